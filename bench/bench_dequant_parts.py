"""Where the large-M path's time goes: the dense weight reconstruction (exl3_recon), the cuBLAS GEMM on it (also with
torch's reduced-precision split-k turned off, which changes cuBLAS's choice), their sum, the whole path, and bf16
cuBLAS on a dense [n, k] weight (F.linear, as vLLM runs it); each is a CUDA graph of calls on rotating weight copies
(the L2 never holds them)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from exl3_vllm.kernels import op as kop  # noqa: E402
from exl3_vllm.kernels.tune import graph_time_us  # noqa: E402
from exl3_vllm.kernels.variants import LINEAR_SOURCE, linear_defines  # noqa: E402


def parts(k, n, m, bits, cb, copies, reps):
    dev = torch.device("cuda")
    w = int(16 * bits)
    ts = [torch.randint(-32768, 32768, (k // 16, n // 16, w), dtype=torch.int16, device=dev) for _ in range(copies)]
    suh = (torch.randn(k, device=dev) * 0.05).half()
    svh = (torch.randn(n, device=dev) * 0.05).half()
    x = torch.randn(m, k, device=dev).bfloat16()
    d = kop.device_for(0)
    kop.prepare(k, n, bits, cb, m, dev)
    lin = d.module(LINEAR_SOURCE, linear_defines(bits, cb))
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    wt = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    wb = [torch.randn(n, k, device=dev).bfloat16() for _ in range(max(2, copies // 4))]

    def rec(t):
        kop.launch_recon(d, lin, stream(), t, suh, svh, wt, n, 0, n, k)

    r = {}
    r["recon"] = graph_time_us([lambda t=t: rec(t) for t in ts[:10]], reps)
    r["gemm"] = graph_time_us([lambda: torch.mm(x, wt.t(), out=y)] * 5, reps)
    mm = torch.backends.cuda.matmul
    saved = mm.allow_bf16_reduced_precision_reduction
    mm.allow_bf16_reduced_precision_reduction = False  # what cuBLAS picks when split-k partial sums must stay fp32
    try:
        r["gemm32"] = graph_time_us([lambda: torch.mm(x, wt.t(), out=y)] * 5, reps)
    finally:
        mm.allow_bf16_reduced_precision_reduction = saved
    r["path"] = graph_time_us([lambda t=t: kop.linear_cuda(x, t, suh, svh, None, [n], cb, out=y, force="dequant")
                               for t in ts[:10]], reps)
    r["bf16"] = graph_time_us([lambda b=b: torch.nn.functional.linear(x, b) for b in wb], reps)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4096x4096,8192x28672,28672x8192")
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    lines = ["| layer | M | recon µs | recon GB/s (W written + trellis read) | GEMM on W µs | GEMM, fp32 "
             "split-k µs | sum µs | path µs | bf16 µs |",
             "|---|---|---|---|---|---|---|---|---|"]
    print(lines[0])
    for spec in a.layers.split(","):
        k, n = map(int, spec.split("x"))
        copies = max(2, min(10, (2 << 30) // (k * n // 2)))
        for m in map(int, a.ms.split(",")):
            r = parts(k, n, m, 4, 2, copies, a.reps)
            s = r["recon"] + r["gemm"]
            line = (f"| {k}x{n} | {m} | {r['recon']:.1f} | {k * n * 2.5 / r['recon'] / 1e3:.0f} | "
                    f"{r['gemm']:.1f} | {r['gemm32']:.1f} | {s:.1f} | {r['path']:.1f} | {r['bf16']:.1f} |")
            lines.append(line)
            print(line, flush=True)
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
