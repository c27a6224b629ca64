"""Same-process A/B of the tuner's split-factor round: the previous rule (half and twice the static factor) against
tune.with_splits (also the factors that fill whole waves). Per layer, codebook and row bucket it times the tuner's
candidates once, the split factors of both rules, picks each rule's winner as the tuner would, then times the two
picks again interleaved (median of --reps graph replays each, three rounds) so the table is not a winner's curse."""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_small_m_parts import layer_copies  # noqa: E402
from exl3_vllm.kernels import clock, op as kop, tune  # noqa: E402


def old_splits(d, best, m, k, n_total, bits, codebook, sizes):
    """The split rule before f119b18: half and twice the static fixed factor."""
    out = []
    for c in best:
        tier = c.split(":")[0]
        if tier == "dequant":
            continue
        base = kop.plan(m, k, n_total, bits, d.sms, d.smem_limit, codebook, d.arch, math.gcd(*sizes),
                        tier + ":fixed").splits
        top = max(1, (k // 16) // kop.TIERS[tier].ks)
        out += [f"{tier}:s{s}" for s in dict.fromkeys((max(1, base // 2), min(top, 2 * base))) if s != base]
    return list(dict.fromkeys(out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4096x4096,4096x14336,14336x4096,8192x28672,28672x8192")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--codebooks", default="2,1")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    d = kop.device_for(0)
    print("| layer | cb | M | previous rule: pick | µs | whole waves too: pick | µs | speedup |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for spec in a.layers.split(","):
        k, n = map(int, spec.split("x"))
        ts, suh, svh = layer_copies(k, n, 4, dev)
        suh2 = suh.view(1, k)
        for cb in map(int, a.codebooks.split(",")):
            kop.prepare(k, n, 4, cb, 1, dev)
            for m in map(int, a.ms.split(",")):
                if m <= tune.LIGHT_BUCKET:
                    clock.rest(0)
                x = torch.randn(m, k, device=dev).bfloat16()
                y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                times: dict[str, float] = {}
                cands = tune.with_fixed(d, tune.candidates(d, m, k, 4, cb, n), m, k, n, 4, cb, [n])
                tune._time_all(x, y, ts, suh2, svh, [n], cb, m, cands, times)
                best = tune.fastest_tiers(times)
                old = old_splits(d, best, m, k, n, 4, cb, [n])
                new = tune.with_splits(d, best, m, k, n, 4, cb, [n])
                more = [c for c in dict.fromkeys(old + new) if c not in times]
                tune._time_all(x, y, ts, suh2, svh, [n], cb, m, more, times)
                pick = {}
                for name, rule in (("old", old), ("new", new)):
                    pool = {c: times[c] for c in cands + rule if c in times}
                    pick[name] = min(pool, key=pool.get)
                res = {c: [] for c in set(pick.values())}
                for _ in range(3):
                    for c in res:
                        calls = [lambda c=c, t=t: kop.linear_cuda(x, t, suh, svh, None, [n], cb, out=y, force=c)
                                 for t in ts[:10]]
                        res[c].append(tune.graph_time_us(calls, a.reps))
                med = {c: sorted(v)[1] for c, v in res.items()}
                po, pn = pick["old"], pick["new"]
                print(f"| {spec} | {'mul1' if cb == 2 else 'mcg'} | {m} | {po} | {med[po]:.2f} | {pn} | {med[pn]:.2f} | "
                      f"{med[po] / med[pn]:.3f}x |", flush=True)
        del ts
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
