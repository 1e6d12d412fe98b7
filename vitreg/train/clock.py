"""Per-step training times without a sync per step."""

from __future__ import annotations

import time

import torch


class StepClock:
    """Per-step times without a sync per step: CUDA events recorded around each step, read in a batch
    at :meth:`collect` (the log boundary); ``perf_counter`` on the CPU, where work is synchronous."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self._open = None
        self._pending: list = []

    def start(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open = event
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending.append((self._open, event))
        else:
            self._pending.append((self._open, time.perf_counter()))

    def collect(self) -> list[float]:
        """Milliseconds of each step since the last collect; synchronises on the last event (CUDA)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        if self.cuda:
            pending[-1][1].synchronize()  # the one CPU-GPU sync point of the interval
            return [a.elapsed_time(b) for a, b in pending]
        return [(b - a) * 1e3 for a, b in pending]
