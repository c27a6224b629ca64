"""One checkpoint module feeding several of a vLLM layer's output partitions (Qwen3.5's in_proj_qkv: vLLM's
in_proj_qkvz has parts q, k, v, z, the checkpoint the modules in_proj_qkv and in_proj_z), at TP 1 and 2, against
the format reference on the modules as written."""
import types

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
import torch  # noqa: E402
from ckpt_builder import linear_tensors, make_ckpt, storage_entry, tensor  # noqa: E402
from safetensors import safe_open  # noqa: E402

from exl3_vllm.format.checkpoint import Checkpoint  # noqa: E402
from exl3_vllm.format.errors import Exl3FormatError  # noqa: E402
from exl3_vllm.format.linear import linear as reference  # noqa: E402
from exl3_vllm.plugin.linear_method import Exl3LinearMethod  # noqa: E402

QKV, Z = "model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_z"
K = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    c = make_ckpt()
    rng = np.random.default_rng(7)
    extra = {**linear_tensors(QKV, K, 768, rng, bits=4), **linear_tensors(Z, K, 256, rng, bits=3)}
    # What exllamav3 writes beside them, raw and outside tensor_storage (docs/format.md 1.9).
    extra.update({"model.layers.0.linear_attn.A_log": tensor("F32", [4], rng),
                  "model.layers.0.linear_attn.dt_bias": tensor("F16", [4], rng),
                  "model.layers.0.linear_attn.conv1d.weight": tensor("F16", [768, 1, 4], rng)})
    c.tensors.update(extra)
    for key in (QKV, Z):
        c.qcfg["tensor_storage"][key] = storage_entry(key, c.tensors)
    path = str(tmp_path_factory.mktemp("spread"))
    c.write(path)
    return Checkpoint(path)


def tensors_of(ck, key):
    spec = ck.modules[key]
    out = {}
    for name, t in spec.tensors.items():
        with safe_open(t.file, "pt") as f:
            out[name] = f.get_tensor(f"{key}.{name}")
    return out


def build(ck, parts, tp_rank=0, tp_size=1):
    method = Exl3LinearMethod(types.SimpleNamespace(checkpoint=ck), "model.layers.0.linear_attn.in_proj_qkvz",
                              [ck.modules[QKV], ck.modules[Z]])
    layer = torch.nn.Module()
    layer.tp_rank, layer.tp_size = tp_rank, tp_size
    method.create_weights(layer, K, parts, K, sum(parts) * tp_size, torch.float32)
    return method, layer


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (0, 2), (1, 2)])
def test_partitions_cut_from_one_module_match_the_reference(ckpt, tp_rank, tp_size):
    part = 256 // tp_size
    method, layer = build(ckpt, [part] * 4, tp_rank, tp_size)
    for key, shard in ((QKV, (0, 1, 2)), (Z, 3)):
        for name, t in tensors_of(ckpt, key).items():
            param = getattr(layer, name)
            param.weight_loader(param, t, shard)
    method.process_weights_after_loading(layer)
    x = torch.randn(5, K)
    got = method.apply(layer, x)
    ref = {key: reference(x, t["trellis"], t["suh"], t["svh"], ckpt.modules[key].codebook)
           for key, t in ((k, tensors_of(ckpt, k)) for k in (QKV, Z))}
    cols = lambda y, base: y[:, base + tp_rank * part: base + (tp_rank + 1) * part]  # noqa: E731
    want = torch.cat([cols(ref[QKV], 0), cols(ref[QKV], 256), cols(ref[QKV], 512), cols(ref[Z], 0)], dim=1)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # q, k and v share in_proj_qkv's suh: one kernel shard for the three (in_proj_z has another K: its own group).
    assert [g[3] for g in layer.exl3.groups] == [[3 * part], [part]]


def test_the_raw_gated_delta_net_tensors_read_without_warnings(ckpt):
    assert not [w for w in ckpt.warnings if "linear_attn" in w or "tensor_storage" in w], ckpt.warnings
    assert ckpt.modules["model.layers.0.linear_attn.conv1d"].shape == (768, 1, 4)


def test_partitions_that_do_not_divide_the_modules_are_refused(ckpt):
    with pytest.raises(Exl3FormatError, match="do not divide"):
        build(ckpt, [256, 256, 128, 384])
    with pytest.raises(Exl3FormatError, match="multiples of 128"):
        build(ckpt, [64] * 4, 0, 4)
