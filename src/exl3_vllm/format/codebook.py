"""The three EXL3 codebooks: 16-bit trellis state -> fp16 weight, bit-exact."""

from __future__ import annotations

import enum

import torch

from .errors import Exl3FormatError

CODEBOOKS = ("3inst", "mcg", "mul1")
_IDS = {name: i for i, name in enumerate(CODEBOOKS)}


class Codebook(enum.IntEnum):
    """A codebook as the kernels number it (EXL3_CB); .label is its name in checkpoints and on the command line."""
    THREE_INST = 0
    MCG = 1
    MUL1 = 2

    @property
    def label(self) -> str:
        return CODEBOOKS[self]

    @classmethod
    def of(cls, codebook: "str | int") -> "Codebook":
        return cls(_IDS[codebook_name(codebook)])

# Multipliers, as the unsigned values and as the int32 the marker tensors store.
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
MARKER_VALUES = {"mcg": MCG_MULT - (1 << 32), "mul1": MUL1_MULT - (1 << 32)}

_3INST_MULT = 89226354
_3INST_ADD = 64248484
_MASK32 = 0xFFFFFFFF
_MUL1_K_INV = 0.00676727294921875  # fp16 0x1EEE
_MUL1_K_BIAS = -10.3828125  # fp16 0xC931


def codebook_name(codebook: str | int) -> str:
    """Normalise a codebook given by name or id."""
    if isinstance(codebook, int) and 0 <= codebook < len(CODEBOOKS):
        return CODEBOOKS[codebook]
    if isinstance(codebook, str) and codebook in _IDS:
        return codebook
    raise Exl3FormatError(f"unknown codebook {codebook!r}", fix=f"use one of {CODEBOOKS}")


def _half_from_bits(bits: torch.Tensor) -> torch.Tensor:
    # Reinterpret the low 16 bits as fp16 without any arithmetic.
    b = bits & 0xFFFF
    b = torch.where(b >= 0x8000, b - 0x10000, b)
    return b.to(torch.int16).view(torch.float16)


def decode(states: torch.Tensor, codebook: str | int) -> torch.Tensor:
    """Decode 16-bit states (any int dtype; int16 read as unsigned) to fp16, same shape."""
    cb = codebook_name(codebook)
    if states.is_floating_point() or states.is_complex():
        raise Exl3FormatError(f"states must be an integer tensor, got {states.dtype}")
    s = states.to(torch.int64) & 0xFFFF
    if cb == "mul1":
        x = (s * MUL1_MULT) & _MASK32
        t = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        # Product and sum are exact in fp32, so one rounding to fp16 matches the fp16 FMA.
        v = (1024 + t).to(torch.float32) * _MUL1_K_INV + _MUL1_K_BIAS
        return v.to(torch.float16)
    if cb == "mcg":
        x = (s * MCG_MULT) & _MASK32
    else:
        x = (s * _3INST_MULT + _3INST_ADD) & _MASK32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _half_from_bits(x).to(torch.float32)
    hi = _half_from_bits(x >> 16).to(torch.float32)
    # Two fp16 in [0.125, 2) add exactly in fp32; the cast is the fp16 add's rounding.
    return (lo + hi).to(torch.float16)


def all_values(codebook: str | int) -> torch.Tensor:
    """fp16 value of each of the 65536 states, indexed by state."""
    return decode(torch.arange(65536, dtype=torch.int64), codebook)
