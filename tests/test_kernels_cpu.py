"""CPU-side checks of the kernels package: NVRTC compile (no GPU needed), the fake impl, the CPU op."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from exl3_vllm import settings
from exl3_vllm.format.linear import linear as ref_linear
from exl3_vllm.kernels import dispatch
from exl3_vllm.kernels import op as kop  # noqa: F401  (registers torch.ops.exl3.linear)
from exl3_vllm.kernels.nvrtc import parse_ptxas_log
from exl3_vllm.kernels.variants import TIERS, all_modules

_HAVE_NVRTC = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


def S(choices):
    """Choices in their written form (what EXL3_VLLM_TIER and the tune cache hold), for comparing with literals."""
    return [str(c) for c in choices]


def C(written):
    """Choices from their written form: a list, or the values of a dict (keys kept)."""
    if isinstance(written, dict):
        return {k: dispatch.Choice.parse(v) for k, v in written.items()}
    return [dispatch.Choice.parse(v) for v in written]


def _layer(k, n, bits, shards=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, w), dtype=torch.int16, generator=g)
    sign = lambda *s: torch.where(torch.rand(*s, generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    suh = (sign(shards, k) * (0.5 + torch.rand(shards, k, generator=g)) * 0.05).half()
    svh = (sign(n) * (0.5 + torch.rand(n, generator=g)) * 0.05).half()
    return trellis, suh, svh


@pytest.mark.skipif(not _HAVE_NVRTC, reason="cuda-bindings / nvidia-cuda-nvrtc not installed (pip install cuda-bindings nvidia-cuda-nvrtc)")
def test_compile_sm90_no_spills(nvrtc_cache, progress, monkeypatch):
    """Every variant (or the CI subset when EXL3_VLLM_CI_FULL is unset) compiles for sm_90 without spills."""
    import os

    from exl3_vllm.kernels.cli import run_compile
    try:
        from cuda.bindings import nvrtc  # noqa: F401
        from exl3_vllm.kernels.nvrtc import nvrtc_version
        nvrtc_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC not usable here: {e}")
    monkeypatch.setenv("EXL3_VLLM_CACHE_DIR", nvrtc_cache)
    import io
    buf = io.StringIO()
    full = os.environ.get("EXL3_VLLM_CI_FULL", "") not in ("", "0")
    rc = run_compile([90], jobs=os.cpu_count() or 1, subset=not full, out=buf, progress=progress)
    print(buf.getvalue())
    assert rc == 0, buf.getvalue()
    assert "exl3_gemm_m16_f16" in buf.getvalue()


@pytest.mark.skipif(not _HAVE_NVRTC, reason="cuda-bindings / nvidia-cuda-nvrtc not installed (pip install cuda-bindings nvidia-cuda-nvrtc)")
def test_overlap_probe_compiles(tmp_path, monkeypatch):
    """The benchmark's overlap probe (bench/experiments/probe_overlap.cu, built on the package headers) compiles for sm_90a through
    compile_source(text=...) into its own cache entry, with every probe kernel and no spills."""
    import os
    import sys

    try:
        from exl3_vllm.kernels.nvrtc import nvrtc_version
        nvrtc_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC not usable here: {e}")
    monkeypatch.setenv("EXL3_VLLM_CACHE_DIR", str(tmp_path))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "experiments"))
    try:
        from probe_overlap import compile_probe
    finally:
        sys.path.pop(0)
    c = compile_probe(4, 2)
    info = {k.name: k for k in c.kernels()}
    assert set(info) == {"probe_rs64", "probe_rs128", "probe_ss64", "probe_ss128", "probe_ss256"}, c.log
    assert all(k.spill_stores + k.spill_loads == 0 for k in info.values()), c.log
    assert not c.cached and compile_probe(4, 2).cached  # keyed by the text: the second call reads the cache
    assert len(list((tmp_path / "kernels").glob("probe_overlap-sm90-*.cubin"))) == 1


def test_ptxas_log_parser():
    log = """ptxas info    : Function properties for exl3_gemm_m16_f16
