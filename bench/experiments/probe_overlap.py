"""Overlap probe: does the trellis decode (integer ALU work) overlap the tensor cores' wgmma on one SM (sm_90a)?

python bench/experiments/probe_overlap.py [--codebooks 2,1] [--out FILE]

One block per SM runs bench/experiments/probe_overlap.cu: MMA warpgroups issue back-to-back wgmmas while decode warpgroups decode
trellis tiles from shared memory; each role alone, then both together (same iteration counts), timed with CUDA events
and per-warp clock64. overlap = (alone_mma + alone_decode - both) / min(alone_mma, alone_decode): 1 = the shorter
role hides completely, 0 = the two serialize. Also the fused loop of the w tiers (decode -> wgmma in the same warps).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from exl3_vllm.kernels import nvrtc  # noqa: E402
from exl3_vllm.kernels.variants import linear_defines  # noqa: E402

PROBE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe_overlap.cu")


def compile_probe(bits: int, codebook: int, arch: int = 90) -> nvrtc.Compiled:
    with open(PROBE_SOURCE, "rb") as f:
        text = f.read()
    return nvrtc.compile_source("probe_overlap.cu", arch, linear_defines(bits, codebook), text=text)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codebooks", default="2,1", help="0/1/2 = 3inst/mcg/mul1")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = []

    def emit(s):
        print(s, flush=True)
        lines.append(s)

    emit(f"device: {torch.cuda.get_device_name(0)} ({sms} SMs), K={args.bits}")
    emit("| codebook | wgmma | MMA warpgroups | decode warpgroups | MMA iters | decode iters | MMA alone µs | "
         "decode alone µs | both µs | MMA clk/iter alone → both | decode clk/tile/warp alone → both | overlap |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
    fused = []
    for cb in (int(c) for c in args.codebooks.split(",")):
        cname = {0: "3inst", 1: "mcg", 2: "mul1"}[cb]
        mod = nvrtc.Module(compile_probe(args.bits, cb), 0)
        w32 = 8 * args.bits
        for kind, n, threads in (("rs", 64, 512), ("rs", 128, 512), ("ss", 64, 384), ("ss", 128, 384),
                                 ("ss", 256, 384)):
            smem = 1024 + 4 * n * 32 + (4 * 64 * 32 if kind == "ss" else 0) + 64 * w32 * 4
            f = mod.function(f"probe_{kind}{n}", smem)
            nw = threads // 32
            sink = torch.empty(sms * threads, dtype=torch.int32, device=dev)
            clk = torch.empty(sms * nw * 2, dtype=torch.int64, device=dev)

            def run(nmma, mi, ai, mode):
                st = torch.cuda.current_stream().cuda_stream
                a = [ctypes.c_int32(nmma), ctypes.c_int32(mi), ctypes.c_int32(ai), ctypes.c_int32(mode),
                     ctypes.c_uint64(sink.data_ptr()), ctypes.c_uint64(clk.data_ptr())]
                nvrtc.launch(f, (sms, 1, 1), (threads, 1, 1), smem, st, a)
                ts = []
                for _ in range(5):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    nvrtc.launch(f, (sms, 1, 1), (threads, 1, 1), smem, st, a)
                    e1.record()
                    e1.synchronize()
                    ts.append(e0.elapsed_time(e1) * 1000)
                c = clk.view(sms, nw, 2).double()
                d = c[..., 1] - c[..., 0]
                mma_clk = d[:, :4 * nmma].mean().item() if nmma else 0.0
                alu_clk = d[:, 4 * nmma:].mean().item() if 4 * nmma < nw else 0.0
                return sorted(ts)[2], mma_clk, alu_clk

            mi = 20000 * 64 // n
            for nmma in (1, 2):
                for ai in (10000, 20000):
                    t1, t2, t3 = run(nmma, mi, ai, 1), run(nmma, mi, ai, 2), run(nmma, mi, ai, 3)
                    ov = (t1[0] + t2[0] - t3[0]) / min(t1[0], t2[0])
                    emit(f"| {cname} | {kind.upper()} m64n{n}k16 | {nmma} | {nw // 4 - nmma} | {mi} | {ai} | "
                         f"{t1[0]:.0f} | {t2[0]:.0f} | {t3[0]:.0f} | {t1[1] / mi:.1f} → {t3[1] / mi:.1f} | "
                         f"{t2[2] / ai:.0f} → {t3[2] / ai:.0f} | {ov:.2f} |")
            if kind == "rs":
                t4, t5, t6 = run(4, mi, 0, 4), run(4, mi, 0, 5), run(4, mi, 0, 6)
                fused.append(f"| {cname} | RS m64n{n}k16 | {t5[0]:.0f} | {t6[0]:.0f} | {t4[0]:.0f} | "
                             f"{(t5[0] + t6[0] - t4[0]) / min(t5[0], t6[0]):.2f} |")
    emit("")
    emit("Fused loop (4 warpgroups, each step: decode a tile, wgmma it, wait):")
    emit("| codebook | wgmma | decode only µs | wgmma only µs | both µs | overlap |")
    emit("|---|---|---|---|---|---|")
    for s in fused:
        emit(s)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
