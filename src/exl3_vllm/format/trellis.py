"""Trellis bitstream <-> 16-bit states, and the tile-internal permutation.

A 16x16 tile is a tail-biting ring of 256 positions.  Ring bit p lives in
uint32 word p // 32 at bit 31 - p % 32, where word m is int16 elements 2m (low
half) and 2m+1 (high half).  Position j's state is the 16-bit window of the
ring ending at its last bit; odd positions carry one extra bit at K + 0.5.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .errors import Exl3FormatError

TILE = 16
POSITIONS = 256
INTEGER_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_BITS = (1.5, 2.5, 3.5)
ALL_BITS = INTEGER_BITS + HALF_BITS


def _perm() -> torch.Tensor:
    j = torch.arange(POSITIONS)
    t, q = j // 8, j % 8
    r = 2 * (t % 4) + (q & 1) + 8 * ((q >> 1) & 1)
    c = t // 4 + 8 * (q >> 2)
    return 16 * r + c


PERM = _perm()  # tile_rowmajor[PERM[j]] = value of trellis position j
INV_PERM = torch.argsort(PERM)


def bits_from_width(width: int, *, tensor: str | None = None, file: str | None = None) -> float | int:
    """K from the trellis' last dimension: 16K for integer K, 16K+8 for K+0.5."""
    if width % 16 == 0 and 1 <= width // 16 <= 8:
        return width // 16
    if width % 16 == 8 and 1 <= width // 16 <= 3:
        return width // 16 + 0.5
    raise Exl3FormatError(
        f"trellis last dimension is {width}; EXL3 stores 16*K int16 per tile for K in 1..8 "
        f"or 16*K+8 for K in 1.5/2.5/3.5",
        tensor=tensor, file=file, fix="the tensor is not an EXL3 trellis or the file is damaged")


def width_from_bits(bits: float) -> int:
    """Inverse of bits_from_width."""
    if bits in INTEGER_BITS:
        return int(16 * bits)
    if bits in HALF_BITS:
        return int(16 * int(bits) + 8)
    raise Exl3FormatError(f"unsupported bits per weight {bits}", fix=f"use one of {ALL_BITS}")


@lru_cache(maxsize=None)
def _layout(width: int):
    """Per-position end bit, new-bit count and the word/shift gather tables."""
    bits = bits_from_width(width)
    ka = int(bits)
    j = torch.arange(POSITIONS, dtype=torch.int64)
    d = torch.full((POSITIONS,), ka, dtype=torch.int64)
    if bits != ka:
        d = d + (j & 1)
    end = torch.cumsum(d, 0)
    ring = 16 * width
    nwords = width // 2
    start = (end - 16) % ring
    i0 = start // 32
    i1 = (i0 + 1) % nwords
    shift = 32 - start % 32
    # For packing: every ring bit belongs to exactly one position's new bits.
    sym_pos = torch.repeat_interleave(j, d)
    first = end - d
    bit_in_sym = torch.arange(ring, dtype=torch.int64) - first[sym_pos]
    sym_shift = d[sym_pos] - 1 - bit_in_sym
    return i0, i1, shift, sym_pos, sym_shift, nwords


@lru_cache(maxsize=None)
def _unpack_tables(width: int, device: torch.device):
    # Cached on the device: a host-to-device copy per call would break CUDA-graph capture.
    i0, i1, shift, _, _, _ = _layout(width)
    return i0.to(device), i1.to(device), shift.to(device)


@lru_cache(maxsize=None)
def _inv_perm(device: torch.device) -> torch.Tensor:
    return INV_PERM.to(device)


def _check_trellis(trellis: torch.Tensor) -> None:
    if trellis.dtype != torch.int16:
        raise Exl3FormatError(f"trellis must be int16, got {trellis.dtype}")
    if trellis.dim() < 1:
        raise Exl3FormatError("trellis must have a last dimension of 16*K int16 per tile")


def unpack(trellis: torch.Tensor) -> torch.Tensor:
    """int16 trellis [..., w] -> int32 states [..., 256] in trellis order (0..65535)."""
    _check_trellis(trellis)
    i0, i1, shift = _unpack_tables(trellis.shape[-1], trellis.device)
    u16 = trellis.to(torch.int64) & 0xFFFF
    words = u16[..., 0::2] | (u16[..., 1::2] << 16)
    w0 = words[..., i0]
    w1 = words[..., i1]
    # 48-bit window holding word i0 and the top half of word i1, read MSB-first.
    window = (w0 << 16) | (w1 >> 16)
    return ((window >> shift) & 0xFFFF).to(torch.int32)


def pack(states: torch.Tensor, bits: float) -> torch.Tensor:
    """States [..., 256] (only each position's new low bits are used) -> int16 trellis."""
    if states.shape[-1] != POSITIONS:
        raise Exl3FormatError(f"states must have a last dimension of 256, got {tuple(states.shape)}")
    width = width_from_bits(bits)
    _, _, _, sym_pos, sym_shift, nwords = _layout(width)
    dev = states.device
    s = states.to(torch.int64) & 0xFFFF
    ring = (s[..., sym_pos.to(dev)] >> sym_shift.to(dev)) & 1
    ring = ring.reshape(*ring.shape[:-1], nwords, 32)
    weights = torch.tensor([1 << (31 - i) for i in range(32)], dtype=torch.int64, device=dev)
    words = (ring * weights).sum(-1)
    out = torch.stack([words & 0xFFFF, words >> 16], dim=-1).reshape(*words.shape[:-1], width)
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16)


def tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """Per-tile values in trellis order [kt, nt, 256] -> matrix [16 kt, 16 nt]."""
    kt, nt, _ = tiles.shape
    rowmajor = tiles[..., _inv_perm(tiles.device)]
    return rowmajor.view(kt, nt, TILE, TILE).permute(0, 2, 1, 3).reshape(kt * TILE, nt * TILE)


def matrix_to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """Matrix [k, n] -> per-tile values in trellis order [k/16, n/16, 256]."""
    k, n = matrix.shape
    tiles = matrix.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3)
    return tiles.reshape(k // TILE, n // TILE, POSITIONS)[..., PERM.to(matrix.device)]
