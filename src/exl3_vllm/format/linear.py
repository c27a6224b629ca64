"""The reference EXL3 linear: the oracle for every kernel and the CPU path."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import trellis as tr
from .errors import Exl3FormatError
from .hadamard import HAD, had_128
from .reconstruct import w_hat

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_linear_args(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                      bias: torch.Tensor | None, shard_sizes: Sequence[int] | None) -> list[int]:
    """Validate one (possibly fused) EXL3 linear; returns the shard widths."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise Exl3FormatError(f"trellis must be int16 [k/16, n/16, 16K], got {trellis.dtype} {tuple(trellis.shape)}")
    tr.bits_from_width(trellis.shape[-1])
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if k % HAD or n % HAD:
        raise Exl3FormatError(f"EXL3 needs k and n to be multiples of 128, got k={k}, n={n}")
    if x.dtype not in _FLOAT_DTYPES:
        raise Exl3FormatError(f"x must be fp16, bf16, fp32 or fp64, got {x.dtype}")
    if x.shape[-1] != k:
        raise Exl3FormatError(f"x has {x.shape[-1]} features but the layer takes k={k}")
    sizes = [n] if shard_sizes is None else [int(s) for s in shard_sizes]
    if sum(sizes) != n or any(s <= 0 or s % HAD for s in sizes):
        raise Exl3FormatError(f"shard sizes {sizes} must be positive multiples of 128 summing to n={n}")
    if suh.shape not in ((k,), (len(sizes), k)) or (suh.dim() == 1 and len(sizes) > 1):
        raise Exl3FormatError(f"suh must be [{k}] or [{len(sizes)}, {k}] (one row per shard), got {tuple(suh.shape)}")
    if svh.shape != (n,):
        raise Exl3FormatError(f"svh must be [{n}], got {tuple(svh.shape)}")
    if bias is not None and bias.shape != (n,):
        raise Exl3FormatError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return sizes


def linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
           codebook: str | int, bias: torch.Tensor | None = None,
           shard_sizes: Sequence[int] | None = None, out_dtype: torch.dtype | None = None,
           compute_dtype: torch.dtype = torch.float32,
           decoded: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W (+ bias) for an EXL3 layer, or a fused layer of shards along n.

    A fused layer concatenates its shards' trellis and svh along n and stacks
    one suh row per shard.  Works on any device; compute_dtype sets the
    precision of everything after the exact fp16 decode.  `decoded` is
    w_hat(trellis) when the caller keeps it, to skip decoding on every call.
    """
    sizes = check_linear_args(x, trellis, suh, svh, bias, shard_sizes)
    lead = x.shape[:-1]
    k = x.shape[-1]
    xs = x.reshape(-1, k).to(compute_dtype)
    suh2 = suh.reshape(len(sizes), k).to(compute_dtype)
    outs = []
    col = 0
    for s, width in enumerate(sizes):
        xh = had_128(xs * suh2[s])
        t0, t1 = col // 16, (col + width) // 16
        wh = decoded[:, col:col + width] if decoded is not None else w_hat(trellis[:, t0:t1], codebook)
        z = xh @ wh.to(compute_dtype)
        outs.append(had_128(z))
        col += width
    y = torch.cat(outs, dim=-1) * svh.to(compute_dtype)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(out_dtype or x.dtype).reshape(*lead, y.shape[-1])
