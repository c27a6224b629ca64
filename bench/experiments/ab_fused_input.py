"""A/B of h8 / h16 transforming their own x (the "fx" twins) against the input-transform kernel, on the same plan:
the measured dispatch's plan per (layer, codebook, M), plus forced plans; every time is a CUDA graph of calls on
rotating weight copies (bench_linear.py's method), 4-bit, bf16 x.

python bench/experiments/ab_fused_input.py --layers 4096x4096,14336x4096 --ms 1,4 --forced h8:s4@1,h8:s8@4
Forced plans (PLAN@M) are fused wherever their x fits (EXL3_VLLM_FUSED_INPUT=all); the tuned ones under the
op's rule. "blocks; pieces per slot": the grid and the (row, 128-k chunk) pieces of x transformed per resident block.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from exl3_vllm.kernels import op as kop  # noqa: E402
from exl3_vllm.kernels.tune import graph_time_us  # noqa: E402
from bench_small_m_parts import layer_copies  # noqa: E402
from decode_floor import decode_floor  # noqa: E402

NAMES = {0: "3inst", 1: "mcg", 2: "mul1"}


def _set(value):
    if value is None:
        os.environ.pop("EXL3_VLLM_FUSED_INPUT", None)
    else:
        os.environ["EXL3_VLLM_FUSED_INPUT"] = value


def with_env(value, f):
    """f() with EXL3_VLLM_FUSED_INPUT set to value (None: unset), then what was there before."""
    old = os.environ.get("EXL3_VLLM_FUSED_INPUT")
    _set(value)
    try:
        return f()
    finally:
        _set(old)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--codebooks", default="2,1", help="0/1/2 = 3inst/mcg/mul1")
    ap.add_argument("--forced", default="", help="PLAN@M, e.g. h8:s4@1,h16:s8@16")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ms = [int(v) for v in args.ms.split(",")]
    forced = [f.split("@") for f in args.forced.split(",") if f]
    d = kop.device_for(0)
    rule = os.environ.get("EXL3_VLLM_FUSED_INPUT")  # the op's rule as set for this run (tuning and tuned rows)
    print("| layer | cb | M | plan | blocks; pieces per slot | fused µs | separate µs | gain µs | decode-only µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.layers.split(","):
        k, n = map(int, spec.split("x"))
        for cb in map(int, args.codebooks.split(",")):
            ts, suh, svh = layer_copies(k, n, 4, dev)
            kop.prepare(k, n, 4, cb, max(ms), dev)
            dec = graph_time_us([lambda t=t: decode_floor(t, cb) for t in ts], args.reps)
            for m in ms:
                x = torch.randn(m, k, device=dev).bfloat16()
                p = kop.plan_for(d, m, k, n, 4, cb, [n])
                rows = [] if p.path != "gemm" or p.stream else [(f"tuned {p.tier}:s{p.splits}", p, None)]
                for f, fm in forced:
                    if int(fm) == m:
                        rows.append((f, kop.plan(m, k, n, 4, d.sms, d.smem_limit, cb, d.arch, n, f), "all"))
                for label, pp, mode in rows:
                    tier = kop.TIERS[pp.tier]
                    force = f"{pp.tier}:s{pp.splits}"
                    fx = with_env(mode or rule, lambda: kop.fused_input(tier, pp, m, n, 4, d.sms, d.smem_limit))
                    if not fx:
                        print(f"| {spec} | {NAMES[cb]} | {m} | {label} (not fused) | | | | | {dec:.2f} |", flush=True)
                        continue
                    calls = lambda: [lambda t=t: kop.linear_cuda(x, t, suh, svh, None, [n], cb, force=force)  # noqa
                                     for t in ts]
                    fused = with_env("all", lambda: graph_time_us(calls(), args.reps))
                    sep = with_env("0", lambda: graph_time_us(calls(), args.reps))
                    blocks, pieces = kop.fused_input_work(tier, pp, m, n)
                    per_slot = blocks * pieces / (2 * d.sms)
                    print(f"| {spec} | {NAMES[cb]} | {m} | {label} | {blocks}; {per_slot:.1f} | {fused:.2f} | "
                          f"{sep:.2f} | {sep - fused:+.2f} | {dec:.2f} |", flush=True)
            del ts
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
