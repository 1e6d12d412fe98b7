"""Before long work, one line saying how long it will take here and how to make it short; work past a year refused.

bench's estimate (:class:`BenchAhead`) times the model's own steps at a small probe batch, scaled to the batch, and
counts what the run will do (compilation, warm-up, windows, a batch search); train's is its FLOPs over a measured
matrix product (:func:`measured_flops_per_s`).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from vitreg.errors import VitregError
from vitreg.measure.autobatch import SEARCH_LIMITS
from vitreg.measure.timing import FEWEST_JUDGED, MIN_WINDOWS, steps_for_window, wall_seconds

#: Work estimated to take longer than this gets the line: any run a user waits on says how long first.
LONG_S = 10.0
#: Work estimated to take longer than this is refused: a year is beyond any job one machine is meant to run,
#: and the estimate errs short, so what is refused would take longer still (`--warmup 10**30` on a CPU was
#: accepted after an estimate of 4.8e24 hours, and ran until killed).
ENDLESS_S = 365 * 24 * 3600.0


def measured_flops_per_s(device: str = "cpu", n: int | None = None, dtype=None) -> float:
    """FLOP/s of a square matrix product on ``device`` (best of four): what a ViT's matrix products reach at most."""
    import torch

    n = n or (4096 if device == "cuda" else 384)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = min(wall_seconds(lambda: a @ b, device, clock=time.perf_counter) for _ in range(4))  # read at call time
    return 2 * n**3 / max(best, 1e-9)


def _where(device: str) -> str:
    return "this CPU" if device == "cpu" else "this GPU"


def _refuse_if_endless(what: str, seconds: float, device: str, basis: str, shorter: dict, command: str) -> None:
    if seconds > ENDLESS_S:
        raise VitregError(f"{what} would take at least {duration_text(seconds)} on {_where(device)} ({basis}), more "
                          f"than a year: it cannot finish; for a short run: {spelled(shorter, command)}")


@dataclass(frozen=True)
class WorkAhead:
    what: str  # "bench", "train"
    flops_per_img: float
    images: int
    shorter: dict  # the options (option-table names) that make it short and are not already in use

    def seconds(self, flops_per_s: float) -> float:
        return self.flops_per_img * self.images / flops_per_s


#: The short runs the estimate offers (the README's CPU-sized commands), as option-table names and values.
SHORT_BENCH = {"model": "deit_tiny_patch16_224", "batch_size": 8, "warmup": 3, "steps": 5, "repeats": 3}
SHORT_TRAIN = {"model": "deit_tiny_patch16_224", "batch_size": 8, "steps": 20}


#: Counts whose 0 means "as many as it takes" (bench's adaptive windows, train's epochs), not "none".
COUNTS_ZERO_IS_OPEN = ("steps", "repeats")


def not_in_use(short: dict, current: dict) -> dict:
    """The options of ``short`` that would shorten the run ``current`` describes: a lower count, another model."""
    def shortens(name, value) -> bool:
        now = current.get(name)
        if isinstance(value, int) and isinstance(now, int):
            # steps/repeats 0: as many as the precision target (or train's epochs) need, never short
            return now > value or (now == 0 and name in COUNTS_ZERO_IS_OPEN)
        return str(now) != str(value)

    return {name: value for name, value in short.items() if shortens(name, value)}


def train_work(batch_size: int, total_steps: int, train_flops: float, model: str = "") -> WorkAhead:
    current = {"model": model, "batch_size": batch_size, "steps": total_steps}
    return WorkAhead("train", train_flops, batch_size * total_steps, not_in_use(SHORT_TRAIN, current))


def spelled(options: dict, command: str = "") -> str:
    """``options`` as the command typed spells them: ``-P name=value`` under ``mlflow run``, ``name=value`` in a
    ``vitreg.api`` call, ``--name value`` on the command line."""
    if command.startswith("mlflow run"):
        return " ".join(f"-P {name}={value}" for name, value in options.items())
    if command.startswith("vitreg.api."):
        return ", ".join(f"{name}={value!r}" for name, value in options.items())
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in options.items())


