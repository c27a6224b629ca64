"""The bad-input corpus: every malformed checkpoint raises Exl3FormatError naming the file/tensor.

Each case starts from a valid tiny checkpoint (tests/ckpt_builder.py), breaks one
thing, and checks that opening it raises our exception type (nothing else
escapes), that the message names the offending file and/or tensor, that it
returns promptly, and that nothing is written into the checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import struct

import numpy as np
import pytest
import torch

from ckpt_builder import O_KEY, Q_KEY, T, make_ckpt, raw_safetensors, split_file, storage_entry, tensor
from exl3_vllm.format.checkpoint import Checkpoint, DenseSpec, Exl3Spec, signs_to_half
from exl3_vllm.format.codebook import MARKER_VALUES
from exl3_vllm.format.errors import Exl3FormatError
from exl3_vllm.format.safetensors_io import MAX_HEADER_BYTES, read_header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
QCFG = "quantization_config.json"
RNG = np.random.default_rng(1234)


# ---- helpers -------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def no_hang():
    """Fail (instead of hanging) if one case takes more than 20 s."""
    def boom(signum, frame):
        raise TimeoutError("checkpoint reader did not return within 20 s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, 20)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def snapshot(root) -> dict:
    """Every file and directory under root with its size, mtime and content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = None
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns, digest)
    return out


def resync(ck):
    """Rebuild tensor_storage from the (mutated) tensors so that only the intended fault remains."""
    keys = sorted({name.rpartition(".")[0] for name in ck.tensors})
    ck.qcfg["tensor_storage"] = {key: storage_entry(key, ck.tensors) for key in keys}
    if ck.shards is not None:
        placed = {n for names in ck.shards for n in names}
        ck.shards[-1].extend(n for n in ck.tensors if n not in placed)
        ck.shards = [[n for n in names if n in ck.tensors] for names in ck.shards]
    return ck


def with_tensors(tmp, change, *, sharded=False, sync=True, **kw):
    """Write a checkpoint after change(tensors) edits its tensor dict."""
    ck = make_ckpt(sharded=sharded, **kw)
    change(ck.tensors)
    if sync:
        resync(ck)
    return ck.write(tmp / "ckpt")


def with_file(tmp, fname, change, *, sharded=False):
    """Write a valid checkpoint, then replace one file's bytes with change(old_bytes) (None deletes it)."""
    path = make_ckpt(sharded=sharded).write(tmp / "ckpt")
    fpath = os.path.join(path, fname)
    with open(fpath, "rb") as f:
        blob = f.read()
    new = change(blob)
    if new is None:
        os.remove(fpath)
    else:
        with open(fpath, "wb") as f:
            f.write(new)
    return path


def with_header(tmp, change, fname=SINGLE, *, sharded=False):
    """Edit the JSON header of one safetensors file (data bytes unchanged)."""
    def edit(blob):
        header, data = split_file(blob)
        change(header)
        return raw_safetensors(header, data)
    return with_file(tmp, fname, edit, sharded=sharded)


def with_json(tmp, fname, change, *, sharded=False):
    """Edit one JSON file: change(obj) edits in place or returns a replacement object."""
    def edit(blob):
        obj = json.loads(blob)
        new = change(obj)
        return json.dumps(obj if new is None else new).encode()
    return with_file(tmp, fname, edit, sharded=sharded)


def header_blob(raw: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(raw)) + raw + data


def set_key(d, key, value):
    d[key] = value


def popper(*names):
    def change(tensors):
        for n in names:
            del tensors[n]
    return change


def setter(name, t):
    def change(tensors):
        tensors[name] = t
    return change


# ---- the corpus ----------------------------------------------------------------------------------
CASES: dict = {}


def case(name, *must_name):
    """Register a case; the error message must contain every string in must_name."""
    def deco(fn):
        assert name not in CASES
        CASES[name] = (fn, must_name)
        return fn
    return deco


def _cut(n):
    return lambda blob: blob[:n(blob)]


def _hlen(blob):
    return struct.unpack("<Q", blob[:8])[0]


# safetensors container: truncation at several points
for _name, _at in {
    "truncated_in_length_prefix": lambda b: 4,
    "truncated_in_header": lambda b: 8 + _hlen(b) // 2,
    "truncated_after_header": lambda b: 8 + _hlen(b),
    "truncated_mid_data": lambda b: 8 + _hlen(b) + (len(b) - 8 - _hlen(b)) // 2,
    "truncated_last_byte": lambda b: len(b) - 1,
}.items():
    case(_name, SINGLE)(lambda tmp, _at=_at: with_file(tmp, SINGLE, _cut(_at)))

case("empty_file", SINGLE)(lambda tmp: with_file(tmp, SINGLE, lambda b: b""))
case("header_length_beyond_file", SINGLE)(
    lambda tmp: with_file(tmp, SINGLE, lambda b: struct.pack("<Q", len(b)) + b[8:]))
case("header_length_over_limit", SINGLE)(
    lambda tmp: with_file(tmp, SINGLE, lambda b: struct.pack("<Q", MAX_HEADER_BYTES + 1) + b[8:]))
case("header_length_2_64_minus_1", SINGLE)(
    lambda tmp: with_file(tmp, SINGLE, lambda b: b"\xff" * 8 + b[8:]))
case("header_length_zero", SINGLE)(lambda tmp: with_file(tmp, SINGLE, lambda b: header_blob(b"")))
case("header_not_json", SINGLE)(lambda tmp: with_file(tmp, SINGLE, lambda b: header_blob(b"{not json!")))
case("header_not_utf8", SINGLE)(lambda tmp: with_file(tmp, SINGLE, lambda b: header_blob(b'{"\xff\xfe": 1}')))
case("header_json_list", SINGLE)(lambda tmp: with_file(tmp, SINGLE, lambda b: raw_safetensors([1, 2])))
case("header_json_string", SINGLE)(lambda tmp: with_file(tmp, SINGLE, lambda b: raw_safetensors("hello")))
case("header_json_null", SINGLE)(lambda tmp: with_file(tmp, SINGLE, lambda b: raw_safetensors(None)))
case("header_deeply_nested", SINGLE)(
    lambda tmp: with_file(tmp, SINGLE, lambda b: header_blob(b"[" * 200_000 + b"]" * 200_000)))
case("header_huge_integer", SINGLE)(
    lambda tmp: with_file(tmp, SINGLE, lambda b: header_blob(b'{"x": {"dtype": "F16", "shape": [' + b"9" * 5000
                                                          + b'], "data_offsets": [0, 2]}}')))
