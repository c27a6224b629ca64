"""The fidelity gate's vLLM side: vLLM + exl3-vllm on each converted checkpoint, teacher-forced and greedy.

    python3 bench/peer/corpus/gate_vllm.py --corpus /tmp/corpus/exl3 --ref /tmp/corpus/ref --out /tmp/corpus/gate \
        [--dtypes float16,bfloat16] [--names a,b] [--parallel 3] [--eager] [--follow /tmp/corpus/DONE]

Per checkpoint and dtype, one child process runs one engine (our kernels; CUDA graphs for decode batches unless
--eager) and saves OUT/<name>-<dtype>.pt:
- "prompt_logprobs": fp32 [T - 1, vocab], vLLM's full distribution for every token of the held-out sequence
  (REF/tokens.pt, the one exllamav3 saw), from prompt logprobs over the whole vocabulary;
- "greedy": 16 prompts (held-out windows of 128 tokens after the teacher-forced part) and 32 greedy tokens each,
  generated together (decode batches of up to 16 rows).
compare.py (exllamav3 side) turns these into KL and top-1 against exllamav3.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "serve_gpu"))
from kit_args import kit_llm_args  # noqa: E402

GREEDY_PROMPTS, GREEDY_LEN, GREEDY_TOKENS = 16, 128, 32


def greedy_prompts(tokens: list[int], start: int, bos: int) -> list[list[int]]:
    return [[bos] + tokens[start + i * GREEDY_LEN: start + (i + 1) * GREEDY_LEN - 1] for i in range(GREEDY_PROMPTS)]


def child(model: str, dtype: str, ref: str, out: str, eager: bool) -> None:
    import torch
    from vllm import LLM, SamplingParams

    ids = torch.load(os.path.join(ref, "tokens.pt")).tolist()
    extra = json.load(open(os.path.join(ref, "greedy_tokens.json")))
    cfg = json.load(open(os.path.join(model, "config.json")))
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]  # multimodal configs nest it
    kw = {"enforce_eager": True} if eager else {"compilation_config": {
        "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}}
    kw.update(kit_llm_args(cfg))
    t0 = time.time()
    # Engines share the GPU with each other and with the conversions: a fixed KV cache skips vLLM's memory profiling,
    # which fails when another process frees memory meanwhile ("Error in memory profiling").
    llm = LLM(model=model, dtype=dtype, max_model_len=len(ids) + 64, max_logprobs=vocab, seed=0,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=512 << 20, max_num_seqs=GREEDY_PROMPTS,
              enable_prefix_caching=False, **kw)
    t_init = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=vocab, detokenize=False)
    res = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    lp = torch.full((len(ids) - 1, vocab), float("-inf"))
    for t, row in enumerate(res.prompt_logprobs[1:]):
        tok = torch.tensor(list(row.keys()), dtype=torch.long)
        lp[t, tok] = torch.tensor([v.logprob for v in row.values()])
    t_prompt = time.time() - t0 - t_init
    prompts = greedy_prompts(extra["tokens"], 0, ids[0])
    gp = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], gp, use_tqdm=False)
    greedy = [{"prompt": p, "tokens": list(o.outputs[0].token_ids)} for p, o in zip(prompts, outs)]
    torch.save({"prompt_logprobs": lp, "greedy": greedy, "init_s": t_init, "prompt_s": t_prompt,
                "eager": eager, "dtype": dtype}, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus")
    ap.add_argument("--ref")
    ap.add_argument("--out")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--names", default="")
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--deadline", type=float, default=0, help="unix time after which no new engine starts")
    ap.add_argument("--follow", default="", help="poll REF/ex3.json for new checkpoints until this file exists")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "DTYPE", "REF", "OUT"))
    a = ap.parse_args()
    if a.child:
        child(*a.child, eager=a.eager)
        return
    os.makedirs(a.out, exist_ok=True)
    dtypes = a.dtypes.split(",")

    def ready() -> list[str]:
        rec = os.path.join(a.ref, "ex3.json")
        done = json.load(open(rec)) if os.path.exists(rec) else []
        return a.names.split(",") if a.names else [r["name"] for r in done if "error" not in r]

    def run(job):
        name, dtype = job
        if a.deadline and time.time() > a.deadline:
            return {"name": name, "dtype": dtype, "rc": "skipped (deadline)"}
        path = os.path.join(a.out, f"{name}-{dtype}.pt")
        log = os.path.join(a.out, f"{name}-{dtype}.log")
        if os.path.exists(path):
            return {"name": name, "dtype": dtype, "rc": 0, "seconds": 0, "resumed": True}
        t = time.time()
        with open(log, "w") as f:
            rc = subprocess.call([sys.executable, __file__, "--child", os.path.join(a.corpus, name), dtype, a.ref, path]
                                 + (["--eager"] if a.eager else []), stdout=f, stderr=subprocess.STDOUT)
        r = {"name": name, "dtype": dtype, "rc": rc, "seconds": round(time.time() - t, 1)}
        if rc:
            with open(log) as f:
                tail = [ln.rstrip() for ln in f.readlines() if ln.strip()][-3:]
            r["error"] = " | ".join(tail)[-600:]
        print("[gate]", json.dumps(r), flush=True)
        return r

    # --follow FLAG: keep taking checkpoints as exllamav3's references land (pipeline.sh), until FLAG exists.
    with ThreadPoolExecutor(a.parallel) as pool:
        futs, queued = [], set()
        while True:
            final = not a.follow or os.path.exists(a.follow)
            for job in ((n, d) for n in ready() for d in dtypes):
                if job not in queued:
                    queued.add(job)
                    futs.append(pool.submit(run, job))
            if final or (a.deadline and time.time() > a.deadline):
                break
            time.sleep(5)
        rows = [f.result() for f in futs]
    rows = [r for r in rows if r["rc"] != "skipped (deadline)"]
    with open(os.path.join(a.out, "gate_runs.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
