"""Serving report: EXL3 against bf16 (and the fp8 / gptq peers where measured) rows from serve_bench.py ->
bench/results/<date>-serve-h200.{md,csv,png}.

Here, with the files the device calls returned (each --dir may hold any kind; later dirs win):
    .venv/bin/python bench/serve_gpu/report.py --dir CALL3_FILES --dir CALL4_FILES \\
        --exactness CALL2_FILES/exactness.json --out-dir bench/results
"""

import argparse
import csv
import datetime
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from provenance import git_commit  # noqa: E402,F401  (mtp_speed takes it from here too)

KINDS = ("exl3", "bf16", "fp8", "gptq", "marlin")
PEERS = ("fp8", "gptq", "marlin")
LABELS = {"exl3": "EXL3 4.0 bpw", "bf16": "bf16", "fp8": "FP8 (vLLM online)",
          "gptq": "GPTQ 4-bit g128 (vLLM's kernel: Machete on Hopper)", "marlin": "GPTQ 4-bit g128 (Marlin)"}
DEVICE_CALLS = [("bash bench/serve_gpu/run_prepare.sh .vkit/c0", '[".vkit/c0"]'),
                ("bash .vkit/c1/stage.sh .vkit/c1", '[".vkit/c1"]'),
                ("bash bench/serve_gpu/run_exactness.sh .vkit/c2", '[".vkit/c2"]'),
                ("bash bench/serve_gpu/run_speed.sh exl3", "[]"), ("bash bench/serve_gpu/run_speed.sh bf16", "[]")]
# The MoE sitting (README.md here): the add-on part, eager exactness and the exl3 rows share the c2 call.
MOE_ROWS = "--preset qwen3-30b-a3b --rows 1024:1:10,1024:16:96,1024:64:192"
MOE_DEVICE_CALLS = [('SPEED_ARGS="--preset qwen3-30b-a3b" bash bench/serve_gpu/run_prepare.sh .vkit/c0', '[".vkit/c0"]'),
                    ("bash .vkit/c3/stage.sh .vkit/c3", '[".vkit/c3"]'),
                    ("bash .vkit/c1/stage.sh .vkit/c1", '[".vkit/c1"]'),
                    ('BUDGET_S=115 EXACT_ARGS="--moe --eager --tokens 16" bash bench/serve_gpu/run_exactness.sh .vkit/c2; '
                     f'SPEED_ARGS="{MOE_ROWS}" bash bench/serve_gpu/run_speed.sh exl3', '[".vkit/c2"]'),
                    (f'SPEED_ARGS="{MOE_ROWS}" bash bench/serve_gpu/run_speed.sh bf16', "[]")]
# Per preset: title, model line, device calls.
MODELS = {
    "llama-3-8b": ("Llama-3-8B shapes",
                   "Llama-3-8B architecture (synthetic weights: `exl3-vllm synth`), decoder linears EXL3 4.0 bpw "
                   "mul1, lm_head EXL3 6 bits (the converter's default), embeddings fp16; bf16 baseline: the same "
                   "config with `--load-format dummy`; `max_position_embeddings` raised to 16384 in both so that "
                   "8192 + 256 tokens fit (only the RoPE table grows)", DEVICE_CALLS),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B shapes (MoE)",
                      "Qwen3-30B-A3B architecture (48 layers, 128 experts of intermediate 768, top-8; synthetic "
                      "weights: `exl3-vllm synth`), attention and every expert EXL3 4.0 bpw mul1, routers fp16, "
                      "lm_head EXL3 6 bits, embeddings fp16; bf16 baseline: the same config with "
                      "`--load-format dummy` (vLLM's Triton fused MoE)", MOE_DEVICE_CALLS),
}
# (what, concurrency or None, input length or None, ratio key, bound, "min"/"max") against bf16, from issue 45.
GOALS = [("out tok/s", 1, None, "out", 1.6, "min"), ("out tok/s", 16, None, "out", 1.3, "min"),
         ("out tok/s", 64, None, "out", 1.0, "min"), ("TTFT", 1, None, "ttft", 1.1, "max")]
