"""EXL3 GPU kernels (NVRTC-compiled CUDA C++) and the torch.ops.exl3.linear op."""

from .nvrtc import KernelError
from .op import backend, deterministic, linear, linear_cuda, plan, prepare

__all__ = ["KernelError", "backend", "deterministic", "linear", "linear_cuda", "plan", "prepare"]