ptxas         .     0 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 126 registers, used 1 barriers, 16 bytes smem
"""
    (k,) = parse_ptxas_log(log)
    assert (k.name, k.registers, k.smem_static, k.spill_stores, k.spill_loads) == ("exl3_gemm_m16_f16", 126, 16, 4, 8)


def test_variant_list():
    mods = all_modules()
    assert len(mods) == 2 + 8 * 3 + 3  # io, moe, then one linear module per (K, codebook)
    for t in TIERS.values():
        assert t.smem(8) <= 227 * 1024
        assert t.threads % 32 == 0 and t.ks % t.kw == 0


def test_plan_shapes():
    p = kop.plan(1, 4096, 4096, 4, 132)
    assert p.path == "gemm" and p.tier == "h8" and p.splits > 1
    assert p.splits * p.steps_per_split >= 4096 // 16
    p = kop.plan(9, 4096, 4096, 4, 132)
    assert p.path == "gemm" and p.tier == "m16" and p.splits > 1
    assert kop.plan(100, 4096, 4096, 4, 132).tier == "m128"
    assert kop.plan(129, 4096, 4096, 4, 132).path == "dequant"
    assert kop.plan(4096, 4096, 4096, 4, 132).path == "dequant"


def test_whole_stages_for_k():
    """The 16-step-stage tiers run where k is a multiple of 256, their 8-step "k8" twins elsewhere, whether the plan
    is static, forced or for the experts; split-k stays in whole stages."""
    from exl3_vllm.kernels import moe as kmoe
    for m, k, cb, want in ((1, 4096, 1, "h8"), (1, 640, 1, "h8k8"), (12, 1152, 1, "h16k8"), (1, 4096, 2, "i4"),
                           (3, 1408, 2, "i4k8"), (8, 896, 2, "i8k8")):
        p = kop.plan(m, k, 2048, 4, 132, codebook=cb, force="h16" if want.startswith("h16") else None)
        assert p.tier == want, (m, k, p)
        t = TIERS[p.tier]
        assert p.steps_per_split % t.ks == 0 and (k // 16) % t.ks == 0
        assert p.splits * p.steps_per_split >= k // 16
    assert kop.plan(1, 640, 2048, 4, 132, force="h8:s2").tier == "h8k8"
    assert kop.plan(1, 4096, 2048, 4, 132, force="h8k8:s2").tier == "h8k8"
    assert kmoe.moe_plan(4, 8, 128, 2048, 1536, 768, 2048, [4], [2], 132).tier == "i8"
    assert kmoe.moe_plan(4, 8, 64, 2048, 2816, 1408, 2048, [4], [2], 132).tier == "i8k8"


def test_fused_input_choice(monkeypatch):
    """h8 / h16 with fixed split-k transform their own x when a block's pieces of x fit one batch of early loads (4 per
    warp), the repeated work per resident-block slot is small, the grid is at most two waves and two blocks still fit
    an SM; never stream-k or the int8 tiers; EXL3_VLLM_FUSED_INPUT=0: never, =all: wherever x fits."""
    h8, h16 = TIERS["h8"], TIERS["h16"]
    lim = 227 * 1024

    def fx(tier, m, k, n, force, smem=lim):
        return kop.fused_input(TIERS[tier], kop.plan(m, k, n, 4, 132, codebook=2, force=force), m, n, 4, 132, smem)
    assert fx("h8", 1, 4096, 4096, "h8:s8")            # 256 blocks x 4 pieces: 3.9 per slot
    assert fx("h8", 1, 4096, 4096, "h8:s16")           # 512 blocks: two waves
    assert not fx("h8k8", 1, 4096, 4096, "h8k8:s32")   # four waves (h8 itself stops at 16 splits of k=4096)
    assert fx("h8", 8, 4096, 4096, "h8:s8")            # 32 pieces per block, 31 per slot
    assert not fx("h8", 8, 4096, 4096, "h8:s4")        # 64 pieces per block: two batches of loads
    assert not fx("h16", 16, 4096, 4096, "h16:s8")
    assert fx("h16", 9, 4096, 1024, "h16:s16")         # 18 pieces per block, 8.7 per slot
    assert fx("h8", 1, 14336, 4096, "h8:s4")           # 28 stages, 13.6 per slot
    assert not fx("h8", 4, 14336, 4096, "h8:s16")      # 54 per slot
    assert fx("h8", 1, 4096, 14336, "h8:s1")           # 112 blocks x 32 stages
    assert not fx("h8", 1, 8192, 28672, "h8:s4")       # four waves
    assert not fx("h8", 1, 8192, 4096, "h8:s1")        # 64 stages of x: one block per SM
    assert not fx("h8", 1, 4096, 4096, "h8:s8", 64 * 1024)
    assert not fx("i4", 1, 4096, 4096, "i4:s8")
    streamed = kop.plan(8, 4096, 28672, 4, 132, force="h8")
    assert streamed.stream and not kop.fused_input(h8, streamed, 8, 28672, 4, 132, lim)
    monkeypatch.setenv("EXL3_VLLM_FUSED_INPUT", "0")
    assert not fx("h8", 1, 4096, 4096, "h8:s8")
    monkeypatch.setenv("EXL3_VLLM_FUSED_INPUT", "lots")
    with pytest.raises(kop.KernelError, match="EXL3_VLLM_FUSED_INPUT='lots'"):
        fx("h8", 1, 4096, 4096, "h8:s8")
    monkeypatch.setenv("EXL3_VLLM_FUSED_INPUT", "all")
    assert fx("h16", 16, 4096, 4096, "h16:s8") and fx("h8", 1, 4096, 4096, "h8:s32")
    assert not fx("h8", 1, 8192, 4096, "h8:s1") and not kop.fused_input(h8, streamed, 8, 28672, 4, 132, lim)
    assert h8.smem_fx(4, 32) == 4 * 8 * 8 * 32 * 4 + 8 * (32 * 16 + 8) * 2
    assert h16.smem_fx(4, 8) == 4 * 8 * 8 * 32 * 4 + 16 * (8 * 16 + 8) * 2


def test_large_m_path_workspace():
    """The large-M path reserves only its weight scratch (no activation buffers)."""
    p = kop.plan(4096, 8192, 28672, 4, 132)
    cols = settings.get('EXL3_VLLM_DEQUANT_BYTES') // (2 * 8192)  # 8192 columns fit the scratch: 4 chunks of 7168
    assert p.path == "dequant" and p.chunk == 7168 <= cols
    assert kop._needs(p, 4096, 8192, 28672, 1) == {"wscratch": 8192 * p.chunk}
    assert kop.plan(4096, 4096, 28672, 4, 132).chunk == 14336  # gate|up of 14336 each: cut at the shard boundary
    assert kop.plan(4096, 4096, 6144, 4, 132).chunk == 6144  # q|k|v in one chunk


def test_plan_int8_tier(monkeypatch):
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2).tier == "i4"
    assert kop.plan(4, 4096, 4096, 4, 132, codebook=2).tier == "i4"
    assert kop.plan(5, 4096, 4096, 4, 132, codebook=2).tier == "i8"
    assert kop.plan(8, 4096, 4096, 2.5, 132, codebook=2).tier == "i8"
    assert kop.plan(9, 4096, 4096, 4, 132, codebook=2).tier == "m16"
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=1).tier == "h8"
    assert kop.plan(8, 4096, 4096, 4, 132, codebook=0).tier == "h8"
    assert kop.plan(1, 65536 + 256, 4096, 4, 132, codebook=2, smem_limit=1 << 20).tier == "h8"
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "i4,i8")
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2).tier == "h8"
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "i4")
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2).tier == "i8"
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "i*, h8")
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2).tier == "m16"
    monkeypatch.delenv("EXL3_VLLM_DISABLE")
    monkeypatch.setenv("EXL3_VLLM_TIER", "i8")
    with pytest.raises(kop.KernelError, match="mul1"):
        kop.plan(1, 4096, 4096, 4, 132, codebook=1)
    monkeypatch.setenv("EXL3_VLLM_TIER", "i4")
    with pytest.raises(kop.KernelError, match="at most 4 rows"):
        kop.plan(5, 4096, 4096, 4, 132, codebook=2)


def test_plan_int8_segments_within_int32(monkeypatch):
    """An int8-tier segment sums at most 16384 k in int32 (127 x 1020 per weight cannot overflow), fixed or stream-k."""
    for k, n, force_splits in ((28672, 8192, None), (32768, 65536, None), (32768, 4096, "1"), (28672, 28672, None)):
        if force_splits:
            monkeypatch.setenv("EXL3_VLLM_SPLITS", force_splits)
        for m in (1, 4, 8):
            p = kop.plan(m, k, n, 4, 132, codebook=2)
            assert p.tier in ("i4", "i8")
            if p.stream:
                units = (n // 128) * (k // 16 // 8)
                assert -(-units // p.stream) * 8 <= dispatch.INT8_SEGMENT_STEPS, (k, n, m, p)
            else:
                assert p.steps_per_split <= dispatch.INT8_SEGMENT_STEPS, (k, n, m, p)
        monkeypatch.delenv("EXL3_VLLM_SPLITS", raising=False)


def test_extra_defines_env(monkeypatch):
    """EXL3_VLLM_EXTRA_DEFINES adds compile-time defines (own module and cache key) for A/B runs of kernel variants."""
    from exl3_vllm.kernels.variants import linear_defines
    assert linear_defines(4, 2) == {"EXL3_KA": 4, "EXL3_HALF": 0, "EXL3_CB": 2}
    monkeypatch.setenv("EXL3_VLLM_EXTRA_DEFINES", "EXL3_A, EXL3_B=3")
    assert linear_defines(4, 2) == {"EXL3_KA": 4, "EXL3_HALF": 0, "EXL3_CB": 2, "EXL3_A": 1, "EXL3_B": 3}


def test_plan_fixed_suffix(monkeypatch):
    """'<tier>:fixed' keeps fixed split-k where the tier would run stream-k (the dispatch times both)."""
    from types import SimpleNamespace
    from exl3_vllm.kernels import tune
    p = kop.plan(128, 8192, 28672, 4, 132, codebook=2, arch=90, force="x64")
    assert p.tier == "x64" and p.stream > 0
    q = kop.plan(128, 8192, 28672, 4, 132, codebook=2, arch=90, force="x64:fixed")
    assert q.tier == "x64" and q.stream == 0 and q.splits >= 1
    hopper = SimpleNamespace(arch=90, smem_limit=227 * 1024, sms=132)
    assert S(tune.with_fixed(hopper, C(["x64", "w128", "dequant"]), 128, 8192, 28672, 4, 2, [28672])) == \
        ["x64", "x64:fixed", "w128", "dequant"]
    with pytest.raises(kop.KernelError, match="not one of"):
        kop.plan(1, 4096, 4096, 4, 132, force="x99:fixed")


def test_plan_streamk_whole_waves(monkeypatch):
    """Stream-k runs full waves of whole column blocks first and shares out only the rest (224 column blocks on 132
    blocks: one whole wave, 92 column blocks as units); none when the layer is narrower than a wave, when
    streamk-dp is disabled, or for an int8 tier whose whole column block would pass the int32 bound."""
    p = kop.plan(256, 8192, 28672, 4, 132, codebook=2, arch=90, force="x256")
    assert (p.stream, p.dp) == (132, 132)
    q = kop.plan(512, 8192, 28672, 4, 132, codebook=2, arch=90, force="x256")
    assert (q.stream, q.dp) == (66, 198)
    assert kop.plan(256, 4096, 4096, 4, 132, codebook=2, arch=90, force="x256").dp == 0
    r = kop.plan(1, 32768, 28672, 4, 66, codebook=2, arch=90, force="i8")
    assert r.stream and r.dp == 0
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "streamk-dp")
    assert kop.plan(256, 8192, 28672, 4, 132, codebook=2, arch=90, force="x256").dp == 0
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "streamk")
    assert kop.plan(256, 8192, 28672, 4, 132, codebook=2, arch=90, force="x256").stream == 0


def test_choice_written_form_round_trips():
    """A Choice reads and writes the form EXL3_VLLM_TIER and the tune cache hold; ':s<N>' implies fixed split-k."""
    Choice = dispatch.Choice
    for text, want in (("x64", Choice("x64")), ("x64:fixed", Choice("x64", True)), ("w16:s16", Choice("w16", True, 16)),
                       ("dequant", Choice("dequant"))):
        assert Choice.parse(text) == want and str(want) == text
    assert Choice.parse("h8:fixed:s4") == Choice("h8", True, 4)
    with pytest.raises(kop.KernelError, match="not one of"):
        Choice.parse("zz")
    # A plan forced by a Choice equals the plan forced by its written form.
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=1, arch=90, force=Choice("w16", True, 16)) == \
        kop.plan(1, 4096, 4096, 4, 132, codebook=1, arch=90, force="w16:s16")


def test_tier_table_refuses_a_stream_flag_its_kernels_do_not_build(monkeypatch):
    """The few-row and warp-specialised macros always build a stream-k twin and the mma.sync ones never do: a table
    entry that says otherwise would dispatch a kernel that does not exist (or miss one that does)."""
    import dataclasses

    from exl3_vllm.kernels import variants
    monkeypatch.setitem(variants.TIERS, "m16", dataclasses.replace(variants.TIERS["m16"], stream=True))
    with pytest.raises(ValueError, match="m16"):
        variants.tier_instantiations()
    monkeypatch.setitem(variants.TIERS, "m16", dataclasses.replace(variants.TIERS["m16"], stream=False))
    monkeypatch.setitem(variants.TIERS, "h8", dataclasses.replace(variants.TIERS["h8"], stream=False))
    with pytest.raises(ValueError, match="h8"):
        variants.tier_instantiations()


def test_plan_split_suffix_and_split_candidates():
    """'<tier>:s<N>' runs fixed split-k over N splits; the dispatch times its two best tiers at half and twice their
    static factor and at the factors that fill whole waves."""
    from types import SimpleNamespace
    from exl3_vllm.kernels import tune
    base = kop.plan(1, 4096, 4096, 4, 132, codebook=1, arch=90, force="w16")
    assert base.tier == "w16" and base.splits == 8 and base.stream == 0
    p = kop.plan(1, 4096, 4096, 4, 132, codebook=1, arch=90, force="w16:s16")
    assert (p.tier, p.splits, p.stream, p.steps_per_split) == ("w16", 16, 0, 16)
    q = kop.plan(128, 8192, 28672, 4, 132, codebook=2, arch=90, force="x64:s3")
    assert q.tier == "x64" and q.splits == 3 and q.stream == 0
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=1, arch=90, force="w16:s999").splits == 4096 // 16 // 8
    for bad in ("w16:s0", "w16:sx", "w16:fast"):
        with pytest.raises(kop.KernelError, match="':fixed' or ':s<N>'"):
            kop.plan(1, 4096, 4096, 4, 132, codebook=1, arch=90, force=bad)
    hopper = SimpleNamespace(arch=90, smem_limit=227 * 1024, sms=132)
    # half, twice, then whole waves of 132 / 264 / 396 / 528 blocks over 32 column blocks (w16:s12 runs 11 splits of
    # 3 stages; h8's waves round to the factors already listed)
    assert S(tune.with_splits(hopper, C(["w16", "h8:fixed", "dequant"]), 1, 4096, 4096, 4, 1, [4096])) == \
        ["w16:s4", "w16:s16", "w16:s11", "h8:s4", "h8:s16"]
    # 64 column blocks: 2 and 4 whole waves of one block per SM are 4 and 8 splits (the static plan takes 5)
    assert kop.plan(1, 28672, 8192, 4, 132, codebook=2, arch=90, force="h8:fixed").splits == 5
    assert S(tune.with_splits(hopper, C(["h8"]), 1, 28672, 8192, 4, 2, [8192])) == ["h8:s2", "h8:s10", "h8:s4", "h8:s6",
                                                                               "h8:s8"]
    # capped at one k16 stage per split, and never below one split
    assert kop.plan(64, 512, 4096, 4, 132, arch=90, force="x64:fixed").splits == 4
    assert S(tune.with_splits(hopper, C(["x64"]), 64, 512, 4096, 4, 1, [4096])) == ["x64:s2"]
    # the two fastest distinct tiers: a tier's ':fixed' twin and dequant do not take the second place
    times = dict(zip(C(["x128", "x128:fixed", "dequant", "x256:fixed", "x256"]), (94.5, 96.0, 99.0, 101.0, 110.0)))
    assert S(tune.fastest_tiers(times)) == ["x128", "x256:fixed"]
    assert "x256:s1" in S(tune.with_splits(hopper, tune.fastest_tiers(times), 256, 4096, 14336, 4, 2, [14336]))


def test_candidates_take_the_128_column_twin():
    """Where the Hopper tier for m rows is a 256-column one (w64, w128), the dispatch also times its 128-column twin;
    the 128-column tiers have none, and a layer whose shards are 128-column multiples only gets the twin itself."""
    from types import SimpleNamespace
    from exl3_vllm.kernels import tune
    hopper = SimpleNamespace(arch=90, smem_limit=227 * 1024, sms=132)
    c64 = S(tune.candidates(hopper, 64, 4096, 4, 2, 4096))
    assert "w64" in c64 and "w64n" in c64
    c128 = S(tune.candidates(hopper, 128, 4096, 4, 2, 4096))
    assert "w128" in c128 and "w128n" in c128
    assert "w32" in S(tune.candidates(hopper, 32, 4096, 4, 2, 4096))
    narrow = S(tune.candidates(hopper, 64, 4096, 4, 2, 384))
    assert "w64n" in narrow and "w64" not in narrow
    assert not any(c.startswith("w") for c in S(tune.candidates(SimpleNamespace(arch=89, smem_limit=99 * 1024, sms=128),
                                                             64, 4096, 4, 2, 4096)))


def test_plan_wg_tiers(monkeypatch):
    """On sm_90 the wgmma tiers take 9..LARGE_M rows; other archs keep the mma.sync tiers; forcing checks the arch."""
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2, arch=90).tier == "i4"
    assert kop.plan(9, 4096, 4096, 4, 132, codebook=2, arch=90).tier == "w16"
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=1, arch=90).tier == "h8"
    assert kop.plan(33, 4096, 4096, 4, 132, arch=90).tier == "w64"
    assert kop.plan(33, 4096, 4096 + 128, 4, 132, arch=90).tier == "w64n"
    assert kop.plan(33, 4096, 4096, 4, 132, arch=90, col_align=128).tier == "w64n"
    assert kop.plan(100, 4096, 4096, 4, 132, arch=90).tier == "w128"
    assert kop.plan(100, 4096, 1152, 4, 132, arch=90).tier == "w128n"
    assert kop.plan(500, 4096, 4096, 4, 132, arch=90, force="w128").tier == "w128"
    assert kop.plan(settings.get('EXL3_VLLM_LARGE_M') + 1, 4096, 4096, 4, 132, arch=90).path == "dequant"
    assert kop.plan(33, 4096, 4096, 4, 132, arch=89).tier == "m64"
    assert kop.plan(33, 4096, 4096, 4, 132, arch=100).tier == "m64"
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "w*,x*")
    assert kop.plan(33, 4096, 4096, 4, 132, arch=90).tier == "m64"
    assert kop.plan(200, 4096, 4096, 4, 132, arch=90).path == "dequant"
    monkeypatch.setenv("EXL3_VLLM_TIER", "w64")
    with pytest.raises(kop.KernelError, match="sm_90"):
        kop.plan(33, 4096, 4096, 4, 132, arch=86)


def test_tune_cache_key_follows_the_tier_set(monkeypatch):
    """A tune cache timed with another set of tiers, other kernel sources or other stream-k switches (an older build
    of the same version, or a changed environment) is not reused."""
    from exl3_vllm.kernels import nvrtc, tune, variants
    tag = tune.tier_set_tag()
    assert len(tag) == 8 and tag == tune.tier_set_tag()
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "streamk-dp")
    assert tune.tier_set_tag() != tag
    monkeypatch.delenv("EXL3_VLLM_DISABLE")
    real = nvrtc.read_source
    monkeypatch.setattr(nvrtc, "read_source",
                        lambda name: real(name) + (b"// edited" if name == variants.LINEAR_SOURCE else b""))
    assert tune.tier_set_tag() != tag
    monkeypatch.setattr(nvrtc, "read_source", real)
    assert tune.tier_set_tag() == tag
    monkeypatch.setattr(variants, "TIERS", {**variants.TIERS, "zz": variants.TIERS["m16"]})
    assert tune.tier_set_tag() != tag


def test_a_switched_off_tier_is_never_dispatched_from_a_cached_table(monkeypatch):
    """A table timed with every tier on, read while EXL3_VLLM_DISABLE leaves tiers out: the call takes the static plan
    among the tiers still on, and the list keys another cache file (timed anew)."""
    from types import SimpleNamespace
    from exl3_vllm.kernels import tune
    d = SimpleNamespace(index=99, arch=90, sms=132, smem_limit=227 * 1024)
    key = (d.index, tune.layer_key(4096, 4096, 4, 2, [4096]))
    monkeypatch.setitem(tune._table, key, C({1: "i4", 8: "i8", 32: "w32", 64: "w64n:fixed", 128: "x128", 256: "dequant"}))
    monkeypatch.delenv("EXL3_VLLM_TIER", raising=False)
    plan = lambda m: kop.plan_for(d, m, 4096, 4096, 4, 2, [4096])  # noqa: E731
    assert [plan(m).tier for m in (1, 8, 32, 64, 128)] == ["i4", "i8", "w32", "w64n", "x128"]
    tag = tune.tier_set_tag()
    for items, off, left_out in (("i4,i8", {1, 8}, lambda t: t.int8), ("w*,x*", {32, 64, 128}, lambda t: t.wg),
                                 ("x*", {128}, lambda t: t.ws), ("w64", {64}, lambda t: t.name.startswith("w64")),
                                 ("i4, w32, x128", {1, 32, 128}, lambda t: t.name in ("i4", "w32", "x128"))):
        monkeypatch.setenv("EXL3_VLLM_DISABLE", items)
        assert tune.tier_set_tag() != tag
        for m in (1, 8, 32, 64, 128):
            p = plan(m)
            assert not (m in off and p.tier == tune._table[key][m].tier), (items, m, p)
            assert not left_out(kop.TIERS[p.tier]), (items, m, p)
        assert plan(256).path == "dequant"
        monkeypatch.delenv("EXL3_VLLM_DISABLE")


def test_disable_list_is_checked_and_replaces_the_old_switches(monkeypatch):
    """EXL3_VLLM_DISABLE: an item that is no tier and no feature, or an old per-family switch set to 0, is refused
    with the spelling to use; with every tier that could run disabled, the dequant path runs; the measured
    dispatch times only what is left."""
    from types import SimpleNamespace
    from exl3_vllm import settings
    from exl3_vllm.kernels import tune
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "i8,warp")
    with pytest.raises(settings.SettingError, match="warp, which is no tier"):
        kop.plan(1, 4096, 4096, 4, 132, codebook=2)
    monkeypatch.delenv("EXL3_VLLM_DISABLE")
    from exl3_vllm.kernels import dispatch
    monkeypatch.setattr(dispatch, "_OFF", {})  # parsed once per process: a new process reads the environment anew
    monkeypatch.setenv("EXL3_VLLM_INT8", "0")
    with pytest.raises(settings.SettingError, match="EXL3_VLLM_DISABLE=i4,i8"):
        kop.plan(1, 4096, 4096, 4, 132, codebook=2)
    monkeypatch.setenv("EXL3_VLLM_INT8", "1")  # the old default is harmless
    monkeypatch.setattr(dispatch, "_OFF", {})
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2).tier == "i4"
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "i*,h*,m*,w*,x*")
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2, arch=90).path == "dequant"
    hopper = SimpleNamespace(arch=90, smem_limit=227 * 1024)
    assert S(tune.candidates(hopper, 1, 4096, 4, 2, 4096)) == ["dequant"]
    with pytest.raises(kop.KernelError, match="leaves no tier for the experts"):
        from exl3_vllm.kernels.moe import moe_plan
        moe_plan(16, 2, 8, 2048, 1536, 768, 2048, [4], [2], 132)
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "x*, w64")
    cands = S(tune.candidates(hopper, 64, 4096, 4, 1, 4096))
    assert cands and not [c for c in cands if c.startswith(("x", "w64"))], cands
    monkeypatch.setenv("EXL3_VLLM_TIER", "x128")
    with pytest.raises(kop.KernelError, match="EXL3_VLLM_DISABLE leaves out"):
        kop.plan(64, 4096, 4096, 4, 132, codebook=1, arch=90)


def test_tune_buckets_and_candidates():
    """The measured dispatch's row buckets and the paths it times per bucket (no GPU needed to list them)."""
    from types import SimpleNamespace
    from exl3_vllm.kernels import tune
    assert [tune.bucket(m) for m in (1, 3, 8, 9, 100, 4096, 9000)] == [1, 4, 8, 16, 128, 4096, 4096]
    hopper = SimpleNamespace(arch=90, smem_limit=227 * 1024)
    ampere = SimpleNamespace(arch=80, smem_limit=163 * 1024)
    assert S(tune.candidates(hopper, 4, 4096, 4, 2, 4096)) == ["i4", "i8", "h8", "w16", "m16"]
    assert S(tune.candidates(hopper, 8, 4096, 4, 2, 4096)) == ["i8", "h8", "w16", "m16"]
    assert S(tune.candidates(hopper, 8, 4096, 4, 1, 4096)) == ["h8", "w16", "m16"]
    assert S(tune.candidates(hopper, 9, 4096, 4, 1, 4096)) == ["h16", "w16", "m16"]
    assert S(tune.candidates(hopper, 17, 4096, 4, 1, 4096)) == ["w32", "m32"]
    assert S(tune.candidates(hopper, 32, 4096, 4, 1, 4096)) == ["w32", "x64", "m32", "dequant"]
    assert S(tune.candidates(hopper, 64, 4096, 4, 1, 4096)) == ["w64", "w64n", "x64", "x128", "m64", "dequant"]
    assert S(tune.candidates(hopper, 64, 4096, 4, 1, 128)) == ["w64n", "x64", "x128", "m64", "dequant"]
    assert S(tune.candidates(hopper, 100, 4096, 4, 1, 128)) == ["w128n", "x64", "x128", "m128", "dequant"]
    assert S(tune.candidates(hopper, 100, 4096, 4, 1, 4096)) == ["w128", "w128n", "x64", "x128", "m128", "dequant"]
    assert S(tune.candidates(hopper, 256, 4096, 4, 1, 4096)) == ["x128", "x256", "dequant"]
    assert S(tune.candidates(hopper, 4096, 4096, 4, 1, 4096)) == ["x256", "dequant"]
    assert S(tune.candidates(ampere, 128, 4096, 4, 1, 4096)) == ["m128", "dequant"]
    assert S(tune.candidates(ampere, 256, 4096, 4, 1, 4096)) == ["dequant"]
    assert tune.layer_key(4096, 6144, 2.5, 2, [4096, 1024, 1024]) == "4096x6144-K2.5-cb2-s4096_1024_1024"


