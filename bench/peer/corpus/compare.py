"""The fidelity gate's verdict: vLLM + exl3-vllm (gate_vllm.py) against exllamav3's own forward (GPU machine).

    PYTHONPATH=/tmp/site:.peer/src:src python3 bench/peer/corpus/compare.py --corpus /tmp/corpus/exl3 \
        --ref /tmp/corpus/ref --gate /tmp/corpus/gate --out /tmp/corpus/gate.json

Per checkpoint and dtype:
- teacher-forced: mean KL(exllamav3 || vLLM) in nats and top-1 agreement over the held-out sequence (exllamav3's
  row t against vLLM's prompt logprobs of token t + 1), and KL(unquantized || vLLM) for scale;
- greedy: exllamav3 runs each prompt + vLLM's greedy tokens; every generated token must be exllamav3's argmax
  unless exllamav3's top-2 logprob margin there is under TIE[dtype] (a near tie), after which the sequence is not
  compared.
Gate (issue 41): fp16 mean KL <= 1e-4 and top-1 >= 99.5%; bf16 mean KL <= 1e-3 and top-1 >= 99%; no greedy mismatch.
Beside it, each row's dtype floor (dtype_floor.py): the checkpoint's dense reconstruction in transformers, run in the
row's dtype, against the same exllamav3 logits. That is what a correct engine in that dtype scores (bf16 arithmetic
alone parts from fp16 at 1.5-2.6% of positions on these models). gate_at_floor keeps the KL bound and asks top-1 at
least the floor's less FLOOR_SLACK where the floor is under the top-1 bound. The same engine's own floors (fp16 vs fp32,
bf16 vs fp16) are reported too. gate_partings keeps the KL bound and counts the teacher-forced top-1 partings where
exllamav3's top-2 margin is TIE[dtype] or more: at most as many as the floor's (a correct bf16 engine parts beyond one
bf16 step too: transformers bf16 against fp16 did at up to 0.70 nats on the MoE, 0.20 on the dense models).
gate_vs_floor keeps the KL bound and no greedy mismatch, and asks that our top-1 partings do not outnumber the floor's
beyond chance: an exact paired (McNemar) test over the positions where either parts, p > ALPHA. It replaces the fixed
slack and the tie-margin count, which each failed rows of one run that the other passed (2026-12-06h).
MoE rows also say where the routers sit on near ties (moe_routing.py). There an expert choice may flip on one rounding
(a flip costs up to 0.4 nats at its position; the fp16 floor of 2026-12-06q's qwen3-moe-b6-hb8 is over the bound for
it), so gate_vs_floor takes their KL bound on the positions off router near ties (kl_off_router_ties).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
from dtype_floor import dense_logits, floors

GATES = {"float16": (1e-4, 0.995), "bfloat16": (1e-3, 0.99)}
# Near-tie margins for the greedy check, in nats: a bf16 logit in [8, 16) moves in steps of 0.0625, so two of them
# may swap on a margin under 0.125 (the 2026-12-06 gate parted at 0.0547 three times in bf16, never in fp16).
TIE = {"float16": 0.05, "bfloat16": 0.125}
FLOOR_SLACK = 0.003  # top-1 points our engine may trail the transformers reference in the same dtype
NEAR_TIE = 1e-3  # a router's gap between its k-th and (k+1)-th probability under which fp16 and fp32 may route apart
ALPHA = 1e-3  # gate_vs_floor: chance of calling a correct engine worse than the floor, per row (30 rows a run)


def vs_floor(dtype: str, kl: float, p: float, greedy_mismatches: int) -> bool:
    """gate_vs_floor's verdict: the dtype's KL bound, partings no more than the floor's beyond chance, greedy exact."""
    return bool(kl <= GATES.get(dtype, (1e-3, 0.99))[0] and p > ALPHA and not greedy_mismatches)


def kl_off_router_ties(row: dict) -> float | None:
    """MoE rows: an upper bound on the mean KL over the positions where no router sits on a near tie, from the row's
    total less its worst positions that do (None for a row without router ties)."""
    ties, n, kl = row.get("router_near_ties"), row.get("positions"), row.get("kl_vs_exllamav3")
    if not ties or not n or kl is None or int(ties) >= int(n):
        return None
    at_ties = sum(float(w["kl"]) for w in row.get("worst_router_gaps") or [] if float(w["min_gap"]) < NEAR_TIE)
    return max(0.0, float(kl) * int(n) - at_ties) / (int(n) - int(ties))


