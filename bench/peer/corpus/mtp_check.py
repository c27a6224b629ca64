"""A converted checkpoint's MTP draft on vLLM's CPU engine (issue 46): greedy output with the draft against without
it (where they part, the undrafted engine's log-probability gap between the two tokens: under bf16's tie margin is
a near tie, as in the gate), and the draft's acceptance, on held-out text (here, no GPU).

    .venv/bin/python bench/peer/corpus/mtp_check.py --ckpt DIR/exl3/qwen3.5-mtp-b4 \\
        --heldout .peer/src/exllamav3/conversion/standard_cal_data [--spec-tokens 1,2] [--prompts 16] [--tokens 32]

Prompts: consecutive held-out windows (make_models.py's split, the checkpoint's tokenizer). Acceptance is vLLM's
spec-decode counters: accepted draft tokens over drafted ones, and tokens per verification step (1 + accepted per
draft). Prints one JSON line per draft length.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--spec-tokens", default="1,2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--csv", help="also write the rows here")
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.ckpt, "config.json")))
    windows = heldout_windows(a.heldout, a.ckpt, n=a.prompts, width=a.prompt_len)
    prompts = [{"prompt_token_ids": w} for w in windows]
    base = {"enable_prefix_caching": False, "max_num_seqs": a.prompts, "max_model_len": a.prompt_len + a.tokens + 16,
            **kit_llm_args(cfg)}
    env = stubs_env()
    spec = {k: start_engine(a.ckpt, "bfloat16", prompts, a.tokens, env=env,
                            extra={**base, "speculative_config": {"method": "mtp", "num_speculative_tokens": k}})
            for k in map(int, a.spec_tokens.split(","))}
    plain = results(run_engine(a.ckpt, "bfloat16", prompts, a.tokens, env=env, extra=base))
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    rows = []
    for k, proc in spec.items():
        got = results(finish(proc))
        # Where a request parts from the undrafted one: the two tokens' log-probabilities there (undrafted engine).
        parted = [(p, g, next(i for i, (x, y) in enumerate(zip(p["tokens"], g["tokens"])) if x != y))
                  for p, g in zip(plain, got) if p["tokens"] != g["tokens"]]
        margins = []
        if parted:
            seqs = [{"prompt_token_ids": p["prompt_ids"] + p["tokens"][:i + 1]} for p, _, i in parted]
            dists = results(run_engine(a.ckpt, "bfloat16", seqs, 1, env=env,
                                       extra={**base, "full_prompt_logprobs": vocab}))
            for (p, g, i), d in zip(parted, dists):
                row = dict(map(tuple, d["prompt_dists"][-1]))
                margins.append(round(row[p["tokens"][i]] - row[g["tokens"][i]], 4))
        c = got[0].get("spec_decode", {})
        drafts, drafted = c.get("vllm:spec_decode_num_drafts", 0), c.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
        same = [next((i for i, (x, y) in enumerate(zip(p["tokens"], g["tokens"])) if x != y), len(p["tokens"]))
                for p, g in zip(plain, got)]
        rows.append({"ckpt": os.path.basename(a.ckpt.rstrip("/")), "spec_tokens": k, "prompts": len(prompts),
                     "tokens_each": a.tokens, "identical_requests": sum(s == a.tokens for s in same),
                     "first_difference": [s for s in same if s < a.tokens], "margin_there": margins,
                     "beyond_tie": sum(m >= TIE["bfloat16"] for m in margins), "drafts": drafts,
                     "draft_tokens": drafted, "accepted_tokens": accepted,
                     "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                     "tokens_per_step": round(1 + accepted / drafts, 3) if drafts else None, "commit": commit})
        print(json.dumps(rows[-1]), flush=True)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
