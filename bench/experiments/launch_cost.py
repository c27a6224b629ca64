"""Host cost of one kernel launch, five ways, on a GPU (issue 45: what our op's launches cost a step outside CUDA
graphs, 2026-12-07b). A one-block copy kernel, compiled with NVRTC:
  - cuda-python's cuLaunchKernel;
  - cuda-python's cuLaunchKernelEx with a programmatic dependent launch (configuration built once), as for a GEMM;
  - the driver's cuLaunchKernel called through ctypes (no cuda-python objects);
  - the driver's cuLaunchKernelEx through ctypes, the same programmatic dependent launch (cuda.h's structs);
  - torch's own copy_ of the same bytes (an ATen launch, for scale).
Each figure: host µs a launch, 200 launches with no sync inside, the fastest of 7 rounds; each ctypes launch's
output is checked against its input.
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


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes, pointer-aligned
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int),
                ("align", ctypes.c_void_p)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, the value
    _fields_ = [("id", ctypes.c_int), ("value", _AttrValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)),
                ("numAttrs", ctypes.c_uint)]


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

    from cuda.bindings import driver as drv

    attr = _Attr()
    attr.id = int(drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = _Config(1, 1, 1, n, 1, 1, 0, stream, ctypes.pointer(attr), 1)
    assert ctypes.sizeof(_Attr) == 72 and ctypes.sizeof(_Config) == 56 and _Config.hStream.offset == 32
    launch_ex = cuda.cuLaunchKernelEx
    launch_ex.restype = ctypes.c_int
    launch_ex.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    cfg_p = ctypes.pointer(cfg)

    def direct_ex():
        err = launch_ex(cfg_p, handle, ptrs, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx through ctypes: error {err}")

    for fn in (direct, direct_ex):
        y.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        assert torch.equal(y, x), f"{fn.__name__}: the launch did not copy x"

    def wrapped():  # through cuda-python's wrappers, arguments as nvrtc.launch builds them
        p = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        err = drv.cuLaunchKernel(f, 1, 1, 1, n, 1, 1, 0, drv.CUstream(stream), ctypes.addressof(p), 0)[0]
        assert int(err) == 0, err

    wcfg = drv.CUlaunchConfig()
    wcfg.gridDimX, wcfg.gridDimY, wcfg.gridDimZ, wcfg.blockDimX, wcfg.blockDimY, wcfg.blockDimZ = 1, 1, 1, n, 1, 1
    wcfg.sharedMemBytes, wcfg.hStream = 0, drv.CUstream(stream)
    wattr = drv.CUlaunchAttribute()
    wattr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    wattr.value.programmaticStreamSerializationAllowed = 1
    wcfg.attrs, wcfg.numAttrs = [wattr], 1

    def wrapped_ex():  # the same, with the configuration built once
        p = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        err = drv.cuLaunchKernelEx(wcfg, f, ctypes.addressof(p), 0)[0]
        assert int(err) == 0, err

    ways = {
        "cuda-python cuLaunchKernel": wrapped,
        "cuda-python cuLaunchKernelEx (PDL)": wrapped_ex,
        "ctypes cuLaunchKernel": direct,
        "ctypes cuLaunchKernelEx (PDL)": direct_ex,
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
