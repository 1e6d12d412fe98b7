"""One record of figures keyed by metric name, what a task measured from the timing to what is logged: recorded by
the runner or the training loop, combined over DDP ranks, then :meth:`Figures.summarized` (the samples'
statistics), :meth:`Figures.completed` (the job-level rows, :data:`DERIVED`) and :meth:`Figures.metrics`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from vitreg.measure import metrics as table
from vitreg.measure.timing import summarize


@dataclass(frozen=True)
class Work:
    """What the job-level rows are computed from besides the figures (the precision and profile: MFU's peak)."""

    world_size: int = 1
    compiled: bool = False
    precision: object = None  # vitreg.hardware.precision.Precision (None: no MFU)
    profile: object = None  # vitreg.hardware.profiles.GpuProfile

    @classmethod
    def of(cls, runtime, hardware, world_size: int = 1) -> Work:
        """A mislabelled run (``hardware.mismatch``) gets no MFU: its label's peak is not its hardware's."""
        precision = None if hardware.mismatch else runtime.precision
        return cls(world_size, runtime.compile != "off", precision, hardware.profile)


@dataclass(frozen=True)
class Figures:
    """One task's figures by metric name: a float, a tuple (a sample) or None (not measured)."""

    task: str
    values: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in self.values:
            declared = table.metric(name).tasks  # KeyError for a name the table does not declare
            if declared and self.task not in declared:
                raise KeyError(f"metric {name!r} is not declared for task {self.task!r}")
        object.__setattr__(self, "values", dict(self.values))  # a copy: the caller's dict stays theirs

    def __getitem__(self, name: str):
        return self.values[name]

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def get(self, name: str, default=None):
        return self.values.get(name, default)

    def with_values(self, **values) -> Figures:
        """This record with ``values`` added or replaced."""
        return Figures(self.task, {**self.values, **values})

    def summarized(self) -> Figures:
        """Each statistic row whose sample this record holds, taken of that sample (an empty sample: None)."""
        out = dict(self.values)
        for m in table.METRICS:
            if m.of and m.of[0] in self.values and (not m.tasks or self.task in m.tasks):
                sample = self.values[m.of[0]]
                out[m.name] = getattr(summarize(sample), m.of[1]) if sample else None
        return Figures(self.task, out)

    def completed(self, work: Work) -> Figures:
        """The job-level rows this task has a rule for (:data:`DERIVED`), from the (reduced) figures."""
        out = dict(self.values)
        for name, rule in DERIVED.items():
            if self.task in table.metric(name).tasks:
                out[name] = rule(out, work)
        return Figures(self.task, out)

    def metrics(self) -> dict[str, float]:
        """What MLflow logs, in table order, samples and unmeasured figures left out."""
        out = {}
        for m in table.METRICS:
            value = self.values.get(m.name)
            if m.logged and value is not None and not isinstance(value, tuple):
                out[f"{self.task}_{m.name}" if m.tasks else m.name] = float(value)
        return out

    def to_dict(self) -> dict:
        """Every value by name (samples as lists), for results.json."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.values.items()}


def _world_size(values: dict, work: Work):
    return work.world_size if work.world_size > 1 else None


def _per_gpu(values: dict, work: Work):
    rate = values.get("throughput_img_per_s")
    return rate / work.world_size if work.world_size > 1 and rate is not None else None


def _achieved_tflops(values: dict, work: Work):
    gflops, rate = values.get("gflops_per_img"), values.get("throughput_img_per_s")
    return gflops * rate / 1e3 if gflops is not None and rate is not None else None  # the whole job's


def _mfu(values: dict, work: Work):
    achieved = values.get("achieved_tflops")
    if achieved is None or work.precision is None:
        return None
    return work.precision.mfu(achieved / work.world_size, work.profile)  # per GPU, against one GPU's peak


def _compile_time_s(values: dict, work: Work):
    first = values.get("first_call_s", values.get("first_step_s"))  # bench's first call, train's first step
    return first if work.compiled else None


def _energy_j_per_img(values: dict, work: Work):
    """The median window's joules per image: its power (every GPU's, summed) over its throughput (summed too)."""
    powers, rates = values.get("window_power_w"), values.get("window_img_per_s")
    if not powers or not rates or len(powers) != len(rates):
        return None  # no energy reading (a CPU run, short windows): absent, never 0
    return statistics.median(p / r for p, r in zip(powers, rates) if r)


def _img_per_j(values: dict, work: Work):
    joules = values.get("energy_j_per_img")
    return 1 / joules if joules else None


#: How each row computed after the reduction is computed, in order (MFU needs the achieved TFLOP/s).
DERIVED = {
    "world_size": _world_size,
    "throughput_img_per_s_per_gpu": _per_gpu,
    "achieved_tflops": _achieved_tflops,
    "mfu": _mfu,
    "compile_time_s": _compile_time_s,
    "energy_j_per_img": _energy_j_per_img,
    "img_per_j": _img_per_j,
}
