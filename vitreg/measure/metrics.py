"""Every benchmark metric, declared once: name, unit, which way is better, how DDP ranks combine it; the runner,
the DDP reducers, the bench report and compare all read it. MLflow sees ``<task>_<name>`` (a job-level metric: the
name alone): add, don't rename. Ranks combine by ``sum`` (rates), ``max`` (the slowest rank sets a synchronous
job's pace), ``min``, ``same`` / ``main`` (rank 0's); ``per_gpu``, ``world`` and ``job`` are computed after.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from vitreg.measure.anatomy import CLASS_TEXT, CLASSES, FLOP_CLASSES

TASKS = ("infer", "train")
HIGHER, LOWER, NEITHER = "higher", "lower", "none"
RANK_RULES = ("sum", "max", "min", "per_gpu", "world", "same", "main", "job")
#: the statistics a row may take of a sample (attributes of :class:`vitreg.measure.timing.Stats`)
STATS = ("median", "mean", "min", "max", "p90", "p99", "cv", "median_ci95_halfwidth_pct")

#: the name family of one timed iteration: a forward pass (infer) or a whole training step (train)
ITERATION_TIME = {"infer": "latency_ms", "train": "step_ms"}


@dataclass(frozen=True)
class Metric:
    name: str  # per-task metrics without their task prefix
    unit: str  # "" for ratios and counts
    better: str  # HIGHER, LOWER or NEITHER (what compare calls a speedup)
    ranks: str  # one of RANK_RULES
    fmt: str  # format spec of one value in the bench report
    tasks: tuple = TASKS  # () for a job-level metric (no prefix)
    compared: tuple = ()  # the tasks whose compare frame always has this column (NaN where unrecorded)
    speed: bool = False  # compare says "faster"/"slower" (not "better"/"worse") of a change in it
    doc: str = ""
    of: tuple = ()  # (sample row, stat): a statistic of a sample, taken after the ranks' samples combine
    logged: bool = True  # False: a sample, or a count kept for the record only


def _iteration(stat: str, task: str, compared: bool, doc: str) -> Metric:
    return Metric(f"{ITERATION_TIME[task]}_{stat}", "ms", LOWER, "max", ".2f", (task,),
                  (task,) if compared else (), True, doc,
                  of=(ITERATION_TIME[task], "median" if stat == "p50" else stat))


_ITERATION_DOC = "ms per iteration (one batch), over every timed iteration; the slowest rank per iteration"

METRICS: tuple[Metric, ...] = (
    # samples: what a rank timed, before any statistic (the ranks' combine element by element)
    Metric("window_img_per_s", "img/s", HIGHER, "sum", ",.1f", doc="img/s of each timed window", logged=False),
    *(Metric(ITERATION_TIME[t], "ms", LOWER, "max", ".2f", (t,), logged=False,
             doc="ms of each timed iteration, in order; the slowest rank per iteration") for t in TASKS),
    Metric("throughput_img_per_s", "img/s", HIGHER, "sum", ",.1f", compared=TASKS, speed=True,
           doc="images per second over a whole timed window, median of the windows", of=("window_img_per_s", "median")),
    Metric("throughput_img_per_s_min", "img/s", HIGHER, "sum", ",.1f", speed=True, doc="slowest window",
           of=("window_img_per_s", "min")),
    Metric("throughput_img_per_s_max", "img/s", HIGHER, "sum", ",.1f", speed=True, doc="fastest window",
           of=("window_img_per_s", "max")),
    *(_iteration(s, "infer", s != "mean", _ITERATION_DOC) for s in ("p50", "p90", "p99", "mean")),
    *(_iteration(s, "train", s == "p50", _ITERATION_DOC) for s in ("p50", "p90", "p99", "mean")),
    Metric("peak_mem_allocated_mb", "MiB", LOWER, "max", ",.0f", compared=TASKS,
           doc="torch.cuda.max_memory_allocated (CUDA only)"),
    Metric("peak_mem_reserved_mb", "MiB", LOWER, "max", ",.0f", doc="torch.cuda.max_memory_reserved (CUDA only)"),
    *(Metric(f"peak_mem_{phase}_mb", "MiB", LOWER, "max", ",.0f", ("train",), doc=f"torch.cuda.max_memory_allocated "
             f"within the {phase} of one more step after the windows (CUDA only)")
      for phase in ("forward", "backward", "optimizer")),
    Metric("mfu", "", HIGHER, "job", ".1%", compared=TASKS,
           doc="achieved FLOP/s per GPU over the GPU's dense datasheet peak for the precision"),
    Metric("throughput_cv", "", LOWER, "sum", ".1%", compared=TASKS, doc="std/mean of the window throughputs",
           of=("window_img_per_s", "cv")),
    Metric("throughput_ci95_halfwidth_pct", "%", LOWER, "sum", ".2f",
           doc="half-width of the median window throughput's 95 % interval (order statistics, distribution-free), "
               "% of the median; absent under 6 windows", of=("window_img_per_s", "median_ci95_halfwidth_pct")),
    Metric("timed_windows", "", NEITHER, "same", "d", doc="timed windows taken (repeats=0: until the precision "
           "target or a limit; the reason is the <task>_timing_stop tag)"),
    Metric("steps_per_window", "", NEITHER, "same", "d", doc="iterations per timed window (steps=0: as many as "
           "last window_min_s); steps=<this> repeats=<timed_windows> reproduces the run's counts"),
    Metric("world_size", "", NEITHER, "world", "d", compared=("train",), doc="processes of a DDP job (nproc>1)"),
    Metric("throughput_img_per_s_per_gpu", "img/s", HIGHER, "per_gpu", ",.1f", compared=("train",), speed=True,
           doc="throughput_img_per_s / world_size (nproc>1)"),
    Metric("gflops_per_img", "GFLOP", NEITHER, "same", ".2f", doc="work per image of the task (train: fwd+bwd)"),
    Metric("achieved_tflops", "TFLOP/s", HIGHER, "job", ".3g", doc="gflops_per_img x throughput, whole job"),
    Metric("first_call_s", "s", LOWER, "max", ".2f", doc="the first call alone: compilation (if any) + lazy init"),
    Metric("warmup_s", "s", LOWER, "max", ".2f", doc="the rest of the warm-up"),
    Metric("compile_time_s", "s", LOWER, "job", ".2f",
           doc="the first call (bench) or first step (train) when compile is on"),
    Metric("allreduce_ms_per_step", "ms", LOWER, "max", ".2f", ("train",),
           doc="profile_steps>0: all-reduce kernel time per step (torch.profiler)"),
    Metric("device_busy_ms_per_step", "ms", LOWER, "max", ".2f", ("train",),
           doc="profile_steps>0: GPU busy time per step (torch.profiler)"),
    # profile=true: the profiled steps per kernel class (vitreg.measure.anatomy); GPU kernel time, host time on a CPU
    *(Metric(f"anatomy_{c}_ms_per_img", "ms", LOWER, "main", ".4f", doc=f"profile=true: ms per image in "
             f"{CLASS_TEXT[c]} (GPU kernel time; on a CPU, op self time), rank 0's") for c in CLASSES),
    *(Metric(f"anatomy_{c}_pct", "%", NEITHER, "main", ".1f", doc=f"profile=true: {CLASS_TEXT[c]}'s share of the "
             "profiled step in %") for c in CLASSES),
    *(Metric(f"anatomy_{c}_tflops", "TFLOP/s", HIGHER, "main", ".3g", doc=f"profile=true: {c} FLOPs counted on the "
             f"model / time in {c} kernels") for c in FLOP_CLASSES),
    Metric("batch_probe_img_per_s", "img/s", HIGHER, "job", ",.0f", speed=True,
           doc="batch_size=auto: one probe's img/s (eager, a few steps), logged with step = the probed batch; "
               "under DDP rank 0's probes"),
    Metric("scaling_efficiency", "", HIGHER, "job", ".1%",
           doc="nproc>1 with baseline_run: throughput_N / (N x throughput_1)"),
    # energy, throttle state (vitreg.measure.energy): absent where the device cannot read them (the CPU), never 0
    Metric("window_power_w", "W", NEITHER, "sum", ",.0f", logged=False,
           doc="mean power of each timed window: NVML energy counter difference at its edges / its GPU-timed "
               "length; the ranks' powers add up"),
    Metric("mean_power_w", "W", NEITHER, "sum", ",.0f", doc="mean power over the timed windows (NVML), all GPUs",
           of=("window_power_w", "mean")),
    Metric("energy_j_per_img", "J", LOWER, "job", ".4g", compared=TASKS,
           doc="joules per image: window power / window throughput (all GPUs' energy over all images), "
               "median of the windows; windows under 1 s give none (the counter refreshes every 20-100 ms)"),
    Metric("img_per_j", "img/J", HIGHER, "job", ",.2f", compared=TASKS, doc="images per joule: 1 / energy_j_per_img"),
    Metric("sm_clock_mhz", "MHz", NEITHER, "min", ",.0f", compared=TASKS,
           doc="median SM clock sampled during the timed windows (every 50 ms); the slowest rank's"),
    Metric("power_capped_frac", "", NEITHER, "max", ".0%", compared=TASKS,
           doc="share of the samples during the timed windows in which the software power cap held the clocks"),
    Metric("usd_per_1m_img", "USD", LOWER, "job", ",.2f", compared=TASKS, logged=False,
           doc="compare with a price per GPU-hour: USD per million images = price x GPUs / 3600 / img/s x 1e6 "
               "(never logged by a run: prices are the user's)"),
    # the train job's end-of-training figures
    Metric("data_wait_frac", "", LOWER, "max", ".1%", ("train",), doc="host time blocked on the loader / step time"),
    Metric("first_step_s", "s", LOWER, "max", ".2f", ("train",), doc="the first training step alone"),
    Metric("measured_steps", "", NEITHER, "min", "d", ("train",), doc="steps timed after the warm-up (not logged)",
           logged=False),
    Metric("final_loss", "", LOWER, "job", ".4f", ("train",), doc="mean training loss of the last interval"),
    Metric("images", "", NEITHER, "job", ",d", ("train",), doc="images trained on, whole job"),
    Metric("steps", "", NEITHER, "job", ",d", ("train",), doc="optimizer steps"),
    Metric("val_top1", "%", HIGHER, "main", ".2f", (), doc="train: top-1 accuracy in percent on the val/ split, "
           "last evaluation (ImageFolder data with a val/ split)"),
    Metric("val_loss", "", LOWER, "main", ".4f", (), doc="train: mean loss on the val/ split, last evaluation"),
    # job-level: logged without a task prefix
    *(Metric(f"overhead_{phase}_s", "s", LOWER, "max", ".2f", (), doc=f"wall seconds of the command outside its timed "
             f"windows: {what}") for phase, what in (
        ("import", "from the process's start to the job (interpreter, imports, option parsing)"),
        ("setup", "the run opened, the job planned, the model built on the CPU, environment, tags and params logged"),
        ("model", "the model on the device, its FLOPs counted, the estimate's probe, the precision's cast"),
        ("task_setup", "each task's batch search (batch_size=auto), optimizer and step built"),
        ("first_call", "each task's first call (compilation, lazy initialisation)"),
        ("warmup", "each task's warm-up after the first call"),
        ("after_windows", "each task's untimed work after its windows (the SDPA backend read, profiles)"),
        ("report", "metrics, results.json, report.md and the run's name and note, after the last window"),
        ("total", "all of the above: the command's time to its result but the timed windows"))),
    Metric("estimated_work_s", "s", NEITHER, "same", ".1f", (),
           doc="the estimate said before the work (vitreg/measure/estimate.py): model on the device to the end of "
               "the last task"),
    Metric("work_s", "s", LOWER, "max", ".1f", (), doc="what that work took (the estimate's counterpart)"),
    Metric("fwd_gflops_per_img", "GFLOP", NEITHER, "same", ".2f", (), TASKS, doc="one forward pass of one image"),
    Metric("params_m", "M", NEITHER, "same", ".1f", (), doc="model parameters, millions"),
    Metric("fp8_top1_agreement", "", HIGHER, "same", ".1%", (),
           doc="amp=fp8*: share of a fixed seeded batch of 64 whose top-1 class matches the bf16 weights' model"),
    Metric("fp8_max_abs_logit_diff", "", LOWER, "same", ".3g", (),
           doc="amp=fp8*: largest |logit(fp8) - logit(bf16 weights)| over that batch"),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}


def metric(name: str) -> Metric:
    """The declared metric ``name`` (without a task prefix); KeyError names the table."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not declared in vitreg.measure.metrics.METRICS") from None