case("header_entry_not_object", SINGLE, Q_KEY + ".suh")(
    lambda tmp: with_header(tmp, lambda h: set_key(h, Q_KEY + ".suh", [1, 2, 3])))
case("header_dtype_missing", SINGLE, Q_KEY + ".suh")(
    lambda tmp: with_header(tmp, lambda h: h[Q_KEY + ".suh"].pop("dtype")))
case("header_dtype_unknown", SINGLE, Q_KEY + ".trellis", "Q4")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".trellis"], "dtype", "Q4")))
case("header_dtype_not_string", SINGLE, Q_KEY + ".trellis")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".trellis"], "dtype", 16)))
case("header_shape_not_list", SINGLE, Q_KEY + ".svh")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".svh"], "shape", "256")))
case("header_shape_negative", SINGLE, Q_KEY + ".svh")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".svh"], "shape", [-256])))
case("header_shape_float", SINGLE, Q_KEY + ".svh")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".svh"], "shape", [256.0])))
case("header_shape_bool", SINGLE, "model.norm.weight")(
    lambda tmp: with_header(tmp, lambda h: set_key(h["model.norm.weight"], "shape", [True])))
case("header_offsets_beyond_file", SINGLE, "model.norm.weight")(
    lambda tmp: with_header(tmp, lambda h: set_key(h["model.norm.weight"], "data_offsets",
                                                   [h["model.norm.weight"]["data_offsets"][0], 10 ** 9])))
case("header_offsets_inverted", SINGLE, Q_KEY + ".suh", "invalid data_offsets")(
    lambda tmp: with_header(tmp, lambda h: h[Q_KEY + ".suh"]["data_offsets"].reverse()))
case("header_offsets_size_mismatch", SINGLE, Q_KEY + ".suh")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".suh"], "data_offsets",
                                                   [h[Q_KEY + ".suh"]["data_offsets"][0],
                                                    h[Q_KEY + ".suh"]["data_offsets"][1] - 2])))
case("header_offsets_wrong_length", SINGLE, Q_KEY + ".suh")(
    lambda tmp: with_header(tmp, lambda h: h[Q_KEY + ".suh"]["data_offsets"].append(0)))
case("header_offsets_strings", SINGLE, Q_KEY + ".suh")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".suh"], "data_offsets", ["0", "512"])))
case("header_offsets_missing", SINGLE, Q_KEY + ".suh")(
    lambda tmp: with_header(tmp, lambda h: h[Q_KEY + ".suh"].pop("data_offsets")))
case("header_overlapping_tensors", SINGLE, Q_KEY + ".svh")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".svh"], "data_offsets",
                                                   list(h[Q_KEY + ".suh"]["data_offsets"]))))
case("header_metadata_not_strings", SINGLE, "__metadata__")(
    lambda tmp: with_header(tmp, lambda h: set_key(h, "__metadata__", {"format": 1})))
case("header_metadata_list", SINGLE, "__metadata__")(
    lambda tmp: with_header(tmp, lambda h: set_key(h, "__metadata__", ["pt"])))

# Quantized token embedding (exllamav3 --embed_bits): a 2-D trellis [rows, G*(1+16K)] and fp16 signs [G, 256]
EMB = "model.embed_tokens"


def embedding(trellis=None, signs=None, extra=None):
    """Replace the dense embedding with quantized-embedding tensors (None leaves one out)."""
    def change(tensors):
        del tensors[EMB + ".weight"]
        if trellis is not None:
            tensors[EMB + ".trellis"] = trellis
        if signs is not None:
            tensors[EMB + ".signs"] = signs
        tensors.update(extra or {})
    return change


_SIGNS = tensor("F16", [1, 256], RNG, values=[1.0, -1.0] * 128)
case("embed_trellis_int32", SINGLE, EMB + ".trellis", "int16")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I32", [128, 65], RNG), _SIGNS)))
case("embed_trellis_3d", SINGLE, EMB + ".trellis", "int16 [rows")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I16", [128, 5, 13], RNG), _SIGNS)))
case("embed_row_width", SINGLE, EMB + ".trellis", "1 + 16K")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I16", [128, 66], RNG), _SIGNS)))
case("embed_K9", SINGLE, EMB + ".trellis", "K in 1..8")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I16", [128, 145], RNG), _SIGNS)))
case("embed_no_rows", SINGLE, EMB + ".trellis")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I16", [0, 65], RNG), _SIGNS)))
case("embed_signs_shape", SINGLE, EMB + ".signs", "[G, 256]")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I16", [128, 65], RNG), tensor("F16", [1, 128], RNG))))
case("embed_signs_dtype", SINGLE, EMB + ".signs", "fp16")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I16", [128, 65], RNG), tensor("F32", [1, 256], RNG))))
case("embed_signs_missing", SINGLE, EMB + ".trellis", ".signs are missing")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I16", [128, 65], RNG))))
case("embed_signs_alone", SINGLE, EMB + ".signs", "without a trellis")(
    lambda tmp: with_tensors(tmp, embedding(signs=_SIGNS)))
case("embed_with_suh", SINGLE, EMB + ".suh", "only .trellis and .signs")(
    lambda tmp: with_tensors(tmp, embedding(tensor("I16", [128, 65], RNG), _SIGNS,
                                            {EMB + ".suh": tensor("F16", [256], RNG)})))

