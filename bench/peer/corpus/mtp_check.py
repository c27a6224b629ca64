"""A converted checkpoint's MTP draft on vLLM's CPU engine (issue 46): greedy output with the draft against without
it (where they part, the undrafted engine's log-probability gap between the two tokens: under bf16's tie margin is
a near tie, as in the gate), and the draft's acceptance, on held-out text (here, no GPU).

    .venv/bin/python bench/peer/corpus/mtp_check.py --ckpt DIR/exl3/qwen3.5-mtp-b4 \\
        --heldout .peer/src/exllamav3/conversion/standard_cal_data [--spec-tokens 1,2] [--prompts 16] [--tokens 32]

Prompts: consecutive held-out windows (make_models.py's split, the checkpoint's tokenizer). Acceptance is vLLM's
spec-decode counters: accepted draft tokens over drafted ones, and tokens per verification step (1 + accepted per
draft). `--alone` also generates each prompt by itself in the same engines (concurrency 1 beside the batch of all
prompts, as the issue's exactness contract asks), and adds the floor as a row with 0 draft tokens: the undrafted
engine's batch against its own lone runs. Prints one JSON line per draft length. DeepSeek-style MTP layers
(num_nextn_predict_layers: GLM-4-MoE-Lite) load through `--load-format exl3` in every engine (draft_args).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "tests"))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "serve_gpu"))

from cpu_check import heldout_windows  # noqa: E402
from engine import finish, results, run_engine, start_engine, stubs_env  # noqa: E402
from kit_args import kit_llm_args  # noqa: E402
from test_real_checkpoints import TIE  # noqa: E402


def draft_args(cfg: dict) -> dict:
    """vLLM's DeepSeek-style drafts build eh_proj as a plain torch Linear: the plugin serves an EXL3 one only through
    its load format, which passes every other tensor through as vLLM's default loader does (so the undrafted engines
    take it too, and load the same weights)."""
    return {"load_format": "exl3"} if cfg.get("num_nextn_predict_layers") else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--spec-tokens", default="1,2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--alone", action="store_true", help="also each prompt alone (c=1), compared the same way")
    ap.add_argument("--csv", help="also write the rows here")
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.ckpt, "config.json")))
    windows = heldout_windows(a.heldout, a.ckpt, n=a.prompts, width=a.prompt_len)
    prompts = [{"prompt_token_ids": w} for w in windows]
    base = {"enable_prefix_caching": False, "max_num_seqs": a.prompts, "max_model_len": a.prompt_len + a.tokens + 16,
            **kit_llm_args(cfg), **draft_args(cfg)}
    env = stubs_env()
    gen = {**base, "one_at_a_time": a.alone}
    spec = {k: start_engine(a.ckpt, "bfloat16", prompts, a.tokens, env=env,
                            extra={**gen, "speculative_config": {"method": "mtp", "num_speculative_tokens": k}})
            for k in map(int, a.spec_tokens.split(","))}
    plain = results(run_engine(a.ckpt, "bfloat16", prompts, a.tokens, env=env, extra=gen))
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]

    def first_diff(x, y):
        return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))

    def compare(ref_key, got, got_key, tag):
        """Where each request parts from the undrafted one: the first differing token, and there the two tokens'
        log-probability gap in the undrafted engine (under bf16's tie margin is a near tie, as in the gate)."""
        same = [first_diff(p[ref_key], g[got_key]) for p, g in zip(plain, got)]
        parted = [(p, g, i) for p, g, i in zip(plain, got, same) if i < a.tokens]
        m = []
        if parted:
            seqs = [{"prompt_token_ids": p["prompt_ids"] + p[ref_key][:i + 1]} for p, _, i in parted]
            dists = results(run_engine(a.ckpt, "bfloat16", seqs, 1, env=env,
                                       extra={**base, "full_prompt_logprobs": vocab}))
            for (p, g, i), d in zip(parted, dists):
                row = dict(map(tuple, d["prompt_dists"][-1]))
                m.append(round(row[p[ref_key][i]] - row[g[got_key][i]], 4))
        return {f"identical_requests{tag}": len(same) - len(parted), f"first_difference{tag}": [i for *_, i in parted],
                f"margin_there{tag}": m, f"beyond_tie{tag}": sum(x >= TIE["bfloat16"] for x in m)}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    name = os.path.basename(a.ckpt.rstrip("/"))
    rows = []
    if a.alone:
        # The floor: the undrafted engine against itself, all prompts together against each alone (batch shapes
        # alone change the sums' order).
        rows.append({"ckpt": name, "spec_tokens": 0, "prompts": len(prompts), "tokens_each": a.tokens,
                     **compare("tokens", plain, "alone_tokens", ""), "commit": commit})
        print(json.dumps(rows[-1]), flush=True)
    for k, proc in spec.items():
        got = results(finish(proc))
        c = got[0].get("spec_decode", {})
        drafts, drafted = c.get("vllm:spec_decode_num_drafts", 0), c.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
        row = {"ckpt": name, "spec_tokens": k, "prompts": len(prompts), "tokens_each": a.tokens,
               **compare("tokens", got, "tokens", "")}
        if a.alone:
            row.update(compare("alone_tokens", got, "alone_tokens", "_alone"))
        # Acceptance counts every request the engine ran (with --alone, the batch and the lone runs together).
        row.update({"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
                    "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                    "tokens_per_step": round(1 + accepted / drafts, 3) if drafts else None, "commit": commit})
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, list(rows[-1]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
