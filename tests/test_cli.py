"""The exl3-vllm command line: synth -> inspect -> reload round trip, and bad input."""

import json
import os

import pytest
import torch

from exl3_vllm import cli
from exl3_vllm.format.checkpoint import Checkpoint
from exl3_vllm.format.linear import linear
from exl3_vllm.synth import synthesize


def test_synth_inspect_reload_round_trip(tmp_path, capsys):
    out = tmp_path / "m"
    bits_map = tmp_path / "bits.json"
    bits_map.write_text(json.dumps({"model.layers.0.mlp.down_proj": 2.5, "model.layers.1.*": 6}))
    assert cli.main(["synth", "--config", "tiny-qwen3", "--bits", "3", "--bits-map", str(bits_map),
                     "--seed", "5", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    ck = Checkpoint(str(out))
    assert s["average_bpw"] == pytest.approx(ck.average_bpw())
    mods = {m["key"]: m for m in s["modules"]}
    assert mods["model.layers.0.mlp.down_proj"]["bits"] == 2.5
    assert mods["model.layers.1.self_attn.q_proj"]["bits"] == 6
    assert mods["model.layers.0.self_attn.q_proj"]["bits"] == 3
    assert mods["lm_head"]["format"] == "exl3" and s["head_bits"] == 6
    assert mods["model.norm"]["format"] == "unquantized"
    assert s["warnings"] == []  # half-integer K (2.5 here) is served, not warned about
    # Reload: the tensors read back run through the reference linear.
    w = ck.weights("model.layers.0.mlp.down_proj")
    x = torch.randn(3, w.trellis.shape[0] * 16, dtype=torch.float64)
    y = linear(x, w.trellis, w.suh, w.svh, w.codebook, compute_dtype=torch.float64)
    assert y.shape == (3, w.trellis.shape[1] * 16) and torch.isfinite(y).all()
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "average bpw (decoder linears):" in text and "warning: " not in text


def test_llama_3_8b_plan_is_4_bpw(capsys):
    assert cli.main(["synth", "--config", "llama-3-8b", "--bits", "4", "--dry-run", "--out", "/nonexistent"]) == 0
    assert "4.00" in capsys.readouterr().out


def test_inspect_bad_checkpoint_exits_2_with_message(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "not valid JSON" in err and "Traceback" not in err


def test_inspect_verify_reads_the_data_and_names_a_nan(tmp_path, capsys):

    out = tmp_path / "ckpt"
    synthesize("tiny-llama", str(out), bits=4, seed=3, embed_bits=4)
    assert cli.main(["inspect", str(out), "--verify"]) == 0
    assert "verify: every scale" in capsys.readouterr().out
    ck = Checkpoint(str(out))
    for name, pos in (("model.layers.1.mlp.up_proj.svh", 7), ("model.embed_tokens.trellis", 0)):
        info = ck.tensors[name]
        with open(info.file, "r+b") as f:
            f.seek(info.offset + 2 * pos)
            old = f.read(2)
            f.seek(info.offset + 2 * pos)
            f.write(bytes([0x00, 0x7C]))  # fp16 +Inf
        assert cli.main(["inspect", str(out)]) == 0  # headers alone cannot see it
        assert cli.main(["inspect", str(out), "--verify"]) == 2
        err = capsys.readouterr().err
        assert name in err and "NaN or Inf" in err, err
        with open(info.file, "r+b") as f:
            f.seek(info.offset + 2 * pos)
            f.write(old)


def test_doctor_reports_versions_and_that_vllm_finds_the_plugin(capsys):
    pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
    assert cli.main(["doctor", "--json", "--no-compile"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["plugin_entry_point"] == "exl3_vllm.plugin:register" and r["vllm_knows_exl3"] == "Exl3Config"
    assert r["torch"] and r["vllm"] and r["python"]


def test_explain_names_each_kernel_call_its_path_per_m_and_why(tmp_path, capsys, monkeypatch):
    import os

    monkeypatch.delenv("EXL3_VLLM_DISABLE", raising=False)
    q = str(tmp_path / "q")
    synthesize("tiny-llama", q, bits=4, seed=1)
    assert cli.main(["explain", q, "--m", "1,16,64,1024", "--json"]) == 0
    calls = json.loads(capsys.readouterr().out)
    # One fused q/k/v call (three shards of one K), as vLLM fuses them.
    qkv = [c for c in calls if c["example"].endswith("q_proj")]
    assert qkv and all(len(c["shards"]) == 3 for c in qkv), qkv
    for c in calls:
        by_m = {r["m"]: r for r in c["rows"]}
        assert by_m[1]["tier"].startswith(("i4", "i8")) and by_m[1]["passed_over"] == []
        assert by_m[16]["tier"].startswith("w") and "h8: m > 8" in by_m[16]["passed_over"]
        assert by_m[1024]["path"] == "dequant" and "dequantize + cuBLAS" in by_m[1024]["passed_over"][0]
    # A real exllamav3 checkpoint whose q/k/v differ in K: one call per K; switches and the arch show in the reasons.
    real = os.path.join(os.path.dirname(__file__), "data", "corpus", "llama-recipe-eb4")
    monkeypatch.setenv("EXL3_VLLM_DISABLE", "i4,i8")
    assert cli.main(["explain", real, "--m", "1,16", "--arch", "89", "--json"]) == 0
    calls = json.loads(capsys.readouterr().out)
    attn = {c["example"].rpartition(".")[2] for c in calls if ".layers.0.self_attn." in c["example"]}
    assert {"q_proj", "k_proj", "v_proj"} <= attn, attn
    for c in calls:
        for r in c["rows"]:
            assert not r["tier"].startswith(("i4", "i8", "w", "x")), r
            assert r["m"] != 1 or "i4/i8: disabled (EXL3_VLLM_DISABLE)" in r["passed_over"], r
            assert r["m"] == 1 or any("sm_89 is not sm_90" in w for w in r["passed_over"]), r


def test_modules_left_out_of_tensor_storage_are_read_from_the_headers(tmp_path, capsys):
    """exllamav3 writes MTP (and vision) modules without listing them in tensor_storage: they are read from the
    safetensors headers as what their tensors say, listed by inspect, with no warning (`mtp.*`, and DeepSeek-style
    MTP layers numbered from num_hidden_layers on); any other EXL3 module missing from tensor_storage is warned
    about."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    synthesize("tiny-llama", str(out), bits=4, seed=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    src = "model.layers.0.mlp.down_proj"
    shard = index["weight_map"][f"{src}.trellis"]
    tensors = {k: v for k, v in load_file(str(out / shard)).items() if k.startswith(src + ".")}
    extra = {}
    nextn = f"model.layers.{json.loads((out / 'config.json').read_text())['num_hidden_layers']}.mlp.down_proj"
    for key in ("mtp.layers.0.mlp.down_proj", nextn, "model.layers.0.mlp.extra_proj"):
        extra.update({key + k[len(src):]: v.clone() for k, v in tensors.items()})
    save_file(extra, str(out / "model-extra.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({k: "model-extra.safetensors" for k in extra})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = Checkpoint(str(out))
    mtp, base = ck.modules["mtp.layers.0.mlp.down_proj"], ck.modules[src]
    assert (mtp.bits, mtp.k, mtp.n, mtp.codebook) == (base.bits, base.k, base.n, base.codebook)
    assert torch.equal(ck.weights("mtp.layers.0.mlp.down_proj").trellis, ck.weights(src).trellis)
    assert [w for w in ck.warnings if "tensor_storage" in w] == [
        "model.layers.0.mlp.extra_proj: EXL3 module in the tensors but not in tensor_storage"]
    assert cli.main(["inspect", str(out), "--json"]) == 0
    mods = {m["key"]: m for m in json.loads(capsys.readouterr().out)["modules"]}
    assert mods["mtp.layers.0.mlp.down_proj"]["format"] == "exl3" and mods["mtp.layers.0.mlp.down_proj"]["bits"] == 4
    assert mods[nextn]["format"] == "exl3"


@pytest.mark.parametrize("preset,mtp,modules", [("tiny-qwen3.5-vl", "mtp.*", 8),
                                                ("tiny-glm4-moe-lite", "model.layers.3.*", 32)])
def test_config_bits_speak_of_the_decoder_mtp_and_vision_are_reported_apart(tmp_path, capsys, preset, mtp, modules):
    """exllamav3's `bits` is the decoder's; MTP layers (mtp_bits) and a vision tower (vision_bits) are quantized apart.
    A model whose MTP layer has other bits than the decoder (a multimodal Qwen3.5's mtp.*; GLM-4-MoE-Lite's
    DeepSeek-style layer, decoder layer num_hidden_layers): no bits warning, and inspect shows each."""
    rules = tmp_path / "bits.json"
    rules.write_text(json.dumps({mtp: 6}))
    out = tmp_path / "m"
    synthesize(preset, str(out), bits=3, bits_map=str(rules), seed=3)
    ck = Checkpoint(str(out))
    assert ck.quantization_config["bits"] == 3 and ck.quantization_config["mtp_bits"] == 6
    assert ck.average_bpw() == 3 and not ck.warnings
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"MTP layers: {modules} EXL3 modules, 6.00 bpw (config: 6)" in text
    assert "vision tower" not in text and "warning" not in text  # stored unquantized, as --vision_bits 16 does
    if preset == "tiny-glm4-moe-lite":  # exllamav3 pads the latent attention's kv_a to 640 and keeps kv_b_proj fp16
        assert ck.nextn_layer("model.layers.3.eh_proj") == "model.layers.3."
        assert ck.nextn_layer("model.layers.2.mlp") is None
        assert ck.modules["model.layers.0.self_attn.kv_a_proj_with_mqa"].n == 640
        assert ck.modules["model.layers.0.self_attn.kv_b_proj"].shape == (4 * (192 + 256), 512)  # heads x (nope + v)
        # vLLM's fused q_a + kv_a, found without the model's packed mapping (a draft built apart may lack it)
        pytest.importorskip("vllm")
        from exl3_vllm.plugin.config import Exl3Config

        c = Exl3Config({"quant_method": "exl3"})
        c.load_checkpoint(str(out))
        assert [spec.key for _, spec in c.specs_for("model.layers.3.self_attn.fused_qkv_a_proj")] == [
            "model.layers.3.self_attn.q_a_proj", "model.layers.3.self_attn.kv_a_proj_with_mqa"]


def test_a_vision_attention_quantized_as_split_qkv_runs_as_the_towers_qkv(tmp_path, monkeypatch):
    """exllamav3 --vision_bits stores a Qwen-VL tower's fused attn.qkv as EXL3 q_proj/k_proj/v_proj beside the source
    qkv; vLLM's tower has one qkv layer, which takes the three as its shards (tests/test_vllm_qwen35.py serves a real
    one). A tower vLLM builds otherwise is refused with what to do (text-only serving never builds it)."""
    pytest.importorskip("vllm")
    import importlib.util

    from safetensors.torch import load_file, save_file

    from exl3_vllm.format.errors import Exl3FormatError
    from exl3_vllm.plugin import vision

    if not importlib.util.find_spec("torchvision"):  # vLLM's Qwen-VL module imports it (tests/stubs/torchvision)
        monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "stubs"))
    from exl3_vllm.plugin.config import Exl3Config

    out = tmp_path / "m"
    synthesize("tiny-qwen3.5-vl", str(out), bits=4, seed=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    src = "model.language_model.layers.3.self_attn.o_proj"
    tensors = {k: v for k, v in load_file(str(out / index["weight_map"][f"{src}.trellis"])).items()
               if k.startswith(src + ".")}
    extra = {f"model.visual.blocks.0.attn.{p}" + k[len(src):]: v.clone() for p in ("q_proj", "k_proj", "v_proj")
             for k, v in tensors.items()}
    save_file(extra, str(out / "model-vision.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({k: "model-vision.safetensors" for k in extra})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = Checkpoint(str(out))
    assert ck.split_vision_qkv == ["model.visual.blocks.0.attn.q_proj"] and not ck.warnings
    c = Exl3Config({"quant_method": "exl3"})
    c.load_checkpoint(str(out))
    specs = vision.split_qkv_specs(c, "visual.blocks.0.attn.qkv")
    assert [s.key for s in specs] == [f"model.visual.blocks.0.attn.{p}_proj" for p in "qkv"]
    assert vision.split_qkv_specs(c, "language_model.model.layers.3.self_attn.qkv_proj") is None  # not a tower's
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2_5_VLForConditionalGeneration"]}))
    c = Exl3Config({"quant_method": "exl3"})
    c.load_checkpoint(str(out))
    with pytest.raises(Exl3FormatError, match="--language-model-only, or convert with --vision_bits 16"):
        vision.split_qkv_specs(c, "visual.blocks.0.attn.qkv")


def test_a_deepseek_style_draft_that_cannot_load_an_exl3_eh_proj_is_refused_with_what_to_do(tmp_path, monkeypatch):
    """A DeepSeek-style MTP layer (decoder layer num_hidden_layers + i) with an EXL3 eh_proj: vLLM drafts that give
    eh_proj a quantization method ask for it first and load it; those that build a plain torch Linear never do, and
    the first other module of that layer is refused, naming the tensor and what to do (`--load-format exl3`, under
    which it is not refused). Decoder layers are untouched."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file, save_file

    from exl3_vllm.format.checkpoint import Checkpoint
    from exl3_vllm.format.linear import linear
    from exl3_vllm.format.errors import Exl3FormatError
    from exl3_vllm.plugin import loader
    from exl3_vllm.plugin.config import Exl3Config

    out = tmp_path / "m"
    synthesize("tiny-llama", str(out), bits=4, seed=3)
    n = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    src = "model.layers.0.mlp.down_proj"
    tensors = {k: v for k, v in load_file(str(out / index["weight_map"][f"{src}.trellis"])).items()
               if k.startswith(src + ".")}
    extra = {f"model.layers.{n}.eh_proj" + k[len(src):]: v.clone() for k, v in tensors.items()}
    save_file(extra, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))

    def config():
        c = Exl3Config({"quant_method": "exl3"})
        c.load_checkpoint(str(out))
        return c

    c = config()
    c.get_quant_method(torch.nn.Identity(), "model.layers.0.self_attn.o_proj")
    with pytest.raises(Exl3FormatError, match=f"model.layers.{n}.eh_proj.*plain torch Linear.*--load-format exl3"):
        c.get_quant_method(torch.nn.Identity(), f"model.layers.{n}.shared_head.head")
    c = config()
    c.get_quant_method(torch.nn.Identity(), f"model.layers.{n}.eh_proj")  # a draft whose eh_proj has a method
    c.get_quant_method(torch.nn.Identity(), f"model.layers.{n}.shared_head.head")
    monkeypatch.setattr(loader, "load_format_is_ours", lambda: True)  # --load-format exl3 hands it the dense weight
    config().get_quant_method(torch.nn.Identity(), f"model.layers.{n}.shared_head.head")

    # What that loader gives such a draft: the EXL3 module as torch's Linear holds it, weight [out, in] in the
    # parameter's dtype and computing what the format reference computes; modules the model quantizes stay EXL3.
    ckpt = Checkpoint(str(out))
    eh = f"model.layers.{n}.eh_proj"
    params = {f"{eh}.weight": torch.empty(256, 512, dtype=torch.float32),
              "model.layers.0.mlp.down_proj.trellis": torch.empty(0)}
    plain = loader.plain_linears(ckpt, params)
    assert list(plain) == [eh]
    dense = loader.dense_linear(ckpt, plain[eh], params[f"{eh}.weight"])
    assert list(dense) == [f"{eh}.weight"] and dense[f"{eh}.weight"].shape == (256, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    w = ckpt.weights(eh)
    want = linear(x, w.trellis, w.suh, w.svh, w.codebook)
    torch.testing.assert_close(x @ dense[f"{eh}.weight"].T, want.float(), rtol=1e-3, atol=1e-3)
