"""Where a small-M call's time goes: the whole op, the op without its input transform (the GEMM kernel alone, reading
the previous call's transformed x), the transform alone, the decode-only pass, and one tiny kernel (a CUDA graph's
per-launch floor); every time is a CUDA graph of calls on rotating weight copies, as in bench_linear.py. A call that
is one launch (h8 / h16 transform x themselves) has no separate parts: "–".

python bench/experiments/bench_small_m_parts.py --layers 4096x4096,4096x14336 --ms 1,4,16
EXL3_VLLM_DISABLE=pdl in the environment times the same without programmatic dependent launch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from exl3_vllm.kernels import nvrtc  # noqa: E402
from exl3_vllm.kernels import op as kop  # noqa: E402
from exl3_vllm.kernels.tune import graph_time_us  # noqa: E402
from decode_floor import decode_floor  # noqa: E402

_launch = nvrtc.launch


def _launches(f, keep=lambda i: True) -> int:
    """Run f with the op's kernel launches filtered (keep(i): whether launch i of this call goes out); returns how
    many launches f made."""
    count = [0]

    def filtered(*a, **kw):
        count[0] += 1
        if keep(count[0] - 1):
            _launch(*a, **kw)

    nvrtc.launch = filtered
    try:
        f()
    finally:
        nvrtc.launch = _launch
    return count[0]


def layer_copies(k: int, n: int, bits: int, dev) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Random trellis copies of one k x n layer (2..10, about 2 GB, so a graph of calls never finds them in the L2),
    suh and svh."""
    copies = max(2, min(10, (2 << 30) // (k * n * bits // 8)))
    ts = [torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), dtype=torch.int16, device=dev)
          for _ in range(copies)]
    return ts, (torch.randn(k, device=dev) * 0.05).half(), (torch.randn(n, device=dev) * 0.05).half()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4096x4096,4096x14336")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--codebooks", default="2,1", help="0/1/2 = 3inst/mcg/mul1")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device("cuda")
    names = {0: "3inst", 1: "mcg", 2: "mul1"}
    print(f"PDL {'on' if kop.pdl_enabled(kop.device_for(0).arch) else 'off'}")
    print("| layer | cb | M | plan | op µs | GEMM alone µs | transform alone µs | decode-only µs | one tiny kernel µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    z = torch.zeros(1, device=dev)
    tiny = graph_time_us([lambda: z.add_(1)] * 10, args.reps)
    for spec in args.layers.split(","):
        k, n = map(int, spec.split("x"))
        for cb in map(int, args.codebooks.split(",")):
            ts, suh, svh = layer_copies(k, n, args.bits, dev)
            kop.prepare(k, n, args.bits, cb, max(map(int, args.ms.split(","))), dev)
            dec = graph_time_us([lambda t=t: decode_floor(t, cb) for t in ts], args.reps)
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device=dev).bfloat16()
                p = kop.plan_for(kop.device_for(0), m, k, n, args.bits, cb, [n])

                def call(t, keep=None):
                    f = lambda: kop.linear_cuda(x, t, suh, svh, None, [n], cb)  # noqa: E731
                    return f() if keep is None else _launches(f, keep)

                full = graph_time_us([lambda t=t: call(t) for t in ts], args.reps)
                gemm = xform = "–"
                if _launches(lambda: call(ts[0])) > 1:
                    gemm = f"{graph_time_us([lambda t=t: call(t, lambda i: i > 0) for t in ts], args.reps):.2f}"
                    xform = f"{graph_time_us([lambda t=t: call(t, lambda i: i == 0) for t in ts], args.reps):.2f}"
                plan = f"{p.tier} s{p.splits}" + (f" stream {p.stream}" if p.stream else "") if p.path == "gemm" else p.path
                print(f"| {spec} | {names[cb]} | {m} | {plan} | {full:.2f} | {gemm} | {xform} | {dec:.2f} | "
                      f"{tiny:.2f} |", flush=True)
            del ts
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
