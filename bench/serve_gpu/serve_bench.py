"""Serving benchmark of one model kind: make the model in /tmp, start `vllm serve`, run `vllm bench serve` rows.

Kinds: exl3 (our checkpoint), bf16 (the same config, `--load-format dummy`), fp8 (that, with `--quantization fp8`:
vLLM's online FP8), gptq (that, with a 4-bit group-128 GPTQ quantization_config: the kernel vLLM picks, Machete on
Hopper), marlin (the same GPTQ model with Machete disabled: Marlin).
On the GPU machine (run_speed.sh wraps it):
    python3 bench/serve_gpu/serve_bench.py --kind exl3 --out $OUT --deadline EPOCH
    python3 bench/serve_gpu/serve_bench.py --kind bf16 --out $OUT --deadline EPOCH
Written as it goes, so a timeout still returns data: $OUT/<kind>_rows.jsonl (one JSON per row),
<kind>_meta.json, <kind>_server.log, <kind>_bench.log; rows and meta are also kept in /tmp/serve-bench.
"""

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request

WORK = "/tmp/serve-bench"
OUTPUT_LEN = 256
# (input tokens, concurrency, prompts): at the kit's bf16 pace on the H200 each row takes about 10-30 s.
ROWS = [(1024, 1, 10), (1024, 4, 24), (1024, 16, 96), (1024, 64, 192),
        (8192, 1, 8), (8192, 4, 20), (8192, 16, 48), (8192, 64, 96)]
# Seconds a row may need (bf16 pace x 1.5 + bench start-up): a row that cannot finish before the deadline is skipped.
EST_S = {(1024, 1): 35, (1024, 4): 30, (1024, 16): 30, (1024, 64): 35,
         (8192, 1): 35, (8192, 4): 35, (8192, 16): 45, (8192, 64): 60}
# 8192 + 256 tokens exceed Llama-3-8B's 8192 positions; a longer RoPE table changes no shapes or FLOPs.
MAX_POSITIONS = 16384
LOG_PATTERNS = {
    "weights_gib": r"Model loading took ([\d.]+) GiB",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "max_concurrency_x": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
    "cuda_graphs_s_gib": r"Graph capturing finished in ([\d.]+) secs, took ([\d.]+) GiB",
    "torch_compile_s": r"torch.compile took ([\d.]+) s in total",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "vllm_version": r"Initializing a V1 LLM engine \(v([\w.+-]+)\)",
    "attention_backend": r"Using (\w+) attention backend",
    "quantization": r"quantization=(\w+)",
    # which kernel a GPTQ config runs (Machete or Marlin on Hopper; weights_gib tells whether it is really 4-bit)
    "linear_kernel": r"Using (\w+LinearKernel)",
    "moe_routing_simulated": r"Simulating MoE routing using a (\w+) strategy",
}


KINDS = ("exl3", "bf16", "fp8", "gptq", "marlin")
GPTQ_KINDS = ("gptq", "marlin")


def server_env(kind: str, moe_routing: str = "") -> dict:
    """On Hopper vLLM runs a GPTQ config on Machete, ahead of Marlin in its kernel list: marlin is the same model with
    Machete switched off (its log line `Using ...LinearKernel` says which ran). moe_routing: vLLM's routing
    simulation for every kind alike, since models without weights route every decode row to the same experts
    (routing_spread.py)."""
    env = dict(os.environ)
    if kind == "marlin":
        env["VLLM_DISABLED_KERNELS"] = "MacheteLinearKernel"
    if moe_routing:
        env["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] = moe_routing
    return env


def is_moe(cfg: dict) -> bool:
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))


def gptq_config(cfg: dict) -> dict:
    """A 4-bit, group-128, symmetric GPTQ quantization_config vLLM runs on Marlin. The linears are named: with no
    weight files (--load-format dummy) vLLM cannot find them in the safetensors headers and would leave every layer
    bf16 (the 2026-12-06 attempt loaded 14.96 GiB)."""
    linears = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    if is_moe(cfg):
        linears += ["mlp.experts"]
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq", "lm_head": False, "modules_in_block_to_quantize": [linears]}


