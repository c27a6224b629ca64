"""`exl3-vllm kernels --compile-only`: compile every kernel variant with NVRTC and report resources."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

DEFAULT_ARCHS = "sm_80,sm_86,sm_89,sm_90,sm_120"
# Opt-in dynamic shared memory per block, by arch (bytes).
SMEM_OPTIN = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024,
              100: 227 * 1024, 103: 227 * 1024, 120: 99 * 1024, 121: 99 * 1024}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kernels", help="compile the EXL3 CUDA kernels with NVRTC and report resources")
    p.add_argument("--compile-only", action="store_true", help="compile (no GPU needed) and report; the only mode for now")
    p.add_argument("--arch", default=DEFAULT_ARCHS, help=f"comma-separated targets (default {DEFAULT_ARCHS})")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write the disk cache")
    p.add_argument("--subset", action="store_true",
                   help="a representative subset (every codebook, K in 1, 2.5, 4, 8) instead of all variants")
    p.set_defaults(func=main)
    return p


def _parse_archs(text: str) -> list[int]:
    out = []
    for a in text.split(","):
        a = a.strip().lower().removeprefix("sm_").removeprefix("compute_")
        if not a.isdigit():
            raise SystemExit(f"--arch: '{a}' is not like sm_90")
        out.append(int(a))
    return out


def _compile_one(job):
    source, defines, arch, use_cache = job
    from .nvrtc import KernelError, compile_source
    t0 = time.time()
    try:
        c = compile_source(source, arch, defines, use_cache=use_cache)
        return job, [k.__dict__ for k in c.kernels()], None, time.time() - t0, c.cached
    except KernelError as e:
        return job, [], str(e), time.time() - t0, False


def jobs_for(archs: list[int], subset: bool, use_cache: bool = True) -> list:
    from .variants import all_modules
    mods = all_modules()
    if subset:
        keep = {1, 4, 8}
        mods = [m for m in mods if not m[1] or m[1]["EXL3_KA"] in keep and not m[1]["EXL3_HALF"]
                or (m[1]["EXL3_KA"] == 2 and m[1]["EXL3_HALF"])]
    return [(s, d, a, use_cache) for a in archs for (s, d) in mods]


def run_compile(archs: list[int], jobs: int = 1, subset: bool = False, use_cache: bool = True,
                out=sys.stdout, progress=None) -> int:
    """Compile every module (or the CI subset) and print each kernel's resources; progress(line) after each module."""
    from .nvrtc import nvrtc_version
    from .variants import TIERS
    todo = jobs_for(archs, subset, use_cache)
    print(f"NVRTC {'.'.join(map(str, nvrtc_version()))}: {len(todo)} modules for "
          f"{', '.join(f'sm_{a}' for a in archs)} with {jobs} process(es)", file=out)
    t0 = time.time()
    failures = 0
    results = []
    with ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else contextlib.nullcontext() as ex:
        for r in (ex.map(_compile_one, todo) if ex else map(_compile_one, todo)):
            results.append(r)
            if progress:
                progress(f"{len(results)}/{len(todo)} modules compiled ({time.time() - t0:.0f}s)")
    print(f"{'arch':>6} {'module':<28} {'kernel':<24} {'regs':>4} {'smem(dyn)':>9} {'stack':>5} {'spill':>5}", file=out)
    for (source, defines, arch, _), kernels, err, dt, cached in results:
        mod = source.removesuffix(".cu")
        if defines:
            bits = defines["EXL3_KA"] + (0.5 if defines["EXL3_HALF"] else 0)
            mod += f" K={bits:g} cb={defines['EXL3_CB']}"
        if err:
            failures += 1
            print(f"sm_{arch:<3} {mod:<28} COMPILE ERROR\n{err}", file=out)
            continue
        for k in kernels:
            dyn = 0
            parts = k["name"].split("_")
            tname = parts[2] if len(parts) > 2 and parts[2] in TIERS else parts[2][:-1] if len(parts) > 2 else ""
            if k["name"].startswith("exl3_gemm_") and tname in TIERS and defines:
                dyn = TIERS[tname].smem(bits)  # "i8s" is the stream-k twin of "i8"
            spill = k["spill_stores"] + k["spill_loads"]
            flag = ""
            if spill:
                failures += 1
                flag = "  SPILL"
            if dyn > SMEM_OPTIN.get(arch, 99 * 1024):
                flag += "  (smem over the arch limit: runtime uses a smaller tier)"
            print(f"sm_{arch:<3} {mod:<28} {k['name']:<24} {k['registers']:>4} {k['smem_static'] + dyn:>9} "
                  f"{k['stack']:>5} {spill:>5}{flag}", file=out)
    n_cached = sum(1 for r in results if r[4])
    print(f"{len(results)} modules ({n_cached} from cache) in {time.time() - t0:.1f}s; "
          f"{failures} failure(s)", file=out)
    return 1 if failures else 0


def main(args) -> int:
    try:
        archs = _parse_archs(args.arch)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    try:
        return run_compile(archs, max(1, args.jobs), args.subset, not args.no_cache)
    except Exception as e:  # noqa: BLE001 - report any setup failure as a non-zero exit
        from .nvrtc import KernelError
        if isinstance(e, (KernelError, ImportError)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="exl3-vllm")
    sp = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sp)
    ns = ap.parse_args()
    sys.exit(ns.func(ns))
