"""Synthetic checkpoints: layout per architecture, bits maps, dense twin, determinism, bad input."""

import argparse
import glob
import json
import os

import pytest
import torch
from safetensors import safe_open

from exl3_vllm.format.checkpoint import Checkpoint
from exl3_vllm.format.codebook import MARKER_VALUES
from exl3_vllm.format.errors import Exl3FormatError
from exl3_vllm.format.reconstruct import dense_weight
from exl3_vllm.synth import PRESETS, plan, synthesize
from exl3_vllm.synth import cli as synth_cli

TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral")
# Dims that are not multiples of 128, so padding and trimming are exercised.
PADDED_QWEN2 = dict(PRESETS["tiny-qwen2"], vocab_size=1000, intermediate_size=320)


def expected_linears(preset: str) -> set[str]:
    c = PRESETS[preset]
    keys = set()
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        keys |= {f"{p}.self_attn.{x}_proj" for x in "qkvo"}
        if preset == "tiny-mixtral":
            keys |= {f"{p}.block_sparse_moe.experts.{e}.{w}" for e in range(c["num_local_experts"])
                     for w in ("w1", "w2", "w3")}
        elif preset in ("tiny-qwen3-moe", "tiny-qwen2-moe"):
            keys |= {f"{p}.mlp.experts.{e}.{w}_proj" for e in range(c["num_experts"]) for w in ("gate", "up", "down")}
            if preset == "tiny-qwen2-moe":
                keys |= {f"{p}.mlp.shared_expert.{w}_proj" for w in ("gate", "up", "down")}
        else:
            keys |= {f"{p}.mlp.{w}_proj" for w in ("gate", "up", "down")}
    return keys | {"lm_head"}


def expected_dense(preset: str) -> set[str]:
    c = PRESETS[preset]
    keys = {"model.embed_tokens", "model.norm"}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        keys |= {f"{p}.input_layernorm", f"{p}.post_attention_layernorm"}
        if preset in ("tiny-qwen3", "tiny-qwen3-moe"):
            keys |= {f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"}
        if preset in ("tiny-qwen3-moe", "tiny-qwen2-moe"):
            keys.add(f"{p}.mlp.gate")
        if preset == "tiny-qwen2-moe":
            keys.add(f"{p}.mlp.shared_expert_gate")
        if preset == "tiny-mixtral":
            keys.add(f"{p}.block_sparse_moe.gate")
    return keys


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: synthesize(name, root / name, bits=4) for name in TINY}


@pytest.mark.parametrize("preset", TINY)
def test_tiny_preset_loads_with_expected_modules(tiny, preset):
    ckpt = Checkpoint(tiny[preset])
    assert ckpt.warnings == []
    exl3 = {m.key: m for m in ckpt.exl3_modules()}
    assert set(exl3) == expected_linears(preset)
    assert set(ckpt.modules) - set(exl3) == expected_dense(preset)
    for key, spec in exl3.items():
        assert spec.codebook == "mul1"
        assert spec.bits == (6 if key == "lm_head" else 4)
        assert ("bias" in spec.tensors) == (preset in ("tiny-qwen2", "tiny-qwen2-moe")
                                            and key.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj"))
    assert ckpt.average_bpw() == 4.0
    qc = ckpt.quantization_config
    assert qc["bits"] == 4.0 and qc["head_bits"] == 6 and qc["version"] == "1.6.5" and qc["codebook"] == "mul1"
    assert qc["out_scales"] == "always" and set(qc["calibration"]) == {"rows", "cols"}
    assert ckpt.config["tie_word_embeddings"] is False
    c = PRESETS[preset]
    q = exl3["model.layers.0.self_attn.q_proj"]
    assert (q.k, q.n) == (c["hidden_size"], c["num_attention_heads"] * c["head_dim"])
    # The router stays fp16 [experts, hidden].
    if preset in ("tiny-qwen3-moe", "tiny-qwen2-moe"):
        assert ckpt.modules["model.layers.1.mlp.gate"].shape == (c["num_experts"], c["hidden_size"])
    if preset == "tiny-qwen2-moe":
        assert ckpt.modules["model.layers.1.mlp.shared_expert_gate"].shape == (1, c["hidden_size"])


@pytest.mark.parametrize("preset", TINY)
def test_tiny_preset_files(tiny, preset):
    path = tiny[preset]
    shards = sorted(glob.glob(os.path.join(path, "model-*-of-*.safetensors")))
    assert len(shards) >= 2
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert sorted(set(index["weight_map"].values())) == [os.path.basename(s) for s in shards]
    total = 0
    for shard in shards:
        # The safetensors library itself must accept every shard.
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
                assert index["weight_map"][name] == os.path.basename(shard)
    assert total == index["metadata"]["total_size"]
    storage = json.load(open(os.path.join(path, "quantization_config.json")))["tensor_storage"]
    ckpt = Checkpoint(path)
    assert set(storage) == set(ckpt.modules)
    for key, entry in storage.items():
        for name, meta in entry["stored_tensors"].items():
            info = ckpt.tensors[name]
            assert meta["shape"] == list(info.shape) and meta["n_bytes"] == info.nbytes
            assert meta["dtype"] == {"I16": "torch.int16", "F16": "torch.float16", "I32": "torch.int32"}[info.dtype]
        if key in {m.key for m in ckpt.exl3_modules()}:
            assert entry["quant_format"] == "exl3" and entry["bits_per_weight"] == ckpt.modules[key].bits
            assert entry["mul1_multiplier"] == 2212286765
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(path, name))


