"""Real vLLM (CPU build) serving synthetic EXL3 checkpoints, against a dense oracle.

The oracle is HF transformers running the --also-dense twin: the same network
with the reconstructed weights, unquantized.
"""

import json
import os
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine import finish, results, run_engine, start_engine  # noqa: E402
from exl3_vllm.synth import synthesize  # noqa: E402

PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30", "w5 w600 w7 w8 w9 w10 w11", "w999 w3"]
MAX_TOKENS = 16
# Mixed per-module bits, fused shards of different K and codebook (as exllamav3's allocator writes them), a
# half-integer K and a 6-bit head.
BITS_MAP = {
    "model.layers.0.self_attn.q_proj": 3,
    "model.layers.0.self_attn.[kv]_proj": 4,
    "model.layers.0.self_attn.o_proj": 2.5,
    "model.layers.0.mlp.gate_proj": 6,
    "model.layers.0.mlp.up_proj": {"bits": 5, "codebook": "mcg"},
    "model.layers.0.mlp.down_proj": 2,
    "model.layers.1.self_attn.[qkv]_proj": 8,
    "model.layers.1.self_attn.o_proj": 4,
    "model.layers.1.mlp.*": 4,
}


def run_vllm(model, dtype, tp=1, check=True):
    proc = run_engine(model, dtype, PROMPTS, MAX_TOKENS, tp)
    return results(proc) if check else proc