def answers(port: int) -> bool:
    """Whether a server on this port answers /v1/models."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_until_up(proc: subprocess.Popen, port: int, until: float) -> bool:
    """Poll a starting `vllm serve` until it answers (True), or it exits or the epoch time `until` passes (False)."""
    while proc.poll() is None and time.time() < until:
        if answers(port):
            return True
        time.sleep(1)
    return False


def wait_files(paths: list, until: float) -> bool:
    """Wait until every path exists (True) or the epoch time `until` passes (False)."""
    while not all(os.path.exists(p) for p in paths):
        if time.time() > until:
            return False
        time.sleep(0.5)
    return True


def touch(path: str) -> None:
    if path:
        open(path, "a").close()


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session, with its engine process: SIGINT, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 25), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass


class Run:
    def __init__(self, a):
        self.a = a
        self.kind = a.kind
        self.t0 = time.time()
        self.deadline = a.deadline or self.t0 + 560
        os.makedirs(a.out, exist_ok=True)
        os.makedirs(WORK, exist_ok=True)
        self.bench_log = open(os.path.join(a.out, f"{a.kind}_bench.log"), "a")
        self.meta = {"kind": a.kind, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commands": {},
                     "rows_plan": [list(r) for r in a.rows], "output_len": a.output_len}

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:6.1f}s {self.kind}] {msg}"
        print(line, flush=True)
        self.bench_log.write(line + "\n")
        self.bench_log.flush()

    def save_meta(self) -> None:
        for d in (self.a.out, WORK):
            with open(os.path.join(d, f"{self.kind}_meta.json"), "w") as f:
                json.dump(self.meta, f, indent=1)

    def add_row(self, row: dict) -> None:
        for d in (self.a.out, WORK):
            with open(os.path.join(d, f"{self.kind}_rows.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

    # ---- model --------------------------------------------------------------------------------
    def make_model(self) -> str:
        a = self.a
        model = a.model_dir or os.path.join(WORK, f"{a.preset}-{a.kind}")
        cfg_path = os.path.join(WORK, f"{a.preset}-config.json")
        from exl3_vllm.synth import load_config

        cfg = load_config(a.preset)
        cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings") or 0, a.max_positions)
        with open(cfg_path + f".{os.getpid()}", "w") as f:  # paired kinds write it at once
            json.dump(cfg, f, indent=1)
        os.replace(cfg_path + f".{os.getpid()}", cfg_path)
        synth = [sys.executable, "-m", "exl3_vllm.cli", "synth", "--config", cfg_path, "--out", model, "--overwrite"]
        if a.kind == "exl3":
            synth += ["--bits", str(a.bits), "--codebook", "mul1", "--head-bits", str(a.head_bits), "--seed", "0"]
        else:
            synth += ["--config-only", "--dense-dtype", "bfloat16"]
        done = os.path.join(model, ".serve_bench_done")
        self.meta["commands"]["model"] = shlex.join(synth)
        try:
            info = json.load(open(done))
        except (OSError, ValueError):
            info = {}
        if info.get("command") == shlex.join(synth):
            self.meta.update(info.get("meta", {}))
            self.say(f"model already in {model} (made by an earlier call)")
            return model
        t = time.time()
        p = subprocess.run(synth, capture_output=True, text=True)
        self.say(f"model: {(p.stdout + p.stderr).strip()[-400:]} ({time.time() - t:.1f} s)")
        if p.returncode:
            raise SystemExit(f"synth failed (rc {p.returncode})")
        made = {"model_s": round(time.time() - t, 1)}
        if a.kind == "exl3":
            q = subprocess.run([sys.executable, "-m", "exl3_vllm.cli", "inspect", model, "--json"],
                               capture_output=True, text=True)
            try:
                made["inspect"] = {k: v for k, v in json.loads(q.stdout).items() if k not in ("modules", "warnings")}
            except ValueError:
                made["inspect_error"] = (q.stdout + q.stderr)[-500:]
        if a.kind in GPTQ_KINDS:
            cfg_file = os.path.join(model, "config.json")
            c = json.load(open(cfg_file))
            c["quantization_config"] = gptq_config(c)
            json.dump(c, open(cfg_file, "w"), indent=1)
        made["model_dir_bytes"] = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model))
        self.meta.update(made)
        with open(done, "w") as f:
            json.dump({"command": shlex.join(synth), "meta": made}, f)
        return model

    # ---- server -------------------------------------------------------------------------------
    def start_server(self, model: str):
        a = self.a
        self.name = f"{a.preset}-{a.kind}"
        cmd = shlex.split(a.vllm_cli) + [
            "serve", model, "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(a.port),
            "--dtype", "bfloat16", "--max-model-len", str(a.max_model_len), "--no-enable-prefix-caching",
            "--gpu-memory-utilization", str(a.gpu_mem), "--disable-uvicorn-access-log"] + shlex.split(a.serve_args)
        if a.kind != "exl3":
            cmd += ["--load-format", "dummy"]
        if a.kind == "fp8":
            cmd += ["--quantization", "fp8"]
        self.meta["commands"]["serve"] = shlex.join(cmd)
        self.say("serve: " + shlex.join(cmd))
        self.server_log_path = os.path.join(a.out, f"{a.kind}_server.log")
        log = open(self.server_log_path, "w")
        # Own session: the server and its engine process are stopped together by process-group id.
        routing = a.moe_routing if a.moe_routing != "model" and is_moe(json.load(open(f"{model}/config.json"))) else ""
        self.meta["moe_routing"] = routing or "model"
        env = server_env(a.kind, routing)
        changed = [f"{k}={env[k]}" for k in ("VLLM_DISABLED_KERNELS", "VLLM_MOE_ROUTING_SIMULATION_STRATEGY")
                   if env.get(k) != os.environ.get(k)]
        if changed:
            self.meta["commands"]["serve_env"] = " ".join(changed)
        self.server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        t = time.time()
        if not wait_until_up(self.server, a.port, self.deadline - 40):
            if self.server.poll() is not None:
                self.say(f"server exited with {self.server.returncode} during start-up; log tail:\n"
                         + self.tail(self.server_log_path, 4000))
            else:
                self.say("server not up before the deadline")
            return False
        self.meta["server_start_s"] = round(time.time() - t, 1)
        self.say(f"server up in {self.meta['server_start_s']} s")
        self.meta["server_log"] = self.parse_log()
        self.meta["nvidia_smi_after_start"] = self.smi()
        self.save_meta()
        return True

    def parse_log(self) -> dict:
        text = open(self.server_log_path, errors="replace").read()
        found = {}
        for key, pat in LOG_PATTERNS.items():
            m = re.findall(pat, text)
            if m:
                found[key] = m[-1] if isinstance(m[-1], str) else list(m[-1])
        return found

    @staticmethod
    def tail(path: str, n: int) -> str:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode(errors="replace")

    @staticmethod
    def smi() -> str:
        try:
            return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total,clocks.sm,power.draw",
                                   "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            return f"nvidia-smi: {e}"

    def stop_server(self) -> None:
        if getattr(self, "server", None) is None or self.server.poll() is not None:
            return
        stop_group(self.server)
        self.say(f"server stopped (rc {self.server.returncode})")

    def warmup(self) -> None:
        # One long and a few short prompts first, so that no measured row pays for first-use work.
        def req(n_tok, max_tokens):
            body = json.dumps({"model": self.name, "prompt": [5 + i % 1000 for i in range(n_tok)],
                               "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}).encode()
            r = urllib.request.Request(f"http://127.0.0.1:{self.a.port}/v1/completions", body,
                                       {"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(r, timeout=120).read()
            except OSError as e:
                self.say(f"warm-up request failed: {e}")
        t = time.time()
        long_len = min(8192, self.a.max_model_len - 16)
        threads = [threading.Thread(target=req, args=(long_len, 8))] + [
            threading.Thread(target=req, args=(min(1024, long_len), 32)) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.say(f"warm-up {time.time() - t:.1f} s")

    # ---- rows ---------------------------------------------------------------------------------
    def bench_row(self, model: str, in_len: int, conc: int, n: int) -> dict:
        a = self.a
        seed = in_len + conc  # distinct per row, the same for both kinds: EXL3 and bf16 see the same prompts
        fname = f"{a.kind}-in{in_len}-c{conc}.json"
        raw_dir = os.path.join(WORK, "raw")
        cmd = shlex.split(a.vllm_cli) + [
            "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{a.port}",
            "--endpoint", "/v1/completions", "--model", self.name, "--tokenizer", model,
            "--dataset-name", "random", "--random-input-len", str(in_len), "--random-output-len", str(a.output_len),
            "--ignore-eos", "--max-concurrency", str(conc), "--num-prompts", str(n), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--disable-tqdm", "--save-result", "--result-dir", raw_dir, "--result-filename", fname]
        row = {"kind": a.kind, "input_len": in_len, "output_len": a.output_len, "concurrency": conc,
               "num_prompts": n, "seed": seed, "command": shlex.join(cmd)}
        path = os.path.join(raw_dir, fname)
        if os.path.exists(path):
            os.remove(path)
        self.say(f"row in={in_len} c={conc} n={n}")
        self.bench_log.write(f"$ {row['command']}\n")
        self.bench_log.flush()
        t = time.time()
        try:
            p = subprocess.run(cmd, stdout=self.bench_log, stderr=subprocess.STDOUT,
                               timeout=max(10, self.left() - 20))
            row["rc"] = p.returncode
        except subprocess.TimeoutExpired:
            row["rc"] = "timeout"
        row["wall_s"] = round(time.time() - t, 1)
        if os.path.exists(path):
            res = json.load(open(path))
            row["result"] = {k: v for k, v in res.items() if not isinstance(v, (list, dict))}
        row["smi"] = self.smi()
        return row

    def run(self) -> int:
        model = self.make_model()
        self.save_meta()
        if self.a.prepare_only:
            return 0
        try:
            return self.serve(model)
        finally:
            touch(self.a.ready_file)  # also on failure: a paired run must not wait for a server that never comes
            touch(self.a.done_file)

    def serve(self, model: str) -> int:
        for d in (self.a.out, WORK):
            open(os.path.join(d, f"{self.kind}_rows.jsonl"), "w").close()
        up = self.start_server(model)
        touch(self.a.ready_file)
        if not up:
            self.stop_server()
            self.meta["error"] = "server did not start"
            self.save_meta()
            return 2
        try:
            if self.a.turn_after:
                # Paired servers: rows only once no other server is starting or running rows on this GPU.
                t = time.time()
                if not wait_files(self.a.turn_after, self.deadline - 60):
                    self.say(f"turn never came ({self.a.turn_after})")
                    self.meta["error"] = "turn never came"
                    return 2
                self.meta["turn_wait_s"] = round(time.time() - t, 1)
                self.say(f"turn after {self.meta['turn_wait_s']} s")
            self.warmup()
            for in_len, conc, n in self.a.rows:
                need = EST_S.get((in_len, conc), 40) * self.a.est_scale
                if self.left() - 25 < need:
                    self.say(f"skip in={in_len} c={conc}: {self.left():.0f} s left, the row needs ~{need:.0f} s")
                    self.add_row({"kind": self.kind, "input_len": in_len, "concurrency": conc, "skipped": True})
                    continue
                row = self.bench_row(model, in_len, conc, n)
                self.add_row(row)
                r = row.get("result", {})
                self.say(f"  -> {r.get('output_throughput', float('nan')):.1f} out tok/s, TPOT "
                         f"{r.get('mean_tpot_ms', float('nan')):.2f} ms, TTFT {r.get('mean_ttft_ms', float('nan')):.1f}"
                         f" ms, {row['wall_s']} s (rc {row['rc']})")
        finally:
            self.meta["server_log"] = self.parse_log()
            self.stop_server()
            self.meta["total_s"] = round(time.time() - self.t0, 1)
            self.save_meta()
        print_table(os.path.join(self.a.out, f"{self.kind}_rows.jsonl"))
        return 0


def print_table(path: str) -> None:
    print(f"{'kind':<5} {'in':>5} {'c':>3} {'n':>4} {'out tok/s':>10} {'TPOT ms':>8} {'TTFT ms':>8} {'p99 TTFT':>9} "
          f"{'ok':>4} {'wall s':>6}")
    for line in open(path):
        r = json.loads(line)
        if r.get("skipped"):
            print(f"{r['kind']:<5} {r['input_len']:>5} {r['concurrency']:>3}  skipped")
            continue
        x = r.get("result", {})
        print(f"{r['kind']:<5} {r['input_len']:>5} {r['concurrency']:>3} {r['num_prompts']:>4} "
              f"{x.get('output_throughput', float('nan')):>10.1f} {x.get('mean_tpot_ms', float('nan')):>8.2f} "
              f"{x.get('mean_ttft_ms', float('nan')):>8.1f} {x.get('p99_ttft_ms', float('nan')):>9.1f} "
              f"{x.get('completed', 0):>4} {r['wall_s']:>6}")


def parse_rows(text: str) -> list:
    if text == "all":
        return ROWS
    rows = []
    for item in text.split(","):
        parts = [int(v) for v in item.split(":")]
        rows.append(tuple(parts) if len(parts) == 3 else (parts[0], parts[1], dict(((r[0], r[1]), r[2])
                                                                                    for r in ROWS)[tuple(parts)]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/serve-out"))
    ap.add_argument("--deadline", type=float, default=0, help="epoch seconds by which everything must be written")
    ap.add_argument("--rows", type=parse_rows, default=ROWS, help="all, or IN:C[:N],... (default all)")
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--max-positions", type=int, default=MAX_POSITIONS)
    ap.add_argument("--bits", default="4")
    ap.add_argument("--head-bits", default="6")
    ap.add_argument("--model-dir")
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    ap.add_argument("--max-model-len", type=int, default=8192 + OUTPUT_LEN + 64,
                    help="64 spare tokens for re-tokenized prompts")
    ap.add_argument("--gpu-mem", type=float, default=0.90)
    ap.add_argument("--port", type=int, default=8361)
    ap.add_argument("--serve-args", default="", help="extra `vllm serve` arguments (both kinds alike)")
    ap.add_argument("--moe-routing", default="uniform_random",
                    help="MoE models: vLLM's routing simulation strategy for every kind, or `model` (the router's)")
    ap.add_argument("--est-scale", type=float, default=1.0, help="scale of the per-row time estimates")
    cli = os.environ.get("VKIT_CLI", "-m vllm.entrypoints.cli.main")
    ap.add_argument("--vllm-cli", default=f"{sys.executable} {cli}",
                    help="how to run vLLM's command line (default: python3 $VKIT_CLI)")
    # Paired runs (run_kinds.sh PAIR=1): servers start together, then take turns with the GPU for their rows.
    ap.add_argument("--ready-file", default="", help="touched once this server is up (or failed to start)")
    ap.add_argument("--turn-after", type=lambda t: [p for p in t.split(",") if p], default=[],
                    help="files (comma-separated) to wait for between start-up and warm-up")
    ap.add_argument("--done-file", default="", help="touched once this kind's rows are done and its server stopped")
    ap.add_argument("--prepare-only", action="store_true", help="only make the model (an earlier call can do it)")
    ap.add_argument("--table", metavar="ROWS_JSONL", help="only print the table of a rows file")
    a = ap.parse_args()
    if a.table:
        print_table(a.table)
        return 0
    return Run(a).run()


if __name__ == "__main__":
    sys.exit(main())