def test_marker_values_and_weight_magnitudes(tmp_path):
    for code in ("mul1", "mcg", "3inst"):
        ckpt = Checkpoint(synthesize("tiny-llama", tmp_path / code, codebook=code))
        for spec in ckpt.exl3_modules():
            assert spec.codebook == code
        key = "model.layers.0.mlp.down_proj"
        if code != "3inst":
            assert int(ckpt.tensor(f"{key}.{code}")) == MARKER_VALUES[code]
        else:
            assert not any(n.endswith((".mcg", ".mul1")) for n in ckpt.tensors)
        w = ckpt.weights(key)
        std = float(dense_weight(w.trellis, w.suh, w.svh, w.codebook).std())
        assert 0.017 < std < 0.023, (code, std)
        storage = json.load(open(tmp_path / code / "quantization_config.json"))["tensor_storage"][key]
        assert ({"mul1": "mul1_multiplier", "mcg": "mcg_multiplier"}.get(code) in storage) == (code != "3inst")


def test_bits_map_mixed(tmp_path):
    bits_map = {
        "model.layers.0.self_attn.q_proj": 2,
        "*.self_attn.k_proj": 3,
        "*.self_attn.v_proj": {"bits": 2.5, "codebook": "mul1"},
        "model.layers.1.*": 8,
        "*.mlp.down_proj": 6,
        "*.o_proj": {"bits": 5, "codebook": "mcg"},
    }
    path = tmp_path / "map.json"
    path.write_text(json.dumps(bits_map))
    ckpt = Checkpoint(synthesize("tiny-qwen3", tmp_path / "out", bits=4, bits_map=str(path), head_bits=16))
    got = {m.key: (m.bits, m.codebook) for m in ckpt.exl3_modules()}
    assert got["model.layers.0.self_attn.q_proj"] == (2, "mul1")
    assert got["model.layers.0.self_attn.k_proj"] == (3, "mul1")
    assert got["model.layers.0.self_attn.v_proj"] == (2.5, "mul1")
    assert got["model.layers.1.self_attn.v_proj"] == (2.5, "mul1")  # first match wins
    assert got["model.layers.1.mlp.up_proj"] == (8, "mul1")
    assert got["model.layers.1.mlp.down_proj"] == (8, "mul1")
    assert got["model.layers.0.mlp.down_proj"] == (6, "mul1")
    assert got["model.layers.0.self_attn.o_proj"] == (5, "mcg")
    assert got["model.layers.0.mlp.gate_proj"] == (4, "mul1")
    assert "lm_head" not in got and ckpt.modules["lm_head"].shape == (1024, 256)
    specs = [m for m in ckpt.exl3_modules()]
    avg = sum(m.bits * m.k * m.n for m in specs) / sum(m.k * m.n for m in specs)
    assert ckpt.average_bpw() == pytest.approx(avg) and ckpt.quantization_config["bits"] == round(avg, 2)
    assert ckpt.warnings == []
    w = ckpt.weights("model.layers.0.self_attn.v_proj")
    assert w.trellis.shape[-1] == 40 and torch.isfinite(dense_weight(w.trellis, w.suh, w.svh, w.codebook)).all()


