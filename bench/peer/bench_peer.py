"""Side-by-side benchmark on the GPU machine: exllamav3 1.6.5's EXL3 linear kernels vs torch bf16 matmul.

    # process "default": exllamav3's defaults (int8 GEMV for mul1 at m<=2, fp16 GEMV at m<=8 where eligible)
    python3 bench/peer/bench_peer.py --proc default --csv OUT/bench_default.csv --deadline UNIX_TIME
    # process "nogemv": tensor-core GEMM only (both switches are read once per process, hence a 2nd process)
    EXL3_GEMV=0 EXL3_INT8_GEMV=0 python3 bench/peer/bench_peer.py --proc nogemv --csv OUT/bench_nogemv.csv \
        --ceilings-from OUT/bench_default.csv --deadline UNIX_TIME

Methods (one CSV row each; times are per call, median over >= 20 calls):
  ceiling_copy   : D2D copy of 2 GiB (bytes = read + written)
  ceiling_gemm   : 8192^3 torch.matmul on random data (bf16, and fp16 as ceiling_gemm_fp16)
  decode_only    : our decode-only kernel (decode_only.cu) over an 8192x28672 trellis, per K and codebook
  bf16           : torch.matmul(x_bf16 (M,k), W_bf16 (k,n)) (cuBLAS)
  exl3_gemm      : ext.exl3_gemm(x, trellis, y, suh, xh, svh, -1, mcg, mul1, 0), autotune warmed first.
                   path column = its return value (0 int8 GEMV, 90 fp16 GEMV, else GEMM shape index)
  exl3_recon     : LinearEXL3.reconstruct_hgemm as in exllamav3 (modules/quant/exl3.py): M >= 1024 fused
                   reconstruct_had_slice + hgemm_recon(x, W); else had_r_128(x->xh, suh), reconstruct,
                   hgemm_recon(xh, W_hat), had_r_128(y, post=svh)
  (LinearEXL3.forward itself uses exl3_gemm for M <= 144 and exl3_recon above; report.py derives that row.)

Weights rotate through >= 4 GiB of distinct copies (views into one buffer), so no call sees its weights in the
60 MiB L2. A torch.cuda._sleep kernel is queued before each timed batch so host launch overhead is hidden and
CUDA events time the GPU work only. The run is ordered by priority and stops cleanly at --deadline.

Clock state: sustained large GEMMs put the H200 into its power cap (1980 -> ~1425 MHz for seconds after the load,
see clock_probe.py), which slows the decode-bound small-M kernels far more than bf16. So the default process runs a
light pass first (ceilings: copy, decode-only, then GEMM; then every M <= 256 row, each waiting for the SM clock to
be back at >= 97% of max), then the heavy pass (M > 256, where both sides run power-capped). Every row records the
NVML SM clock at its start and end (sm_mhz, sm_mhz_end).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peer_ext  # noqa: E402
from clocks import Clocks  # noqa: E402

LAYERS = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)]
M_ALL = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
M_RED = [1, 4, 16, 64, 256, 1024, 4096]
M_NOGEMV = [1, 2, 4, 8]
GEMM_MAX_M = 256          # exl3_gemm measured for M <= this
RECON_MIN_M = 64          # exl3_recon measured for M >= this
ROT_BYTES = 4 << 30
CBS = {"3inst": (False, False), "mcg": (True, False), "mul1": (False, True)}
CB_ID = {"3inst": 0, "mcg": 1, "mul1": 2}

FIELDS = ["proc", "phase", "method", "k", "n", "K", "cb", "M", "path", "us_median", "us_min", "us_max", "reps",
          "weight_bytes", "act_bytes", "out_bytes", "flops", "value", "unit", "note", "sm_mhz", "sm_mhz_end"]

M_LIGHT_MAX = 256         # light pass: M <= this (no sustained power draw); heavy pass: M > this


class Deadline(Exception):
    pass


class Bench:
    def __init__(self, ext, proc: str, csv_path: str, deadline: float):
        self.ext = ext
        self.proc = proc
        self.deadline = deadline
        self.f = open(csv_path, "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=FIELDS)
        self.w.writeheader()
        self.f.flush()
        self.dev = torch.device("cuda:0")
        self.cycles_per_us = self._sleep_rate()
        self.ceil = {}
        self.clk = Clocks()

    def _sleep_rate(self) -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        s.record()
        torch.cuda._sleep(2_000_000)
        e.record()
        torch.cuda.synchronize()
        return 2_000_000 / (s.elapsed_time(e) * 1000.0)

    def check(self):
        if time.time() > self.deadline:
            raise Deadline()

    def row(self, **kw):
        r = {k: "" for k in FIELDS}
        r.update(proc=self.proc)
        r.update(kw)
        self.w.writerow(r)
        self.f.flush()

    def time_op(self, fn, reps: int, warm: int, idx0: int = 0, rested: bool = False) -> tuple[list[float], object]:
        """fn(i) -> anything; returns (per-call µs list, return value of the first warm-up call).
        rested: wait for the SM clock to leave the power cap first (light measurements)."""
        if rested:
            torch.cuda.synchronize()
            self.clk.wait_rested()
        self.sm0 = self.clk.sm()
        ret = fn(idx0)
        for i in range(1, warm):
            fn(idx0 + i)
        torch.cuda.synchronize()
        # host enqueue cost per call (GPU idle -> pure host time)
        t = time.perf_counter()
        fn(idx0 + warm)
        host_us = (time.perf_counter() - t) * 1e6
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        sleep_us = min(200_000.0, reps * host_us * 1.5 + 100.0)
        torch.cuda._sleep(int(sleep_us * self.cycles_per_us))
        for i in range(reps):
            starts[i].record()
            fn(idx0 + warm + 1 + i)
            ends[i].record()
        torch.cuda.synchronize()
        self.sm1 = self.clk.sm()
        return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)], ret

    def emit(self, phase, method, times, **kw):
        self.row(phase=phase, method=method, us_median=f"{statistics.median(times):.3f}",
                 us_min=f"{min(times):.3f}", us_max=f"{max(times):.3f}", reps=len(times),
                 sm_mhz=self.sm0, sm_mhz_end=self.sm1, **kw)
        return statistics.median(times)

    # ---------------------------------------------------------------- ceilings
    def ceilings(self):
        n = 1 << 30                                            # 1 Gi bf16 elements = 2 GiB
        src = torch.randn(n, device=self.dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t, _ = self.time_op(lambda i: dst.copy_(src), 10, 2)
        us = self.emit("ceiling", "ceiling_copy", t, value=f"{4 * n / statistics.median(t) / 1e3:.1f}", unit="GB/s",
                       note="2 GiB D2D copy, bytes read+written")
        self.ceil["copy_gbs"] = 4 * n / us / 1e3
        del src, dst
        # decode-only rate (weights/s), our kernel
        k, n = 8192, 28672
        nsm = self.ext.g_get_num_sms(0)
        for K in range(1, 9):
            tr = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=self.dev)
            for cb in ("mul1", "mcg", "3inst"):
                self.check()
                best = None
                for blocks_per_sm in (4, 8, 16):
                    grid = nsm * blocks_per_sm
                    out = torch.empty(grid * 256, device=self.dev, dtype=torch.float32)
                    t, _ = self.time_op(lambda i: self.ext.peer_decode_only(tr, out, CB_ID[cb], grid), 20, 2,
                                        rested=True)
                    if best is None or statistics.median(t) < statistics.median(best[0]):
                        best = (t, grid)
                t, grid = best
                rate = k * n / statistics.median(t) / 1e3       # Gweights/s (weights per µs / 1e3)
                self.emit("ceiling", "decode_only", t, k=k, n=n, K=K, cb=cb, weight_bytes=k * n * K // 8,
                          value=f"{rate:.1f}", unit="Gweight/s", path=f"grid{grid}",
                          note="our decode_only.cu, trellis read from HBM, fp16 values summed in registers")
                self.ceil[("decode", K, cb)] = rate
                print(f"[ceil] decode-only K={K} {cb}: {rate:.0f} Gweight/s "
                      f"({k * n * K / 8 / statistics.median(t) / 1e3:.0f} GB/s of trellis)", flush=True)
            del tr

        for dt, name in ((torch.bfloat16, "ceiling_gemm"), (torch.float16, "ceiling_gemm_fp16")):
            a = torch.randn(8192, 8192, device=self.dev, dtype=dt)
            b = torch.randn(8192, 8192, device=self.dev, dtype=dt)
            c = torch.empty(8192, 8192, device=self.dev, dtype=dt)
            t, _ = self.time_op(lambda i: torch.matmul(a, b, out=c), 20, 3)
            tf = 2 * 8192 ** 3 / statistics.median(t) / 1e6
            self.emit("ceiling", name, t, flops=2 * 8192 ** 3, value=f"{tf:.1f}", unit="TFLOP/s",
                      note="8192^3 random")
            self.ceil[name] = tf
            del a, b, c
        print(f"[ceil] copy {self.ceil['copy_gbs']:.0f} GB/s, bf16 GEMM {self.ceil['ceiling_gemm']:.0f} TFLOP/s, "
              f"fp16 GEMM {self.ceil['ceiling_gemm_fp16']:.0f} TFLOP/s", flush=True)

    # ---------------------------------------------------------------- timing helpers
    def floor_us(self, wbytes, abytes, obytes, flops, K=None, cb=None, k=0, n=0, dense=False):
        if not self.ceil:
            return None
        t_bw = (wbytes + abytes + obytes) / (self.ceil["copy_gbs"] * 1e3)
        t_fl = flops / (self.ceil["ceiling_gemm"] * 1e6)
        t_dec = 0.0
        if not dense and ("decode", K, cb) in self.ceil:
            t_dec = k * n / (self.ceil[("decode", K, cb)] * 1e3)
        return max(t_bw, t_fl, t_dec)

    def report(self, tag, us, wbytes, abytes, obytes, flops, **kw):
        fl = self.floor_us(wbytes, abytes, obytes, flops, **kw)
        gbs = (wbytes + abytes + obytes) / us / 1e3
        tf = flops / us / 1e6
        pct = f"{100 * fl / us:5.1f}%" if fl else "  n/a"
        print(f"{tag:58s} {us:10.2f} us {gbs:8.0f} GB/s {tf:7.1f} TF/s floor {pct}", flush=True)

    def reps_for(self, est_us: float) -> int:
        return 30 if est_us < 2000 else 20

    # ---------------------------------------------------------------- bf16
    def bench_bf16(self, phase, layers, m_list):
        for (k, n) in layers:
            wb = 2 * k * n
            ncopy = max(4, math.ceil(ROT_BYTES / wb))
            buf = torch.randn(ncopy * k * n, device=self.dev, dtype=torch.bfloat16)
            ws = [buf[i * k * n:(i + 1) * k * n].view(k, n) for i in range(ncopy)]
            ctr = 0
            for M in m_list:
                self.check()
                x = torch.randn(M, k, device=self.dev, dtype=torch.bfloat16)
                y = torch.empty(M, n, device=self.dev, dtype=torch.bfloat16)
                est = 2 * M * k * n / 700e6 + wb / 4e6
                reps = self.reps_for(est)
                t, _ = self.time_op(lambda i: torch.matmul(x, ws[i % ncopy], out=y), reps, 3, ctr,
                                    rested=M <= M_LIGHT_MAX)
                ctr += reps + 4
                us = self.emit(phase, "bf16", t, k=k, n=n, M=M, weight_bytes=wb, act_bytes=2 * M * k,
                               out_bytes=2 * M * n, flops=2 * M * k * n)
                self.report(f"bf16 {k}x{n} M={M}", us, wb, 2 * M * k, 2 * M * n, 2 * M * k * n, dense=True)
            del buf, ws

    # ---------------------------------------------------------------- exl3
    def bench_exl3(self, phase, layer, K, cbs, m_list, methods):
        k, n = layer
        ext = self.ext
        tbytes = k * n * K // 8
        wbytes = tbytes + 2 * (k + n)
        ncopy = max(4, math.ceil(ROT_BYTES / tbytes))
        per = (k // 16) * (n // 16) * 16 * K
        buf = torch.randint(-32768, 32768, (ncopy * per,), dtype=torch.int16, device=self.dev)
        trs = [buf[i * per:(i + 1) * per].view(k // 16, n // 16, 16 * K) for i in range(ncopy)]
        wtmp = torch.empty(k, n, dtype=torch.half, device=self.dev)
        ctr = 0
        try:
            for cb in cbs:
                mcg, mul1 = CBS[cb]
                g = torch.Generator(device="cpu").manual_seed(k * 7 + n * 13 + K)
                suh = ((torch.randint(0, 2, (k,), generator=g) * 2 - 1) * (0.5 + torch.rand(k, generator=g))).half().to(self.dev)
                svh = ((torch.randint(0, 2, (n,), generator=g) * 2 - 1) * (0.5 + torch.rand(n, generator=g)) * 0.02).half().to(self.dev)
                for M in m_list:
                    x = torch.randn(M, k, device=self.dev, dtype=torch.half)
                    y = torch.empty(M, n, device=self.dev, dtype=torch.half)
                    xh = torch.empty_like(x)
                    ab, ob, fl = 2 * M * k, 2 * M * n, 2 * M * k * n
                    common = dict(k=k, n=n, K=K, cb=cb, M=M, weight_bytes=wbytes, act_bytes=ab, out_bytes=ob, flops=fl)
                    if "gemm" in methods and M <= GEMM_MAX_M:
                        self.check()
                        fn = lambda i: ext.exl3_gemm(x, trs[i % ncopy], y, suh, xh, svh, -1, mcg, mul1, 0)
                        t, ret = self.time_op(fn, 30, 3, ctr, rested=M <= M_LIGHT_MAX)
                        ctr += 34
                        us = self.emit(phase, "exl3_gemm", t, path=ret, **common)
                        self.report(f"exl3_gemm {k}x{n} K={K} {cb} M={M} path={ret}", us, wbytes, ab, ob, fl,
                                    K=K, cb=cb, k=k, n=n)
                    if "recon" in methods and M >= RECON_MIN_M:
                        self.check()
                        fused = M >= 1024

                        def fn(i, x=x, y=y, xh=xh, fused=fused, suh=suh, svh=svh, mcg=mcg, mul1=mul1):
                            tr = trs[i % ncopy]
                            if fused:
                                ext.reconstruct_had_slice(wtmp, tr, suh, svh, float(K), mcg, mul1, 0)
                                ext.hgemm_recon(x, wtmp, y)
                            else:
                                ext.had_r_128(x, xh, suh, None, 1.0)
                                ext.reconstruct(wtmp, tr, float(K), mcg, mul1)
                                ext.hgemm_recon(xh, wtmp, y)
                                ext.had_r_128(y, y, None, svh, 1.0)
                        est = fl / 600e6 + k * n * 2 / 2e6
                        reps = self.reps_for(est)
                        t, _ = self.time_op(fn, reps, 3, ctr, rested=M <= M_LIGHT_MAX)
                        ctr += reps + 4
                        p = "fused" if fused else "unfused"
                        us = self.emit(phase, "exl3_recon", t, path=p, **common)
                        self.report(f"exl3_recon {k}x{n} K={K} {cb} M={M} {p}", us, wbytes, ab, ob, fl,
                                    K=K, cb=cb, k=k, n=n)
        finally:
            del buf, trs, wtmp
            torch.cuda.empty_cache()


def load_ceilings(path, bench: Bench):
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["method"] == "ceiling_copy":
                bench.ceil["copy_gbs"] = float(r["value"])
            elif r["method"] in ("ceiling_gemm", "ceiling_gemm_fp16"):
                bench.ceil[r["method"]] = float(r["value"])
            elif r["method"] == "decode_only":
                bench.ceil[("decode", int(r["K"]), r["cb"])] = float(r["value"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proc", choices=["default", "nogemv"], required=True)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--deadline", type=float, default=time.time() + 540)
    ap.add_argument("--ceilings-from", default=None)
    ap.add_argument("--quick", action="store_true", help="headline subset only")
    ap.add_argument("--only-ceilings", action="store_true", help="copy / GEMM / decode-only ceilings only")
    ap.add_argument("--light-only", action="store_true", help="skip the heavy pass (M > 256)")
    a = ap.parse_args()
    if a.proc == "nogemv":
        assert os.environ.get("EXL3_GEMV") == "0" and os.environ.get("EXL3_INT8_GEMV") == "0"
    torch.manual_seed(1234)
    ext = peer_ext.load()
    print("[bench] info:", peer_ext.info(ext), flush=True)
    print(f"[bench] proc={a.proc} deadline in {a.deadline - time.time():.0f} s", flush=True)
    b = Bench(ext, a.proc, a.csv, a.deadline)
    t0 = time.time()
    big = (8192, 28672)
    others = [K for K in (2, 3, 5, 6, 8)]
    try:
        if a.proc == "default":
            # light pass first (M <= 256, each measurement on a rested clock), then the heavy pass (M > 256),
            # where the sustained GEMM power cap applies to exllamav3 and bf16 alike
            b.ceilings()
            b.row(phase="mark", method="phase_done", note=f"ceilings {time.time() - t0:.0f}s")
            if a.only_ceilings:
                return
            rest = [L for L in LAYERS if L != big]
            ML = [M for M in M_ALL if M <= M_LIGHT_MAX]
            MH = [M for M in M_ALL if M > M_LIGHT_MAX]
            b.bench_bf16("L1", [big], ML)
            b.bench_exl3("L1", big, 4, ["mul1", "mcg", "3inst"], ML, ("gemm", "recon"))
            b.row(phase="mark", method="phase_done", note=f"L1 {time.time() - t0:.0f}s")
            if a.quick:
                return
            b.bench_bf16("L2", rest, ML)
            for L in rest:
                b.bench_exl3("L2", L, 4, ["mul1", "mcg", "3inst"], ML, ("gemm", "recon"))
            b.row(phase="mark", method="phase_done", note=f"L2 {time.time() - t0:.0f}s")
            for K in others:
                for L in [big] + rest:
                    b.bench_exl3("L3", L, K, ["mul1", "mcg"], ML, ("gemm", "recon"))
            b.row(phase="mark", method="phase_done", note=f"L3 {time.time() - t0:.0f}s, waited {b.clk.waited:.0f}s for clocks")
            if a.light_only:
                return
            b.bench_bf16("H1", [big] + rest, MH)
            for L in [big] + rest:
                b.bench_exl3("H1", L, 4, ["mul1", "mcg", "3inst"], MH, ("recon",))
            b.row(phase="mark", method="phase_done", note=f"H1 {time.time() - t0:.0f}s")
            for K in others:
                for L in [big] + rest:
                    b.bench_exl3("H2", L, K, ["mul1", "mcg"], MH, ("recon",))
            b.row(phase="mark", method="phase_done", note=f"H2 {time.time() - t0:.0f}s, waited {b.clk.waited:.0f}s for clocks")
        else:
            if a.ceilings_from and os.path.exists(a.ceilings_from):
                load_ceilings(a.ceilings_from, b)
            b.bench_exl3("B1", big, 4, ["mul1", "mcg", "3inst"], M_NOGEMV, ("gemm",))
            rest = [L for L in LAYERS if L != big]
            for L in rest:
                b.bench_exl3("B1", L, 4, ["mul1", "mcg", "3inst"], M_NOGEMV, ("gemm",))
            b.row(phase="mark", method="phase_done", note=f"B1 {time.time() - t0:.0f}s")
            for K in others:
                for L in [big] + rest:
                    b.bench_exl3("B2", L, K, ["mul1", "mcg"], M_NOGEMV, ("gemm",))
            b.row(phase="mark", method="phase_done", note=f"B2 {time.time() - t0:.0f}s, waited {b.clk.waited:.0f}s for clocks")
    except Deadline:
        b.row(phase="mark", method="deadline", note=f"stopped at {time.time() - t0:.0f}s")
        print(f"[bench] deadline reached after {time.time() - t0:.0f} s", flush=True)
    finally:
        b.f.close()
    print(f"[bench] done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
