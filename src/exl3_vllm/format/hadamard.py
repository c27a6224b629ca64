"""The 128-point Sylvester Hadamard transform EXL3 applies on both sides of W."""

from __future__ import annotations

import torch

from .errors import Exl3FormatError

HAD = 128


_SYLVESTER: list[torch.Tensor] = []
# Plain dict caches, not lru_cache: torch.compile traces through them without warnings about wrapped functions.
_BY_DTYPE_DEVICE: dict[tuple, torch.Tensor] = {}


def _sylvester() -> torch.Tensor:
    if not _SYLVESTER:
        a = torch.arange(HAD)
        bits = a[:, None] & a[None, :]
        parity = torch.zeros_like(bits)
        for b in range(7):
            parity ^= (bits >> b) & 1
        _SYLVESTER.append((1 - 2 * parity).to(torch.float64) / HAD ** 0.5)
    return _SYLVESTER[0]


def hadamard_128(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal, symmetric H with H[a, b] = (-1)^popcount(a & b) / sqrt(128); shared, do not modify."""
    # Cached per (dtype, device): a host-to-device copy on every call would break CUDA-graph capture.
    key = (dtype, str(torch.device(device) if device is not None else "cpu"))
    h = _BY_DTYPE_DEVICE.get(key)
    if h is None:
        h = _BY_DTYPE_DEVICE[key] = _sylvester().to(dtype=dtype, device=device)
    return h


def had_128(x: torch.Tensor) -> torch.Tensor:
    """Apply H to every 128-block of the last dimension (x_blk @ H), in x's dtype."""
    n = x.shape[-1]
    if n % HAD:
        raise Exl3FormatError(f"Hadamard needs a last dimension that is a multiple of 128, got {n}")
    h = hadamard_128(x.dtype, x.device)
    return (x.reshape(*x.shape[:-1], n // HAD, HAD) @ h).reshape(x.shape)
