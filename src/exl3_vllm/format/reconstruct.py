"""Dense reconstruction: trellis -> rotated W_hat -> original-basis W."""

from __future__ import annotations

import torch

from . import codebook as cb
from . import trellis as tr
from .errors import Exl3FormatError
from .hadamard import HAD, hadamard_128

# Columns decoded per step, to bound the int64 intermediates of the unpack.
_CHUNK_N = 2048


def w_hat(trellis: torch.Tensor, codebook: str | int) -> torch.Tensor:
    """Rotated-basis weight W_hat [k, n] in fp16, bit-exact with the format."""
    if trellis.dim() != 3:
        raise Exl3FormatError(f"trellis must be 3-D [k/16, n/16, 16K], got shape {tuple(trellis.shape)}")
    bits = tr.bits_from_width(trellis.shape[-1])
    name = cb.codebook_name(codebook)
    if bits != int(bits) and name != "mul1":
        raise Exl3FormatError(f"half-integer K={bits} is only defined for the mul1 codebook, not {name}")
    kt, nt, _ = trellis.shape
    out = torch.empty(kt * 16, nt * 16, dtype=torch.float16, device=trellis.device)
    step = _CHUNK_N // 16
    for t0 in range(0, nt, step):
        t1 = min(nt, t0 + step)
        values = cb.decode(tr.unpack(trellis[:, t0:t1]), name)
        out[:, t0 * 16:t1 * 16] = tr.tiles_to_matrix(values)
    return out


def rotate(w: torch.Tensor) -> torch.Tensor:
    """B_k @ w @ B_n with 128-block Hadamards on both sides, in w's dtype."""
    k, n = w.shape
    h = hadamard_128(w.dtype, w.device)
    w = (h @ w.reshape(k // HAD, HAD, n)).reshape(k, n)
    return (w.reshape(k, n // HAD, HAD) @ h).reshape(k, n)


def dense_weight(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                 codebook: str | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Original-basis W [k, n] so that y = x @ W, computed in dtype (fp32 or fp64)."""
    wh = w_hat(trellis, codebook)
    k, n = wh.shape
    if k % HAD or n % HAD:
        raise Exl3FormatError(f"EXL3 needs k and n to be multiples of 128, got {k}x{n}")
    if suh.numel() != k or svh.numel() != n:
        raise Exl3FormatError(f"suh/svh lengths {suh.numel()}/{svh.numel()} do not match k={k}, n={n}")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    w = rotate(wh.to(compute))
    w = suh.reshape(k, 1).to(compute) * w * svh.reshape(1, n).to(compute)
    return w.to(dtype)
