"""Benchmark torch.ops.exl3.linear against bf16 cuBLAS on the GPU, with measured floors.

Each point: a CUDA graph of R calls, each on a different copy of the weights (copies rotate
through >= --pool-gb so the 60 MiB L2 never holds them), replayed --reps times; the per-call
time is the median replay time / R.

With --peer auto (the default) and exllamav3's kernels available through bench/peer/peer_ext.load()
(EXL3_PEER_SO, .peer/lib, .peer/build, or a build from the carried source), every row also gets
exllamav3's time for the same layer, codebook and M, on the same trellis copies, suh and svh, timed the
same way; without them those columns read "–".
"""

from __future__ import annotations

import argparse
import csv
import datetime
import glob
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from exl3_vllm.kernels import clock  # noqa: E402
from exl3_vllm.kernels import op as kop  # noqa: E402
from exl3_vllm.kernels.tune import graph_time_us as graph_time  # noqa: E402  (bench_moe imports it from here)
from decode_floor import decode_floor  # noqa: E402
from provenance import git_commit, gpu_name  # noqa: E402

LAYERS = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)]
ALL_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
CB = {"3inst": 0, "mcg": 1, "mul1": 2}
PEER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer")
NA = "–"
# Rows up to this many are timed on a rested clock (no power cap left from the previous large-M rows).
LIGHT_M = 256
# exllamav3 1.6.5 modules/quant/exl3.py: exl3_gemm up to this many rows, reconstruct + hgemm above
PEER_RECON_ABOVE = 144
PEER_FUSED_FROM = 1024  # its fused reconstruct (both Hadamards folded into the weights) from this many rows
PEER_SLICE_N = 32768    # its MAX_RECONSTRUCT_SLICE_N


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


def load_peer(mode):
    """exllamav3's kernels (bench/peer), or None after one line saying why."""
    if mode == "off":
        return None
    try:
        sys.path.insert(0, PEER_DIR)
        import peer_ext
        # with nothing under .peer/, load() would start a build that cannot succeed
        if not (os.environ.get("EXL3_PEER_SO") or glob.glob(os.path.join(peer_ext.LIB_DIR, peer_ext.NAME + ".so*"))
                or glob.glob(os.path.join(peer_ext.BUILD_DIR, peer_ext.NAME + "*.so")) or os.path.isdir(peer_ext.EXT_DIR)):
            raise FileNotFoundError("no library or source under .peer/ (bench/README.md, peer harness)")
        ext = peer_ext.load()
    except Exception as e:  # a missing or mismatched library must not stop our own benchmark
        print(f"exllamav3: not available ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); "
              f"its columns read {NA}", flush=True)
        return None
    print(f"exllamav3: {ext.PEER} from {ext.__file__}", flush=True)
    return ext


