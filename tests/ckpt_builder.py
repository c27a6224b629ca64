"""Tiny EXL3 checkpoints written byte by byte, so tests can corrupt any part of them.

A checkpoint is described by plain data (tensors, config, quantization_config)
and written with write_checkpoint(); safetensors files are built by hand
(8-byte little-endian header length, JSON header, data) rather than with the
safetensors library, so every field can be made wrong on purpose.
"""

from __future__ import annotations

import copy
import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from exl3_vllm.format.codebook import MARKER_VALUES

NP_DTYPES = {"I16": np.int16, "F16": np.float16, "BF16": np.uint16, "F32": np.float32, "I32": np.int32,
             "I64": np.int64, "U8": np.uint8}
DTYPE_SIZES = {"I16": 2, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "U16": 2}
TORCH_DTYPE_NAMES = {"I16": "torch.int16", "F16": "torch.float16", "BF16": "torch.bfloat16",
                     "F32": "torch.float32", "I32": "torch.int32", "I64": "torch.int64", "U8": "torch.uint8"}
Q_KEY = "model.layers.0.self_attn.q_proj"
O_KEY = "model.layers.0.self_attn.o_proj"


@dataclass
class T:
    """One tensor as it will be written: safetensors dtype name, shape, raw bytes."""
    dtype: str
    shape: list[int]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def tensor(dtype: str, shape: list[int], rng: np.random.Generator, *, values=None) -> T:
    """A tensor of the given dtype and shape, random unless values are given."""
    count = int(np.prod(shape)) if shape else 1
    if values is not None:
        arr = np.asarray(values, dtype=NP_DTYPES[dtype]).reshape(count)
    elif dtype in ("F16", "F32"):
        arr = rng.uniform(-1.5, 1.5, count).astype(NP_DTYPES[dtype])
    elif dtype == "BF16":
        arr = (rng.uniform(-1.5, 1.5, count).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        info = np.iinfo(NP_DTYPES[dtype])
        arr = rng.integers(info.min, info.max, count, endpoint=True, dtype=NP_DTYPES[dtype])
    return T(dtype, list(shape), arr.astype(arr.dtype.newbyteorder("<")).tobytes())


def width(bits: float) -> int:
    return int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8


def linear_tensors(key: str, k: int, n: int, rng: np.random.Generator, *, bits: float = 4,
                   codebook: str = "mul1", bias: bool = False, legacy: bool = False) -> dict[str, T]:
    """The tensors of one valid EXL3 linear (any int16 bit pattern is a valid trellis)."""
    out = {f"{key}.trellis": tensor("I16", [k // 16, n // 16, width(bits)], rng)}
    if legacy:
        out[f"{key}.su"] = tensor("I16", [k // 16], rng)
        out[f"{key}.sv"] = tensor("I16", [n // 16], rng)
    else:
        out[f"{key}.suh"] = tensor("F16", [k], rng)
        out[f"{key}.svh"] = tensor("F16", [n], rng)
    if codebook in MARKER_VALUES:
        out[f"{key}.{codebook}"] = tensor("I32", [], rng, values=[MARKER_VALUES[codebook]])
    if bias:
        out[f"{key}.bias"] = tensor("F16", [n], rng)
    return out


def safetensors_bytes(tensors: dict[str, T], metadata: dict | None = None) -> bytes:
    """A safetensors file: u64 LE header length, JSON header, then the data in order."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw + b"".join(t.data for t in tensors.values())


def raw_safetensors(header: object, data: bytes = b"") -> bytes:
    """A file with an arbitrary (possibly invalid) JSON header."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def split_file(blob: bytes) -> tuple[dict, bytes]:
    """(header dict, data bytes) of a safetensors blob written by safetensors_bytes."""
    (hlen,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + hlen]), blob[8 + hlen:]


def storage_entry(key: str, tensors: dict[str, T]) -> dict:
    """The tensor_storage entry exllamav3's converter writes for one module."""
    own = {name: t for name, t in tensors.items() if name.rpartition(".")[0] == key}
    entry: dict = {"stored_tensors": {
        name: {"shape": list(t.shape), "n_bytes": t.nbytes, "dtype": TORCH_DTYPE_NAMES.get(t.dtype, t.dtype)}
        for name, t in own.items()}}
    trellis = own.get(f"{key}.trellis")
    if trellis is not None:
        w = trellis.shape[-1] if trellis.shape else 0
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = w // 16 if w % 16 == 0 else w / 16
        if f"{key}.mul1" in own:
            entry["mul1_multiplier"] = MARKER_VALUES["mul1"] + (1 << 32)
        if f"{key}.mcg" in own:
            entry["mcg_multiplier"] = MARKER_VALUES["mcg"] + (1 << 32)
    return entry


@dataclass
class Ckpt:
    """A checkpoint before it is written; tests mutate the fields, then call write()."""
    tensors: dict[str, T]
    config: dict
    qcfg: dict  # quantization_config.json (with tensor_storage)
    shards: list[list[str]] | None = None  # tensor names per shard; None = one model.safetensors
    extra_files: dict[str, bytes] = field(default_factory=dict)

    def shard_names(self) -> list[str]:
        n = len(self.shards or [])
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def file_of(self, tensor_name: str) -> str:
        """The file name a tensor is written to."""
        if self.shards is None:
            return "model.safetensors"
        for fname, names in zip(self.shard_names(), self.shards):
            if tensor_name in names:
                return fname
        raise KeyError(tensor_name)

    def index(self) -> dict:
        weight_map = {name: fname for fname, names in zip(self.shard_names(), self.shards or [])
                      for name in names}
        return {"metadata": {"total_size": sum(t.nbytes for t in self.tensors.values())},
                "weight_map": weight_map}

    def write(self, path) -> str:
        path = str(path)
        os.makedirs(path, exist_ok=True)
        files: dict[str, bytes] = {
            "config.json": json.dumps(self.config, indent=2).encode(),
            "quantization_config.json": json.dumps(self.qcfg, indent=2).encode(),
        }
        if self.shards is None:
            files["model.safetensors"] = safetensors_bytes(self.tensors, {"format": "pt"})
        else:
            for fname, names in zip(self.shard_names(), self.shards):
                files[fname] = safetensors_bytes({n: self.tensors[n] for n in names if n in self.tensors},
                                                 {"format": "pt"})
            files["model.safetensors.index.json"] = json.dumps(self.index(), indent=2).encode()
        files.update(self.extra_files)
        for name, blob in files.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(blob)
        return path

    def copy(self) -> "Ckpt":
        return copy.deepcopy(self)


def make_ckpt(*, sharded: bool = False, seed: int = 0, dim: int = 256, bits: float = 4,
              codebook: str = "mul1", vocab: int = 128, bias: bool = False, legacy: bool = False) -> Ckpt:
    """A valid tiny llama-like EXL3 checkpoint: embedding, q_proj and o_proj (EXL3), a norm."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, T] = {"model.embed_tokens.weight": tensor("F16", [vocab, dim], rng)}
    tensors.update(linear_tensors(Q_KEY, dim, dim, rng, bits=bits, codebook=codebook, bias=bias, legacy=legacy))
    tensors.update(linear_tensors(O_KEY, dim, dim, rng, bits=bits, codebook=codebook))
    tensors["model.layers.0.input_layernorm.weight"] = tensor("F16", [dim], rng)
    tensors["model.norm.weight"] = tensor("F16", [dim], rng)
    qc = {"quant_method": "exl3", "version": "1.6.5", "bits": bits, "head_bits": 16,
          "calibration": {"rows": 100, "cols": 2048}, "out_scales": "auto", "codebook": codebook}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
              "intermediate_size": 2 * dim, "num_attention_heads": 4, "num_key_value_heads": 4,
              "num_hidden_layers": 1, "vocab_size": vocab, "torch_dtype": "float16",
              "tie_word_embeddings": False, "quantization_config": qc}
    keys = sorted({name.rpartition(".")[0] for name in tensors})
    qcfg = dict(qc, tensor_storage={key: storage_entry(key, tensors) for key in keys})
    shards = None
    if sharded:
        names = list(tensors)
        first = [n for n in names if n.startswith(("model.embed_tokens", Q_KEY))]
        shards = [first, [n for n in names if n not in first]]
    return Ckpt(tensors, config, qcfg, shards)
