"""Runs tests/vllm_runner.py (one vLLM CPU engine) in a subprocess, for the end-to-end tests."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def engine_env(tp: int = 1) -> dict:
    """Offline, 1 GiB of KV cache; one rank runs in-process, more need worker processes bound to the cores."""
    e = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    if tp == 1:
        e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        e["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    return e


def stubs_env() -> dict:
    """tests/stubs on PYTHONPATH where torchvision is missing (the CPU set-up; tests/stubs/torchvision says why), so
    that vLLM can import its Qwen3.5 / Qwen-VL modules; nothing where the real one is installed."""
    import importlib.util

    spec = importlib.util.find_spec("torchvision")
    if spec and not (spec.origin or "").startswith(os.path.join(HERE, "stubs")):  # the stub may be imported already
        return {}
    return {"PYTHONPATH": os.path.join(HERE, "stubs") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _args(model, dtype, prompts, max_tokens, tp, extra):
    return [sys.executable, os.path.join(HERE, "vllm_runner.py"), model, dtype, json.dumps(prompts), str(max_tokens),
            str(tp)] + ([json.dumps(extra)] if extra else [])


def run_engine(model, dtype, prompts, max_tokens, tp=1, extra=None, env=None, timeout=600):
    """The finished subprocess; extra adds LLM(...) arguments, env adds environment variables."""
    return subprocess.run(_args(model, dtype, prompts, max_tokens, tp, extra), capture_output=True, text=True,
                          timeout=timeout, env=dict(engine_env(tp), **(env or {})))


def start_engine(model, dtype, prompts, max_tokens, tp=1, extra=None, env=None):
    """run_engine in the background (engine start-up is mostly one core's work, so two overlap well); finish() it."""
    return subprocess.Popen(_args(model, dtype, prompts, max_tokens, tp, extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(engine_env(tp), **(env or {})))


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def results(proc):
    """The runner's RESULT line, or a failure showing the engine's output."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])