def peer_calls(ext, x, ts, suh, svh, bits, cbn):
    """One closure per trellis copy doing what exllamav3's LinearEXL3.forward does for x (fp16 in and out):
    exl3_gemm with its own dispatch (int8 GEMV, fp16 GEMV or the autotuned GEMM) up to 144 rows, else
    reconstruct + hgemm_recon. Returns (calls, path name of the first call)."""
    m, k = x.shape
    n = ts[0].shape[1] * 16
    mcg, mul1 = cbn == "mcg", cbn == "mul1"
    y = torch.empty(m, n, dtype=torch.half, device=x.device)
    xh = torch.empty_like(x)
    if m <= PEER_RECON_ABOVE:
        calls = [lambda t=t: ext.exl3_gemm(x, t, y, suh, xh, svh, -1, mcg, mul1, 0) for t in ts]
        tag = calls[0]()  # also runs exllamav3's autotune for this shape outside the graph
        return calls, {0: "int8_gemv", 90: "gemv"}.get(tag, f"gemm{tag}")
    fused = m >= PEER_FUSED_FROM
    w = torch.empty(k * min(n, PEER_SLICE_N), dtype=torch.half, device=x.device)  # its per-call temporary

    def call(t):
        if not fused:
            ext.had_r_128(x, xh, suh, None, 1.0)
        for n0 in range(0, n, PEER_SLICE_N):
            n1 = min(n0 + PEER_SLICE_N, n)
            wv = w[:k * (n1 - n0)].view(k, n1 - n0)
            if fused:
                ext.reconstruct_had_slice(wv, t, suh, svh[n0:], float(bits), mcg, mul1, n0)
            elif n1 - n0 == n:
                ext.reconstruct(wv, t, float(bits), mcg, mul1)
            else:
                ext.reconstruct_slice(wv, t, float(bits), mcg, mul1, n0)
            ext.hgemm_recon(x if fused else xh, wv, y[:, n0:n1])
        if not fused:
            ext.had_r_128(y, y, None, svh, 1.0)
    return [lambda t=t: call(t) for t in ts], "recon_fused" if fused else "recon"


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
    ap.add_argument("--peer", choices=["auto", "off"], default="auto",
                    help="auto: add exllamav3's kernels (bench/peer) where its library loads")
    ap.add_argument("--tiers", default="", help="extra forced tiers per row (with --no-compare: only these beside auto), e.g. x64,x128:fixed")
    ap.add_argument("--deadline", type=float, default=0, help="unix time: stop the grid and write what is done")
    ap.add_argument("--commit", default="", help="the tree measured (a device copy's git is stale; default: git here)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time each row's bf16 and ours this many times, interleaved: the row is the repeat with the "
                         "median speedup, speedup_spread the lowest-highest (rows at the H200's power cap move "
                         "between runs)")
    args = ap.parse_args()
    commit = args.commit or git_commit(os.path.dirname(os.path.abspath(__file__)))
    device = gpu_name()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = torch.cuda.get_device_capability(0)
    arch = cap[0] * 10 + cap[1]
    bw, gemm_rate = measure_ceilings(args.reps)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s", flush=True)
    peer = load_peer(args.peer)
    stopped = []

    def late():
        if args.deadline and time.time() > args.deadline and not stopped:
            stopped.append(time.time())
            print(f"--deadline reached: stopping after {len(rows)} rows", flush=True)
        return bool(stopped)

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
        if late():
            break
        # bf16 baseline weights, rotated, stored [n, k] and applied by F.linear as vLLM's unquantized layers do
        wb_bytes = k * n * 2
        nb = copies_for(wb_bytes, args.pool_gb, cap=args.calls)
        wbs = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(nb)]
        for bits, cbn in configs:
            big = (k, n) == (8192, 28672)
            if (bits, cbn) not in ((4, "mul1"), (4, "mcg")) and not big:
                continue
            if late():
                break
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
            t_prep = time.time()
            kop.prepare(k, n, bits, cb, max(ms), dev)
            t_prep = time.time() - t_prep
            sink = torch.empty(sms * 8 * 256, dtype=torch.int32, device=dev)
            clock.rest(0)
            td = graph_time([lambda t=t: decode_floor(t, cb, sink) for t in (trs * 4)[:max(args.calls, nc)]], args.reps)
            decode_rate = k * n / (td * 1e-6)
            print(f"layer {k}x{n} K={bits} {cbn}: decode-only {td:.1f} us ({decode_rate / 1e12:.2f} Tweights/s), "
                  f"{nc} weight copies, prepare (compile + tune) {t_prep:.1f} s", flush=True)
            for m in ms:
                if late():
                    break
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                bf16_calls = [lambda wt=wt: torch.nn.functional.linear(x, wt) for wt in (wbs * args.calls)[:args.calls]]

                def bf16_time():
                    """bf16 timed beside each row it divides (never reused across codebooks or paths), its clock too."""
                    if m <= LIGHT_M:
                        clock.rest(0)
                    t = graph_time(bf16_calls, args.reps)
                    return t, clock.sm_mhz(0)

                ts = (trs * (args.calls // len(trs) + 1))[:args.calls]
                paths = [("auto", None)]
                if args.compare and m >= 16 and bits == 4:
                    # The alternatives auto could have taken: the mma.sync tier, the other large-M path.
                    auto = kop.plan_for(kop.device_for(0), m, k, n, bits, cb, [n])
                    alts = ["dequant"] if m >= 64 else []
                    if m <= 128:
                        alts.append(next(t for t in ("m16", "m32", "m64", "m128") if m <= kop.TIERS[t].bm))
                    if arch == 90:
                        if m <= 128:
                            alts.append(kop.wg_tier(m, bits, 227 * 1024, n).name)
                        alts += [t for t in args.tiers.split(",") if t]
                    chosen = "dequant" if auto.path == "dequant" else auto.tier
                    paths += [(a, a) for a in dict.fromkeys(alts) if a != chosen]
                if not args.compare:
                    paths += [(t, t) for t in args.tiers.split(",") if t]
                if m <= 8 and cbn == "mul1" and args.compare:
                    paths.append(("m16", "m16"))  # the fp16 tier the int8 tier replaces
                for pname, force in paths:
                    if force:
                        os.environ["EXL3_VLLM_TIER"] = force
                    else:
                        os.environ.pop("EXL3_VLLM_TIER", None)
                    calls = [lambda t=t: torch.ops.exl3.linear(x, t, suh, svh, None, [n], cb) for t in ts]
                    try:
                        torch.ops.exl3.linear(x, trs[0], suh, svh, None, [n], cb)  # grow workspace outside capture
                    except kop.KernelError as e:  # a --tiers tier this row cannot take (e.g. i16 above 16 rows)
                        os.environ.pop("EXL3_VLLM_TIER", None)
                        print(f"{k}x{n} M={m} {pname}: skipped ({str(e)[:80]})", flush=True)
                        continue
                    pairs = []  # (bf16, its clock, ours, its clock) per repeat, interleaved
                    for _ in range(args.repeats):
                        tb, mhz_b = bf16_time()
                        if m <= LIGHT_M:
                            clock.rest(0)
                        pairs.append((tb, mhz_b, graph_time(calls, args.reps), clock.sm_mhz(0)))
                    pairs.sort(key=lambda q: q[0] / q[2])
                    tb, mhz_b, t_ours, mhz = pairs[len(pairs) // 2]  # the repeat with the median speedup
                    spread = f"{pairs[0][0] / pairs[0][2]:.3f}-{pairs[-1][0] / pairs[-1][2]:.3f}"
                    os.environ.pop("EXL3_VLLM_TIER", None)
                    nbytes = tbytes + m * k * 2 + m * n * 2
                    flops = 2 * m * k * n
                    floor = max(nbytes / bw, k * n / decode_rate, flops / gemm_rate)  # bw: bytes moved (read + write) per second
                    p = kop.plan_for(kop.device_for(0), m, k, n, bits, cb, [n]) if not force else force
                    row = dict(layer=f"{k}x{n}", K=bits, cb=cbn, M=m, path=pname,
                               plan=str(p) if not force else force, ours_us=round(t_ours, 2), bf16_us=round(tb, 2),
                               speedup=round(tb / t_ours, 3), GBps=round(nbytes / t_ours / 1e3, 1),
                               TFLOPs=round(flops / t_ours / 1e6, 2), floor_us=round(floor * 1e6, 2),
                               pct_floor=round(100 * floor * 1e6 / t_ours, 1), decode_only_us=round(td, 2),
                               exllamav3_us=NA, exllamav3_path=NA, exllamav3_speedup=NA, ours_vs_exllamav3=NA,
                               sm_mhz=mhz if mhz is not None else NA, bf16_sm_mhz=mhz_b if mhz_b is not None else NA,
                               speedup_spread=spread, repeats=args.repeats, commit=commit, device=device)
                    rows.append(row)
                    print(f"{row['layer']:>11} K={bits} {cbn:5s} M={m:5d} {pname:7s} ours {t_ours:9.2f} us  bf16 {tb:9.2f} us  "
                          f"x{tb / t_ours:5.2f}  floor {floor * 1e6:8.2f} us ({row['pct_floor']:5.1f}%)", flush=True)
                if peer is not None:
                    # exllamav3 on the same trellis copies, suh and svh, with fp16 x; after ours, so a clock
                    # still recovering from the previous point's load would slow ours rather than exllamav3
                    try:
                        pcalls, ppath = peer_calls(peer, x.half(), ts, suh, svh, bits, cbn)
                        tb, _ = bf16_time()
                        tp = graph_time(pcalls, args.reps)
                        del pcalls
                        for r in rows[-len(paths):]:
                            r.update(exllamav3_us=round(tp, 2), exllamav3_path=ppath, exllamav3_speedup=round(tb / tp, 3),
                                     ours_vs_exllamav3=round(tp / r["ours_us"], 3))
                        print(f"{f'{k}x{n}':>11} K={bits} {cbn:5s} M={m:5d} exllamav3 {tp:9.2f} us  bf16 {tb:9.2f} us  "
                              f"x{tb / tp:5.2f}  ({ppath})", flush=True)
                    except Exception as e:  # one shape exllamav3 rejects must not end the run
                        print(f"exllamav3 failed at {k}x{n} K={bits} {cbn} M={m}: {type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]}", flush=True)
            del trs
            torch.cuda.empty_cache()
        del wbs
        torch.cuda.empty_cache()

    if not rows:
        print("no rows measured (deadline?), nothing written")
        return
    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, f"{args.tag}.csv")
    with open(csv_path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        wr.writeheader()
        wr.writerows(rows)
    md = os.path.join(args.out_dir, f"{args.tag}.md")
    with open(md, "w") as f:
        f.write(f"# EXL3 linear benchmark\n\n- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
                f"- commit: {commit}\n- device: {torch.cuda.get_device_name(0)} ({sms} SMs), torch {torch.__version__}\n"
                f"- command: `python bench/bench_linear.py {' '.join(sys.argv[1:])}`\n"
                f"- measured ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s\n"
                f"- method: CUDA graph of {args.calls} calls on rotating weight copies (>= {args.pool_gb} GB pool or "
                f"<= 256 copies), median of {args.reps} replays; floor = max(bytes/BW, weights/decode-only rate, flops/GEMM rate); "
                f"rows with M <= {LIGHT_M} and the decode-only pass wait for NVML to report no power or thermal clock "
                f"cap (kernels/clock.py); bf16 is timed again beside every row it divides; "
                f"sm_mhz / bf16_sm_mhz: the SM clock read right after ours / bf16\n"
                f"- exllamav3: " + (f"{peer.PEER} ({os.path.basename(peer.__file__)}), what its LinearEXL3.forward runs: "
                                    f"exl3_gemm (own dispatch, path column) up to {PEER_RECON_ABOVE} rows, else reconstruct + "
                                    f"hgemm_recon; fp16 x, same trellis copies / suh / svh, same graph timing; "
                                    f"ours_vs_exllamav3 = exllamav3_us / ours_us" if peer else f"not measured ({NA})")
                + (f"\n- stopped at the --deadline after {len(rows)} rows" if stopped else "") + "\n\n")
        keys = list(rows[0].keys())
        f.write("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r[k2]) for k2 in keys) + " |\n")
    print(f"wrote {md} and {csv_path}")


if __name__ == "__main__":
    main()
