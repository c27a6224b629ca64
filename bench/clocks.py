"""The H200's SM clock through NVML, for benchmarks that must not time a power-capped chip."""

from __future__ import annotations

import time


class Clocks:
    """NVML SM-clock reader. Sustained large GEMMs push the H200 into its power cap for seconds after the load
    ends, which slows decode-bound small-M kernels far more than memory-bound ones (bench/README.md has the
    measurement), so light measurements wait for the clock to recover."""

    def __init__(self):
        self.h = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.max = pynvml.nvmlDeviceGetMaxClockInfo(self.h, pynvml.NVML_CLOCK_SM)
        except Exception as e:
            print("[clock] NVML unavailable:", e, flush=True)
        print(f"[clock] SM clock now {self.sm()} MHz, max {getattr(self, 'max', '?')} MHz", flush=True)
        self.waited = 0.0

    def sm(self) -> int | str:
        try:
            return self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM) if self.h else ""
        except Exception:  # noqa: BLE001 - a reading, never a reason to stop a benchmark
            return ""

    def wait_rested(self, timeout=3.0):
        if not self.h:
            return
        t0 = time.time()
        while (self.sm() or 0) < 0.97 * self.max and time.time() - t0 < timeout:
            time.sleep(0.05)
        self.waited += time.time() - t0
