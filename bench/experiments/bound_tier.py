"""Bound analysis of forced tiers: each tier timed in full and with the kernel's diagnostic switches (no MMA, no
decode, no x loads, no split-k reduction; wrong results by design), one process per switch set, so the parts' costs
can be compared.

python bench/experiments/bound_tier.py --tiers x256:s1,x128 --layer 8192x28672 --ms 128,256
A switch that is not one of SWITCHES is a compile-time variant to compare: defines joined by '+', e.g.
--switches full,EXL3_DIAG_NO_X+EXL3_DIAG_NO_DECODE

The EXL3_DIAG_* switches (wrong results by design) are no longer in the kernel sources: this experiment's results are
recorded in bench/results (2026-12-04-linear-h200-dp, -rs); to rerun it, check out 5cd3c98, whose exl3_linear.cu
has them. Without them every switch set compiles and times the full kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SWITCHES = {"full": "", "no-mma": "EXL3_DIAG_NO_MMA", "no-decode": "EXL3_DIAG_NO_DECODE",
            "no-x": "EXL3_DIAG_NO_X", "no-tail": "EXL3_DIAG_NO_TAIL", "loads": "EXL3_DIAG_NO_MMA,EXL3_DIAG_NO_DECODE",
            "trellis": "EXL3_DIAG_NO_X,EXL3_DIAG_NO_MMA,EXL3_DIAG_NO_DECODE"}


def child(args) -> None:
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
    from exl3_vllm.kernels import op as kop
    from exl3_vllm.kernels import tune
    k, n = (int(v) for v in args.layer.split("x"))
    dev = torch.device("cuda")
    w = int(16 * args.bits)
    copies = max(2, int(2e9 // (k * n * args.bits / 8)))  # rotate weights past the L2
    g = torch.Generator(device=dev).manual_seed(0)
    trs = [torch.randint(-32768, 32768, (k // 16, n // 16, w), dtype=torch.int16, device=dev, generator=g)
           for _ in range(min(copies, 10))]
    suh = ((torch.rand(k, device=dev, generator=g) + 0.5) * 0.05).half()
    svh = ((torch.rand(n, device=dev, generator=g) + 0.5) * 0.05).half()
    res = {}
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, k, device=dev, generator=g).half()
        for tier in args.tiers.split(","):
            calls = [lambda t=t, tier=tier: kop.linear_cuda(x, t, suh, svh, None, [n], args.cb, force=tier)
                     for t in trs]
            res[f"{tier}@{m}"] = tune.graph_time_us(calls, 5)
    print("RESULT " + json.dumps(res))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", required=True)
    ap.add_argument("--layer", default="8192x28672")
    ap.add_argument("--ms", default="256")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--cb", type=int, default=2)
    ap.add_argument("--switches", default="full,no-mma,no-decode,loads")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    table = {}
    for sw in args.switches.split(","):
        env = dict(os.environ, EXL3_VLLM_EXTRA_DEFINES=SWITCHES.get(sw, sw.replace("+", ",")), EXL3_VLLM_TUNE="0")
        cmd = [sys.executable, __file__, "--child"] + [f"--{a}={getattr(args, a)}" for a in ("tiers", "layer", "ms", "bits", "cb")]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{sw}: failed\n{r.stderr[-2000:]}")
            continue
        table[sw] = json.loads(line[7:])
    keys = next(iter(table.values()), {}).keys()
    print(f"{args.layer} K={args.bits} cb={args.cb} (us)")
    print("tier@m".ljust(16) + "".join(s.rjust(11) for s in table))
    for key in keys:
        print(key.ljust(16) + "".join(f"{table[s].get(key, float('nan')):11.1f}" for s in table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