# EXL3 tensors
TRELLIS = Q_KEY + ".trellis"
case("trellis_not_int16", SINGLE, TRELLIS, "int16")(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("F16", [16, 16, 64], RNG))))
case("trellis_int32", SINGLE, TRELLIS, "int16")(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I32", [16, 16, 32], RNG))))
case("trellis_2d", SINGLE, TRELLIS, "3-D")(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I16", [256, 64], RNG))))
case("trellis_4d", SINGLE, TRELLIS, "3-D")(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I16", [16, 16, 8, 8], RNG))))
case("trellis_scalar", SINGLE, TRELLIS, "3-D")(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I16", [], RNG))))
case("trellis_last_dim_50", SINGLE, TRELLIS, "50")(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I16", [16, 16, 50], RNG))))
case("trellis_last_dim_K9", SINGLE, TRELLIS, "144")(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I16", [16, 16, 144], RNG))))
case("trellis_last_dim_4.5", SINGLE, TRELLIS, "72")(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I16", [16, 16, 72], RNG))))
case("trellis_last_dim_zero", SINGLE, TRELLIS)(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I16", [16, 16, 0], RNG))))
case("trellis_k_not_128_multiple", SINGLE, TRELLIS, "k=64")(
    lambda tmp: with_tensors(tmp, lambda ts: (setter(TRELLIS, tensor("I16", [4, 16, 64], RNG))(ts),
                                               setter(Q_KEY + ".suh", tensor("F16", [64], RNG))(ts))))
case("trellis_n_not_128_multiple", SINGLE, TRELLIS, "n=144")(
    lambda tmp: with_tensors(tmp, lambda ts: (setter(TRELLIS, tensor("I16", [16, 9, 64], RNG))(ts),
                                               setter(Q_KEY + ".svh", tensor("F16", [144], RNG))(ts))))
case("trellis_k_zero", SINGLE, TRELLIS)(
    lambda tmp: with_tensors(tmp, setter(TRELLIS, tensor("I16", [0, 16, 64], RNG))))
case("half_K_3inst", SINGLE, TRELLIS, "mul1")(
    lambda tmp: with_tensors(tmp, lambda ts: None, bits=2.5, codebook="3inst"))
case("half_K_mcg", SINGLE, TRELLIS, "mul1")(
    lambda tmp: with_tensors(tmp, lambda ts: None, bits=3.5, codebook="mcg"))
case("both_markers", SINGLE, Q_KEY + ".mul1", "both")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".mcg", tensor("I32", [], RNG, values=[MARKER_VALUES["mcg"]]))))
case("mul1_marker_wrong_value", SINGLE, Q_KEY + ".mul1", "12345")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".mul1", tensor("I32", [], RNG, values=[12345]))))
case("mcg_marker_holds_mul1_value", SINGLE, Q_KEY + ".mcg")(
    lambda tmp: with_tensors(tmp, lambda ts: setter(Q_KEY + ".mcg", tensor(
        "I32", [], RNG, values=[MARKER_VALUES["mul1"]]))(ts), codebook="mcg"))
case("mul1_marker_unsigned_int64", SINGLE, Q_KEY + ".mul1", "int32")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".mul1", tensor("I64", [], RNG,
                                                                 values=[MARKER_VALUES["mul1"] + (1 << 32)]))))
case("mul1_marker_float", SINGLE, Q_KEY + ".mul1", "int32")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".mul1", tensor("F32", [], RNG, values=[1.0]))))
case("mul1_marker_vector", SINGLE, Q_KEY + ".mul1", "scalar")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".mul1", tensor("I32", [2], RNG, values=[MARKER_VALUES["mul1"]] * 2))))
case("missing_suh", SINGLE, Q_KEY + ".suh", "missing")(lambda tmp: with_tensors(tmp, popper(Q_KEY + ".suh")))
case("missing_svh", SINGLE, Q_KEY + ".svh", "missing")(lambda tmp: with_tensors(tmp, popper(Q_KEY + ".svh")))
case("suh_wrong_length", SINGLE, Q_KEY + ".suh", "256")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".suh", tensor("F16", [128], RNG))))
case("suh_fp32", SINGLE, Q_KEY + ".suh", "F32")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".suh", tensor("F32", [256], RNG))))
case("suh_bf16", SINGLE, Q_KEY + ".suh", "BF16")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".suh", tensor("BF16", [256], RNG))))
case("suh_2d", SINGLE, Q_KEY + ".suh")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".suh", tensor("F16", [1, 256], RNG))))
case("svh_wrong_length", SINGLE, Q_KEY + ".svh", "256")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".svh", tensor("F16", [384], RNG))))
case("svh_fp32", SINGLE, Q_KEY + ".svh", "F32")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".svh", tensor("F32", [256], RNG))))
case("legacy_su_wrong_length", SINGLE, Q_KEY + ".su", "16")(
    lambda tmp: with_tensors(tmp, lambda ts: setter(Q_KEY + ".su", tensor("I16", [256], RNG))(ts), legacy=True))
case("legacy_sv_fp16", SINGLE, Q_KEY + ".sv")(
    lambda tmp: with_tensors(tmp, lambda ts: setter(Q_KEY + ".sv", tensor("F16", [16], RNG))(ts), legacy=True))
case("orphan_suh", SINGLE, "model.layers.0.mlp.up_proj.suh", "trellis")(
    lambda tmp: with_tensors(tmp, setter("model.layers.0.mlp.up_proj.suh", tensor("F16", [256], RNG))))
case("orphan_marker", SINGLE, "model.layers.0.mlp.up_proj.mul1", "trellis")(
    lambda tmp: with_tensors(tmp, setter("model.layers.0.mlp.up_proj.mul1",
                                         tensor("I32", [], RNG, values=[MARKER_VALUES["mul1"]]))))
case("trellis_and_weight", SINGLE, Q_KEY + ".weight")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".weight", tensor("F16", [256, 256], RNG))))
case("bias_wrong_length", SINGLE, Q_KEY + ".bias", "256")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".bias", tensor("F16", [255], RNG))))
case("bias_int", SINGLE, Q_KEY + ".bias")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".bias", tensor("I32", [256], RNG))))

# sharded checkpoints and the index
case("shard_missing", SHARD2, "missing")(lambda tmp: with_file(tmp, SHARD2, lambda b: None, sharded=True))
case("shard_truncated", SHARD2)(lambda tmp: with_file(tmp, SHARD2, lambda b: b[:len(b) // 2], sharded=True))
case("shard_bad_trellis", SHARD2, O_KEY + ".trellis")(
    lambda tmp: with_tensors(tmp, setter(O_KEY + ".trellis", tensor("I16", [16, 16, 50], RNG)), sharded=True))
case("shard_bad_svh", SHARD2, O_KEY + ".svh")(
    lambda tmp: with_tensors(tmp, setter(O_KEY + ".svh", tensor("F32", [256], RNG)), sharded=True))
case("index_parent_path", INDEX, "../x.safetensors")(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight", "../x.safetensors"),
                          sharded=True))
case("index_nested_parent_path", INDEX, "sub/../../x.safetensors")(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight",
                                                        "sub/../../x.safetensors"), sharded=True))
case("index_absolute_path", INDEX, "/etc/passwd")(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight", "/etc/passwd"),
                          sharded=True))
case("index_backslash_path", INDEX)(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight",
                                                        "..\\x.safetensors"), sharded=True))
case("index_nul_in_path", INDEX)(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight",
                                                        "model\x00.safetensors"), sharded=True))
