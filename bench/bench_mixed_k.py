"""Fused layers whose shards differ in K (exllamav3's recipes, measure + optimize): the plugin's per-group calls
against the same layer fused at one K, and bf16 cuBLAS, on the GPU.

    python3 bench/bench_mixed_k.py [--ms 1,4,16,64,256,1024,4096] [--out bench/results/<date>-mixed-k-<gpu>.csv]

Layers (Llama-3-8B shapes): q/k/v 4096 -> 4096 + 1024 + 1024 with q at K=4 and k/v at K=5 (two groups, two calls:
what Exl3LinearMethod runs), and gate/up 4096 -> 14336 + 14336 with gate at 4 and up at 5 (two calls). Beside each:
the same fused layer at K=4 and at K=5 (one call), and the bf16 fused weight. Timing as bench_linear.py: a CUDA graph
of --calls calls on rotating weight copies (L2 defeated), median of --reps replays.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from exl3_vllm.kernels import op as kop  # noqa: E402
from exl3_vllm.kernels.tune import graph_time_us as graph_time  # noqa: E402
from provenance import git_commit, gpu_name  # noqa: E402

MUL1 = 2
LAYERS = {"qkv": (4096, [4096, 1024, 1024], [4, 5, 5]), "gate_up": (4096, [14336, 14336], [4, 5])}


def copies(nbytes: int, pool_gb: float) -> int:
    return max(2, min(64, -(-int(pool_gb * 2**30) // nbytes)))


def groups_of(bits: list[int]) -> list[tuple[int, int, int]]:
    """(first shard, end shard, K) of each run of adjacent shards at one K."""
    out = []
    for i, b in enumerate(bits):
        if out and out[-1][2] == b:
            out[-1] = (out[-1][0], i + 1, b)
        else:
            out.append((i, i + 1, b))
    return out


def make(k: int, sizes: list[int], bits: list[int], n_copies: int, dev) -> list[list[tuple]]:
    """Per copy, per group: (trellis, suh rows, svh, sizes)."""
    out = []
    for _ in range(n_copies):
        groups = []
        for s0, s1, b in groups_of(bits):
            n = sum(sizes[s0:s1])
            t = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * b), dtype=torch.int16, device=dev)
            suh = ((torch.rand(s1 - s0, k, device=dev) + 0.5) * 0.05).half()
            svh = ((torch.rand(n, device=dev) + 0.5) * 0.05).half()
            groups.append((t, suh, svh, sizes[s0:s1]))
        out.append(groups)
    return out


def call(x, groups):
    ys = [torch.ops.exl3.linear(x, t, suh, svh, None, sz, MUL1) for t, suh, svh, sz in groups]
    return ys[0] if len(ys) == 1 else torch.cat(ys, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--pool-gb", type=float, default=2.0)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="")
    ap.add_argument("--commit", default="", help="the tree measured (a device copy's git is stale; default: git here)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    ms = [int(m) for m in a.ms.split(",")]
    commit = a.commit or git_commit(os.path.dirname(os.path.abspath(__file__)))
    gpu = gpu_name()
    rows = []
    for name, (k, sizes, bits) in LAYERS.items():
        n = sum(sizes)
        variants = {"mixed": bits, "fused_k4": [4] * len(sizes), "fused_k5": [5] * len(sizes)}
        weights = {}
        for v, bv in variants.items():
            nbytes = sum(k * s * b // 8 for s, b in zip(sizes, bv))
            weights[v] = make(k, sizes, bv, copies(nbytes, a.pool_gb), dev)
            for t, _, _, sz in weights[v][0]:
                kop.prepare(k, t.shape[1] * 16, kop.bits_of(t), MUL1, max(ms), dev, sz)
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                 for _ in range(copies(k * n * 2, a.pool_gb))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"layer": name, "k": k, "shards": "+".join(map(str, sizes)), "mixed_bits": "/".join(map(str, bits)),
                   "m": m}
            for v, ws in weights.items():
                sel = (ws * (a.calls // len(ws) + 1))[:a.calls]
                row[f"{v}_us"] = round(graph_time([lambda g=g: call(x, g) for g in sel], a.reps), 2)
            sel = (dense * (a.calls // len(dense) + 1))[:a.calls]
            row["bf16_us"] = round(graph_time([lambda w=w: torch.nn.functional.linear(x, w) for w in sel], a.reps), 2)
            row["mixed_vs_fused_k5"] = round(row["fused_k5_us"] / row["mixed_us"], 3)
            row["mixed_vs_bf16"] = round(row["bf16_us"] / row["mixed_us"], 3)
            row.update(commit=commit, device=gpu)
            print(row, flush=True)
            rows.append(row)
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
