"""GPU checks of the grouped EXL3 MoE kernel (kernels.moe.moe_cuda) against an fp64 reference (CUDA machine)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_report import rel as _rel, report as _report  # noqa: E402
from exl3_vllm.format.hadamard import hadamard_128  # noqa: E402
from exl3_vllm.format.reconstruct import w_hat  # noqa: E402
from exl3_vllm.kernels import KernelError  # noqa: E402
from exl3_vllm.kernels import moe as kmoe  # noqa: E402

E, TOPK, K, I = 128, 8, 1024, 384  # experts, routed experts per token, expert input width, intermediate width
TS = (1, 2, 3, 8, 16, 33, 64, 128, 257, 1024, 4096)
DTYPES = (torch.float16, torch.bfloat16)
IDS_DTYPES = (torch.int32, torch.int64)
TOL = 1e-3
DEV = torch.device("cuda")
INST3, MCG, MUL1 = 0, 1, 2
# suh as _layer in test_kernels_gpu; svh 10x larger so gate/up/down outputs are O(0.1..1) as in a real MLP
# (silu in its non-linear range, fp16 outputs far from subnormals).
SUH_SCALE, SVH_SCALE = 0.05, 0.5

# name -> (w13 groups, w2 groups); a group is (K bits, codebook, first expert, end expert).
CONFIGS = {
    "4-mul1": ([(4, MUL1, 0, E)], [(4, MUL1, 0, E)]),
    "4-mcg": ([(4, MCG, 0, E)], [(4, MCG, 0, E)]),
    "3-3inst": ([(3, INST3, 0, E)], [(3, INST3, 0, E)]),
    "2.5-mul1": ([(2.5, MUL1, 0, E)], [(2.5, MUL1, 0, E)]),
    "mixed": ([(4, MUL1, 0, E // 2), (3, MCG, E // 2, E)], [(5, MUL1, 0, E)]),
}


class Stack(NamedTuple):
    """One projection of every expert, in moe_cuda's argument order (trellis, codebooks, where, suh, svh)."""
    trellis: list
    codebooks: list
    where: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor


