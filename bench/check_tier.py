"""Quick check of forced tiers against the format reference on one small fused layer, before the full GPU tests.

python bench/check_tier.py --tiers x64,x256   (exit 1 on any error above tolerance or a kernel error; run it under
`timeout` so a hang in a new pipeline cannot eat a device call)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from exl3_vllm.format.linear import linear as ref_linear  # noqa: E402
from exl3_vllm.kernels import op as kop  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", required=True)
    ap.add_argument("--ms", default="1,37,64,129,256,300")
    ap.add_argument("--tol", type=float, default=3e-3)
    ap.add_argument("--sizes", default="256,384", help="shard widths of the fused layer (256-column tiers need multiples of 256)")
    ap.add_argument("--configs", default="4:2,3:1,2.5:2,8:0", help="K:codebook pairs (codebook 0/1/2 = 3inst/mcg/mul1)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    os.environ["EXL3_VLLM_TUNE"] = "0"
    g = torch.Generator(device=dev).manual_seed(1)
    bad = 0
    for bits, cb in ((float(c.split(":")[0]), int(c.split(":")[1])) for c in args.configs.split(",")):
        bits = int(bits) if bits == int(bits) else bits
        k, sizes = 2048, [int(v) for v in args.sizes.split(",")]
        n = sum(sizes)
        w = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
        tr = torch.randint(-32768, 32768, (k // 16, n // 16, w), dtype=torch.int16, device=dev, generator=g)
        suh = ((torch.rand(2, k, device=dev, generator=g) + 0.5) * 0.05).half()
        svh = ((torch.rand(n, device=dev, generator=g) + 0.5) * 0.05).half()
        bias = (torch.randn(n, device=dev, generator=g) * 0.1).half()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            ref = ref_linear(x.float(), tr, suh, svh, cb, bias=bias, shard_sizes=sizes, out_dtype=torch.float32)
            for t in args.tiers.split(","):
                y = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                try:
                    kop.linear_cuda(x, tr, suh, svh, bias, sizes, cb, out=y, force=t)
                    torch.cuda.synchronize()
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                except Exception as e:  # noqa: BLE001 - report every tier, then fail
                    print(f"{t:6s} K={bits:<3g} cb={cb} m={m:4d} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                    bad += 1
                    continue
                ok = err <= args.tol and not torch.isnan(y).any()
                bad += not ok
                print(f"{t:6s} K={bits:<3g} cb={cb} m={m:4d} rel_err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    print(f"{bad} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
