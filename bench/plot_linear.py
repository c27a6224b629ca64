"""Speedup over bf16 cuBLAS vs M, one panel per layer, from a bench_linear.py CSV (runs anywhere).
Where the CSV has exllamav3 times (bench_linear --peer), each codebook's exllamav3 speedup is a dashed line."""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--png", required=True)
    ap.add_argument("--title", default="EXL3 linear vs bf16 cuBLAS")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(dict)  # (layer, label) -> {M: speedup}
    peer = defaultdict(dict)    # (layer, label of our auto line) -> {M: exllamav3 speedup}
    for r in csv.DictReader(open(args.csv)):
        label = f"K={r['K']} {r['cb']}" + ("" if r["path"] == "auto" else f" ({r['path']})")
        series[(r["layer"], label)][int(r["M"])] = float(r["speedup"])
        try:  # older CSVs lack the column; "–" where exllamav3 was not measured
            if r["path"] == "auto":
                peer[(r["layer"], label)][int(r["M"])] = float(r.get("exllamav3_speedup") or "")
        except ValueError:
            pass
    layers = sorted({k[0] for k in series}, key=lambda s: [int(v) for v in s.split("x")])
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 3.8), squeeze=False, sharey=True)
    for ax, layer in zip(axes[0], layers):
        for (ly, label), pts in sorted(series.items()):
            if ly != layer or len(pts) < 2:
                continue
            ms = sorted(pts)
            line, = ax.plot(ms, [pts[m] for m in ms], marker="o", ms=3, label=label,
                            linestyle="-" if "(" not in label else ":")
            pp = peer.get((ly, label), {})
            if len(pp) >= 2:  # same colour as our line, so each codebook reads as a pair
                pm = sorted(pp)
                ax.plot(pm, [pp[m] for m in pm], marker="x", ms=3, linestyle="--", color=line.get_color(),
                        label=f"{label} exllamav3")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(layer)
        ax.set_xlabel("M (rows)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("bf16 time / EXL3 time" + (" (dashed: exllamav3)" if peer else ""))
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    # A 64-colour palette keeps each plot near 30-70 KB (the tracked tree travels with every device call).
    from PIL import Image
    Image.open(args.png).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(args.png, optimize=True)


if __name__ == "__main__":
    main()
