"""What the linear, MoE and embedding methods share while loading weights: codebook markers, damaged values, and the
tensor-parallel sizes a width allows."""

from __future__ import annotations

import torch

from ..format import codebook as cb
from ..format.errors import Exl3FormatError
from ..format.hadamard import HAD
from ..format.integrity import DAMAGED


def marker(w: torch.Tensor, name: str, file: str, tensor: str) -> int:
    """A codebook marker's value; any other value than its codebook's is refused."""
    value = int(w.reshape(-1)[0])
    if value != cb.MARKER_VALUES[name]:
        raise Exl3FormatError(f"codebook marker holds {value}, expected {cb.MARKER_VALUES[name]}", file=file,
                              tensor=tensor)
    return value


def damaged(what: str, file: str, tensor: str) -> Exl3FormatError:
    """A NaN or Inf scale would turn every output it reaches into NaN: refused at load, naming the tensor."""
    return Exl3FormatError(what, file=file, tensor=tensor, fix=DAMAGED)


def tp_hint(width: int, tp: int) -> str:
    """The tensor_parallel_size values that split width into multiples of the 128-wide Hadamard block."""
    ok = [d for d in (1, 2, 4, 8, 16) if width % d == 0 and (width // d) % HAD == 0]
    return f"tensor_parallel_size in {ok}" if ok else "tensor_parallel_size 1"
