"""Quantized token embeddings (exllamav3 >= 1.6, converter option --embed_bits): each row decoded on its own.

A table of `rows` x `hidden` is stored as `<key>.trellis`, int16 [rows, G * (1 + 16K)] with G = ceil(hidden / 256),
and `<key>.signs`, fp16 [G, 256] of +-1. Each row holds G groups of 256 values; a group is one fp16 scale word and
a tail-biting ring of 256 K-bit symbols (mul1 codebook, natural element order, no tile permutation). The decode:
states from the ring, mul1 values times the scale, an unnormalised 256-point Walsh-Hadamard transform over 1/16,
the group's signs, one rounding to fp16; the row is the groups in order, cut to `hidden`.
"""

from __future__ import annotations

import math

import torch

from .codebook import decode
from .errors import Exl3FormatError

GROUP = 256


def groups_of(hidden: int) -> int:
    return math.ceil(hidden / GROUP)


def bits_from_row(row_words: int, groups: int, tensor: str | None = None, file: str | None = None) -> int:
    """K of a quantized embedding from its row width (G * (1 + 16K) int16 words)."""
    per, rem = divmod(row_words, groups) if groups > 0 else (0, 1)
    if rem or (per - 1) % 16 or not 1 <= (per - 1) // 16 <= 8:
        raise Exl3FormatError(f"a quantized embedding row of {row_words} words is not {groups} groups of 1 + 16K "
                              "words with K in 1..8", tensor=tensor, file=file,
                              fix="re-convert or re-download the embedding")
    return (per - 1) // 16


def row_scales(trellis: torch.Tensor, groups: int) -> torch.Tensor:
    """fp16 [rows, groups]: each group's scale word."""
    return trellis.reshape(trellis.shape[0], groups, -1)[..., 0].contiguous().view(torch.float16)


def _states(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """16-bit trellis states of each ring position from its words ([..., 16K] int16, bits read LSB first)."""
    words = stream.to(torch.int32) & 0xFFFF
    words = torch.cat([words, torch.zeros_like(words[..., :1])], -1)  # a symbol may straddle the last word
    first = torch.arange(GROUP, device=stream.device, dtype=torch.int32) * bits
    lo, hi = words[..., first >> 4], words[..., (first >> 4) + 1]
    sym = ((lo | (hi << 16)) >> (first & 15)) & ((1 << bits) - 1)
    # state_i holds symbol_{i-j} at bit j*K (the ring wraps); the distinct bit ranges make the sum an OR.
    state = sym
    for j in range(1, math.ceil(16 / bits)):
        state = state + (torch.roll(sym, j, dims=-1) << (j * bits))
    return state & 0xFFFF


def _wht(v: torch.Tensor) -> torch.Tensor:
    """Unnormalised 256-point Walsh-Hadamard transform, natural order, butterflies of span 1, 2, ..., 128."""
    lead = v.shape[:-1]
    s = 1
    while s < GROUP:
        p = v.reshape(*lead, GROUP // (2 * s), 2, s)
        lo, hi = p[..., 0, :], p[..., 1, :]
        v = torch.stack((lo + hi, lo - hi), dim=-2).reshape(*lead, GROUP)
        s *= 2
    return v


def decode_rows(rows: torch.Tensor, signs: torch.Tensor, hidden: int,
                values_of: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 [M, hidden] from trellis rows int16 [M, G * (1 + 16K)] and signs fp16 [G, 256]; any device.

    values_of: codebook.all_values("mul1") on the rows' device, to look states up instead of decoding them.
    """
    groups = signs.shape[0]
    bits = bits_from_row(rows.shape[-1], groups)
    w = rows.reshape(-1, groups, 1 + 16 * bits)
    scale = w[..., 0].contiguous().view(torch.float16).to(torch.float32)
    states = _states(w[..., 1:], bits)
    values = values_of[states.long()] if values_of is not None else decode(states, "mul1")
    values = values.to(torch.float32) * scale.unsqueeze(-1)
    # 1/16 and the signs are exact in fp32, so the one rounding is the cast to fp16.
    out = (_wht(values) * (1.0 / 16) * signs.to(torch.float32)).to(torch.float16)
    # Contiguous even when the last group is part padding: vLLM's fused add + RMSNorm refuses strided rows.
    return out.reshape(-1, groups * GROUP)[:, :hidden].contiguous()


def dense_table(trellis: torch.Tensor, signs: torch.Tensor, hidden: int, chunk: int = 4096) -> torch.Tensor:
    """The whole table, fp16 [rows, hidden], decoded `chunk` rows at a time."""
    return torch.cat([decode_rows(trellis[i:i + chunk], signs, hidden) for i in range(0, trellis.shape[0], chunk)])
