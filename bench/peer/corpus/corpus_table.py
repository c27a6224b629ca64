"""Issue 41's corpus table: one row per converted setting, from every GPU gate and CPU check in bench/results (here).

    .venv/bin/python bench/peer/corpus/corpus_table.py [--results bench/results] [--csv OUT.csv]

Each setting's latest GPU gate run (the models are trained anew each sitting, so runs are not merged) gives loads on
the GPU, KL and top-1 against exllamav3 in fp16 and bf16 and the verdict against the floor (gate_table.py); its latest
CPU check gives loads on the CPU. Settings that a gate never ran are listed with what is known, so the gaps show.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert import JOBS  # noqa: E402
from gate_table import _num, flat, read  # noqa: E402

STUDY = re.compile(r"(\d{4}-\d{2}-\d{2}[a-z]?)-")


def latest(paths: list[str], keyf) -> dict:
    """key -> (study, row) of the newest study holding it (names sort by date, then letter)."""
    out: dict = {}
    for p in sorted(paths, key=lambda p: STUDY.search(os.path.basename(p)).group(1)):
        for r in read(p):
            out[keyf(r)] = (STUDY.search(os.path.basename(p)).group(1), r)
    return out


def describe(spec) -> str:
    """A job's converter settings in a few words (convert.py's JOBS)."""
    if isinstance(spec, list):
        return " ".join(spec)
    kind = spec[0]
    if kind == "recipe":
        return " ".join(["per-tensor recipe"] + list(spec[2]))
    if kind == "optimize":
        return f"measure + optimize of {' and '.join(spec[1])} at {spec[2]}"
    return f"{' '.join(spec[2])}, MLPs sliced at {spec[1]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "..", "..", "results"))
    ap.add_argument("--csv")
    a = ap.parse_args()
    gates = latest(glob.glob(os.path.join(a.results, "*-gate-*.csv")), lambda r: (r["name"], r["dtype"]))
    cpus = latest(glob.glob(os.path.join(a.results, "*corpus-cpu.csv")), lambda r: (r["name"], r["dtype"]))
    names = list(JOBS) + sorted({n for n, _ in gates} - set(JOBS))
    rows = []
    for name in names:
        row = {"setting": name, "converter arguments": describe(JOBS[name][1]) if name in JOBS else ""}
        cpu = [(s, r) for (n, _), (s, r) in cpus.items() if n == name]
        row["cpu"] = (f"{'ok' if all(r.get('load') == 'ok' for _, r in cpu) else 'FAIL'} ({max(s for s, _ in cpu)})"
                      if cpu else "no CPU row")
        gpu_ok = True
        for dt, short in (("float16", "fp16"), ("bfloat16", "bf16")):
            g = gates.get((name, dt))
            if g is None:
                row[f"{short} KL / top-1"], row[f"{short} vs floor"] = "no gate row", ""
                gpu_ok = False
                continue
            study, r = g
            f = flat(r)
            kl, top1 = _num(f["kl_vs_exllamav3"]), _num(f["top1_vs_exllamav3"])
            row[f"{short} KL / top-1"] = (f"{kl:.1e} / {100 * top1:.2f}%" if kl is not None and top1 is not None
                                          else "—")
            row[f"{short} vs floor"] = f"{'pass' if str(f['gate_vs_floor']) == 'True' else 'FAIL'} ({study})"
            gpu_ok &= str(r.get("load", "ok")) == "ok"
        row["gpu"] = "ok" if gpu_ok else ("no gate row" if not any((name, d) in gates for d in ("float16", "bfloat16"))
                                          else "FAIL")
        rows.append(row)
    cols = ["setting", "converter arguments", "cpu", "gpu", "fp16 KL / top-1", "fp16 vs floor", "bf16 KL / top-1",
            "bf16 vs floor"]
    if a.csv:
        with open(a.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, cols)
            w.writeheader()
            w.writerows(rows)
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    done = [r for r in rows if "pass" in r["fp16 vs floor"] and "pass" in r["bf16 vs floor"]]
    print(f"\nsettings {len(rows)}; both dtypes pass against the floor on the GPU: {len(done)}; "
          f"no GPU gate row: {sum(r['gpu'] == 'no gate row' for r in rows)}")


if __name__ == "__main__":
    main()
