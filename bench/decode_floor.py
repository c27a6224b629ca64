"""The decode-only benchmark floor: bench/cuda/exl3_decode_sum.cu decodes every weight of a trellis into MMA fragments
and folds them into one word per thread (no x, no MMA, no output), built on the package's linear-module headers.

    from decode_floor import decode_floor   # with bench/ on sys.path
    decode_floor(trellis, codebook, sink)   # one launch on the current stream; returns sink
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from exl3_vllm.kernels import nvrtc  # noqa: E402
from exl3_vllm.kernels.variants import linear_defines  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "cuda" / "exl3_decode_sum.cu"
KERNEL = "exl3_decode_sum"
_modules: dict = {}


def compile_decode_sum(bits: float, codebook: int, arch: int = 90) -> nvrtc.Compiled:
    """The kernel for (bits, codebook) on sm_<arch>, with the linear module's defines (its own cache entry)."""
    return nvrtc.compile_source(SOURCE.name, arch, linear_defines(bits, codebook), text=SOURCE.read_bytes())


def decode_floor(trellis, codebook: int, sink=None):
    """Decode every weight of the trellis into MMA fragments and discard them (benchmark floor)."""
    import torch

    from exl3_vllm.kernels.dispatch import bits_of
    from exl3_vllm.kernels.runtime import device_for
    bits = bits_of(trellis)
    d = device_for(trellis.device.index)
    key = (bits, codebook, d.index)
    mod = _modules.get(key)
    if mod is None:
        mod = _modules[key] = nvrtc.Module(compile_decode_sum(bits, codebook, d.arch), d.index)
    blocks = d.sms * 8
    if sink is None:
        sink = torch.empty(blocks * 256, dtype=torch.int32, device=trellis.device)
    ntiles = trellis.shape[0] * trellis.shape[1]
    nvrtc.launch(mod.function(KERNEL), (blocks, 1, 1), (256, 1, 1), 0,
                 torch.cuda.current_stream(trellis.device).cuda_stream,
                 [ctypes.c_uint64(trellis.data_ptr()), ctypes.c_int64(ntiles), ctypes.c_uint64(sink.data_ptr())])
    return sink
