"""Measured dispatch: per layer shape and row bucket, the fastest path a call may take, timed once and cached.

prepare() times the candidates (the int8 tier, the Hopper wgmma tier and its 128-column twin, the mma.sync tier,
dequantize + cuBLAS), then the two fastest tiers again at other split-k factors (buckets up to split_bucket() rows),
on random data of the layer's shape at each bucket of rows up to the layer's max_m, outside any graph capture, and
keeps the winner in memory and in a JSON file per (GPU, driver, CUDA, NVRTC, package version, tier set). A call with
m rows uses the choice of the smallest bucket >= m. EXL3_VLLM_TUNE=0 or deterministic mode keep the static plan.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import List, Optional

import torch

from .. import settings
from . import clock, nvrtc, variants
from .dispatch import (DEQUANT, Choice, deterministic, int8_ok, mma_tier, plan, switched_on, wg_enabled, wg_tier,
                       ws_enabled, ws_tier)
from .nvrtc import KernelError, cache_dir, nvrtc_version
from .variants import IO_SOURCE, LINEAR_SOURCE, TIERS

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Weight copies rotate through at least this many bytes so small layers are not timed from L2.
_ROTATE_BYTES = 192 << 20

# Buckets up to this many rows are timed on a rested clock (kernels/clock.py): their kernels are decode-bound.
LIGHT_BUCKET = 256

# Which paths a bucket times (candidates, with_splits); part of the cache key, so a new rule re-times.
TUNE_RULE = 3

# The linear op whose paths are timed, and how to drop its launch recipes made while timing (they hold the timing's
# workspace): kernels/op.py sets both when imported (this module never imports op).
run_linear = None
forget_recipes = None

_table: dict[tuple, dict[int, str]] = {}
_generation = 0  # counts changes to _table: a launch recipe decided from an older table is not reused
_disk: dict[int, dict] = {}
_lock = threading.Lock()


def enabled() -> bool:
    return settings.get("EXL3_VLLM_TUNE") and not deterministic()


def split_bucket() -> int:
    """The largest bucket whose best tiers are also timed at other split-k factors (0: none)."""
    return settings.get("EXL3_VLLM_TUNE_SPLITS")


def bucket(m: int) -> int:
    return next((b for b in BUCKETS if b >= m), BUCKETS[-1])


def layer_key(k: int, n_total: int, bits: float, codebook: int, sizes: List[int]) -> str:
    return f"{k}x{n_total}-K{bits:g}-cb{codebook}-s{'_'.join(str(s) for s in sizes)}"


def tier_set_tag() -> str:
    """A short digest of what the timings depend on besides the device: the kernel sources, the tiers, the timing
    rule and the settings marked keys_tune (settings.py). A cache file timed by another build is not read."""
    tag = ",".join(sorted(variants.TIERS)) + f";rule{TUNE_RULE};" + settings.tune_digest()
    h = hashlib.sha1(tag.encode())
    for name in (LINEAR_SOURCE, IO_SOURCE) + nvrtc.HEADERS:
        h.update(nvrtc.read_source(name))
    return h.hexdigest()[:8]


def device_key(index: int) -> str:
    from .. import __version__
    props = torch.cuda.get_device_properties(index)
    drv = nvrtc.driver_version()
    nv = ".".join(str(v) for v in nvrtc_version())
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{props.name}-sm{props.major}{props.minor}-drv{drv}-"
                                            f"cuda{torch.version.cuda}-nvrtc{nv}-exl3vllm{__version__}-"
                                            f"tiers{tier_set_tag()}")


def _path(index: int) -> Path:
    return cache_dir().parent / "tune" / f"{device_key(index)}.json"


def read_table(path: Path) -> dict:
    """{layer key: {bucket: path}} from a cache file; a missing or damaged file reads as empty (re-timed)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: {str(b): str(c) for b, c in v.items()} for k, v in data.items() if isinstance(v, dict)}


