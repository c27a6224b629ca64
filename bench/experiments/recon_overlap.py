"""Issue 45 item 3, measured before building it: can the large-M path hide its weight reconstruction under cuBLAS's
GEMM by running the two on two streams over column chunks (chunk i+1 reconstructed while chunk i multiplies), with
cuBLAS's SM count optionally capped (torch's sm carveout) so the reconstruction has SMs of its own?

Per layer and M, one process: bf16 F.linear; our op as it is (force="dequant": reconstruct then multiply, chunk by
chunk, one stream); the reconstruction alone and the GEMM alone (their sum is the sequential bound, the larger their
overlapped bound); the two-stream pipeline at 2/4/8 chunks x carveouts. CUDA graphs of --calls calls on rotating
trellis copies (L2 defeated), median of --reps replays (tune.graph_time_us). Every variant's output is checked against
the op's own on fresh random x, into an output poisoned with NaN first (largest difference over the output's largest
value; NaN where a column was not written).

  python bench/experiments/recon_overlap.py --out $OUT/recon_overlap.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"))
from exl3_vllm.kernels import clock  # noqa: E402
from exl3_vllm.kernels import op as kop  # noqa: E402
from exl3_vllm.kernels.tune import graph_time_us as graph_time  # noqa: E402

# Llama-3-8B's linears (k x n): gate_up, down, qkv, o (the largest first, in case the deadline stops the run)
LAYERS = [(4096, 28672), (14336, 4096), (4096, 6144), (4096, 4096)]
CB = 2  # mul1


class Pipeline:
    """x @ W over column chunks: chunk i reconstructed on a side stream into one of two buffers while chunk i-1 is
    multiplied on the caller's stream; carve: SMs cuBLAS leaves free (0: none)."""

    def __init__(self, k, n, chunks, carve, dtype, priority):
        self.k, self.n, self.carve = k, n, carve
        cols = -(-n // (chunks * 128)) * 128
        self.chunks = [(c0, min(cols, n - c0)) for c0 in range(0, n, cols)]
        self.bufs = [torch.empty(cols * k, dtype=dtype, device="cuda") for _ in range(2)]
        self.side = torch.cuda.Stream(priority=priority)
        self.d = kop.device_for(0)
        self.lin = self.d.module(kop.LINEAR_SOURCE, kop.linear_defines(4, CB))

    def __call__(self, x, trellis, suh, svh, y):
        cur = torch.cuda.current_stream()
        self.side.wait_stream(cur)
        done = []
        for i, (c0, cols) in enumerate(self.chunks):
            buf = self.bufs[i % 2]
            ready = torch.cuda.Event()
            with torch.cuda.stream(self.side):
                if i >= 2:
                    self.side.wait_event(done[i - 2])  # the GEMM that read this buffer has finished
                kop.launch_recon(self.d, self.lin, self.side.cuda_stream, trellis, suh, svh, buf, self.n, c0, cols,
                                 self.k)
                ready.record(self.side)
            cur.wait_event(ready)
            w = buf[:cols * self.k].view(cols, self.k).t()
            if self.carve:
                torch._C._set_sm_carveout_experimental(self.carve)
            torch.mm(x, w, out=y[:, c0:c0 + cols])
            if self.carve:
                torch._C._set_sm_carveout_experimental(None)
            ev = torch.cuda.Event()
            ev.record(cur)
            done.append(ev)
        cur.wait_stream(self.side)
        return y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1024,256,4096")
    ap.add_argument("--layers", default="", help="e.g. 4096x4096 (default: Llama-3-8B's four)")
    ap.add_argument("--chunks", default="2,4,8")
    ap.add_argument("--carves", default="0,8,16,32")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pool-gb", type=float, default=1.0)
    ap.add_argument("--blas", default="cublas", help="torch's preferred BLAS library for every GEMM here")
    ap.add_argument("--deadline", type=float, default=0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "recon_overlap.json"))
    a = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    props = torch.cuda.get_device_properties(0)
    res = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__, "rows": []}
    layers = [tuple(int(v) for v in s.split("x")) for s in a.layers.split(",")] if a.layers else LAYERS
    ms = [int(v) for v in a.ms.split(",")]
    g = torch.Generator(device="cuda").manual_seed(1)
    # Whether the carveout reaches torch.mm at all: the same GEMM with and without it.
    xx = torch.randn(4096, 4096, device="cuda", dtype=dt)
    ww = torch.randn(4096, 4096, device="cuda", dtype=dt)
    probe = {}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for c in [0] + [int(v) for v in a.carves.split(",") if int(v)]:
            torch._C._set_sm_carveout_experimental(c or None)
            probe[f"{lib}/{c}"] = graph_time([lambda: torch.mm(xx, ww)] * 8, a.reps)
            torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library(a.blas)
    res["carveout_probe_us"] = probe
    res["blas"] = a.blas
    print("4096^3 GEMM us by library/carveout:", {c: round(t, 1) for c, t in probe.items()}, flush=True)
    for k, n in layers:
        nc = max(2, min(a.calls, -(-int(a.pool_gb * 2**30) // (k * n // 2))))
        trs = [torch.randint(-32768, 32768, (k // 16, n // 16, 64), dtype=torch.int16, device="cuda", generator=g)
               for _ in range(nc)]
        suh = ((torch.rand(k, device="cuda", generator=g) + 0.5) * 0.05).half()
        svh = ((torch.rand(n, device="cuda", generator=g) + 0.5) * 0.05).half()
        nb = max(2, min(a.calls, -(-int(a.pool_gb * 2**30) // (k * n * 2))))
        wbs = [torch.randn(n, k, device="cuda", dtype=dt, generator=g) * 0.02 for _ in range(nb)]
        kop.prepare(k, n, 4, CB, max(ms), torch.device("cuda"))
        pipes = {(c, s): Pipeline(k, n, c, s, dt, -1) for c in (int(v) for v in a.chunks.split(","))
                 for s in (int(v) for v in a.carves.split(","))}
        for m in ms:
            if a.deadline and time.time() > a.deadline:
                print("deadline: stopping", flush=True)
                break
            x = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
            ys = [torch.empty(m, n, device="cuda", dtype=dt) for _ in range(2)]
            tsel = (trs * a.calls)[:a.calls]
            clock.rest(0)
            row = {"k": k, "n": n, "m": m, "clock_mhz": clock.sm_mhz(0)}
            row["bf16"] = graph_time([lambda w=w: torch.mm(x, w.t(), out=ys[0])
                                      for w in (wbs * a.calls)[:a.calls]], a.reps)
            row["ours"] = graph_time([lambda t=t: kop.linear_cuda(x, t, suh, svh, None, [n], CB, out=ys[0],
                                                                   force="dequant") for t in tsel], a.reps)
            wfull = torch.empty(n * k, dtype=dt, device="cuda")
            d = kop.device_for(0)
            lin = d.module(kop.LINEAR_SOURCE, kop.linear_defines(4, CB))
            row["recon"] = graph_time([lambda t=t: kop.launch_recon(d, lin, torch.cuda.current_stream().cuda_stream,
                                                                     t, suh, svh, wfull, n, 0, n, k) for t in tsel],
                                      a.reps)
            wv = wfull.view(n, k).t()
            row["gemm"] = graph_time([lambda: torch.mm(x, wv, out=ys[0])] * a.calls, a.reps)
            # The op's own output on this x is the reference for every pipeline.
            ys[0].fill_(float("nan"))
            ref = kop.linear_cuda(x, trs[0], suh, svh, None, [n], CB, out=ys[0], force="dequant").clone()
            for (c, cv), p in pipes.items():
                ys[1].fill_(float("nan"))
                got = p(x, trs[0], suh, svh, ys[1])
                torch.cuda.synchronize()
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                t = graph_time([lambda t=t: p(x, t, suh, svh, ys[1]) for t in tsel], a.reps)
                row[f"pipe{c}c{cv}"] = t
                row[f"pipe{c}c{cv}_err"] = err
            best = min((v, kk) for kk, v in row.items() if kk.startswith("pipe") and not kk.endswith("_err"))
            row["best"] = best[1]
            res["rows"].append(row)
            print(f"{k}x{n} M={m}: bf16 {row['bf16']:.1f} ours {row['ours']:.1f} recon {row['recon']:.1f} gemm "
                  f"{row['gemm']:.1f} | best {best[1]} {best[0]:.1f} us ({row['ours'] / best[0]:.3f}x ours, "
                  f"{row['bf16'] / best[0]:.3f}x bf16; ours {row['bf16'] / row['ours']:.3f}x bf16) | max err "
                  f"{max(v for kk, v in row.items() if kk.endswith('_err')):.3g}", flush=True)
            json.dump(res, open(a.out, "w"), indent=1)
        del trs, wbs, pipes
        torch.cuda.empty_cache()
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