case("index_empty_file_name", INDEX)(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight", ""), sharded=True))
case("index_file_name_not_string", INDEX)(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight", 2), sharded=True))
case("index_weight_map_list", INDEX, "weight_map")(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d, "weight_map", list(d["weight_map"])), sharded=True))
case("index_weight_map_empty", INDEX, "weight_map")(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d, "weight_map", {}), sharded=True))
case("index_weight_map_missing", INDEX, "weight_map")(
    lambda tmp: with_json(tmp, INDEX, lambda d: d.pop("weight_map"), sharded=True))
case("index_tensor_absent_from_shard", SHARD1, "model.layers.0.mlp.up_proj.weight")(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.layers.0.mlp.up_proj.weight",
                                                        SHARD1), sharded=True))
case("index_invalid_json", INDEX, "JSON")(lambda tmp: with_file(tmp, INDEX, lambda b: b[:-3], sharded=True))
case("index_json_list", INDEX)(lambda tmp: with_file(tmp, INDEX, lambda b: b"[]", sharded=True))
case("index_not_utf8", INDEX)(lambda tmp: with_file(tmp, INDEX, lambda b: b"\xff" + b, sharded=True))


@case("index_symlink_outside", INDEX, SHARD2)
def _symlink_outside(tmp):
    path = make_ckpt(sharded=True).write(tmp / "ckpt")
    outside = tmp / "elsewhere.safetensors"
    os.rename(os.path.join(path, SHARD2), outside)
    os.symlink(outside, os.path.join(path, SHARD2))
    return path


# config.json and quantization_config.json
CONFIG = "config.json"
case("config_invalid_json", CONFIG, "JSON")(lambda tmp: with_file(tmp, CONFIG, lambda b: b[:-2]))
case("config_missing", CONFIG, "missing")(lambda tmp: with_file(tmp, CONFIG, lambda b: None))
case("config_json_list", CONFIG, "object")(lambda tmp: with_file(tmp, CONFIG, lambda b: b"[1, 2]"))
case("config_empty", CONFIG)(lambda tmp: with_file(tmp, CONFIG, lambda b: b""))
case("config_not_utf8", CONFIG)(lambda tmp: with_file(tmp, CONFIG, lambda b: b"\xfe\xff" + b))
case("config_deeply_nested", CONFIG)(lambda tmp: with_file(tmp, CONFIG, lambda b: b"[" * 200_000 + b"]" * 200_000))
case("config_huge_integer", CONFIG)(
    lambda tmp: with_file(tmp, CONFIG, lambda b: b'{"hidden_size": ' + b"7" * 5000 + b"}"))
case("config_no_quantization_config", CONFIG, "exl3")(
    lambda tmp: with_json(tmp, CONFIG, lambda d: d.pop("quantization_config")))
case("config_quant_method_gptq", CONFIG, "exl3")(
    lambda tmp: with_json(tmp, CONFIG, lambda d: set_key(d["quantization_config"], "quant_method", "gptq")))
case("config_quantization_config_string", CONFIG, "exl3")(
    lambda tmp: with_json(tmp, CONFIG, lambda d: set_key(d, "quantization_config", "exl3")))


@case("config_is_directory", CONFIG)
def _config_dir(tmp):
    path = with_file(tmp, CONFIG, lambda b: None)
    os.mkdir(os.path.join(path, CONFIG))
    return path


case("qcfg_invalid_json", QCFG, "JSON")(lambda tmp: with_file(tmp, QCFG, lambda b: b"{" + b))
case("qcfg_json_list", QCFG)(lambda tmp: with_file(tmp, QCFG, lambda b: b"[]"))
case("qcfg_huge_integer", QCFG)(lambda tmp: with_file(tmp, QCFG, lambda b: b'{"bits": ' + b"1" * 4400 + b"}"))
case("storage_not_object", QCFG, "tensor_storage")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d, "tensor_storage", [])))
case("storage_entry_not_object", QCFG, "tensor_storage", Q_KEY)(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"], Q_KEY, 4)))
case("storage_bits_disagree", QCFG, Q_KEY, "bits_per_weight")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "bits_per_weight", 3)))
case("storage_bits_string", QCFG, Q_KEY, "bits_per_weight")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "bits_per_weight", "4")))
case("storage_bits_bool", QCFG, Q_KEY, "bits_per_weight")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "bits_per_weight", True)))
case("storage_bits_huge_int", QCFG, Q_KEY, "bits_per_weight")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "bits_per_weight", 10 ** 400)))
case("storage_quant_format_other", QCFG, Q_KEY, "quant_format")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "quant_format", "gptq")))
case("storage_shape_disagree", QCFG, Q_KEY + ".suh", "shape")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY]["stored_tensors"][Q_KEY + ".suh"],
                                                       "shape", [128])))
case("storage_shape_not_list", QCFG, Q_KEY + ".suh", "shape")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY]["stored_tensors"][Q_KEY + ".suh"],
                                                       "shape", 256)))
case("storage_lists_missing_tensor", QCFG, Q_KEY + ".bias")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY]["stored_tensors"], Q_KEY + ".bias",
                                                       {"shape": [256], "n_bytes": 512, "dtype": "torch.float16"})))
case("storage_stored_tensors_list", QCFG, Q_KEY, "stored_tensors")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "stored_tensors", [])))
case("storage_dense_shape_disagree", QCFG, "model.norm.weight", "shape")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(
        d["tensor_storage"]["model.norm"]["stored_tensors"]["model.norm.weight"], "shape", [512])))

# the directory itself
case("no_safetensors", "safetensors")(lambda tmp: with_file(tmp, SINGLE, lambda b: None))


@case("single_file_is_directory", SINGLE, "not a regular file")
def _single_dir(tmp):
    path = with_file(tmp, SINGLE, lambda b: None)
    os.mkdir(os.path.join(path, SINGLE))
    return path


@case("path_is_a_file", "config.json", "directory")
def _path_file(tmp):
    path = make_ckpt().write(tmp / "ckpt")
    return os.path.join(path, "config.json")


case("path_missing", "nowhere", "directory")(lambda tmp: str(tmp / "nowhere"))


# ---- issue 42: markers, JSON type confusion, index aliases, duplicates, zero-sized and absurd shapes ------
case("mcg_marker_int16", SINGLE, Q_KEY + ".mcg", "int32")(
    lambda tmp: with_tensors(tmp, lambda ts: setter(Q_KEY + ".mcg", tensor(
        "I16", [], RNG, values=[0x1FED]))(ts), codebook="mcg"))
case("mcg_marker_1x1", SINGLE, Q_KEY + ".mcg", "scalar")(
    lambda tmp: with_tensors(tmp, lambda ts: setter(Q_KEY + ".mcg", tensor(
        "I32", [1, 1], RNG, values=[MARKER_VALUES["mcg"]]))(ts), codebook="mcg"))
