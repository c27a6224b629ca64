"""The format reference against outputs of exllamav3's own CUDA kernels.

The fixtures come from bench/peer/ (see tests/data/exllamav3/README.md): they
are made on the GPU machine with exllamav3 1.6.5's kernels.
"""

import glob
import json
import os

import pytest
import torch
from safetensors import safe_open

from exl3_vllm.format import codebook as cb
from exl3_vllm.format import embedding as emb
from exl3_vllm.format import trellis as tr
from exl3_vllm.format.hadamard import had_128
from exl3_vllm.format.linear import linear
from exl3_vllm.format.reconstruct import dense_weight, w_hat

DATA = os.path.join(os.path.dirname(__file__), "data", "exllamav3")
CASES = sorted(p for p in glob.glob(os.path.join(DATA, "k*.safetensors")))

pytestmark = pytest.mark.skipif(
    not CASES, reason="no exllamav3 fixtures in tests/data/exllamav3: they are made on the GPU machine "
                      "by bench/peer (see bench/README.md)")


def load(path):
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def case_id(path):
    return os.path.basename(path).removesuffix(".safetensors")


@pytest.mark.parametrize("path", CASES, ids=case_id)
def test_states_and_w_hat_bit_exact(path):
    t, meta = load(path)
    bits, name = float(meta["K"]), meta["codebook"]
    assert tr.bits_from_width(t["trellis"].shape[-1]) == bits
    states = tr.unpack(t["trellis"])
    assert torch.equal(states, t["states"].to(torch.int32) & 0xFFFF)
    ours = w_hat(t["trellis"], name)
    assert torch.equal(ours.view(torch.int16), t["w_hat"].view(torch.int16))


@pytest.mark.parametrize("path", CASES, ids=case_id)
def test_dense_weight_and_gemm_within_fp16_rounding(path):
    t, meta = load(path)
    name = meta["codebook"]
    w = dense_weight(t["trellis"], t["suh"], t["svh"], name, torch.float64)
    err_w = rel(t["w"], w)
    assert err_w < 2e-3, err_w
    # had_r_128 with pre_scale = suh: the GEMM's input transform.
    assert rel(t["had_x"], had_128(t["x"].double() * t["suh"].double())) < 1e-3
    for key in sorted(k for k in t if k.startswith("y_m")):
        m = int(key[3:].split("_")[0])
        x = t["x"][:m]
        ref = linear(x.double(), t["trellis"], t["suh"], t["svh"], name, compute_dtype=torch.float64)
        err = rel(t[key], ref)
        assert err < 5e-3, (key, err)


def test_codebooks_bit_exact():
    path = os.path.join(DATA, "codebooks.safetensors")
    if not os.path.exists(path):
        pytest.skip("codebooks.safetensors not made")
    t, _ = load(path)
    for name in cb.CODEBOOKS:
        assert torch.equal(cb.all_values(name).view(torch.int16), t[f"cb_{name}"].view(torch.int16)), name


def test_fixture_set_is_complete():
    ids = {case_id(p) for p in CASES}
    want = {f"k{k}_{c}" for k in range(1, 9) for c in cb.CODEBOOKS} | {f"k{k}p5_mul1" for k in (1, 2, 3)}
    missing = sorted(want - ids)
    assert not missing, f"missing fixtures: {missing}"


def test_embedding_rows_bit_exact():
    t, meta = load(os.path.join(DATA, "embedding_rows.safetensors"))
    hidden = int(meta["hidden"])
    for k in range(1, 9):
        for values_of in (None, cb.all_values("mul1")):
            ours = emb.decode_rows(t[f"k{k}.trellis"], t[f"k{k}.signs"], hidden, values_of)
            assert torch.equal(ours.view(torch.int16), t[f"k{k}.rows"].view(torch.int16)), k