def hf_oracle(dense_dir, prompt_ids, tokens, dtype):
    """Teacher-forced logits of the dense twin over prompt + generated tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(dense_dir, dtype=dtype)
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits, -1)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def model_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    bits_map = root / "bits.json"
    bits_map.write_text(json.dumps(BITS_MAP))
    q, d = str(root / "exl3"), str(root / "dense")
    # A quantized token embedding (exllamav3's --embed_bits); the dense twin holds its decoded table.
    synthesize(request.param, q, bits=4, head_bits=6, bits_map=str(bits_map), seed=1, also_dense=d,
               dense_dtype="float32", embed_bits=4)
    # Both dtypes' engines at once: start-up is mostly one core's work, so the two overlap.
    bf16 = start_engine(q, "bfloat16", PROMPTS, MAX_TOKENS)
    runs = {"float32": run_vllm(q, "float32"), "bfloat16": results(finish(bf16))}
    return q, d, runs


def test_greedy_tokens_and_prompt_logprobs_match_dense_oracle_fp32(model_pair):
    q, d, runs = model_pair
    for res in runs["float32"]:
        lp = hf_oracle(d, res["prompt_ids"], res["tokens"], torch.float32)
        n = len(res["prompt_ids"])
        oracle_tokens = []
        ids = list(res["prompt_ids"])
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS)
        oracle_tokens = out[0, n:].tolist()
        assert res["tokens"] == oracle_tokens
        # Prompt logprobs: vLLM's logprob of each prompt token vs the oracle's, fp32 tolerance.
        want = [lp[i - 1, t].item() for i, t in enumerate(res["prompt_ids"]) if i > 0]
        got = res["prompt_logprobs"]
        assert all(g is not None for g in got)
        assert max(abs(a - b) for a, b in zip(got, want)) < 2e-3


def test_bf16_tokens_match_until_a_near_tie(model_pair):
    q, d, runs = model_pair
    tol = 0.1  # bf16 logit noise bound; tokens are compared only while the oracle's top-2 margin exceeds it
    for res in runs["bfloat16"]:
        n = len(res["prompt_ids"])
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        ids = torch.tensor([res["prompt_ids"] + res["tokens"]])
        with torch.no_grad():
            logits = model(ids).logits[0]
        for i, tok in enumerate(res["tokens"]):
            row = logits[n - 1 + i]
            top2 = torch.topk(row, 2)
            margin = (top2.values[0] - top2.values[1]).item()
            if margin < tol:
                break
            assert tok == int(top2.indices[0]), f"token {i}: vLLM {tok}, oracle {int(top2.indices[0])}"


def test_malformed_checkpoint_fails_fast_with_our_message(tmp_path):
    q = str(tmp_path / "bad")
    synthesize("tiny-llama", q, bits=4, seed=4)
    qc = json.load(open(os.path.join(q, "quantization_config.json")))
    key = "model.layers.1.mlp.down_proj"
    qc["tensor_storage"][key]["bits_per_weight"] = 3
    json.dump(qc, open(os.path.join(q, "quantization_config.json"), "w"))
    t0 = time.time()
    proc = run_engine(q, "bfloat16", PROMPTS[:1], 4, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "quantization_config.json" in out and key in out and "bits_per_weight 3 but the trellis holds 4" in out
    assert time.time() - t0 < 120
    # Our one line comes before any traceback.
    ours = proc.stderr.find("EXL3 checkpoint error:")
    assert ours != -1 and (proc.stderr.find("Traceback") == -1 or ours < proc.stderr.find("Traceback")), \
        proc.stderr[:3000]


def test_unquantized_head_stored_padded_loads_and_matches_the_oracle(tmp_path):
    from exl3_vllm.synth import load_config

    # exllamav3 -hb 16 stores the head padded to a multiple of 128 rows; vLLM's loader wants the vocabulary.
    cfg = dict(load_config("tiny-llama"), vocab_size=1000)
    q, d = str(tmp_path / "q"), str(tmp_path / "d")
    synthesize(cfg, q, bits=4, head_bits=16, seed=8, also_dense=d, dense_dtype="float32")
    res = run_vllm(q, "float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    for r in res:
        with torch.no_grad():
            out = model.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS)
        assert r["tokens"] == out[0, len(r["prompt_ids"]):].tolist()


def test_sliced_mlp_and_quantized_embedding_match_the_oracle_and_tp2_equals_tp1(tmp_path):
    """exllamav3 stores MLPs wider than 55,296 as `.slice.N` modules (gate/up along their outputs, down along its
    inputs); here a small one sliced in three (512 columns each, exllamav3's split rule) with mixed K and codebook,
    beside a 5-bit quantized embedding and a 6-bit head: the engine joins the slices and matches the unsliced dense
    twin; at tensor_parallel_size 2 each rank takes its part (rank 0 all of slice 0 and half of slice 1; half the
    embedding's rows; 128 of k/v's 256 columns) and the replies equal TP=1's."""
    from exl3_vllm.synth import load_config

    cfg = dict(load_config("tiny-llama"), intermediate_size=1536, num_key_value_heads=4)  # k/v split at TP=2
    q, d = str(tmp_path / "q"), str(tmp_path / "d")
    synthesize(cfg, q, bits=4, head_bits=6, seed=9, also_dense=d, dense_dtype="float32", mlp_slices=3, embed_bits=5,
               bits_map={"model.layers.0.mlp.down_proj": 3, "model.layers.1.mlp.gate_proj": {"bits": 5, "codebook": "mcg"},
                         "model.layers.1.self_attn.q_proj": 5, "model.layers.0.self_attn.*": 3})
    tp2_proc = start_engine(q, "float32", PROMPTS, MAX_TOKENS, tp=2)  # beside TP=1's engine (see model_pair)
    tp1 = run_vllm(q, "float32")
    for r in tp1:
        # Teacher-forced (this random model's greedy path runs into EOS, which generate(min_new_tokens) forbids).
        lp = hf_oracle(d, r["prompt_ids"], r["tokens"], torch.float32)
        n = len(r["prompt_ids"])
        want = [lp[i - 1, t].item() for i, t in enumerate(r["prompt_ids"]) if i > 0]
        assert max(abs(a - b) for a, b in zip(r["prompt_logprobs"], want)) < 2e-3
        for i, tok in enumerate(r["tokens"]):
            top2 = torch.topk(lp[n - 1 + i], 2)
            assert tok == int(top2.indices[0]) or (top2.values[0] - top2.values[1]).item() < 1e-4, (i, tok)
    tp2 = results(finish(tp2_proc))
    for a, b in zip(tp1, tp2):
        assert a["tokens"] == b["tokens"]
        assert max(abs(x - y) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"])) < 1e-4


def test_compiled_graph_cache_key_follows_the_tensor_layout(tmp_path):
    """vLLM reuses a compiled graph by a hash of its config, and the graph bakes in each layer's K, codebook and
    slicing. Conversions into one directory with one config.json (the same average bits) (found on the GPU: the sliced model loaded
    the unsliced one's graph and failed): each gets its own key, and a rewrite of the same one keeps its key."""
    import shutil

    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    from exl3_vllm.synth import load_config

    load_general_plugins()
    cfg, path = dict(load_config("tiny-llama"), intermediate_size=1536), str(tmp_path / "ckpt")
    layouts = {"plain": {}, "same again": {}, "sliced": {"mlp_slices": 3},
               "K moved": {"bits_map": {"model.layers.0.mlp.down_proj": 3, "model.layers.0.mlp.up_proj": 5}},
               "one codebook": {"bits_map": {"model.layers.0.mlp.down_proj": {"bits": 4, "codebook": "mcg"}}}}
    keys, configs = {}, set()
    for name, kw in layouts.items():
        shutil.rmtree(path, ignore_errors=True)
        synthesize(cfg, path, bits=4, seed=1, **kw)
        configs.add(open(os.path.join(path, "config.json")).read())
        keys[name] = EngineArgs(model=path, dtype="float32", max_model_len=256).create_engine_config().compute_hash()
    assert len(configs) == 1  # config.json alone would give them one key
    assert keys["plain"] == keys["same again"]
    assert len({keys[n] for n in ("plain", "sliced", "K moved", "one codebook")}) == 4, keys


@pytest.mark.parametrize("tensor,word", [("model.layers.0.self_attn.k_proj.suh", 5),  # channel 5
                                         ("model.embed_tokens.trellis", None)])  # a row's group scale
def test_non_finite_scales_are_refused_at_load(tensor, word, tmp_path):
    """A NaN scale, written into the file after conversion, stops the engine at load, naming the tensor."""
    from exl3_vllm.format.checkpoint import Checkpoint

    q = str(tmp_path / "nan")
    synthesize("tiny-llama", q, bits=4, seed=5, embed_bits=4)
    info = Checkpoint(q).tensors[tensor]
    if word is None:  # the quantized embedding: row 7's first group starts with its fp16 scale word
        word = 7 * info.shape[1]
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 2 * word)
        f.write(bytes([0x00, 0x7E]))  # fp16 NaN
    proc = run_engine(q, "float32", PROMPTS[:1], 4, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and tensor in out and "NaN or Inf" in out, out[-3000:]


def test_128_rule_fails_fast_at_tensor_parallel_2(tmp_path):
    bad = str(tmp_path / "tp_bad")
    synthesize("tiny-llama", bad, bits=4, seed=6)  # k/v are 128 wide: 64 per rank at TP=2
    t0 = time.time()
    proc = run_vllm(bad, "float32", tp=2, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "k_proj" in out and "multiples of 128" in out and "tensor_parallel_size in [1]" in out, out[-3000:]
    assert time.time() - t0 < 240
