"""The GPU's power and thermal clock caps through NVML, so the tuner and benchmarks time small-M work on a rested chip.

Sustained large GEMMs (the tuner's own large-M buckets, the previous layer's) hold the H200 at its power cap for seconds
after the load ends; decode-bound small-M kernels run far slower there than memory-bound ones, which would skew a
comparison between them. Without NVML (nvidia-ml-py) every function here is a no-op.
"""

from __future__ import annotations

import time

# NVML clock event reasons that lower the SM clock under load: SW power cap, HW slowdown, SW/HW thermal, power brake.
CAPPED = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

_handles: dict[int, object] = {}


def _handle(index: int):
    if index not in _handles:
        try:
            import torch
            _handles[index] = torch.cuda._get_pynvml_handler(index)
        except Exception:  # noqa: BLE001 - no NVML: the caller times without waiting
            _handles[index] = None
    return _handles[index]


def reasons(index: int) -> int | None:
    """The device's current clock event reasons bit mask, or None without NVML."""
    h = _handle(index)
    if h is None:
        return None
    try:
        import pynvml
        get = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(get(h))
    except Exception:  # noqa: BLE001 - a reading, never a reason to fail
        return None


def sm_mhz(index: int) -> int | None:
    """The SM clock now (MHz), or None without NVML."""
    h = _handle(index)
    if h is None:
        return None
    try:
        import pynvml
        return int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
    except Exception:  # noqa: BLE001
        return None


def rest(index: int, timeout: float = 3.0) -> float:
    """Wait (at most timeout seconds) until no power or thermal cap holds the clock down; returns seconds waited."""
    t0 = time.monotonic()
    while True:
        r = reasons(index)
        if r is None or not r & CAPPED or time.monotonic() - t0 >= timeout:
            return time.monotonic() - t0
        time.sleep(0.02)
