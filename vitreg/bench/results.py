"""What a benchmark measured, as typed values (a :class:`TaskResult` per task, a :class:`BenchResult` per run) and
as text: the terminal table (:func:`results_table`) and report.md (:func:`report_markdown`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import pandas as pd

from vitreg.analysis.frame import options_shown_in
from vitreg.analysis.render import RESULT_HEADERS as HEADERS
from vitreg.analysis.render import code_block, fixed_width, inert, markdown_table, result_rows
from vitreg.config.options import identity_names
from vitreg.config.parse import param_text
from vitreg.config.spec import BenchSpec
from vitreg.environment import EnvInfo
from vitreg.measure.autobatch import BatchChoice
from vitreg.measure.energy import SPREAD_LIMIT, suspect_flags
from vitreg.measure.figures import Figures
from vitreg.measure.graphs import EAGER_STEPS_BEFORE_CAPTURE
from vitreg.measure.metrics import job_metrics, task_metrics
from vitreg.models.factory import ModelInfo

#: eager forward passes before an inference capture (no DDP there: a few to settle the allocator)
INFER_EAGER_STEPS_BEFORE_CAPTURE = 3


@dataclass(frozen=True)
class TaskResult:
    """One task: what ran (batch, SDPA backend, compile cache) and its :class:`Figures`."""

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

    @property
    def flags(self) -> list[str]:
        """What makes this figure suspect, from its tags."""
        return suspect_flags(self.window_tags)

    def tags(self) -> dict[str, str]:
        """What this task ran, as run tags prefixed by the task."""
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
    estimated_work_s: float | None = None  # what the estimate said before the tasks (vitreg.measure.estimate)
    work_s: float | None = None  # what the tasks took, the estimate's counterpart

    def metrics(self) -> dict[str, float]:
        out = job_metrics({"fwd_gflops_per_img": self.fwd_gflops_per_img, "params_m": self.model.params_m,
                           "estimated_work_s": self.estimated_work_s, "work_s": self.work_s})
        if self.fp8_agreement is not None:
            out.update(job_metrics({"fp8_top1_agreement": self.fp8_agreement.top1_agreement,
                                    "fp8_max_abs_logit_diff": self.fp8_agreement.max_abs_logit_diff}))
        for task in self.tasks:
            out.update(task.metrics())
        return out

    def tags(self) -> dict[str, str]:
        """What ran, as run tags: precision, SDPA asked for and found (overall where the tasks agree), per task."""
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
        return [point for task in self.tasks for point in task.series()]

    @property
    def flags(self) -> list[str]:
        """Every task's flags, once each, in order: what the run's name carries."""
        return list(dict.fromkeys(flag for task in self.tasks for flag in task.flags))

    def summary_line(self) -> str:
        ran = ", ".join(f"{t.task} {t.sdpa_backend}" for t in self.tasks if t.sdpa_backend) or "-"
        return f"precision {self.precision}; sdpa={self.sdpa} (ran: {ran})"

    def to_dict(self) -> dict:
        return {"spec": self.spec.to_params(), "gpu": self.gpu, "amp": self.amp, "device": self.device,
                "model": asdict(self.model), "fwd_gflops_per_img": self.fwd_gflops_per_img,
                "tasks": [t.to_dict() for t in self.tasks], "precision": self.precision, "tags": self.tags()}


def _rows(result: BenchResult) -> list[list[str]]:
    return result_rows({"task": t.task, "batch_size": t.batch_size, "metrics": t.metrics()} for t in result.tasks)


#: the cell of a figure this run has no value for (:meth:`vitreg.measure.metrics.Column.render`)
NO_VALUE = "-"


def _carried(rows: list[list[str]]) -> list[list[str]]:
    """The rows less the columns no row has a value in (a CPU has no compile time, CUDA allocator, datasheet peak,
    energy counter or SM clock: five columns of ``-`` hid the ones it has)."""
    keep = [i for i in range(len(rows[0])) if any(row[i] != NO_VALUE for row in rows[1:])]
    return [[row[i] for i in keep] for row in rows]


def results_table(result: BenchResult) -> str:
    """The terminal's table, a suspect figure flagged on its row (issue 38: a 3.5x slower figure was printed
    without a word)."""
    flags = [", ".join(task.flags) or NO_VALUE for task in result.tasks]
    rows = _carried([HEADERS + ["flags"]] + [row + [flag] for row, flag in zip(_rows(result), flags)])
    return "\n".join([result.summary_line(), fixed_width(rows[0], rows[1:], [False] * len(rows[0]))])


def spread_warning(result: BenchResult) -> str | None:
    """A warning when a task's window spread is over :data:`SPREAD_LIMIT`: a comparison may see noise as a change."""
    missed = [t.task for t in result.tasks if t.window_tags.get("spread_over_target") == "true"]
    if not missed:
        return None
    return (f"warning: {' and '.join(missed)}: window spread over {SPREAD_LIMIT:.0%} (the windows' CV; "
            f"tag {missed[0]}_spread_over_target): rerun on a quiet machine, or with more steps per window, "
            f"before comparing")


def precision_warning(result: BenchResult) -> str | None:
    """A warning when a task stopped timing before its median was as sure as ``precision_pct`` asked."""
    missed = [t for t in result.tasks if "precision missed" in t.flags]
    if not missed:
        return None
    halfwidth = {t.task: t.figures.get("throughput_ci95_halfwidth_pct") for t in missed}
    said = "; ".join(f"{t.task}: " + ("no 95 % interval (under 3 windows)" if halfwidth[t.task] is None else
                                      f"+-{halfwidth[t.task]:.2f} %") + " after "
                     f"{t.repeats} windows (tag {t.task}_timing_stop={t.window_tags['timing_stop']})" for t in missed)
    fix = ("cuda_graph=true times the GPU alone" if any("launch-bound" in t.flags for t in missed) else
           "rerun on a quiet machine or with a larger max_time_s")
    return (f"warning: the precision target {result.spec.precision_pct:g} % was not reached ({said}): {fix} before "
            f"comparing")