case("mul1_marker_empty", SINGLE, Q_KEY + ".mul1", "scalar")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".mul1", tensor("I32", [0], RNG))))


def _qc(key, value):
    return lambda d: set_key(d["quantization_config"], key, value)


def _top(key, value):
    return lambda d: set_key(d, key, value)


# Every field the reader takes from config.json: a wrong type is refused, never silently skipped.
for _name, _change, _words in (
        ("config_bits_string", _qc("bits", "4"), ("bits", "'4'")),
        ("config_bits_list", _qc("bits", [4]), ("bits",)),
        ("config_bits_bool", _qc("bits", True), ("bits",)),
        ("config_quant_method_null", _qc("quant_method", None), ("exl3",)),
        ("config_hidden_size_list", _top("hidden_size", [256]), ("hidden_size", "[256]")),
        ("config_hidden_size_string", _top("hidden_size", "256"), ("hidden_size",)),
        ("config_hidden_size_zero", _top("hidden_size", 0), ("hidden_size",)),
        ("config_intermediate_size_float", _top("intermediate_size", 512.0), ("intermediate_size",)),
        ("config_vocab_size_bool", _top("vocab_size", True), ("vocab_size",)),
        ("config_num_attention_heads_string", _top("num_attention_heads", "4"), ("num_attention_heads",)),
        ("config_num_key_value_heads_negative", _top("num_key_value_heads", -4), ("num_key_value_heads",)),
        ("config_head_dim_dict", _top("head_dim", {"value": 64}), ("head_dim",)),
        ("config_moe_intermediate_size_list", _top("moe_intermediate_size", [128]), ("moe_intermediate_size",)),
        ("config_shared_expert_size_string", _top("shared_expert_intermediate_size", "x"),
         ("shared_expert_intermediate_size",)),
        ("config_text_config_list", _top("text_config", [{"hidden_size": 256}]), ("text_config",)),
        ("config_text_config_hidden_size_string", _top("text_config", {"hidden_size": "256"}),
         ("text_config", "hidden_size")),
):
    case(_name, CONFIG, *_words)(lambda tmp, _change=_change: with_json(tmp, CONFIG, _change))

case("storage_null", QCFG, "tensor_storage")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d, "tensor_storage", None)))
case("storage_stored_tensors_null", QCFG, Q_KEY, "stored_tensors")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "stored_tensors", None)))
case("storage_stored_tensor_entry_not_object", QCFG, Q_KEY + ".suh", "object")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY]["stored_tensors"], Q_KEY + ".suh",
                                                       [256])))
case("storage_shape_strings", QCFG, Q_KEY + ".suh", "shape")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY]["stored_tensors"][Q_KEY + ".suh"],
                                                       "shape", ["256"])))
case("storage_shape_floats", QCFG, Q_KEY + ".suh", "shape")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY]["stored_tensors"][Q_KEY + ".suh"],
                                                       "shape", [256.0])))
case("storage_bits_list", QCFG, Q_KEY, "bits_per_weight")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "bits_per_weight", [4])))
case("storage_quant_format_number", QCFG, Q_KEY, "quant_format")(
    lambda tmp: with_json(tmp, QCFG, lambda d: set_key(d["tensor_storage"][Q_KEY], "quant_format", 3)))


def _index_listing_norm_twice(blob):
    # json.dumps cannot write a duplicate key: splice a first mapping of model.norm.weight (to the other shard) in.
    text = json.dumps(json.loads(blob))
    return text.replace('"weight_map": {', f'"weight_map": {{"model.norm.weight": "{SHARD1}", ', 1).encode()


case("index_tensor_listed_twice", INDEX, "model.norm.weight", "twice")(
    lambda tmp: with_file(tmp, INDEX, _index_listing_norm_twice, sharded=True))
case("index_same_file_two_spellings", INDEX, "./" + SHARD2)(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight", "./" + SHARD2),
                          sharded=True))
case("index_dot_inside_path", INDEX, "sub/./" + SHARD2)(
    lambda tmp: with_json(tmp, INDEX, lambda d: set_key(d["weight_map"], "model.norm.weight", "sub/./" + SHARD2),
                          sharded=True))


@case("tensor_in_two_shards", O_KEY + ".svh", SHARD1, SHARD2)
def _two_shards(tmp):
    ck = make_ckpt(sharded=True)
    ck.shards[0].append(O_KEY + ".svh")  # also stays in shard 2, where the index places it
    return ck.write(tmp / "ckpt")


def _duplicate_header_name(blob):
    header, data = split_file(blob)
    raw = json.dumps(header)
    dup = json.dumps({"model.norm.weight": header["model.norm.weight"]})[1:-1]
    return header_blob(raw.replace("{", "{" + dup + ", ", 1).encode(), data)


case("header_duplicate_tensor_name", SINGLE, "model.norm.weight", "twice")(
    lambda tmp: with_file(tmp, SINGLE, _duplicate_header_name))
case("shard_header_length_beyond_file", SHARD1)(
    lambda tmp: with_file(tmp, SHARD1, lambda b: struct.pack("<Q", len(b)) + b[8:], sharded=True))
case("norm_weight_zero_sized", SINGLE, "model.norm.weight", "zero-sized")(
    lambda tmp: with_tensors(tmp, setter("model.norm.weight", tensor("F16", [0], RNG))))
case("embed_weight_zero_rows", SINGLE, "model.embed_tokens.weight", "zero-sized")(
    lambda tmp: with_tensors(tmp, setter("model.embed_tokens.weight", tensor("F16", [0, 256], RNG))))
case("other_tensor_zero_sized", SINGLE, "model.rotary_emb.inv_freq", "zero-sized")(
    lambda tmp: with_tensors(tmp, setter("model.rotary_emb.inv_freq", tensor("F32", [0], RNG))))
# Absurd shapes in a small file: refused from the header (the byte span cannot match), nothing allocated.
case("trellis_claims_2_40_elements", SINGLE, TRELLIS, "needs")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[TRELLIS], "shape", [1 << 18, 1 << 18, 16])))
case("shape_product_2_312", SINGLE, Q_KEY + ".suh", "needs")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".suh"], "shape", [1 << 39] * 8)))
case("shape_dim_2_40", SINGLE, Q_KEY + ".suh", "invalid shape")(
    lambda tmp: with_header(tmp, lambda h: set_key(h[Q_KEY + ".suh"], "shape", [1 << 40])))
