"""Deterministic, streamed tensor contents for a TensorPlan (numpy chunks, never a whole model)."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Iterator

import numpy as np
import torch

from ..format import codebook as cb
from .plan import TensorPlan

TARGET_W_STD = 0.02  # per-element std of a real LLM linear weight
FLOAT_CHUNK = 1 << 22  # elements per float chunk (a multiple of 4: each chunk eats whole uint64 words)
RAW_CHUNK = 1 << 22  # uint64 words per trellis chunk (32 MiB)
_NP_DTYPES = {"I16": np.int16, "F16": np.float16, "I32": np.int32, "F32": np.float32}


def bit_generator(seed: int, name: str) -> np.random.SFC64:
    """A generator per (seed, tensor name), so a tensor's bytes do not depend on write order or shards."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]
    return np.random.SFC64(np.random.SeedSequence([seed, *words]))


@lru_cache(maxsize=None)
def _normal_table(scale: float = 1.0, offset: float = 0.0, dtype: str = "F32") -> np.ndarray:
    # N(0, 1) quantiles at 65536 evenly spaced probabilities: a random uint16 index is a normal sample.
    p = (torch.arange(65536, dtype=torch.float64) + 0.5) / 65536
    q = torch.special.ndtri(p).numpy()
    return (q * scale + offset).astype(_NP_DTYPES[dtype])


def _normal_draws(bg: np.random.SFC64, m: int, scale: float = 1.0, offset: float = 0.0,
                  dtype: str = "F32") -> np.ndarray:
    """m samples of N(offset, scale^2) (truncated at 4.3 sigma), by table lookup: 10x cheaper than Gaussian."""
    idx = bg.random_raw((m + 3) // 4).view("<u2")[:m]
    return np.take(_normal_table(scale, offset, dtype), idx)


@lru_cache(maxsize=None)
def codebook_std(codebook: str) -> float:
    """Std of the decoded value over all 65536 states (about 1.0 for mul1, 1.24 for 3inst/mcg)."""
    return float(cb.all_values(codebook).double().std())


def _scale_vector(bg, length: int, live: int, rms: float) -> np.ndarray:
    # Random sign x lognormal magnitude, normalised to the target RMS; padding entries stay 0.
    mag = np.exp(_normal_draws(bg, live, 0.35))
    mag *= np.float32(rms / float(np.sqrt(np.mean(mag.astype(np.float64) ** 2))))
    sign = (bg.random_raw(live) & 1).astype(np.float32) * 2 - 1
    out = np.zeros(length, dtype=np.float32)
    out[:live] = sign * mag
    return out.astype(np.float16)


def chunks(tp: TensorPlan, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes as a sequence of C-contiguous numpy arrays, in order."""
    bg = bit_generator(seed, tp.name)
    numel = int(np.prod(tp.shape, dtype=np.int64))
    if tp.role == "trellis":
        # Every bit pattern is a valid trellis, so uniform random words are a valid tensor.
        words = tp.nbytes // 8
        for off in range(0, words, RAW_CHUNK):
            yield bg.random_raw(min(RAW_CHUNK, words - off))
        return
    if tp.role == "embed_trellis":
        # Random rings; each group's first word is its fp16 scale, which sets the row's RMS (about 0.02).
        rows, groups = tp.shape[0], tp.live
        words = np.frombuffer(bg.random_raw(-(-tp.nbytes // 8)).tobytes()[:tp.nbytes], dtype=np.int16).copy()
        scales = (np.exp(_normal_draws(bg, rows * groups, 0.3)) * np.float32(0.02)).astype(np.float16)
        words.reshape(rows, groups, -1)[..., 0] = scales.view(np.int16).reshape(rows, groups)
        yield words
        return
    if tp.role == "signs":
        yield ((bg.random_raw(numel) & 1).astype(np.float32) * 2 - 1).astype(np.float16).reshape(tp.shape)
        return
    if tp.role == "marker":
        yield np.array(cb.MARKER_VALUES[tp.codebook], dtype=np.int32)
        return
    if tp.role in ("suh", "svh"):
        # W = suh_i svh_j (rotated w_hat): rms(suh) * rms(svh) * std(codebook) = TARGET_W_STD.
        rms = (TARGET_W_STD / codebook_std(tp.codebook)) ** 0.5
        yield _scale_vector(bg, numel, tp.live, rms)
        return
    if tp.role == "bias":
        out = np.zeros(numel, dtype=np.float32)
        out[:tp.live] = _normal_draws(bg, tp.live, tp.scale)
        yield out.astype(np.float16)
        return
    scale, offset = (0.05, 1.0) if tp.role == "norm" else (tp.scale, 0.0)
    for off in range(0, numel, FLOAT_CHUNK):
        yield _normal_draws(bg, min(FLOAT_CHUNK, numel - off), scale, offset, tp.dtype)


def value(tp: TensorPlan, seed: int) -> torch.Tensor:
    """The whole tensor (for one module at a time: reconstruction, tests)."""
    data = bytearray()
    for c in chunks(tp, seed):
        data += c.tobytes()
    torch_dtype = {"I16": torch.int16, "F16": torch.float16, "I32": torch.int32, "F32": torch.float32}[tp.dtype]
    if not data:
        return torch.empty(tp.shape, dtype=torch_dtype)
    return torch.frombuffer(data, dtype=torch_dtype).reshape(tp.shape).clone()
