"""What a benchmark measured, as typed values: one :class:`TaskResult` per task, one :class:`BenchResult`
per run. Metric names come from the metric table (:mod:`vitreg.measure.metrics`); what ran (precision,
SDPA backend, compile cache, the batch ``auto`` chose) travels with them, for the job to log in one call."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vitreg.config.spec import BenchSpec
from vitreg.measure.autobatch import BatchChoice
from vitreg.measure.metrics import ITERATION_TIME, job_metrics, task_metrics
from vitreg.measure.timing import Stats
from vitreg.models.factory import ModelInfo


@dataclass(frozen=True)
class TaskResult:
    """One task's figures. Throughput is images per second over a whole window; latency is per iteration."""

    task: str  # "infer" or "train"
    batch_size: int
    img_size: int
    steps: int
    repeats: int
    throughput: Stats  # img/s, one value per window
    iter_ms: Stats  # ms per iteration (one batch), all iterations of all windows
    first_call_s: float  # the first call alone: compilation (if any) + lazy init
    warmup_s: float  # the rest of the warm-up
    compiled: bool
    gflops_per_img: float
    achieved_tflops: float
    mfu: float | None
    peak_mem_allocated_mb: float | None
    peak_mem_reserved_mb: float | None
    world_size: int = 1
    # profile_steps > 0 (train): from torch.profiler after the windows; the slowest rank's under DDP
    allreduce_ms_per_step: float | None = None
    device_busy_ms_per_step: float | None = None
    sdpa_backend: str | None = None  # read from the profiler after the windows (vitreg.hardware.sdpa)
    compile_cache: str | None = None  # when compiling: cold, warm, partial or unused (the first call's)
    batch_choice: BatchChoice | None = None  # batch_size=auto: the probes and the choice

    def tags(self) -> dict[str, str]:
        """What this task ran, as run tags prefixed by the task (the chosen batch, the SDPA backend, ...)."""
        tags = {"sdpa_backend": self.sdpa_backend, "compile_cache": self.compile_cache}
        if self.batch_choice is not None:
            tags.update(batch_size_chosen=self.batch_size, batch_probes=self.batch_choice.summary(),
                        batch_size_source=self.batch_choice.source)  # "cache": kept by an earlier run
        return {f"{self.task}_{k}": str(v) for k, v in tags.items() if v is not None}

    def series(self) -> list[tuple[int, dict[str, float]]]:
        """``(step, metrics)`` pairs to log with that step: the batch probes (step = batch)."""
        probes = self.batch_choice.series() if self.batch_choice is not None else []
        return [(batch, task_metrics(self.task, {"batch_probe_img_per_s": rate})) for batch, rate in probes]

    def metrics(self) -> dict[str, float]:
        """MLflow metrics, units in the names, prefixed by the task (named in :mod:`vitreg.measure.metrics`)."""
        it = ITERATION_TIME[self.task]
        distributed = self.world_size > 1
        return task_metrics(self.task, {
            "throughput_img_per_s": self.throughput.median,
            "throughput_img_per_s_min": self.throughput.min,
            "throughput_img_per_s_max": self.throughput.max,
            "throughput_cv": self.throughput.cv,
            "gflops_per_img": self.gflops_per_img,
            "achieved_tflops": self.achieved_tflops,
            "warmup_s": self.warmup_s,
            "first_call_s": self.first_call_s,
            f"{it}_p50": self.iter_ms.median,
            f"{it}_p90": self.iter_ms.p90,
            f"{it}_p99": self.iter_ms.p99,
            f"{it}_mean": self.iter_ms.mean,
            "compile_time_s": self.first_call_s if self.compiled else None,
            "mfu": self.mfu,
            "peak_mem_allocated_mb": self.peak_mem_allocated_mb,
            "peak_mem_reserved_mb": self.peak_mem_reserved_mb,
            "allreduce_ms_per_step": self.allreduce_ms_per_step,
            "device_busy_ms_per_step": self.device_busy_ms_per_step,
            "world_size": self.world_size if distributed else None,
            "throughput_img_per_s_per_gpu": self.throughput.median / self.world_size if distributed else None,
        })

    def to_dict(self) -> dict:
        d = asdict(self)
        d["throughput"] = self.throughput.as_dict()
        d["iter_ms"] = self.iter_ms.as_dict()
        d["metrics"] = self.metrics()
        return d


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


