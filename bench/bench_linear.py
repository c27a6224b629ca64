"""Benchmark torch.ops.exl3.linear against bf16 cuBLAS on the GPU, with measured floors.

Each point: a CUDA graph of R calls, each on a different copy of the weights (copies rotate
through >= --pool-gb so the 60 MiB L2 never holds them), replayed --reps times; the per-call
time is the median replay time / R.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from exl3_vllm.kernels import op as kop  # noqa: E402
from exl3_vllm.kernels.tune import graph_time_us as graph_time  # noqa: E402  (bench_moe imports it from here)

LAYERS = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)]
ALL_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
CB = {"3inst": 0, "mcg": 1, "mul1": 2}


def copies_for(nbytes, pool_gb, cap=64):
    return max(2, min(cap, -(-int(pool_gb * 2**30) // max(nbytes, 1))))


def measure_ceilings(reps):
    n = 1 << 28  # 512 MiB of bf16
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = graph_time([lambda: b.copy_(a)] * 10, reps)
    bw = 2 * a.numel() * 2 / (t * 1e-6)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = graph_time([lambda: torch.mm(x, y)] * 5, reps)
    flops = 2 * 8192**3 / (t * 1e-6)
    del a, b, x, y
    return bw, flops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer layers, K values and M")
    ap.add_argument("--pool-gb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="2026-12-01-linear-h200")
    ap.add_argument("--layers", default="", help="e.g. 4096x4096,8192x28672 (default: all)")
    ap.add_argument("--ms", default="", help="e.g. 1,16,64 (default: the full grid)")
    ap.add_argument("--configs", default="", help="e.g. 4:mul1,4:mcg (default: all)")
    ap.add_argument("--no-compare", dest="compare", action="store_false",
                    help="only the auto path (default: also the tiers/paths auto chose against)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = torch.cuda.get_device_capability(0)
    arch = cap[0] * 10 + cap[1]
    bw, gemm_rate = measure_ceilings(args.reps)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s", flush=True)

    configs = [(4, "mul1"), (4, "mcg"), (4, "3inst")] + [(b, "mul1") for b in (2, 3, 5, 6, 8)] + [(b, "mcg") for b in (2, 3)]
    layers = LAYERS
    if args.quick:
        layers = [(4096, 14336), (8192, 28672)]
    if args.layers:
        layers = [tuple(int(v) for v in l.split("x")) for l in args.layers.split(",")]
    if args.configs:
        configs = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.configs.split(",")]
    sel_ms = [int(v) for v in args.ms.split(",")] if args.ms else None
    rows = []
    for (k, n) in layers:
        # bf16 baseline weights, rotated
        wb_bytes = k * n * 2
        nb = copies_for(wb_bytes, args.pool_gb, cap=args.calls)
        wbs = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(nb)]
        base = {}
        for bits, cbn in configs:
            big = (k, n) == (8192, 28672)
            if (bits, cbn) not in ((4, "mul1"), (4, "mcg")) and not big:
                continue
            ms = ALL_M
            if (bits, cbn) == (4, "3inst"):
                ms = [1, 16, 64, 256, 2048]
            elif bits != 4:
                ms = [1, 16, 64, 256]
            if args.quick:
                ms = [m for m in ms if m in (1, 16, 64, 256, 2048)]
            if sel_ms:
                ms = [m for m in ms if m in sel_ms]
            cb = CB[cbn]
            w = 16 * bits
            tbytes = k * n * bits // 8
            nc = copies_for(tbytes, args.pool_gb, cap=256)
            trs = [torch.randint(-32768, 32768, (k // 16, n // 16, w), dtype=torch.int16, device=dev) for _ in range(nc)]
            suh = ((torch.rand(k, device=dev) + 0.5) * 0.05).half()
            svh = ((torch.rand(n, device=dev) + 0.5) * 0.05).half()
            kop.prepare(k, n, bits, cb, max(ms), dev)
            sink = torch.empty(sms * 8 * 256, dtype=torch.int32, device=dev)
            td = graph_time([lambda t=t: kop.decode_floor(t, cb, sink) for t in (trs * 4)[:max(args.calls, nc)]], args.reps)
            decode_rate = k * n / (td * 1e-6)
            print(f"layer {k}x{n} K={bits} {cbn}: decode-only {td:.1f} us ({decode_rate / 1e12:.2f} Tweights/s), "
                  f"{nc} weight copies", flush=True)
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                if m not in base:
                    calls = [lambda wt=wt: torch.mm(x, wt) for wt in (wbs * args.calls)[:args.calls]]
                    base[m] = graph_time(calls, args.reps)
                tb = base[m]
                paths = [("auto", None)]
                if args.compare and m >= 16 and bits == 4:
                    # The alternatives auto could have taken: the mma.sync tier, the other large-M path.
                    auto = kop.plan_for(kop._dev(0), m, k, n, bits, cb, [n])
                    alts = ["dequant"] if m >= 64 else []
                    if m <= 128:
                        alts.append(next(t for t in ("m16", "m32", "m64", "m128") if m <= kop.TIERS[t].bm))
                    if arch == 90:
                        alts.append(kop.wg_tier(m, bits, 227 * 1024, n).name)
                    chosen = "dequant" if auto.path == "dequant" else auto.tier
                    paths += [(a, a) for a in alts if a != chosen]
                if m <= 8 and cbn == "mul1" and args.compare:
                    paths.append(("m16", "m16"))  # the fp16 tier the int8 tier replaces
                for pname, force in paths:
                    if force:
                        os.environ["EXL3_VLLM_TIER"] = force
                    else:
                        os.environ.pop("EXL3_VLLM_TIER", None)
                    ts = (trs * (args.calls // len(trs) + 1))[:args.calls]
                    calls = [lambda t=t: torch.ops.exl3.linear(x, t, suh, svh, None, [n], cb) for t in ts]
                    torch.ops.exl3.linear(x, trs[0], suh, svh, None, [n], cb)  # grow workspace outside capture
                    t_ours = graph_time(calls, args.reps)
                    os.environ.pop("EXL3_VLLM_TIER", None)
                    nbytes = tbytes + m * k * 2 + m * n * 2
                    flops = 2 * m * k * n
                    floor = max(nbytes / bw * 2, k * n / decode_rate, flops / gemm_rate)  # bw counts read+write
                    p = kop.plan_for(kop._dev(0), m, k, n, bits, cb, [n]) if not force else force
                    row = dict(layer=f"{k}x{n}", K=bits, cb=cbn, M=m, path=pname,
                               plan=str(p) if not force else force, ours_us=round(t_ours, 2), bf16_us=round(tb, 2),
                               speedup=round(tb / t_ours, 3), GBps=round(nbytes / t_ours / 1e3, 1),
                               TFLOPs=round(flops / t_ours / 1e6, 2), floor_us=round(floor * 1e6, 2),
                               pct_floor=round(100 * floor * 1e6 / t_ours, 1), decode_only_us=round(td, 2))
                    rows.append(row)
                    print(f"{row['layer']:>11} K={bits} {cbn:5s} M={m:5d} {pname:7s} ours {t_ours:9.2f} us  bf16 {tb:9.2f} us  "
                          f"x{tb / t_ours:5.2f}  floor {floor * 1e6:8.2f} us ({row['pct_floor']:5.1f}%)", flush=True)
            del trs
            torch.cuda.empty_cache()
        del wbs
        torch.cuda.empty_cache()

    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, f"{args.tag}.csv")
    with open(csv_path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        wr.writeheader()
        wr.writerows(rows)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "uncommitted"
    except OSError:
        commit = "unknown"
    md = os.path.join(args.out_dir, f"{args.tag}.md")
    with open(md, "w") as f:
        f.write(f"# EXL3 linear benchmark\n\n- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
                f"- commit: {commit}\n- device: {torch.cuda.get_device_name(0)} ({sms} SMs), torch {torch.__version__}\n"
                f"- command: `python bench/bench_linear.py {' '.join(sys.argv[1:])}`\n"
                f"- measured ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s\n"
                f"- method: CUDA graph of {args.calls} calls on rotating weight copies (>= {args.pool_gb} GB pool or "
                f"<= 256 copies), median of {args.reps} replays; floor = max(bytes/BW, weights/decode-only rate, flops/GEMM rate)\n\n")
        keys = list(rows[0].keys())
        f.write("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r[k2]) for k2 in keys) + " |\n")
    print(f"wrote {md} and {csv_path}")


if __name__ == "__main__":
    main()
