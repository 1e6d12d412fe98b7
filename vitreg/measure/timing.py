"""Timers and statistics: timed windows (CUDA events, one synchronize after the window: a host clock would time
how fast Python queued the kernels), the median's interval and when to stop timing (:class:`StopRule`, nvbench's
``stdrel``, pyperf's ``min_time``), and the command's phases outside the windows (:data:`PHASES`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field

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
    # half-width of the median's 95 % interval, % of the median (None: too few values for one)
    median_ci95_halfwidth_pct: float | None = None

    @property
    def cv(self) -> float:
        """Coefficient of variation (std / mean): the run's own noise, unitless."""
        return self.std / self.mean if self.mean else 0.0


def summarize(values) -> Stats:
    data = [float(v) for v in values]
    if not data:
        raise ValueError("summarize() needs at least one value")
    p10, p90, p99 = (float(p) for p in np.percentile(data, [10, 90, 99]))
    return Stats(len(data), statistics.median(data), statistics.fmean(data),
                 statistics.pstdev(data) if len(data) > 1 else 0.0, min(data), max(data), p10, p90, p99,
                 median_halfwidth_pct(data))


#: The fewest windows whose median has a 95 % interval from order statistics: [x(1), x(6)] holds the
#: median with probability 1 - 2 / 2**6 = 96.9 %; five windows' [x(1), x(5)] only 93.8 %. From three windows
#: the stop rule reads Student's t interval instead (:func:`median_halfwidth_pct`): a GPU-bound step whose windows
#: agree to 0.2 % is as sure after three as after six, and each window costs a second.
MIN_WINDOWS = 6
#: The fewest windows any interval is read from (Student's t of three).
FEWEST_JUDGED = 3
#: The most windows a task times when the target is not reached (each costs at least window_min_s).
MAX_WINDOWS = 60
#: Steps per window are computed for this much more than window_min_s, so that the scatter of the
#: iteration time rarely leaves a window short (a short window is recalibration, not a sample). A GPU's steps
#: scatter by tenths of a percent: 3 % more rounds a ViT-B train window to 3 steps of 0.36 s, where 10 % made 4.
WINDOW_MARGIN = 1.03

# why the windows stopped (the ``<task>_timing_stop`` tag)
STOP_PRECISION, STOP_MAX_WINDOWS, STOP_MAX_TIME, STOP_FIXED = "precision_met", "max_windows", "max_time", "fixed"
#: a launch-bound step's windows stop at MIN_WINDOWS, target met or not: their scatter is the host's, which neither
#: more nor longer windows average away (bs32 bf16 eager ViT-B on an H100: +-26 % after 60 s of 1-4 s windows)
STOP_LAUNCH_BOUND = "launch_bound"
#: the stops at which the median is less sure than precision_pct asked
STOPS_MISSED = (STOP_MAX_WINDOWS, STOP_MAX_TIME, STOP_LAUNCH_BOUND)


def median_interval(values) -> tuple[float, float] | None:
    """The median's distribution-free 95 % interval ``[x(k), x(n+1-k)]``: the largest ``k`` whose coverage
    ``1 - 2 P(Binomial(n, 1/2) < k)`` is at least 95 % (None: too few values). Not a bootstrap: exact for
    any continuous distribution (a throttled window is an outlier, not a Gaussian tail), it exists from six values,
    where a bootstrap covers too little, and costs a sort between windows."""
    data = sorted(float(v) for v in values)
    n = len(data)
    below = 0.0  # P(B < k), B ~ Binomial(n, 1/2): the chance that fewer than k values lie below the median
    best = None
    # each term C(n, k-1) / 2**n in floats, through log-gamma: exact integers cost O(n) digits a term (the
    # 7,000 step times of a noisy small-batch task took 10.8 s of bignum arithmetic on the H200's host)
    log_all = math.lgamma(n + 1) - n * math.log(2)
    for k in range(1, n // 2 + 1):
        below += math.exp(log_all - math.lgamma(k) - math.lgamma(n - k + 2))
        if 1 - 2 * below < 0.95:
            break
        best = k
    return None if best is None else (data[best - 1], data[n - best])


#: Student's t, two-sided 95 %, by degrees of freedom: the interval of three to five values.
T95 = {2: 4.303, 3: 3.182, 4: 2.776}


def median_halfwidth_pct(values) -> float | None:
    """The half-width of a 95 % interval of the sample's centre, in % of the median: from :data:`MIN_WINDOWS` values
    the median's interval (its farther end); from three to five, Student's t interval of the mean, which one
    outlying value widens past any target, so a scattered sample never stops there. None under three."""
    values = [float(v) for v in values]
    median = statistics.median(values) if values else 0.0
    if len(values) < FEWEST_JUDGED or not median:
        return None
    if len(values) < MIN_WINDOWS:
        return T95[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values)) / abs(median) * 100
    low, high = median_interval(values)
    return max(median - low, high - median) / abs(median) * 100


