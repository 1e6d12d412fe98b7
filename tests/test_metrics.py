"""The metric table is the one truth: the runner, the DDP reducers, the bench report and compare all
read it, and between them they cover every metric it declares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from vitreg.analysis import comparison
from vitreg.analysis.frame import ALL_METRICS, SHARED_METRICS, TASK_METRICS, CompareError
from vitreg.analysis.timm_csv import read_timm_csv
from vitreg.bench import report
from vitreg.bench.results import BenchResult, TaskResult
from vitreg.config.spec import BenchSpec
from vitreg.ddp import world
from vitreg.hardware.precision import Fp8Agreement
from vitreg.measure import metrics
from vitreg.measure.autobatch import BatchChoice, Probe
from vitreg.measure.profiling import CommProfile
from vitreg.measure.timing import summarize
from vitreg.models.factory import ModelInfo

DATA = Path(__file__).parent / "data"

# Per-task metrics that other jobs than the bench runner log: the bench job's scaling against a
# baseline run, and the train job's end-of-training figures.
NOT_FROM_THE_RUNNER = {"scaling_efficiency", "data_wait_frac", "first_step_s", "measured_steps", "final_loss",
                       "images", "steps"}


def _task(task: str, **kw) -> TaskResult:
    """A task result with every optional figure measured (a compiled DDP job on CUDA, profiled)."""
    fields = dict(task=task, batch_size=64, img_size=224, steps=3, repeats=3,
                  throughput=summarize([1200.0, 1234.5, 1250.0]), iter_ms=summarize([3.0, 3.0, 4.0, 5.0, 5.0]),
                  first_call_s=12.5, warmup_s=0.75, compiled=True, gflops_per_img=4.6, achieved_tflops=5.678,
                  mfu=0.0123, peak_mem_allocated_mb=12345.6, peak_mem_reserved_mb=13000.0, world_size=2,
                  allreduce_ms_per_step=1.5 if task == "train" else None,
                  device_busy_ms_per_step=2.5 if task == "train" else None,
                  batch_choice=BatchChoice(64, (Probe(32, 1000.0), Probe(64, 1200.0), Probe(128, None)), "oom"))
    return TaskResult(**{**fields, **kw})


def _bench(*tasks: TaskResult) -> BenchResult:
    info = ModelInfo("test_vit", "timm", 224, 16, 1000, 5.7, False)
    return BenchResult(BenchSpec(model="test_vit"), "h200", "bf16", "cuda", info, 4.6, tuple(tasks))


def test_the_table_is_well_formed():
    names = [m.name for m in metrics.METRICS]
    assert len(names) == len(set(names))
    for m in metrics.METRICS:
        assert m.better in (metrics.HIGHER, metrics.LOWER, metrics.NEITHER), m
        assert m.ranks in metrics.RANK_RULES, m
        assert set(m.tasks) <= set(metrics.TASKS) and set(m.compared) <= set(metrics.TASKS), m
        assert not m.speed or m.unit in ("img/s", "ms"), m
        format(1.0 if "d" not in m.fmt else 1, m.fmt)  # a format spec that formats a number
    with pytest.raises(KeyError, match="not declared"):
        metrics.metric("imgs_per_sec")


def test_logged_names_are_the_ones_mlflow_always_had():
    m = _bench(_task("infer"), _task("train")).metrics()
    stats = ["throughput_img_per_s", "throughput_img_per_s_min", "throughput_img_per_s_max", "throughput_cv",
             "gflops_per_img", "achieved_tflops", "warmup_s", "first_call_s"]
    tail = ["compile_time_s", "mfu", "peak_mem_allocated_mb", "peak_mem_reserved_mb"]
    ddp = ["world_size", "throughput_img_per_s_per_gpu"]
    assert list(m) == (["fwd_gflops_per_img", "params_m"]
                       + [f"infer_{k}" for k in stats + ["latency_ms_p50", "latency_ms_p90", "latency_ms_p99",
                                                        "latency_ms_mean"] + tail + ddp]
                       + [f"train_{k}" for k in stats + ["step_ms_p50", "step_ms_p90", "step_ms_p99", "step_ms_mean"]
                          + tail + ["allreduce_ms_per_step", "device_busy_ms_per_step"] + ddp])
    assert m["infer_throughput_img_per_s_per_gpu"] == 1234.5 / 2 and m["infer_compile_time_s"] == 12.5


def test_the_runner_logs_every_declared_metric_and_only_those():
    # an amp=fp8 run also logs its agreement with bf16 (job-level)
    bench = dataclasses.replace(_bench(_task("infer"), _task("train")), fp8_agreement=Fp8Agreement(0.75, 0.25))
    logged = set(bench.metrics()) | {k for _, values in bench.series() for k in values}  # series: with a step
    declared = {f"{t}_{m.name}" for m in metrics.METRICS for t in m.tasks if m.name not in NOT_FROM_THE_RUNNER}
    declared |= {m.name for m in metrics.METRICS if not m.tasks}
    assert logged == declared
    assert [(step, *values) for step, values in bench.series()][:2] == [
        (32, "infer_batch_probe_img_per_s"), (64, "infer_batch_probe_img_per_s")]  # the probes that fit
    with pytest.raises(KeyError, match="not declared for task 'infer'"):
        metrics.task_metrics("infer", {"allreduce_ms_per_step": 1.0})
    assert metrics.task_metrics("infer", {"allreduce_ms_per_step": None}) == {}  # unmeasured: nothing logged
    with pytest.raises(KeyError, match="per task"):
        metrics.job_metrics({"mfu": 0.5})
    assert bench.metrics()["fp8_top1_agreement"] == 0.75 and "fp8_top1_agreement" not in _bench().metrics()


def test_the_bench_report_shows_declared_metrics_formatted_by_the_table():
    for col in metrics.REPORT_COLUMNS:
        for task in metrics.TASKS:
            for field in col.fields():
                name = field.replace("iter_", metrics.ITERATION_TIME[task] + "_", 1)
                assert task in metrics.metric(name).tasks, (col.header, name)
    infer, train = report._rows(_bench(_task("infer"), _task("train", compiled=False, mfu=None)))
    assert report.HEADERS == ["task", "batch", "img/s median (min-max)", "CV", "ms/iter p50 / p90 / p99",
                              "compile s", "peak alloc MiB", "TFLOP/s", "MFU"]
    assert infer == ["infer", "64", "1,234.5 (1,200.0-1,250.0)", "1.7%", "4.00 / 5.00 / 5.00", "12.50", "12,346",
                     "5.68", "1.2%"]
    assert train[5] == "-" and train[8] == "-"  # eager: no compile time; no datasheet peak: no MFU
    cpu = report._rows(_bench(_task("infer", peak_mem_allocated_mb=None, peak_mem_reserved_mb=None)))[0]
    assert cpu[6] == "-"


def test_the_reducers_take_every_rule_from_the_table():
    figures = {f.name for f in dataclasses.fields(world.RankFigures)}
    assert set(world.FIGURE_METRICS) == figures
    iteration = [m for m in metrics.METRICS if m.name.startswith(tuple(metrics.ITERATION_TIME.values()))]
    assert {m.ranks for m in iteration} == {"max"}  # infer and train iterations reduce alike
    for name in [*world.FIGURE_METRICS.values(), *world.TRAIN_FIGURES, "allreduce_ms_per_step",
                 "device_busy_ms_per_step"]:
        assert metrics.metric(name).ranks in ("sum", "max", "min"), name
    profiled = {f.name for f in dataclasses.fields(CommProfile)} - {"steps"}
    assert profiled <= set(metrics.BY_NAME)
    with pytest.raises(ValueError, match="not combined"):
        metrics.combine("mfu", [0.1, 0.2])


def test_combine_sums_rates_per_window_and_takes_the_slowest_rank():
    assert metrics.combine("throughput_img_per_s", [(1.0, 2.0), (3.0, 5.0)]) == (4.0, 7.0)
    assert metrics.combine("step_ms_p50", [(1.0, 9.0), (3.0, 5.0)]) == (3.0, 9.0)
    assert metrics.combine("measured_steps", [10, 8, 9]) == 8
    assert metrics.combine("peak_mem_allocated_mb", [None, 5.0, 4.0]) == 5.0
    assert metrics.combine("peak_mem_allocated_mb", [None, None]) is None


def test_slowest_profile_combines_by_the_table(monkeypatch):
    mine, theirs = CommProfile(5, 1.0, None), CommProfile(5, 3.0, 2.0)
    monkeypatch.setattr(world, "gather_objects", lambda obj, w: [obj, theirs])
    reducer = world.ResultReducer(world.World(world_size=2))
    assert reducer.slowest_profile(mine) == CommProfile(5, 3.0, 2.0)


def test_compare_knows_a_direction_for_every_directed_metric():
    assert ALL_METRICS and set(ALL_METRICS) <= set(metrics.BY_NAME)
    assert TASK_METRICS["infer"][:4] == ("throughput_img_per_s", "latency_ms_p50", "latency_ms_p90", "latency_ms_p99")
    assert SHARED_METRICS == ("fwd_gflops_per_img",)
    frame = pd.DataFrame({"gpu": ["h200"], **{m.name: [1.0] for m in metrics.METRICS}})
    for m in metrics.METRICS:
        if m.name in SHARED_METRICS:
            continue  # a property of the model, not of a task's run: not a metric to compare on
        if m.better == metrics.NEITHER:
            with pytest.raises(CompareError, match="no better direction"):
                comparison._polarity(m.name, frame)
        else:
            assert comparison._polarity(m.name, frame) == (m.better == metrics.HIGHER), m.name


def test_timm_imports_log_declared_metrics():
    names = {name for csv in ("benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv",
                              "benchmark-train-amp-nchw-pt240-cu124-rtx4090.csv")
             for rec in read_timm_csv(DATA / csv) for name in rec.metrics}
    assert {"infer_throughput_img_per_s", "train_step_ms_p50", "fwd_gflops_per_img"} <= names
    for name in names:
        task, _, rest = name.partition("_")
        assert (task in metrics.TASKS and task in metrics.metric(rest).tasks) or not metrics.metric(name).tasks, name