def merge_write(path: Path, entries: dict) -> None:
    """Merge entries into the file (other processes, e.g. tensor-parallel ranks, may have written other layers)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = read_table(path)
        for k, v in entries.items():
            merged.setdefault(k, {}).update(v)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs re-timing at the next start


def _load(index: int) -> dict:
    if index not in _disk:
        _disk[index] = read_table(_path(index))
    return _disk[index]


def generation() -> int:
    return _generation


def choice(d, m: int, k: int, n_total: int, bits: float, codebook: int, sizes: List[int]) -> Optional[Choice]:
    """The measured path for m rows of this layer on device d, or None (not tuned: use the static plan)."""
    if not enabled():
        return None
    t = _table.get((d.index, layer_key(k, n_total, bits, codebook, sizes)))
    return t.get(bucket(m)) if t else None


def candidates(d, m: int, k: int, bits: float, codebook: int, col_align: int) -> list[Choice]:
    """Every path worth timing for m rows: the int8 tier, the Hopper tiers, the mma.sync tier, dequant (a tier
    re-decodes the weights once per row block, so only blocks near m compete)."""
    out = []
    if int8_ok(m, k, codebook, d.smem_limit):
        out += ["i4", "i8"] if m <= TIERS["i4"].bm else ["i8"]
    if m <= TIERS["h16"].bm:
        out.append("h8" if m <= TIERS["h8"].bm else "h16")
    t = wg_tier(m, bits, d.smem_limit, col_align) if wg_enabled(d.arch) and m <= 128 else None
    if t is not None:
        out.append(t.name)
        # Its 128-column twin as well: two smaller blocks per SM were faster on some layers (4096x4096 at 64-128 rows).
        twin = TIERS.get(t.name + "n")
        if twin is not None and twin.smem(bits) <= d.smem_limit and col_align % twin.cols == 0:
            out.append(twin.name)
    if ws_enabled(d.arch) and m >= 32:
        # Row blocks within a factor 2 of m (a smaller block decodes twice but may pipeline better), else the largest.
        near = [t.name for t in TIERS.values() if t.ws and m <= 2 * t.bm and t.bm <= 2 * m and t.smem(bits) <= d.smem_limit]
        t = ws_tier(m, bits, d.smem_limit)
        out += near or ([t.name] if t is not None else [])
    t = mma_tier(m, bits, d.smem_limit) if m <= 128 else None
    if t is not None:
        out.append(t.name)
    out = [Choice(c) for c in out if switched_on(Choice(c), d.arch)]
    return out + [Choice(DEQUANT)] if m >= 32 or not out else out


def with_fixed(d, cands: list[Choice], m: int, k: int, n_total: int, bits: float, codebook: int,
               sizes: List[int]) -> list[Choice]:
    """Each tier that would run stream-k here, also with fixed split-k: which is faster depends on the layer
    (stream-k's partial column blocks go through the fp32 workspace)."""
    out = []
    for c in cands:
        out.append(c)
        if c.tier != DEQUANT and plan(m, k, n_total, bits, d.sms, d.smem_limit, codebook, d.arch,
                                      math.gcd(*sizes), c).stream:
            out.append(Choice(c.tier, fixed=True))
    return out


def fastest_tiers(times: dict, n: int = 2) -> list[Choice]:
    """The fastest timing of each of the n fastest distinct tiers (dequant has no split factor): a tier's stream-k and
    fixed split-k runs count once, so a second tier whose other split factors may win is not crowded out."""
    out, seen = [], set()
    for c in sorted(times, key=times.get):
        if c.tier != DEQUANT and c.tier not in seen:
            seen.add(c.tier)
            out.append(c)
    return out[:n]


def with_splits(d, best: list[Choice], m: int, k: int, n_total: int, bits: float, codebook: int,
                sizes: List[int]) -> list[Choice]:
    """The best tiers again at other fixed split-k factors: half and twice the static factor, and the
    factors whose grids fill 1..4 whole waves of one block per SM (a tier may fit one or two per SM). Fewer splits
    mean fewer atomics and x re-reads, more mean more resident blocks to hide the decode latency. Factors are listed as
    the plan runs them (a factor that rounds to whole stages of another is timed once)."""
    out = []
    for c in best:
        tier = c.tier
        if tier == DEQUANT:
            continue
        t = TIERS[tier]

        def runs(s: int) -> int:
            return plan(m, k, n_total, bits, d.sms, d.smem_limit, codebook, d.arch, math.gcd(*sizes),
                        Choice(tier, True, s or None)).splits
        base = runs(0)
        blocks = (n_total // t.cols) * -(-m // t.bm)
        # (plan caps a factor at one k16 stage per split)
        want = [max(1, base // 2), 2 * base] + [max(1, w * d.sms // blocks) for w in (1, 2, 3, 4)]
        seen = {base}
        for s in want:
            s = runs(s)
            if s not in seen:
                seen.add(s)
                out.append(Choice(tier, True, s))
    return list(dict.fromkeys(out))


def graph_time_us(calls: list, reps: int) -> float:
    """GPU time per call in microseconds: the calls captured in one CUDA graph (Python launch cost would dominate
    small layers), median over reps replays. The first two calls run uncaptured to load modules and grow workspace."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(calls))
    del g
    times.sort()
    return times[len(times) // 2]


def ensure(d, k: int, n_total: int, bits: float, codebook: int, sizes: List[int], max_m: int) -> None:
    """Time every bucket up to max_m's bucket not yet known for this layer shape (memory, then disk, then GPU)."""
    if not enabled() or torch.cuda.is_current_stream_capturing():
        return
    key = layer_key(k, n_total, bits, codebook, sizes)
    want = [b for b in BUCKETS if b <= bucket(max(1, max_m))]
    global _generation
    with _lock:
        table = _table.setdefault((d.index, key), {})
        known = len(table)
        try:
            _fill(d, k, n_total, bits, codebook, sizes, key, want, table)
        finally:
            _generation += len(table) != known


def _fill(d, k, n_total, bits, codebook, sizes, key, want, table) -> None:
    disk = _load(d.index).setdefault(key, {})
    for b in want:
        if b not in table and str(b) in disk:
            try:
                table[b] = Choice.parse(disk[str(b)])
            except KernelError:  # a hand-edited or foreign entry: timed again
                pass
    todo = [b for b in want if b not in table]
    if not todo:
        return
    _measure(d, k, n_total, bits, codebook, sizes, todo, table)
    disk.update({str(b): str(v) for b, v in table.items()})
    merge_write(_path(d.index), {key: disk})


def _measure(d, k, n_total, bits, codebook, sizes, todo, table) -> None:
    dev = d.device
    words = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
    nbytes = k * n_total * words // 8
    copies = max(1, min(4, -(-_ROTATE_BYTES // nbytes)))
    g = torch.Generator(device=dev).manual_seed(0)
    trs = [torch.randint(-32768, 32768, (k // 16, n_total // 16, words), dtype=torch.int16, device=dev, generator=g)
           for _ in range(copies)]
    suh = (torch.rand(len(sizes), k, device=dev, generator=g) + 0.5).half()
    svh = (torch.rand(n_total, device=dev, generator=g) + 0.5).half()
    col_align = math.gcd(*sizes)
    try:
        # Paths timed but not chosen may grow the workspace far past what the chosen ones need: released afterwards.
        with d.scratch_workspace():
            _measure_buckets(d, k, n_total, bits, codebook, sizes, todo, table, g, trs, suh, svh, col_align)
    finally:
        del trs
        forget_recipes()
        torch.cuda.empty_cache()


def _measure_buckets(d, k, n_total, bits, codebook, sizes, todo, table, g, trs, suh, svh, col_align) -> None:
    dev = d.device
    for b in todo:
        if b <= LIGHT_BUCKET:
            clock.rest(d.index)
        x = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=g)
        y = torch.empty(b, n_total, device=dev, dtype=torch.bfloat16)
        times: dict[Choice, float] = {}
        cands = with_fixed(d, candidates(d, b, k, bits, codebook, col_align), b, k, n_total, bits, codebook, sizes)
        _time_all(x, y, trs, suh, svh, sizes, codebook, b, cands, times)
        if b <= split_bucket():
            best = fastest_tiers(times)
            more = [c for c in with_splits(d, best, b, k, n_total, bits, codebook, sizes) if c not in times]
            _time_all(x, y, trs, suh, svh, sizes, codebook, b, more, times)
        if times:
            table[b] = min(times, key=times.get)


def _time_all(x, y, trs, suh, svh, sizes, codebook, b, cands, times) -> None:
    """GPU time of each candidate path into times (a path this layer cannot run is left out)."""
    calls = {c: [lambda c=c, t=trs[i % len(trs)]: run_linear(x, t, suh if len(sizes) > 1 else suh[0], svh, None,
                                                              sizes, codebook, out=y, force=c)
                 for i in range(10 if b <= 256 else 4)] for c in cands}
    # Two rounds, each candidate's best kept: the first candidate of a cold start no longer pays the clock ramp.
    for _ in range(2):
        for c in list(calls):
            try:
                times[c] = min(times.get(c, float("inf")), graph_time_us(calls[c], reps=3))
            except KernelError:
                del calls[c]  # this layer cannot run it: not retried
