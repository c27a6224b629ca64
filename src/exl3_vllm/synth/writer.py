"""Stream a planned model into sharded safetensors, plus configs and tokenizer."""

from __future__ import annotations

import copy
import json
import os
import re
import struct
import time
from dataclasses import dataclass
from math import prod
from typing import Callable, Iterable

import numpy as np
import torch

from ..format.errors import Exl3FormatError
from ..format.embedding import dense_table
from ..format.reconstruct import dense_weight
from . import tensors as gen
from .plan import DTYPE_SIZES, Plan, plan
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILES, vision_token_ids, write_tokenizer

DEFAULT_SHARD_BYTES = 2 * 1024 ** 3
INDEX_FILE = "model.safetensors.index.json"
DENSE_DTYPES = {"bfloat16": ("BF16", torch.bfloat16), "float32": ("F32", torch.float32)}
PREPROCESSOR = "preprocessor_config.json"
_OUR_FILES = ("config.json", "quantization_config.json", INDEX_FILE, "model.safetensors",
              PREPROCESSOR) + TOKENIZER_FILES
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass
class Entry:
    """A tensor to stream: header facts plus a function yielding its bytes as numpy chunks."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_SIZES[self.dtype]


def _shard_groups(groups: list[list[Entry]], limit: int) -> list[list[Entry]]:
    # Whole modules per shard, as exllamav3's compile does; a module larger than the limit gets its own.
    shards: list[list[Entry]] = [[]]
    size = 0
    for group in groups:
        g = sum(e.nbytes for e in group)
        if size + g > limit and size > 0:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += g
    return [s for s in shards if s]


def _write_file(path: str, entries: list[Entry]) -> None:
    # 4-byte dtypes first so every tensor's data stays aligned to its element size.
    entries = sorted(entries, key=lambda e: -DTYPE_SIZES[e.dtype])
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb", buffering=1 << 24) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            written = 0
            for chunk in e.produce():
                chunk = np.ascontiguousarray(chunk)
                f.write(chunk.data.cast("B") if chunk.ndim else chunk.tobytes())
                written += chunk.nbytes
            if written != e.nbytes:
                raise AssertionError(f"{e.name}: produced {written} bytes, header says {e.nbytes}")


def write_sharded(out_dir: str, groups: list[list[Entry]], shard_bytes: int | None = None) -> list[str]:
    """Write groups of tensors as model.safetensors or model-0000i-of-0000N.safetensors + index."""
    total = sum(e.nbytes for g in groups for e in g)
    if shard_bytes is None:
        # Small models still get >= 2 shards so readers exercise the index.
        shard_bytes = min(DEFAULT_SHARD_BYTES, max(1, -(-total // 2)))
    shards = _shard_groups(groups, shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05}-of-{len(shards):05}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for name, entries in zip(names, shards):
        _write_file(os.path.join(out_dir, name), entries)
        for e in entries:
            weight_map[e.name] = name
    if len(shards) > 1:
        _write_json(os.path.join(out_dir, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=4))
        f.write("\n")


def _prepare_dir(path: str, overwrite: bool, what: str) -> None:
    """Check (before anything is written) that path can take a checkpoint."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise Exl3FormatError(f"{what} exists and is not a directory", file=path)
    if os.path.isdir(path):
        present = os.listdir(path)
        if present and not overwrite:
            raise Exl3FormatError(f"{what} is not empty", file=path,
                                  fix="choose a new directory, or pass overwrite=True / --overwrite to replace "
                                      "the files synth writes")


