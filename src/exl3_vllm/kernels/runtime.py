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
    captured graphs. Streams registered with concurrent_stream() get workspace of their own (vLLM runs shared experts
    on a second stream while the routed ones run); every other stream shares one set."""

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
        self.init_workspace()

    def init_workspace(self) -> None:
        """No workspace yet (also for a stand-in device made without __init__)."""
        self.bufs: dict[int, dict[str, torch.Tensor]] = {}  # lane (0 or a concurrent stream) -> name -> buffer
        self.reserved: dict[str, int] = {}  # name -> elements prepare() reserved: any lane may take that much
        self.concurrent: set[int] = set()  # handles of streams whose ops may overlap other streams' ops
        self._old: list[torch.Tensor] = []
        self._unzeroed: set[tuple[int, str]] = set()  # zeroed buffers made inside a capture, not yet filled
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def scratch_workspace(self):
        """Workspace grown inside the block is released when it ends; what was reserved before stays as it was."""
        bufs, old, unzeroed = self.bufs, self._old, self._unzeroed
        self.bufs, self._old, self._unzeroed = {s: dict(b) for s, b in bufs.items()}, [], set(unzeroed)
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the block's kernels are done with what is released
            self.bufs, self._old, self._unzeroed = bufs, old, unzeroed

    def module(self, source: str, defines: dict | None):
        mod = nvrtc.loaded(source, self.arch, defines, self.index)
        if mod is None:
            if torch.cuda.is_current_stream_capturing():
                raise KernelError(f"EXL3 kernel module {source} {defines} is not loaded and a CUDA graph is being "
                                  "captured; call exl3_vllm.kernels.prepare(...) for this layer before capture")
            mod = nvrtc.load(source, self.arch, defines, self.index)
        return mod

    def buf(self, name: str, numel: int, dtype: torch.dtype, zero: bool = False, stream: int = 0) -> torch.Tensor:
        """The buffer `name` of at least numel elements for a call on this stream (handle). Inside a CUDA-graph
        capture only up to what reserve() set aside may be allocated (a concurrent stream's first copy of it)."""
        lane = stream if stream in self.concurrent else 0
        bufs = self.bufs.get(lane)
        b = None if bufs is None else bufs.get(name)
        if b is None or b.numel() < numel:
            capturing = torch.cuda.is_current_stream_capturing()
            if capturing and numel > self.reserved.get(name, 0):
                raise KernelError(f"EXL3 workspace '{name}' needs {numel} elements but "
                                  f"{self.reserved.get(name, 0)} are reserved and a CUDA graph is being captured; "
                                  "call exl3_vllm.kernels.prepare(..., max_m=...) with the largest batch before "
                                  "capture")
            if b is not None:
                self._old.append(b)
            b = (torch.zeros if zero else torch.empty)(max(numel, 1), dtype=dtype, device=self.device)
            self.bufs.setdefault(lane, {})[name] = b
            if zero and capturing:
                self._unzeroed.add((lane, name))  # its fill is a node of the graph: not run until a replay
            else:
                self._unzeroed.discard((lane, name))
        elif self._unzeroed and (lane, name) in self._unzeroed and not torch.cuda.is_current_stream_capturing():
            b.zero_()
            self._unzeroed.discard((lane, name))
        return b

    def reserve(self, name: str, numel: int, dtype: torch.dtype, zero: bool = False) -> None:
        """Set aside numel elements of `name` in the shared set, before any capture."""
        self.reserved[name] = max(self.reserved.get(name, 0), numel)
        self.buf(name, numel, dtype, zero)


_devices: dict[int, Device] = {}


def device_for(index: int) -> Device:
    d = _devices.get(index)
    if d is None:
        d = _devices[index] = Device(index)
    return d


def concurrent_stream(stream: torch.cuda.Stream) -> None:
    """Give ops called on this stream workspace of their own: they may run while ops on other streams run."""
    device_for(stream.device.index if stream.device.index is not None else torch.cuda.current_device()) \
        .concurrent.add(stream.cuda_stream)


BUF_DTYPES = {"xh": torch.float16, "xq": torch.int8, "xmeta": torch.float32, "wscratch": torch.float16,
           "counters": torch.int32, "ws_atomic": torch.float32, "ws_slots": torch.float32}
ZERO_BUFS = {"counters", "ws_atomic"}
