"""Per-GPU state shared by the dense and MoE ops: compiled modules, workspace buffers that only grow (captured CUDA
graphs keep pointing at them), and the argument struct every GEMM kernel takes."""

from __future__ import annotations

import contextlib
import ctypes
import threading

import torch

from . import nvrtc
from .nvrtc import KernelError


class GemmArgs(ctypes.Structure):
    _fields_ = [("xh", ctypes.c_uint64), ("trellis", ctypes.c_uint64), ("svh", ctypes.c_uint64),
                ("bias", ctypes.c_uint64), ("out", ctypes.c_uint64), ("ws", ctypes.c_uint64),
                ("counters", ctypes.c_uint64), ("m", ctypes.c_int32), ("k", ctypes.c_int32),
                ("n_total", ctypes.c_int32), ("splits", ctypes.c_int32), ("steps_per_split", ctypes.c_int32),
                ("mode", ctypes.c_int32), ("nshards", ctypes.c_int32), ("shard_end", ctypes.c_int32 * 8),
                ("stream", ctypes.c_int32), ("xmeta", ctypes.c_uint64), ("block_expert", ctypes.c_uint64),
                ("expert_where", ctypes.c_uint64), ("expert_words", ctypes.c_int64), ("group", ctypes.c_int32),
                ("mblocks", ctypes.c_int32), ("dp", ctypes.c_int32), ("xraw", ctypes.c_uint64),
                ("suh", ctypes.c_uint64)]


MAX_SHARDS = 8


class Device:
    """Per-device modules and workspace; buffers only grow (but inside scratch_workspace) and old ones stay alive for
    captured graphs."""

    def __init__(self, index: int):
        self.index = index
        self.device = torch.device("cuda", index)
        cap = torch.cuda.get_device_capability(index)
        self.arch = cap[0] * 10 + cap[1]
        if self.arch < 80:
            raise KernelError(f"cuda:{index} is sm_{self.arch}; exl3-vllm kernels need sm_80 or newer "
                              "(set EXL3_VLLM_BACKEND=reference to run the slow reference instead)")
        props = torch.cuda.get_device_properties(index)
        self.sms = props.multi_processor_count
        self.smem_limit = getattr(props, "shared_memory_per_block_optin", 99 * 1024)
        self.bufs: dict[str, torch.Tensor] = {}
        self._old: list[torch.Tensor] = []
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def scratch_workspace(self):
        """Workspace grown inside the block is released when it ends; what was reserved before stays as it was."""
        bufs, old = self.bufs, self._old
        self.bufs, self._old = dict(bufs), []
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the block's kernels are done with what is released
            self.bufs, self._old = bufs, old

    def module(self, source: str, defines: dict | None):
        mod = nvrtc.loaded(source, self.arch, defines, self.index)
        if mod is None:
            if torch.cuda.is_current_stream_capturing():
                raise KernelError(f"EXL3 kernel module {source} {defines} is not loaded and a CUDA graph is being "
                                  "captured; call exl3_vllm.kernels.prepare(...) for this layer before capture")
            mod = nvrtc.load(source, self.arch, defines, self.index)
        return mod

    def buf(self, name: str, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        b = self.bufs.get(name)
        if b is None or b.numel() < numel:
            if torch.cuda.is_current_stream_capturing():
                raise KernelError(f"EXL3 workspace '{name}' needs {numel} elements but {0 if b is None else b.numel()} "
                                  "are reserved and a CUDA graph is being captured; call "
                                  "exl3_vllm.kernels.prepare(..., max_m=...) with the largest batch before capture")
            if b is not None:
                self._old.append(b)
            numel = max(numel, 1)
            b = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=self.device)
            self.bufs[name] = b
        return b


_devices: dict[int, Device] = {}


def device_for(index: int) -> Device:
    d = _devices.get(index)
    if d is None:
        d = _devices[index] = Device(index)
    return d


BUF_DTYPES = {"xh": torch.float16, "xq": torch.int8, "xmeta": torch.float32, "wscratch": torch.float16,
           "counters": torch.int32, "ws_atomic": torch.float32, "ws_slots": torch.float32}
ZERO_BUFS = {"counters", "ws_atomic"}
