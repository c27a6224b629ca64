"""torch.ops.exl3.linear: the EXL3 linear op (our CUDA kernels on GPU, the format reference elsewhere)."""

from __future__ import annotations

import ctypes
import itertools
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .. import settings
from ..format.codebook import Codebook
from . import library, nvrtc, tune
# The decisions live in dispatch.py; the names are re-exported here for callers of this op (tests, bench).
from .dispatch import (Choice, Plan, backend, bits_of, dequant_bytes, deterministic, fused_input, fused_input_work,  # noqa: F401
                       int8_ok, large_m, mma_tier, pdl_enabled, plan, switched_on, wg_enabled, wg_tier, ws_enabled,
                       ws_tier)
from .nvrtc import KernelError
from .runtime import BUF_DTYPES, MAX_SHARDS, ZERO_BUFS, Device, GemmArgs, device_for
from .variants import (INT8_MAX_M, IO_SOURCE, LINEAR_SOURCE, RECON_SMEM, TIERS, gemm_kernel_name,  # noqa: F401
                       linear_defines, whole_stages)


_CODEBOOKS = frozenset(int(c) for c in Codebook)


def _needs(p: Plan, m: int, k: int, n_total: int, shards: int) -> dict[str, int]:
    if p.path == "dequant":
        return {"wscratch": k * p.chunk}
    tier = TIERS[p.tier]
    need = {"xq": shards * (k // 16) * 256, "xmeta": shards * 32} if tier.int8 else {"xh": shards * m * k}
    need["counters"] = -(-m // tier.bm) * (n_total // 128)
    if p.splits > 1 or p.stream:
        need["ws_slots" if deterministic() else "ws_atomic"] = (p.splits if deterministic() else 1) * m * n_total
    return need


def plan_for(d: Device, m: int, k: int, n_total: int, bits: float, codebook: int, sizes: List[int]) -> Plan:
    """The plan a call on device d runs: EXL3_VLLM_TIER, else the measured choice for m's bucket unless a switch
    turned its tier off, else static."""
    force = settings.get("EXL3_VLLM_TIER")
    if not force:
        tuned = tune.choice(d, m, k, n_total, bits, codebook, sizes)
        force = tuned if tuned is not None and switched_on(tuned, d.arch) else ""
    return plan(m, k, n_total, bits, d.sms, d.smem_limit, codebook, d.arch, math.gcd(*sizes), force)


def prepare(k: int, n_total: int, bits: float, codebook: int, max_m: int,
            device: torch.device | int | str | None = None, shard_sizes: Optional[List[int]] = None) -> None:
    """Compile/load every kernel a layer may dispatch to, time the candidate paths per row bucket (once per layer
    shape and device, cached on disk) and reserve workspace for up to max_m rows.

    Call once per layer at load time, before any CUDA-graph capture.
    """
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        return
    d = device_for(dev.index if dev.index is not None else torch.cuda.current_device())
    sizes = list(shard_sizes) if shard_sizes else [n_total]
    shards = len(sizes)
    d.module(IO_SOURCE, None)
    d.module(LINEAR_SOURCE, linear_defines(bits, codebook))
    tune.ensure(d, k, n_total, bits, codebook, sizes, max_m)
    need: dict[str, int] = {}
    # Workspace grows with m within a path, so every m up to 256 and each bucket edge covers all calls.
    ms = sorted(set(range(1, min(max_m, max(256, large_m() + 1)) + 1)) |
                {b for b in tune.BUCKETS if b <= max_m} | {max_m})
    for m in ms:
        p = plan_for(d, m, k, n_total, bits, codebook, sizes)
        for name, v in _needs(p, m, k, n_total, shards).items():
            need[name] = max(need.get(name, 0), v)
    with d.lock:
        for name, v in need.items():
            d.reserve(name, v, BUF_DTYPES[name], zero=name in ZERO_BUFS)


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _check_cuda_args(x, trellis, suh, svh, bias, shard_sizes, codebook):
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise KernelError(f"exl3 linear: x must be fp16 or bf16 on CUDA, got {x.dtype}; cast it first")
    if trellis.dtype != torch.int16 or trellis.dim() != 3 or not trellis.is_contiguous():
        raise KernelError(f"exl3 linear: trellis must be a contiguous int16 [k/16, n/16, 16K] tensor, "
                          f"got {trellis.dtype} {tuple(trellis.shape)} contiguous={trellis.is_contiguous()}")
    k, n_total = trellis.shape[0] * 16, trellis.shape[1] * 16
    if k % 128 or n_total % 128:
        raise KernelError(f"exl3 linear: k={k} and n={n_total} must be multiples of 128")
    if x.shape[-1] != k:
        raise KernelError(f"exl3 linear: x has {x.shape[-1]} features, the trellis expects k={k}")
    sizes = list(shard_sizes) if shard_sizes else [n_total]
    if sum(sizes) != n_total or any(s <= 0 or s % 128 for s in sizes) or len(sizes) > MAX_SHARDS:
        raise KernelError(f"exl3 linear: shard_sizes {sizes} must be at most {MAX_SHARDS} positive multiples "
                          f"of 128 summing to n={n_total}")
    S = len(sizes)
    if suh.dtype != torch.float16 or suh.numel() != S * k:
        raise KernelError(f"exl3 linear: suh must be fp16 [{k}] or [{S}, {k}] (one row per shard), "
                          f"got {suh.dtype} {tuple(suh.shape)}")
    if svh.dtype != torch.float16 or svh.shape != (n_total,):
        raise KernelError(f"exl3 linear: svh must be fp16 [{n_total}], got {svh.dtype} {tuple(svh.shape)}")
    if bias is not None and bias.shape != (n_total,):
        raise KernelError(f"exl3 linear: bias must be [{n_total}], got {tuple(bias.shape)}")
    if codebook not in _CODEBOOKS:
        known = ", ".join(f"{int(c)} ({c.label})" for c in Codebook)
        raise KernelError(f"exl3 linear: codebook must be one of {known}, got {codebook}")
    bits = bits_of(trellis)
    if bits != int(bits) and codebook != Codebook.MUL1:
        raise KernelError(f"exl3 linear: K={bits} (half-integer) exists only with the mul1 codebook")
    for name, t in (("x", x), ("trellis", trellis), ("suh", suh), ("svh", svh), ("bias", bias)):
        if t is not None and t.device != trellis.device:
            raise KernelError(f"exl3 linear: {name} is on {t.device}, the trellis on {trellis.device}")
    if trellis.data_ptr() % 16:
        # The kernels copy trellis words in 16-byte chunks; a per-call copy of the layer would hide a slow path.
        raise KernelError(f"exl3 linear: the trellis starts {trellis.data_ptr() % 16} bytes past a 16-byte boundary "
                          f"(a view into a larger buffer?); pass trellis.clone() once at load")
    return k, n_total, sizes, bits


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when contiguous on a 16-byte boundary, else an aligned copy (the kernels read it in 8-byte words)."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


@dataclass
class _Recipe:
    """What a call of one shape launches, decided once per (shape, settings, measured choice): the plan, the
    kernels' handles, grids and shared memory, the workspace it needs and the GEMM's arguments besides the
    addresses. A call then only checks its tensors, takes its buffers and launches (steps outside CUDA graphs pay
    this host work on every layer)."""
    p: Plan
    io: object
    # dequant path: (first column, columns, [(shard, first column, columns, grid) of each shard's piece of the chunk])
    chunks: list = field(default_factory=list)
    recon_fn: object = None
    wts: tuple | None = None  # (the scratch buffer, each chunk's [k, cols] weight view for the GEMM); remade if it grew
    input: str = ""  # "i8", "xh" (a separate transform), or "" (fused into the GEMM)
    staged: bool = False  # xh in the ws tiers' bulk-copy layout
    input_fn: object = None
    xh_numel: int = 0
    counters: int = 0
    ws: str = ""
    ws_numel: int = 0
    args: GemmArgs | None = None
    fx: bool = False
    gemm_fn: object = None
    grid: tuple = ()
    block: tuple = ()
    smem: int = 0
    pdl: bool = False
    reduce_fn: object = None
    reduce_grid: tuple = ()


_RECIPES: dict[tuple, _Recipe] = {}
_MAX_RECIPES = 4096  # distinct row counts x layer shapes; cleared when full (a step of new sizes re-derives them)


def _recipe(d, bf: bool, m: int, k: int, n_total: int, bits: float, codebook: int, sizes: tuple, force) -> _Recipe:
    p = plan_for(d, m, k, n_total, bits, codebook, list(sizes)) if force is None else \
        plan(m, k, n_total, bits, d.sms, d.smem_limit, codebook, d.arch, math.gcd(*sizes), force)
    io = d.module(IO_SOURCE, None)
    lin = d.module(LINEAR_SOURCE, linear_defines(bits, codebook))
    r = _Recipe(p, io)
    if p.path == "dequant":
        r.recon_fn = lin.function("exl3_recon_bf16" if bf else "exl3_recon_f16", RECON_SMEM)
        ends = list(itertools.accumulate(sizes))
        for c0 in range(0, n_total, p.chunk):
            c1 = min(c0 + p.chunk, n_total)
            pieces = [(s, max(c0, e - w), min(c1, e) - max(c0, e - w)) for s, (w, e) in enumerate(zip(sizes, ends))
                      if e - w < c1 and e > c0]
            r.chunks.append((c0, c1 - c0, [(s, p0, pcols, recon_grid(d, pcols, k)) for s, p0, pcols in pieces]))
        return r
    tier = TIERS[p.tier]
    if not whole_stages(tier, k // 16, p.steps_per_split):
        raise KernelError(f"exl3 linear: tier {tier.name} runs {tier.ks} k16 steps per stage; k={k} with "
                          f"{p.steps_per_split} steps per split is not whole stages (use its k8 twin)")
    S = len(sizes)
    r.fx = fused_input(tier, p, m, n_total, bits, d.sms, d.smem_limit)
    if tier.int8:
        r.input, r.xh_numel = "i8", S * (k // 16) * 256
        r.input_fn = io.function("exl3_input_i8_bf16" if bf else "exl3_input_i8_f16", 4 * k)
    elif not r.fx:
        r.input, r.xh_numel, r.staged = "xh", S * m * k, bool(tier.ws)
    det = deterministic()
    mblocks = -(-m // tier.bm)
    ncb = n_total // 128
    r.counters = mblocks * ncb
    if p.splits > 1 or p.stream:
        r.ws, r.ws_numel = ("ws_slots", p.splits * m * n_total) if det else ("ws_atomic", m * n_total)
    a = r.args = GemmArgs()
    a.m, a.k, a.n_total = m, k, n_total
    a.splits, a.steps_per_split, a.mode = p.splits, p.steps_per_split, 1 if det else 0
    a.nshards = S
    end = 0
    for i, width in enumerate(sizes):
        end += width // 128
        a.shard_end[i] = end
    a.stream, a.dp = p.stream, p.dp
    a.mblocks = 1
    r.smem = tier.smem_fx(bits, p.steps_per_split) if r.fx else tier.smem(bits)
    r.gemm_fn = lin.function(gemm_kernel_name(tier.name + ("s" if p.stream else "fx" if r.fx else ""), bf), r.smem)
    r.grid = (p.stream, 1, mblocks) if p.stream else (n_total // tier.cols, p.splits, mblocks)
    r.block = (tier.threads, 1, 1)
    r.pdl = pdl_enabled(d.arch)
    if det and p.splits > 1:
        r.reduce_fn = io.function("exl3_reduce_bf16" if bf else "exl3_reduce_f16")
        r.reduce_grid = (ncb, -(-m // 8), 1)
    return r


def linear_cuda(x, trellis, suh, svh, bias, shard_sizes, codebook, out=None, force: Choice | str | None = None):
    """Our kernels.  x [..., k] fp16/bf16 -> [..., n_total] in x.dtype; force picks the path (dispatch.Choice)."""
    k, n_total, sizes, bits = _check_cuda_args(x, trellis, suh, svh, bias, shard_sizes, codebook)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    x2 = _aligned(x2)  # the kernels read x in 8- and 16-byte words
    m = x2.shape[0]
    y = out if out is not None else torch.empty(m, n_total, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n_total)
    suh = _aligned(suh)
    svh = _aligned(svh)
    d = device_for(x.device.index)
    bf = x.dtype == torch.bfloat16
    sizes = tuple(sizes)
    key = (d.index, bf, m, k, n_total, bits, codebook, sizes, force, tune.generation(), settings.call_key())
    r = _RECIPES.get(key)
    if r is None:
        r = _recipe(d, bf, m, k, n_total, bits, codebook, sizes, force)
        if len(_RECIPES) >= _MAX_RECIPES:
            _RECIPES.clear()
        _RECIPES[key] = r
    stream = torch.cuda.current_stream(x.device).cuda_stream
    if r.p.path == "dequant":
        _dequant_path(d, r, stream, x2, trellis, suh, svh, bias, y, k, n_total)
        return y.reshape(*lead, n_total)
    if bias is not None:
        bias = _aligned(bias.to(torch.float16))
    S = len(sizes)
    xmeta = None
    if r.input == "i8":
        xh = d.buf("xq", r.xh_numel, torch.int8, stream=stream)
        xmeta = d.buf("xmeta", S * 32, torch.float32, stream=stream)
        nvrtc.launch(r.input_fn, (INT8_MAX_M, S, 1), (1024, 1, 1), 4 * k, stream,
                     [ctypes.c_uint64(x2.data_ptr()), ctypes.c_int32(k), ctypes.c_uint64(suh.data_ptr()),
                      ctypes.c_uint64(xh.data_ptr()), ctypes.c_uint64(xmeta.data_ptr()), ctypes.c_int32(m),
                      ctypes.c_int32(k)])
    elif r.input == "xh":
        xh = d.buf("xh", r.xh_numel, torch.float16, stream=stream)
        launch_input(d, r.io, stream, x2, suh, xh, m, k, S, staged=r.staged)
    else:
        xh = x2  # fused: unused by the kernel; any valid pointer
    counters = d.buf("counters", r.counters, torch.int32, zero=True, stream=stream)
    ws = d.buf(r.ws, r.ws_numel, torch.float32, zero=r.ws in ZERO_BUFS, stream=stream) if r.ws else None
    a = GemmArgs.from_buffer_copy(r.args)
    a.xh, a.trellis, a.svh, a.bias, a.out = xh.data_ptr(), trellis.data_ptr(), svh.data_ptr(), _ptr(bias), y.data_ptr()
    a.ws, a.counters, a.xmeta = _ptr(ws), counters.data_ptr(), _ptr(xmeta)
    if r.fx:
        a.xraw, a.suh = x2.data_ptr(), suh.data_ptr()
    nvrtc.launch(r.gemm_fn, r.grid, r.block, r.smem, stream, [a], overlap_previous=r.pdl)
    if r.reduce_fn is not None:
        nvrtc.launch(r.reduce_fn, r.reduce_grid, (256, 1, 1), 0, stream,
                     [ctypes.c_uint64(ws.data_ptr()), ctypes.c_int32(r.p.splits), ctypes.c_int32(m),
                      ctypes.c_int32(n_total), ctypes.c_uint64(svh.data_ptr()), ctypes.c_uint64(_ptr(bias)),
                      ctypes.c_uint64(y.data_ptr())])
    return y.reshape(*lead, n_total)


def _forget_recipes() -> None:
    _RECIPES.clear()


tune.run_linear = linear_cuda
tune.forget_recipes = _forget_recipes


def launch_input(d, io, stream, x2, suh, xh, m, k, S, staged=False):
    """xh[s, r] = fp16(Hadamard-128(x[r] * suh[s])) for every shard s (one warp per 128 values, grid-strided);
    staged: in the ws tiers' bulk-copy layout instead (exl3_input.cuh)."""
    warps = S * m * (k // 128)
    name = "exl3_input_staged" if staged else "exl3_input"
    nvrtc.launch(io.function(f"{name}_bf16" if x2.dtype == torch.bfloat16 else f"{name}_f16"),
                 (min(-(-warps // 8), d.sms * 8), 1, 1), (256, 1, 1), 0, stream,
                 [ctypes.c_uint64(x2.data_ptr()), ctypes.c_int32(k), ctypes.c_uint64(suh.data_ptr()),
                  ctypes.c_uint64(xh.data_ptr()), ctypes.c_int32(m), ctypes.c_int32(k), ctypes.c_int32(S)])


def recon_grid(d, cols: int, k: int) -> tuple:
    units = (cols // 128) * (k // 128)
    # At least two units per block on small layers: a block loads its next unit while it finishes the current one.
    return (min(units, d.sms * 8, max(d.sms * 2, units // 2)), 1, 1)


def _recon(fn, grid, stream, trellis: int, suh_s: int, svh: int, wt: int, n_total, c0, cols, k):
    """The reconstruction kernel on raw addresses (suh_s: the shard's suh row, wt: the [cols, k] destination)."""
    nvrtc.launch(fn, grid, (256, 1, 1), RECON_SMEM, stream,
                 [ctypes.c_uint64(trellis), ctypes.c_uint64(suh_s), ctypes.c_uint64(svh), ctypes.c_uint64(wt),
                  ctypes.c_int32(n_total), ctypes.c_int32(c0), ctypes.c_int32(cols), ctypes.c_int32(k)])


def launch_recon(d, lin, stream, trellis, suh_s, svh, wt, n_total, c0, cols, k):
    """wt[cols, k] = the dense weight W[:, c0:c0+cols] transposed, in wt's dtype (suh_s: the shard's suh)."""
    fn = lin.function("exl3_recon_bf16" if wt.dtype == torch.bfloat16 else "exl3_recon_f16", RECON_SMEM)
    _recon(fn, recon_grid(d, cols, k), stream, trellis.data_ptr(), suh_s.data_ptr(), svh.data_ptr(), wt.data_ptr(),
           n_total, c0, cols, k)


def _dequant_path(d, r: _Recipe, stream, x2, trellis, suh, svh, bias, y, k, n_total):
    """Per column chunk (shards side by side): the dense weight in x's dtype (both Hadamards, suh and svh folded
    in), then y's columns = x @ W (+ bias) by cuBLAS straight into y: no pass over x or y besides the GEMM's own.
    The bias is added in x's dtype here (vLLM passes it in the model's dtype, so that is exact there)."""
    wbuf = d.buf("wscratch", k * r.p.chunk, torch.float16, stream=stream)
    if r.wts is None or r.wts[0] is not wbuf:  # each chunk's weight, as the GEMM reads it (views made once)
        w = wbuf.view(x2.dtype)
        r.wts = (wbuf, [w[:cols * k].view(cols, k).t() for _, cols, _ in r.chunks])
    if bias is not None:
        # Aligned, so that cuBLAS takes the same route whatever the caller's bias view (see the addmm below).
        bias = _aligned(bias.to(x2.dtype))
    tp, sp, vp, wp = trellis.data_ptr(), suh.data_ptr(), svh.data_ptr(), wbuf.data_ptr()
    for (c0, cols, pieces), wt_t in zip(r.chunks, r.wts[1]):
        for s, p0, pcols, grid in pieces:  # each shard's columns with its own suh (2-byte values: fp16 suh, wt)
            _recon(r.recon_fn, grid, stream, tp, sp + 2 * s * k, vp, wp + 2 * (p0 - c0) * k, n_total, p0, pcols, k)
        whole = cols == n_total
        out = y if whole else y[:, c0:c0 + cols]
        if bias is None:
            torch.mm(x2, wt_t, out=out)
        else:
            # A chunk that is all of y gets cuBLASLt's bias epilogue (one rounding) where the bias is aligned; into a
            # column slice of y cuBLAS rounds x @ W, then the sum (two): copying a fresh result into y costs more.
            torch.addmm(bias if whole else bias[c0:c0 + cols], x2, wt_t, out=out)


# ---------------------------------------------------------------------------------------------
# The op

def _reference(x, trellis, suh, svh, bias, shard_sizes, codebook):
    from ..format.linear import linear as ref_linear
    return ref_linear(x, trellis, suh, svh, int(codebook), bias=bias,
                      shard_sizes=list(shard_sizes) if shard_sizes else None, out_dtype=x.dtype)


def _linear_any(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                bias: Optional[torch.Tensor], shard_sizes: List[int], codebook: int) -> torch.Tensor:
    """y = x @ W (+ bias) for an EXL3 (possibly fused) layer; CPU and other devices use the reference."""
    return _reference(x, trellis, suh, svh, bias, shard_sizes, codebook)


def _linear_cuda(x, trellis, suh, svh, bias, shard_sizes, codebook):
    if backend() == "reference":
        return _reference(x, trellis, suh, svh, bias, shard_sizes, codebook)
    return linear_cuda(x, trellis, suh, svh, bias, shard_sizes, codebook)


def _linear_fake(x, trellis, suh, svh, bias, shard_sizes, codebook):
    n_total = trellis.shape[1] * 16
    torch._check(x.shape[-1] == trellis.shape[0] * 16, lambda: "x's last dimension must equal the layer's k")
    return x.new_empty((*x.shape[:-1], n_total))


linear = library.define("linear", _linear_any, _linear_fake, cuda=_linear_cuda)
