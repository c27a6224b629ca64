"""synth --config-only: the unquantized twin's config and tokenizer, no weights (vLLM --load-format dummy)."""

import json
import os

import pytest

from exl3_vllm.cli import main as cli_main
from exl3_vllm.format.errors import Exl3FormatError
from exl3_vllm.synth import synthesize, write_config_only


def test_config_only_matches_the_exl3_config(tmp_path):
    q, d = tmp_path / "q", tmp_path / "d"
    synthesize("tiny-llama", q, bits=4, seed=1)
    write_config_only("tiny-llama", d)
    assert sorted(os.listdir(d)) == ["config.json", "generation_config.json", "special_tokens_map.json",
                                     "tokenizer.json", "tokenizer_config.json"]
    cq, cd = json.load(open(q / "config.json")), json.load(open(d / "config.json"))
    assert "quantization_config" not in cd and cd["torch_dtype"] == "bfloat16"
    cq.pop("quantization_config")
    assert {k: v for k, v in cq.items() if k != "torch_dtype"} == {k: v for k, v in cd.items() if k != "torch_dtype"}
    assert open(q / "tokenizer.json").read() == open(d / "tokenizer.json").read()


def test_config_only_cli(tmp_path):
    out = tmp_path / "m"
    assert cli_main(["synth", "--config", "llama-3-8b", "--config-only", "--out", str(out)]) == 0
    cfg = json.load(open(out / "config.json"))
    assert cfg["hidden_size"] == 4096 and cfg["num_hidden_layers"] == 32 and cfg["tie_word_embeddings"] is False
    assert not [f for f in os.listdir(out) if f.endswith(".safetensors")]
    with pytest.raises(Exl3FormatError, match="not empty"):
        write_config_only("llama-3-8b", out)
    write_config_only("llama-3-8b", out, "float32", overwrite=True)
    assert json.load(open(out / "config.json"))["torch_dtype"] == "float32"