def paired_p(ours: list[int] | int, floor: list[int] | int) -> float:
    """One-sided exact McNemar p-value that our top-1 partings from exllamav3 outnumber the floor's by chance.
    Given the positions: b = ours only, c = floor's only, p = P(Binomial(b + c, 1/2) >= b). Given counts only, the
    overlap is unknown; b - c is still the count difference d, and p is smallest when c = 0, so 2^-d bounds it (and
    1/2 when d <= 0: then b <= (b + c) / 2)."""
    if isinstance(ours, int) or isinstance(floor, int):
        d = (ours if isinstance(ours, int) else len(ours)) - (floor if isinstance(floor, int) else len(floor))
        return 0.5 if d <= 0 else 0.5 ** d
    b, c = len(set(ours) - set(floor)), len(set(floor) - set(ours))
    n = b + c
    return sum(math.comb(n, i) for i in range(b, n + 1)) / 2 ** n if n else 1.0


def kl_rows(ref_logits: torch.Tensor, got_lp: torch.Tensor, worst: list | None = None) -> tuple[float, float]:
    """Mean KL(ref || got) and top-1 agreement; worst: filled with the 5 largest (position, KL), for moe_routing.py."""
    lp = torch.log_softmax(ref_logits.float(), -1)
    q = got_lp.float()
    kl = (lp.exp() * (lp - q)).sum(-1)
    if worst is not None:
        top = torch.topk(kl, min(5, kl.numel()))
        worst += [(int(p), round(v, 5)) for p, v in zip(top.indices.tolist(), top.values.tolist())]
    return kl.mean().item(), (lp.argmax(-1) == q.argmax(-1)).float().mean().item()


def partings(ref_logits: torch.Tensor, got_lp: torch.Tensor, tie: float) -> dict:
    """Where the top-1s part: exllamav3's top-2 margin there (nats). A parting under the tie margin is a swap the
    dtype's rounding can make; one above it is an error."""
    lp = torch.log_softmax(ref_logits.float(), -1)
    top2 = torch.topk(lp, 2).values
    differ = lp.argmax(-1) != got_lp.float().argmax(-1)
    margin = (top2[:, 0] - top2[:, 1])[differ]
    return {"parted": margin.numel(), "parted_margin_max": round(margin.max().item(), 4) if margin.numel() else 0.0,
            "parted_beyond_tie": int((margin >= tie).sum()), "parted_at": differ.nonzero().flatten().tolist()}


