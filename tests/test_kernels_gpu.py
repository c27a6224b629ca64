"""GPU checks of torch.ops.exl3.linear against the fp64 format reference (run on a CUDA machine)."""

from __future__ import annotations


import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_report import rel as _rel, report as _report  # noqa: E402
from exl3_vllm.format.hadamard import hadamard_128  # noqa: E402
from exl3_vllm.format.reconstruct import w_hat  # noqa: E402
from exl3_vllm.kernels import op as kop  # noqa: E402

MS = (1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128, 129, 255, 256, 511, 1024, 2048, 4096)
VARIANTS = [(b, cb) for b in (1, 2, 3, 4, 5, 6, 7, 8) for cb in (0, 1, 2)] + [(1.5, 2), (2.5, 2), (3.5, 2)]
DTYPES = (torch.float16, torch.bfloat16)
TOL = 1e-3
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _static_plan(monkeypatch):
    """The static plan by default: timing every bucket of every small test layer would dominate the run
    (test_measured_dispatch turns the measured dispatch back on)."""
    monkeypatch.setenv("EXL3_VLLM_TUNE", "0")


def _layer(k, n, bits, shards, gen):
    w = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, w), dtype=torch.int16, device=DEV, generator=gen)

    def sv(*s):
        sign = torch.where(torch.rand(*s, device=DEV, generator=gen) < 0.5, -1.0, 1.0)
        return (sign * (0.5 + torch.rand(*s, device=DEV, generator=gen)) * 0.05).half()
    return trellis, sv(shards, k), sv(n), (torch.randn(n, device=DEV, generator=gen) * 0.1).half()