@pytest.mark.parametrize("dense_dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_also_dense_matches_reconstruction(tmp_path, dense_dtype, torch_dtype):
    q, d = tmp_path / "q", tmp_path / "d"
    synthesize(PADDED_QWEN2, q, bits=3, head_bits=5, also_dense=d, dense_dtype=dense_dtype)
    ckpt = Checkpoint(q)
    head = ckpt.modules["lm_head"]
    assert (head.n, head.padded_from) == (1024, {"n": 1000})
    assert ckpt.modules["model.layers.0.mlp.down_proj"].k == 384
    cfg = json.load(open(d / "config.json"))
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == dense_dtype
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == 1000
    dense = {}
    for shard in glob.glob(str(d / "*.safetensors")):
        with safe_open(shard, "pt") as f:
            dense.update({name: f.get_tensor(name) for name in f.keys()})
    index = json.load(open(d / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(dense)
    names = set()
    for key, spec in ckpt.modules.items():
        if spec in ckpt.exl3_modules():
            w = ckpt.weights(key)
            n_out = spec.padded_from.get("n", spec.n)
            k_in = spec.padded_from.get("k", spec.k)
            ref = dense_weight(w.trellis, w.suh, w.svh, w.codebook).T[:n_out, :k_in].to(torch_dtype)
            got = dense[f"{key}.weight"]
            assert got.dtype == torch_dtype and torch.equal(got, ref), key
            names.add(f"{key}.weight")
            if w.bias is not None:
                assert torch.equal(dense[f"{key}.bias"], w.bias[:n_out])
                assert torch.all(w.bias[n_out:] == 0)
                names.add(f"{key}.bias")
        else:
            for suffix in spec.tensors:
                name = f"{key}.{suffix}"
                assert torch.equal(dense[name], ckpt.tensor(name)), name
                names.add(name)
    assert names == set(dense)
    assert dense["lm_head.weight"].shape == (1000, 256)
    assert dense["model.layers.0.mlp.down_proj.weight"].shape == (256, 320)
    assert dense["model.layers.0.self_attn.q_proj.bias"].shape == (256,)
    # Padding is zero in suh/svh, so the padded rows/columns of W carry nothing.
    w = ckpt.weights("lm_head")
    assert torch.all(dense_weight(w.trellis, w.suh, w.svh, w.codebook)[:, 1000:] == 0)


def test_deterministic(tmp_path):
    a = synthesize("tiny-qwen3-moe", tmp_path / "a", seed=7, bits=2)
    b = synthesize("tiny-qwen3-moe", tmp_path / "b", seed=7, bits=2)
    c = synthesize("tiny-qwen3-moe", tmp_path / "c", seed=8, bits=2)
    files = sorted(os.listdir(a))
    assert files == sorted(os.listdir(b))
    for name in files:
        assert open(os.path.join(a, name), "rb").read() == open(os.path.join(b, name), "rb").read(), name
    key = "model.layers.0.mlp.experts.3.up_proj.trellis"
    assert not torch.equal(Checkpoint(a).tensor(key), Checkpoint(c).tensor(key))


def test_plan_full_presets():
    p = plan("llama-3-8b", bits=4)
    lin = p.decoder_linears()
    assert len(lin) == 32 * 7
    shapes = {m.key.split(".", 3)[-1]: (m.k, m.n) for m in lin if m.key.startswith("model.layers.31.")}
    assert shapes == {"self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (4096, 1024),
                      "self_attn.v_proj": (4096, 1024), "self_attn.o_proj": (4096, 4096),
                      "mlp.gate_proj": (4096, 14336), "mlp.up_proj": (4096, 14336), "mlp.down_proj": (14336, 4096)}
    assert all(m.bits == 4 and m.codebook == "mul1" for m in lin)
    assert round(p.average_bpw, 2) == 4.00 and p.quantization_config()["bits"] == 4.0
    head = next(m for m in p.modules if m.key == "lm_head")
    assert (head.k, head.n, head.bits) == (4096, 128256, 6)
    assert next(m for m in p.modules if m.key == "model.embed_tokens").tensors[0].shape == (128256, 4096)
    # Trellis bits + fp16 embedding + 6-bit head, in bytes.
    params = sum(m.k * m.n for m in lin)
    assert params == 32 * (4096 * (4096 * 2 + 1024 * 2) + 3 * 4096 * 14336)
    assert p.total_bytes > params // 2 + 128256 * 4096 * 2

    p = plan("qwen3-8b", bits=3.5)
    assert len(p.decoder_linears()) == 36 * 7 and p.average_bpw == 3.5
    assert {m.key for m in p.modules} >= {"model.layers.35.self_attn.q_norm", "model.layers.35.self_attn.k_norm"}

    p = plan("qwen3-30b-a3b", bits=4, head_bits=16)
    lin = p.decoder_linears()
    assert len(lin) == 48 * (4 + 128 * 3)
    experts = [m for m in lin if m.role == "expert"]
    assert {(m.k, m.n) for m in experts} == {(2048, 768), (768, 2048)}
    router = next(m for m in p.modules if m.key == "model.layers.47.mlp.gate")
    assert router.kind == "dense" and router.tensors[0].shape == (128, 2048)
    assert next(m for m in p.modules if m.key == "lm_head").kind == "dense"

    # Qwen3.5-27B's decoder: 48 gated-delta-net layers and 16 gated attention layers (q_proj doubled by the output
    # gate), and its MTP layer outside the decoder's average.
    p = plan("qwen3.5-27b", bits=4)
    lin = p.decoder_linears()
    assert len(lin) == 48 * 6 + 16 * 7 and p.average_bpw == 4.0
    shapes = {m.key.split(".", 4)[-1]: (m.k, m.n) for m in lin if ".layers.3." in m.key or ".layers.4." in m.key}
    assert shapes["self_attn.q_proj"] == (5120, 2 * 24 * 256) and shapes["linear_attn.in_proj_qkv"] == (5120, 10240)
    assert shapes["mlp.down_proj"] == (17408, 5120)
    assert any(m.key == "mtp.layers.0.self_attn.q_proj" for m in p.modules)


@pytest.mark.parametrize("kwargs, match", [
    (dict(config_or_preset="tiny-gpt"), "unknown preset"),
    (dict(config_or_preset="/nonexistent/config.json"), "does not exist"),
    (dict(bits=9), "not an EXL3 bitrate"),
    (dict(bits=0.5), "not an EXL3 bitrate"),
    (dict(bits="four"), "must be a number"),
    (dict(bits=4.5), "not an EXL3 bitrate"),
    (dict(head_bits=12), "not an EXL3 bitrate"),
    (dict(codebook="mul2"), "not an EXL3 codebook"),
    (dict(bits=2.5, codebook="mcg"), "needs the mul1 codebook"),
    (dict(bits=4, head_bits=1.5, codebook="3inst"), "needs the mul1 codebook"),
    (dict(bits_map={"*.q_proj": 3.5}, codebook="mcg"), "needs the mul1 codebook"),
    (dict(bits_map={"*.q_proj": {"bits": 2.5, "codebook": "3inst"}}), "needs the mul1 codebook"),
    (dict(bits_map={"*.q_proj": 10}), "not an EXL3 bitrate"),
    (dict(bits_map={"*.q_proj": {"codebook": "mcg"}}), "needs 'bits'"),
    (dict(bits_map=[["*", 4]]), "must be a JSON object"),
    (dict(bits_map="/nonexistent/map.json"), "does not exist"),
    (dict(seed=-1), "seed"),
    (dict(dense_dtype="float16", also_dense="DENSE"), "dense dtype"),
    (dict(config_or_preset=dict(PRESETS["tiny-llama"], architectures=["GPT2LMHeadModel"], model_type="gpt2")),
     "unsupported architecture"),
    (dict(config_or_preset=dict(PRESETS["tiny-llama"], hidden_size=None)), "hidden_size"),
    (dict(config_or_preset={"architectures": ["LlamaForCausalLM"], "text_config": PRESETS["tiny-llama"]}),
     "nested text_config goes with a multimodal class"),
    (dict(config_or_preset=dict(PRESETS["tiny-qwen3.5"], architectures=["Qwen3_5ForConditionalGeneration"])),
     "nested text_config goes with a multimodal class"),
])
def test_bad_input_raises_and_writes_nothing(tmp_path, kwargs, match):
    args = dict(config_or_preset="tiny-llama", out_dir=tmp_path / "out")
    args.update(kwargs)
    if args.get("also_dense") == "DENSE":
        args["also_dense"] = tmp_path / "dense"
    with pytest.raises(Exl3FormatError, match=match):
        synthesize(**args)
    assert not (tmp_path / "out").exists() and not (tmp_path / "dense").exists()


def test_bad_config_files(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(Exl3FormatError, match="not valid JSON"):
        synthesize(str(bad), tmp_path / "out")
    bad.write_text("[1, 2]")
    with pytest.raises(Exl3FormatError, match="JSON object"):
        synthesize(str(tmp_path), tmp_path / "out")
    (tmp_path / "map.json").write_text("{")
    with pytest.raises(Exl3FormatError, match="not valid JSON"):
        synthesize("tiny-llama", tmp_path / "out", bits_map=str(tmp_path / "map.json"))
    assert not (tmp_path / "out").exists()


def test_non_empty_output_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    with pytest.raises(Exl3FormatError, match="not empty"):
        synthesize("tiny-llama", out)
    synthesize("tiny-llama", out, overwrite=True, shard_bytes=1 << 40)
    assert (out / "keep.txt").read_text() == "user file"
    assert os.path.isfile(out / "model.safetensors")  # one shard when the limit allows
    synthesize("tiny-llama", out, overwrite=True)
    assert not os.path.exists(out / "model.safetensors")  # stale files of an earlier run are removed
    Checkpoint(str(out))


def _run_cli(argv):
    parser = argparse.ArgumentParser()
    synth_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli(tmp_path, capsys):
    bits_map = tmp_path / "map.json"
    bits_map.write_text(json.dumps({"*.mlp.*": 3}))
    out = tmp_path / "out"
    rc = _run_cli(["synth", "--config", "tiny-mixtral", "--bits", "2", "--codebook", "mcg", "--head-bits", "16",
                   "--bits-map", str(bits_map), "--seed", "3", "--also-dense", str(tmp_path / "d"),
                   "--dense-dtype", "float32", "--out", str(out)])
    assert rc == 0
    ckpt = Checkpoint(str(out))
    assert ckpt.average_bpw() == 2.0 and ckpt.modules["lm_head"].shape == (1024, 256)
    assert {m.codebook for m in ckpt.exl3_modules()} == {"mcg"}
    assert json.load(open(tmp_path / "d" / "config.json"))["torch_dtype"] == "float32"
    capsys.readouterr()
    for argv, match in ((["--config", "nope", "--out", str(tmp_path / "x")], "unknown preset"),
                        (["--config", "tiny-llama", "--bits", "9", "--out", str(tmp_path / "x")], "bitrate"),
                        (["--config", "tiny-llama", "--seed", "x", "--out", str(tmp_path / "x")], "integer"),
                        (["--config", "tiny-llama"], "--out"),
                        (["--config", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")], "exist")):
        assert _run_cli(["synth", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("exl3-vllm synth: error:") and match in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
    assert _run_cli(["synth", "--config", "llama-3-8b", "--dry-run"]) == 0
    assert "4.00 bpw" in capsys.readouterr().out


def test_tokenizer(tiny):
    path = tiny["tiny-llama"]
    tok = json.load(open(os.path.join(path, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    assert len(vocab) == 1024 and sorted(vocab.values()) == list(range(1024))
    assert [vocab[t] for t in ("<unk>", "<s>", "</s>", "<pad>", "a", "\u0120a", "\u0120ab")] == [0, 1, 2, 3, 101, 260, 287]
    # Every merge joins two tokens that already exist into a new one.
    for merge in tok["model"]["merges"]:
        a, b = merge.split(" ")
        assert a in vocab and b in vocab and a + b in vocab and vocab[a + b] > max(vocab[a], vocab[b])
    cfg = json.load(open(os.path.join(path, "tokenizer_config.json")))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in cfg
    gen = json.load(open(os.path.join(path, "generation_config.json")))
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    tokenizers = pytest.importorskip("tokenizers")
    t = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    assert t.encode("hi a ab</s>").ids == [1, 4 + ord("h"), 4 + ord("i"), 260, 287, 2]
    assert t.decode([1, 4 + ord("h"), 260, 287, 2]) == "h a ab"
