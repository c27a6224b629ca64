"""Host (Python) cost of one call of our CUDA linear op, on any machine: launches, cuBLAS and CUDA queries stubbed.

What a step outside a CUDA graph pays per layer before the GPU sees any work (issue 45: a 1k prefill at c=1 runs
without a graph). Real launches (cuLaunchKernel, cuBLAS's host side) come on top.
    .venv/bin/python bench/host_cost.py            # per-call microseconds, Llama-3-8B's four linears
    .venv/bin/python bench/host_cost.py 1024       # also cProfile of one call shape (o_proj at that M)
    python3 bench/host_cost.py --gpu [--out F.json]  # on a GPU: real launches; our op against bf16's F.linear
    .venv/bin/python bench/host_cost.py --dispatch     # the torch op call alone: custom_op against library.define
    .venv/bin/python bench/host_cost.py --csv OUT.csv TREE@COMMIT=F.json ...  # --gpu results as one CSV
"""

import cProfile
import json
import os
import pstats
import sys
import time
import types

import torch

from exl3_vllm.kernels import nvrtc, op, runtime


class _Module:
    def function(self, name, smem=0):
        return name


def stub(patch=setattr, launch=lambda *a, **k: None, mm=lambda a, b, out=None: out) -> runtime.Device:
    """A stand-in H100 (132 SMs, sm_90) whose kernel launches go to launch and cuBLAS GEMMs to mm (default:
    nothing); the measured dispatch is on with nothing measured, so the static plan runs after the same lookups a
    tuned layer pays. patch replaces the attributes (a test passes monkeypatch.setattr)."""
    d = runtime.Device.__new__(runtime.Device)
    d.index, d.device, d.arch, d.sms, d.smem_limit = 0, torch.device("cpu"), 90, 132, 227 * 1024
    d.init_workspace()
    d.module = lambda src, defines: _Module()
    patch(op, "device_for", lambda i: d)
    patch(nvrtc, "launch", launch)
    patch(torch.cuda, "current_stream", lambda dev=None: types.SimpleNamespace(cuda_stream=0))
    patch(torch.cuda, "is_current_stream_capturing", lambda: False)
    patch(torch, "mm", mm)
    patch(torch, "addmm", lambda c, a, b, out=None: mm(a, b, out=out))
    return d