def _dense64(trellis, suh, svh, cb, sizes):
    """Per-shard original-basis W in fp64, concatenated along n."""
    wh = w_hat(trellis, cb).double()
    k, n = wh.shape
    h = hadamard_128(torch.float64, wh.device)
    w = (h @ wh.reshape(k // 128, 128, n)).reshape(k, n)
    w = (w.reshape(k, n // 128, 128) @ h).reshape(k, n) * svh.double()[None]
    cols, c = [], 0
    for s, width in enumerate(sizes):
        cols.append(suh[s].double()[:, None] * w[:, c:c + width])
        c += width
    return torch.cat(cols, 1)


def _run_vs_ref(m, dt, gen, trellis, suh, svh, bias, sizes, cb, w64):
    """One call on fresh random x into a NaN-poisoned output: (relative error against the fp64 reference, the dtype's
    own rounding of the reference, whether any output was left unwritten)."""
    x = torch.randn(m, w64.shape[0], device=DEV, generator=gen).to(dt)
    b = bias.to(dt)
    ref = x.double() @ w64 + b.double()
    out = torch.full((m, w64.shape[1]), float("nan"), dtype=dt, device=DEV)
    kop.linear_cuda(x, trellis, suh, svh, b, sizes, cb, out=out)
    torch.cuda.synchronize()
    return _rel(out, ref), _rel(ref.to(dt), ref), bool(torch.isnan(out).any())


@pytest.mark.parametrize("bits,cb", VARIANTS)
def test_every_m_dtype_and_shards(bits, cb):
    gen = torch.Generator(device=DEV).manual_seed(int(bits * 100) + cb)
    k = 512
    worst = {}
    fails = []
    for sizes in ([384], [128, 256, 128]):
        n = sum(sizes)
        trellis, suh, svh, bias = _layer(k, n, bits, len(sizes), gen)
        w64 = _dense64(trellis, suh, svh, cb, sizes)
        use_bias = len(sizes) > 1
        kop.prepare(k, n, bits, cb, max(MS), DEV, sizes)
        for m in MS:
            for dt in DTYPES:
                x = torch.randn(m, k, device=DEV, generator=gen).to(dt)
                b = bias.to(dt)  # vLLM's bias is in the model's dtype
                ref = x.double() @ w64 + (b.double() if use_bias else 0)
                out = torch.full((m, n), float("nan"), dtype=dt, device=DEV)
                kop.linear_cuda(x, trellis, suh if len(sizes) > 1 else suh[0], svh, b if use_bias else None,
                                sizes, cb, out=out)
                torch.cuda.synchronize()
                err = _rel(out, ref)
                floor = _rel(ref.to(dt), ref)
                key = (dt, len(sizes))
                worst[key] = max(worst.get(key, 0.0), err)
                if not (err <= TOL + floor) or torch.isnan(out).any():
                    fails.append(f"m={m} {dt} shards={sizes}: err {err:.2e} (rounding floor {floor:.2e})")
    for (dt, s), e in sorted(worst.items(), key=str):
        _report(f"K={bits:g} cb={cb} {str(dt)[6:]:8s} shards={s} max_rel_err={e:.3e}")
    assert not fails, "\n".join(fails[:20])


WG_VARIANTS = [(4, 2), (4, 1), (3, 0), (2.5, 2), (8, 2), (1, 1)]


@pytest.mark.parametrize("tier", ["w16", "w32", "w64", "w128", "w64n", "w128n", "x64", "x128", "x256",
                                  "m16", "m32", "m64", "m128", "h8", "h16", "h8k8", "h16k8", "dequant"])
def test_tiers_forced(tier, monkeypatch):
    """Each tier (the Hopper wgmma ones on sm_90), forced, at partial/whole/multiple row blocks, fused shards, split-k,
    stream-k (tiers with a stream twin, on a layer whose column blocks leave a partial wave) and one split: the
    measured dispatch may pick any of them."""
    if tier != "dequant" and kop.TIERS[tier].wg and torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the wg tiers are sm_90a only")
    monkeypatch.setenv("EXL3_VLLM_TIER", tier)
    bm = kop.TIERS[tier].bm if tier != "dequant" else 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device=DEV).manual_seed(bm)
    worst, fails = 0.0, []
    for bits, cb in WG_VARIANTS:
        wide = tier != "dequant" and kop.TIERS[tier].cols == 256
        layers = [(512, [512]), (4096, [256, 512, 256])] if wide else [(512, [384]), (4096, [128, 256, 128])]
        stream_layer = (4096, [512, 256] if wide else [384, 256])
        if tier != "dequant" and kop.TIERS[tier].stream:
            layers.append(stream_layer)
        for k, sizes in layers:
            n = sum(sizes)
            trellis, suh, svh, bias = _layer(k, n, bits, len(sizes), gen)
            w64 = _dense64(trellis, suh, svh, cb, sizes)
            pl = kop.plan(bm, k, n, bits, sms, codebook=cb, arch=90, col_align=math.gcd(*sizes))
            assert k == 512 or tier == "dequant" or pl.splits > 1 or pl.stream
            assert (k, sizes) != stream_layer or pl.stream, (tier, pl)
            for m in sorted({1, 9, bm - 1, bm, bm + 1, 2 * bm + 3}):
                for dt in DTYPES:
                    err, floor, nan = _run_vs_ref(m, dt, gen, trellis, suh if len(sizes) > 1 else suh[0], svh, bias,
                                                  sizes, cb, w64)
                    worst = max(worst, err)
                    if not (err <= TOL + floor) or nan:
                        fails.append(f"K={bits} cb={cb} k={k} m={m} {dt}: err {err:.2e} (floor {floor:.2e})")
    _report(f"tier {tier} forced: max_rel_err={worst:.3e} over {len(WG_VARIANTS)} variants")
    assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("tier", ["x64", "x128", "x256"])
def test_streamk_whole_waves(tier, monkeypatch):
    """Stream-k on a layer wider than one wave: full waves of whole column blocks first (no partial sums), then the
    rest shared out as units with several contributors per column block; the plan must use both parts."""
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the ws tiers are sm_90a only")
    monkeypatch.setenv("EXL3_VLLM_TIER", tier)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bm = kop.TIERS[tier].bm
    k, sizes = 512, [128 * (sms // 2), 128 * (sms - sms // 2 + 8)]
    n = sum(sizes)
    gen = torch.Generator(device=DEV).manual_seed(11)
    worst, fails = 0.0, []
    for bits, cb in ((4, 2), (3, 1)):
        trellis, suh, svh, bias = _layer(k, n, bits, len(sizes), gen)
        w64 = _dense64(trellis, suh, svh, cb, sizes)
        for m in (bm, 2 * bm + 3):
            pl = kop.plan(m, k, n, bits, sms, codebook=cb, arch=90, col_align=math.gcd(*sizes))
            assert pl.stream and 0 < pl.dp < n // 128, pl
            for dt in DTYPES:
                err, floor, nan = _run_vs_ref(m, dt, gen, trellis, suh, svh, bias, sizes, cb, w64)
                worst = max(worst, err)
                if not (err <= TOL + floor) or nan:
                    fails.append(f"K={bits} cb={cb} m={m} {dt}: err {err:.2e} (floor {floor:.2e}) {pl}")
    _report(f"tier {tier} stream-k with whole waves: max_rel_err={worst:.3e}")
    assert not fails, "\n".join(fails)


def test_input_staged_layout():
    """The ws tiers' staged x (one bulk copy per stage) holds the plain transform's values: xh[s][k / 64][m][64] with
    row r's 16-byte chunk j at chunk j ^ (r % 8), the 128-byte swizzle wgmma reads x in."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    m, k, S = 37, 512, 2
    x = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
    suh = (torch.randn(S, k, device=DEV, generator=gen) * 0.05).half()
    d = kop.device_for(0)
    io = d.module(kop.IO_SOURCE, None)
    stream = torch.cuda.current_stream().cuda_stream
    plain, staged = (torch.full((S * m * k,), float("nan"), dtype=torch.float16, device=DEV) for _ in range(2))
    kop.launch_input(d, io, stream, x, suh, plain, m, k, S)
    kop.launch_input(d, io, stream, x, suh, staged, m, k, S, staged=True)
    torch.cuda.synchronize()
    pv = plain.view(S, m, k // 64, 8, 8)
    expect = torch.empty(S, k // 64, m, 8, 8, dtype=torch.float16, device=DEV)
    for r in range(m):
        for j in range(8):
            expect[:, :, r, j ^ (r % 8)] = pv[:, r, :, j]
    assert not torch.isnan(plain).any()
    assert torch.equal(staged.view_as(expect), expect)


@pytest.mark.parametrize("svh_scale", [2e-3, 1.0, 800.0])
def test_dequant_chunks_and_svh_range(svh_scale, monkeypatch):
    """The large-M path with 256-column chunks (shards split across chunks, each chunk's GEMM writing a column slice
    of y in place) and svh from tiny to large, each 128-column group a different power of two: the reconstructed
    dense weight (svh folded in, in x's dtype) must keep its precision at both ends; m=2048 is the path's real size."""
    monkeypatch.setenv("EXL3_VLLM_TIER", "dequant")
    k, sizes = 1024, [640, 384, 128]
    monkeypatch.setenv("EXL3_VLLM_DEQUANT_BYTES", str(2 * k * 256))
    n = sum(sizes)
    gen = torch.Generator(device=DEV).manual_seed(int(svh_scale * 1000))
    worst = 0.0
    for bits, cb in ((4, 2), (3, 1), (2, 0)):
        trellis, suh, svh, bias = _layer(k, n, bits, len(sizes), gen)
        group = 2.0 ** (torch.arange(n, device=DEV) // 128 % 7 - 3)
        svh = (svh.float() * group * svh_scale).half()
        w64 = _dense64(trellis, suh, svh, cb, sizes)
        for m in (40, 300, 2048):
            for dt in DTYPES:
                err, floor, nan = _run_vs_ref(m, dt, gen, trellis, suh, svh, bias, sizes, cb, w64)
                worst = max(worst, err)
                # three roundings in x's dtype (W, x @ W, + bias) where the fused kernels have one: two floors
                assert not nan and err <= TOL + 2 * floor, (bits, cb, m, dt, err, floor)
    _report(f"dequant 256-column chunks, svh x{svh_scale:g}: max_rel_err={worst:.3e}")


def test_measured_dispatch(tmp_path, monkeypatch):
    """prepare() times the candidates per row bucket, keeps a valid winner per bucket, writes the disk cache, and a
    fresh process state reads the same table back; the tuned calls stay exact."""
    from exl3_vllm.kernels import tune
    monkeypatch.setenv("EXL3_VLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EXL3_VLLM_TUNE", "1")
    monkeypatch.delenv("EXL3_VLLM_TIER", raising=False)
    gen = torch.Generator(device=DEV).manual_seed(11)
    k, sizes = 2048, [1024, 256, 256]
    n = sum(sizes)
    trellis, suh, svh, bias = _layer(k, n, 4, len(sizes), gen)
    bias = bias.bfloat16()
    w64 = _dense64(trellis, suh, svh, 2, sizes)
    d = kop.device_for(0)
    key = (0, tune.layer_key(k, n, 4, 2, sizes))
    tune._table.pop(key, None)
    kop.prepare(k, n, 4, 2, 300, DEV, sizes)
    table = dict(tune._table[key])
    assert sorted(table) == [b for b in tune.BUCKETS if b <= 512], table
    for b, c in table.items():
        cands = tune.with_fixed(d, tune.candidates(d, b, k, 4, 2, math.gcd(*sizes)), b, k, n, 4, 2, sizes)
        # a split-k variant ("<tier>:s<N>") of one of the bucket's candidates, timed after them
        splits = tune.with_splits(d, cands, b, k, n, 4, 2, sizes) if b <= tune.split_bucket() else []
        assert c in cands or c in splits, (b, c)
    files = list((tmp_path / "tune").glob("*.json"))
    assert len(files) == 1
    tune._table.pop(key)
    tune._disk.clear()
    kop.prepare(k, n, 4, 2, 300, DEV, sizes)
    assert tune._table[key] == table
    for m in (1, 5, 12, 40, 100, 300):
        x = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        kop.linear_cuda(x, trellis, suh, svh, bias, sizes, 2, out=out)
        ref = x.double() @ w64 + bias.double()
        err, floor = _rel(out, ref), _rel(ref.bfloat16(), ref)
        assert err <= TOL + floor, (m, err)
    _report(f"measured dispatch k={k} shards={sizes}: {table}")


def test_split_k_large_k_and_op_path():
    gen = torch.Generator(device=DEV).manual_seed(7)
    k, n = 4096, 512
    trellis, suh, svh, bias = _layer(k, n, 4, 1, gen)
    bias = bias.bfloat16()
    w64 = _dense64(trellis, suh, svh, 2, [n])
    for m in (1, 7, 16, 40, 64, 200, 300):
        x = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
        y = torch.ops.exl3.linear(x, trellis, suh[0], svh, bias, [n], 2)
        ref = x.double() @ w64 + bias.double()
        err, floor = _rel(y, ref), _rel(ref.bfloat16(), ref)
        _report(f"k=4096 m={m} plan={kop.plan(m, k, n, 4, torch.cuda.get_device_properties(0).multi_processor_count)} err={err:.3e}")
        assert err <= TOL + floor


@pytest.mark.parametrize("bits", [4, 2.5, 7])
def test_int8_tier_wide_k_fused(bits, monkeypatch):
    """The mul1 int8 tiers (i4 up to 4 rows, i8 up to 8) at wide k (input transform in shared memory, long int32
    sums) are exact within the fp16 path's tolerance, stream-k and fixed split, and i8 forced where i4 runs."""
    gen = torch.Generator(device=DEV).manual_seed(int(bits * 10))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for k, sizes in ((8192, [256, 128]), (28672, [384])):
        n = sum(sizes)
        trellis, suh, svh, bias = _layer(k, n, bits, len(sizes), gen)
        w64 = _dense64(trellis, suh, svh, 2, sizes)
        sh = suh if len(sizes) > 1 else suh[0]
        for m in (1, 3, 4, 5, 8):
            assert kop.plan(m, k, n, bits, sms, codebook=2).tier == ("i4" if m <= 4 else "i8")
            assert kop.plan(m, k, n, bits, sms, codebook=2).stream > 0
            for dt in DTYPES:
                x = (torch.randn(m, k, device=DEV, generator=gen) * 3).to(dt)
                ref = x.double() @ w64 + bias.double()
                floor = _rel(ref.to(dt), ref)
                out = torch.full((m, n), float("nan"), dtype=dt, device=DEV)
                kop.linear_cuda(x, trellis, sh, svh, bias, sizes, 2, out=out)
                monkeypatch.setenv("EXL3_VLLM_DISABLE", "i4,i8")
                fp = kop.linear_cuda(x, trellis, sh, svh, bias, sizes, 2)
                monkeypatch.setenv("EXL3_VLLM_DISABLE", "streamk")
                fixed = kop.linear_cuda(x, trellis, sh, svh, bias, sizes, 2)
                monkeypatch.delenv("EXL3_VLLM_DISABLE")
                other = ""
                if m <= 4:
                    monkeypatch.setenv("EXL3_VLLM_TIER", "i8")
                    y8 = torch.full((m, n), float("nan"), dtype=dt, device=DEV)
                    kop.linear_cuda(x, trellis, sh, svh, bias, sizes, 2, out=y8)
                    monkeypatch.delenv("EXL3_VLLM_TIER")
                    torch.cuda.synchronize()
                    err8 = _rel(y8, ref)
                    other = f" i8 forced err={err8:.3e} (bit-identical to i4: {torch.equal(y8, out)})"
                    assert not torch.isnan(y8).any() and err8 <= TOL + floor, (k, m, dt, err8)
                torch.cuda.synchronize()
                err, err_fp, err_fixed = _rel(out, ref), _rel(fp, ref), _rel(fixed, ref)
                _report(f"int8 tier {kop.plan(m, k, n, bits, sms, codebook=2).tier} K={bits:g} k={k} m={m} "
                        f"{str(dt)[6:]} stream-k err={err:.3e} fixed-split err={err_fixed:.3e} (fp16 tier "
                        f"{err_fp:.3e}){other}")
                assert not torch.isnan(out).any() and err <= TOL + floor, (k, m, dt, err)
                assert err_fixed <= TOL + floor, (k, m, dt, err_fixed)


def test_reference_backend_env(monkeypatch):
    gen = torch.Generator(device=DEV).manual_seed(3)
    trellis, suh, svh, _ = _layer(256, 256, 3, 1, gen)
    x = torch.randn(4, 256, device=DEV, generator=gen).half()
    monkeypatch.setenv("EXL3_VLLM_BACKEND", "reference")
    a = torch.ops.exl3.linear(x, trellis, suh[0], svh, None, [256], 1)
    monkeypatch.setenv("EXL3_VLLM_BACKEND", "auto")
    b = torch.ops.exl3.linear(x, trellis, suh[0], svh, None, [256], 1)
    assert _rel(b, a.double()) < 2e-3


@pytest.mark.parametrize("m", [1, 16, 64, 512])
def test_cuda_graph_replay_equals_eager(m, monkeypatch):
    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    gen = torch.Generator(device=DEV).manual_seed(11 + m)
    k, sizes = 2048, [512, 256]
    n = sum(sizes)
    trellis, suh, svh, bias = _layer(k, n, 4, 2, gen)
    kop.prepare(k, n, 4, 2, 512, DEV, sizes)
    x = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
    eager = torch.ops.exl3.linear(x, trellis, suh, svh, bias, sizes, 2).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.exl3.linear(x, trellis, suh, svh, bias, sizes, 2)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.ops.exl3.linear(x, trellis, suh, svh, bias, sizes, 2)
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    x.copy_(torch.randn(m, k, device=DEV, generator=gen).bfloat16())
    g.replay()
    eager2 = torch.ops.exl3.linear(x, trellis, suh, svh, bias, sizes, 2)
    torch.cuda.synchronize()
    assert torch.equal(y, eager2)


@pytest.mark.parametrize("m", [1, 8, 48, 128])
def test_deterministic_bit_exact(m, monkeypatch):
    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    gen = torch.Generator(device=DEV).manual_seed(5 + m)
    k, n = 4096, 1024
    trellis, suh, svh, bias = _layer(k, n, 3, 1, gen)
    x = torch.randn(m, k, device=DEV, generator=gen).half()
    p = kop.plan(m, k, n, 3, torch.cuda.get_device_properties(0).multi_processor_count)
    assert p.path == "dequant" or p.splits > 1, p
    first = torch.ops.exl3.linear(x, trellis, suh[0], svh, bias, [n], 1)
    for _ in range(19):
        assert torch.equal(torch.ops.exl3.linear(x, trellis, suh[0], svh, bias, [n], 1), first)


@pytest.mark.parametrize("tier", ["x64", "x128", "x256", "w64", "w16"])
def test_deterministic_forced_hopper_tier(tier, monkeypatch):
    """Deterministic mode with a Hopper tier forced: partial sums through the split slots and the reduction kernel
    (never the atomics or stream-k), exact against the reference and bit-identical over 20 runs."""
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the wg tiers are sm_90a only")
    _check_deterministic_forced(monkeypatch, tier, kop.TIERS[tier].bm + 3, 31, arch=90, col_align=256)


@pytest.mark.parametrize("tier,m", [("i4", 3), ("i8", 7)])
def test_deterministic_int8_tiers(tier, m, monkeypatch):
    """Deterministic mode with an int8 tier forced: split slots + reduction kernel, exact and bit-identical over 20 runs."""
    _check_deterministic_forced(monkeypatch, tier, m, 37 + m)


def _check_deterministic_forced(monkeypatch, tier, m, seed, **plan_kw):
    """Deterministic mode with `tier` forced on a fused 4096 x [256, 256] layer: split slots and the reduction kernel
    (never atomics or stream-k), exact against the reference and bit-identical over 20 runs."""
    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    monkeypatch.setenv("EXL3_VLLM_TIER", tier)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k, sizes, cb = 4096, [256, 256], 2
    n = sum(sizes)
    trellis, suh, svh, bias = _layer(k, n, 4, len(sizes), gen)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    p = kop.plan(m, k, n, 4, sms, codebook=cb, **plan_kw)
    assert p.tier == tier and p.splits > 1 and not p.stream, p
    x = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
    ref = x.double() @ _dense64(trellis, suh, svh, cb, sizes) + bias.double()
    first = torch.full((m, n), float("nan"), dtype=x.dtype, device=DEV)
    kop.linear_cuda(x, trellis, suh, svh, bias, sizes, cb, out=first)
    torch.cuda.synchronize()
    err = _rel(first, ref)
    _report(f"deterministic {tier} forced (splits {p.splits}, m={m}): rel_err={err:.3e}")
    assert err <= TOL + _rel(ref.to(x.dtype), ref)
    for _ in range(19):
        assert torch.equal(kop.linear_cuda(x, trellis, suh, svh, bias, sizes, cb), first)


def test_x_view_at_odd_offset():
    """x a contiguous view starting 2 bytes into its storage (the kernels read x in 8- and 16-byte words): the op
    copies it to an aligned buffer instead of faulting, whichever input transform the tier uses (int8, fp16, staged)."""
    gen = torch.Generator(device=DEV).manual_seed(31)
    k, sizes = 1024, [256, 128]
    n = sum(sizes)
    for bits, cb, m in ((4, 2, 3), (3, 1, 5), (4, 1, 40)):
        trellis, suh, svh, bias = _layer(k, n, bits, len(sizes), gen)
        w64 = _dense64(trellis, suh, svh, cb, sizes)
        for dt in DTYPES:
            x = torch.randn(m * k + 1, device=DEV, generator=gen).to(dt)[1:].view(m, k)
            assert x.data_ptr() % 4 == 2
            b = bias.to(dt)
            ref = x.double() @ w64 + b.double()
            out = torch.full((m, n), float("nan"), dtype=dt, device=DEV)
            kop.linear_cuda(x, trellis, suh, svh, b, sizes, cb, out=out)
            torch.cuda.synchronize()
            assert _rel(out, ref) <= TOL + _rel(ref.to(dt), ref), (bits, cb, m, dt)


@pytest.mark.parametrize("tier", ["h8", "h16", "i4", "i8"])
def test_odd_k_takes_k8_twin(tier, monkeypatch):
    """k not a multiple of 256 (640, 1152, 4736): the 16-step-stage tiers hand over to their 8-step twins, fixed
    split-k and stream-k, fused input or not, fused shards; every k16 step counts (a dropped half stage would miss the
    reference by far more than the tolerance)."""
    monkeypatch.setenv("EXL3_VLLM_TIER", tier)
    gen = torch.Generator(device=DEV).manual_seed(41)
    cb = 2 if tier.startswith("i") else 1
    bm = kop.TIERS[tier].bm
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sizes = [256, 128]
    n = sum(sizes)
    worst = 0.0
    for k in (640, 1152, 4736):
        trellis, suh, svh, bias = _layer(k, n, 4, len(sizes), gen)
        w64 = _dense64(trellis, suh, svh, cb, sizes)
        assert kop.plan(bm, k, n, 4, sms, codebook=cb, col_align=128, force=tier).tier == tier + "k8"
        for m in sorted({1, 3, bm}):
            for dt in DTYPES:
                err, floor, nan = _run_vs_ref(m, dt, gen, trellis, suh, svh, bias, sizes, cb, w64)
                worst = max(worst, err)
                assert not nan and err <= TOL + floor, (tier, k, m, dt, err, floor)
    _report(f"{tier} at odd k -> {tier}k8: max_rel_err={worst:.3e}")


def _odd_view(t):
    """The same values as t in a contiguous view that starts 2 bytes into its storage."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view_as(t).copy_(t)


@pytest.mark.parametrize("tier", ["h8", "m64", "x64", "dequant"])
def test_scales_and_bias_at_odd_offset(tier, monkeypatch):
    """suh, svh and bias as views 2 bytes into their storage (the kernels read them in 8-byte words): the op copies
    them to aligned buffers, so the output is bit-identical to aligned inputs' (deterministic mode); a trellis view
    off a 16-byte boundary is a clear error instead of a misaligned-address fault."""
    if tier == "x64" and torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the wg tiers are sm_90a only")
    monkeypatch.setenv("EXL3_VLLM_TIER", tier)
    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    gen = torch.Generator(device=DEV).manual_seed(37)
    k, sizes = 1024, [256, 128]
    n = sum(sizes)
    trellis, suh, svh, bias = _layer(k, n, 4, len(sizes), gen)
    for dt in DTYPES:
        x = torch.randn(40, k, device=DEV, generator=gen).to(dt)
        b = bias.to(dt)
        want = kop.linear_cuda(x, trellis, suh, svh, b, sizes, 2)
        o_suh, o_svh, o_b = _odd_view(suh), _odd_view(svh), _odd_view(b)
        assert o_suh.data_ptr() % 4 == 2 and o_svh.data_ptr() % 4 == 2 and o_b.data_ptr() % 4 == 2
        got = kop.linear_cuda(x, trellis, o_suh, o_svh, o_b, sizes, 2)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (tier, dt)
    with pytest.raises(kop.KernelError, match="16-byte boundary"):
        kop.linear_cuda(x, _odd_view(trellis), suh, svh, b, sizes, 2)


@pytest.mark.parametrize("tier", ["h8", "h16"])
def test_fused_input_equals_transform_kernel(tier, monkeypatch):
    """h8 / h16 transforming their own rows of x (the "fx" twins) against the same plan after the input-transform
    kernel: bit-identical in deterministic mode (same arithmetic) and exact against the reference, over blocks of 1,
    4 and 8 stages, partial and full row blocks, fused shards with their own suh, both dtypes, x at an odd offset."""
    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bm = kop.TIERS[tier].bm
    gen = torch.Generator(device=DEV).manual_seed(bm + 77)
    k, sizes = 4096, [128, 256, 128]
    n = sum(sizes)
    worst, runs = 0.0, 0
    for bits, cb in ((4, 2), (3, 1), (2, 0)):
        trellis, suh, svh, bias = _layer(k, n, bits, len(sizes), gen)
        w64 = _dense64(trellis, suh, svh, cb, sizes)
        for splits in (2, 4, 16):
            force = f"{tier}:s{splits}"
            for m in (1, 3, bm):
                p = kop.plan(m, k, n, bits, sms, codebook=cb, arch=90, col_align=128, force=force)
                assert p.steps_per_split == 256 // splits and not p.stream, p
                for dt in DTYPES:
                    x = torch.randn(m * k + 1, device=DEV, generator=gen).to(dt)
                    x = x[1:].view(m, k) if m == 3 else x[:-1].view(m, k)
                    b = bias.to(dt)
                    outs = []
                    for limit in ("all", "0"):
                        monkeypatch.setenv("EXL3_VLLM_FUSED_INPUT", limit)
                        assert kop.fused_input(kop.TIERS[tier], p, m, n, bits, sms, 227 * 1024) == (limit != "0")
                        out = torch.full((m, n), float("nan"), dtype=dt, device=DEV)
                        kop.linear_cuda(x, trellis, suh, svh, b, sizes, cb, out=out, force=force)
                        outs.append(out)
                    torch.cuda.synchronize()
                    ref = x.double() @ w64 + b.double()
                    err = _rel(outs[0], ref)
                    worst = max(worst, err)
                    runs += 1
                    assert torch.equal(outs[0], outs[1]), (bits, cb, force, m, dt)
                    assert err <= TOL + _rel(ref.to(dt), ref) and not torch.isnan(outs[0]).any(), (bits, cb, force, m)
    _report(f"fused input {tier}: {runs} calls bit-identical to the transform kernel, max_rel_err={worst:.3e}")


def test_bad_input_errors():
    gen = torch.Generator(device=DEV).manual_seed(1)
    trellis, suh, svh, _ = _layer(256, 256, 4, 1, gen)
    with pytest.raises(kop.KernelError, match="x must be fp16 or bf16"):
        kop.linear_cuda(torch.randn(2, 256, device=DEV), trellis, suh[0], svh, None, [256], 2)
    with pytest.raises(kop.KernelError, match="suh"):
        kop.linear_cuda(torch.randn(2, 256, device=DEV).half(), trellis, suh[0].float(), svh, None, [256], 2)
    with pytest.raises(kop.KernelError, match="half-integer"):
        t2 = torch.randint(-32768, 32768, (16, 16, 40), dtype=torch.int16, device=DEV)
        kop.linear_cuda(torch.randn(2, 256, device=DEV).half(), t2, suh[0], svh, None, [256], 0)