# The MoE shape's target (issue 45): at least bf16's output tok/s at every concurrency.
MOE_GOALS = [("out tok/s", c, None, "out", 1.0, "min") for c in (1, 4, 16, 64)]
# Against the peers (issue 45): at least GPTQ-Marlin's output tok/s at every row, FP8's up to concurrency 16.
PEER_GOALS = {"gptq": 10 ** 9, "marlin": 10 ** 9, "fp8": 16}
METRICS = ["output_throughput", "total_token_throughput", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
           "completed", "failed", "duration", "total_input_tokens", "total_output_tokens"]


def load(dirs: list[str]) -> tuple[dict, dict]:
    rows, meta = {k: {} for k in KINDS}, {}
    for d in dirs:
        for kind in KINDS:
            p = os.path.join(d, f"{kind}_rows.jsonl")
            if os.path.exists(p):
                for line in open(p):
                    if line.strip():
                        r = json.loads(line)
                        key = (r["input_len"], r["concurrency"])
                        # Rows of one kind may come from several calls: a measured row beats a skipped one.
                        if not (r.get("skipped") and key in rows[kind] and not rows[kind][key].get("skipped")):
                            rows[kind][key] = r
            m = os.path.join(d, f"{kind}_meta.json")
            if os.path.exists(m) and kind not in meta:
                meta[kind] = json.load(open(m))
    return rows, meta


def val(row: dict | None, key: str) -> float:
    if not row or row.get("skipped") or "result" not in row:
        return math.nan
    v = row["result"].get(key)
    return float(v) if isinstance(v, (int, float)) else math.nan


def ratios(e: dict | None, b: dict | None) -> dict:
    def div(x, y):
        return x / y if y and not math.isnan(x) and not math.isnan(y) else math.nan
    return {"out": div(val(e, "output_throughput"), val(b, "output_throughput")),
            "decode": div(val(b, "mean_tpot_ms"), val(e, "mean_tpot_ms")),  # decode tok/s = 1000 / TPOT
            "tpot": div(val(e, "mean_tpot_ms"), val(b, "mean_tpot_ms")),
            "ttft": div(val(e, "mean_ttft_ms"), val(b, "mean_ttft_ms"))}


def goals_for(in_len: int, conc: int, r: dict, goals: list = GOALS) -> list[tuple[str, float, float, str, bool | None]]:
    out = []
    for what, c, n, key, bound, sense in goals:
        if (c is None or c == conc) and (n is None or n == in_len):
            x = r[key]
            ok = None if math.isnan(x) else (x >= bound if sense == "min" else x <= bound)
            out.append((what, x, bound, sense, ok))
    return out


def goal_text(goals) -> str:
    parts = []
    for what, x, bound, sense, ok in goals:
        mark = "n/a" if ok is None else ("met" if ok else "MISSED")
        parts.append(f"{what} {x:.2f}x {'≥' if sense == 'min' else '≤'}{bound:g}: {mark}")
    return "; ".join(parts)


def fmt(x: float, nd: int = 1) -> str:
    return "–" if math.isnan(x) else f"{x:,.{nd}f}"


def keys(rows: dict) -> list[tuple[int, int]]:
    return sorted(set().union(*rows.values()))


def present(rows: dict) -> list[str]:
    """The kinds with rows, in KINDS order (exl3 and bf16 always: the tables are built around them)."""
    return [k for k in KINDS if k in ("exl3", "bf16") or rows[k]]


