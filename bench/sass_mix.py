"""Static instruction mix of a GEMM kernel's decode loop, per 16x16 trellis tile and lane, from its SASS (no GPU).

Compiles one (K, codebook) module with NVRTC as the package does (plus optional extra defines), disassembles it with
nvdisasm (the `nvidia-cuda-nvdisasm` wheel, or $NVDISASM / PATH), finds in each named kernel the loop holding the
most codebook multiplies (the decode loop: 8 per tile and lane) and prints its instructions per tile by opcode and
by pipe, with a cycles-per-tile estimate for one SM sub-partition (issue: 1 per clock; ALU and FMA-heavy pipes: a
warp instruction per 2 clocks each; FMA-lite: 1).

    python bench/sass_mix.py --bits 4 --cb mul1 --kernels h8_f16,h16_f16,i8_f16 [--defines NAME=1,..] [--arch 90]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from exl3_vllm.kernels import nvrtc  # noqa: E402
from exl3_vllm.format.codebook import Codebook  # noqa: E402
from exl3_vllm.kernels.variants import LINEAR_SOURCE, linear_defines  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_floor import compile_decode_sum  # noqa: E402

# One immediate per state and tile in each codebook's decode (exl3_common.cuh): how the loop's tiles are counted.
# mcg / mul1: the state multiplier; 3inst: its addend (ptxas keeps 3inst's multiplier in a register).
MULTIPLIERS = {0: 64248484, 1: 0xCBAC1FED, 2: 0x83DCD12D}
# Pipe of each opcode on sm_80 / sm_90 (CUDA guide throughput table: 64 results per clock per SM = 2 clocks per
# warp instruction per sub-partition, 128 = 1).
ALU = {"LOP3", "SHF", "PRMT", "IADD3", "ISETP", "SEL", "LEA", "MOV", "FSEL", "FSETP", "IMNMX", "SHL", "SHR", "LOP",
       "BMSK", "PLOP3", "P2R", "R2P", "FLO", "POPC", "BREV", "VIADD"}
FMA_HEAVY = {"IMAD", "IDP", "IMUL", "I2F", "F2I", "F2F", "F2FP"}
FMA_LITE = {"FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2", "FMNMX"}
MEM = {"LDS", "STS", "LDSM", "LDG", "STG", "LDGSTS", "SHFL", "RED", "ATOMG", "LD", "ST", "UBLKCP", "SYNCS"}
TENSOR = {"HMMA", "IMMA", "HGMMA", "IGMMA"}

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def find_nvdisasm() -> str:
    for cand in (os.environ.get("NVDISASM"), shutil.which("nvdisasm")):
        if cand and os.path.isfile(cand):
            return cand
    for site in sys.path:
        for hit in glob.glob(os.path.join(site, "nvidia", "*", "bin", "nvdisasm")):
            return hit
    raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or set NVDISASM to its path")


def disassemble(bits: float, codebook: int, arch: int = 90, defines: str = "") -> tuple[dict, dict]:
    """The linear module of (bits, codebook) for sm_<arch> and the benchmark's exl3_decode_sum (bench/cuda), through the
    package's NVRTC path and cache, with extra defines "NAME=V,.." (EXL3_VLLM_EXTRA_DEFINES' syntax):
    ({kernel: SASS lines}, {kernel: (registers, spill bytes)})."""
    saved = os.environ.get("EXL3_VLLM_EXTRA_DEFINES")
    os.environ["EXL3_VLLM_EXTRA_DEFINES"] = defines
    try:
        comps = [nvrtc.compile_source(LINEAR_SOURCE, arch, linear_defines(bits, codebook)),
                 compile_decode_sum(bits, codebook, arch)]
    finally:
        if saved is None:
            del os.environ["EXL3_VLLM_EXTRA_DEFINES"]
        else:
            os.environ["EXL3_VLLM_EXTRA_DEFINES"] = saved
    funcs, regs = {}, {}
    for comp in comps:
        with tempfile.TemporaryDirectory() as td:
            path = os.path.join(td, "m.cubin")
            Path(path).write_bytes(comp.cubin)
            sass = subprocess.run([find_nvdisasm(), "-c", path], check=True, capture_output=True, text=True).stdout
        funcs.update(functions(sass))
        regs.update({k.name: (k.registers, k.spill_stores) for k in comp.kernels()})
    return funcs, regs


def functions(sass: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.match(r"\s*\.text\.(\w+):", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is not None:
            cur.append(line)
    return out


def parse(lines: list[str]):
    """[(addr, opcode, operands)] and {label: addr of the next instruction}."""
    ins, labels, pending = [], {}, []
    for line in lines:
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INS.search(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            ins.append((addr, m.group(3), m.group(4)))
    return ins, labels


def is_multiply(op: str, args: str, mult: int) -> bool:
    if not op.startswith("IMAD") or op.startswith(("IMAD.MOV", "IMAD.SHL", "IMAD.IADD", "IMAD.U32", "IMAD.X")):
        return False
    signed = mult - (1 << 32) if mult >= 1 << 31 else mult
    return any(f in args.lower() for f in (hex(mult), f"-{hex(-signed)}" if signed < 0 else hex(signed)))


def decode_loop(ins, labels, mult: int):
    """The back-edge loop [start, end] holding the most codebook multiplies (the smallest such on a tie)."""
    best = None
    for addr, op, args in ins:
        if op != "BRA" and not op.startswith("BRA."):
            continue
        m = _TARGET.search(args)
        if not m or m.group(1) not in labels or labels[m.group(1)] > addr:
            continue
        lo = labels[m.group(1)]
        body = [i for i in ins if lo <= i[0] <= addr]
        n = sum(is_multiply(o, a, mult) for _, o, a in body)
        key = (n, -(addr - lo))
        if n and (best is None or key > best[0]):
            best = (key, body)
    return best[1] if best else None


def pipe(op: str) -> str:
    base = op.split(".")[0]
    if base in TENSOR:
        return "tensor"
    if base in FMA_HEAVY:
        return "fma_heavy"
    if base in FMA_LITE:
        return "fma_lite"
    if base in ALU:
        return "alu"
    if base in MEM:
        return "mem"
    return "other"


def opname(op: str) -> str:
    parts = op.split(".")
    if parts[0] == "IMAD" and len(parts) > 1 and parts[1] in ("MOV", "IADD", "SHL", "U32", "WIDE", "X", "HI"):
        return "IMAD." + parts[1]
    return parts[0]


def mix(body, mult: int) -> dict:
    tiles = sum(is_multiply(o, a, mult) for _, o, a in body) / 8
    ops = Counter(opname(o) for _, o, _ in body)
    pipes = Counter(pipe(o) for _, o, _ in body)
    per = {k: v / tiles for k, v in ops.items()}
    pp = {k: v / tiles for k, v in pipes.items()}
    issue = len(body) / tiles
    cycles = {"issue": issue, "alu": 2 * pp.get("alu", 0), "fma_heavy": 2 * pp.get("fma_heavy", 0),
              "fma_lite": pp.get("fma_lite", 0)}
    return {"tiles": tiles, "ops": per, "pipes": pp, "issue": issue, "cycles": cycles,
            "bound": max(cycles, key=cycles.get)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=float, default=4)
    ap.add_argument("--cb", default="mul1", help="3inst, mcg or mul1")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--kernels", default="h8_f16,h16_f16", help="exl3_gemm_<name> kernels, comma-separated")
    ap.add_argument("--defines", default="", help="extra compile-time defines NAME=V,.. (experiment switches)")
    ap.add_argument("--top", type=int, default=14, help="opcodes listed per kernel")
    args = ap.parse_args(argv)
    cb = int(Codebook.of(int(args.cb) if args.cb.isdigit() else args.cb))
    bits = int(args.bits) if args.bits == int(args.bits) else args.bits
    funcs, regs = disassemble(bits, cb, args.arch, args.defines)
    print(f"K={bits} {Codebook(cb).label} sm_{args.arch} defines={args.defines or '-'}")
    print("| kernel | regs | spill B | tiles/iter | instr/tile | ALU | FMA-heavy | FMA-lite | mem | tensor | "
          "est. clk/tile (bound) | top opcodes per tile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in filter(None, args.kernels.split(",")):
        full = name if name.startswith("exl3_") else f"exl3_gemm_{name}"
        if full not in funcs:
            print(f"| {full} | not in this module |")
            continue
        body = decode_loop(*parse(funcs[full]), MULTIPLIERS[cb])
        if body is None:
            print(f"| {full} | no decode loop found |")
            continue
        r = mix(body, MULTIPLIERS[cb])
        p = r["pipes"]
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["ops"].items(), key=lambda kv: -kv[1])[:args.top])
        rg, sp = regs.get(full, ("?", "?"))
        print(f"| {full} | {rg} | {sp} | {r['tiles']:g} | {r['issue']:.2f} | {p.get('alu', 0):.2f} | "
              f"{p.get('fma_heavy', 0):.2f} | {p.get('fma_lite', 0):.2f} | {p.get('mem', 0):.2f} | "
              f"{p.get('tensor', 0):.2f} | {r['cycles'][r['bound']]:.1f} ({r['bound']}) | {top} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
