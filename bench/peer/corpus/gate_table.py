"""The gate's rows as a CSV and a markdown table, here (no GPU): from compare.py's gate.json, or an earlier study's CSV.

    .venv/bin/python bench/peer/corpus/gate_table.py --gate DIR/ref/gate.json --csv bench/results/<study>.csv
    .venv/bin/python bench/peer/corpus/gate_table.py --gate bench/results/2026-12-06d-gate-h100-vllm026.csv

Rows that predate gate_vs_floor (no parting positions) get its verdict from counts: paired_p's bound, 2^-(ours - floor).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import ALPHA, kl_off_router_ties, paired_p, vs_floor  # noqa: E402

COLUMNS = ["name", "dtype", "load", "positions", "kl_vs_exllamav3", "top1_vs_exllamav3", "parted", "parted_margin_max",
           "parted_beyond_tie", "floor_kl", "floor_top1", "floor_parted", "floor_parted_margin_max",
           "floor_parted_beyond_tie", "paired_p", "paired_from", "greedy_compared", "greedy_near_ties",
           "greedy_mismatches", "gate", "gate_at_floor", "gate_partings", "gate_vs_floor",
           "kl_unquantized_vs_exllamav3", "kl_unquantized_vs_vllm", "init_s", "router_near_ties",
           "kl_off_router_ties"]


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def flat(r: dict) -> dict:
    """One gate.json row (or earlier CSV row) with the floor's partings and the paired verdict spelled out."""
    out = {k: r.get(k) for k in COLUMNS}
    fp = r.get("floor_parted")
    if isinstance(fp, dict):
        out.update(floor_parted=fp["parted"], floor_parted_margin_max=fp["parted_margin_max"],
                   floor_parted_beyond_tie=fp["parted_beyond_tie"])
    if isinstance(r.get("greedy_mismatches"), list):
        out["greedy_mismatches"] = len(r["greedy_mismatches"])
    n = int(_num(r.get("positions")) or 2047)
    out["positions"] = n
    top1, ftop1, kl = _num(r.get("top1_vs_exllamav3")), _num(r.get("floor_top1")), _num(r.get("kl_vs_exllamav3"))
    if out["parted"] in (None, "") and top1 is not None:
        out["parted"] = round((1 - top1) * n)
    if out["floor_parted"] in (None, "") and ftop1 is not None:
        out["floor_parted"] = round((1 - ftop1) * n)
    if out["kl_off_router_ties"] in (None, "") and isinstance(r.get("worst_router_gaps"), list):
        out["kl_off_router_ties"] = kl_off_router_ties({**r, "positions": n})
    if "paired_p" in r and r["paired_p"] is not None:
        out["paired_from"] = "positions"
        off = _num(out["kl_off_router_ties"])
        if kl is not None and off is not None:  # rows compare.py judged on the whole mean before kl_off_router_ties
            out["gate_vs_floor"] = vs_floor(r.get("dtype"), min(kl, off), float(r["paired_p"]),
                                            int(_num(out["greedy_mismatches"]) or 0))
    elif out["parted"] not in (None, "") and out["floor_parted"] not in (None, ""):
        out["paired_p"] = paired_p(int(out["parted"]), int(out["floor_parted"]))
        out["paired_from"] = "counts (bound)"
        out["gate_vs_floor"] = kl is not None and vs_floor(r.get("dtype"), kl, out["paired_p"],
                                                            int(_num(out["greedy_mismatches"]) or 0))
    return out


def read(path: str) -> list[dict]:
    if path.endswith(".json"):
        return json.load(open(path))
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gate", required=True, help="gate.json (compare.py) or an earlier study's CSV")
    ap.add_argument("--csv", help="write the flattened rows here")
    a = ap.parse_args()
    rows = [flat(r) for r in read(a.gate)]
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    pct = lambda v: f"{100 * float(v):.2f}%" if _num(v) is not None else "—"  # noqa: E731
    sci = lambda v: f"{float(v):.1e}" if _num(v) is not None else "—"  # noqa: E731
    print("| checkpoint | dtype | mean KL vs ex3 | top-1 vs ex3 | floor: KL, top-1 | partings: ours / floor | "
          "paired p | greedy: compared / near ties / mismatches | issue's bounds | vs floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    last = None
    for r in rows:
        name = r["name"] if r["name"] != last else ""
        last = r["name"]
        p = _num(r["paired_p"])
        off = _num(r["kl_off_router_ties"])
        kl = sci(r["kl_vs_exllamav3"]) + (f" (off router ties ≤ {off:.1e})" if off is not None else "")
        print(f"| {name} | {r['dtype']} | {kl} | {pct(r['top1_vs_exllamav3'])} | "
              f"{sci(r['floor_kl'])}, {pct(r['floor_top1'])} | {r['parted']} / {r['floor_parted']} | "
              f"{'—' if p is None else f'{p:.2g}'} | {r['greedy_compared']} / {r['greedy_near_ties']} / "
              f"{r['greedy_mismatches']} | {'pass' if str(r['gate']) == 'True' else 'fail'} | "
              f"{'pass' if str(r['gate_vs_floor']) == 'True' else '**fail**'} |")
    print(f"\nrows {len(rows)}; issue's bounds: {sum(str(r['gate']) == 'True' for r in rows)}; "
          f"vs floor (paired p > {ALPHA:g}, KL bound, no greedy mismatch): "
          f"{sum(str(r['gate_vs_floor']) == 'True' for r in rows)}")


if __name__ == "__main__":
    main()
