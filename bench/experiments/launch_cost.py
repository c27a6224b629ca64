"""Host cost of one kernel launch, four ways, on a GPU (issue 45: what our op's launches cost a step outside CUDA
graphs, 2026-12-07b). A one-block copy kernel, compiled with NVRTC:
  - cuda-python's cuLaunchKernel, as nvrtc.launch calls it;
  - cuda-python's cuLaunchKernelEx with a programmatic dependent launch, as nvrtc.launch calls it for a GEMM;
  - the driver's cuLaunchKernel called through ctypes (no cuda-python objects);
  - torch's own copy_ of the same bytes (an ATen launch, for scale).
Each figure: host µs a launch, 200 launches with no sync inside, the fastest of 7 rounds; the ctypes launch's output
is checked against its input.
    python3 bench/experiments/launch_cost.py [--out F.json]
"""

import ctypes
import json
import sys
import time

import torch

from exl3_vllm.kernels import nvrtc

SRC = b"""extern "C" __global__ void launch_probe(const float* x, float* y, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
"""


def host_us(fn, n=200, rounds=7) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> int:
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(0)
    mod = nvrtc.Module(nvrtc.compile_source("launch_probe.cu", 10 * major + minor, text=SRC), 0)
    f = mod.function("launch_probe")
    n = 128
    x = torch.randn(n, device=dev)
    y = torch.full((n,), float("nan"), device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    args = [ctypes.c_uint64(x.data_ptr()), ctypes.c_uint64(y.data_ptr()), ctypes.c_int32(n)]

    cuda = ctypes.CDLL("libcuda.so.1")
    launch = cuda.cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    handle = int(f)
    ptrs = (ctypes.c_void_p * 3)(*[ctypes.addressof(a) for a in args])

    def direct():
        err = launch(handle, 1, 1, 1, n, 1, 1, 0, stream, ptrs, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel through ctypes: error {err}")

    direct()
    torch.cuda.synchronize()
    assert torch.equal(y, x), "the ctypes launch did not copy x"
    ways = {
        "cuda-python cuLaunchKernel": lambda: nvrtc.launch(f, (1, 1, 1), (n, 1, 1), 0, stream, args),
        "cuda-python cuLaunchKernelEx (PDL)": lambda: nvrtc.launch(f, (1, 1, 1), (n, 1, 1), 0, stream, args,
                                                                 overlap_previous=True),
        "ctypes cuLaunchKernel": direct,
        "torch copy_": lambda: y.copy_(x),
    }
    rows = {name: round(host_us(fn), 2) for name, fn in ways.items()}
    for name, us in rows.items():
        print(f"{name}: {us:.2f} µs a launch")
    if "--out" in sys.argv:
        with open(sys.argv[sys.argv.index("--out") + 1], "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "host_us": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
