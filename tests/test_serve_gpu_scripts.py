"""bench/serve_gpu: the exactness comparison rule and the report's ratios and goals, on made-up inputs."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench", "serve_gpu"))

import exactness  # noqa: E402
import report  # noqa: E402


def _run(tokens, top1, top2, prompt_lp):
    return {"tokens": tokens, "top2": [[a, b] for a, b in zip(top1, top2)], "prompt_lp": prompt_lp}


def test_compare_rule():
    ref = _run([1, 2, 3, 4], [-1.0, -1.0, -1.0, -1.0], [-2.0, -1.01, -2.0, -2.0], [-3.0, -4.0])
    same = exactness.compare([ref], [ref], 0.05)
    assert same["pass"] and same["greedy_tokens_equal"] == 4 and same["greedy_near_ties_passed"] == 1
    # Parting where the reference's margin is 0.01 < tol is allowed; the comparison stops there.
    tie = exactness.compare([_run([1, 9, 3, 4], [-1.0] * 4, [-2.0] * 4, [-3.0, -4.0])], [ref], 0.05)
    assert tie["pass"] and tie["greedy_tokens_equal"] == 1 and len(tie["parted_at_near_tie"]) == 1
    # Parting where the margin is 1.0 is a mismatch.
    bad = exactness.compare([_run([1, 2, 9, 4], [-1.0] * 4, [-2.0] * 4, [-3.0, -4.0])], [ref], 0.05)
    assert not bad["pass"] and bad["greedy_mismatches"][0]["pos"] == 2
    # A prompt logprob off by more than the tolerance fails even with equal tokens.
    lp = exactness.compare([_run([1, 2, 3, 4], [-1.0] * 4, [-2.0] * 4, [-3.0, -4.1])], [ref], 0.05)
    assert not lp["pass"] and abs(lp["max_prompt_logprob_diff"] - 0.1) < 1e-9


def _row(kind, n, c, tok_s, tpot, ttft):
    return {"kind": kind, "input_len": n, "output_len": 256, "concurrency": c, "num_prompts": 8, "seed": n + c,
            "rc": 0, "command": f"bench {kind} {n} {c}",
            "result": {"output_throughput": tok_s, "mean_tpot_ms": tpot, "mean_ttft_ms": ttft, "completed": 8,
                       "failed": 0}}


def test_report_ratios_and_goals(tmp_path, monkeypatch):
    rows = {"exl3": [_row("exl3", 1024, 1, 340.0, 2.9, 30.0), _row("exl3", 8192, 1, 300.0, 3.0, 260.0)],
            "bf16": [_row("bf16", 1024, 1, 200.0, 4.8, 30.0), _row("bf16", 8192, 1, 190.0, 4.9, 200.0)]}
    for kind, rs in rows.items():
        (tmp_path / f"{kind}_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
        (tmp_path / f"{kind}_meta.json").write_text(json.dumps({"commands": {"serve": f"serve {kind}"},
                                                               "started": "2099-01-02 00:00:00 UTC"}))
    monkeypatch.setattr(sys, "argv", ["report.py", "--dir", str(tmp_path), "--out-dir", str(tmp_path / "out"),
                                      "--commit", "abc"])
    assert report.main() == 0
    md = (tmp_path / "out" / "2099-01-02-serve-h200.md").read_text()
    assert "decode tok/s 1.66x ≥1.6: met" in md            # 4.8 / 2.9
    assert "TTFT 1.30x ≤1.15: MISSED" in md                 # 260 / 200
    assert "Goals missed: in 8192 c=1: TTFT 1.30x" in md
    csv = (tmp_path / "out" / "2099-01-02-serve-h200.csv").read_text().splitlines()
    assert len(csv) == 3 and csv[1].startswith("1024,256,1,8,1025,")
