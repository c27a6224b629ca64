"""A/B of the few-row tiers' stage shapes in one module: h8 / h16 / i4 / i8 (16 k16 steps x 2 stages) against their
"k8" twins (8 x 4), forced fixed split-k, best split per side, fused input by the op's rule; CUDA graphs of calls on
rotating weight copies (bench_linear.py's method), 4-bit, bf16 x. The last column is the relative difference of the
two sides' outputs (a different k-warp partition of the steps, so not zero).

python bench/experiments/ab_stages.py --layers 4096x4096,28672x8192 --ms 1,4,8,16
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

os.environ["EXL3_VLLM_TUNE"] = "0"  # forced plans only: no load-time tuning
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from exl3_vllm.kernels import op as kop  # noqa: E402
from exl3_vllm.kernels.tune import graph_time_us  # noqa: E402
from bench_small_m_parts import layer_copies  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4096x4096,14336x4096,4096x14336,8192x28672,28672x8192")
    ap.add_argument("--ms", default="1,4,8,16")
    ap.add_argument("--splits", default="1,2,4,8,12,16")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ms = [int(v) for v in args.ms.split(",")]
    print("| layer | cb | M | tier | k8 twin (8x4) best µs (splits) | 16x2 best µs (splits) | speedup | "
          "rel. diff of outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.layers.split(","):
        k, n = map(int, spec.split("x"))
        if (k // 16) % 16:
            print(f"| {spec} | k is not a multiple of 256: only the k8 twins run there |")
            continue
        for cb in (2, 1):
            ts, suh, svh = layer_copies(k, n, 4, dev)
            kop.prepare(k, n, 4, cb, max(ms), dev)
            for m in ms:
                tiers = (["i4"] if m <= 4 else ["i8"] if m <= 8 else []) if cb == 2 else []
                tiers += ["h8" if m <= 8 else "h16"]
                x = torch.randn(m, k, device=dev).bfloat16()
                for tier in tiers:
                    best = {}
                    for name in (tier + "k8", tier):
                        top = max(1, (k // 16) // kop.TIERS[name].ks)
                        res = {}
                        for s in (int(v) for v in args.splits.split(",")):
                            if s <= top:
                                f = f"{name}:s{s}"
                                res[s] = graph_time_us([lambda t=t: kop.linear_cuda(x, t, suh, svh, None, [n], cb, force=f)
                                                        for t in ts], args.reps)
                        s_best = min(res, key=res.get)
                        out = kop.linear_cuda(x, ts[0], suh, svh, None, [n], cb, force=f"{name}:s{s_best}").float()
                        best[name] = (res[s_best], s_best, out)
                    a, b = best[tier + "k8"], best[tier]
                    diff = ((a[2] - b[2]).norm() / a[2].norm()).item()
                    print(f"| {spec} | {'mul1' if cb == 2 else 'mcg'} | {m} | {tier} | {a[0]:.2f} (s{a[1]}) | "
                          f"{b[0]:.2f} (s{b[1]}) | {a[0] / b[0]:.3f}x | {diff:.1e} |", flush=True)
            del ts
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