case("dense_zero_times_absurd", SINGLE, "model.norm.weight", "zero-sized")(
    lambda tmp: with_header(tmp, lambda h: h["model.norm.weight"].update(
        shape=[0, (1 << 40) - 1], data_offsets=[h["model.norm.weight"]["data_offsets"][0]] * 2)))


# ---- data the headers cannot vouch for: Checkpoint() opens these, verify() refuses them ---------------
VERIFY_CASES: dict = {}


def verify_case(name, *must_name):
    def deco(fn):
        assert name not in VERIFY_CASES
        VERIFY_CASES[name] = (fn, must_name)
        return fn
    return deco


def _vec(dtype, pos, value):
    """A plausible scale/bias vector (|v| in [0.5, 1.5], random signs, 256 long) with one value set."""
    v = RNG.uniform(0.5, 1.5, 256) * RNG.choice([-1.0, 1.0], 256)
    if dtype == "BF16":  # the builder takes bf16 as raw bits
        v = (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    v[pos] = value
    return tensor(dtype, [256], RNG, values=v)


NAN, INF = float("nan"), float("inf")
verify_case("suh_nan", SINGLE, Q_KEY + ".suh", "NaN or Inf")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".suh", _vec("F16", 5, NAN))))
verify_case("suh_inf", SINGLE, Q_KEY + ".suh", "NaN or Inf")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".suh", _vec("F16", 0, INF))))
verify_case("svh_minus_inf", SINGLE, Q_KEY + ".svh", "NaN or Inf")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".svh", _vec("F16", 255, -INF))))
verify_case("svh_nan_in_shard", SHARD2, O_KEY + ".svh", "NaN or Inf")(
    lambda tmp: with_tensors(tmp, setter(O_KEY + ".svh", _vec("F16", 17, NAN)), sharded=True))
verify_case("bias_nan", SINGLE, Q_KEY + ".bias", "NaN or Inf")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".bias", _vec("F16", 3, NAN)), bias=True))
verify_case("bias_fp32_inf", SINGLE, Q_KEY + ".bias", "NaN or Inf")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".bias", _vec("F32", 9, INF)), bias=True))
verify_case("bias_bf16_nan", SINGLE, Q_KEY + ".bias", "NaN or Inf")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".bias", _vec("BF16", 1, 0x7FC0)), bias=True))
# A whole scale vector of zeros (a zero-filled hole in a download) makes the linear's output 0: refused.
verify_case("suh_all_zero", SINGLE, Q_KEY + ".suh", "every value is 0")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".suh", tensor("F16", [256], RNG, values=np.zeros(256)))))
verify_case("svh_all_signed_zero", SINGLE, O_KEY + ".svh", "every value is 0")(
    lambda tmp: with_tensors(tmp, setter(O_KEY + ".svh", tensor("F16", [256], RNG, values=[0.0, -0.0] * 128))))



def _zero_bytes(name, start, count):
    """A zero-filled hole in a tensor's bytes, as a download that stopped or a sparse file leaves."""
    def change(tensors):
        t = tensors[name]
        tensors[name] = T(t.dtype, t.shape, t.data[:start] + bytes(count) + t.data[start + count:])
    return change


# Trellis words are near-random: real exllamav3 checkpoints have no run of zero bytes over 2; a 1 KiB hole is refused.
verify_case("trellis_zero_hole", SINGLE, TRELLIS, "zeros", "hole")(
    lambda tmp: with_tensors(tmp, _zero_bytes(TRELLIS, 3000, 1024)))
verify_case("trellis_zero_hole_in_shard", SHARD2, O_KEY + ".trellis", "zeros")(
    lambda tmp: with_tensors(tmp, _zero_bytes(O_KEY + ".trellis", 0, 4096), sharded=True))

# A whole vector of subnormal scales (exllamav3's are at least 0.0156 in every corpus checkpoint) scales its output to
# about 0, as zeros would: refused the same way.
verify_case("suh_all_subnormal", SINGLE, Q_KEY + ".suh", "subnormal")(
    lambda tmp: with_tensors(tmp, setter(Q_KEY + ".suh", tensor("F16", [256], RNG,
                                                                values=[2.0 ** -24, -(2.0 ** -20)] * 128))))

# ...and what verify() accepts: one subnormal channel, a single zero channel, an all-zero bias.
VERIFY_ACCEPTS = {
    "suh_one_subnormal": setter(Q_KEY + ".suh", _vec("F16", 11, 2.0 ** -20)),
    "svh_one_zero": setter(Q_KEY + ".svh", _vec("F16", 7, 0.0)),
    "bias_all_zero": setter(Q_KEY + ".bias", tensor("F16", [256], RNG, values=np.zeros(256))),
}


# ---- the tests -----------------------------------------------------------------------------------
def test_corpus_is_large_enough():
    assert len(CASES) >= 160


@pytest.mark.parametrize("sharded", [False, True])
def test_valid_loads(sharded, tmp_path):
    path = make_ckpt(sharded=sharded).write(tmp_path / "ckpt")
    before = snapshot(tmp_path)
    ckpt = Checkpoint(path)
    assert ckpt.warnings == []
    assert snapshot(tmp_path) == before
    for key in (Q_KEY, O_KEY):
        spec = ckpt.modules[key]
        assert isinstance(spec, Exl3Spec)
        assert (spec.k, spec.n, spec.bits, spec.codebook, spec.legacy_signs) == (256, 256, 4, "mul1", False)
        assert set(spec.tensors) == {"trellis", "suh", "svh", "mul1"}
    for key in ("model.embed_tokens", "model.norm", "model.layers.0.input_layernorm"):
        assert isinstance(ckpt.modules[key], DenseSpec)
    assert ckpt.modules["model.embed_tokens"].shape == (128, 256)
    assert ckpt.average_bpw() == 4
    if sharded:
        assert os.path.basename(ckpt.modules[O_KEY].tensors["trellis"].file) == SHARD2
        assert os.path.basename(ckpt.modules[Q_KEY].tensors["trellis"].file) == SHARD1


@pytest.mark.parametrize("bits,codebook", [(1, "3inst"), (2, "mcg"), (3, "mul1"), (8, "3inst"), (1.5, "mul1"),
                                           (3.5, "mul1")])