def test_tune_cache_file_merges_and_survives_damage(tmp_path):
    """Two writers (tensor-parallel ranks) keep each other's layers; a damaged file reads as empty (re-timed)."""
    from exl3_vllm.kernels import tune
    path = tmp_path / "tune" / "gpu.json"
    tune.merge_write(path, {"a": {"1": "i8", "16": "w16"}})
    tune.merge_write(path, {"b": {"1": "m16"}, "a": {"32": "w32"}})
    assert tune.read_table(path) == {"a": {"1": "i8", "16": "w16", "32": "w32"}, "b": {"1": "m16"}}
    path.write_text("{not json")
    assert tune.read_table(path) == {}
    path.write_text("[1, 2]")
    assert tune.read_table(path) == {}


def test_clock_rest_waits_out_the_power_cap(monkeypatch):
    """The tuner's rest: returns at once without NVML or without a cap; waits while a power/thermal reason is set, and
    gives up at its timeout."""
    from exl3_vllm.kernels import clock
    monkeypatch.setattr(clock, "reasons", lambda index: None)
    assert clock.rest(0) < 0.05
    seq = iter([0x4, 0x4, 0x40, 0x1])  # power cap, power cap, HW thermal, then only "idle"
    monkeypatch.setattr(clock, "reasons", lambda index: next(seq))
    assert 0.05 <= clock.rest(0) < 1.0
    monkeypatch.setattr(clock, "reasons", lambda index: 0x4)
    assert 0.2 <= clock.rest(0, timeout=0.2) < 0.5


