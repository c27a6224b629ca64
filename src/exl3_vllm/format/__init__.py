"""The EXL3 format in plain torch: parsing, decode, reconstruction, reference linear."""

from .codebook import CODEBOOKS, Codebook, decode
from .errors import Exl3FormatError
from .hadamard import had_128, hadamard_128
from .linear import linear
from .reconstruct import dense_weight, w_hat
from .trellis import PERM, bits_from_width, pack, unpack, width_from_bits

__all__ = [
    "CODEBOOKS", "Codebook", "PERM", "Exl3FormatError", "bits_from_width", "decode",
    "dense_weight", "had_128", "hadamard_128", "linear", "pack", "unpack", "w_hat",
    "width_from_bits",
]
