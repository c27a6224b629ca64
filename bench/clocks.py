"""The SM-clock rest of kernels/clock.py as the per-benchmark object bench_peer.py keeps (it also totals the wait)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from exl3_vllm.kernels import clock  # noqa: E402


class Clocks:
    def __init__(self, index: int = 0):
        self.index = index
        self.waited = 0.0
        print(f"[clock] SM clock now {self.sm()} MHz, cap reasons {clock.reasons(index)}", flush=True)

    def sm(self) -> int | str:
        v = clock.sm_mhz(self.index)
        return "" if v is None else v

    def wait_rested(self, timeout: float = 3.0) -> None:
        self.waited += clock.rest(self.index, timeout)