def run_warning(result: BenchResult | None) -> str | None:
    """The run's one warning line (issue 38), the spread's and the precision target's together."""
    if result is None:
        return None
    said = [w for w in (spread_warning(result), precision_warning(result)) if w]
    return "warning: " + "; ".join(w.removeprefix("warning: ") for w in said) if said else None


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    return markdown_table(pd.DataFrame(rows, columns=headers))


def cudnn_text(raw: str | None) -> str | None:
    """torch's cuDNN version integer as a version: ``91002`` -> ``9.10.2`` (cuDNN 9 packs
    major*10000 + minor*100 + patch), ``8907`` -> ``8.9.7`` (cuDNN 8: major*1000 + minor*100 + patch)."""
    if not raw or not str(raw).isdigit():
        return raw
    number = int(raw)
    major, rest = divmod(number, 10000) if number >= 10000 else divmod(number, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _cuda_rows(result: BenchResult, env: EnvInfo) -> list[list[str]]:
    """The GPU software stack; torch reports its build's also where no GPU ran (then shown as the build's)."""
    stack = f"{env.cuda_version or '-'} / {cudnn_text(env.cudnn_version) or '-'} / {env.nccl_version or '-'}"
    if result.device == "cuda":
        return [["driver / CUDA / cuDNN / NCCL", f"{env.driver_version or '-'} / {stack}"]]
    if env.cuda_version:
        return [["torch build: CUDA / cuDNN / NCCL", f"{stack} (not used: no GPU ran)"]]
    return []


def _gpu_text(result: BenchResult, env: EnvInfo) -> str:
    if not env.gpu_count:
        return f"none (CPU: {env.cpu_model}, {env.cpu_count} cores)"
    memory = "-" if env.gpu_memory_gb is None else f"{env.gpu_memory_gb:.0f}"
    gpus = f"{env.gpu_name} x{env.gpu_count} ({memory} GB, cc {env.compute_capability or '-'})"
    return gpus if result.device == "cuda" else f"{gpus}, not used: the run was on {result.device}"


# The identity options the Configuration table's own rows show; every other gets a row `name | value`, so two
# reports of different configurations differ here, and an option added to the table appears unasked.
_NAMED_ROWS = ("model", "img_size", "amp", "sdpa", "compile", "compile_backend", "cuda_graph")


def _identity_rows(result: BenchResult) -> list[list[str]]:
    """``[name, value]`` of the other identity options; the DDP settings only where several processes ran."""
    spec = result.spec
    several = max((t.figures.get("world_size") or 1 for t in result.tasks), default=1) > 1
    names = [n for n in identity_names("bench") if n not in _NAMED_ROWS and hasattr(spec, n)]
    return [[n, param_text(getattr(spec, n))] for n in names if several or n not in options_shown_in("ddp")]


def report_markdown(result: BenchResult, env: EnvInfo, command: str | None = None) -> str:
    """report.md: what ran, where, and what it measured."""
    spec = result.spec
    env_rows = [
        ["GPU", _gpu_text(result, env)],
        ["label", f"{result.gpu}"],
        *_cuda_rows(result, env),
        ["torch / torchvision / timm / mlflow",
         f"{env.torch_version} / {env.torchvision_version} / {env.timm_version} / {env.mlflow_version}"],
        ["python / OS", f"{env.python_version} / {env.os}"],
        ["host / vitreg commit", f"{env.hostname} / {env.vitreg_git_sha}"],
    ]
    cfg_rows = [
        ["model", f"{result.model.name} ({result.model.source}, {result.model.params_m:.1f} M params)"],
        ["image size", str(result.model.img_size)],
        ["precision / attention", result.summary_line()],
        ["compile", f"{spec.compile} ({spec.compile_backend})" if spec.compile != "off" else "off (eager)"],
        ["CUDA graph", f"yes: each step captured once (after {EAGER_STEPS_BEFORE_CAPTURE} eager steps for train, "
                       f"{INFER_EAGER_STEPS_BEFORE_CAPTURE} for infer), timed as replays" if spec.cuda_graph else "no"],
        ["timing", f"{spec.warmup} warm-up iters, " + ", ".join(
            f"{t.task} {t.repeats} windows x {t.steps} iters ({t.window_tags.get('timing_stop', '-')})"
            for t in result.tasks) + f", {'CUDA events' if result.device == 'cuda' else 'perf_counter'}"],
        *_identity_rows(result),
        ["forward GFLOPs / image", f"{result.fwd_gflops_per_img:.2f}"],
    ]
    parts = [f"# vitreg benchmark: {inert(result.model.name)} on {inert(result.gpu)}", ""]
    if command:  # the command line holds the run name and every value typed: a block it cannot close
        parts += [code_block(command), ""]
    parts += ["## Environment", "", _markdown(["", ""], env_rows), "",
              "## Configuration", "", _markdown(["", ""], cfg_rows), "",
              "## Results", "", _markdown(HEADERS, _rows(result)), "",
              "Throughput: images per second over a whole timed window, median of the windows (min-max in "
              "brackets); CV: std/mean of the window throughputs. Latency: one iteration (one batch) in ms. "
              "Training iterations are forward + loss + backward + optimizer step. MFU: achieved FLOP/s over the "
              "GPU's dense datasheet peak for the active precision. Compile time: the first call alone, apart "
              "from the timed windows.", ""]
    return "\n".join(parts)

