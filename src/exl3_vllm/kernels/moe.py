"""Grouped EXL3 experts on the GPU: routing into expert-aligned row blocks, one GEMM launch per projection and
(K, codebook) group, SwiGLU folded into the down projection's input transform, and a fixed-order combine."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import List, Sequence

import torch

from .. import settings
from ..format.codebook import Codebook
from . import library, nvrtc
from .nvrtc import KernelError
from .dispatch import DEQUANT, Choice, bits_of, deterministic, int8_ok, tier_on
from .runtime import BUF_DTYPES, ZERO_BUFS, GemmArgs, device_for
from .op import recon_grid
from .variants import (IO_SOURCE, LINEAR_SOURCE, MOE_SOURCE, RECON_SMEM, TIERS, for_k, gemm_kernel_name,
                       linear_defines, whole_stages)


@dataclass(frozen=True)
class MoePlan:
    tier: str            # one tier for both projections, so they share one row alignment
    bm: int              # rows per block
    max_blocks: int      # row blocks reserved: every pair's block plus one partial block per active expert
    splits13: int
    steps13: int
    splits2: int
    steps2: int

    @property
    def rows(self) -> int:
        return self.max_blocks * self.bm


def _splits(tier, est_blocks: int, k: int, slots: int) -> tuple[int, int]:
    """Split-k just large enough to fill the resident-block slots once (as the dense plan does)."""
    ktiles = k // 16
    splits = 1 if deterministic() else max(1, min(-(-slots // max(est_blocks, 1)), ktiles // tier.ks))
    steps = -(-ktiles // splits)
    steps = -(-steps // tier.ks) * tier.ks
    return -(-ktiles // steps), steps


def moe_plan(tokens: int, topk: int, n_experts: int, k13: int, n13: int, k2: int, n2: int,
             bits: Sequence[float], codebooks: Sequence[int], sms: int, smem_limit: int = 227 * 1024) -> MoePlan:
    """Tier from the average rows per active expert; mul1-only layers take the int8 tier up to 8 rows."""
    pairs = tokens * topk
    active = max(1, min(n_experts, pairs))
    avg = pairs / active
    force = settings.get("EXL3_VLLM_TIER")
    force = Choice.parse(force).tier if force else ""  # the experts take the tier; split options are the dense path's
    fp16 = [t for t in TIERS.values() if t.experts and not t.int8 and all(t.smem(b) <= smem_limit for b in bits)
            and tier_on(t)]
    if force and force != DEQUANT:
        if force not in TIERS or not TIERS[force].experts:
            raise KernelError(f"EXL3_VLLM_TIER={force!r} is not one of the MoE tiers "
                              f"{sorted(t for t in TIERS if TIERS[t].experts)}")
        tier = TIERS[force]
        if not tier_on(tier):
            raise KernelError(f"EXL3_VLLM_TIER={force} is a tier that EXL3_VLLM_DISABLE leaves out")
    elif (avg <= TIERS["i8"].bm and all(c == Codebook.MUL1 for c in codebooks)
          and int8_ok(1, max(k13, k2), 2, smem_limit) and tier_on(TIERS["i8"])):
        tier = TIERS["i8"]
    elif fp16:
        tier = next((t for t in fp16 if avg <= t.bm), fp16[-1])
    else:
        raise KernelError(f"EXL3_VLLM_DISABLE={settings.raw('EXL3_VLLM_DISABLE')} leaves no tier for the experts "
                          f"(they run on {sorted(t for t in TIERS if TIERS[t].experts and not TIERS[t].int8)})")
    if tier.int8 and not all(c == Codebook.MUL1 for c in codebooks):
        raise KernelError("EXL3_VLLM_TIER=i8 needs every expert on the mul1 codebook")
    tier = for_k(tier, math.gcd(k13, k2))  # one tier for both projections: whole stages of either k
    bm = tier.bm
    est = active * max(1, math.ceil(avg / bm))
    slots = sms * (2 if tier.threads <= 256 else 1)
    s13, st13 = _splits(tier, est * (n13 // 128), k13, slots)
    s2, st2 = _splits(tier, est * (n2 // 128), k2, slots)
    return MoePlan(tier.name, bm, -(-pairs // bm) + active, s13, st13, s2, st2)


def _check(x, topk_weights, topk_ids, w13_trellis, w13_codebooks, w13_where, w13_suh, w13_svh,
           w2_trellis, w2_codebooks, w2_where, w2_suh, w2_svh):
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2:
        raise KernelError(f"exl3 moe: x must be a 2-D fp16/bf16 CUDA tensor, got {x.dtype} {tuple(x.shape)} "
                          f"on {x.device}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise KernelError(f"exl3 moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                          f"{tuple(topk_weights.shape)} must both be [tokens={x.shape[0]}, topk]")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise KernelError(f"exl3 moe: topk_ids must be int32/int64 and topk_weights floating point, got "
                          f"{topk_ids.dtype} and {topk_weights.dtype}")
    E = w13_suh.shape[0]
    for name, tr, cbs, where in (("w13", w13_trellis, w13_codebooks, w13_where),
                                 ("w2", w2_trellis, w2_codebooks, w2_where)):
        if not tr or len(tr) != len(cbs):
            raise KernelError(f"exl3 moe: {name} needs one codebook per trellis group, got {len(tr)} groups and "
                              f"{len(cbs)} codebooks")
        for t in tr:
            if t.dtype != torch.int16 or t.dim() != 4 or not t.is_contiguous() or t.device != x.device:
                raise KernelError(f"exl3 moe: {name} trellis groups must be contiguous int16 [E_g, k/16, n/16, 16K] "
                                  f"on {x.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
            if t.data_ptr() % 16:
                raise KernelError(f"exl3 moe: a {name} trellis group starts {t.data_ptr() % 16} bytes past a 16-byte "
                                  "boundary (a view into a larger buffer?); pass a .clone() once at load")
        if where.dtype != torch.int32 or where.shape != (E, 2) or where.device != x.device:
            raise KernelError(f"exl3 moe: {name}_where must be int32 [{E}, 2] on {x.device} (group, index of each "
                              f"expert), got {where.dtype} {tuple(where.shape)} on {where.device}")
    k13, n13 = w13_trellis[0].shape[1] * 16, w13_trellis[0].shape[2] * 16
    k2, n2 = w2_trellis[0].shape[1] * 16, w2_trellis[0].shape[2] * 16
    inter = n13 // 2
    if any(t.shape[1:3] != w13_trellis[0].shape[1:3] for t in w13_trellis) or \
            any(t.shape[1:3] != w2_trellis[0].shape[1:3] for t in w2_trellis):
        raise KernelError("exl3 moe: every group of a projection must have the same k and n")
    if k2 != inter or n2 != k13 or k13 % 128 or inter % 128:
        raise KernelError(f"exl3 moe: gate/up are {k13}x{n13} and down {k2}x{n2}; need down = {inter}x{k13} and "
                          "k, intermediate width multiples of 128")
    hidden = x.shape[1]
    if hidden > k13 or hidden % 4:
        raise KernelError(f"exl3 moe: x has {hidden} features, the experts take at most {k13} (a multiple of 4)")
    shapes = {"w13_suh": (w13_suh, (E, 2, k13)), "w13_svh": (w13_svh, (E, n13)), "w2_suh": (w2_suh, (E, k2)),
              "w2_svh": (w2_svh, (E, n2))}
    for name, (t, shape) in shapes.items():
        if t.dtype != torch.float16 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != x.device:
            raise KernelError(f"exl3 moe: {name} must be contiguous fp16 {list(shape)} on {x.device}, got "
                              f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if t.data_ptr() % 8:
            raise KernelError(f"exl3 moe: {name} starts {t.data_ptr() % 8} bytes past an 8-byte boundary (a view into "
                              "a larger buffer?); pass a .clone() once at load")
    bits = [bits_of(t) for t in w13_trellis] + [bits_of(t) for t in w2_trellis]
    for b, c in zip(bits, list(w13_codebooks) + list(w2_codebooks)):
        linear_defines(b, c)  # raises for K/codebook pairs that do not exist
    return E, k13, n13, k2, n2, bits


def _needs(p: MoePlan, pairs: int, k13: int, n13: int, k2: int, n2: int) -> dict[str, int]:
    tier = TIERS[p.tier]
    rows = p.rows
    need = {"moe_pos": pairs, "moe_rows": rows, "moe_blocks": p.max_blocks, "moe_y": rows * max(n13, n2),
            "counters": p.max_blocks * max(n13, n2) // 128}
    if tier.int8:
        need["xq"] = 2 * p.max_blocks * (max(k13, k2) // 16) * 256
        need["xmeta"] = 2 * p.max_blocks * 32
    else:
        need["xh"] = rows * max(2 * k13, k2)
    if p.splits13 > 1 or p.splits2 > 1:
        need["ws_atomic"] = rows * max(n13, n2)
    return need


# Threads per block of the routed rows' input kernels (one block per row slot, shard and reserved row block): a row's
# k/16 quantization steps leave most of a 1024-thread block idle at every barrier.
INPUT_THREADS = 256
# Workspace shared with the dense op (xh, xq, xmeta, counters, ws_atomic) keeps its dtypes; the rest is ours.
_DTYPES = dict(BUF_DTYPES, moe_pos=torch.int32, moe_rows=torch.int32, moe_blocks=torch.int32, moe_y=torch.int16)


def prepare_moe(w13_trellis: List[torch.Tensor], w13_codebooks: List[int], w2_trellis: List[torch.Tensor],
                w2_codebooks: List[int], n_experts: int, topk: int, max_tokens: int,
                device: torch.device | int | str | None = None) -> None:
    """Compile every kernel an experts layer may use and reserve workspace for up to max_tokens; before capture."""
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        return
    d = device_for(dev.index if dev.index is not None else torch.cuda.current_device())
    d.module(IO_SOURCE, None)
    d.module(MOE_SOURCE, None)
    bits = [bits_of(t) for t in w13_trellis] + [bits_of(t) for t in w2_trellis]
    cbs = list(w13_codebooks) + list(w2_codebooks)
    for b, c in zip(bits, cbs):
        d.module(LINEAR_SOURCE, linear_defines(b, c))
    k13, n13 = w13_trellis[0].shape[1] * 16, w13_trellis[0].shape[2] * 16
    k2, n2 = w2_trellis[0].shape[1] * 16, w2_trellis[0].shape[2] * 16
    need: dict[str, int] = {}
    for t in range(1, max_tokens + 1):
        p = moe_plan(t, topk, n_experts, k13, n13, k2, n2, bits, cbs, d.sms, d.smem_limit)
        for name, v in _needs(p, t * topk, k13, n13, k2, n2).items():
            need[name] = max(need.get(name, 0), v)
    with d.lock:
        for name, v in need.items():
            d.reserve(name, v, _DTYPES[name], zero=name in ZERO_BUFS)


class _MoeGather(ctypes.Structure):
    _fields_ = [("block_expert", ctypes.c_uint64), ("row_src", ctypes.c_uint64), ("bm", ctypes.c_int32),
                ("x", ctypes.c_uint64), ("ldx", ctypes.c_int32), ("ncols", ctypes.c_int32), ("topk", ctypes.c_int32),
                ("suh", ctypes.c_uint64), ("S", ctypes.c_int32), ("k", ctypes.c_int32), ("wpair", ctypes.c_uint64)]


class _MoeSwiglu(ctypes.Structure):
    _fields_ = [("block_expert", ctypes.c_uint64), ("row_src", ctypes.c_uint64), ("bm", ctypes.c_int32),
                ("y13", ctypes.c_uint64), ("inter", ctypes.c_int32), ("valid", ctypes.c_int32),
                ("suh", ctypes.c_uint64)]


def _i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(v)


def _u64(v: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(v)


def _gemm(d, stream, bf, p: MoePlan, xin, trellis_groups, codebooks, where, svh, y, k, n, shard_sizes, splits,
          steps, blocks, xmeta):
    """One launch per (K, codebook) group; blocks of experts in other groups exit at once."""
    tier = TIERS[p.tier]
    ncb = n // 128
    counters = d.buf("counters", p.max_blocks * ncb, torch.int32, zero=True, stream=stream)
    ws = d.buf("ws_atomic", p.rows * n, torch.float32, zero=True, stream=stream) if splits > 1 else None
    for g, (tr, cb) in enumerate(zip(trellis_groups, codebooks)):
        bits = bits_of(tr)
        lin = d.module(LINEAR_SOURCE, linear_defines(bits, cb))
        a = GemmArgs()
        a.xh, a.trellis, a.svh, a.bias, a.out = xin.data_ptr(), tr.data_ptr(), svh.data_ptr(), 0, y.data_ptr()
        a.ws, a.counters = 0 if ws is None else ws.data_ptr(), counters.data_ptr()
        a.m, a.k, a.n_total = p.rows, k, n
        a.splits, a.steps_per_split, a.mode = splits, steps, 0
        a.nshards = len(shard_sizes)
        end = 0
        for i, s in enumerate(shard_sizes):
            end += s // 128
            a.shard_end[i] = end
        a.stream = 0
        a.xmeta = 0 if xmeta is None else xmeta.data_ptr()
        a.block_expert, a.expert_where = blocks.data_ptr(), where.data_ptr()
        a.expert_words = (k // 16) * (n // 16) * (tr.shape[-1] // 2)
        a.group, a.mblocks = g, p.max_blocks
        smem = tier.smem(bits)
        f = lin.function(gemm_kernel_name(tier.name, bf), smem)
        nvrtc.launch(f, (ncb, splits, p.max_blocks), (tier.threads, 1, 1), smem, stream, [a])


def moe_cuda(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             w13_trellis: List[torch.Tensor], w13_codebooks: List[int], w13_where: torch.Tensor,
             w13_suh: torch.Tensor, w13_svh: torch.Tensor,
             w2_trellis: List[torch.Tensor], w2_codebooks: List[int], w2_where: torch.Tensor,
             w2_suh: torch.Tensor, w2_svh: torch.Tensor,
             inter_valid: int = -1, weights_on_input: bool = False) -> torch.Tensor:
    """sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over each row's top-k local experts, in x's dtype.

    Graph-safe: every launch size follows from x's shape; routing stays on the device (_moe_recon, when asked for,
    is not, and is never taken during a capture).
    """
    E, k13, n13, k2, n2, bits = _check(x, topk_weights, topk_ids, w13_trellis, w13_codebooks, w13_where, w13_suh,
                                       w13_svh, w2_trellis, w2_codebooks, w2_where, w2_suh, w2_svh)
    T, hidden = x.shape
    topk = topk_ids.shape[1]
    out = torch.empty(T, hidden, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = x if x.is_contiguous() and x.data_ptr() % 8 == 0 else x.clone(memory_format=torch.contiguous_format)
    inter = n13 // 2
    valid = inter if inter_valid is None or inter_valid < 0 else min(inter_valid, inter)
    d = device_for(x.device.index)
    if recon_wanted(x):
        return _moe_recon(d, x, topk_weights, topk_ids, (w13_trellis, w13_codebooks, w13_where, w13_suh, w13_svh),
                          (w2_trellis, w2_codebooks, w2_where, w2_suh, w2_svh), E, k13, n13, k2, n2, valid,
                          weights_on_input, out)
    cbs = list(w13_codebooks) + list(w2_codebooks)
    p = moe_plan(T, topk, E, k13, n13, k2, n2, bits, cbs, d.sms, d.smem_limit)
    tier = TIERS[p.tier]
    if not whole_stages(tier, k13 // 16, p.steps13, k2 // 16, p.steps2):
        raise KernelError(f"exl3 moe: tier {tier.name} runs {tier.ks} k16 steps per stage; k13={k13} / k2={k2} "
                          f"are not whole stages (use its k8 twin)")
    pairs = T * topk
    stream = torch.cuda.current_stream(x.device).cuda_stream
    bf = x.dtype == torch.bfloat16
    sfx = "bf16" if bf else "f16"
    moe = d.module(MOE_SOURCE, None)
    ids = topk_ids.reshape(-1).to(torch.int32)
    w = topk_weights.reshape(-1).to(torch.float32)
    pos = d.buf("moe_pos", pairs, torch.int32, stream=stream)
    rows = d.buf("moe_rows", p.rows, torch.int32, stream=stream)
    blocks = d.buf("moe_blocks", p.max_blocks, torch.int32, stream=stream)
    nvrtc.launch(moe.function("exl3_moe_align", 12 * E), (1, 1, 1), (1024, 1, 1), 12 * E, stream,
                 [_u64(ids.data_ptr()), _i32(pairs), _i32(E), _i32(p.bm), _i32(p.max_blocks), _u64(pos.data_ptr()),
                  _u64(rows.data_ptr()), _u64(blocks.data_ptr())])
    ybuf = d.buf("moe_y", p.rows * max(n13, n2), torch.int16, stream=stream)
    y13 = ybuf[:p.rows * n13].view(x.dtype)
    gather = _MoeGather(blocks.data_ptr(), rows.data_ptr(), p.bm, x.data_ptr(), hidden, hidden, topk,
                        w13_suh.data_ptr(), 2, k13, w.data_ptr() if weights_on_input else 0)
    xmeta = None
    if tier.int8:
        xin = d.buf("xq", 2 * p.max_blocks * (max(k13, k2) // 16) * 256, torch.int8, stream=stream)
        xmeta = d.buf("xmeta", 2 * p.max_blocks * 32, torch.float32, stream=stream)
        nvrtc.launch(moe.function(f"exl3_moe_gather_i8_{sfx}", 4 * k13), (8, 2, p.max_blocks), (INPUT_THREADS, 1, 1),
                     4 * k13, stream, [gather, _u64(xin.data_ptr()), _u64(xmeta.data_ptr()), _i32(p.max_blocks),
                                       _i32(k13)])
    else:
        xin = d.buf("xh", p.rows * max(2 * k13, k2), torch.float16, stream=stream)
        warps = 2 * p.rows * (k13 // 128)
        nvrtc.launch(moe.function(f"exl3_moe_gather_{sfx}"), (-(-warps // 8), 1, 1), (256, 1, 1), 0, stream,
                     [gather, _u64(xin.data_ptr()), _i32(p.rows), _i32(k13), _i32(2)])
    _gemm(d, stream, bf, p, xin, w13_trellis, w13_codebooks, w13_where, w13_svh, y13, k13, n13, [inter, inter],
          p.splits13, p.steps13, blocks, xmeta)
    swiglu = _MoeSwiglu(blocks.data_ptr(), rows.data_ptr(), p.bm, y13.data_ptr(), inter, valid, w2_suh.data_ptr())
    if tier.int8:
        nvrtc.launch(moe.function(f"exl3_moe_swiglu_i8_{sfx}", 4 * k2), (8, 1, p.max_blocks), (INPUT_THREADS, 1, 1),
                     4 * k2, stream, [swiglu, _u64(xin.data_ptr()), _u64(xmeta.data_ptr()), _i32(p.max_blocks),
                                      _i32(k2)])
    else:
        warps = p.rows * (k2 // 128)
        nvrtc.launch(moe.function(f"exl3_moe_swiglu_{sfx}"), (-(-warps // 8), 1, 1), (256, 1, 1), 0, stream,
                     [swiglu, _u64(xin.data_ptr()), _i32(p.rows), _i32(k2)])
    # y13 is dead once the down input exists, so the down output reuses its buffer.
    y2 = ybuf[:p.rows * n2].view(x.dtype)
    _gemm(d, stream, bf, p, xin, w2_trellis, w2_codebooks, w2_where, w2_svh, y2, k2, n2, [n2], p.splits2, p.steps2,
          blocks, xmeta)
    _combine(moe, stream, y2, n2, pos, None if weights_on_input else w, topk, out)
    return out


def _combine(moe, stream, y: torch.Tensor, ldy: int, pos: torch.Tensor, w: torch.Tensor | None, topk: int,
             out: torch.Tensor) -> None:
    """out[t] = sum_j w[t, j] * y[pos[t, j]] (1 for w without weights; pos -1: an expert of another rank)."""
    sfx = "bf16" if out.dtype == torch.bfloat16 else "f16"
    nvrtc.launch(moe.function(f"exl3_moe_combine_{sfx}"), (out.shape[0], 1, 1), (256, 1, 1), 0, stream,
                 [_u64(y.data_ptr()), _i32(ldy), _u64(pos.data_ptr()), _u64(0 if w is None else w.data_ptr()),
                  _i32(topk), _i32(out.shape[1]), _u64(out.data_ptr())])


def recon_wanted(x: torch.Tensor) -> bool:
    """The large-M path (dense expert weights, then grouped GEMMs): asked for by EXL3_VLLM_TIER=dequant, for bf16
    outside CUDA-graph capture (its row ranges are read on the host). Not yet chosen by itself: unmeasured."""
    force = settings.get("EXL3_VLLM_TIER")
    return (bool(force) and Choice.parse(force).tier == DEQUANT and x.dtype == torch.bfloat16
            and not torch.cuda.is_current_stream_capturing())


def _recon_experts(d, stream, stack, suh_stride, wt, e0, e1, n, k, shards):
    """wt[e - e0] = expert e's dense weight [n, k] (both Hadamards, suh and svh folded in) for e in [e0, e1); stack:
    (trellis groups, codebooks, where, suh, svh)."""
    trellis_groups, codebooks, where, suh, svh = stack
    for g, (tr, cb) in enumerate(zip(trellis_groups, codebooks)):
        lin = d.module(LINEAR_SOURCE, linear_defines(bits_of(tr), cb))
        fn = lin.function("exl3_recon_experts_bf16", RECON_SMEM)
        words = (k // 16) * (n // 16) * (tr.shape[-1] // 2)
        cols = n // shards
        for s in range(shards):  # each shard's columns with its own suh row
            nvrtc.launch(fn, (recon_grid(d, cols, k)[0], e1 - e0, 1), (256, 1, 1), RECON_SMEM, stream,
                         [_u64(tr.data_ptr()), _u64(where.data_ptr()), _i32(g), _i32(e0), ctypes.c_int64(words),
                          _u64(suh.data_ptr() + 2 * s * k), _i32(suh_stride), _u64(svh.data_ptr()), _i32(n),
                          _u64(wt.data_ptr() + 2 * s * cols * k), ctypes.c_int64(n * k), _i32(n), _i32(s * cols),
                          _i32(cols), _i32(k)])


def _moe_recon(d, x, topk_weights, topk_ids, w13, w2, E, k13, n13, k2, n2, valid, weights_on_input, out):
    """moe_cuda's result for many rows per expert (w13, w2: trellis groups, codebooks, where, suh, svh): the routed
    rows sorted by expert; per range of experts their dense weights reconstructed in bf16, then torch's grouped
    GEMMs, SwiGLU between; the combine kernel last. Not graph-safe: the per-expert row ends are read on the host."""
    T, topk, inter = x.shape[0], topk_ids.shape[1], n13 // 2
    stream = torch.cuda.current_stream(x.device).cuda_stream
    ids = topk_ids.reshape(-1)
    key = torch.where((ids >= 0) & (ids < E), ids, E).to(torch.int32)  # experts of other ranks sort last
    key, perm = torch.sort(key, stable=True)
    ends = torch.searchsorted(key, torch.arange(E, device=x.device, dtype=torch.int32), right=True, out_int32=True)
    counts_end = [0] + ends.tolist()  # the host sync: row ranges of each range of experts
    routed = counts_end[-1]
    pos = torch.full((T * topk,), -1, dtype=torch.int32, device=x.device)
    pos[perm[:routed]] = torch.arange(routed, dtype=torch.int32, device=x.device)
    xs = x.index_select(0, perm[:routed] // topk)
    if weights_on_input:  # Llama-4 style: the router weight scales the input, the output is taken as is
        xs = (xs.float() * topk_weights.reshape(-1)[perm[:routed]].float()[:, None]).to(x.dtype)
    if x.shape[1] < k13:
        xs = torch.nn.functional.pad(xs, (0, k13 - x.shape[1]))
    y2 = torch.empty(routed, n2, dtype=x.dtype, device=x.device)
    per = max(1, settings.get("EXL3_VLLM_DEQUANT_BYTES") // (2 * max(n13 * k13, n2 * k2)))  # experts per range
    wbuf = d.buf("moe_wrecon", min(E, per) * max(n13 * k13, n2 * k2), torch.float16, stream=stream).view(x.dtype)
    for e0 in range(0, E, per):
        e1 = min(E, e0 + per)
        r0, r1 = counts_end[e0], counts_end[e1]
        if r1 == r0:
            continue
        offs = ends[e0:e1] - r0
        wt = wbuf[:(e1 - e0) * n13 * k13].view(e1 - e0, n13, k13)
        _recon_experts(d, stream, w13, 2 * k13, wt, e0, e1, n13, k13, 2)
        h = torch._grouped_mm(xs[r0:r1], wt.transpose(1, 2), offs=offs)
        a = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float())
        if valid < inter:
            a[:, valid:] = 0  # padding columns decode to noise, not zeros
        wt = wbuf[:(e1 - e0) * n2 * k2].view(e1 - e0, n2, k2)
        _recon_experts(d, stream, w2, k2, wt, e0, e1, n2, k2, 1)
        y2[r0:r1] = torch._grouped_mm(a.to(x.dtype), wt.transpose(1, 2), offs=offs)
    _combine(d.module(MOE_SOURCE, None), stream, y2, n2, pos,
             None if weights_on_input else topk_weights.reshape(-1).to(torch.float32), topk, out)
    return out


def _moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 w13_trellis: List[torch.Tensor], w13_codebooks: List[int], w13_where: torch.Tensor,
                 w13_suh: torch.Tensor, w13_svh: torch.Tensor,
                 w2_trellis: List[torch.Tensor], w2_codebooks: List[int], w2_where: torch.Tensor,
                 w2_suh: torch.Tensor, w2_svh: torch.Tensor, inter_valid: int, weights_on_input: bool) -> torch.Tensor:
    """moe_cuda as one opaque op, so torch.compile keeps the routed experts out of its graph."""
    return moe_cuda(x, topk_weights, topk_ids, w13_trellis, w13_codebooks, w13_where, w13_suh, w13_svh,
                    w2_trellis, w2_codebooks, w2_where, w2_suh, w2_svh, inter_valid, weights_on_input)


def _moe_experts_fake(x, *args):
    return torch.empty_like(x)


moe_experts = library.define("moe_experts", _moe_experts, _moe_experts_fake)