def duration_text(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``, ``32 h``, ``4.8e+24 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    return f"{hours:.1f} h" if hours < 10 else f"{hours:.0f} h" if hours < 1e6 else f"{hours:.2g} h"


def estimate_line(work: WorkAhead, flops_per_s: float, device: str, compiling: bool = False,
                  command: str = "") -> str | None:
    """The line to say before ``work`` (None when it is quick): the estimate, its sum, how to make it short."""
    return _estimate_line(work.what, "at least", work.seconds(flops_per_s), device,
                          f"{work.flops_per_img / 1e9:.3g} GFLOP/img x {work.images:,} images at a measured "
                          f"{flops_per_s / 1e9:.0f} GFLOP/s{'; compiling comes on top' if compiling else ''}",
                          work.shorter, command)


def _estimate_line(what: str, bound: str, seconds: float, device: str, basis: str, shorter: dict,
                   command: str) -> str | None:
    if seconds <= LONG_S:
        return None
    short = f"; for a short run: {spelled(shorter, command)}" if shorter else ""
    return f"estimate: {what} will take {bound} {duration_text(seconds)} on {_where(device)} ({basis}){short}"


def refuse_if_endless(work: WorkAhead, flops_per_s: float, device: str, command: str = "") -> None:
    _refuse_if_endless(work.what, work.seconds(flops_per_s), device,
                       f"{work.images:.3g} images at a measured {flops_per_s / 1e9:.0f} GFLOP/s", work.shorter, command)


def say_if_long(work: WorkAhead, device: str, progress, compiling: bool = False, command: str = "") -> str | None:
    """Measure this machine, refuse endless work, say the estimate when the work is long; returns the line said."""
    if work.flops_per_img <= 0 or work.images <= 0:
        return None
    flops_per_s = measured_flops_per_s(device)
    refuse_if_endless(work, flops_per_s, device, command)
    line = estimate_line(work, flops_per_s, device, compiling, command)
    if line:
        progress(line)
    return line


#: The work of one probe call on a GPU: enough to hide the kernel launches (~30 ms of bf16 math on an H200,
#: where ViT-B's eager forward at batch 1 is launch-bound).
PROBE_FLOPS_CUDA = 2e13
#: The timed probe calls stop once they add up to this (after the first), so a probe costs at most about
#: 2 x this plus one step; on a CPU the probe's batch is sized from the measured matmul rate to take about this.
PROBE_S = 0.5
#: A ViT step's FLOP rate against a square matmul's of the same dtype on a CPU: the probe's batch is sized with it,
#: and a step too long to time (a GPU-sized model on a CPU: one image's step over 4 x PROBE_S) is estimated with
#: it, from the model's FLOPs, in seconds rather than minutes inside that step (a timed image is nearer the truth:
#: ViT-B's bf16 forward on this project's CPU timed 35 s a 256-batch, where its FLOPs said 186 s).
CPU_STEP_EFFICIENCY = 0.5
#: Seconds torch.compile takes per task with a cold cache (a warm one takes about a quarter): typical ViT
#: figures, since nothing can time a compile before it runs (ViT-B/16 infer, cold, on an H100: 9.5 s, a train
#: graph more: benchmarks/results/h100-2026-12-06-tta; the modes beyond default: H200 runs, h200-*/).
COMPILE_S = {"off": 0.0, "default": 15.0, "reduce-overhead": 60.0, "max-autotune": 300.0}
#: An fp8 graph (torchao's scaled matmuls) compiles this much longer: ViT-B/16, cold, 93 s against ~15 s (issue 46).
FP8_COMPILE = 6.0
#: A GPU task's time beyond its steps: the first call's autotuning, the allocator emptied between tasks, the SDPA
#: backend read (0.75-1.5 s a task on an H100: benchmarks/results/h100-2026-12-06-tta).
GPU_TASK_S = 0.75
#: Untimed steps after the windows (the SDPA backend read under the profiler: one step, and its start).
AFTER_WINDOWS_STEPS = 2


def estimated_batch(spec, device: str) -> int:
    """The spec's batch; batch_size=auto: the largest the search tries first."""
    if not spec.auto_batch:
        return int(spec.batch_size)
    return SEARCH_LIMITS["cuda"].start if device == "cuda" else SEARCH_LIMITS["cpu"].limit


def probe_batch(batch: int, flops_per_img: float, device: str, matmul_flops_per_s: float = 0.0) -> int:
    """The probe's batch, at most the run's: on a GPU :data:`PROBE_FLOPS_CUDA` of work; on a CPU what the measured
    matmul rate does in :data:`PROBE_S`, or 0 where one image's step would take over four times that."""
    if device == "cuda":
        return min(batch, max(1, math.ceil(PROBE_FLOPS_CUDA / max(flops_per_img, 1.0))))
    images = PROBE_S * matmul_flops_per_s * CPU_STEP_EFFICIENCY / max(flops_per_img, 1.0)
    return 0 if images < 0.25 else min(batch, max(1, int(images)))


def step_seconds(make_step, batch: int, flops_per_img: float, device: str, matmul_flops_per_s: float = 0.0) -> float:
    """Seconds one step of ``make_step`` takes at ``batch``: the median of up to three calls at a batch of
    :func:`probe_batch` (fewer past :data:`PROBE_S`) after an untimed one, scaled; on a CPU, a step too long to
    time comes from its FLOPs at ``matmul_flops_per_s``. The random state is put back after it, so the run's inputs
    are those it makes without the probe."""
    import torch

    small = probe_batch(batch, flops_per_img, device, matmul_flops_per_s)
    if not small:
        return flops_per_img * batch / max(matmul_flops_per_s * CPU_STEP_EFFICIENCY, 1.0)
    devices = [torch.cuda.current_device()] if device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        step = make_step(small)
        step()  # lazy initialisation, the autotuner's trials
        # the median of up to three: what a step typically takes (the fastest of a few calls is a quiet
        # moment's time, and a run's steps meet the machine as it is); fewer when a step is long, where one
        # call is both enough and costly
        times = [wall_seconds(step, device)]
        while len(times) < 3 and sum(times) < PROBE_S:
            times.append(wall_seconds(step, device))
    typical = statistics.median(times)
    return typical * batch / small


@dataclass(frozen=True)
class BenchAhead:
    """What bench will do: per task its step's seconds at the run's batch, the spec's counts."""

    spec: object  # vitreg.config.spec.BenchSpec
    step_s: dict = field(default_factory=dict)  # task -> seconds per step at the batch
    device: str = "cpu"
    compile_cached: bool = False  # the compile cache folder already holds entries
    command: str = ""  # what the user typed: the advice takes its spelling (see :func:`spelled`)
    compile_s: dict = field(default_factory=dict)  # task -> the last timed compile of its graph (batch_cache)
    searched: tuple = ()  # the tasks whose batch batch_size=auto searches (none kept): their step is at the start's
    fp8: bool = False  # an fp8 precision: its graphs compile longer (FP8_COMPILE)
    launch_bound: tuple = ()  # the tasks whose step waits on its launches: timed in MIN_WINDOWS windows

    def task_seconds(self, task: str) -> float:
        """First call (with compilation), warm-up, the timed windows, the untimed steps after them."""
        spec, step = self.spec, self.step_s[task]
        window = (spec.steps or steps_for_window(spec.window_min_s, step)) * step
        timed = (spec.repeats or (MIN_WINDOWS if task in self.launch_bound else self._windows)) * window
        if not spec.repeats:  # the stop rule starts no window that would end past max_time_s
            timed = max(window, min(timed, spec.max_time_s))
        compile_s = self.compile_s.get(task)
        if compile_s is None:  # no compile of this graph timed yet: a typical one
            compile_s = self._typical_compile_s()
        return compile_s + (spec.warmup + AFTER_WINDOWS_STEPS) * step + timed + \
            (self._search_s(step) if task in self.searched else 0.0) + (GPU_TASK_S if self.device == "cuda" else 0.0)

    @property
    def _windows(self) -> int:
        """The windows the precision target typically takes: a GPU's agree to a fraction of a percent, and three
        carry it; a CPU's scatter more."""
        return FEWEST_JUDGED if self.device == "cuda" else MIN_WINDOWS

    def _typical_compile_s(self) -> float:
        return COMPILE_S[self.spec.compile] * (0.25 if self.compile_cached else 1.0) * (FP8_COMPILE if self.fp8 else 1)

    def _search_s(self, step: float) -> float:
        """batch_size=auto's probes (on a GPU the first three: it stops once a doubling gains under 1 %)."""
        limits, batch = SEARCH_LIMITS[self.device], estimated_batch(self.spec, self.device)
        batches, b = [], limits.start
        while b <= limits.limit and len(batches) < (3 if self.device == "cuda" else limits.max_probes):
            batches.append(b)
            b *= 2
        return sum((limits.probe_steps + limits.probe_warmup) * step * b / batch for b in batches)

    def seconds(self) -> float:
        return sum(self.task_seconds(t) for t in self.step_s)

    @property
    def shorter(self) -> dict:
        spec = self.spec
        current = {"model": spec.model, "batch_size": estimated_batch(spec, self.device), "warmup": spec.warmup,
                   "steps": spec.steps, "repeats": spec.repeats}
        return not_in_use(SHORT_BENCH, current)

    def _steps_text(self) -> str:
        return ", ".join(f"{t} {s * 1e3:,.1f} ms/step" for t, s in self.step_s.items())

    def refuse_if_endless(self) -> None:
        _refuse_if_endless("bench", self.seconds(), self.device, f"{self._steps_text()}, measured", self.shorter,
                           self.command)

    def line(self) -> str | None:
        spec = self.spec
        timing = (f"{spec.repeats} windows" if spec.repeats else
                  f"{self._windows}+ windows of >= {spec.window_min_s:g} s (at most {spec.max_time_s:g} s)")
        compiling = f"; compiling ~{self._typical_compile_s():.0f} s a task" if spec.compile != "off" else ""
        return _estimate_line("bench", "about", self.seconds(), self.device, f"{self._steps_text()} in the run's "
                              f"precision, timed here or from the kept batch's probe; {spec.warmup} warm-up steps, {timing} per task{compiling}",
                              self.shorter, self.command)
