"""Turn bench_peer.py CSVs into the results table, a merged CSV and a plot (runs anywhere, no GPU).

    python3 bench/peer/report.py --summary bench_default.csv            # short headline print
    python3 bench/peer/report.py --default bench_default.csv --nogemv bench_nogemv.csv \
        --md bench/results/2026-12-01-peer-exllamav3-h200.md --csv bench/results/2026-12-01-peer-exllamav3-h200.csv \
        --png bench/results/2026-12-01-peer-exllamav3-h200.png --header header.md

Derived columns: GB/s = (weight + activation + output bytes) / time; TFLOP/s = 2Mkn / time;
floor = max(bytes / copy_BW, k*n / decode_rate(K, codebook), 2Mkn / bf16_GEMM_rate) (decode term only for EXL3
rows); % of floor = floor / time. "exl3_auto" is what LinearEXL3.forward would run: exl3_gemm for M <= 144,
exl3_recon above (exllamav3's AUTO_RECONSTRUCT_THRESHOLD).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
from collections import defaultdict

AUTO_THRESHOLD = 144


def read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def ceilings(rows):
    c = {}
    for r in rows:
        if r["method"] == "ceiling_copy":
            c["copy_gbs"] = float(r["value"])
        elif r["method"] in ("ceiling_gemm", "ceiling_gemm_fp16"):
            c[r["method"]] = float(r["value"])
        elif r["method"] == "decode_only":
            c[("decode", int(r["K"]), r["cb"])] = float(r["value"])
    return c


def derive(r, c):
    us = float(r["us_median"])
    wb, ab, ob, fl = (int(r[x] or 0) for x in ("weight_bytes", "act_bytes", "out_bytes", "flops"))
    k, n = int(r["k"]), int(r["n"])
    t_bw = (wb + ab + ob) / (c["copy_gbs"] * 1e3) if "copy_gbs" in c else 0.0
    t_fl = fl / (c["ceiling_gemm"] * 1e6) if "ceiling_gemm" in c else 0.0
    t_dec = 0.0
    if r["method"] != "bf16" and r["K"]:
        key = ("decode", int(r["K"]), r["cb"])
        if key in c:
            t_dec = k * n / (c[key] * 1e3)
    floor = max(t_bw, t_fl, t_dec)
    bound = "bw" if floor == t_bw else ("flop" if floor == t_fl else "decode")
    return {"us": us, "gbs": (wb + ab + ob) / us / 1e3, "tflops": fl / us / 1e6, "floor_us": floor,
            "pct": 100 * floor / us if floor else float("nan"), "bound": bound}


def measured(rows):
    return [r for r in rows if r["method"] in ("bf16", "exl3_gemm", "exl3_recon")]


def index(rows):
    d = {}
    for r in measured(rows):
        key = (r["method"], int(r["k"]), int(r["n"]), r["K"], r["cb"], int(r["M"]))
        d[key] = r
    return d


def summary(path, ceil_path=None):
    rows = read(path)
    c = ceilings(rows)
    if ceil_path:
        c.update({k: v for k, v in ceilings(read(ceil_path)).items() if isinstance(k, tuple)})
    print(f"copy {c.get('copy_gbs', float('nan')):.0f} GB/s | bf16 GEMM {c.get('ceiling_gemm', float('nan')):.0f} "
          f"TFLOP/s | fp16 GEMM {c.get('ceiling_gemm_fp16', float('nan')):.0f} TFLOP/s")
    dec = {k: v for k, v in c.items() if isinstance(k, tuple)}
    for K in range(1, 9):
        s = "  ".join(f"{cb} {dec[('decode', K, cb)]:.0f}" for cb in ("mul1", "mcg", "3inst") if ("decode", K, cb) in dec)
        if s:
            print(f"decode-only K={K} (Gweight/s): {s}")
    d = index(rows)
    print(f"{'layer':>12} {'K':>2} {'cb':>5} {'M':>5} {'exl3 auto us':>13} {'path':>8} {'bf16 us':>9} {'ratio':>6}")
    for (k, n) in [(8192, 28672), (4096, 4096)]:
        for cb in ("mul1", "mcg", "3inst"):
            for M in (1, 16, 256, 4096):
                meth = "exl3_gemm" if M <= AUTO_THRESHOLD else "exl3_recon"
                e = d.get((meth, k, n, "4", cb, M))
                b = d.get(("bf16", k, n, "", "", M))
                if not e:
                    continue
                bus = float(b["us_median"]) if b else float("nan")
                eus = float(e["us_median"])
                print(f"{k:>5}x{n:<6} {4:>2} {cb:>5} {M:>5} {eus:13.1f} {e['path']:>8} {bus:9.1f} {bus / eus:6.2f}")


def full(a):
    rows_a = read(a.default)
    rows_b = read(a.nogemv) if a.nogemv and os.path.exists(a.nogemv) else []
    c = ceilings(rows_a)
    if a.ceilings:                      # decode-only rates measured in another run override those of --default
        c.update({k: v for k, v in ceilings(read(a.ceilings)).items() if isinstance(k, tuple)})
    da, db = index(rows_a), index(rows_b)
    layers = sorted({(int(r["k"]), int(r["n"])) for r in measured(rows_a)}, key=lambda x: (x[0] * x[1], x[0]))
    confs = sorted({(r["K"], r["cb"]) for r in measured(rows_a) if r["method"] != "bf16"},
                   key=lambda x: (int(x[0]), x[1]))
    Ms = sorted({int(r["M"]) for r in measured(rows_a)})

    out_rows = []
    lines = []
    for (k, n) in layers:
        lines.append(f"\n### {k} x {n} (k x n)\n")
        lines.append("| K | cb | M | bf16 µs | bf16 %floor | exl3 auto µs | auto path | auto GB/s | auto TFLOP/s | "
                     "auto %floor (bound) | exl3_gemm µs (ret) | no-GEMV µs (ret) | exl3_recon µs | best exl3 µs | bf16/auto | bf16/best |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for (K, cb) in confs:
            for M in Ms:
                b = da.get(("bf16", k, n, "", "", M))
                g = da.get(("exl3_gemm", k, n, K, cb, M))
                rc = da.get(("exl3_recon", k, n, K, cb, M))
                ng = db.get(("exl3_gemm", k, n, K, cb, M))
                auto = g if M <= AUTO_THRESHOLD else rc
                if not (g or rc or ng):
                    continue
                bd = derive(b, c) if b else None
                ad = derive(auto, c) if auto else None
                cell = lambda r: f"{float(r['us_median']):.1f}" if r else "–"
                gcell = f"{cell(g)} ({g['path']})" if g else "–"
                ngcell = f"{cell(ng)} ({ng['path']})" if ng else "–"
                auto_path = ("gemm:" + auto["path"] if auto is g else "recon:" + auto["path"]) if auto else "–"
                lines.append(
                    f"| {K} | {cb} | {M} | {cell(b)} | {bd['pct']:.0f}% | " if bd else f"| {K} | {cb} | {M} | – | – | ")
                if ad:
                    lines[-1] += (f"{ad['us']:.1f} | {auto_path} | {ad['gbs']:.0f} | {ad['tflops']:.1f} | "
                                  f"{ad['pct']:.0f}% ({ad['bound']}) | ")
                else:
                    lines[-1] += "– | – | – | – | – | "
                ratio = f"{bd['us'] / ad['us']:.2f}" if (bd and ad) else "–"
                best = min(float(r["us_median"]) for r in (g, ng, rc) if r)
                bratio = f"{bd['us'] / best:.2f}" if bd else "–"
                lines[-1] += f"{gcell} | {ngcell} | {cell(rc)} | {best:.1f} | {ratio} | {bratio} |"
        # flat CSV rows
    reps = [(f"default_rep{i + 1}", read(p)) for i, p in enumerate(a.rep or [])]
    spread_lines = []
    for tag, rows_r in reps:
        dr = index(rows_r)
        spread_lines.append(f"- {tag} ({a.rep[int(tag[-1]) - 1]}) vs the main default run, median over 20+ calls each:")
        spread_lines.append("")
        spread_lines.append("| method | path class | rows | median abs. diff | p90 | max | median ratio rep/main |")
        spread_lines.append("|---|---|---|---|---|---|---|")
        groups = defaultdict(list)
        for key, r in da.items():
            if key in dr:
                cls = r["path"] if r["method"] == "exl3_gemm" else (r["path"] or "-")
                cls = {"0": "int8 GEMV", "90": "fp16 GEMV"}.get(cls, cls if r["method"] != "exl3_gemm" else "TC GEMM (autotuned)")
                groups[(r["method"], cls)].append(float(dr[key]["us_median"]) / float(r["us_median"]))
        for (m, cls), v in sorted(groups.items()):
            d = sorted(abs(x - 1) for x in v)
            spread_lines.append(f"| {m} | {cls} | {len(v)} | {100 * d[len(d) // 2]:.1f}% | {100 * d[int(0.9 * (len(d) - 1))]:.1f}% | "
                                f"{100 * d[-1]:.1f}% | {sorted(v)[len(v) // 2]:.3f} |")
        spread_lines.append("")
    for src, rows in (("default", rows_a), ("nogemv", rows_b)) + tuple(reps):
        for r in measured(rows):
            dd = derive(r, c)
            out_rows.append({"proc": src, "method": r["method"], "k": r["k"], "n": r["n"], "K": r["K"], "cb": r["cb"],
                             "M": r["M"], "path": r["path"], "us_median": r["us_median"], "us_min": r["us_min"],
                             "reps": r["reps"], "gbs": f"{dd['gbs']:.1f}", "tflops": f"{dd['tflops']:.2f}",
                             "floor_us": f"{dd['floor_us']:.3f}", "pct_floor": f"{dd['pct']:.1f}",
                             "bound": dd["bound"], "sm_mhz": r.get("sm_mhz", ""), "note": r.get("note", "")})
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out_rows[0].keys()))
            w.writeheader()
            w.writerows(out_rows)

    ceil_lines = [f"- copy bandwidth: **{c.get('copy_gbs', float('nan')):.0f} GB/s** (2 GiB D2D copy, read+written)",
                  f"- bf16 GEMM (8192³, random): **{c.get('ceiling_gemm', float('nan')):.0f} TFLOP/s**; "
                  f"fp16: {c.get('ceiling_gemm_fp16', float('nan')):.0f} TFLOP/s",
                  "- decode-only rate (our decode_only.cu, 8192×28672 trellis, Gweight/s):", "",
                  "| K | mul1 | mcg | 3inst |", "|---|---|---|---|"]
    for K in range(1, 9):
        vals = [c.get(("decode", K, cb)) for cb in ("mul1", "mcg", "3inst")]
        if any(vals):
            ceil_lines.append(f"| {K} | " + " | ".join(f"{v:.0f}" if v else "–" for v in vals) + " |")
    marks = [r for r in rows_a + rows_b if r["method"] in ("phase_done", "deadline")]
    mark_lines = [f"- {r['proc']}: {r['method']} {r['phase']} {r['note']}" for r in marks]

    header = open(a.header).read() if a.header and os.path.exists(a.header) else ""
    with open(a.md, "w") as f:
        f.write(header)
        f.write("\n## Measured ceilings\n\n" + "\n".join(ceil_lines) + "\n")
        f.write("\n## Coverage / phases completed\n\n" + "\n".join(mark_lines) + "\n")
        if spread_lines:
            f.write("\n## Run-to-run spread\n\n" + "\n".join(spread_lines) + "\n")
        f.write("\n## Results\n")
        f.write("\n".join(lines) + "\n")

    if a.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ncol = 3
        nrow = math.ceil((len(layers) + 1) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 4.6 * nrow), squeeze=False)
        flat = [ax for row in axes for ax in row]
        for ax, (k, n) in zip(flat, layers):
            def series(meth, K, cb, rows_idx):
                xs, ys = [], []
                for M in Ms:
                    if meth == "auto":
                        r = rows_idx.get(("exl3_gemm" if M <= AUTO_THRESHOLD else "exl3_recon", k, n, K, cb, M))
                    else:
                        r = rows_idx.get((meth, k, n, K, cb, M))
                    if r:
                        xs.append(M)
                        ys.append(float(r["us_median"]))
                return xs, ys
            xs, ys = series("bf16", "", "", da)
            ax.plot(xs, ys, "k-o", label="bf16 torch.matmul", lw=2)
            for (K, cb, st) in (("4", "mul1", "r-o"), ("4", "mcg", "b-s"), ("4", "3inst", "g-^"),
                                ("2", "mul1", "m--"), ("8", "mul1", "c--")):
                xs, ys = series("auto", K, cb, da)
                if xs:
                    ax.plot(xs, ys, st, label=f"exl3 K={K} {cb}", ms=4)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{k} x {n}")
            ax.set_xlabel("M (rows)")
            ax.set_ylabel("µs")
            ax.grid(True, which="both", alpha=0.3)
        handles, labels = flat[0].get_legend_handles_labels()
        for ax in flat[len(layers):]:
            ax.axis("off")
        flat[len(layers)].legend(handles, labels, loc="center", fontsize=11,
                                 title="exl3 = LinearEXL3 dispatch:\nexl3_gemm for M<=144, reconstruct+cuBLAS above")
        fig.suptitle("exllamav3 1.6.5 EXL3 linear (LinearEXL3 dispatch) vs bf16 cuBLAS, H200")
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--summary", default=None)
    ap.add_argument("--default", default=None)
    ap.add_argument("--nogemv", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--header", default=None)
    ap.add_argument("--ceilings", default=None, help="CSV whose decode_only rows override those in --default")
    ap.add_argument("--rep", action="append", help="repeat run(s) of the default process (spread table, extra CSV rows)")
    a = ap.parse_args()
    if a.summary:
        summary(a.summary, a.ceilings)
    if a.default:
        full(a)


if __name__ == "__main__":
    main()
