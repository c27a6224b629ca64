"""The one call from the MoE method into the EXL3 experts op: routed SwiGLU experts, one EXL3 linear each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels import library
from .op import exl3_linear


@dataclass
class ExpertStack:
    """One projection of every local expert: w13 (gate | up fused along n) or w2 (down).

    Experts that share K and codebook are stacked in one group tensor, so a grouped kernel runs one
    launch per group; most checkpoints have a single group.
    """
    trellis: list[torch.Tensor]    # per group: int16 [E_g, k/16, n/16, 16K_g]
    codebooks: list[int]           # per group: codebook id
    where: list[tuple[int, int]]   # per local expert: (group, index in the group)
    suh: torch.Tensor              # fp16 [E, shards, k] (w13) or [E, k] (w2)
    svh: torch.Tensor              # fp16 [E, n]
    shard_sizes: list[int]         # [n/2, n/2] (w13) or [n] (w2)
    decoded: torch.Tensor | None   # fp16 [E, k, n]: the exact decode the CPU path keeps, else None
    where_dev: torch.Tensor | None = None  # int32 [E, 2] on the GPU: `where` for the grouped kernels

    @property
    def k(self) -> int:
        return self.trellis[0].shape[1] * 16

    def __len__(self) -> int:
        return len(self.where)

    def linear(self, x: torch.Tensor, e: int) -> torch.Tensor:
        g, i = self.where[e]
        return exl3_linear(x, self.trellis[g][i], self.suh[e], self.svh[e], None, self.shard_sizes,
                           self.codebooks[g], None if self.decoded is None else self.decoded[e])

    def args(self) -> tuple:
        """The stack as custom-op arguments (tensors, tensor lists and int lists)."""
        return (self.trellis, self.codebooks, [v for gi in self.where for v in gi], self.suh, self.svh,
                self.shard_sizes, self.decoded)

    @classmethod
    def from_args(cls, trellis, codebooks, where, suh, svh, shard_sizes, decoded) -> "ExpertStack":
        return cls(list(trellis), list(codebooks), list(zip(where[::2], where[1::2])), suh, svh,
                   list(shard_sizes), decoded)


def exl3_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: ExpertStack,
             w2: ExpertStack, inter_valid: int | None = None, *, weights_on_input: bool = False,
             dense: bool | None = None) -> torch.Tensor:
    """sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over each row's top-k experts e = topk_ids[:, j].

    topk_ids are local expert indices (negative: an expert on another rank, which contributes nothing).
    inter_valid: intermediate columns of this rank that are real, not the checkpoint's padding to 128.
    Experts run in a fixed order and the combine is fp32, so the result does not depend on scheduling.
    On CUDA this is the grouped-kernel op; with EXL3_VLLM_BACKEND=reference, dense=True runs every expert on every
    row with zero weights for the unrouted ones (no data-dependent shapes), the default where GPU code is traced or
    captured.
    """
    if x.is_cuda and w13.where_dev is not None and kernels.backend() != "reference":
        # Our grouped kernels: graph-safe, so the same call serves eager, torch.compile and CUDA graphs.
        return torch.ops.exl3.moe_experts(x, topk_weights, topk_ids, w13.trellis, w13.codebooks, w13.where_dev,
                                          w13.suh, w13.svh, w2.trellis, w2.codebooks, w2.where_dev, w2.suh, w2.svh,
                                          -1 if inter_valid is None else inter_valid, weights_on_input)
    if dense is None and torch.compiler.is_compiling() and x.device.type == "cpu":
        # vLLM's CPU engine traces apply(): an opaque op keeps the routed row gather and the graph small.
        return torch.ops.exl3.moe(x, topk_weights, topk_ids, *w13.args(), *w2.args(),
                                  -1 if inter_valid is None else inter_valid, weights_on_input)
    if dense is None:
        # Traced or captured GPU code cannot take the data-dependent row gather.
        dense = torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())
    t, hidden = x.shape
    k13, inter = w13.k, w13.shard_sizes[0]
    xp = F.pad(x, (0, k13 - hidden)) if k13 != hidden else x
    w = topk_weights.float()
    out = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    for e in range(len(w13)):
        hit = topk_ids == e
        if dense:
            rows = None
            xe, we = xp, (w * hit).sum(1)
        else:
            rows, slot = hit.nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe, we = xp.index_select(0, rows), w[rows, slot]
        coef = we
        if weights_on_input:
            # Llama-4 style: the router weight scales the input and the output is taken as is.
            xe = (xe.float() * we[:, None]).to(x.dtype)
            coef = hit.any(1).float() if dense else torch.ones_like(we)
        g, u = w13.linear(xe, e).float().split(inter, dim=-1)
        a = F.silu(g) * u
        if inter_valid is not None and inter_valid < inter:
            # Padding columns decode to noise, not zeros: drop them as the dense path trims gate/up.
            a[:, inter_valid:] = 0
        y = w2.linear(a.to(x.dtype), e)
        contrib = y[:, :hidden].float() * coef[:, None]
        if dense:
            out = out + contrib
        else:
            out.index_add_(0, rows, contrib)  # each row at most once per expert: deterministic
    return out.to(x.dtype)


def _moe_any(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             w13_trellis: List[torch.Tensor], w13_codebooks: List[int], w13_where: List[int], w13_suh: torch.Tensor,
             w13_svh: torch.Tensor, w13_shard_sizes: List[int], w13_decoded: Optional[torch.Tensor],
             w2_trellis: List[torch.Tensor], w2_codebooks: List[int], w2_where: List[int], w2_suh: torch.Tensor,
             w2_svh: torch.Tensor, w2_shard_sizes: List[int], w2_decoded: Optional[torch.Tensor],
             inter_valid: int, weights_on_input: bool) -> torch.Tensor:
    """exl3_moe run eagerly (routed rows only), for graphs that trace the MoE layer."""
    w13 = ExpertStack.from_args(w13_trellis, w13_codebooks, w13_where, w13_suh, w13_svh, w13_shard_sizes,
                                w13_decoded)
    w2 = ExpertStack.from_args(w2_trellis, w2_codebooks, w2_where, w2_suh, w2_svh, w2_shard_sizes, w2_decoded)
    return exl3_moe(x, topk_weights, topk_ids, w13, w2, None if inter_valid < 0 else inter_valid,
                    weights_on_input=weights_on_input, dense=False)


def _moe_op_fake(x, *args):
    return torch.empty_like(x)


_moe_op = library.define("moe", _moe_any, _moe_op_fake)