def test_valid_bits_and_codebooks(bits, codebook, tmp_path):
    ckpt = Checkpoint(make_ckpt(bits=bits, codebook=codebook, bias=True).write(tmp_path / "ckpt"))
    spec = ckpt.modules[Q_KEY]
    assert (spec.bits, spec.codebook, spec.has_bias) == (bits, codebook, True)
    assert ckpt.average_bpw() == bits


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed(name, tmp_path):
    build, must_name = CASES[name]
    path = str(build(tmp_path))
    before = snapshot(tmp_path)
    with pytest.raises(Exl3FormatError) as info:
        Checkpoint(path)
    err = info.value
    msg = str(err)
    assert err.file or err.tensor, msg
    for s in must_name:
        assert s in msg, f"{s!r} not named in: {msg}"
    assert msg == msg.strip() and "\n" not in msg and len(msg) < 2000, msg
    assert snapshot(tmp_path) == before, "the reader wrote into the checkpoint directory"


@pytest.mark.parametrize("name", sorted(VERIFY_CASES))
def test_verify_refuses_bad_values(name, tmp_path):
    build, must_name = VERIFY_CASES[name]
    path = str(build(tmp_path))
    ckpt = Checkpoint(path)  # header-valid: only the data is wrong
    with pytest.raises(Exl3FormatError) as info:
        ckpt.verify()
    msg = str(info.value)
    for s in must_name:
        assert s in msg, f"{s!r} not named in: {msg}"
    assert "\n" not in msg and len(msg) < 2000, msg


def _sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_verify_checks_the_sha256_a_hugging_face_download_recorded(tmp_path):
    """huggingface_hub's local-dir download writes `<etag>` (an LFS file's sha256) beside each file; a file that
    differs from it (changed, or cut short) is refused; a 40-digit etag (a small file's git hash) is not a sha256."""
    path = make_ckpt().write(tmp_path / "ckpt")
    shard = os.path.join(path, SINGLE)
    meta = os.path.join(path, ".cache", "huggingface", "download", SINGLE + ".metadata")
    os.makedirs(os.path.dirname(meta))
    open(meta, "w").write(f"{'c' * 40}\n{_sha256(shard)}\n1765000000.0\n")
    Checkpoint(path).verify()
    open(meta, "w").write(f"{'c' * 40}\n{'0' * 64}\n1765000000.0\n")
    with pytest.raises(Exl3FormatError, match="sha256") as info:
        Checkpoint(path).verify()
    assert SINGLE in str(info.value) and "\n" not in str(info.value)
    open(meta, "w").write(f"{'c' * 40}\n{'a' * 40}\n1765000000.0\n")
    Checkpoint(path).verify()


def test_verify_checks_a_hub_cache_blob_against_its_name(tmp_path):
    """In the hub cache a snapshot's files link to blobs named by their sha256."""
    path = make_ckpt().write(tmp_path / "snapshot")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shard = os.path.join(path, SINGLE)
    blob = blobs / _sha256(shard)
    os.replace(shard, blob)
    os.symlink(blob, shard)
    Checkpoint(path).verify()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # the last byte: tensor data the headers cannot see
    blob.write_bytes(bytes(data))
    with pytest.raises(Exl3FormatError, match="sha256"):
        Checkpoint(path).verify()


@pytest.mark.parametrize("name", sorted(VERIFY_ACCEPTS))
def test_verify_accepts_tiny_and_partly_zero_values(name, tmp_path):
    ckpt = Checkpoint(with_tensors(tmp_path, VERIFY_ACCEPTS[name], bias=True))
    ckpt.verify()
    assert ckpt.warnings == []


@pytest.mark.parametrize("name", ["suh_nan", "bias_bf16_nan", "suh_all_zero"])
def test_inspect_verify_exits_2_naming_the_tensor(name, tmp_path, capsys):
    from exl3_vllm import cli

    build, must_name = VERIFY_CASES[name]
    path = str(build(tmp_path))
    assert cli.main(["inspect", path]) == 0  # headers alone cannot see it
    capsys.readouterr()
    assert cli.main(["inspect", path, "--verify"]) == 2
    err = capsys.readouterr().err
    assert all(s in err for s in must_name) and "Traceback" not in err, err