def task_metrics(task: str, values: dict) -> dict[str, float]:
    """``{"<task>_<name>": value}`` for each of ``values`` that is not None, each declared (for ``task``)."""
    out = {}
    for name, value in values.items():
        declared = metric(name).tasks
        if value is not None:
            if task not in declared:
                raise KeyError(f"metric {name!r} is not declared for task {task!r}")
            out[f"{task}_{name}"] = float(value)
    return out


def job_metrics(values: dict) -> dict[str, float]:
    """Job-level metrics (no prefix), checked against the table like :func:`task_metrics`."""
    for name in values:
        if metric(name).tasks:
            raise KeyError(f"metric {name!r} is per task: log it through task_metrics()")
    return {name: float(v) for name, v in values.items() if v is not None}


def compared_metrics(task: str) -> tuple[str, ...]:
    """The per-task metrics compare's frame always carries for ``task``, in table order."""
    return tuple(m.name for m in METRICS if m.tasks and task in m.compared)


def compared_job_metrics() -> tuple[str, ...]:
    """The job-level metrics compare's frame carries on every task row of a run."""
    return tuple(m.name for m in METRICS if not m.tasks and m.compared)


def combine(name: str, per_rank: list):
    """The job's value of metric ``name`` from every rank's by its ``ranks`` rule; tuples (samples) element by
    element. A None (not measured) makes a sum None (a partial sum would understate the job); max and min leave it
    out. The rules computed after the reduction raise."""
    rule = metric(name).ranks
    if rule in ("same", "main"):
        return per_rank[0] if per_rank else None
    reducers = {"sum": sum, "max": max, "min": min}
    if rule not in reducers:
        raise ValueError(f"metric {name!r} ({rule!r}) is not combined from the ranks' figures")
    present = [v for v in per_rank if v is not None]
    if not present or (rule == "sum" and len(present) < len(per_rank)):
        return None
    if isinstance(present[0], tuple):
        return tuple(reducers[rule](vs) for vs in zip(*present))
    return reducers[rule](present)