def peer_lines(rows: dict) -> tuple[list[str], list[str]]:
    """The side-by-side table of every measured kind, with EXL3's ratio to each peer; and the peer goals missed."""
    kinds = present(rows)
    peers = [k for k in kinds if k in PEERS]
    if not peers:
        return [], []
    head = "| in / out | c | " + " | ".join(f"{LABELS[k]} out tok/s" for k in kinds) + " | " + \
        " | ".join(f"EXL3 / {k}" for k in kinds if k != "exl3") + " | " + \
        " | ".join(f"{k} TTFT ms" for k in kinds) + " |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    missed = []
    for key in keys(rows):
        e = rows["exl3"].get(key)
        cells = [fmt(val(rows[k].get(key), "output_throughput")) for k in kinds]
        rat = []
        for k in kinds[1:]:
            x = ratios(e, rows[k].get(key))["out"]
            rat.append(fmt(x, 2))
            if k in PEER_GOALS and key[1] <= PEER_GOALS[k] and not math.isnan(x) and x < 1.0:
                missed.append(f"in {key[0]} c={key[1]}: EXL3 / {k} {x:.2f}x < 1")
        ttft = [fmt(val(rows[k].get(key), "mean_ttft_ms")) for k in kinds]
        out_len = next((x["output_len"] for x in (rows[k].get(key) for k in kinds) if x and "output_len" in x), "?")
        out.append(f"| {key[0]} / {out_len} | {key[1]} | " + " | ".join(cells + rat + ttft) + " |")
    return out, missed


def write_csv(path: str, rows: dict, goals: list = GOALS, commit: str = "", device: str = "") -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        head = ["input_len", "output_len", "concurrency", "num_prompts", "seed"]
        kinds = present(rows)
        peers = [k for k in kinds if k in PEERS]
        head += [f"{k}_{m}" for k in kinds for m in METRICS]
        head += ["ratio_output_tok_s", "ratio_decode_tok_s", "ratio_mean_tpot", "ratio_mean_ttft", "goals"]
        head += [f"ratio_output_tok_s_vs_{k}" for k in peers] + [f"ratio_mean_ttft_vs_{k}" for k in peers]
        # Every row names its tree and GPU, and each kind's nvidia-smi line (clock, power) at its row's end.
        head += ["commit", "device"] + [f"{k}_smi" for k in kinds]
        w.writerow(head)
        for key in keys(rows):
            e, b = rows["exl3"].get(key), rows["bf16"].get(key)
            any_row = e if e and not e.get("skipped") else b or {}
            r = ratios(e, b)
            line = [key[0], any_row.get("output_len", ""), key[1], any_row.get("num_prompts", ""),
                    any_row.get("seed", "")]
            line += [val(rows[k].get(key), m) for k in kinds for m in METRICS]
            line += [r["out"], r["decode"], r["tpot"], r["ttft"], goal_text(goals_for(key[0], key[1], r, goals))]
            line += [ratios(e, rows[k].get(key))["out"] for k in peers]
            line += [ratios(e, rows[k].get(key))["ttft"] for k in peers]
            line += [commit, device] + [(rows[k].get(key) or {}).get("smi", "") for k in kinds]
            w.writerow(["" if isinstance(v, float) and math.isnan(v) else (f"{v:.4g}" if isinstance(v, float) else v)
                        for v in line])


def write_png(path: str, rows: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    lens = sorted({k[0] for k in keys(rows)})
    panels = [("output_throughput", "output tok/s"), ("mean_tpot_ms", "mean TPOT (ms)"),
              ("mean_ttft_ms", "mean TTFT (ms)")]
    fig, axes = plt.subplots(len(lens), 4, figsize=(19, 4.2 * len(lens)), squeeze=False)
    for i, n in enumerate(lens):
        concs = sorted({c for (m, c) in keys(rows) if m == n})
        for j, (metric, label) in enumerate(panels):
            ax = axes[i][j]
            for kind, style in zip(present(rows), ("o-", "s--", "d:", "^-.")):
                name = LABELS[kind]
                pts = [(c, val(rows[kind].get((n, c)), metric)) for c in concs]
                pts = [(c, y) for c, y in pts if not math.isnan(y)]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
            ax.set_title(f"{label}, input {n} tokens")
            ax.set_ylabel(label)
        ax = axes[i][3]
        for key, style, name in (("out", "o-", "out tok/s"), ("decode", "^-", "decode tok/s (1/TPOT)"),
                                 ("ttft", "v--", "TTFT")):
            pts = [(c, ratios(rows["exl3"].get((n, c)), rows["bf16"].get((n, c)))[key]) for c in concs]
            pts = [(c, y) for c, y in pts if not math.isnan(y)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"EXL3 / bf16, input {n} tokens")
        ax.set_ylabel("ratio")
        for ax in axes[i]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs, [str(c) for c in concs])
            ax.set_xlabel("concurrency")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def inspect_text(m: dict) -> str:
    i = m.get("inspect")
    if not i:
        return "–"
    return (f"decoder average {i.get('average_bpw', math.nan):.2f} bpw, head {i.get('head_bits')} bits, "
            f"{i.get('exl3_modules')} EXL3 linears, codebooks {i.get('codebooks')}, "
            f"{i.get('total_bytes', 0) / 2 ** 30:.2f} GiB; made on the device in {m.get('model_s', '?')} s")


