"""Issue 43 A/B: bench_linear.py CSVs from two trees (file names ...-before.csv / ...-after.csv, as ab_trees.sh
writes them) as one markdown table per (layer, K, codebook, M, path): ours/bf16 time ratio per tree (mean, range
over repeats), after/before, and a flag where the change exceeds the larger range of repeats.

    python bench/experiments/ab_trees_report.py OUT_DIR_OR_CSVS...
"""

from __future__ import annotations

import csv
import glob
import os
import re
import sys
from statistics import mean, median


def short(plan: str) -> str:
    """Plan(path='gemm', tier='h8', splits=4, ...) -> h8/s4 (a forced tier's name stays as it is)."""
    f = {k: a or b for k, a, b in re.findall(r"(\w+)=(?:'([^']*)'|(\d+))", plan)}
    if not f:
        return plan
    s = f.get("tier") or f.get("path", "?")
    s += f"/s{f['splits']}" if f.get("splits", "1") != "1" else ""
    return s + (f"/k{f['stream']}" if f.get("stream", "0") != "0" else "")


def load(paths):
    """{(layer, K, cb, M, path): {"before": [(ratio, plan)], "after": [...]}} and the files read per tree."""
    files = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "*.csv"))) if os.path.isdir(p) else [p]
    data, seen = {}, {"before": [], "after": []}
    for f in files:
        tree = next((t for t in ("before", "after") if re.search(rf"-{t}\.csv$", f)), None)
        if tree is None:
            continue
        seen[tree].append(os.path.basename(f))
        with open(f, newline="") as fh:
            for r in csv.DictReader(fh):
                key = (r["layer"], r["K"], r["cb"], int(r["M"]), r["path"])
                ratio = float(r["ours_us"]) / float(r["bf16_us"])
                data.setdefault(key, {"before": [], "after": []})[tree].append((ratio, r["plan"]))
    return data, seen


def main(argv):
    data, seen = load(argv or ["."])
    print(f"before: {', '.join(seen['before']) or 'none'}\nafter: {', '.join(seen['after']) or 'none'}\n")
    print("ratio = ours_us / bf16_us in the same process (lower is faster); range = max - min over repeats; "
          "**x** = |after - before| exceeds the larger range\n")
    print("| layer | K | cb | M | path | n b/a | before: mean (range) | after: mean (range) | after/before | flag "
          "| plans |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    changes, flagged, rows = {}, 0, 0
    for key in sorted(data, key=lambda k: ([int(v) for v in k[0].split("x")], k[1], k[2], k[4], k[3])):
        b, a = data[key]["before"], data[key]["after"]
        if not b or not a:
            print(f"| {' | '.join(map(str, key))} | {len(b)}/{len(a)} | | | | missing | |")
            continue
        rb, ra = [v for v, _ in b], [v for v, _ in a]
        mb, ma = mean(rb), mean(ra)
        noise = max(max(rb) - min(rb), max(ra) - min(ra))
        flag = abs(ma - mb) > noise
        pb, pa = sorted({short(p) for _, p in b}), sorted({short(p) for _, p in a})
        plans = ",".join(pb) if pb == pa else f"{','.join(pb)} -> {','.join(pa)}"
        rows += 1
        flagged += flag
        changes.setdefault(key[3], []).append(ma / mb)
        print(f"| {' | '.join(map(str, key))} | {len(b)}/{len(a)} | {mb:.4f} ({max(rb) - min(rb):.4f}) | "
              f"{ma:.4f} ({max(ra) - min(ra):.4f}) | {ma / mb:.3f} | {'**x**' if flag else ''} | {plans} |")
    print(f"\n{flagged} of {rows} rows changed by more than the repeats' range.\n")
    print("| M | rows | after/before median (min-max) |\n|---|---|---|")
    for m in sorted(changes):
        c = changes[m]
        print(f"| {m} | {len(c)} | {median(c):.3f} ({min(c):.3f}-{max(c):.3f}) |")


if __name__ == "__main__":
    main(sys.argv[1:])