def test_tune_rests_before_light_buckets(monkeypatch):
    """Buckets up to LIGHT_BUCKET rows are timed on a rested clock; the large ones (which cause the cap) are not."""
    from exl3_vllm.kernels import clock, tune
    rested = []
    monkeypatch.setattr(clock, "rest", lambda index, timeout=3.0: rested.append(index) or 0.0)
    deq = dispatch.Choice("dequant")
    monkeypatch.setattr(tune, "_time_all", lambda x, y, trs, suh, svh, sizes, cb, b, cands, times: times.update({deq: 1.0}))
    monkeypatch.setattr(tune, "candidates", lambda *a: [deq])

    class D:
        index, device, sms, smem_limit, arch = 0, torch.device("cpu"), 132, 227 * 1024, 90

        def scratch_workspace(self):
            return contextlib.nullcontext()
    table = {}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    tune._measure(D(), 256, 256, 4, 2, [256], [1, 256, 512, 1024], table)
    assert rested == [0, 0] and table == {1: deq, 256: deq, 512: deq, 1024: deq}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_impl_shapes(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(2, 5, 256, dtype=dtype)
        tr = torch.empty(16, 24, 64, dtype=torch.int16)
        y = torch.ops.exl3.linear(x, tr, torch.empty(2, 256, dtype=torch.float16), torch.empty(384, dtype=torch.float16),
                                  None, [128, 256], 2)
        assert y.shape == (2, 5, 384) and y.dtype == dtype


@pytest.mark.parametrize("bits,cb", [(4, 2), (3, 1), (2, 0), (2.5, 2)])
def test_cpu_op_equals_reference(bits, cb):
    k, n = 256, 384
    trellis, suh, svh = _layer(k, n, bits, shards=2, seed=int(bits * 10) + cb)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    bias = torch.randn(n).half()
    y = torch.ops.exl3.linear(x, trellis, suh, svh, bias, [128, 256], cb)
    ref = ref_linear(x, trellis, suh, svh, cb, bias=bias, shard_sizes=[128, 256], out_dtype=x.dtype)
    assert y.dtype == x.dtype and torch.equal(y, ref)


def test_cpu_op_rejects_bad_shapes():
    trellis, suh, svh = _layer(256, 128, 4)
    with pytest.raises(Exception, match="features|k="):
        torch.ops.exl3.linear(torch.randn(2, 128).half(), trellis, suh[0], svh, None, [128], 2)


# ---- grouped experts: the plan and the op's CPU-side contract (the kernels themselves: tests/test_moe_gpu.py)
from exl3_vllm.kernels import moe as kmoe  # noqa: E402


def _moe_plan(tokens, bits=(4, 4), cbs=(2, 2), **kw):
    return kmoe.moe_plan(tokens, 8, 128, 2048, 1536, 768, 2048, bits, cbs, 132, **kw)


def test_moe_plan_tiers_and_row_bound():
    assert _moe_plan(1).tier == "i8" and _moe_plan(128).tier == "i8"  # <= 8 rows per active expert
    assert _moe_plan(1, cbs=(2, 1)).tier == "m16"                     # int8 needs mul1 in both projections
    assert _moe_plan(256).tier == "m16" and _moe_plan(512).tier == "m32" and _moe_plan(8192).tier == "m128"
    for t in (1, 3, 17, 100, 1000, 8192):
        p = _moe_plan(t)
        # Every expert's rows fit: ceil(count_e / bm) summed over experts <= pairs / bm + active experts.
        assert p.max_blocks == -(-t * 8 // p.bm) + min(128, t * 8)
        assert p.splits13 * p.steps13 >= 2048 // 16 and p.splits2 * p.steps2 >= 768 // 16


def test_moe_plan_deterministic_and_forced(monkeypatch):
    assert _moe_plan(1).splits13 > 1
    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    p = _moe_plan(1)
    assert p.splits13 == 1 and p.splits2 == 1  # no atomics: each block owns its outputs
    monkeypatch.setenv("EXL3_VLLM_TIER", "m64")
    assert _moe_plan(1).tier == "m64"
    monkeypatch.setenv("EXL3_VLLM_TIER", "i8")
    with pytest.raises(kop.KernelError, match="mul1"):
        _moe_plan(1, cbs=(2, 0))
    for dense_only in ("i4", "h8"):  # x as the MMA's B operand: dense layers only
        monkeypatch.setenv("EXL3_VLLM_TIER", dense_only)
        with pytest.raises(kop.KernelError, match="not one of the MoE tiers"):
            _moe_plan(1)


def test_moe_op_fake_and_cpu_error():
    from torch._subclasses.fake_tensor import FakeTensorMode
    E, k, inter = 4, 256, 128
    weights = lambda: ([torch.empty(E, k // 16, 2 * inter // 16, 64, dtype=torch.int16)], [2],
            torch.zeros(E, 2, dtype=torch.int32), torch.empty(E, 2, k, dtype=torch.float16),
            torch.empty(E, 2 * inter, dtype=torch.float16),
            [torch.empty(E, inter // 16, k // 16, 64, dtype=torch.int16)], [2],
            torch.zeros(E, 2, dtype=torch.int32), torch.empty(E, inter, dtype=torch.float16),
            torch.empty(E, k, dtype=torch.float16), -1, False)  # noqa: E731
    with FakeTensorMode():
        x = torch.empty(3, 200, dtype=torch.bfloat16)
        y = torch.ops.exl3.moe_experts(x, torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int64), *weights())
        assert y.shape == x.shape and y.dtype == x.dtype
    with pytest.raises(kop.KernelError, match="CUDA"):
        kmoe.moe_cuda(torch.randn(3, 200).bfloat16(), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int64),
                       *weights())


def test_trellis_alignment_error():
    """A trellis view that does not start on a 16-byte boundary (the kernels copy its words in 16-byte chunks) is
    refused before any launch, with the fix in the message."""
    trellis, suh, svh = _layer(256, 256, 4)
    odd = torch.empty(trellis.numel() + 1, dtype=torch.int16)[1:].view_as(trellis).copy_(trellis)
    x = torch.randn(2, 256).half()
    kop._check_cuda_args(x, trellis, suh[0], svh, None, [256], 2)
    with pytest.raises(kop.KernelError, match=r"2 bytes past a 16-byte boundary.*trellis.clone\(\)"):
        kop._check_cuda_args(x, odd, suh[0], svh, None, [256], 2)


def test_the_cuda_instantiations_are_the_tier_table():
    """The instantiations generated from variants.TIERS (exl3_tiers.cuh, the only place exl3_linear.cu's kernels are
    named) build each tier with its block shape, stages and stream-k twin, read back through the macros' meaning: the
    Python dispatch never asks for a kernel the source does not build, nor builds one it ignores."""
    import re

    from exl3_vllm.kernels.nvrtc import read_source
    pattern = r"^(EXL3_(?:TIER|FEW_TIER|WG_TIER|WG_STREAM|WS_TIER|FX_TIER))\((\w+), ([^)]*)\)$"
    assert not re.findall(pattern, read_source("exl3_linear.cu").decode(), re.M)
    assert '#include "exl3_tiers.cuh"' in read_source("exl3_linear.cu").decode()
    src = read_source("exl3_tiers.cuh").decode()
    calls = re.findall(pattern, src, re.M)
    built, streams, fx = {}, set(), set()
    for macro, name, args in calls:
        a = [int(v) for v in args.split(", ")]
        if macro == "EXL3_TIER":
            built[name] = dict(bm=a[0], nt=a[1], kw=a[2], ks=a[3], stages=a[4], int8=False, xb=False, wg=0, ws=0)
        elif macro == "EXL3_FEW_TIER":  # MODE 1: int8, 2: int8 with x as B, 3: fp16 with x as B; every one streams
            # (BM is the MMA's rows here; i4's dispatch bound, TIERS' bm, is half of them)
            built[name] = dict(ks=a[2], stages=a[3], int8=a[1] in (1, 2), xb=a[1] in (2, 3), wg=0, ws=0)
            streams.add(name)
        elif macro == "EXL3_WG_TIER":
            built[name] = dict(bm=a[0], wg=a[1], ks=a[2], stages=a[3], int8=False, xb=False, ws=0)
        elif macro == "EXL3_WG_STREAM":
            streams.add(name)
        elif macro == "EXL3_WS_TIER":
            built[name] = dict(bm=a[0], ws=a[1], ks=a[2], stages=a[3], wg=2, int8=False, xb=False)
            streams.add(name)
        else:
            fx.add(name)
    assert set(built) == set(TIERS), set(built) ^ set(TIERS)
    for name, want in built.items():
        t = TIERS[name]
        got = {f: getattr(t, f) for f in want}
        assert got == want, (name, got, want)
        assert t.stream == (name in streams), name
    assert fx == {n for n, t in TIERS.items() if t.xb and not t.int8}


def test_every_cuda_header_is_registered():
    """NVRTC finds an include only among the headers nvrtc.HEADERS names, and the compile cache key hashes exactly
    those: every .cuh of kernels/cuda must be one of them."""
    from importlib import resources

    from exl3_vllm.kernels.nvrtc import FILE_HEADERS
    cuda = resources.files("exl3_vllm.kernels").joinpath("cuda")
    assert {f.name for f in cuda.iterdir() if f.name.endswith(".cuh")} == set(FILE_HEADERS)


@pytest.fixture
def stub_gpu(monkeypatch):
    """linear_cuda on CPU tensors with bench/host_cost.py's stand-in H100: launches and cuBLAS calls are recorded as
    (kernel name, grid) and ("mm", columns), nothing runs."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import host_cost

    calls = []
    host_cost.stub(monkeypatch.setattr, launch=lambda f, grid, *a, **k: calls.append((f, tuple(grid))),
                   mm=lambda a, b, out=None: calls.append(("mm", b.shape[1])))
    monkeypatch.setattr(kop, "_RECIPES", {})
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_launch_recipe_is_keyed_by_every_setting_it_reads(stub_gpu, monkeypatch):
    """A call's launches are decided once per shape and kept (steps outside CUDA graphs pay that host work on every
    layer): the settings read while deciding are exactly the ones marked keys_call, so changing one of them changes
    what the next call launches, and a repeated call launches the same kernels without deciding again."""
    read = set()
    real_raw, real_get = settings.raw, settings.get
    monkeypatch.setattr(settings, "raw", lambda name: read.add(name) or real_raw(name))
    monkeypatch.setattr(settings, "get", lambda name: read.add(name) or real_get(name))
    keyed = {s.name for s in settings.SETTINGS.values() if s.keys_call}
    trellis, suh, svh = _layer(1024, 3 * 1024, 4, shards=3)
    suh = suh.reshape(-1)

    def launches(m):
        stub_gpu.clear()
        kop.linear_cuda(torch.randn(m, 1024).bfloat16(), trellis, suh, svh, None, [1024, 1024, 1024], 2)
        return list(stub_gpu)

    for m in (1, 4, 16, 64, 129, 1024):
        first = launches(m)
        assert first and read <= keyed, (m, read - keyed)
        made = len(kop._RECIPES)
        assert launches(m) == first and len(kop._RECIPES) == made
    assert launches(4)[0][0].startswith("exl3_input_i8")
    monkeypatch.setenv("EXL3_VLLM_TIER", "h16")
    assert [f for f, _ in launches(4)] == ["exl3_input_bf16", "exl3_gemm_h16s_bf16"]
    monkeypatch.setenv("EXL3_VLLM_TIER", "")
    monkeypatch.setenv("EXL3_VLLM_LARGE_M", "2")
    assert launches(4) == [("exl3_recon_bf16", (64, 1, 1))] * 3 + [("mm", 3072)]
    monkeypatch.setenv("EXL3_VLLM_DEQUANT_BYTES", str(2 * 1024 * 1536))  # two chunks of 1536 columns cut shard 1
    # a reconstruction's grid is its piece's 128 x 128 units here: 1024, 512 | 512, 1024 columns
    recon = lambda cols: ("exl3_recon_bf16", (cols // 128 * 8, 1, 1))  # noqa: E731
    assert launches(4) == [recon(1024), recon(512), ("mm", 1536), recon(512), recon(1024), ("mm", 1536)]
    assert read <= keyed, read - keyed


def test_a_new_measured_choice_makes_the_next_call_decide_again(stub_gpu, monkeypatch):
    """The recipe cache is keyed by the measured table's generation, not by each call's looked-up choice (3 µs a
    call): a choice the measured dispatch adds changes what the next call launches; a table that gains nothing does
    not make calls decide again."""
    from exl3_vllm.kernels import tune

    monkeypatch.setattr(tune, "merge_write", lambda *a: None)
    sizes = [1024, 1024, 1024]
    key = tune.layer_key(1024, 3072, 4, 2, sizes)
    monkeypatch.setattr(tune, "_table", {})
    monkeypatch.setattr(tune, "_disk", {0: {key: {str(b): "h16" for b in tune.BUCKETS if b <= 16}}})
    trellis, suh, svh = _layer(1024, 3072, 4, shards=3)

    def names(m):
        stub_gpu.clear()
        kop.linear_cuda(torch.randn(m, 1024).bfloat16(), trellis, suh.reshape(-1), svh, None, sizes, 2)
        return [f for f, _ in stub_gpu]

    assert names(4)[0].startswith("exl3_input_i8")  # the static plan: nothing measured yet
    g = tune.generation()
    tune.ensure(kop.device_for(0), 1024, 3072, 4, 2, sizes, 16)  # the known choices, read from the disk table
    assert tune.generation() == g + 1
    assert names(4) == ["exl3_input_bf16", "exl3_gemm_h16s_bf16"]
    made = len(kop._RECIPES)
    tune.ensure(kop.device_for(0), 1024, 3072, 4, 2, sizes, 16)
    assert tune.generation() == g + 1 and names(4) == ["exl3_input_bf16", "exl3_gemm_h16s_bf16"]
    assert len(kop._RECIPES) == made


def test_workspace_grown_while_timing_paths_is_released(stub_gpu, monkeypatch):
    """The measured dispatch times paths it will not choose, some needing far more workspace than the chosen ones
    (stream-k's fp32 rows, the large-M path's weight scratch): what the timing grew is released when it ends, with the
    launch recipes made while timing (they hold it), and what was reserved before stays. On a first start that
    workspace had stayed reserved beside the KV cache (2.1 GiB of the Qwen3.5-27B shape's, 2026-12-07e)."""
    from exl3_vllm.kernels import tune

    monkeypatch.setattr(tune, "merge_write", lambda *a: None)
    monkeypatch.setattr(tune, "_path", lambda index: None)
    monkeypatch.setattr(tune, "_table", {})
    monkeypatch.setattr(tune, "_disk", {0: {}})
    monkeypatch.setattr(tune.clock, "rest", lambda index: 0.0)
    d = kop.device_for(0)
    seen: dict[str, int] = {}

    def timed(calls, reps):  # each candidate runs once (the stub launches nothing); its workspace is what is measured
        calls[0]()
        for name, buf in d.bufs[0].items():
            seen[name] = max(seen.get(name, 0), buf.numel())
        return 1.0 + len(stub_gpu)

    monkeypatch.setattr(tune, "graph_time_us", timed)
    kept = d.buf("counters", 64, torch.int32, zero=True)
    sizes = [1024, 1024, 1024]
    tune.ensure(d, 1024, 3072, 4, 2, sizes, 1024)
    assert len(tune._table[0, tune.layer_key(1024, 3072, 4, 2, sizes)]) == len([b for b in tune.BUCKETS if b <= 1024])
    assert seen["wscratch"] >= 1024 * 1024 and seen["ws_atomic"] >= 1024 * 3072 and seen["counters"] > 64
    assert d.bufs == {0: {"counters": kept}} and d._old == [] and kop._RECIPES == {}


@pytest.mark.skipif(not _HAVE_NVRTC, reason="cuda-bindings not installed (pip install cuda-bindings)")
def test_a_dependent_launch_reuses_its_configuration():
    """A programmatic dependent launch's cuLaunchKernelEx configuration is built once per launch shape and stream
    (building it cost more than the rest of the launch's Python), with the shape and the serialization attribute."""
    from exl3_vllm.kernels import nvrtc

    cfg = nvrtc._pdl_config((132, 2, 1), (384, 1, 1), 200_000, 7)
    assert nvrtc._pdl_config((132, 2, 1), (384, 1, 1), 200_000, 7) is cfg
    assert nvrtc._pdl_config((132, 2, 1), (384, 1, 1), 200_000, 8) is not cfg
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.sharedMemBytes) == (132, 2, 1, 384, 200_000)
    assert int(cfg.hStream) == 7 and cfg.numAttrs == 1
    assert cfg.attrs[0].value.programmaticStreamSerializationAllowed == 1


def test_a_concurrent_stream_has_its_own_workspace(monkeypatch):
    """Calls on a stream registered as concurrent (vLLM's shared experts run on one beside the routed experts) never
    share a workspace buffer with other streams' calls; streams not registered share one set. A concurrent stream's
    first call inside a CUDA-graph capture may take up to what prepare() reserved, and no more."""
    import os
    import sys
    import types

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import host_cost

    gemms = []
    d = host_cost.stub(monkeypatch.setattr, launch=lambda f, grid, block, smem, stream, args, **kw:
                       gemms.append((stream, args[0].xh, args[0].counters)) if f.startswith("exl3_gemm") else None)
    monkeypatch.setattr(kop, "_RECIPES", {})
    monkeypatch.setenv("EXL3_VLLM_TUNE", "0")
    d.concurrent.add(7)
    k, n = 1024, 1024
    trellis, suh, svh = _layer(k, n, 4)
    for m in (2, 16):  # an int8 tier and an fp16 one with its own input transform
        d.bufs.clear()
        gemms.clear()
        x = torch.randn(m, k).half()
        for handle in (0, 7, 8):
            monkeypatch.setattr(torch.cuda, "current_stream",
                                lambda dev=None, h=handle: types.SimpleNamespace(cuda_stream=h))
            kop.linear_cuda(x, trellis, suh, svh, None, [n], 2)
        (_, xh0, c0), (_, xh7, c7), (_, xh8, c8) = gemms
        assert xh0 != xh7 and c0 != c7  # transformed x (xq / xh) and split-k counters
        assert (xh8, c8) == (xh0, c0)
        assert set(d.bufs) == {0, 7}
    d.reserve("xq", 64, torch.int8)
    d.reserve("counters", 64, torch.int32, zero=True)
    d.concurrent.add(9)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert d.buf("xq", 64, torch.int8, stream=9).numel() == 64  # reserved: a new lane may take it inside a capture
    with pytest.raises(kop.KernelError, match="'counters' needs .* CUDA graph is being captured"):
        d.buf("counters", 10**6, torch.int32, zero=True, stream=9)
    # Zeroed workspace made inside a capture is filled by the graph's replay; its first use outside one fills it.
    counters = d.buf("counters", 64, torch.int32, zero=True, stream=9)
    counters.fill_(5)  # what the memory holds before any replay
    assert d.buf("counters", 64, torch.int32, zero=True, stream=9).eq(5).all()  # still inside the capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert d.buf("counters", 64, torch.int32, zero=True, stream=9) is counters and counters.eq(0).all()
    counters.fill_(5)
    assert d.buf("counters", 64, torch.int32, zero=True, stream=9).eq(5).all()  # once only: the kernels reset it


def test_large_m_reconstruction_addresses_match_the_views_they_stand_for(monkeypatch):
    """The large-M path launches each shard's piece of a chunk on raw addresses (views cost host time every call):
    each launch's suh and destination addresses are those of the suh row and the scratch slice they stand for."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import host_cost

    recons = []
    d = host_cost.stub(monkeypatch.setattr, launch=lambda f, grid, block, smem, stream, args, **kw:
                       recons.append((grid, [a.value for a in args])) if f.startswith("exl3_recon") else None)
    monkeypatch.setattr(kop, "_RECIPES", {})
    monkeypatch.setenv("EXL3_VLLM_LARGE_M", "2")
    monkeypatch.setenv("EXL3_VLLM_DEQUANT_BYTES", str(2 * 1024 * 1536))  # chunks of 1536 columns: shard 1 is cut
    k, sizes = 1024, [1024, 1024, 1024]
    trellis, suh, svh = _layer(k, 3072, 4, shards=3)
    suh = suh.reshape(-1)
    for dt in (torch.bfloat16, torch.float16):
        recons.clear()
        kop.linear_cuda(torch.randn(4, k).to(dt), trellis, suh, svh, None, sizes, 2)
        w = d.bufs[0]["wscratch"].view(dt)
        want = [(0, 0, 1024), (1, 1024, 512), (1, 1536, 512), (2, 2048, 1024)]  # (shard, first column, columns)
        assert len(recons) == len(want)
        for (grid, a), (s, p0, pcols) in zip(recons, want):
            c0 = p0 // 1536 * 1536
            assert a[0] == trellis.data_ptr() and a[2] == svh.data_ptr()
            assert a[1] == suh.view(-1, k)[s].data_ptr()
            assert a[3] == w[:1536 * k].view(1536, k)[p0 - c0:p0 - c0 + pcols].data_ptr()
            assert a[4:] == [3072, p0, pcols, k] and grid == kop.recon_grid(d, pcols, k)