def routing_line(meta: dict, kinds: list[str]) -> str:
    """How the MoE rows routed: the rows of kinds whose routers run on weightless models are not comparable."""
    sim = {k: meta.get(k, {}).get("server_log", {}).get("moe_routing_simulated") for k in kinds}
    if all(sim.values()):
        return (f"- MoE routing: vLLM's {'/'.join(sorted(set(sim.values())))} simulation for every kind "
                "(serve_bench.py --moe-routing), since weightless models route every decode row to the same experts "
                "(routing_spread.py)")
    if any(sim.values()):
        return "- MoE routing: simulated for " + ", ".join(k for k in kinds if sim[k]) + " only: NOT COMPARABLE"
    return ("- MoE routing: each model's own router. The weightless kinds (everything but EXL3) then send every "
            "decode row to the same top-k experts (routing_spread.py), so their decode reads k experts a layer where "
            "EXL3's rows spread over most of them: the peers' decode rows are not comparable with EXL3's")


def mem_table(meta: dict, kinds: list[str]) -> list[str]:
    out = ["| | " + " | ".join(LABELS[k] for k in kinds) + " |", "|---|" + "---|" * len(kinds)]
    items = [("weights (vLLM: Model loading took)", "weights_gib", " GiB"),
             ("KV cache (Available KV cache memory)", "kv_cache_gib", " GiB"),
             ("KV cache size", "kv_cache_tokens", " tokens"),
             ("max concurrency at max_model_len", "max_concurrency_x", "x"),
             ("CUDA graphs (s, GiB)", "cuda_graphs_s_gib", ""),
             ("torch.compile", "torch_compile_s", " s"),
             ("engine init (profile, KV, warm-up)", "init_engine_s", " s"),
             ("attention backend", "attention_backend", ""), ("quantization (vLLM's log)", "quantization", ""),
             ("mixed-precision linear kernel (vLLM's log)", "linear_kernel", ""), ("vLLM", "vllm_version", "")]
    for label, key, unit in items:
        cells = []
        for kind in kinds:
            v = meta.get(kind, {}).get("server_log", {}).get(key)
            if key == "kv_cache_gib" and v is None:  # set on the command line (PAIR=1), vLLM logs no size
                fixed = re.search(r"--kv-cache-memory-bytes[ =](\d+)", meta.get(kind, {}).get("commands", {})
                                  .get("serve", ""))
                if fixed:
                    cells.append(f"{int(fixed.group(1)) / 2 ** 30:g} GiB (fixed: --kv-cache-memory-bytes)")
                    continue
            cells.append("–" if v is None else (", ".join(v) if isinstance(v, list) else f"{v}{unit}"))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, key in (("server start to ready", "server_start_s"), ("model prepared in", "model_s")):
        cells = [f"{meta[k][key]} s" if key in meta.get(k, {}) else "–" for k in kinds]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = [meta.get(k, {}).get("nvidia_smi_after_start", "–") for k in kinds]
    out.append("| nvidia-smi after start (name, used, total, SM clock, power) | " + " | ".join(cells) + " |")
    return out


