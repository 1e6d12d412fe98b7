"""Timers and statistics.

GPU work is asynchronous: a host clock read after launching kernels measures how fast Python
queued them, not how long the GPU took (the mistake of ``time.time()`` without a synchronize).
:func:`time_window` therefore records a CUDA event between iterations and reads them all after a
single synchronize at the end of the window, so per-iteration latencies come without a host sync
inside the timed region. On the CPU, work is synchronous and ``perf_counter`` is exact enough.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Stats:
    """Summary of a sample: median and spread. Units are the caller's (ms, img/s)."""

    n: int
    median: float
    mean: float
    std: float
    min: float
    max: float
    p10: float
    p90: float
    p99: float

    @property
    def cv(self) -> float:
        """Coefficient of variation (std / mean): the run's own noise, unitless."""
        return self.std / self.mean if self.mean else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "cv": self.cv}


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    data = list(values)
    if not data:
        raise ValueError("percentile of an empty sample")
    return float(np.percentile(data, q))


def summarize(values) -> Stats:
    data = [float(v) for v in values]
    if not data:
        raise ValueError("summarize() needs at least one value")
    p10, p90, p99 = (float(p) for p in np.percentile(data, [10, 90, 99]))
    return Stats(
        n=len(data),
        median=statistics.median(data),
        mean=statistics.fmean(data),
        std=statistics.pstdev(data) if len(data) > 1 else 0.0,
        min=min(data),
        max=max(data),
        p10=p10,
        p90=p90,
        p99=p99,
    )


@dataclass(frozen=True)
class Window:
    """One timed window: ``iters`` back-to-back calls, their per-call times and the total."""

    iter_ms: tuple
    total_ms: float

    @property
    def iters(self) -> int:
        return len(self.iter_ms)


def time_window(fn, iters: int, device_type: str, clock=time.perf_counter) -> Window:
    """Call ``fn`` ``iters`` times back to back and time each call.

    CUDA: ``iters + 1`` events recorded on the current stream, one before the first call and one
    after each; the only synchronize is after the last event, outside the region. Event records cost
    a few microseconds of launch time and no GPU time, so the loop stays as tight as a bare one.
    CPU: ``clock`` (``perf_counter``; a test passes its own) before and after each call.
    """
    if iters < 1:
        raise ValueError("iters must be >= 1")
    if device_type == "cuda":
        import torch

        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(iters):
            fn()
            events[i + 1].record()
        events[-1].synchronize()  # this is the one CPU-GPU sync point, after the window
        iter_ms = tuple(events[i].elapsed_time(events[i + 1]) for i in range(iters))
        return Window(iter_ms, events[0].elapsed_time(events[-1]))
    stamps = [clock()]
    for _ in range(iters):
        fn()
        stamps.append(clock())
    iter_ms = tuple((b - a) * 1e3 for a, b in zip(stamps, stamps[1:]))
    return Window(iter_ms, (stamps[-1] - stamps[0]) * 1e3)


def synchronize(device_type: str) -> None:
    """Wait for queued device work (a no-op on the CPU). Call outside timed regions only."""
    if device_type == "cuda":
        import torch

        torch.cuda.synchronize()


def wall_seconds(fn, device_type: str, clock=time.perf_counter) -> float:
    """Wall time of one call including all device work it queued (for compile / first-call times)."""
    synchronize(device_type)
    start = clock()
    fn()
    synchronize(device_type)
    return clock() - start
