"""Does the GPU's clock/thermal state move exllamav3's timings? (diagnostic, runs on the GPU machine)

    EXL3_PEER_SO=.peer/lib/exl3_peer.so python3 bench/peer/clock_probe.py

Times exl3_gemm (8192x28672, K=4, mcg and mul1, M=1 and 16), bf16 M=1 and our decode-only kernel, first on a rested
GPU, then right after ~4 s of back-to-back 8192^3 bf16 GEMMs, then after 6 s idle; logs SM clock, power,
temperature and NVML throttle reasons next to every timing. Same methodology as bench_peer.py (rotated weights,
CUDA events, queued sleep kernel, median of 30).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_ext  # noqa: E402
from bench_peer import Bench  # noqa: E402

try:
    import pynvml
    pynvml.nvmlInit()
    H = pynvml.nvmlDeviceGetHandleByIndex(0)
except Exception as e:  # pragma: no cover
    H = None
    print("no NVML:", e)


def gpu_state() -> str:
    if H is None:
        return ""
    sm = pynvml.nvmlDeviceGetClockInfo(H, pynvml.NVML_CLOCK_SM)
    p = pynvml.nvmlDeviceGetPowerUsage(H) / 1000
    t = pynvml.nvmlDeviceGetTemperature(H, pynvml.NVML_TEMPERATURE_GPU)
    try:
        r = pynvml.nvmlDeviceGetCurrentClocksEventReasons(H)
    except Exception:
        r = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(H)
    return f"sm {sm} MHz, {p:.0f} W, {t} C, reasons 0x{r:x}"


def main():
    ext = peer_ext.load()
    b = Bench(ext, "probe", "/tmp/probe.csv", time.time() + 300)
    dev = torch.device("cuda:0")
    k, n, K = 8192, 28672, 4
    per = (k // 16) * (n // 16) * 16 * K
    ncopy = 36
    buf = torch.randint(-32768, 32768, (ncopy * per,), dtype=torch.int16, device=dev)
    trs = [buf[i * per:(i + 1) * per].view(k // 16, n // 16, 16 * K) for i in range(ncopy)]
    g = torch.Generator(device="cpu").manual_seed(1)
    suh = ((torch.randint(0, 2, (k,), generator=g) * 2 - 1) * (0.5 + torch.rand(k, generator=g))).half().to(dev)
    svh = ((torch.randint(0, 2, (n,), generator=g) * 2 - 1) * (0.5 + torch.rand(n, generator=g)) * 0.02).half().to(dev)
    wb = torch.randn(10 * k * n, device=dev, dtype=torch.bfloat16)
    wbs = [wb[i * k * n:(i + 1) * k * n].view(k, n) for i in range(10)]
    xs = {M: torch.randn(M, k, device=dev, dtype=torch.half) for M in (1, 16)}
    ys = {M: torch.empty(M, n, device=dev, dtype=torch.half) for M in (1, 16)}
    xhs = {M: torch.empty(M, k, device=dev, dtype=torch.half) for M in (1, 16)}
    xb = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    yb = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(132 * 8 * 256, device=dev, dtype=torch.float32)
    ctr = [0]

    def measure(tag):
        res = []
        for cb, (mcg, mul1) in (("mcg", (True, False)), ("mul1", (False, True))):
            for M in (1, 16):
                fn = lambda i, M=M, mcg=mcg, mul1=mul1: ext.exl3_gemm(xs[M], trs[i % ncopy], ys[M], suh, xhs[M], svh, -1, mcg, mul1, 0)
                st0 = gpu_state()
                t, ret = b.time_op(fn, 30, 3, ctr[0]); ctr[0] += 34
                res.append(f"  exl3_gemm {cb} M={M:<2} path={ret:<3} {statistics.median(t):8.1f} us  [{st0} -> {gpu_state()}]")
        st0 = gpu_state()
        t, _ = b.time_op(lambda i: torch.matmul(xb, wbs[i % 10], out=yb), 30, 3)
        res.append(f"  bf16 M=1                {statistics.median(t):8.1f} us  [{st0} -> {gpu_state()}]")
        st0 = gpu_state()
        t, _ = b.time_op(lambda i: ext.peer_decode_only(trs[i % ncopy], out, 1, 132 * 8), 20, 2)
        res.append(f"  decode_only mcg K=4     {statistics.median(t):8.1f} us  [{st0} -> {gpu_state()}]")
        print(f"[{tag}]", flush=True)
        print("\n".join(res), flush=True)

    print("idle:", gpu_state(), flush=True)
    measure("rested (autotune included in warm-up)")
    measure("rested, again")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    t0 = time.time()
    while time.time() - t0 < 4.0:
        for _ in range(20):
            torch.matmul(a, a, out=c)
        torch.cuda.synchronize()
    print("after 4 s of bf16 GEMM:", gpu_state(), flush=True)
    measure("hot (right after GEMM load)")
    time.sleep(6)
    print("after 6 s idle:", gpu_state(), flush=True)
    measure("after 6 s idle")


if __name__ == "__main__":
    main()
