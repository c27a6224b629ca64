"""The kernel variants: one module per (K, codebook) plus the shared input/reduction module."""

from __future__ import annotations

from dataclasses import dataclass

from .. import settings
from ..format.codebook import Codebook


def _label(codebook: int) -> str:
    return Codebook(codebook).label if codebook in set(Codebook) else repr(codebook)

IO_SOURCE = "exl3_io.cu"
LINEAR_SOURCE = "exl3_linear.cu"
MOE_SOURCE = "exl3_moe.cu"

INTEGER_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_BITS = (1.5, 2.5, 3.5)
OUT_DTYPES = ("f16", "bf16")


@dataclass(frozen=True)
class Tier:
    name: str
    bm: int      # rows of x per block
    nt: int      # 16-column tiles per warp (the block owns 128 columns)
    kw: int      # warps splitting the k16 steps of a stage
    ks: int      # k16 steps per pipeline stage
    stages: int  # cp.async pipeline depth
    int8: bool = False  # mul1 only: int8 activations (hi + lo rows) against the product bytes
    wg: int = 0         # sm_90a only: warpgroups per block (64 columns each), decoded weights as wgmma A fragments
    stream: bool = False  # has a stream-k twin ("<name>s" kernels)
    ws: int = 0         # sm_90a warp-specialized: producer warpgroups decoding into shared memory (wg=2 consumers)
    xb: bool = False    # x as the MMA's B operand (rows as its n), the weights as A: dense layers only
    preg: int = 0       # ws only: registers each producer thread keeps (setmaxnreg), the rest go to the consumers

    @property
    def threads(self) -> int:
        return 128 * (self.wg + self.ws) if self.wg else 32 * (8 // self.nt) * self.kw

    @property
    def experts(self) -> bool:
        """The grouped-experts kernels can run it (mma.sync with x as the A operand, int8 or fp16)."""
        return not self.wg and not self.xb

    @property
    def cols(self) -> int:
        """Output columns per block (the grid's x is n / cols)."""
        return 64 * self.wg if self.wg else 128

    def smem(self, bits: float) -> int:
        w32 = 8 * int(bits) + (4 if bits != int(bits) else 0)
        if self.ws:  # x, decoded A (4 KB per k16 step) and trellis stages, a 64-row reduction tile, alignment
            return 1024 + self.stages * self.ks * (self.bm * 32 + 4096 + 32 * w32) + 64 * 132 * 4
        if self.wg:  # x stages (32 bytes per row and k16 step), trellis stages, 1024 bytes of alignment
            return 1024 + max(self.stages * self.ks * (4 * self.wg * w32 * 4 + self.bm * 32), self.bm * 132 * 4)
        a_stage = self.ks * 256 if self.int8 else self.bm * (self.ks * 16 + 8) * 2
        stage = self.ks * 8 * w32 * 4 + a_stage
        return max(self.stages * stage, self.red_bytes)

    @property
    def red_bytes(self) -> int:
        """The fp32 reduction tile of 128 padded columns: one per k-warp for h8 / h16 / i4 / i8 (each sums its own
        slice)."""
        return self.bm * 132 * 4 * (self.kw if self.xb or self.int8 else 1)

    def smem_fx(self, bits: float, steps: int) -> int:
        """The "fx" twin of h8 / h16: trellis stages, then the block's rows of x over its steps k16 steps."""
        w32 = 8 * int(bits) + (4 if bits != int(bits) else 0)
        return max(self.stages * self.ks * 8 * w32 * 4 + self.bm * (steps * 16 + 8) * 2, self.red_bytes)


# The single list of tiers: tier_instantiations() turns it into exl3_linear.cu's kernel entry points.
TIERS = {t.name: t for t in (
    Tier("m16", 16, 8, 8, 8, 4),
    Tier("m32", 32, 4, 4, 8, 4),
    Tier("m64", 64, 2, 4, 8, 3),
    Tier("m128", 128, 1, 2, 4, 3),
    # int8 activations against the mul1 product bytes: i8 = up to 8 rows (hi and lo parts as the 16 MMA rows), i4 = up
    # to 4 rows with the weights as the MMA's A operand (16 columns per MMA instead of 8: half the MMAs per tile).
    Tier("i8", 8, 4, 4, 16, 2, int8=True, stream=True),
    Tier("i4", 4, 4, 4, 16, 2, int8=True, stream=True, xb=True),
    # h8 / h16: each 8 rows of x as the MMA's n against 16 weight columns as its A operand (per 8 rows and tile one
    # MMA for mul1, two for 3inst / mcg whose weight halves the MMA adds: no fp16 packing in the decode).
    Tier("h8", 8, 4, 4, 16, 2, stream=True, xb=True),
    Tier("h16", 16, 4, 4, 16, 2, stream=True, xb=True),
    # 8-step-stage twins of the four above for k that is not a multiple of 256 (for_k)
    Tier("i8k8", 8, 4, 4, 8, 4, int8=True, stream=True),
    Tier("i4k8", 4, 4, 4, 8, 4, int8=True, stream=True, xb=True),
    Tier("h8k8", 8, 4, 4, 8, 4, stream=True, xb=True),
    Tier("h16k8", 16, 4, 4, 8, 4, stream=True, xb=True),
    Tier("w16", 16, 1, 1, 8, 4, wg=2),
    Tier("w32", 32, 1, 1, 8, 4, wg=2, stream=True),
    Tier("w64", 64, 1, 1, 8, 4, wg=4, stream=True),
    Tier("w128", 128, 1, 1, 4, 4, wg=4),
    # 128-column twins for layers whose shards are not multiples of 256 columns
    Tier("w64n", 64, 1, 1, 4, 4, wg=2, stream=True),
    Tier("w128n", 128, 1, 1, 4, 4, wg=2),
    Tier("x64", 64, 1, 1, 8, 3, wg=2, ws=2, stream=True),
    Tier("x128", 128, 1, 1, 4, 4, wg=2, ws=2, stream=True),
    # x256's producers keep 80 registers so the consumers' 176 hold the accumulators and a stage's A fragments.
    Tier("x256", 256, 1, 1, 4, 3, wg=2, ws=2, stream=True, preg=80),
)}


def _instantiation(t: Tier) -> list[str]:
    """The macro lines of exl3_linear.cu that build tier t's kernels (each macro makes the f16 and bf16 pair)."""
    if t.ws:
        return [f"EXL3_WS_TIER({t.name}, {t.bm}, {t.ws}, {t.ks}, {t.stages}, {t.preg})"]
    if t.wg:
        return [f"EXL3_WG_{m}({t.name}, {t.bm}, {t.wg}, {t.ks}, {t.stages})"
                for m in ("TIER", "STREAM") if m == "TIER" or t.stream]
    if t.int8 or t.xb:  # the few-row family: MODE 1 int8, 2 int8 with x as B, 3 fp16 with x as B; all stream
        mode = 2 if t.int8 and t.xb else 1 if t.int8 else 3
        # int8 kernels always fill the MMA's 16 rows with 8 rows' hi and lo parts; i4's bm is its dispatch bound.
        lines = [f"EXL3_FEW_TIER({t.name}, {8 if t.int8 else t.bm}, {mode}, {t.ks}, {t.stages})"]
        return lines + ([] if t.int8 else [f"EXL3_FX_TIER({t.name}, {t.bm}, {t.ks}, {t.stages})"])
    return [f"EXL3_TIER({t.name}, {t.bm}, {t.nt}, {t.kw}, {t.ks}, {t.stages})"]


def tier_instantiations() -> str:
    """exl3_tiers.cuh, made from TIERS: every tier's kernels; int8 ones only in mul1 modules (EXL3_CB 2), wgmma and
    warp-specialised ones only in sm_90a builds (EXL3_WGMMA)."""
    for t in TIERS.values():  # the few-row and warp-specialised macros always build a stream-k twin, the m tiers never
        if t.stream != bool(t.ws or t.int8 or t.xb or (t.wg and t.stream)):
            raise ValueError(f"tier {t.name}: stream={t.stream} does not match what its kernel family builds")
    def lines(pick):
        return [line for t in TIERS.values() if pick(t) for line in _instantiation(t)]
    out = ["// Generated by exl3_vllm.kernels.variants.tier_instantiations() from TIERS; not a file on disk."]
    out += lines(lambda t: not t.wg and not t.int8)
    out += ["#if EXL3_CB == 2", *lines(lambda t: t.int8), "#endif"]
    out += ["#ifdef EXL3_WGMMA", *lines(lambda t: t.wg), "#endif", ""]
    return "\n".join(out)


def whole_stages(tier: Tier, *steps: int) -> bool:
    """Every count of k16 steps (a layer's k / 16, a split's steps) is whole stages of tier: the kernels run whole
    stages, so a partial one would drop its steps."""
    return all(s % tier.ks == 0 for s in steps)


def for_k(tier: Tier, k: int) -> Tier:
    """tier, or its "k8" twin where k / 16 is not a whole number of tier's stages."""
    return tier if whole_stages(tier, k // 16) else TIERS[tier.name + "k8"]


# The only arch whose build has the wg tiers (wgmma is Hopper's; NVRTC targets sm_90a there).
WG_ARCH = 90
# Dynamic shared memory of the large-M weight reconstruction (exl3_recon_*): two buffers of a unit's 64 tiles of packed
# fp16 fragments (16 bytes per lane).
RECON_SMEM = 2 * 64 * 32 * 16
# Rows the int8 tier takes at most (hi and lo parts fill the 16 MMA rows).
INT8_MAX_M = 8


def all_bits() -> tuple:
    return INTEGER_BITS + HALF_BITS


def valid(bits: float, codebook: int) -> bool:
    if bits in HALF_BITS:
        return codebook == Codebook.MUL1
    return bits in INTEGER_BITS and codebook in set(Codebook)


def linear_defines(bits: float, codebook: int) -> dict:
    if not valid(bits, codebook):
        raise ValueError(f"no EXL3 kernel for K={bits} with codebook {_label(codebook)}: "
                         "half-integer K exists only for mul1, K must be 1..8 or 1.5/2.5/3.5")
    d = {"EXL3_KA": int(bits), "EXL3_HALF": int(bits != int(bits)), "EXL3_CB": int(codebook)}
    # Development A/B of compile-time kernel variants in one process: "NAME=1,OTHER=2" (its own cache key).
    extra = settings.get("EXL3_VLLM_EXTRA_DEFINES")
    for item in filter(None, (s.strip() for s in extra.split(","))):
        name, _, value = item.partition("=")
        d[name.strip()] = int(value or 1)
    return d


def all_modules() -> list[tuple[str, dict]]:
    """Every (source, defines) pair the package can load."""
    mods = [(IO_SOURCE, {}), (MOE_SOURCE, {})]
    for bits in all_bits():
        for cb in Codebook:
            if valid(bits, cb):
                mods.append((LINEAR_SOURCE, linear_defines(bits, cb)))
    return mods


def gemm_kernel_name(tier: str, out_bf16: bool) -> str:
    return f"exl3_gemm_{tier}_{'bf16' if out_bf16 else 'f16'}"