def test_inspect_refuses_every_case_in_one_line(tmp_path, capsys):
    from exl3_vllm import cli

    for i, (name, (build, must_name)) in enumerate(sorted(CASES.items())):
        path = str(build(tmp_path / str(i)))
        assert cli.main(["inspect", path]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err and "\n" not in err and all(s in err for s in must_name), (name, err)


# Broken config.json or path: transformers or vLLM read these before any plugin runs, and refuse them in their words.
VLLM_SPEAKS_FIRST = {
    "config_deeply_nested", "config_empty", "config_head_dim_dict", "config_hidden_size_list",
    "config_hidden_size_string", "config_huge_integer", "config_intermediate_size_float", "config_invalid_json",
    "config_json_list", "config_missing", "config_no_quantization_config", "config_not_utf8",
    "config_num_attention_heads_string", "config_quant_method_gptq", "config_quant_method_null",
    "config_quantization_config_string", "config_text_config_hidden_size_string", "config_text_config_list",
    "config_vocab_size_bool", "path_missing"}


def test_vllm_refuses_every_case_while_building_its_config(tmp_path, monkeypatch):
    """The path `vllm serve` takes (EngineArgs.create_engine_config: no engine process, no model yet): every case is
    refused; each one the plugin can see is refused with its message (the file, the tensor, what is wrong)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
    import time

    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    monkeypatch.setattr(time, "sleep", lambda s: None)  # vLLM waits 2 s before reading a broken config.json again
    assert VLLM_SPEAKS_FIRST <= set(CASES)
    for i, (name, (build, must_name)) in enumerate(sorted(CASES.items())):
        path = str(build(tmp_path / str(i)))
        with pytest.raises(BaseException) as info:  # vLLM wraps ours in pydantic's ValidationError
            EngineArgs(model=path, dtype="float32", max_model_len=256).create_engine_config()
        if name not in VLLM_SPEAKS_FIRST:
            assert all(s in str(info.value) for s in must_name), (name, str(info.value)[-600:])


@pytest.mark.parametrize("sharded", [False, True])
def test_weights_are_the_bytes_written(sharded, tmp_path):
    ck = make_ckpt(sharded=sharded, bias=True)
    ckpt = Checkpoint(ck.write(tmp_path / "ckpt"))
    for key in (Q_KEY, O_KEY):
        w = ckpt.weights(key)
        assert w.trellis.dtype == torch.int16 and w.trellis.shape == (16, 16, 64)
        assert w.suh.dtype == torch.float16 and w.svh.dtype == torch.float16
        assert w.trellis.numpy().tobytes() == ck.tensors[f"{key}.trellis"].data
        assert w.suh.numpy().tobytes() == ck.tensors[f"{key}.suh"].data
        assert w.svh.numpy().tobytes() == ck.tensors[f"{key}.svh"].data
        assert w.codebook == "mul1" and w.bits == 4
        if key == Q_KEY:
            assert w.bias.numpy().tobytes() == ck.tensors[f"{key}.bias"].data
        else:
            assert w.bias is None
    emb = ckpt.tensor("model.embed_tokens.weight")
    assert emb.numpy().tobytes() == ck.tensors["model.embed_tokens.weight"].data
    with pytest.raises(Exl3FormatError, match="model.norm"):
        ckpt.weights("model.norm")
    with pytest.raises(Exl3FormatError, match="no.such.tensor"):
        ckpt.tensor("no.such.tensor")


def test_weights_read_after_file_truncated(tmp_path):
    # A file cut after the checkpoint was opened: the read names the file and tensor.
    ck = make_ckpt()
    path = ck.write(tmp_path / "ckpt")
    ckpt = Checkpoint(path)
    with open(os.path.join(path, SINGLE), "r+b") as f:
        f.truncate(64)
    with pytest.raises(Exl3FormatError, match=re.escape(Q_KEY)) as info:
        ckpt.weights(Q_KEY)
    assert SINGLE in str(info.value)


# ---- warnings (not errors) -----------------------------------------------------------------------
def _warned(ckpt, *words):
    return [w for w in ckpt.warnings if all(x in w for x in words)]


def test_warning_config_bits_disagree(tmp_path):
    ck = make_ckpt()
    ck.config["quantization_config"]["bits"] = 3.0
    ckpt = Checkpoint(ck.write(tmp_path / "ckpt"))
    assert _warned(ckpt, "bits=3.0", "4.00"), ckpt.warnings


def test_warning_config_bits_absurd(tmp_path):
    ck = make_ckpt()
    ck.config["quantization_config"]["bits"] = 10 ** 400
    ckpt = Checkpoint(ck.write(tmp_path / "ckpt"))
    assert _warned(ckpt, "bits="), ckpt.warnings


def test_config_bits_agreeing_gives_no_warning(tmp_path):
    ck = make_ckpt()
    ck.config["quantization_config"]["bits"] = 4.01  # rounded to 2 decimals by the converter
    assert Checkpoint(ck.write(tmp_path / "ckpt")).warnings == []


def test_warning_module_not_in_tensor_storage(tmp_path):
    ck = make_ckpt()
    del ck.qcfg["tensor_storage"][O_KEY]
    ckpt = Checkpoint(ck.write(tmp_path / "ckpt"))
    assert _warned(ckpt, O_KEY, "tensor_storage"), ckpt.warnings
    assert isinstance(ckpt.modules[O_KEY], Exl3Spec)


def test_warning_storage_without_tensors(tmp_path):
    ck = make_ckpt()
    ck.qcfg["tensor_storage"]["model.layers.0.mlp.up_proj"] = {"stored_tensors": {}}
    ckpt = Checkpoint(ck.write(tmp_path / "ckpt"))
    assert _warned(ckpt, "model.layers.0.mlp.up_proj"), ckpt.warnings


def test_warning_no_quantization_config_json(tmp_path):
    path = make_ckpt().write(tmp_path / "ckpt")
    os.remove(os.path.join(path, QCFG))
    ckpt = Checkpoint(path)
    assert _warned(ckpt, QCFG), ckpt.warnings
    assert len(ckpt.exl3_modules()) == 2


def test_half_integer_is_served_without_a_warning(tmp_path):
    ckpt = Checkpoint(make_ckpt(bits=2.5, codebook="mul1").write(tmp_path / "ckpt"))
    assert not ckpt.warnings
    assert ckpt.modules[Q_KEY].bits == 2.5 and ckpt.modules[Q_KEY].half_bits
    assert ckpt.weights(Q_KEY).trellis.shape == (16, 16, 40)


def test_legacy_su_sv_load_as_signs(tmp_path):
    ck = make_ckpt(legacy=True)
    su = np.array([0, -1, 1, 0x4000, -32768, 0x1234, 7, 0x0F0F, 0, 0, 0, 0, 0, 0, 0, 1], dtype=np.int16)
    ck.tensors[Q_KEY + ".su"] = tensor("I16", [16], RNG, values=su)
    resync(ck)
    ckpt = Checkpoint(ck.write(tmp_path / "ckpt"))
    assert _warned(ckpt, Q_KEY, "legacy"), ckpt.warnings
    spec = ckpt.modules[Q_KEY]
    assert spec.legacy_signs and set(spec.tensors) == {"trellis", "su", "sv", "mul1"}
    w = ckpt.weights(Q_KEY)
    # channel 16w+i <-> bit i of word w; a set bit means -1
    bits = (su.astype(np.uint16)[:, None] >> np.arange(16)) & 1
    expect = (1 - 2 * bits.reshape(-1)).astype(np.float16)
    assert w.suh.dtype == torch.float16 and w.suh.shape == (256,)
    assert np.array_equal(w.suh.numpy(), expect)
    assert w.suh[0].item() == 1 and w.suh[16].item() == -1 and w.suh[31].item() == -1  # word 0 = 0, word 1 = -1
    assert w.suh[32].item() == -1 and w.suh[33].item() == 1  # word 2 = 1: only channel 32 negative
    sv = np.frombuffer(ck.tensors[Q_KEY + ".sv"].data, dtype="<i2")
    assert torch.equal(w.svh, signs_to_half(torch.from_numpy(sv.copy())))
    assert set(w.svh.unique().tolist()) <= {-1.0, 1.0}


def test_read_header_names_file_directly(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"\x01\x00")
    with pytest.raises(Exl3FormatError, match="x.safetensors"):
        read_header(str(p))
    with pytest.raises(Exl3FormatError, match="nope.safetensors"):
        read_header(str(tmp_path / "nope.safetensors"))


def test_read_header_accepts_reference_layout(tmp_path):
    ck = make_ckpt()
    p = tmp_path / "m.safetensors"
    from ckpt_builder import safetensors_bytes
    p.write_bytes(safetensors_bytes(ck.tensors, {"format": "pt"}))
    infos, meta = read_header(str(p))
    assert meta == {"format": "pt"}
    assert list(infos) == list(ck.tensors)
    t: T = ck.tensors[Q_KEY + ".trellis"]
    assert infos[Q_KEY + ".trellis"].shape == tuple(t.shape) and infos[Q_KEY + ".trellis"].nbytes == t.nbytes