@dataclass(frozen=True)
class Column:
    """One column of the bench report: ``cell`` formats the task's metrics in their own ``fmt`` (``{iter_p50}``:
    latency_ms_p50 or step_ms_p50); a cell with a metric the task did not record shows ``-``."""

    header: str
    cell: str

    def fields(self) -> list[str]:
        return [f for _, f, _, _ in string.Formatter().parse(self.cell) if f]

    def render(self, task: str, values: dict) -> str:
        resolved = {}
        for field in self.fields():
            name = field.replace("iter_", ITERATION_TIME[task] + "_", 1) if field.startswith("iter_") else field
            if values.get(name) is None:
                return "-"
            resolved[field] = format(values[name], metric(name).fmt)
        return self.cell.format(**resolved)


REPORT_COLUMNS: tuple[Column, ...] = (
    Column("img/s median (min-max)", "{throughput_img_per_s} ({throughput_img_per_s_min}-{throughput_img_per_s_max})"),
    Column("CV", "{throughput_cv}"),
    Column("ms/iter p50 / p90 / p99", "{iter_p50} / {iter_p90} / {iter_p99}"),
    Column("compile s", "{compile_time_s}"),
    Column("peak alloc MiB", "{peak_mem_allocated_mb}"),
    Column("TFLOP/s", "{achieved_tflops}"),
    Column("MFU", "{mfu}"),
    Column("J/img (W)", "{energy_j_per_img} ({mean_power_w})"),
    Column("SM MHz, capped", "{sm_clock_mhz}, {power_capped_frac}"),
)