def exactness_lines(path: str) -> list[str]:
    s = json.load(open(path))
    out = [f"Tolerance {s['tol']} (logprob; also the near-tie margin). {s['prompts']} prompts of "
           f"{min(s['prompt_lengths'])}-{max(s['prompt_lengths'])} tokens, {s['tokens']} greedy tokens each; "
           f"vLLM {s.get('vllm')}, "
           f"{'enforce_eager' if s.get('eager') else 'defaults (torch.compile, CUDA graphs)'}. Overall: "
           f"**{'PASS' if s['pass'] else 'FAIL'}**.", "",
           "| check | max prompt logprob diff | mean | max decode logprob diff | greedy tokens equal | "
           "parted at a near tie | mismatches | pass |", "|---|---|---|---|---|---|---|---|"]
    for name, c in s["checks"].items():
        out.append(f"| {name} | {c['max_prompt_logprob_diff']:.4f} | {c['mean_prompt_logprob_diff']:.5f} | "
                   f"{c['max_decode_logprob_diff']:.4f} | {c['greedy_tokens_equal']} / {c['decode_positions']} | "
                   f"{len(c['parted_at_near_tie'])} | {len(c['greedy_mismatches'])} | {c['pass']} |")
    if s.get("errors"):
        out += ["", f"Errors: {s['errors']}"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", action="append", required=True, help="folder with <kind>_rows.jsonl / _meta.json")
    ap.add_argument("--exactness", help="exactness.json from run_exactness.sh")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--date", help="default: the day the exl3 run started (its meta), else today (UTC)")
    ap.add_argument("--name", default="serve-h200")
    ap.add_argument("--preset", default="llama-3-8b", choices=sorted(MODELS), help="the model the rows served")
    ap.add_argument("--commit", help="default: git rev-parse here")
    ap.add_argument("--calls", help="where the sitting's device calls are written down, when not the README's default")
    ap.add_argument("--device-run", action="store_true", help="run on the device copy (no git there)")
    a = ap.parse_args()
    rows, meta = load(a.dir)
    started = [m["started"][:10] for m in meta.values() if m.get("started")]
    a.date = a.date or (started[0] if started else datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    os.makedirs(a.out_dir, exist_ok=True)
    base = os.path.join(a.out_dir, f"{a.date}-{a.name}")
    goals = MOE_GOALS if a.preset == "qwen3-30b-a3b" else GOALS
    commit = a.commit or ("the device copy of the working tree (see the call's report made here)" if a.device_run
                          else git_commit())
    device = next((m["nvidia_smi_after_start"].split(",")[0] for m in meta.values()
                   if m.get("nvidia_smi_after_start", "nvidia-smi:")[:11] != "nvidia-smi:"), "unknown")
    write_csv(base + ".csv", rows, goals, commit, device)
    png_note = write_png(base + ".png", rows)
    title, model_line, calls = MODELS[a.preset]
    md = [f"# Serving: EXL3 4.0 bpw against bf16, {title}, vLLM on {device}", "",
          f"- date: {a.date}; commit: {commit}; device: {device}",
          f"- EXL3 checkpoint as written: {inspect_text(meta.get('exl3', {}))}",
          f"- model: {model_line}",
          "- `vllm bench serve`: random dataset, `--ignore-eos`, prefix caching off on the server, seed = input "
          "length + concurrency (distinct per row, the same prompts for both models), request rate inf, "
          "`--max-concurrency` = c",
          "- ratios are EXL3 / bf16: tok/s above 1 and TPOT/TTFT below 1 favour EXL3; decode tok/s = 1000 / mean "
          "TPOT"] + ([routing_line(meta, present(rows))] if a.preset == "qwen3-30b-a3b" else []) + [""]
    if png_note:
        md += [f"_{png_note}_", ""]
    else:
        md += [f"![serving]({os.path.basename(base)}.png)", ""]
    md += ["| in / out | c | EXL3 out tok/s | bf16 out tok/s | ratio | EXL3 TPOT ms | bf16 TPOT ms | TPOT ratio | "
           "EXL3 TTFT ms | bf16 TTFT ms | TTFT ratio | EXL3 p99 TTFT | bf16 p99 TTFT | goals |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    missed = []
    for key in keys(rows):
        e, b = rows["exl3"].get(key), rows["bf16"].get(key)
        r = ratios(e, b)
        g = goals_for(key[0], key[1], r, goals)
        missed += [f"in {key[0]} c={key[1]}: {w} {x:.2f}x" for w, x, _, _, ok in g if ok is False]
        out_len = next((x["output_len"] for x in (e, b) if x and "output_len" in x), "?")
        md.append(f"| {key[0]} / {out_len} | {key[1]} | {fmt(val(e, 'output_throughput'))} | "
                  f"{fmt(val(b, 'output_throughput'))} | {fmt(r['out'], 2)} | {fmt(val(e, 'mean_tpot_ms'), 2)} | "
                  f"{fmt(val(b, 'mean_tpot_ms'), 2)} | {fmt(r['tpot'], 2)} | {fmt(val(e, 'mean_ttft_ms'))} | "
                  f"{fmt(val(b, 'mean_ttft_ms'))} | {fmt(r['ttft'], 2)} | {fmt(val(e, 'p99_ttft_ms'))} | "
                  f"{fmt(val(b, 'p99_ttft_ms'))} | {goal_text(g) or '–'} |")
    md += ["", f"Goals missed: {', '.join(missed) if missed else 'none'}."]
    side, peer_missed = peer_lines(rows)
    if side:
        md += ["", "## EXL3 beside the other formats", "",
               "Output tok/s of every kind measured, EXL3's ratio to each (above 1 favours EXL3), and mean TTFT. "
               "Peer goals (issue 45): at least GPTQ-Marlin at every row, at least FP8 up to c=16.", ""]
        md += side + ["", f"Peer goals missed: {', '.join(peer_missed) if peer_missed else 'none'}."]
    md += ["", "## GPU memory and start-up", ""]
    md += mem_table(meta, present(rows))
    bad = [f"{k} in {r['input_len']} c={r['concurrency']}: "
           + ("skipped (time)" if r.get("skipped") else f"rc {r.get('rc')}, completed {val(r, 'completed'):.0f}, "
              f"failed {val(r, 'failed'):.0f}")
           for k in present(rows) for r in rows[k].values()
           if r.get("skipped") or r.get("rc") != 0 or val(r, "failed") > 0]
    if bad:
        md += ["", "Incomplete rows: " + "; ".join(bad) + "."]
    if a.exactness and os.path.exists(a.exactness):
        md += ["", "## Exactness (kernels vs the format reference in the same engine)", ""]
        md += exactness_lines(a.exactness)
    md += ["", "## Exact commands", ""]
    if a.calls:  # a sitting that did not follow the README's default calls names its own note
        md += [f"Device calls as run: {a.calls}. The server and bench run in the vLLM kit's environment plus "
               "`VLLM_PLUGINS=exl3` (bench/serve_gpu/device_env.sh); per kind:"]
    else:
        md += ["Device calls, back to back (bench/serve_gpu/README.md); the server and bench run in the vLLM kit's "
               "environment (`/tmp/vllm-kit/env.sh`) plus `VLLM_PLUGINS=exl3` (bench/serve_gpu/device_env.sh):", "",
               "| command | carry |", "|---|---|"]
        md += [f"| `{c}` | `{k}` |" for c, k in calls]
    md += [""]
    for kind in present(rows):
        cmds = meta.get(kind, {}).get("commands", {})
        md += [f"{kind}:", "", "```"]
        md += [f"# model\n{cmds['model']}" if "model" in cmds else "# model: –",
               f"# server\n{cmds['serve']}" if "serve" in cmds else "# server: –", "# bench rows"]
        md += [r["command"] for _, r in sorted(rows[kind].items()) if r.get("command")]
        md += ["```", ""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {base}.md, .csv" + ("" if png_note else ", .png"))
    print("\n".join(line for line in md if line.startswith("| ") and " / " in line.split("|")[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
