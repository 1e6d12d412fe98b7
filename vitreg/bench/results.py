"""What a benchmark measured, as typed values: one :class:`TaskResult` per task, one :class:`BenchResult`
per run. Metric names come from the metric table (:mod:`vitreg.measure.metrics`); what ran (precision,
SDPA backend, compile cache, the batch ``auto`` chose) travels with them, for the job to log in one call."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vitreg.config.spec import BenchSpec
from vitreg.measure.autobatch import BatchChoice
from vitreg.measure.figures import Figures
from vitreg.measure.metrics import job_metrics, task_metrics
from vitreg.models.factory import ModelInfo


@dataclass(frozen=True)
class TaskResult:
    """One task: what ran (batch, SDPA backend, compile cache) and its :class:`Figures`, the one
    record of what it measured (throughput per window, ms per iteration, their statistics, ...)."""

    task: str  # "infer" or "train"
    batch_size: int
    img_size: int
    steps: int
    repeats: int
    figures: Figures
    sdpa_backend: str | None = None  # read from the profiler after the windows (vitreg.hardware.sdpa)
    compile_cache: str | None = None  # when compiling: cold, warm, partial or unused (the first call's)
    batch_choice: BatchChoice | None = None  # batch_size=auto: the probes and the choice
    window_tags: dict = field(default_factory=dict)  # throttle, energy source, contention (vitreg.measure.energy)

    @property
    def throughput_img_per_s(self) -> float:
        """The median window's img/s, the whole job's."""
        return self.figures["throughput_img_per_s"]

    def tags(self) -> dict[str, str]:
        """What this task ran, as run tags prefixed by the task (the chosen batch, the SDPA backend, ...)."""
        tags = {"sdpa_backend": self.sdpa_backend, "compile_cache": self.compile_cache}
        if self.batch_choice is not None:
            tags.update(batch_size_chosen=self.batch_size, batch_probes=self.batch_choice.summary(),
                        batch_size_source=self.batch_choice.source)  # "cache": kept by an earlier run
        tags.update(self.window_tags)
        return {f"{self.task}_{k}": str(v) for k, v in tags.items() if v is not None}

    def series(self) -> list[tuple[int, dict[str, float]]]:
        """``(step, metrics)`` pairs to log with that step: the batch probes (step = batch)."""
        probes = self.batch_choice.series() if self.batch_choice is not None else []
        return [(batch, task_metrics(self.task, {"batch_probe_img_per_s": rate})) for batch, rate in probes]

    def metrics(self) -> dict[str, float]:
        """MLflow metrics, units in the names, prefixed by the task (named in :mod:`vitreg.measure.metrics`)."""
        return self.figures.metrics()

    def to_dict(self) -> dict:
        return {"task": self.task, "batch_size": self.batch_size, "img_size": self.img_size, "steps": self.steps,
                "repeats": self.repeats, "sdpa_backend": self.sdpa_backend, "compile_cache": self.compile_cache,
                "batch_choice": asdict(self.batch_choice) if self.batch_choice is not None else None,
                "figures": self.figures.to_dict(), "metrics": self.metrics()}


@dataclass(frozen=True)
class BenchResult:
    """Everything one benchmark measured, ready for results.json and the MLflow run."""

    spec: BenchSpec
    gpu: str
    amp: str
    device: str
    model: ModelInfo
    fwd_gflops_per_img: float
    tasks: tuple = field(default_factory=tuple)
    precision: str = "fp32"  # Precision.label: what ran (autocast-bf16, bf16-weights, tf32, ...)
    sdpa: str = "auto"  # the SDPA backend asked for; each task says which ran
    compile_cache_dir: str | None = None  # when compiling: inductor's cache folder
    profile_dir: str | None = None  # profile=true: <task>/trace.json.gz and <task>/top_ops.txt under it
    fp8_agreement: object | None = None  # amp=fp8*: vitreg.hardware.precision.Fp8Agreement against bf16

    def metrics(self) -> dict[str, float]:
        out = job_metrics({"fwd_gflops_per_img": self.fwd_gflops_per_img, "params_m": self.model.params_m})
        if self.fp8_agreement is not None:
            out.update(job_metrics({"fp8_top1_agreement": self.fp8_agreement.top1_agreement,
                                    "fp8_max_abs_logit_diff": self.fp8_agreement.max_abs_logit_diff}))
        for task in self.tasks:
            out.update(task.metrics())
        return out

    def tags(self) -> dict[str, str]:
        """What ran, as run tags: precision, SDPA asked for and (per task, and overall where the tasks
        agree) found, compile cache, the batch each task chose under batch_size=auto."""
        tags = {"precision": self.precision, "sdpa": self.sdpa}
        backends = {t.sdpa_backend for t in self.tasks if t.sdpa_backend}
        if len(backends) == 1:
            tags["sdpa_backend"] = backends.pop()
        if self.compile_cache_dir:
            tags["compile_cache_dir"] = self.compile_cache_dir
        for task in self.tasks:
            tags.update(task.tags())
        return tags

    def series(self) -> list[tuple[int, dict[str, float]]]:
        """Every task's :meth:`TaskResult.series`: log each ``(step, metrics)`` with that step."""
        return [point for task in self.tasks for point in task.series()]

    def summary_line(self) -> str:
        """One line for the terminal above the results table: precision and SDPA backend(s)."""
        ran = ", ".join(f"{t.task} {t.sdpa_backend}" for t in self.tasks if t.sdpa_backend) or "-"
        return f"precision {self.precision}; sdpa={self.sdpa} (ran: {ran})"

    def to_dict(self) -> dict:
        return {"spec": self.spec.to_params(), "gpu": self.gpu, "amp": self.amp, "device": self.device,
                "model": asdict(self.model), "fwd_gflops_per_img": self.fwd_gflops_per_img,
                "tasks": [t.to_dict() for t in self.tasks], "precision": self.precision, "tags": self.tags()}