def gaps_of(ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    """[T, layers] router gaps on the sequence (moe_routing.py: our dense reconstruction in transformers, fp32)."""
    from moe_routing import dense_model, router_gaps

    model, cfg = dense_model(ckpt)
    return router_gaps(model.cuda() if torch.cuda.is_available() else model, cfg, ids)[1]


def routing_note(gaps: torch.Tensor, worst: list) -> dict:
    """MoE only: the router near ties on the sequence, and each worst position's smallest gap and the last near tie
    at or before it (a tie can route differently in exllamav3's fp16; later positions inherit it through attention)."""
    ties = (gaps.min(1).values < NEAR_TIE).nonzero().flatten().tolist()
    return {"router_near_ties": len(ties), "worst_router_gaps": [
        {"pos": p, "kl": v, "min_gap": round(gaps[p].min().item(), 5),
         "last_tie_at_or_before": max((t for t in ties if t <= p), default=None)} for p, v in worst]}


def greedy_check(model, greedy: list[dict], vocab: int, tie: float) -> dict:
    compared = ties = 0
    bad = []
    for i, g in enumerate(greedy):
        seq = torch.tensor(g["prompt"] + g["tokens"], dtype=torch.long).view(1, -1)
        with torch.inference_mode():
            lg = torch.log_softmax(model.forward(seq, {})[0, :, :vocab].float(), -1).cpu()
        n = len(g["prompt"])
        for p, tok in enumerate(g["tokens"]):
            row = lg[n - 1 + p]
            top2 = torch.topk(row, 2)
            margin = (top2.values[0] - top2.values[1]).item()
            if tok != int(top2.indices[0]):
                if margin >= tie:
                    bad.append({"prompt": i, "pos": p, "vllm": tok, "exllamav3": int(top2.indices[0]),
                                "margin": round(margin, 4)})
                break
            ties += margin < tie
            compared += 1
    return {"greedy_compared": compared, "greedy_near_ties": ties, "greedy_mismatches": bad}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--gate", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from exllamav3 import Config, Model
    from ex3_slicing import use_split_of

    ex3 = {r["name"]: r for r in json.load(open(os.path.join(a.ref, "ex3.json")))}
    runs = json.load(open(os.path.join(a.gate, "gate_runs.json")))
    rows = []
    for name in dict.fromkeys(r["name"] for r in runs):
        cfg = json.load(open(os.path.join(a.corpus, name, "config.json")))
        vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
        gaps = None  # MoE only, computed once per checkpoint
        ref = torch.load(os.path.join(a.ref, f"{name}.pt"))["logits"]
        hf_path = os.path.join(a.ref, f"hf-{ex3[name]['model']}.pt")
        hf = torch.load(hf_path)["logits"] if os.path.exists(hf_path) else None  # none for committed fixtures
        model = None
        dense = dense_logits(os.path.join(a.corpus, name), torch.load(os.path.join(a.ref, "tokens.pt")), "cuda")
        own = floors(dense)
        for run in (r for r in runs if r["name"] == name):
            row = {"name": name, "dtype": run["dtype"], "model": ex3[name]["model"],
                   "quantization_config": ex3[name].get("quantization_config"), "embedding": ex3[name].get("embedding"),
                   "kl_unquantized_vs_exllamav3": ex3[name].get("kl_vs_unquantized")}
            path = os.path.join(a.gate, f"{name}-{run['dtype']}.pt")
            if run["rc"] != 0 or not os.path.exists(path):
                row.update(load="FAIL", error=run.get("error", run["rc"]), gate=False)
                rows.append(row)
                continue
            got = torch.load(path)
            lp = got["prompt_logprobs"]
            worst: list = []
            kl, top1 = kl_rows(ref[:-1], lp, worst)
            kl_hf, top1_hf = kl_rows(hf[:-1], lp) if hf is not None else (None, None)
            if model is None:
                use_split_of(os.path.join(a.corpus, name))
                model = Model.from_config(Config.from_directory(os.path.join(a.corpus, name)))
                model.load(device="cuda:0")
            g = greedy_check(model, got["greedy"], vocab, TIE[run["dtype"]])
            if cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
                if gaps is None:
                    gaps = gaps_of(os.path.join(a.corpus, name), torch.load(os.path.join(a.ref, "tokens.pt")))
                g.update(routing_note(gaps, worst))
            max_kl, min_top1 = GATES.get(run["dtype"], (1e-3, 0.99))
            floor_kl = floor_top1 = floor_parted = None
            if run["dtype"] in dense:
                floor_lp = torch.log_softmax(dense[run["dtype"]][:-1, :vocab], -1)
                floor_kl, floor_top1 = kl_rows(ref[:-1], floor_lp)
                floor_parted = partings(ref[:-1], floor_lp, TIE[run["dtype"]])
            at_floor = min(min_top1, floor_top1 - FLOOR_SLACK) if floor_top1 is not None else min_top1
            parted = partings(ref[:-1], lp, TIE[run["dtype"]])
            beyond_floor = floor_parted["parted_beyond_tie"] if floor_parted else 0
            row.update(floor_kl=floor_kl, floor_top1=floor_top1, own_dtype_floor=own.get(run["dtype"]),
                       gate_at_floor=bool(kl <= max_kl and top1 >= at_floor and not g["greedy_mismatches"]),
                       **parted, floor_parted=floor_parted,
                       gate_partings=bool(kl <= max_kl and parted["parted_beyond_tie"] <= beyond_floor
                                          and not g["greedy_mismatches"]))
            row.update(load="ok", positions=lp.shape[0], kl_vs_exllamav3=kl, top1_vs_exllamav3=top1,
                       worst_positions=worst, kl_unquantized_vs_vllm=kl_hf, top1_unquantized_vs_vllm=top1_hf,
                       init_s=round(got["init_s"], 1), eager=got["eager"], **g,
                       gate=bool(kl <= max_kl and top1 >= min_top1 and not g["greedy_mismatches"]))
            row["kl_off_router_ties"] = kl_off_router_ties(row)
            if floor_parted:
                row["paired_p"] = paired_p(parted["parted_at"], floor_parted["parted_at"])
                row["gate_vs_floor"] = vs_floor(run["dtype"], min(kl, row["kl_off_router_ties"] or kl), row["paired_p"],
                                                len(g["greedy_mismatches"]))
            print("[compare]", json.dumps({k: v for k, v in row.items() if k != "quantization_config"}), flush=True)
            rows.append(row)
        if model is not None:
            model.unload()
            del model
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"GATE {'PASS' if rows and all(r['gate'] for r in rows) else 'FAIL'}: "
          f"{sum(r['gate'] for r in rows)}/{len(rows)} rows; at the dtype floor: "
          f"{sum(r.get('gate_at_floor', False) for r in rows)}/{len(rows)}; partings beyond a tie at most the floor's: "
          f"{sum(r.get('gate_partings', False) for r in rows)}/{len(rows)}; no more partings than the floor's "
          f"(paired, p > {ALPHA:g}): {sum(r.get('gate_vs_floor', False) for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    main()
