"""EXL3 GPU kernels (NVRTC-compiled CUDA C++): torch.ops.exl3.linear and torch.ops.exl3.moe_experts; and
torch.ops.exl3.embedding (torch ops for now)."""

from .embedding import embedding
from .nvrtc import KernelError
from .op import backend, deterministic, linear, linear_cuda, plan, prepare
from .moe import moe_cuda, moe_experts, prepare_moe
from .runtime import concurrent_stream

__all__ = ["KernelError", "backend", "concurrent_stream", "deterministic", "embedding", "linear", "linear_cuda",
           "moe_cuda", "moe_experts", "plan", "prepare", "prepare_moe"]
