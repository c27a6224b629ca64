"""GLM-4-MoE-Lite (GLM-4.7-Flash's layout: multi-head latent attention, a dense first layer, routed experts with a
shared one) with EXL3 linears on vLLM's CPU engine, against its dense twin in transformers (fp32); and its
DeepSeek-style EXL3 MTP layer as vLLM's speculative draft, whose eh_proj vLLM builds as a plain torch Linear: served
with `--load-format exl3` (plugin/loader.py), refused with what to do without it (issue 46). The checkpoint's layout
is exllamav3 1.6.5's for this class (synth/plan.py: kv_a padded to 640 columns, kv_b_proj fp16, the MTP layer at
num_hidden_layers). vLLM's CPU MLA backends run bf16 with a 576-wide latent, as the preset has."""
import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine import run_engine  # noqa: E402
from mtp_contract import PROMPTS, check_dense_twin, check_mtp_contract, engine_pair  # noqa: E402
from exl3_vllm.synth import synthesize  # noqa: E402

TOKENS = 16
VOCAB = 1024  # the tiny presets' vocabulary
SPEC = {"method": "mtp", "num_speculative_tokens": 2}
ENGINE = {"max_num_seqs": len(PROMPTS)}
SHARPEN = 2.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Seed 1: the model with its MTP layer (outside tensor_storage, as exllamav3 writes it); seed 2: an unrelated
    model of the same shape."""
    root = tmp_path_factory.mktemp("glm4-moe-lite")
    out = {}
    for seed in (1, 2):
        synthesize("tiny-glm4-moe-lite", str(root / f"exl3-{seed}"), bits=4, head_bits=6, seed=seed,
                   also_dense=str(root / f"dense-{seed}"), dense_dtype="float32")
        out[seed] = (str(root / f"exl3-{seed}"), str(root / f"dense-{seed}"))
        for d in out[seed]:
            sharpen(d)
    return out


def sharpen(ckpt, factor=SHARPEN):
    """The final norms' weights (the model's and the MTP layer's shared head's) times factor, alike in the EXL3
    checkpoint and its twin: logits `factor` times wider. As synthesized, this model's next-token distributions are
    nearly flat (an unrelated model within KL 0.1), so nearly every greedy step is a tie and the greedy check would
    see little."""
    from safetensors.torch import load_file, save_file

    names = {"model.norm.weight", "model.layers.3.shared_head.norm.weight"}
    index = json.load(open(f"{ckpt}/model.safetensors.index.json"))["weight_map"]
    for file in {index[n] for n in names}:
        sd = load_file(f"{ckpt}/{file}")
        for n in names & set(sd):
            sd[n] = sd[n] * factor
        save_file(sd, f"{ckpt}/{file}", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def engines(models):
    return engine_pair(models[1][0], SPEC, TOKENS, VOCAB, ENGINE, spec_extra={"load_format": "exl3"})


def test_latent_attention_moe_model_matches_its_dense_twin_bf16(models, engines):
    check_dense_twin(models, engines[0], VOCAB)


def test_mtp_speculation_changes_no_greedy_token(models, engines):
    check_mtp_contract(models, engines, VOCAB)


def test_without_the_exl3_load_format_the_draft_is_refused_with_what_to_do(models):
    ckpt = models[1][0]
    n = json.load(open(f"{ckpt}/config.json"))["num_hidden_layers"]
    proc = run_engine(ckpt, "bfloat16", PROMPTS[:1], 2, extra={"speculative_config": SPEC}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"model.layers.{n}.eh_proj" in out and "--load-format exl3" in out, out[-3000:]
