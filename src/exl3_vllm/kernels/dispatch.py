"""The static dispatch: which path, tier and split-k a call of m rows takes (plan), what each tier family can run,
and the switches that turn families off. Pure decisions on shapes and settings: no GPU, no kernels."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from .. import settings
from ..format.codebook import Codebook
from .nvrtc import KernelError
from .variants import INT8_MAX_M, TIERS, WG_ARCH, for_k


def backend() -> str:
    """'auto' (our kernels on CUDA) or 'reference' (the format reference on any device)."""
    return settings.get("EXL3_VLLM_BACKEND")


def deterministic() -> bool:
    return settings.get("EXL3_VLLM_DETERMINISTIC")


FEATURES = ("streamk", "streamk-dp", "pdl")


def _base(name: str) -> str:
    """A tier's family name: its k8 and 128-column n twins go with it (h8k8 -> h8, w64n -> w64)."""
    name = name[:-2] if name.endswith("k8") else name
    return name[:-1] if name.endswith("n") else name


_OFF: dict[str, tuple[frozenset[str], frozenset[str]]] = {}


def _off() -> tuple[frozenset[str], frozenset[str]]:
    """(tier names, features) that EXL3_VLLM_DISABLE leaves out, parsed once per value and process (plan() asks
    often); an item that names no tier and no feature, or a replaced switch set to 0, is refused, not ignored."""
    key = settings.raw("EXL3_VLLM_DISABLE")
    hit = _OFF.get(key)
    if hit is None:
        settings.check_retired()
        items = settings.get("EXL3_VLLM_DISABLE")
        names = {_base(t) for t in TIERS} | set(TIERS)
        bad = sorted(i for i in items if i not in FEATURES and not fnmatch.filter(names, i))
        if bad:
            raise settings.SettingError(f"EXL3_VLLM_DISABLE names {', '.join(bad)}, which is no tier and no feature: "
                                        f"tiers {', '.join(sorted({_base(t) for t in TIERS}))}; features "
                                        f"{', '.join(FEATURES)}")
        tiers = frozenset(t for t in TIERS if any(fnmatch.fnmatch(_base(t), i) or fnmatch.fnmatch(t, i)
                                                  for i in items if i not in FEATURES))
        hit = _OFF[key] = (tiers, frozenset(items & set(FEATURES)))
    return hit


def tier_on(tier) -> bool:
    """Whether EXL3_VLLM_DISABLE leaves tier (a Tier) in the dispatch."""
    return tier.name not in _off()[0]


def feature_on(name: str) -> bool:
    return name not in _off()[1]


def wg_enabled(arch: int) -> bool:
    """The Hopper wgmma tiers: built for sm_90a only; with every w tier disabled the mma.sync tiers run instead."""
    off = _off()[0]
    return arch == WG_ARCH and any(t.wg and not t.ws and t.name not in off for t in TIERS.values())


def ws_enabled(arch: int) -> bool:
    """The warp-specialized Hopper tiers (decode into shared memory), unless every x tier is disabled."""
    off = _off()[0]
    return arch == WG_ARCH and any(t.ws and t.name not in off for t in TIERS.values())


def pdl_enabled(arch: int) -> bool:
    """The GEMM starts loading its weights while the input transform finishes (programmatic dependent launch, sm_90+);
    disabling pdl launches it after the transform as usual."""
    return arch >= 90 and feature_on("pdl")


