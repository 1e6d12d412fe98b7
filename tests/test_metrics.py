"""The metric table is the one truth: the runner, the DDP reducers, the bench report and compare all
read it, and between them they cover every metric it declares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from vitreg.analysis import comparison
from vitreg.analysis.frame import ALL_METRICS, SHARED_METRICS, TASK_METRICS, CompareError
from vitreg.analysis.timm_benchmark import read_timm_csv
from vitreg.bench import results as report
from vitreg.bench.results import BenchResult, TaskResult
from vitreg.config.spec import BenchSpec
from vitreg.ddp import world
from vitreg.hardware.precision import Fp8Agreement
from vitreg.measure import metrics
from vitreg.measure.anatomy import CLASSES, Anatomy
from vitreg.measure.autobatch import BatchChoice, Probe
from vitreg.measure.figures import Figures, Work
from vitreg.measure.traces import CommProfile
from vitreg.models.factory import ModelInfo

DATA = Path(__file__).parent / "data"

# Per-task metrics that other jobs than the bench runner log: the bench job's scaling against a
# baseline run, and the train job's end-of-training figures.
NOT_FROM_THE_RUNNER = {"scaling_efficiency", "data_wait_frac", "first_step_s", "measured_steps", "final_loss",
                       "images", "steps", "val_top1", "val_loss"} | {
    m.name for m in metrics.METRICS if m.name.startswith("overhead_")}  # the job's phases (vitreg/bench/job.py)


#: profile=true's step anatomy (vitreg.measure.anatomy): 80 ms of matmul kernels, 10 of attention, 10 of idle gaps
_ANATOMY = Anatomy({**dict.fromkeys(CLASSES, 0.0), "matmul": 80_000.0, "attention": 10_000.0, "idle": 10_000.0}, 2,
                   64, False, {"matmul": 4.4e9, "attention": 0.2e9}, {"matmul": 989.4, "attention": 989.4})
ANATOMY_NAMES = [f"anatomy_{c}_{unit}" for c in CLASSES for unit in ("ms_per_img", "pct")] + [
    "anatomy_matmul_tflops", "anatomy_attention_tflops"]


def _task(task: str, compiled: bool = True, **values) -> TaskResult:
    """A task result with every optional figure measured (a compiled DDP job on CUDA, profiled)."""
    profiled = {"allreduce_ms_per_step": 1.5, "device_busy_ms_per_step": 2.5, "peak_mem_forward_mb": 9000.0,
                "peak_mem_backward_mb": 9100.0, "peak_mem_optimizer_mb": 2000.0} if task == "train" else {}
    profiled.update(_ANATOMY.figures())  # profile=true
    figures = Figures(task, {"window_img_per_s": (1200.0, 1234.5, 1250.0),
                             metrics.ITERATION_TIME[task]: (3.0, 3.0, 4.0, 5.0, 5.0), "first_call_s": 12.5,
                             "warmup_s": 0.75, "gflops_per_img": 4.6, "peak_mem_allocated_mb": 12345.6,
                             "peak_mem_reserved_mb": 13000.0, "window_power_w": (690.0, 700.0, 710.0),
                             "sm_clock_mhz": 1635.0, "power_capped_frac": 1.0, "timed_windows": 3,
                             "steps_per_window": 30, **profiled})
    figures = figures.summarized().completed(Work(world_size=2, compiled=compiled))
    # no GPU profile here: MFU as a GPU run has it; three windows have no 95 % interval: a longer run's
    figures = figures.with_values(**{"mfu": 0.0123, "throughput_ci95_halfwidth_pct": 0.4, **values})
    choice = BatchChoice(64, (Probe(32, 1000.0), Probe(64, 1200.0), Probe(128, None)), "oom")
    return TaskResult(task, 64, 224, 3, 3, figures, batch_choice=choice)


def _bench(*tasks: TaskResult) -> BenchResult:
    info = ModelInfo("test_vit", "timm", 224, 16, 1000, 5.7, False)
    return BenchResult(BenchSpec(model="test_vit"), "h200", "bf16", "cuda", info, 4.6, tuple(tasks),
                       estimated_work_s=50.0, work_s=45.0)


def test_the_table_is_well_formed():
    names = [m.name for m in metrics.METRICS]
    assert len(names) == len(set(names))
    for m in metrics.METRICS:
        assert m.better in (metrics.HIGHER, metrics.LOWER, metrics.NEITHER), m
        assert m.ranks in metrics.RANK_RULES, m
        assert set(m.tasks) <= set(metrics.TASKS) and set(m.compared) <= set(metrics.TASKS), m
        assert not m.speed or m.unit in ("img/s", "ms"), m
        assert not m.of or (m.of[0] in names and m.of[1] in metrics.STATS), m  # a statistic of a declared sample
        format(1.0 if "d" not in m.fmt else 1, m.fmt)  # a format spec that formats a number
    with pytest.raises(KeyError, match="not declared"):
        metrics.metric("imgs_per_sec")


def test_logged_names_are_the_ones_mlflow_always_had():
    m = _bench(_task("infer"), _task("train")).metrics()
    stats = ["throughput_img_per_s", "throughput_img_per_s_min", "throughput_img_per_s_max", "throughput_cv",
             "gflops_per_img", "achieved_tflops", "warmup_s", "first_call_s", "throughput_ci95_halfwidth_pct",
             "timed_windows", "steps_per_window"]
    tail = ["compile_time_s", "mfu", "peak_mem_allocated_mb", "peak_mem_reserved_mb"]
    ddp = ["world_size", "throughput_img_per_s_per_gpu"]
    energy = ["mean_power_w", "energy_j_per_img", "img_per_j", "sm_clock_mhz", "power_capped_frac"]  # a GPU's
    assert set(m) == set(["fwd_gflops_per_img", "params_m", "estimated_work_s", "work_s"]
                       + [f"infer_{k}" for k in stats + ["latency_ms_p50", "latency_ms_p90", "latency_ms_p99",
                                                        "latency_ms_mean"] + tail + ddp + energy]
                       + [f"train_{k}" for k in stats + ["step_ms_p50", "step_ms_p90", "step_ms_p99", "step_ms_mean"]
                          + tail + ["allreduce_ms_per_step", "device_busy_ms_per_step"] + ddp + energy
                          + [f"peak_mem_{phase}_mb" for phase in ("forward", "backward", "optimizer")]]
                       + [f"{t}_{k}" for t in ("infer", "train") for k in ANATOMY_NAMES])
    assert m["infer_throughput_img_per_s_per_gpu"] == 1234.5 / 2 and m["infer_compile_time_s"] == 12.5
    # the median window's joules per image: of (690/1200, 700/1234.5, 710/1250) = (0.575, 0.567, 0.568), 0.568
    assert m["infer_energy_j_per_img"] == pytest.approx(710 / 1250) and m["infer_mean_power_w"] == 700.0
    assert m["infer_img_per_j"] == pytest.approx(1250 / 710)


def test_the_runner_logs_every_declared_metric_and_only_those():
    # an amp=fp8 run also logs its agreement with bf16 (job-level)
    bench = dataclasses.replace(_bench(_task("infer"), _task("train")), fp8_agreement=Fp8Agreement(0.75, 0.25))
    logged = set(bench.metrics()) | {k for _, values in bench.series() for k in values}  # series: with a step
    declared = {f"{t}_{m.name}" for m in metrics.METRICS for t in m.tasks
                if m.name not in NOT_FROM_THE_RUNNER and m.logged}
    declared |= {m.name for m in metrics.METRICS if not m.tasks and m.name not in NOT_FROM_THE_RUNNER}
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
                              "compile s", "peak alloc MiB", "TFLOP/s", "MFU", "J/img (W)", "SM MHz, capped"]
    assert infer == ["infer", "64", "1,234.5 (1,200.0-1,250.0)", "1.7%", "4.00 / 5.00 / 5.00", "12.50", "12,346",
                     "5.68", "1.2%", "0.568 (700)", "1,635, 100%"]
    assert train[5] == "-" and train[8] == "-"  # eager: no compile time; no datasheet peak: no MFU
    cpu = report._rows(_bench(_task("infer", peak_mem_allocated_mb=None, peak_mem_reserved_mb=None)))[0]
    assert cpu[6] == "-"
    cpu = report._rows(_bench(_task("infer", window_power_w=None, energy_j_per_img=None, mean_power_w=None,
                                    sm_clock_mhz=None, power_capped_frac=None)))[0]
    assert cpu[9:] == ["-", "-"]  # no NVML: absent, never 0


def test_the_reducers_take_every_rule_from_the_table():
    iteration = [m for m in metrics.METRICS if m.name.startswith(tuple(metrics.ITERATION_TIME.values()))]
    assert {m.ranks for m in iteration} == {"max"}  # infer and train iterations reduce alike
    # a record of every figure a rank measures: the reducer combines each by its row's rule, none by hand
    rank_rules = ("sum", "max", "min", "same", "main")
    for task in metrics.TASKS:
        rows = [m for m in metrics.METRICS if m.ranks in rank_rules and (not m.tasks or task in m.tasks)]
        ranks = [Figures(task, {m.name: (float(r), float(2 - r)) if not m.logged and m.name != "measured_steps"
                                else float(r + 1) for m in rows}) for r in range(2)]
        total = world.reduce_figures(ranks)
        for m in rows:
            assert total[m.name] == metrics.combine(m.name, [f[m.name] for f in ranks]), m.name
        assert total["window_img_per_s"] == (1.0, 3.0) and total[metrics.ITERATION_TIME[task]] == (1.0, 2.0)
        assert total["first_call_s"] == 2.0 and total["fwd_gflops_per_img"] == 1.0  # max; same: rank 0's
    with pytest.raises(ValueError, match="not combined"):
        world.reduce_figures([Figures("train", {"mfu": 0.1})] * 2)  # computed after the reduction, not before
    profiled = {f.name for f in dataclasses.fields(CommProfile)} - {"steps"}
    assert profiled <= set(metrics.BY_NAME)
    with pytest.raises(ValueError, match="not combined"):
        metrics.combine("mfu", [0.1, 0.2])


def test_a_record_holds_declared_names_only():
    with pytest.raises(KeyError, match="not declared in"):
        Figures("infer", {"imgs_per_sec": 1.0})
    with pytest.raises(KeyError, match="not declared for task 'infer'"):
        Figures("infer", {"step_ms": (1.0,)})
    f = Figures("train", {"step_ms": (1.0, 2.0, 3.0, 10.0), "gflops_per_img": 2.0, "throughput_img_per_s": 500.0,
                          "first_step_s": 4.0, "measured_steps": 4}).summarized()
    assert (f["step_ms_p50"], f["step_ms_mean"]) == (2.5, 4.0)
    done = f.completed(Work(world_size=2, compiled=True))
    assert done["achieved_tflops"] == 1.0 and done["throughput_img_per_s_per_gpu"] == 250.0
    assert done["compile_time_s"] == 4.0 and done["world_size"] == 2 and done["mfu"] is None  # no GPU profile
    logged = done.metrics()
    assert "train_step_ms" not in logged and "train_measured_steps" not in logged  # samples, counts: not logged
    assert logged["train_step_ms_p50"] == 2.5 and logged["train_compile_time_s"] == 4.0
    assert f.completed(Work())["compile_time_s"] is None and f.completed(Work())["world_size"] is None


def test_a_new_row_is_recorded_reduced_and_logged_with_no_other_change(monkeypatch):
    """Adding a metric is its row and the code that measures it: the record takes the name, the DDP
    reducer combines it by its rule, and it is logged under its task's prefix."""
    row = metrics.Metric("energy_j_per_img", "J", metrics.LOWER, "max", ".2f", ("infer",), doc="a new figure")
    monkeypatch.setattr(metrics, "METRICS", (*metrics.METRICS, row))
    monkeypatch.setitem(metrics.BY_NAME, row.name, row)
    ranks = [_task("infer").figures.with_values(energy_j_per_img=e) for e in (0.25, 0.5)]
    total = world.reduce_figures([Figures("infer", {"energy_j_per_img": f["energy_j_per_img"]}) for f in ranks])
    assert total["energy_j_per_img"] == 0.5  # the largest rank's, as the row says
    assert TaskResult("infer", 64, 224, 3, 3, ranks[0]).metrics()["infer_energy_j_per_img"] == 0.25


def test_combine_sums_rates_per_window_and_takes_the_slowest_rank():
    assert metrics.combine("throughput_img_per_s", [(1.0, 2.0), (3.0, 5.0)]) == (4.0, 7.0)
    assert metrics.combine("step_ms_p50", [(1.0, 9.0), (3.0, 5.0)]) == (3.0, 9.0)
    assert metrics.combine("measured_steps", [10, 8, 9]) == 8
    assert metrics.combine("peak_mem_allocated_mb", [None, 5.0, 4.0]) == 5.0
    assert metrics.combine("peak_mem_allocated_mb", [None, None]) is None
    assert metrics.combine("throughput_img_per_s", [None, 5.0]) is None  # a partial sum would understate the job


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