def _clean_dir(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name in _OUR_FILES or _SHARD_RE.fullmatch(name):
            os.remove(os.path.join(path, name))


def _base_config(p: Plan) -> dict:
    cfg = copy.deepcopy(p.config)
    cfg.pop("quantization_config", None)
    # The converter always writes a separate lm_head; the ids are those of the synthetic tokenizer.
    for c in (cfg, cfg.get("text_config")):
        if isinstance(c, dict):
            c["tie_word_embeddings"] = False
            c["bos_token_id"], c["eos_token_id"], c["pad_token_id"] = BOS_ID, EOS_ID, PAD_ID
    if _vision(p):
        cfg.update(vision_token_ids(p.text["vocab_size"]))
    return cfg


def _vision(p: Plan) -> bool:
    return isinstance(p.config.get("vision_config"), dict)


def _write_preprocessor(p: Plan, out_dir: str) -> None:
    """A multimodal model's image processor settings (Qwen-VL's published ones), which its processor needs."""
    v = p.config.get("vision_config")
    if _vision(p):
        _write_json(os.path.join(out_dir, PREPROCESSOR), {
            "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": v.get("patch_size", 16),
            "temporal_patch_size": v.get("temporal_patch_size", 2), "merge_size": v.get("spatial_merge_size", 2),
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"})


def _quant_groups(p: Plan, seed: int) -> list[list[Entry]]:
    def producer(tp):
        return lambda: gen.chunks(tp, seed)
    return [[Entry(t.name, t.dtype, t.shape, producer(t)) for t in m.tensors] for m in p.modules]


_SLICE = re.compile(r"(.*)\.slice\.(\d+)\.weight$")


def _dense_groups(p: Plan, seed: int, dense_dtype: str) -> list[list[Entry]]:
    st_dtype, torch_dtype = DENSE_DTYPES[dense_dtype]
    groups = []
    for m in p.modules:
        if m.kind == "exl3_embedding":
            def table(m=m):
                t = dense_table(gen.value(m.tensor("trellis"), seed), gen.value(m.tensor("signs"), seed),
                                m.in_features)
                yield t.to(torch_dtype).contiguous().view(torch.uint8).numpy()

            groups.append([Entry(f"{m.key}.weight", st_dtype, (m.out_features, m.in_features), table)])
            continue
        if m.kind == "dense" and m.is_head and m.out_features != p.text["vocab_size"]:
            def head(m=m):  # the converter's row padding, trimmed back for the plain HF twin
                yield gen.value(m.tensors[0], seed)[:p.text["vocab_size"]].contiguous().numpy()

            t = m.tensors[0]
            groups.append([Entry(t.name, t.dtype, (p.text["vocab_size"], t.shape[1]), head)])
            continue
        if m.kind != "exl3":
            groups.append([Entry(t.name, t.dtype, t.shape, (lambda t=t: gen.chunks(t, seed))) for t in m.tensors])
            continue

        def weight(m=m):
            w = dense_weight(gen.value(m.tensor("trellis"), seed), gen.value(m.tensor("suh"), seed),
                             gen.value(m.tensor("svh"), seed), m.codebook, torch.float32)
            # HF (out, in) orientation, padding trimmed back to the logical sizes.
            w = w.T[:m.out_features, :m.in_features].to(torch_dtype).contiguous()
            yield w.view(torch.uint8).numpy()

        def bias(m=m):
            yield gen.value(m.tensor("bias"), seed)[:m.out_features].numpy()

        group = [Entry(f"{m.key}.weight", st_dtype, (m.out_features, m.in_features), weight)]
        if m.bias:
            group.append(Entry(f"{m.key}.bias", "F16", (m.out_features,), bias))
        groups.append(group)
    return _join_slices(groups, torch_dtype)


def _join_slices(groups: list[list[Entry]], torch_dtype) -> list[list[Entry]]:
    """The dense twin of a sliced MLP is the plain HF module: `<key>.slice.N.weight` joined along the intermediate
    size (the output rows of gate / up, the input columns of down)."""
    out, sliced = [], {}
    for g in groups:
        m = _SLICE.match(g[0].name)
        if m is None:
            out.append(g)
            continue
        if m.group(1) not in sliced:
            sliced[m.group(1)] = []
            out.append(sliced[m.group(1)])  # filled below, in place
        sliced[m.group(1)].append(g[0])
    for key, holder in sliced.items():
        parts = list(holder)
        dim = 1 if key.endswith("down_proj") else 0
        shape = list(parts[0].shape)
        shape[dim] = sum(e.shape[dim] for e in parts)

        def joined(parts=parts, dim=dim):
            ws = [torch.from_numpy(np.concatenate(list(e.produce()))).view(torch_dtype).view(e.shape) for e in parts]
            yield torch.cat(ws, dim).contiguous().view(torch.uint8).numpy()

        holder[:] = [Entry(f"{key}.weight", parts[0].dtype, tuple(shape), joined)]
    return out


def synthesize(config_or_preset, out_dir, bits=4.0, codebook: str = "mul1", head_bits=6, bits_map=None,
               seed: int = 0, embed_bits=16, also_dense=None, dense_dtype: str = "bfloat16", *, shard_bytes: int | None = None,
               overwrite: bool = False, log: Callable[[str], None] | None = None, mlp_slices: int = 1) -> str:
    """Write a synthetic EXL3 checkpoint (and optionally its dense twin); returns the absolute out_dir.

    config_or_preset: a preset name (see PRESETS), an HF config.json path (or its directory) or a dict.
    bits_map: a JSON file path or dict {module-key glob: bits | {"bits": b, "codebook": c}}, first match wins.
    """
    t0 = time.time()
    p = plan(config_or_preset, bits=bits, codebook=codebook, head_bits=head_bits, bits_map=bits_map,
             embed_bits=embed_bits, mlp_slices=mlp_slices)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise Exl3FormatError(f"seed must be a non-negative integer, got {seed!r}")
    if dense_dtype not in DENSE_DTYPES:
        raise Exl3FormatError(f"dense dtype {dense_dtype!r} is not supported", fix=f"use one of {', '.join(DENSE_DTYPES)}")
    if shard_bytes is not None and (isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int)
                                    or shard_bytes <= 0):
        raise Exl3FormatError(f"shard size must be a positive number of bytes, got {shard_bytes!r}")
    out_dir = os.path.abspath(os.fspath(out_dir))
    dense_dir = os.path.abspath(os.fspath(also_dense)) if also_dense is not None else None
    if dense_dir == out_dir:
        raise Exl3FormatError("the dense copy needs its own directory, not the EXL3 output directory", file=dense_dir)
    _prepare_dir(out_dir, overwrite, "output directory")
    if dense_dir:
        _prepare_dir(dense_dir, overwrite, "dense output directory")
    vocab = p.text["vocab_size"]
    max_len = p.text.get("max_position_embeddings")
    max_len = max_len if type(max_len) is int and max_len > 0 else 4096

    _clean_dir(out_dir)
    names = write_sharded(out_dir, _quant_groups(p, seed), shard_bytes)
    qc = p.quantization_config()
    src_qc = p.config.get("quantization_config")
    if isinstance(src_qc, dict) and src_qc.get("quant_method") != "exl3":
        qc["original_quantization_config"] = src_qc
    cfg = _base_config(p)
    cfg["quantization_config"] = qc
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    _write_json(os.path.join(out_dir, "quantization_config.json"), {**qc, "tensor_storage": p.tensor_storage()})
    write_tokenizer(out_dir, vocab, max_len, _vision(p))
    _write_preprocessor(p, out_dir)
    if log:
        log(f"wrote {out_dir}: {len(names)} safetensors file(s), {p.total_bytes / 1024 ** 3:.2f} GiB, "
            f"{qc['bits']:.2f} bpw decoder average, head {p.head_bits} bits, {time.time() - t0:.1f} s")

    if dense_dir:
        t1 = time.time()
        _clean_dir(dense_dir)
        names = write_sharded(dense_dir, _dense_groups(p, seed, dense_dtype), shard_bytes)
        cfg = _base_config(p)
        cfg["torch_dtype"] = dense_dtype
        _write_json(os.path.join(dense_dir, "config.json"), cfg)
        write_tokenizer(dense_dir, vocab, max_len, _vision(p))
        _write_preprocessor(p, dense_dir)
        if log:
            log(f"wrote {dense_dir}: dense {dense_dtype} twin, {len(names)} safetensors file(s), "
                f"{time.time() - t1:.1f} s")
    return out_dir


def write_config_only(config_or_preset, out_dir, dtype: str = "bfloat16", *, overwrite: bool = False,
                      log: Callable[[str], None] | None = None) -> str:
    """config.json and tokenizer of the unquantized network synthesize() would write, and no weights.

    For vLLM's --load-format dummy: the same architecture and tokenizer as the EXL3 checkpoint, in dtype.
    """
    p = plan(config_or_preset)
    if dtype not in DENSE_DTYPES:
        raise Exl3FormatError(f"dtype {dtype!r} is not supported", fix=f"use one of {', '.join(DENSE_DTYPES)}")
    out_dir = os.path.abspath(os.fspath(out_dir))
    _prepare_dir(out_dir, overwrite, "output directory")
    _clean_dir(out_dir)
    cfg = _base_config(p)
    cfg["torch_dtype"] = dtype
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    max_len = p.text.get("max_position_embeddings")
    write_tokenizer(out_dir, p.text["vocab_size"], max_len if type(max_len) is int and max_len > 0 else 4096,
                    _vision(p))
    _write_preprocessor(p, out_dir)
    if log:
        log(f"wrote {out_dir}: config.json and tokenizer only ({p.arch}, {dtype}, no weights)")
    return out_dir
