"""Read an EXL3 checkpoint directory into per-module specs (headers only)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

from . import codebook as cb
from . import embedding as emb
from . import trellis as tr
from .errors import Exl3FormatError
from .hadamard import HAD
from .safetensors_io import TensorInfo, read_header, read_tensor, unique_object

EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", *cb.MARKER_VALUES)
INDEX_FILE = "model.safetensors.index.json"
NGRAM_FILE = "ngram_embedding.safetensors"
# An expert's (gate, up) names in checkpoints: Hugging Face's, and Mixtral's w1 / w3.
EXPERT_GATE_UP = (("gate_proj", "up_proj"), ("w1", "w3"))
# The converter never lists MTP and vision modules in tensor_storage: their absence there is normal. DeepSeek-style
# MTP ("nextn") modules are decoder layers numbered from num_hidden_layers on.
_UNLISTED = re.compile(r"(^|\.)(mtp|visual|vision_tower|vision_model|multi_modal_projector)(\.|$)")
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
SINGLE_FILE = "model.safetensors"
# The config.json sizes the reader uses (text_config's when there is one); null means not stated.
DIM_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size",
            "shared_expert_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
POSITIVE_DIMS = ("hidden_size", "num_attention_heads", "vocab_size")


@dataclass
class Exl3Spec:
    """One EXL3 linear: y = x @ W, W of shape k x n."""
    key: str
    k: int
    n: int
    bits: float
    codebook: str
    tensors: dict[str, TensorInfo]  # by role: trellis, suh|su, svh|sv, bias, mcg|mul1
    legacy_signs: bool = False
    padded_from: dict[str, int] = field(default_factory=dict)  # "k"/"n" -> logical size

    @property
    def has_bias(self) -> bool:
        return "bias" in self.tensors

    @property
    def half_bits(self) -> bool:
        return self.bits != int(self.bits)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def trellis_bytes(self) -> int:
        return self.tensors["trellis"].nbytes


@dataclass
class EmbeddingSpec:
    """A quantized token embedding: rows x hidden, K bits per value (format/embedding.py)."""
    key: str
    rows: int
    hidden: int  # groups * 256; the model's hidden size may be smaller
    bits: int
    tensors: dict[str, TensorInfo]  # trellis, signs

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass
class DenseSpec:
    """A module stored unquantized (norms, embeddings, routers, unquantized linears)."""
    key: str
    tensors: dict[str, TensorInfo]

    @property
    def shape(self) -> tuple[int, ...]:
        w = self.tensors.get("weight")
        return w.shape if w else ()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass
class Exl3Weights:
    """The tensors of one EXL3 linear, ready for the reference or a kernel."""
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    codebook: str
    bias: torch.Tensor | None = None

    @property
    def bits(self) -> float:
        return tr.bits_from_width(self.trellis.shape[-1])


def _short(value: object) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _read_json(path: str, what: str, unique_keys: bool = False) -> dict:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"),
                              object_pairs_hook=unique_object(path) if unique_keys else None)
    except Exl3FormatError:
        raise
    except FileNotFoundError:
        raise Exl3FormatError(f"{what} is missing", file=path,
                              fix="point at the directory exllamav3's converter wrote") from None
    # ValueError also covers integers longer than Python's int_max_str_digits.
    except (ValueError, RecursionError) as e:
        raise Exl3FormatError(f"{what} is not valid JSON ({type(e).__name__}: {e})", file=path,
                              fix="repair or re-download the file") from None
    except OSError as e:
        raise Exl3FormatError(f"cannot read {what}: {e.strerror or e}", file=path) from None
    if not isinstance(data, dict):
        raise Exl3FormatError(f"{what} must hold a JSON object", file=path, fix="repair or re-download the file")
    return data


def _inside(root: str, name: object, index_path: str) -> str:
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or "\0" in name \
            or any(part in ("..", ".", "") for part in name.split("/")):
        raise Exl3FormatError(f"weight_map names file {name!r}, which is not a plain relative path "
                              "inside the checkpoint", file=index_path, fix="repair the index")
    path = os.path.join(root, name)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise Exl3FormatError(f"weight_map file {name!r} resolves outside the checkpoint", file=index_path,
                              fix="repair the index or the symbolic link")
    return path


def _dims_from_config(config: dict) -> set[int]:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    dims = set()
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size",
                "shared_expert_intermediate_size"):
        v = text.get(key)
        if type(v) is int and v > 0:
            dims.add(v)
    heads, kv, hd, hid = (text.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "hidden_size"))
    if type(heads) is int and heads > 0:
        if not (type(hd) is int and hd > 0) and type(hid) is int:
            hd = hid // heads
        if type(hd) is int:
            dims.add(heads * hd)
            if type(kv) is int and kv > 0:
                dims.add(kv * hd)
    return dims


class Checkpoint:
    """An EXL3 checkpoint directory: config, tensor headers and module specs.

    Only headers (and 4-byte codebook markers) are read on open; tensors are
    read one at a time with tensor() or weights().
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.warnings: list[str] = []
        self.unsupported: list[tuple[str, str]] = []  # (file or module, what): readable, but not servable
        if not os.path.isdir(self.path):
            raise Exl3FormatError("not a directory", file=self.path, fix="pass the checkpoint directory")
        self.config = _read_json(os.path.join(self.path, "config.json"), "config.json")
        qc = self.config.get("quantization_config")
        if not isinstance(qc, dict) or qc.get("quant_method") != "exl3":
            raise Exl3FormatError("config.json has no quantization_config with quant_method 'exl3'",
                                  file=os.path.join(self.path, "config.json"),
                                  fix="this is not an EXL3 checkpoint; convert it with exllamav3 first")
        self.quantization_config = qc
        self._check_config_types()
        self.tensor_storage = self._read_tensor_storage()
        self.tensors = self._read_tensors()
        self.modules: dict[str, Exl3Spec | DenseSpec] = {}
        self.other: dict[str, TensorInfo] = {}
        self._build_specs()
        if os.path.exists(os.path.join(self.path, NGRAM_FILE)):
            self.unsupported.append((NGRAM_FILE, "hashed n-gram embedding tables (exllamav3's --ngram_bits), "
                                                 "which vLLM's models do not read"))
        self._check_experts()
        self._find_split_vision_qkv()
        self._check_storage()
        self._check_bits()

    def _check_config_types(self) -> None:
        """A field of the wrong type in config.json is refused, not skipped: vLLM would fail on it later."""
        path = os.path.join(self.path, "config.json")

        def fail(what):
            return Exl3FormatError(what, file=path, fix="repair config.json or re-download it")

        bits = self.quantization_config.get("bits")
        if bits is not None and type(bits) not in (int, float):  # bools are not numbers here
            raise fail(f"quantization_config.bits must be a number, found {_short(bits)}")
        tc = self.config.get("text_config")
        if tc is not None and not isinstance(tc, dict):
            raise fail(f"text_config must be an object, found {_short(tc)}")
        text, where = (tc, "text_config.") if tc is not None else (self.config, "")
        for key in DIM_KEYS:
            v, least = text.get(key), 1 if key in POSITIVE_DIMS else 0
            if v is not None and not (type(v) is int and v >= least):
                raise fail(f"{where}{key} must be an integer >= {least}, found {_short(v)}")

    def _find_split_vision_qkv(self) -> None:
        """A Qwen-VL vision tower quantized by the converter keeps attention as split EXL3 q/k/v beside the fused
        source (docs/format.md 1.9); the plugin runs them as one qkv layer."""
        self.split_vision_qkv = sorted(k for k, m in self.modules.items() if isinstance(m, Exl3Spec)
                                       and _UNLISTED.search(k) and k.endswith(".attn.q_proj"))

    def _check_experts(self) -> None:
        """Routed experts whose gate and up differ in K or codebook (hand-written recipes write them): vLLM fuses
        every expert's gate and up into one tensor, so the whole checkpoint is refused here, before any model."""
        bad: dict[str, list[tuple[Exl3Spec, Exl3Spec]]] = {}
        for key, gate in self.modules.items():
            pair = next((u for g, u in EXPERT_GATE_UP if key.endswith("." + g)), None)
            if pair is None or ".experts." not in key or not isinstance(gate, Exl3Spec):
                continue
            up = self.modules.get(key[: key.rindex(".") + 1] + pair)
            if isinstance(up, Exl3Spec) and (gate.bits, gate.codebook) != (up.bits, up.codebook):
                bad.setdefault(key.rsplit(".experts.", 1)[0], []).append((gate, up))
        if bad:
            g, u = next(iter(bad.values()))[0]
            n = sum(len(v) for v in bad.values())
            self.unsupported.append((g.key, f"{n} routed experts in {len(bad)} layer(s) whose gate and up differ in K "
                                            f"or codebook (here {g.bits:g} bits {g.codebook} and {u.bits:g} bits "
                                            f"{u.codebook}), which vLLM fuses into one tensor"))

    # ---- files -------------------------------------------------------------------------------
    def _read_tensor_storage(self) -> dict:
        path = os.path.join(self.path, "quantization_config.json")
        if not os.path.exists(path):
            self.warnings.append("quantization_config.json is missing: modules are taken from the tensors alone")
            return {}
        data = _read_json(path, "quantization_config.json")
        ts = data.get("tensor_storage", {})
        # Name the first offending module so the user knows where to look.
        bad = [k for k, v in ts.items() if not isinstance(v, dict)][:1] if isinstance(ts, dict) else []
        if not isinstance(ts, dict) or bad:
            raise Exl3FormatError("tensor_storage must map module names to objects", file=path,
                                  tensor=bad[0] if bad else None, fix="repair or re-download the file")
        return ts

    def _read_tensors(self) -> dict[str, TensorInfo]:
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index):
            data = _read_json(index, INDEX_FILE, unique_keys=True)
            wmap = data.get("weight_map")
            if not isinstance(wmap, dict) or not wmap:
                raise Exl3FormatError("index has no weight_map object", file=index, fix="repair the index")
            files: dict[str, list[str]] = {}
            for name, fname in wmap.items():
                files.setdefault(_inside(self.path, fname, index), []).append(name)
            tensors: dict[str, TensorInfo] = {}
            seen: dict[str, str] = {}  # tensor name -> the first shard whose header has it
            for fpath, names in files.items():
                if not os.path.isfile(fpath):
                    raise Exl3FormatError(f"shard listed in {INDEX_FILE} is missing", file=fpath,
                                          fix="download every shard the index names")
                infos, _ = read_header(fpath)
                # vLLM loads every tensor of every listed shard: a name in two of them is loaded twice.
                for name in infos:
                    if seen.setdefault(name, fpath) != fpath:
                        raise Exl3FormatError(f"the tensor is also in {seen[name]}; two shards hold it",
                                              file=fpath, tensor=name,
                                              fix="remove the stale shard or re-download the checkpoint")
                for name in names:
                    if name not in infos:
                        raise Exl3FormatError(f"{INDEX_FILE} places this tensor in the file, but its header "
                                              "does not have it", file=fpath, tensor=name,
                                              fix="the shard or the index is out of date")
                    tensors[name] = infos[name]
            return tensors
        single = os.path.join(self.path, SINGLE_FILE)
        if os.path.exists(single) and not os.path.isfile(single):
            raise Exl3FormatError("not a regular file", file=single, fix="replace it with the model's safetensors file")
        if not os.path.isfile(single):
            raise Exl3FormatError(f"neither {SINGLE_FILE} nor {INDEX_FILE} exists", file=self.path,
                                  fix="download the model's safetensors files")
        return read_header(single)[0]

    # ---- specs -------------------------------------------------------------------------------
    def _build_specs(self) -> None:
        groups: dict[str, dict[str, TensorInfo]] = {}
        for name, info in self.tensors.items():
            key, _, suffix = name.rpartition(".")
            if suffix in EXL3_SUFFIXES or suffix in ("weight", "bias", "signs"):
                groups.setdefault(key, {})[suffix] = info
            else:
                self.other[name] = info
        dims = _dims_from_config(self.config)
        for key, parts in groups.items():
            linear_parts = set(parts) & {"suh", "svh", "su", "sv", "mcg", "mul1", "bias"}
            if "trellis" in parts and ("signs" in parts or (len(parts["trellis"].shape) == 2 and not linear_parts)):
                self.modules[key] = self._embedding_spec(key, parts)
            elif "trellis" in parts:
                self.modules[key] = self._exl3_spec(key, parts, dims)
            elif "signs" in parts:
                raise Exl3FormatError("embedding signs without a trellis", file=parts["signs"].file,
                                      tensor=f"{key}.signs", fix="the checkpoint is incomplete")
            elif any(s in parts for s in EXL3_SUFFIXES):
                some = next(s for s in EXL3_SUFFIXES if s in parts)
                raise Exl3FormatError("EXL3 tensor without a trellis", file=parts[some].file,
                                      tensor=f"{key}.{some}", fix="the checkpoint is incomplete")
            else:
                self.modules[key] = DenseSpec(key, parts)
        dense = [t for m in self.modules.values() if isinstance(m, DenseSpec) for t in m.tensors.values()]
        for info in dense + list(self.other.values()):
            # No model has a 0-sized weight: vLLM would fail on the shape, with its own traceback.
            if 0 in info.shape:
                raise Exl3FormatError(f"zero-sized tensor {info.dtype}{list(info.shape)}", file=info.file,
                                      tensor=info.name, fix="the file is damaged; re-download or re-convert it")

    def _embedding_spec(self, key: str, parts: dict[str, TensorInfo]) -> EmbeddingSpec:
        t, name = parts["trellis"], f"{key}.trellis"
        extra = sorted(set(parts) - {"trellis", "signs"})
        if extra:
            raise Exl3FormatError(f"a quantized embedding has only .trellis and .signs, found .{extra[0]} too",
                                  file=parts[extra[0]].file, tensor=f"{key}.{extra[0]}",
                                  fix="re-convert or re-download this module")
        sg = parts.get("signs")
        if sg is None:
            raise Exl3FormatError(f"a linear's trellis must be 3-D [k/16, n/16, 16K], found {list(t.shape)}; a 2-D "
                                  "trellis is a quantized embedding, but its .signs are missing (row-sharded tables, "
                                  ".shard_N.trellis, are not supported)", file=t.file, tensor=name,
                                  fix="the checkpoint is incomplete")
        if t.dtype != "I16" or len(t.shape) != 2 or t.shape[0] == 0:
            raise Exl3FormatError(f"an embedding trellis must be int16 [rows, G*(1+16K)], found "
                                  f"{t.dtype}{list(t.shape)}", file=t.file, tensor=name,
                                  fix="re-convert or re-download this module")
        if sg.dtype != "F16" or len(sg.shape) != 2 or sg.shape[1] != emb.GROUP or sg.shape[0] == 0:
            raise Exl3FormatError(f"embedding signs must be fp16 [G, {emb.GROUP}], found {sg.dtype}{list(sg.shape)}",
                                  file=sg.file, tensor=sg.name, fix="re-convert or re-download this module")
        groups = sg.shape[0]
        bits = emb.bits_from_row(t.shape[1], groups, tensor=name, file=t.file)
        return EmbeddingSpec(key, t.shape[0], groups * emb.GROUP, bits, {"trellis": t, "signs": sg})

    def _exl3_spec(self, key: str, parts: dict[str, TensorInfo], dims: set[int]) -> Exl3Spec:
        t = parts["trellis"]
        name = f"{key}.trellis"

        def fail(what, tensor=name, info=t, fix="re-convert or re-download this module"):
            return Exl3FormatError(what, file=info.file, tensor=tensor, fix=fix)

        if "weight" in parts:
            raise fail("module has both a trellis and a dense weight", tensor=f"{key}.weight")
        if t.dtype != "I16":
            raise fail(f"trellis must be int16 (I16), found {t.dtype}")
        if len(t.shape) != 3:
            raise fail(f"trellis must be 3-D [k/16, n/16, 16K], found shape {list(t.shape)}")
        bits = tr.bits_from_width(t.shape[2], tensor=name, file=t.file)
        k, n = 16 * t.shape[0], 16 * t.shape[1]
        if k == 0 or n == 0 or k % HAD or n % HAD:
            raise fail(f"k={k} and n={n} must be positive multiples of 128 (the Hadamard block)")
        markers = [m for m in cb.MARKER_VALUES if m in parts]
        if len(markers) == 2:
            raise fail(f"both .{markers[0]} and .{markers[1]} codebook markers are present", tensor=f"{key}.{markers[1]}")
        code = markers[0] if markers else "3inst"
        if markers:
            mk = parts[code]
            if mk.dtype != "I32" or mk.shape not in ((), (1,)):
                raise fail(f"codebook marker must be an int32 scalar, found {mk.dtype}{list(mk.shape)}",
                           tensor=mk.name, info=mk)
            value = int(read_tensor(mk).reshape(-1)[0])
            if value != cb.MARKER_VALUES[code]:
                raise fail(f"codebook marker holds {value}, expected {cb.MARKER_VALUES[code]}; "
                           "a different multiplier is not an EXL3 codebook this runtime knows",
                           tensor=mk.name, info=mk)
        if bits != int(bits) and code != "mul1":
            raise fail(f"half-integer K={bits} needs the mul1 codebook, but the codebook is {code}")
        roles = {"trellis": t}
        legacy = False
        for side, new, old, length in (("input", "suh", "su", k), ("output", "svh", "sv", n)):
            if new in parts:
                v = parts[new]
                if v.dtype != "F16" or v.shape != (length,):
                    raise fail(f"{new} must be fp16 [{length}], found {v.dtype}{list(v.shape)}",
                               tensor=v.name, info=v)
                roles[new] = v
            elif old in parts:
                v = parts[old]
                if v.dtype != "I16" or v.shape != (length // 16,):
                    raise fail(f"legacy {old} must be int16 [{length // 16}], found {v.dtype}{list(v.shape)}",
                               tensor=v.name, info=v)
                roles[old] = v
                legacy = True
            else:
                raise fail(f"the {side} scales {key}.{new} are missing", tensor=f"{key}.{new}")
        if "bias" in parts:
            b = parts["bias"]
            if b.dtype not in ("F16", "BF16", "F32") or b.shape != (n,):
                raise fail(f"bias must be a float vector [{n}], found {b.dtype}{list(b.shape)}",
                           tensor=b.name, info=b)
            roles["bias"] = b
        if markers:
            roles[code] = parts[code]
        padded = {}
        for axis, size in (("k", k), ("n", n)):
            for d in dims:
                if d < size < d + HAD and d % HAD:
                    padded[axis] = d
        return Exl3Spec(key, k, n, bits, code, roles, legacy, padded)

    def nextn_layer(self, key: str) -> str | None:
        """The prefix ("...layers.N.") of the DeepSeek-style MTP layer key lies in (numbered from num_hidden_layers
        on), else None."""
        tc = self.config.get("text_config")
        layer, layers = _LAYER.search(key), (tc if isinstance(tc, dict) else self.config).get("num_hidden_layers")
        if layer is None or type(layers) is not int or int(layer.group(2)) < layers:
            return None
        return key[:layer.end()]

    def _unlisted(self, key: str) -> bool:
        """A module the converter leaves out of tensor_storage (MTP, vision)."""
        return bool(_UNLISTED.search(key)) or self.nextn_layer(key) is not None

    def _check_storage(self) -> None:
        path = os.path.join(self.path, "quantization_config.json")
        for key, spec in self.modules.items():
            entry = self.tensor_storage.get(key)
            if entry is None:
                if isinstance(spec, Exl3Spec) and self.tensor_storage and not self._unlisted(key):
                    self.warnings.append(f"{key}: EXL3 module in the tensors but not in tensor_storage")
                continue
            if isinstance(spec, Exl3Spec):
                fmt = entry.get("quant_format")
                if fmt not in (None, "exl3"):
                    raise Exl3FormatError(f"tensor_storage says quant_format {fmt!r} but the module has a trellis",
                                          file=path, tensor=key, fix="the file does not match the tensors")
                bpw = entry.get("bits_per_weight")
                # Exact comparison: float() of a huge JSON integer would overflow; bools are not numbers here.
                if bpw is not None and (type(bpw) not in (int, float) or bpw != spec.bits):
                    raise Exl3FormatError(
                        f"tensor_storage says bits_per_weight {bpw!r} but the trellis holds {spec.bits} bits",
                        file=path, tensor=key, fix="the config does not match the tensors; re-convert")
            stored = entry.get("stored_tensors", {})
            if not isinstance(stored, dict):
                raise Exl3FormatError("stored_tensors must be an object", file=path, tensor=key)
            for tname, meta in stored.items():
                if not isinstance(meta, dict):
                    raise Exl3FormatError(f"a stored_tensors entry must be an object, found {_short(meta)}",
                                          file=path, tensor=tname, fix="repair or re-download the file")
                info = self.tensors.get(tname)
                if info is None:
                    raise Exl3FormatError("tensor_storage lists this tensor but no safetensors file has it",
                                          file=path, tensor=tname, fix="the checkpoint is incomplete")
                shape = meta.get("shape")
                # Type-strict: 256.0 or true is not a size, even where Python calls it equal.
                if shape is not None and (not isinstance(shape, list) or any(type(d) is not int for d in shape)
                                          or shape != list(info.shape)):
                    raise Exl3FormatError(f"tensor_storage gives shape {_short(shape)} but the file holds "
                                          f"{list(info.shape)}", file=path, tensor=tname,
                                          fix="the config does not match the tensors")
        for key in self.tensor_storage:
            if key not in self.modules and not any(t.startswith(key + ".") for t in self.other):
                self.warnings.append(f"{key}: in tensor_storage but no tensors found")

    def _check_bits(self) -> None:
        stated = self.quantization_config.get("bits")
        avg = self.average_bpw()
        # abs(stated) > 64 first: a huge JSON integer cannot be turned into a float; NaN also warns.
        # measure + optimize output states the storage average (trellis, scales and markers) instead.
        mods = self.decoder_linears()
        stored = sum(8 * m.nbytes for m in mods) / max(1, sum(m.k * m.n for m in mods))
        if type(stated) in (int, float) and avg is not None and (abs(stated) > 64 or not (
                abs(stated - avg) <= 0.015 or abs(stated - stored) <= 0.015)):
            self.warnings.append(f"config.json says bits={stated} but the decoder linears average {avg:.2f} bpw")
        # Half-integer K (mul1, the converter's default below 4 bpw) is no warning: this runtime serves it.
        for spec in self.exl3_modules():
            if spec.legacy_signs:
                self.warnings.append(f"{spec.key}: legacy su/sv sign vectors (no magnitudes)")

    # ---- queries -----------------------------------------------------------------------------
    def exl3_modules(self) -> list[Exl3Spec]:
        return [m for m in self.modules.values() if isinstance(m, Exl3Spec)]

    @staticmethod
    def is_head(key: str) -> bool:
        return key.rsplit(".", 1)[-1] in ("lm_head", "output", "head")

    def decoder_linears(self) -> list[Exl3Spec]:
        """The EXL3 linears config's `bits` speaks of: not the head, nor MTP and vision modules (mtp_bits and
        vision_bits state theirs)."""
        return [m for m in self.exl3_modules() if not self.is_head(m.key) and not self._unlisted(m.key)]

    def average_bpw(self) -> float | None:
        """Trellis bits per weight over the decoder linears."""
        mods = self.decoder_linears()
        weights = sum(m.k * m.n for m in mods)
        return sum(m.bits * m.k * m.n for m in mods) / weights if weights else None

    def model_bpw(self) -> float | None:
        """Bits per weight over every weight matrix: EXL3 linears, head and embedding at K, dense ones at 16."""
        bits = weights = 0
        for m in self.modules.values():
            if isinstance(m, Exl3Spec):
                n, b = m.k * m.n, m.bits
            elif isinstance(m, EmbeddingSpec):
                n, b = m.rows * m.hidden, m.bits
            elif len(m.shape) == 2:
                n, b = m.shape[0] * m.shape[1], 16
            else:
                continue
            bits, weights = bits + b * n, weights + n
        return bits / weights if weights else None

    def verify(self) -> None:
        """Read what the headers cannot vouch for (format/integrity.py); raises Exl3FormatError naming the first bad
        file or tensor."""
        from .integrity import verify

        verify(self)

    def tensor(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        info = self.tensors.get(name)
        if info is None:
            raise Exl3FormatError("no such tensor in the checkpoint", file=self.path, tensor=name)
        return read_tensor(info, device)

    def weights(self, key: str, device: str | torch.device = "cpu") -> Exl3Weights:
        spec = self.modules.get(key)
        if not isinstance(spec, Exl3Spec):
            raise Exl3FormatError("not an EXL3 module", file=self.path, tensor=key)
        r = spec.tensors
        suh = read_tensor(r["suh"], device) if "suh" in r else signs_to_half(read_tensor(r["su"], device))
        svh = read_tensor(r["svh"], device) if "svh" in r else signs_to_half(read_tensor(r["sv"], device))
        bias = read_tensor(r["bias"], device) if "bias" in r else None
        return Exl3Weights(read_tensor(r["trellis"], device), suh, svh, spec.codebook, bias)


def signs_to_half(packed: torch.Tensor) -> torch.Tensor:
    """Legacy su/sv: channel 16w+i is bit i of word w; a set bit means -1."""
    bits = (packed.to(torch.int32).unsqueeze(-1) >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)
