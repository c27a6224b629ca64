"""Validated, lazy safetensors headers and single-tensor reads."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod

import torch

from .errors import Exl3FormatError

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32,
    "I64": torch.int64, "F64": torch.float64,
}
# Far above any real header (a 100 GB checkpoint's shard headers are < 1 MiB).
MAX_HEADER_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def _bad(path: str, what: str, tensor: str | None = None) -> Exl3FormatError:
    return Exl3FormatError(what, file=path, tensor=tensor,
                           fix="the file is damaged or not a safetensors file; re-download or re-convert it")


def unique_object(path: str):
    """A json object_pairs_hook refusing a key given twice (json.loads would keep the last one silently)."""
    def hook(items: list) -> dict:
        seen = set()
        for key, _ in items:
            if key in seen:
                raise Exl3FormatError(f"the key {key[:200]!r} appears twice in one object, so which entry holds is "
                                      "ambiguous", file=path, fix="repair or re-download the file")
            seen.add(key)
        return dict(items)
    return hook


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors header without reading tensor data."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"file is {size} bytes, too short for a safetensors header")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES:
                raise _bad(path, f"header claims {hlen} bytes (limit {MAX_HEADER_BYTES})")
            if 8 + hlen > size:
                raise _bad(path, f"header claims {hlen} bytes but the file has only {size - 8} after the length")
            raw = f.read(hlen)
    except OSError as e:
        raise Exl3FormatError(f"cannot read file: {e.strerror or e}", file=path,
                              fix="check that the checkpoint is complete and readable") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_object(path))
    except Exl3FormatError:
        raise
    # ValueError also covers integers longer than Python's int_max_str_digits.
    except (ValueError, RecursionError) as e:
        raise _bad(path, f"header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    data_start = 8 + hlen
    data_len = size - data_start
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(path, "__metadata__ must map strings to strings")
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _bad(path, "header entry is not an object", name)
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise _bad(path, f"unknown dtype {dtype!r}", name)
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < (1 << 40) for d in shape):
            raise _bad(path, f"invalid shape {shape!r}", name)
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise _bad(path, f"invalid data_offsets {offs!r} (need [begin, end] with 0 <= begin <= end)", name)
        if offs[1] > data_len:
            raise _bad(path, f"data_offsets {offs!r} outside the {data_len}-byte data section "
                             "(truncated file?)", name)
        nbytes = prod(shape) * DTYPE_SIZES[dtype]
        if offs[1] - offs[0] != nbytes:
            raise _bad(path, f"data_offsets span {offs[1] - offs[0]} bytes but {dtype}{shape} needs {nbytes}", name)
        infos[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + offs[0], nbytes)
    # Tensors sharing bytes mean a corrupt header (the safetensors library refuses them too).
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in infos.values() if i.nbytes)
    for (_, end, prev), (start, _, name) in zip(spans, spans[1:]):
        if start < end:
            raise _bad(path, f"data overlaps that of tensor '{prev}'", name)
    return infos, meta


def read_tensor(info: TensorInfo, device: str | torch.device = "cpu") -> torch.Tensor:
    """Read one tensor's bytes (and nothing else) from its file."""
    if info.dtype not in TORCH_DTYPES:
        raise Exl3FormatError(f"dtype {info.dtype} is not supported here", file=info.file, tensor=info.name)
    try:
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.nbytes)
    except OSError as e:
        raise Exl3FormatError(f"cannot read tensor data: {e.strerror or e}", file=info.file,
                              tensor=info.name, fix="check that the file is complete") from None
    if len(data) != info.nbytes:
        raise _bad(info.file, f"only {len(data)} of {info.nbytes} data bytes could be read", info.name)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    t = t.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)
    return t.to(device)
