"""One forced tier on one layer shape, a few calls: the target for ncu / nsys (no timing of its own).

ncu -k regex:exl3_gemm_x64 -c 1 --section WarpStateStats python bench/experiments/profile_tier.py --tier x64 --m 16
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from exl3_vllm.kernels import op as kop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", required=True)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--layer", default="8192x28672")
    ap.add_argument("--bits", type=float, default=4)
    ap.add_argument("--cb", type=int, default=2)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    k, n = (int(v) for v in args.layer.split("x"))
    dev = torch.device("cuda")
    w = int(16 * args.bits) if args.bits == int(args.bits) else 16 * int(args.bits) + 8
    tr = torch.randint(-32768, 32768, (k // 16, n // 16, w), dtype=torch.int16, device=dev)
    suh = ((torch.rand(k, device=dev) + 0.5) * 0.05).half()
    svh = ((torch.rand(n, device=dev) + 0.5) * 0.05).half()
    x = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
    y = torch.empty(args.m, n, device=dev, dtype=torch.bfloat16)
    for _ in range(args.calls):
        kop.linear_cuda(x, tr, suh, svh, None, [n], args.cb, out=y, force=args.tier)
    torch.cuda.synchronize()
    print(kop.plan(args.m, k, n, args.bits, torch.cuda.get_device_properties(0).multi_processor_count,
                   codebook=args.cb, arch=90, force=args.tier))


if __name__ == "__main__":
    main()
