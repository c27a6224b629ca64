"""What the headers cannot vouch for, read from the data (`inspect --verify`): scales, biases and embedding row scales
finite, no scale vector all zero, no zero-filled hole in a trellis, and each file's bytes against the checksum a
Hugging Face download recorded beside it."""

from __future__ import annotations

import hashlib
import os
import re

import torch

from . import embedding as emb
from .checkpoint import Checkpoint, EmbeddingSpec, Exl3Spec
from .errors import Exl3FormatError
from .safetensors_io import TensorInfo, read_tensor

DAMAGED = "the checkpoint is damaged: re-download or re-convert it"
# Trellis words are near-random bits (real checkpoints: no zero run over 2 bytes), so 512 zero bytes is a hole.
HOLE = 512
# fp16's smallest normal; exllamav3's scales are far above it (corpus: |suh| >= 0.0156, |svh| >= 0.43).
TINY = 2.0 ** -14


def verify(ck: Checkpoint) -> None:
    """Raises Exl3FormatError naming the first bad file or tensor; a file unlike its download first."""
    for f in sorted({i.file for i in ck.tensors.values()}):
        _checksum(f)
    for key, spec in ck.modules.items():
        if isinstance(spec, Exl3Spec):
            vectors = [r for r in ("suh", "svh", "bias") if r in spec.tensors]
            _no_hole(spec.tensors["trellis"], read_tensor(spec.tensors["trellis"]))
        elif isinstance(spec, EmbeddingSpec):
            trellis = read_tensor(spec.tensors["trellis"])
            _no_hole(spec.tensors["trellis"], trellis)
            scales = emb.row_scales(trellis, spec.hidden // emb.GROUP)
            bad = (~torch.isfinite(scales)).any(1).nonzero()
            if bad.numel():
                raise Exl3FormatError(f"{bad.numel()} rows have a NaN or Inf scale (first: row {int(bad[0])})",
                                      file=spec.tensors["trellis"].file, tensor=f"{key}.trellis", fix=DAMAGED)
            vectors = ["signs"]
        else:
            vectors = [r for r, i in spec.tensors.items() if i.dtype in ("F16", "BF16", "F32")]
        for role in vectors:
            info = spec.tensors[role]
            v = read_tensor(info)
            if not bool(torch.isfinite(v).all()):
                raise Exl3FormatError(f"{int((~torch.isfinite(v)).sum())} NaN or Inf values", file=info.file,
                                      tensor=info.name, fix=DAMAGED)
            if role in ("suh", "svh") and not bool((v.float().abs() >= TINY).any()):
                raise Exl3FormatError(f"every value is 0 or subnormal (under 2^-14), so {key}'s output would be 0 "
                                      "(a zero-filled hole in the file?)", file=info.file, tensor=info.name,
                                      fix=DAMAGED)


def _no_hole(info: TensorInfo, trellis: torch.Tensor) -> None:
    b = trellis.contiguous().view(torch.uint8).reshape(-1)
    blocks = b[: b.numel() // HOLE * HOLE].view(-1, HOLE)  # a run of 2 * HOLE zeros fills one aligned block
    zero = (blocks == 0).all(1).nonzero()
    if zero.numel():
        raise Exl3FormatError(f"{zero.numel() * HOLE} bytes of its trellis are zeros (first at byte "
                              f"{int(zero[0]) * HOLE}): a hole in the file, not quantized weights", file=info.file,
                              tensor=info.name, fix=DAMAGED)


def recorded_sha256(path: str) -> str | None:
    """The sha256 a Hugging Face download recorded for this file: huggingface_hub's local-dir metadata
    (`.cache/huggingface/download/<name>.metadata`, its second line the etag) or a hub-cache blob's name."""
    real = os.path.realpath(path)
    if real != os.path.abspath(path) and re.fullmatch(r"[0-9a-f]{64}", os.path.basename(real)):
        return os.path.basename(real)
    meta = os.path.join(os.path.dirname(path), ".cache", "huggingface", "download", os.path.basename(path) + ".metadata")
    try:
        with open(meta) as fh:
            lines = fh.read().split("\n")
    except OSError:
        return None
    etag = lines[1].strip().strip('"') if len(lines) > 1 else ""
    return etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None  # 40 hex digits: a small file's git hash


def _checksum(path: str) -> None:
    want = recorded_sha256(path)
    if want is None:
        return
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    if h.hexdigest() != want:
        raise Exl3FormatError(f"its sha256 is {h.hexdigest()[:16]}..., but the download recorded {want[:16]}...",
                              file=path, fix="the file changed or did not finish downloading: download it again")