@dataclass(frozen=True)
class StopRule:
    """When a task's timed windows stop: after ``repeats`` (> 0), else once the median's 95 % half-width is at most
    ``precision_pct``, at :data:`MAX_WINDOWS`, or before a window that would end past ``max_time_s``."""

    precision_pct: float
    max_time_s: float
    repeats: int = 0

    def reason(self, rates, elapsed_s: float, next_window_s: float) -> str | None:
        """Why to stop after the windows of ``rates`` (img/s each); None: time another."""
        if self.repeats:
            return STOP_FIXED if len(rates) >= self.repeats else None
        halfwidth = median_halfwidth_pct(rates)
        if halfwidth is not None and halfwidth <= self.precision_pct:
            return STOP_PRECISION
        if len(rates) >= MAX_WINDOWS:
            return STOP_MAX_WINDOWS
        if elapsed_s + next_window_s > self.max_time_s:
            return STOP_MAX_TIME
        return None


def steps_for_window(window_min_s: float, iter_s: float | None) -> int:
    """Whole steps for a window of ``window_min_s`` (with :data:`WINDOW_MARGIN`); 1 while the step time is unknown."""
    if not iter_s or iter_s <= 0:
        return 1
    return max(1, math.ceil(window_min_s * WINDOW_MARGIN / iter_s))


@dataclass(frozen=True)
class Window:
    iter_ms: tuple
    total_ms: float

    @property
    def iters(self) -> int:
        return len(self.iter_ms)

    def img_per_s(self, batch_size: int) -> float:
        return batch_size * self.iters / self.total_ms * 1e3


def time_window(fn, iters: int, device_type: str, clock=time.perf_counter) -> Window:
    """Call ``fn`` ``iters`` times back to back and time each call: on CUDA an event before the first call and after
    each (a few microseconds of launch, no GPU time), one synchronize after the last; on a CPU ``clock``."""
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


def process_age_s() -> float:
    """Seconds since this process started (the interpreter and imports): on Linux ``/proc/self/stat``'s start time
    against ``CLOCK_BOOTTIME``, which no wall-clock adjustment moves; elsewhere psutil's (wall clock); else 0."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()  # fields 3 on; the name before ")" may hold spaces
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        pass
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # psutil missing or the process table unreadable: count from here
        return 0.0


@dataclass
class PhaseClock:
    """Wall seconds of a command by phase: each :meth:`mark` ends the phase it names (marked again, it adds up);
    ``timed`` is the windows, every other phase overhead. One per process (:data:`PHASES`): the phases run through
    the CLI, the job and the runner. Marks before :meth:`begin` are not recorded."""

    last_s: float | None = None
    phases: dict = field(default_factory=dict)
    began: bool = False  # a command already began in this process: the next one's "import" is 0

    def begin(self) -> None:
        """A command starts: the first in this process counts its ``import`` phase from the process's start."""
        self.phases = {"import": 0.0 if self.began else process_age_s()}
        self.began = True
        self.last_s = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.last_s is None:
            return
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last_s
        self.last_s = now

    def overhead_s(self) -> dict[str, float]:
        """``{"overhead_<phase>_s": seconds}`` for every phase but the timed windows, and their total."""
        out = {f"overhead_{phase}_s": s for phase, s in self.phases.items() if phase != "timed"}
        return {**out, "overhead_total_s": sum(out.values())} if out else {}


PHASES = PhaseClock()