def args(m, k, sizes, bits=4):
    n = sum(sizes)
    return (torch.randn(m, k, dtype=torch.bfloat16), torch.zeros(k // 16, n // 16, 16 * bits, dtype=torch.int16),
            torch.ones(len(sizes) * k, dtype=torch.float16), torch.ones(n, dtype=torch.float16), None, sizes, 0)


def per_call_us(a, n=1000, rounds=7) -> float:
    """The fastest of several rounds: the CPU machine's speed drifts during a session."""
    return min(time_us(lambda: op.linear_cuda(*a), n, warm=50) for _ in range(rounds))


LAYERS = (("qkv", 4096, [4096, 1024, 1024]), ("o", 4096, [4096]), ("gate_up", 4096, [14336, 14336]),
          ("down", 14336, [4096]))


def gpu(out: str | None) -> None:
    """Host time per call with real launches (no sync inside the timed loop; few enough calls that the launch queue
    never fills, so the host is what is timed): torch.ops.exl3.linear as vLLM's graph calls it, linear_cuda directly,
    and F.linear on the dense bf16 weight (bf16's layer). Static dispatch (EXL3_VLLM_TUNE=0), mul1 codebook, 4 bits;
    under torch.inference_mode, as vLLM runs a forward."""
    os.environ.setdefault("EXL3_VLLM_TUNE", "0")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def host_us(fn, n=60) -> tuple[float, float]:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        return host / n * 1e6, (time.perf_counter() - t) / n * 1e6

    big = None
    for name, k, sizes in LAYERS:
        n = sum(sizes)
        tr = torch.randint(-32768, 32767, (k // 16, n // 16, 64), dtype=torch.int16, device=dev, generator=g)
        suh = (torch.randint(0, 2, (len(sizes) * k,), device=dev, generator=g) * 2 - 1).half()
        svh = (torch.rand(n, device=dev, generator=g) * 0.01).half()
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev, generator=g)
        op.prepare(k, n, 4, 2, 8192, dev, sizes)
        for m in (1, 16, 64, 1024):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=g)
            args = (x, tr, suh, svh, None, sizes, 2)
            r = {"layer": name, "m": m, "path": str(op.plan_for(op.device_for(0), m, k, n, 4, 2, sizes))}
            calls = {"op": lambda: torch.ops.exl3.linear(*args), "linear_cuda": lambda: op.linear_cuda(*args),
                     "bf16": lambda: torch.nn.functional.linear(x, w)}
            for key, fn in calls.items():
                r[f"{key}_host_us"], r[f"{key}_wall_us"] = (round(v, 1) for v in host_us(fn))
            rows.append(r)
            print(json.dumps(r), flush=True)
            big = args if (name, m) == ("gate_up", 1024) else big
    for m in (1, 16, 64, 1024):
        us = {key: sum(r[f"{key}_host_us"] for r in rows if r["m"] == m) for key in ("op", "linear_cuda", "bf16")}
        print(f"M={m}: one layer's four calls, host µs: " + ", ".join(f"{k} {v:.0f}" for k, v in us.items()))
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(40):
        torch.ops.exl3.linear(*big)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def dispatch() -> None:
    """What calling a torch op costs before its body runs, for an op of exl3::linear's signature whose body returns
    a ready tensor: registered with torch.library.custom_op and with library.define."""
    from typing import List, Optional

    from exl3_vllm.kernels import library

    ready = torch.empty(4, 256)

    def body(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
             bias: Optional[torch.Tensor], shard_sizes: List[int], codebook: int) -> torch.Tensor:
        return ready

    def fake(x, trellis, suh, svh, bias, shard_sizes, codebook):
        return torch.empty_like(ready)

    wrapped = torch.library.custom_op("exl3::host_cost_custom_op", body, mutates_args=())
    wrapped.register_fake(fake)
    library.define("host_cost_library", body, fake)
    a = (torch.randn(4, 256), torch.zeros(16, 16, 64, dtype=torch.int16), torch.ones(256).half(),
         torch.ones(256).half(), None, [256], 2)
    calls = {"custom_op, .default (a compiled graph's call)": torch.ops.exl3.host_cost_custom_op.default,
             "custom_op, torch.ops.exl3.x (eager)": torch.ops.exl3.host_cost_custom_op,
             "library.define, .default": torch.ops.exl3.host_cost_library.default,
             "library.define, torch.ops.exl3.x": torch.ops.exl3.host_cost_library}
    for name, f in calls.items():
        us = min(time_us(lambda: f(*a)) for _ in range(3))
        print(f"{name}: {us:.1f} µs a call")


def to_csv(path: str, runs: list[str]) -> None:
    """--gpu results (TREE@COMMIT=F.json, e.g. new@8f89347=host_cost_gpu_new.json) as one CSV row per tree, layer
    and M."""
    import csv

    with open(path, "w", newline="") as f:
        w = None
        for run in runs:
            name, _, src = run.partition("=")
            tree, _, commit = name.partition("@")
            data = json.load(open(src))
            for r in data["rows"]:
                row = {"tree": tree, "commit": commit, "device": data["device"], **r}
                if w is None:
                    w = csv.DictWriter(f, list(row))
                    w.writeheader()
                w.writerow(row)


def time_us(fn, n=20000, warm=200) -> float:
    for _ in range(warm):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


if __name__ == "__main__":
    if "--csv" in sys.argv:
        to_csv(sys.argv[sys.argv.index("--csv") + 1], [a for a in sys.argv[1:] if "=" in a])
        sys.exit(0)
    if "--dispatch" in sys.argv:
        dispatch()
        sys.exit(0)
    if "--gpu" in sys.argv:
        with torch.inference_mode():  # as vLLM runs a forward: no autograd bookkeeping around any call
            gpu(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None)
        sys.exit(0)
    stub()
    print("| M | path | " + " | ".join(name for name, _, _ in LAYERS) + " | one layer | 32 layers |")
    print("|---" * (4 + len(LAYERS)) + "|")
    for m in (1, 16, 64, 1024):
        us = [per_call_us(args(m, k, sizes)) for _, k, sizes in LAYERS]
        path = op.plan_for(op.device_for(0), m, 4096, 4096, 4, 0, [4096]).path
        print(f"| {m} | {path} | " + " | ".join(f"{u:.0f} µs" for u in us) + f" | {sum(us):.0f} µs | "
              f"{32 * sum(us) / 1000:.1f} ms |")
    if len(sys.argv) > 1:
        a = args(int(sys.argv[1]), 4096, [4096])
        cProfile.run("for _ in range(2000): op.linear_cuda(*a)", "/tmp/host_cost.prof")
        pstats.Stats("/tmp/host_cost.prof").sort_stats("tottime").print_stats(15)
