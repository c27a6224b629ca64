"""The fidelity gate's paired verdict (bench/peer/corpus/compare.py, gate_table.py): our top-1 partings from
exllamav3 against a third engine's, on the same positions."""
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench", "peer", "corpus"))
compare = pytest.importorskip("compare")
gate_table = pytest.importorskip("gate_table")


def test_exact_paired_p_is_mcnemar():
    ours, floor = [1, 2, 3, 4, 5, 6], [5, 6, 7]  # b = 4 ours only, c = 1 floor only
    assert compare.paired_p(ours, floor) == pytest.approx(sum(math.comb(5, i) for i in (4, 5)) / 32)
    assert compare.paired_p(floor, ours) == pytest.approx(1 - 1 / 32)  # one-sided: the floor parting more is fine
    assert compare.paired_p([3, 9], [9, 3]) == 1.0  # the same positions


def test_count_bound_never_exceeds_the_exact_p():
    """With counts only the overlap is unknown; 2^-d must not be above the exact p for any overlap."""
    for n_ours in range(0, 25, 3):
        for n_floor in range(0, 25, 4):
            bound = compare.paired_p(n_ours, n_floor)
            for shared in range(0, min(n_ours, n_floor) + 1):
                ours = list(range(n_ours))
                floor = list(range(shared)) + list(range(100, 100 + n_floor - shared))
                assert bound <= compare.paired_p(ours, floor) + 1e-12


def test_rows_without_positions_get_the_bound_verdict():
    row = {"name": "m", "dtype": "bfloat16", "positions": "2047", "kl_vs_exllamav3": "3e-4",
           "top1_vs_exllamav3": str(1 - 58 / 2047), "floor_top1": str(1 - 48 / 2047), "greedy_mismatches": "0"}
    out = gate_table.flat(row)
    assert (out["parted"], out["floor_parted"], out["paired_from"]) == (58, 48, "counts (bound)")
    assert out["paired_p"] == 0.5 ** 10 and out["gate_vs_floor"] is False
    out = gate_table.flat({**row, "top1_vs_exllamav3": str(1 - 57 / 2047)})
    assert out["gate_vs_floor"] is True
    assert gate_table.flat({**row, "kl_vs_exllamav3": "2e-3", "top1_vs_exllamav3": str(1 - 40 / 2047)})[
        "gate_vs_floor"] is False  # the KL bound still holds the row


def test_moe_kl_bound_is_judged_off_router_near_ties():
    """An MoE row whose mean KL is over the bound only through positions where a router sat on a near tie (an expert
    choice flipped on rounding) passes; KL at a position off the ties still counts, and so does a tie's far gap."""
    worst = [{"pos": 669, "kl": 0.4, "min_gap": 1e-5}, {"pos": 112, "kl": 0.1, "min_gap": 1e-4},
             {"pos": 149, "kl": 0.02, "min_gap": 0.009}]
    row = {"name": "moe", "dtype": "float16", "positions": 2000, "kl_vs_exllamav3": 0.6 / 2000, "paired_p": 0.9,
           "greedy_mismatches": [], "router_near_ties": 100, "worst_router_gaps": worst, "gate_vs_floor": False}
    assert compare.kl_off_router_ties(row) == pytest.approx(0.1 / 1900)  # 0.6 less the two ties' 0.5 nats
    out = gate_table.flat(row)
    assert out["kl_off_router_ties"] == pytest.approx(0.1 / 1900) and out["gate_vs_floor"] is True
    far = [{**w, "min_gap": 0.01} for w in worst]  # the same KL where no router was near a tie: the bound holds it
    assert gate_table.flat({**row, "worst_router_gaps": far})["gate_vs_floor"] is False
    assert compare.kl_off_router_ties({**row, "router_near_ties": 0}) is None  # a dense row: the mean as it is


def test_corpus_table_takes_each_settings_latest_gate_and_cpu_rows(tmp_path, monkeypatch):
    """corpus_table.py: per converter job, the newest study's rows; a failed verdict shows; a job never gated says so."""
    import csv

    corpus_table = pytest.importorskip("corpus_table")
    cols = ["name", "dtype", "load", "positions", "kl_vs_exllamav3", "top1_vs_exllamav3", "parted", "floor_top1",
            "floor_parted", "paired_p", "greedy_mismatches", "gate", "gate_vs_floor"]

    def gate(name, kl, verdict):
        return {"name": name, "dtype": "float16", "load": "ok", "positions": 2047, "kl_vs_exllamav3": kl,
                "top1_vs_exllamav3": 0.995, "parted": 10, "floor_top1": 0.996, "floor_parted": 8, "paired_p": 0.3,
                "greedy_mismatches": 0, "gate": True, "gate_vs_floor": verdict}

    for study, rows in (("2026-12-06c", [gate("llama-b4", 9e-5, False)]),
                        ("2026-12-06h", [gate("llama-b4", 1.8e-5, True), gate("llama-b3", 1.7e-5, False)])):
        with open(tmp_path / f"{study}-gate-h100.csv", "w", newline="") as f:
            w = csv.DictWriter(f, cols)
            w.writeheader()
            w.writerows(rows)
    with open(tmp_path / "2026-12-06k-corpus-cpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["name", "dtype", "load"])
        w.writeheader()
        w.writerow({"name": "llama-b4", "dtype": "float32", "load": "ok"})
    out = tmp_path / "table.csv"
    monkeypatch.setattr(sys, "argv", ["corpus_table.py", "--results", str(tmp_path), "--csv", str(out)])
    corpus_table.main()
    rows = {r["setting"]: r for r in csv.DictReader(open(out))}
    assert rows["llama-b4"]["fp16 vs floor"] == "pass (2026-12-06h)"  # the newer run, not 06c's fail
    assert rows["llama-b4"]["fp16 KL / top-1"] == "1.8e-05 / 99.50%" and rows["llama-b4"]["cpu"] == "ok (2026-12-06k)"
    assert rows["llama-b3"]["fp16 vs floor"] == "FAIL (2026-12-06h)" and rows["llama-b3"]["cpu"] == "no CPU row"
    assert rows["llama-b5"]["gpu"] == "no gate row"
