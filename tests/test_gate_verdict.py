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