def _sv(shape, scale, gen):
    sign = torch.where(torch.rand(*shape, device=DEV, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * (0.5 + torch.rand(*shape, device=DEV, generator=gen)) * scale).half()


def _stack(groups, k, n, shards, gen):
    """Random trellises grouped by (K, codebook); where[e] = (group, index of e in the group)."""
    trellis, codebooks = [], []
    where = torch.empty(E, 2, dtype=torch.int32)
    for g, (bits, cb, lo, hi) in enumerate(groups):
        experts = list(range(lo, hi))
        if len(groups) > 1:
            experts.reverse()  # index in group != expert - lo, so a kernel ignoring where[:, 1] fails
        w = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
        trellis.append(torch.randint(-32768, 32768, (len(experts), k // 16, n // 16, w), dtype=torch.int16,
                                     device=DEV, generator=gen))
        codebooks.append(cb)
        for i, e in enumerate(experts):
            where[e] = torch.tensor([g, i])
    suh = _sv((E, shards, k) if shards > 1 else (E, k), SUH_SCALE, gen)
    return Stack(trellis, codebooks, where.to(DEV), suh, _sv((E, n), SVH_SCALE, gen))


def _experts(name, gen):
    g13, g2 = CONFIGS[name]
    return _stack(g13, K, 2 * I, 2, gen), _stack(g2, I, K, 1, gen)


def _prepare(w13, w2, max_tokens):
    kmoe.prepare_moe(w13.trellis, w13.codebooks, w2.trellis, w2.codebooks, E, TOPK, max_tokens, DEV)


def _dense64(st, shards):
    """Every expert's original-basis W [E, k, n] in fp64 (each shard of n scaled by its own suh)."""
    _, kt, nt, _ = st.trellis[0].shape
    k, n = kt * 16, nt * 16
    h = hadamard_128(torch.float64, DEV)
    out = torch.empty(E, k, n, dtype=torch.float64, device=DEV)
    where = st.where.tolist()
    for g, (tr, cb) in enumerate(zip(st.trellis, st.codebooks)):
        eg, _, _, width = tr.shape
        # Tiles decode independently: decode the whole group side by side along n in one call.
        wh = w_hat(tr.permute(1, 0, 2, 3).reshape(kt, eg * nt, width), cb)
        wh = wh.reshape(k, eg, n).permute(1, 0, 2).double()
        wh = (h @ wh.reshape(eg, k // 128, 128, n)).reshape(eg, k, n)
        wh = (wh.reshape(eg, k, n // 128, 128) @ h).reshape(eg, k, n)
        experts = sorted((i, e) for e, (gg, i) in enumerate(where) if gg == g)
        out[torch.tensor([e for _, e in experts], device=DEV)] = wh
    suh = st.suh.double().reshape(E, shards, k).permute(0, 2, 1)[..., None]  # [E, k, shards, 1]
    out = (out.reshape(E, k, shards, n // shards) * suh).reshape(E, k, n)
    return out * st.svh.double()[:, None, :]


def _route(t, gen, ids_dtype, drop=0.0):
    """Distinct top-k experts per token, softmax weights; a `drop` share of slots (never slot 0) set to -1."""
    ids = torch.rand(t, E, device=DEV, generator=gen).topk(TOPK, dim=1).indices
    w = torch.softmax(torch.randn(t, TOPK, device=DEV, generator=gen) * 2, dim=1)
    if drop:
        off = torch.rand(t, TOPK, device=DEV, generator=gen) < drop
        off[:, 0] = False  # every row keeps one local expert, so no reference row is all zeros
        ids = ids.masked_fill(off, -1)
    return w.float(), ids.to(ids_dtype)


def _reference(x, w, ids, w13, w2, inter_valid=-1, weights_on_input=False):
    """(fp64 result, emulation in x.dtype) routed rows only, one expert at a time.

    The emulation rounds to x.dtype where the kernel has to: the expert input (x*w when weights_on_input),
    gate/up outputs, the down input silu(g)*u, each expert's down output, and the final sum.
    """
    dt = x.dtype
    t, hidden = x.shape
    k = w13.shape[1]
    xq = F.pad(x, (0, k - hidden)).double()  # missing input columns count as zeros
    ref = torch.zeros(t, hidden, dtype=torch.float64, device=DEV)
    emu = torch.zeros_like(ref)
    flat = ids.reshape(-1).long()
    slots = ((flat >= 0) & (flat < E)).nonzero().squeeze(1)
    experts, order = flat[slots].sort(stable=True)
    slots = slots[order]
    rows_all, w_all = slots // TOPK, w.reshape(-1)[slots].double()
    start = 0
    for e, c in enumerate(torch.bincount(experts, minlength=E).tolist()):
        if c == 0:
            continue
        rows, we = rows_all[start:start + c], w_all[start:start + c]
        start += c
        x64 = xq[rows]
        xe = x64
        coef = we[:, None]
        if weights_on_input:
            x64 = x64 * coef
            xe = x64.to(dt).double()
            coef = torch.ones_like(coef)
        for inp, acc, rnd in ((x64, ref, lambda v: v), (xe, emu, lambda v: v.to(dt).double())):
            gu = rnd(inp @ w13[e])
            a = F.silu(gu[:, :I]) * gu[:, I:]
            if inter_valid >= 0:
                a[:, inter_valid:] = 0  # padding columns of the intermediate count as zeros
            acc.index_add_(0, rows, coef * rnd(rnd(a) @ w2[e])[:, :hidden])
    return ref, emu.to(dt)


def _check(y, x, ref, emu, label, worst, key, fails):
    """Record err vs the fp64 reference; fail above TOL + the dtype's rounding floor, or on NaN/Inf."""
    torch.cuda.synchronize()
    assert y.shape == ref.shape and y.dtype == x.dtype and y.device == x.device, \
        f"{label}: got {tuple(y.shape)} {y.dtype} {y.device}, want {tuple(ref.shape)} {x.dtype} {x.device}"
    err, floor = _rel(y, ref), _rel(emu, ref)
    finite = bool(torch.isfinite(y).all())
    if key not in worst or err > worst[key][0]:
        worst[key] = (err, floor)
    if not (finite and err <= TOL + floor):
        fails.append(f"{label}: err {err:.2e} (rounding floor {floor:.2e}){'' if finite else ' NON-FINITE'}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_matches_reference(name):
    gen = torch.Generator(device=DEV).manual_seed(sum(map(ord, name)))
    w13, w2 = _experts(name, gen)
    d13, d2 = _dense64(w13, 2), _dense64(w2, 1)
    _prepare(w13, w2, max(TS))
    worst, fails = {}, []
    for i, t in enumerate(TS):
        for dt in DTYPES:
            x = torch.randn(t, K, device=DEV, generator=gen).to(dt)
            w, ids = _route(t, gen, IDS_DTYPES[i % 2])
            y = kmoe.moe_cuda(x, w, ids, *w13, *w2)
            ref, emu = _reference(x, w, ids, d13, d2)
            _check(y, x, ref, emu, f"{name} T={t} {dt} ids {ids.dtype}", worst, dt, fails)
    for dt, (e, f) in sorted(worst.items(), key=str):
        _report(f"moe {name:8s} {str(dt)[6:]:8s} max_rel_err={e:.3e} (floor there {f:.3e})")
    assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("threads", [None, 512, 1024])
@pytest.mark.parametrize("weights_on_input", [False, True])
def test_moe_options(weights_on_input, threads, monkeypatch):
    """x narrower than k, padded intermediate (inter_valid), experts on other ranks (-1), Llama-4 weighting; threads:
    the int8 input kernels (T <= 16 here) at that block size instead of the default (bench_moe --input-threads)."""
    if threads:
        monkeypatch.setattr(kmoe, "INPUT_THREADS", threads)
    assert kmoe.moe_plan(16, TOPK, E, K, 2 * I, I, K, [4], [MUL1], 132).tier.startswith("i8")
    gen = torch.Generator(device=DEV).manual_seed(21 + weights_on_input)
    w13, w2 = _experts("4-mul1", gen)
    d13, d2 = _dense64(w13, 2), _dense64(w2, 1)
    hidden, inter_valid = K - 64, I - 128
    _prepare(w13, w2, 300)
    worst, fails = {}, []
    for i, t in enumerate((1, 5, 16, 300)):
        for dt in (torch.bfloat16, torch.float16):
            x = torch.randn(t, hidden, device=DEV, generator=gen).to(dt)
            w, ids = _route(t, gen, IDS_DTYPES[i % 2], drop=0.25)
            y = kmoe.moe_cuda(x, w, ids, *w13, *w2, inter_valid=inter_valid, weights_on_input=weights_on_input)
            ref, emu = _reference(x, w, ids, d13, d2, inter_valid, weights_on_input)
            _check(y, x, ref, emu, f"T={t} {dt} ids {ids.dtype}", worst, dt, fails)
    for dt, (e, f) in sorted(worst.items(), key=str):
        _report(f"moe options hidden={hidden} inter_valid={inter_valid} weights_on_input={weights_on_input} "
                f"threads={threads or kmoe.INPUT_THREADS} {str(dt)[6:]:8s} max_rel_err={e:.3e} (floor there {f:.3e})")
    assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("name,opts", [("4-mul1", False), ("mixed", False), ("4-mcg", True)])
def test_moe_recon_path_matches_reference(name, opts, monkeypatch):
    """The large-M path (EXL3_VLLM_TIER=dequant, bf16): dense expert weights per range of experts, grouped GEMMs.
    Its floor is the emulation with weights rounded to bf16 as the path stores them; ranges of 5 experts, so a
    layer takes many; opts: x narrower than k, padded intermediate, experts on other ranks, Llama-4 weighting."""
    monkeypatch.setenv("EXL3_VLLM_TIER", "dequant")
    monkeypatch.setenv("EXL3_VLLM_DEQUANT_BYTES", str(5 * 2 * K * 2 * I))
    gen = torch.Generator(device=DEV).manual_seed(sum(map(ord, name)) + 7)
    w13, w2 = _experts(name, gen)
    d13, d2 = _dense64(w13, 2), _dense64(w2, 1)
    r13, r2 = d13.to(torch.bfloat16).double(), d2.to(torch.bfloat16).double()
    hidden, inter_valid = (K - 64, I - 128) if opts else (K, -1)
    worst, fails = {}, []
    for t, woi in ((1, False), (257, opts), (1024, False), (2048, opts)):
        x = torch.randn(t, hidden, device=DEV, generator=gen).to(torch.bfloat16)
        w, ids = _route(t, gen, IDS_DTYPES[t % 2], drop=0.25 if opts else 0.0)
        assert kmoe.recon_wanted(x)
        y = kmoe.moe_cuda(x, w, ids, *w13, *w2, inter_valid=inter_valid, weights_on_input=woi)
        ref, _ = _reference(x, w, ids, d13, d2, inter_valid, woi)
        _, emu = _reference(x, w, ids, r13, r2, inter_valid, woi)
        _check(y, x, ref, emu, f"{name} T={t} weights_on_input={woi}", worst, torch.bfloat16, fails)
    for dt, (e, f) in sorted(worst.items(), key=str):
        _report(f"moe recon {name:8s} opts={opts} {str(dt)[6:]:8s} max_rel_err={e:.3e} (floor there {f:.3e})")
    assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_moe_graph_replay_equals_eager(t, monkeypatch):
    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    gen = torch.Generator(device=DEV).manual_seed(31 + t)
    w13, w2 = _experts("mixed", gen)
    _prepare(w13, w2, 512)
    x = torch.randn(t, K, device=DEV, generator=gen).bfloat16()
    w, ids = _route(t, gen, torch.int64)
    eager = kmoe.moe_cuda(x, w, ids, *w13, *w2).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kmoe.moe_cuda(x, w, ids, *w13, *w2)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = kmoe.moe_cuda(x, w, ids, *w13, *w2)
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    # New inputs and a new routing written in place: the graph must read them, not the captured ones.
    w_new, ids_new = _route(t, gen, torch.int64)
    x.copy_(torch.randn(t, K, device=DEV, generator=gen).bfloat16())
    w.copy_(w_new)
    ids.copy_(ids_new)
    y.fill_(float("nan"))
    g.replay()
    eager2 = kmoe.moe_cuda(x, w, ids, *w13, *w2)
    torch.cuda.synchronize()
    assert torch.equal(y, eager2)
    assert not torch.equal(eager2, eager)


@pytest.mark.parametrize("t", [1, 64, 1024])
def test_moe_deterministic_bit_exact(t, monkeypatch):
    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    gen = torch.Generator(device=DEV).manual_seed(41 + t)
    w13, w2 = _experts("mixed", gen)
    _prepare(w13, w2, 1024)
    for dt in DTYPES:
        x = torch.randn(t, K, device=DEV, generator=gen).to(dt)
        w, ids = _route(t, gen, torch.int32)
        first = kmoe.moe_cuda(x, w, ids, *w13, *w2).clone()
        for _ in range(19):
            assert torch.equal(kmoe.moe_cuda(x, w, ids, *w13, *w2), first), (t, dt)


@pytest.mark.parametrize("t", [3, 16, 64])
def test_moe_and_linear_on_two_streams(t, monkeypatch):
    """vLLM runs a MoE layer's shared expert (our linear op) on a second stream while the routed experts (our MoE op)
    run on the first: with that stream registered as concurrent, in flight together each gives what it gives alone.
    Both queues are held behind a sleep so that they drain side by side."""
    from exl3_vllm.kernels import concurrent_stream
    from exl3_vllm.kernels import op as kop

    monkeypatch.setenv("EXL3_VLLM_DETERMINISTIC", "1")
    monkeypatch.setenv("EXL3_VLLM_TUNE", "0")
    gen = torch.Generator(device=DEV).manual_seed(51 + t)
    w13, w2 = _experts("4-mul1", gen)
    _prepare(w13, w2, 64)
    k, n = K, 2 * I  # the shared expert's gate|up shape
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), dtype=torch.int16, device=DEV, generator=gen)
    suh, svh = _sv((1, k), SUH_SCALE, gen), _sv((n,), SVH_SCALE, gen)
    kop.prepare(k, n, 4, MUL1, 64, DEV)
    x = torch.randn(t, K, device=DEV, generator=gen).bfloat16()
    w, ids = _route(t, gen, torch.int32)
    alone_moe = kmoe.moe_cuda(x, w, ids, *w13, *w2).clone()
    alone_lin = kop.linear_cuda(x, trellis, suh, svh, None, [n], MUL1).clone()
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    concurrent_stream(streams[1])  # as the plugin registers vLLM's auxiliary stream
    moe_out, lin_out = [], []
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)
    for _ in range(30):
        with torch.cuda.stream(streams[0]):
            moe_out.append(kmoe.moe_cuda(x, w, ids, *w13, *w2))
        with torch.cuda.stream(streams[1]):
            lin_out.append(kop.linear_cuda(x, trellis, suh, svh, None, [n], MUL1))
    torch.cuda.synchronize()
    bad_moe = sum(not torch.equal(y, alone_moe) for y in moe_out)
    bad_lin = sum(not torch.equal(y, alone_lin) for y in lin_out)
    assert torch.isfinite(alone_moe).all() and torch.isfinite(alone_lin).all()
    assert bad_moe == 0 and bad_lin == 0, f"T={t}: {bad_moe} MoE and {bad_lin} linear results of 30 differ"


def test_moe_bad_input():
    gen = torch.Generator(device=DEV).manual_seed(51)
    w13, w2 = _experts("4-mul1", gen)
    _prepare(w13, w2, 16)
    w, ids = _route(4, gen, torch.int32)
    with pytest.raises(KernelError):
        kmoe.moe_cuda(torch.randn(4, K, device=DEV), w, ids, *w13, *w2)
    with pytest.raises(KernelError):
        kmoe.moe_cuda(torch.randn(4, K, device=DEV).half(), w, ids[:, :TOPK // 2].contiguous(), *w13, *w2)
    # Views 2 bytes into their storage: a clear error instead of a misaligned-address fault.
    t0 = w13.trellis[0]
    odd = torch.empty(t0.numel() + 1, dtype=torch.int16, device=DEV)[1:].view_as(t0).copy_(t0)
    with pytest.raises(KernelError, match="16-byte boundary"):
        kmoe.moe_cuda(torch.randn(4, K, device=DEV).half(), w, ids, *w13._replace(trellis=[odd, *w13.trellis[1:]]), *w2)
    sv = w2.svh
    odd_sv = torch.empty(sv.numel() + 1, dtype=sv.dtype, device=DEV)[1:].view_as(sv).copy_(sv)
    with pytest.raises(KernelError, match="w2_svh starts 2 bytes"):
        kmoe.moe_cuda(torch.randn(4, K, device=DEV).half(), w, ids, *w13, *w2._replace(svh=odd_sv))
