"""The one call from the plugin into the EXL3 linear op."""

from __future__ import annotations

import torch

from .. import kernels  # noqa: F401  (registers torch.ops.exl3.linear)
from ..format.linear import linear as reference_linear
from . import compat


def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                bias: torch.Tensor | None, shard_sizes: list[int], codebook: int,
                decoded: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W (+ bias) for a (fused) EXL3 layer, in x's dtype."""
    if decoded is not None:
        # CPU path: the layer keeps its exact fp16 decode, so only the rotations run per call.
        return reference_linear(x, trellis, suh, svh, codebook, bias=bias, shard_sizes=shard_sizes,
                                decoded=decoded)
    return torch.ops.exl3.linear(x, trellis, suh, svh, bias, shard_sizes, codebook)


def max_batched_tokens(default: int = 8192) -> int:
    """The most rows one forward can bring, from the running vLLM config."""
    try:
        from vllm.config import get_current_vllm_config

        sched = get_current_vllm_config().scheduler_config
        return int(getattr(sched, "max_num_batched_tokens", None) or default)
    except Exception:  # noqa: BLE001 - outside an engine (tests), fall back to the default
        return default


def prepare_layer(trellis: torch.Tensor, shard_sizes: list[int], codebook: int) -> None:
    """Compile every kernel the layer may use and reserve workspace before any graph capture."""
    if trellis.device.type != "cuda" or kernels.backend() == "reference":
        return
    kernels.prepare(trellis.shape[0] * 16, trellis.shape[1] * 16, kernels.op.bits_of(trellis), codebook,
                    max_batched_tokens(), trellis.device, shard_sizes)


def prepare_experts(w13_trellis: list[torch.Tensor], w13_codebooks: list[int], w2_trellis: list[torch.Tensor],
                    w2_codebooks: list[int], n_experts: int, topk: int) -> None:
    """The grouped-experts counterpart of prepare_layer."""
    if w13_trellis[0].device.type != "cuda" or kernels.backend() == "reference":
        return
    kernels.prepare_moe(w13_trellis, w13_codebooks, w2_trellis, w2_codebooks, n_experts, topk,
                        max_batched_tokens(), w13_trellis[0].device)
    for stream in compat.concurrent_streams():  # the shared experts' linears run there beside these experts
        kernels.concurrent_stream(stream)
