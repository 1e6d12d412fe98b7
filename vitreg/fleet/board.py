"""The sweep's one live line: done / running / queued / failed per GPU type, and the time left."""

from __future__ import annotations

import collections
import statistics
import threading
import time

STATES = ("done", "running", "queued", "failed")


class Board:
    """Counts of children per GPU type and state; :meth:`line` is the live line the parent shows."""

    def __init__(self, slots: int, progress):
        self._counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._lock = threading.Lock()
        self._durations: list[float] = []
        self._slots = max(1, slots)
        self._progress = progress
        self._last = ""

    def queued(self, gpu: str) -> None:
        self._move(gpu, None, "queued")

    def started(self, gpu: str) -> None:
        self._move(gpu, "queued", "running")

    def ended(self, gpu: str, ok: bool, seconds: float | None = None, was: str = "running") -> None:
        if seconds is not None:
            self._durations.append(seconds)
        self._move(gpu, was, "done" if ok else "failed")

    def requeued(self, gpu: str) -> None:
        """A child retried (a smaller batch after an out-of-memory failure) counts once more as queued."""
        self._move(gpu, None, "queued")

    def _move(self, gpu: str, source: str | None, target: str) -> None:
        with self._lock:
            counts = self._counts[gpu or "-"]
            if source:
                counts[source] -= 1
            counts[target] += 1
            line = self.line()
        if line != self._last:
            self._last = line
            self._progress(line)

    def line(self) -> str:
        """``sweep: h100 2 done, 1 running, 1 queued, 0 failed | a100 ...; about 40 s left``."""
        parts = [f"{gpu} " + ", ".join(f"{c[s]} {s}" for s in STATES) for gpu, c in sorted(self._counts.items())]
        left = sum(c["running"] + c["queued"] for c in self._counts.values())
        eta = ""
        if self._durations and left:
            # the median child: a GPU's first child also waits for its warm worker's imports, once
            typical = statistics.median(self._durations)
            eta = f"; about {format_seconds(typical * -(-left // self._slots))} left"
        return "sweep: " + " | ".join(parts) + eta


def format_seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Clock:
    """Seconds since it was made (a child's wall time)."""

    def __init__(self):
        self._start = time.monotonic()

    def seconds(self) -> float:
        return time.monotonic() - self._start
