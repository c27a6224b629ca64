"""Fuzzing the header and JSON parsing: no exception but Exl3FormatError may escape.

(a) read_header (and read_tensor on whatever it accepts) over random bytes,
valid files with flipped bytes, and random JSON headers; (b) Checkpoint over
directories whose JSON files are random JSON values or mutated valid files.
Bounded: ~200 examples per test on tiny inputs.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_builder import O_KEY, Q_KEY, make_ckpt, raw_safetensors, safetensors_bytes, split_file
from exl3_vllm.format.checkpoint import Checkpoint
from exl3_vllm.format.errors import Exl3FormatError
from exl3_vllm.format.safetensors_io import read_header, read_tensor

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Names the parsers look for, so random JSON reaches past the first type check.
KEYS = ["quant_method", "quantization_config", "tensor_storage", "stored_tensors", "bits", "bits_per_weight",
        "quant_format", "shape", "dtype", "data_offsets", "__metadata__", "weight_map", "text_config",
        "hidden_size", "num_attention_heads", "head_dim", "num_key_value_heads", "vocab_size",
        Q_KEY, Q_KEY + ".trellis", Q_KEY + ".suh", Q_KEY + ".mul1", "model.norm.weight", "exl3"]
ODD = [0, -1, 1, 2, 4, 16, 128, 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 400, -(10 ** 30), 0.5, 2.5, 1e308,
       float("inf"), float("-inf"), float("nan"), "", "exl3", "F16", "I16", "I32", "../x", "/abs", "a\x00b",
       "model.safetensors", True, False, None, [], {}, [0, 0], [16, 16, 64]]
SCALARS = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats()
           | st.text(max_size=10) | st.sampled_from(KEYS) | st.sampled_from(ODD))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=4),
                    max_leaves=16)


def run_or_format_error(fn, *args):
    """Call fn; Exl3FormatError is an accepted outcome, anything else fails the test."""
    try:
        return fn(*args)
    except Exl3FormatError as e:
        assert str(e)
        return None


def paths_in(obj):
    """(container, key) for every value inside obj, plus (None, None) for obj itself."""
    out = [(None, None)]
    stack = [obj]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append((node, k))
            stack.append(v)
    return out


def mutate(data, obj, steps):
    """Replace, delete or add values at random places in a JSON structure."""
    obj = copy.deepcopy(obj)
    for _ in range(steps):
        paths = paths_in(obj)
        # Half the time aim at a field the reader interprets (most paths are inside shape lists).
        aimed = [p for p in paths if isinstance(p[1], str) and (p[1] in KEYS or p[1].startswith("model."))]
        if aimed and data.draw(st.booleans(), label="aim"):
            paths = aimed
        container, key = paths[data.draw(st.integers(0, len(paths) - 1), label="where")]
        action = data.draw(st.sampled_from(["replace", "delete", "add"]), label="action")
        # Scalars a third of the time; a copy, since later steps may edit it (ODD holds [] and {}).
        value = copy.deepcopy(data.draw(st.sampled_from(ODD) | SCALARS | JSON, label="value"))
        if container is None:
            obj = value
        elif action == "replace":
            container[key] = value
        elif action == "delete":
            del container[key]
        else:
            target = container[key]
            if isinstance(target, dict):
                target[data.draw(st.sampled_from(KEYS) | st.text(max_size=6), label="new key")] = value
            elif isinstance(target, list):
                target.append(value)
            else:
                container[key] = [target, value]
    return obj


def flip_bytes(data, blob: bytes, max_flips: int = 4) -> bytes:
    """XOR a few random bytes (and maybe truncate)."""
    b = bytearray(blob)
    for _ in range(data.draw(st.integers(1, max_flips), label="flips")):
        if b:
            b[data.draw(st.integers(0, len(b) - 1), label="pos")] ^= data.draw(st.integers(1, 255), label="xor")
    if data.draw(st.booleans(), label="truncate"):
        b = b[:data.draw(st.integers(0, len(b)), label="cut")]
    return bytes(b)


# Raw text json.dumps cannot produce: over-long integers, deep nesting, bad escapes, NUL, BOM.
SPLICES = ["9" * 4400, "-" + "1" * 5000, "[" * 3000, '"\\ud800"', '"\\u0000"', "\x00", "NaN", "-Infinity",
           "1e999", "\ufeff", '"', "}", ",", "0." + "0" * 4400]


def splice_text(data, blob: bytes) -> bytes:
    """Insert or overwrite-with one raw snippet at a random place in a JSON text."""
    text = blob.decode("utf-8", "replace")
    snippet = data.draw(st.sampled_from(SPLICES), label="snippet")
    at = data.draw(st.integers(0, len(text)), label="at")
    end = at + data.draw(st.integers(0, 8), label="overwrite")
    return (text[:at] + snippet + text[end:]).encode("utf-8", "surrogatepass")


class Scratch:
    """A fresh directory per example (hypothesis cannot use function-scoped tmp_path)."""

    def __enter__(self):
        self.path = tempfile.mkdtemp(prefix="exl3fuzz-")
        return self.path

    def __exit__(self, *exc):
        shutil.rmtree(self.path, ignore_errors=True)


def check_header_file(blob: bytes):
    with Scratch() as d:
        p = os.path.join(d, "x.safetensors")
        with open(p, "wb") as f:
            f.write(blob)
        res = run_or_format_error(read_header, p)
        if res is not None:
            infos, meta = res
            assert isinstance(meta, dict)
            for info in infos.values():
                t = run_or_format_error(read_tensor, info)
                assert t is None or tuple(t.shape) == info.shape
        return res


# A small valid file to mutate: tensors of several dtypes.
SMALL = make_ckpt(dim=128, bits=2, vocab=8)
SMALL_BLOB = safetensors_bytes({k: v for k, v in SMALL.tensors.items() if Q_KEY in k or "norm" in k}, {"format": "pt"})
SMALL_HEADER, SMALL_DATA = split_file(SMALL_BLOB)


# ---- (a) read_header -----------------------------------------------------------------------------
def test_small_blob_is_valid():
    infos, meta = check_header_file(SMALL_BLOB)
    assert meta == {"format": "pt"} and Q_KEY + ".trellis" in infos


@FUZZ
@given(st.binary(max_size=300))
def test_read_header_random_bytes(blob):
    check_header_file(blob)


@FUZZ
@given(st.integers(0, 2 ** 64 - 1), st.binary(max_size=200))
def test_read_header_random_length_prefix(hlen, rest):
    check_header_file(struct.pack("<Q", hlen) + rest)


@FUZZ
@given(st.data())
def test_read_header_flipped_bytes(data):
    # Flips land in the length prefix and header most of the time (that is where the parsing is).
    hlen = struct.unpack("<Q", SMALL_BLOB[:8])[0]
    region = data.draw(st.sampled_from([8 + hlen, len(SMALL_BLOB)]), label="region")
    blob = flip_bytes(data, SMALL_BLOB[:region]) + SMALL_BLOB[region:]
    check_header_file(blob)


@FUZZ
@given(JSON, st.binary(max_size=64))
def test_read_header_random_json(header, data):
    check_header_file(raw_safetensors(header, data))


ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F16", "BF16", "F32", "I16", "I32", "U8", "BOOL", "U16", "F8_E4M3", "Q4"]) | SCALARS,
    "shape": st.lists(st.integers(-2, 8), max_size=3) | JSON,
    "data_offsets": st.lists(st.integers(-2, 80), min_size=2, max_size=2) | JSON,
})


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), ENTRY | JSON, max_size=4),
       st.binary(max_size=80))
def test_read_header_tensor_like_entries(header, data):
    check_header_file(raw_safetensors(header, data))


@FUZZ
@given(st.data())
def test_read_header_mutated_structure(data):
    header = mutate(data, SMALL_HEADER, data.draw(st.integers(0, 3), label="steps"))
    res = check_header_file(raw_safetensors(header, SMALL_DATA))
    if json.dumps(header) == json.dumps(SMALL_HEADER):  # not ==: False == 0 in Python
        assert res is not None


# ---- (b) Checkpoint over fuzzed directories ------------------------------------------------------
BASE = {sharded: make_ckpt(sharded=sharded, dim=128, bits=2, vocab=8) for sharded in (False, True)}
FILES = {sharded: ["config.json", "quantization_config.json"] + (["model.safetensors.index.json"] if sharded else [])
         for sharded in (False, True)}


def open_checkpoint(path):
    ckpt = run_or_format_error(Checkpoint, path)
    if ckpt is not None:
        assert all(isinstance(w, str) for w in ckpt.warnings)
        ckpt.average_bpw()
        for spec in ckpt.exl3_modules():
            run_or_format_error(ckpt.weights, spec.key)
    return ckpt


def test_fuzz_bases_load():
    for sharded, ck in BASE.items():
        with Scratch() as d:
            ckpt = open_checkpoint(ck.write(os.path.join(d, "c")))
            assert ckpt is not None and ckpt.warnings == []
            assert {Q_KEY, O_KEY} <= set(ckpt.modules)


def _write_json_variant(data, sharded: bool, make_value):
    ck = BASE[sharded]
    fname = data.draw(st.sampled_from(FILES[sharded]), label="file")
    with Scratch() as d:
        path = ck.write(os.path.join(d, "c"))
        fpath = os.path.join(path, fname)
        with open(fpath, "rb") as f:
            original = f.read()
        new = make_value(original)
        with open(fpath, "wb") as f:
            f.write(new)
        ckpt = open_checkpoint(path)
        if new == original:
            assert ckpt is not None


@FUZZ
@given(st.data(), st.booleans())
def test_checkpoint_random_json_files(data, sharded):
    value = data.draw(JSON, label="json")
    _write_json_variant(data, sharded, lambda original: json.dumps(value).encode())


@FUZZ
@given(st.data(), st.booleans())
def test_checkpoint_mutated_json_files(data, sharded):
    steps = data.draw(st.integers(0, 3), label="steps")
    _write_json_variant(data, sharded, lambda original: json.dumps(mutate(data, json.loads(original), steps)).encode())


@FUZZ
@given(st.data(), st.booleans())
def test_checkpoint_flipped_json_bytes(data, sharded):
    _write_json_variant(data, sharded, lambda original: flip_bytes(data, original, max_flips=3))


@FUZZ
@given(st.data(), st.booleans())
def test_checkpoint_spliced_json_text(data, sharded):
    # Number tokens are the likeliest targets: splice over one of them half the time.
    def splice(original):
        text = original.decode()
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        if digits and data.draw(st.booleans(), label="on a number"):
            i = digits[data.draw(st.integers(0, len(digits) - 1), label="digit")]
            return (text[:i] + data.draw(st.sampled_from(SPLICES[:2] + SPLICES[6:9]), label="num") + text[i:]).encode()
        return splice_text(data, original)
    _write_json_variant(data, sharded, splice)


@FUZZ
@given(st.data())
def test_read_header_spliced_text(data):
    hlen = struct.unpack("<Q", SMALL_BLOB[:8])[0]
    raw = splice_text(data, SMALL_BLOB[8:8 + hlen])
    check_header_file(struct.pack("<Q", len(raw)) + raw + SMALL_DATA)


@FUZZ
@given(st.data(), st.booleans())
def test_checkpoint_mutated_safetensors_header(data, sharded):
    ck = BASE[sharded]
    fname = data.draw(st.sampled_from(["model.safetensors"] if not sharded else ck.shard_names()), label="file")
    with Scratch() as d:
        path = ck.write(os.path.join(d, "c"))
        fpath = os.path.join(path, fname)
        with open(fpath, "rb") as f:
            header, blob_data = split_file(f.read())
        new = mutate(data, header, data.draw(st.integers(0, 3), label="steps"))
        with open(fpath, "wb") as f:
            f.write(raw_safetensors(new, blob_data))
        ckpt = open_checkpoint(path)
        if json.dumps(new) == json.dumps(header):
            assert ckpt is not None


@pytest.mark.parametrize("sharded", [False, True])
def test_fuzz_leaves_no_files(sharded):
    # The scratch directories are removed; the reader itself writes nothing (test_malformed checks that).
    before = set(os.listdir(tempfile.gettempdir()))
    with Scratch() as d:
        open_checkpoint(BASE[sharded].write(os.path.join(d, "c")))
    assert {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("exl3fuzz-")} == set()