def fused_input(tier, p: "Plan", m: int, n_total: int, bits: float, sms: int, smem_limit: int) -> bool:
    """h8 / h16 with fixed split-k transform their own rows of x in the prologue instead of after an input-transform
    launch. Every column block repeats that work and a block's loop waits for it, so only where a block's pieces go
    out in one batch of loads ahead of its weights (4 per warp), the repeated work per resident-block slot is small,
    the grid is at most two waves and two blocks still fit an SM. EXL3_VLLM_FUSED_INPUT: that per-slot bound; 0:
    never; "all": wherever x fits (to compare)."""
    env = settings.raw("EXL3_VLLM_FUSED_INPUT")
    if not (tier.xb and not tier.int8 and not p.stream and env != "0"
            and tier.smem_fx(bits, p.steps_per_split) <= smem_limit // 2 - 1024):
        return False
    if env == "all":
        return True
    try:
        bound = float(env)
    except ValueError:
        raise KernelError(f"EXL3_VLLM_FUSED_INPUT={env!r} is not a number of pieces per slot, 0 or 'all'") from None
    slots = 2 * sms
    blocks, pieces = fused_input_work(tier, p, m, n_total)
    return pieces <= 4 * (tier.threads // 32) and blocks * pieces <= bound * slots and blocks <= 2 * slots


def fused_input_work(tier, p: "Plan", m: int, n_total: int) -> tuple[int, int]:
    """(blocks of the grid, (row, 128-k chunk) pieces of x each block transforms) when a plan runs an fx twin."""
    return (n_total // tier.cols) * p.splits * -(-m // tier.bm), min(m, tier.bm) * (p.steps_per_split // 8)


def large_m() -> int:
    """Above this many rows the static plan takes dequantize + cuBLAS; the measured dispatch may still pick a tier."""
    return settings.get("EXL3_VLLM_LARGE_M")


def dequant_bytes() -> int:
    return settings.get("EXL3_VLLM_DEQUANT_BYTES")


def dequant_chunk(k: int, n_total: int) -> int:
    """The large-M path's chunk width: as few chunks as the weight scratch allows, of equal width (a multiple of
    128), so that a layer of two equal shards that does not fit in one chunk is cut at its shard boundary."""
    cols = max(128, (dequant_bytes() // (2 * k)) // 128 * 128)
    chunks = -(-n_total // cols)
    return -(-n_total // (chunks * 128)) * 128


def bits_of(trellis: torch.Tensor) -> float:
    w = trellis.shape[-1]
    if w % 16 == 0 and 1 <= w // 16 <= 8:
        return w // 16
    if w % 16 == 8 and 1 <= w // 16 <= 3:
        return w // 16 + 0.5
    raise KernelError(f"trellis last dimension {w} is not 16*K (K=1..8) or 16*K+8 (K=1.5/2.5/3.5)")


DEQUANT = "dequant"


@dataclass(frozen=True)
class Choice:
    """A path asked for by name (EXL3_VLLM_TIER, a tuned table, a benchmark): a tier of TIERS or DEQUANT, and how it
    splits k. Written as "<tier>", "<tier>:fixed" (fixed split-k where it would run stream-k) or "<tier>:s<N>" (fixed
    split-k over N splits): the environment's and the tune cache's form."""
    tier: str
    fixed: bool = False
    splits: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Choice":
        name, *opts = text.split(":")
        if name != DEQUANT and name not in TIERS:
            raise KernelError(f"EXL3_VLLM_TIER={name!r} is not one of {sorted(TIERS)} or {DEQUANT!r}")
        fixed, splits = False, None
        for o in opts:
            if o == "fixed":
                fixed = True
            elif o[:1] == "s" and o[1:].isdigit() and int(o[1:]) >= 1:
                splits = int(o[1:])
            else:
                raise KernelError(f"tier option ':{o}' is not ':fixed' or ':s<N>' (N >= 1 splits)")
        return cls(name, fixed or splits is not None, splits)

    def __str__(self) -> str:
        return self.tier + (f":s{self.splits}" if self.splits else ":fixed" if self.fixed else "")


@dataclass(frozen=True)
class Plan:
    path: str             # "gemm" or "dequant"
    tier: str = ""
    splits: int = 1
    steps_per_split: int = 0
    chunk: int = 0        # columns per dequant chunk
    stream: int = 0       # >0: stream-k grid size (blocks sharing column-block x stage units evenly)
    dp: int = 0           # stream-k: column blocks run whole first, in full waves of `stream` blocks


# k16 steps one int8-tier segment may sum in int32: |x| <= 127 times a product byte sum <= 1020 per weight, 16384 k.
INT8_SEGMENT_STEPS = 1024


def int8_tier(m: int):
    """The mul1 integer tier for m rows (i4 up to 4 rows, else i8), None if m is over both or they are disabled."""
    off = _off()[0]
    return next((t for t in (TIERS["i4"], TIERS["i8"]) if m <= t.bm and t.name not in off), None)


def int8_ok(m: int, k: int, codebook: int, smem_limit: int) -> bool:
    """The mul1 integer tier: few rows, the row's input transform fits in shared memory, no int32 overflow."""
    return (codebook == Codebook.MUL1 and m <= INT8_MAX_M and 4 * k + 1024 <= smem_limit and k <= 65536
            and int8_tier(m) is not None)


def wg_tier(m: int, bits: float, smem_limit: int, col_align: int):
    """The Hopper tier for m rows: fewest rows that hold m, then the widest block (x is re-read per column block)."""
    off = _off()[0]
    wgs = [t for t in TIERS.values() if t.wg and not t.ws and t.smem(bits) <= smem_limit and col_align % t.cols == 0
           and t.name not in off]
    fit = [t for t in wgs if m <= t.bm]
    return min(fit, key=lambda t: (t.bm, -t.cols)) if fit else max(wgs, key=lambda t: (t.bm, t.cols), default=None)


def ws_tier(m: int, bits: float, smem_limit: int):
    """The warp-specialized Hopper tier for m rows: fewest rows that hold m (more rows run as row blocks)."""
    off = _off()[0]
    fits = sorted((t for t in TIERS.values() if t.ws and t.smem(bits) <= smem_limit and t.name not in off),
                  key=lambda t: t.bm)
    return next((t for t in fits if m <= t.bm), fits[-1]) if fits else None


def mma_tier(m: int, bits: float, smem_limit: int):
    """The mma.sync tier for m rows (any sm_80+), None if every one is disabled."""
    off = _off()[0]
    fits = [t for t in TIERS.values() if not t.int8 and not t.wg and not t.xb and t.smem(bits) <= smem_limit
            and t.name not in off]
    return next((t for t in fits if m <= t.bm), fits[-1] if fits else None)


def plan(m: int, k: int, n_total: int, bits: float, sms: int, smem_limit: int = 227 * 1024, codebook: int = -1,
         arch: int = 0, col_align: int | None = None, force: Choice | str | None = None) -> Plan:
    """How one call runs: tier and split-k factor, or the dequant path with its chunk width (columns of the weight
    reconstructed at a time, across shard boundaries: one GEMM per chunk).

    col_align: the gcd of the shard widths (a block's columns must lie in one shard); default n_total.
    force: the path to take (a Choice or its written form; default: EXL3_VLLM_TIER, else the static choice below).
    """
    col_align = col_align or n_total
    force = settings.get("EXL3_VLLM_TIER") if force is None else force
    if isinstance(force, str):
        force = Choice.parse(force) if force else None
    fixed = force is not None and force.fixed
    fs = settings.get("EXL3_VLLM_SPLITS") if force is None or force.splits is None else str(force.splits)
    if (force is not None and force.tier == DEQUANT) or (force is None and m > large_m()):
        return Plan("dequant", chunk=dequant_chunk(k, n_total))
    if force is not None:
        tier = TIERS[force.tier]
        if tier.int8 and not (codebook == Codebook.MUL1 and m <= tier.bm and 4 * k + 1024 <= smem_limit):
            raise KernelError(f"EXL3_VLLM_TIER={tier.name} needs the mul1 codebook, at most {tier.bm} rows and "
                              f"4*k + 1024 <= {smem_limit} (got codebook {codebook}, m={m}, k={k})")
        if tier.wg and arch != WG_ARCH:
            raise KernelError(f"EXL3_VLLM_TIER={tier.name} needs an sm_{WG_ARCH} GPU (wgmma), this is sm_{arch}")
        if col_align % tier.cols:
            raise KernelError(f"EXL3_VLLM_TIER={tier.name} covers {tier.cols} columns per block; this layer's shards "
                              f"are multiples of {col_align} only (use the 'n' twin, e.g. w64n)")
        if not tier_on(tier):
            raise KernelError(f"EXL3_VLLM_TIER={tier.name} is a tier that EXL3_VLLM_DISABLE leaves out")
    elif int8_ok(m, k, codebook, smem_limit):
        tier = int8_tier(m)
    elif m <= TIERS["h8"].bm and TIERS["h8"].smem(bits) <= smem_limit and tier_on(TIERS["h8"]):
        tier = TIERS["h8"]
    else:
        tier = (wg_tier(m, bits, smem_limit, col_align) if arch == WG_ARCH else None) or mma_tier(m, bits, smem_limit)
    if tier is None:  # every tier that could run here is disabled: the dequant path runs any shape
        return Plan("dequant", chunk=dequant_chunk(k, n_total))
    tier = for_k(tier, k)
    mblocks = -(-m // tier.bm)
    ktiles = k // 16
    base = (n_total // tier.cols) * mblocks
    slots = sms * (2 if tier.threads <= 256 else 1)
    # Just enough splits to fill the resident-block slots once; more splits measured slower (atomics, A re-reads).
    splits = max(1, min(-(-slots // base), ktiles // tier.ks))
    if fs is not None:
        splits = max(1, min(int(fs), ktiles // tier.ks))
    if tier.int8:
        splits = max(splits, -(-ktiles // INT8_SEGMENT_STEPS))
    steps = -(-ktiles // splits)
    steps = -(-steps // tier.ks) * tier.ks
    splits = -(-ktiles // steps)
    blocks = base * splits
    fill = blocks / (-(-blocks // slots) * slots)
    if (tier.stream and fill < 0.9 and fs is None and not fixed and not deterministic()
            and feature_on("streamk")):
        # A partial last wave (224 column blocks x 2 splits on 264 slots: 85%) idles SMs; stream-k gives every
        # resident block the same number of (column block, stage) units instead.
        units = (n_total // tier.cols) * (ktiles // tier.ks)
        stream = max(1, min(slots // mblocks, units))
        if tier.int8:  # a block's units of one column block are one segment: keep them within the int32 bound
            stream = max(stream, -(-units * tier.ks // INT8_SEGMENT_STEPS))
        # Whole waves of column blocks need no partial sums; only the last partial wave is shared out as units.
        dp = 0
        if feature_on("streamk-dp") and (not tier.int8 or ktiles <= INT8_SEGMENT_STEPS):
            dp = (n_total // tier.cols) // stream * stream
        return Plan("gemm", tier.name, splits, steps, stream=stream, dp=dp)
    return Plan("gemm", tier.name, splits, steps)


def passed_over(m: int, k: int, bits: float, codebook: int, arch: int, smem: int) -> list[str]:
    """Why each path plan() ranks before the one it takes was passed over at m rows, in plan()'s order (dequantize +
    cuBLAS above the large-M bound, else the mul1 int8 tiers, h8, the Hopper tiers, the mma.sync tiers): keep the
    two in step."""
    why = []
    if m > large_m():
        return [f"m > {large_m()} (EXL3_VLLM_LARGE_M): dequantize + cuBLAS"]
    if not int8_ok(m, k, codebook, smem):
        reason = (f"codebook {Codebook(codebook).label}, the int8 tiers are mul1 only" if codebook != Codebook.MUL1 else
                  f"m > {INT8_MAX_M}" if m > INT8_MAX_M else
                  "disabled (EXL3_VLLM_DISABLE)" if int8_tier(m) is None else f"k={k}: x does not fit shared memory")
        why.append(f"i4/i8: {reason}")
    else:
        return why
    if m > TIERS["h8"].bm:
        why.append(f"h8: m > {TIERS['h8'].bm}")
    elif TIERS["h8"].smem(bits) > smem:
        why.append("h8: over the shared memory limit")
    elif not tier_on(TIERS["h8"]):
        why.append("h8: disabled (EXL3_VLLM_DISABLE)")
    else:
        return why
    if arch != WG_ARCH:
        why.append(f"wgmma: sm_{arch} is not sm_90")
    elif not wg_enabled(arch):
        why.append("wgmma: disabled (EXL3_VLLM_DISABLE)")
    return why


def switched_on(choice: Choice, arch: int) -> bool:
    """Whether EXL3_VLLM_DISABLE and the GPU allow a measured choice."""
    tier = TIERS.get(choice.tier)
    if tier is None:
        return True
    return tier_on(tier) and (not tier.wg or arch == WG_ARCH)
