"""vitreg.analysis (and vitreg.tracking.search's tidy frame) on synthetic search_runs frames whose right
answer is known by construction."""

from __future__ import annotations

import itertools
import os
import re
import math
from pathlib import Path

import pandas as pd
import matplotlib
import pytest

from vitreg.analysis import frame as schema
from vitreg.analysis import plots
from vitreg.analysis.comparison import compare_gpus, compare_runs, compile_amp_gains
from vitreg.analysis.frame import CompareError
from vitreg.analysis.render import format_table, markdown_table
from vitreg.analysis.report import write_report
from vitreg.analysis.timm_benchmark import read_timm_csv
from vitreg.config.options import identity_names, option
from vitreg.tracking.search import runs_frame, tidy

DATA = Path(__file__).parent / "data"
_ids = itertools.count()


def run(gpu, thr=None, *, model="deit_small_patch16_224", task="infer", amp="bf16", compile="off",
        bs=64, img=224, nproc=None, status="FINISHED", lat=None, step=None, tag_gpu=True, ddp=None,
        ddp_comm_hook=None, **metrics):
    """One row as mlflow.search_runs() returns it (params/tags are strings, metrics floats)."""
    row = {
        "run_id": f"r{next(_ids):04d}",
        "status": status,
        "start_time": pd.Timestamp("2025-01-01", tz="UTC"),
        "params.model": model,
        "params.task": task,
        "params.gpu": "auto",
        "params.amp": "auto",
        "tags.amp": amp,
        "params.compile": compile,
        "params.batch_size": str(bs),
        "params.img_size": str(img),
    }
    if tag_gpu:
        row["tags.gpu"] = gpu
    else:
        row["params.gpu"] = gpu
    if nproc is not None:
        row["params.nproc"] = str(nproc)
    if ddp is not None:  # (bucket MB, static graph) as MLflow logs them: strings
        row["params.ddp_bucket_mb"], row["params.ddp_static_graph"] = str(ddp[0]), str(ddp[1]).lower()
    if ddp_comm_hook is not None:
        row["params.ddp_comm_hook"] = ddp_comm_hook
    prefixes = ["infer", "train"] if task == "both" else [task]
    for p in prefixes:
        if thr is not None:
            row[f"metrics.{p}_throughput_img_per_s"] = float(thr)
    if lat is not None:
        row["metrics.infer_latency_ms_p50"] = float(lat)
    if step is not None:
        row["metrics.train_step_ms_p50"] = float(step)
    for k, v in metrics.items():
        row[f"metrics.{k}"] = float(v)
    return row


def frame(*rows):
    """The rows as mlflow.search_runs() returns them."""
    return pd.DataFrame(list(rows))


def runs(*rows):
    """The rows as the tidy frame the analysis works on."""
    return tidy(frame(*rows))


def repeats(gpu, values, **kw):
    return [run(gpu, v, **kw) for v in values]


def only(table, **where):
    sel = pd.Series(True, index=table.index)
    for k, v in where.items():
        sel &= table[k] == v
    rows = table[sel]
    assert len(rows) == 1, rows
    return rows.iloc[0]


# ---------------------------------------------------------------------------------------- tidy


def test_tidy_splits_both_runs_and_strips_prefixes():
    df = frame(
        run("h200", 2000, task="both", lat=3.1, step=40.0, fwd_gflops_per_img=9.2,
            infer_peak_mem_allocated_mb=900, train_peak_mem_allocated_mb=5000),
        run("a100", 1000, tag_gpu=False),  # no tags.gpu: falls back to params.gpu
    )
    t = tidy(df)
    assert len(t) == 3
    h = t[t["gpu"] == "h200"].set_index("task")
    assert h.loc["infer", "throughput_img_per_s"] == 2000
    assert h.loc["infer", "latency_ms_p50"] == 3.1
    assert h.loc["infer", "peak_mem_allocated_mb"] == 900
    assert h.loc["train", "peak_mem_allocated_mb"] == 5000
    assert h.loc["train", "step_ms_p50"] == 40.0
    assert math.isnan(h.loc["train", "latency_ms_p50"])
    assert (h["fwd_gflops_per_img"] == 9.2).all()  # shared metric goes to both task rows
    a = only(t, gpu="a100")
    assert a["amp"] == "bf16"  # resolved tags.amp wins over params.amp=auto
    assert a["nproc"] == 1  # missing params.nproc means one process
    assert a["batch_size"] == 64 and a["img_size"] == 224
    for col in schema.config_columns() + schema.ALL_METRICS:
        assert col in t.columns


def test_tidy_ignores_failed_runs_and_keeps_timm_imports():
    df = frame(
        run("a100", 1000),
        run("a100", 99999, status="FAILED"),
        run("a100", 88888, status="RUNNING"),
        {**run("rtx4090", 700, status="SCHEDULED"), "tags.source": "timm"},
    )
    t = tidy(df)
    assert sorted(t["throughput_img_per_s"]) == [700, 1000]
    assert set(t["source"]) == {"vitreg", "timm"}


def test_failed_runs_do_not_move_the_comparison():
    ok = repeats("a100", [1000, 1010, 990]) + repeats("h200", [2000, 2020, 1980])
    bad = [run("h200", 10, status="FAILED"), run("a100", 1e6, status="FAILED")]
    with_bad = compare_gpus(runs(*ok, *bad), baseline="a100").table
    without = compare_gpus(runs(*ok), baseline="a100").table
    pd.testing.assert_frame_equal(with_bad, without)
    assert only(with_bad, gpu="h200")["n_runs"] == 3


def test_empty_and_all_failed_frames_raise_compare_error():
    with pytest.raises(CompareError, match="no runs to compare"):
        tidy(pd.DataFrame())
    with pytest.raises(CompareError, match="FAILED"):
        tidy(frame(run("a100", 1, status="FAILED"), run("a100", 2, status="FAILED")))
    assert isinstance(CompareError("x"), ValueError)


# ---------------------------------------------------------------------------------- verdicts


def test_clear_2x_speedup_is_faster_with_ci_excluding_one():
    df = runs(*repeats("a100", [1000, 1012, 994, 1005, 989]),
               *repeats("h200", [2010, 1992, 2005, 2021, 1987]))
    c = compare_gpus(df, baseline="a100")
    h = only(c.table, gpu="h200")
    assert h["verdict"] == "faster"
    assert h["speedup"] == pytest.approx(2005 / 1000)
    assert 1 < h["ci_low"] <= h["speedup"] <= h["ci_high"]
    assert h["n_runs"] == 5
    assert h["throughput_img_per_s_min"] == 1987 and h["throughput_img_per_s_max"] == 2021
    base = only(c.table, gpu="a100")
    assert base["verdict"] == "baseline" and base["speedup"] == 1.0
    assert c.table.iloc[0]["gpu"] == "a100"  # baseline row leads its configuration
    assert c.geomean_speedup() == {"h200": pytest.approx(2.005)}
    assert c.verdict_counts == {"baseline": 1, "faster": 1}

    # Same data, the other way round.
    back = only(compare_gpus(df, baseline="H200").table, gpu="a100")  # label match is case-blind
    assert back["verdict"] == "slower"
    assert back["ci_high"] < 1


def test_overlapping_noisy_runs_are_within_noise():
    df = runs(*repeats("a100", [1000, 1300, 900, 1200, 1100]),
               *repeats("h200", [1050, 950, 1250, 1150, 1000]))
    h = only(compare_gpus(df, baseline="a100").table, gpu="h200")
    assert h["verdict"] == "within noise"
    assert h["ci_low"] < 1 < h["ci_high"]


def test_ci_excluding_one_is_not_enough_when_runs_scatter_more_than_the_change():
    # Medians are rock steady (the bootstrap interval of their ratio is [1.1, 1.1]) but each side
    # has an outlier run 40% away: a 10% change is not distinguishable from that scatter.
    df = runs(*repeats("a100", [100] * 6 + [140]), *repeats("h200", [110] * 6 + [70]))
    h = only(compare_gpus(df, baseline="a100").table, gpu="h200")
    assert h["ci_low"] > 1
    assert h["verdict"] == "within noise"


def test_single_runs_get_a_point_estimate_but_no_verdict():
    df = runs(run("a100", 1000), *repeats("h200", [2000, 2010]))
    h = only(compare_gpus(df, baseline="a100").table, gpu="h200")
    assert h["verdict"] == "single run"
    assert h["speedup"] == pytest.approx(2.005)
    assert math.isnan(h["ci_low"]) and math.isnan(h["ci_high"])


def test_configuration_missing_on_baseline_says_no_baseline():
    df = runs(*repeats("a100", [1000, 1001]), *repeats("h200", [2000, 2001]),
               *repeats("h200", [500, 501], model="vit_large_patch16_224"))
    t = compare_gpus(df, baseline="a100").table
    assert only(t, model="vit_large_patch16_224")["verdict"] == "no baseline"
    assert math.isnan(only(t, model="vit_large_patch16_224")["speedup"])


def test_configurations_are_not_mixed():
    # Same GPU pair, runs that differ in one identity option each (the batch, the attention kernel, the
    # compile backend, CUDA graphs, the DDP hook): separate comparisons, never one pooled group. Varying
    # only batch_size, as this test once did, let four CPU runs at sdpa=auto and sdpa=math pool as one.
    variants = [dict(bs=64), dict(bs=256), dict(bs=64, sdpa="math"), dict(bs=64, compile="default"),
                dict(bs=64, compile="default", compile_backend="eager"), dict(bs=64, cuda_graph="true"),
                dict(bs=64, nproc=2), dict(bs=64, nproc=2, ddp_comm_hook="bf16")]
    rows = []
    for i, variant in enumerate(variants):
        params = {f"params.{k}": v for k, v in variant.items() if k not in ("bs", "compile", "nproc",
                                                                             "ddp_comm_hook")}
        kw = {k: v for k, v in variant.items() if k in ("bs", "compile", "nproc", "ddp_comm_hook")}
        base = 1000 * (i + 1)
        rows += [{**run("a100", base + d, **kw), **params} for d in (0, 2)]
        rows += [{**run("h200", (i + 2) * base + d, **kw), **params} for d in (0, 2)]
    t = compare_gpus(runs(*rows), baseline="a100").table
    assert len(t) == 2 * len(variants) and set(t["n_runs"]) == {2}
    h200 = t[t["gpu"] == "h200"]
    expected = sorted(((i + 2) * 1000 * (i + 1) + 1) / (1000 * (i + 1) + 1) for i in range(len(variants)))
    assert sorted(h200["speedup"]) == pytest.approx(expected)
    assert only(t, gpu="h200", batch_size=256)["speedup"] == pytest.approx((3 * 2000 + 1) / 2001)


def test_cpu_runs_at_two_attention_kernels_are_two_configurations():
    """The case of issue 19: four CPU runs, two at sdpa=auto and two at sdpa=math, were one configuration
    of n_runs=4; each kernel is its own, and the terminal table shows the one option that varies."""
    df = runs(*[{**run("cpu", v, amp="off"), "params.sdpa": kernel}
                for kernel, v in (("auto", 30), ("auto", 31), ("math", 20), ("math", 21))])
    c = compare_gpus(df)
    assert sorted(c.table["sdpa"]) == ["auto", "math"] and list(c.table["n_runs"]) == [2, 2]
    text = format_table(c)
    header = text.splitlines()[text.splitlines().index(next(l for l in text.splitlines() if l.startswith("model")))]
    assert "sdpa" in header.split() and "clip_grad" not in text and "compile_backend" not in text
    assert "fixed: " in text and "compile=off" in text


def _two_values(option) -> tuple[str, str]:
    """Two values of ``option`` that are different settings, as MLflow logs params (strings)."""
    if option.name == "task":
        return "infer", "train"  # a task=both run's infer row is an infer run's: the same work
    if option.kind == "choice":
        return option.choices[0], option.choices[-1]
    if option.kind == "bool":
        return "false", "true"
    if option.kind in ("int", "batch"):
        return "64", "128"
    if option.kind == "float":
        return "0.5", "0.75"
    return str(option.default or "x"), "other"


# an identity option that only acts where another one lets it (the same work otherwise, kept as one)
_ACTS_ONLY_WITH = {"compile_backend": {"compile": "default"},
                   **{name: {"nproc": 2} for name in schema.options_shown_in("ddp")}}
_IDENTITY = [(command, name) for command in schema.RUN_COMMANDS for name in identity_names(command)
             if name != "model_uri"]  # an infer run is compared as the architecture its checkpoint holds


def _run_with(command: str, name: str, value: str, gpu: str, thr: float) -> dict:
    """A run of ``command`` (its vitreg_job tag) whose ``name`` param is ``value`` and the rest as ``run``'s."""
    task = value if name == "task" else ("train" if command == "train" else "infer")
    row = run(gpu, thr, task=task, **_ACTS_ONLY_WITH.get(name, {}))
    row["tags.vitreg_job"] = command
    if name != "task":
        row[f"params.{name}"] = value
        if f"tags.{name}" in row:  # a resolved tag (amp) holds what ran: the same setting
            row[f"tags.{name}"] = value
    return row


def test_every_identity_option_is_checked_below():
    assert {name for _, name in _IDENTITY} >= set(identity_names("bench"))
    assert len(_IDENTITY) >= 30  # bench, infer and train


@pytest.mark.parametrize(("command", "name"), _IDENTITY, ids=[f"{c}-{n}" for c, n in _IDENTITY])
def test_runs_differing_in_one_identity_option_alone_are_never_pooled(command, name):
    a, b = _two_values(option(command, name))
    rows = [_run_with(command, name, a, "a100", v) for v in (1000, 1010)]
    rows += [_run_with(command, name, a, "h200", v) for v in (2000, 2020)]
    rows += [_run_with(command, name, b, "a100", v) for v in (3000, 3030)]
    rows += [_run_with(command, name, b, "h200", v) for v in (9000, 9090)]
    t = compare_gpus(runs(*rows), baseline="a100").table
    assert len(t) == 4 and list(t["n_runs"]) == [2, 2, 2, 2], t
    assert sorted(t.loc[t["gpu"] == "h200", "speedup"]) == pytest.approx([2.0, 3.0])


def test_runs_that_predate_an_option_compare_with_runs_at_its_default():
    """No sdpa / compile_backend / cuda_graph param: logged before the option, so run at today's default
    (torch picked the kernel, inductor, no graph); a bench run has no clip_grad: not applicable ("-")."""
    old = [run("a100", v, compile="default") for v in (1000, 1010)]
    at_default = [{**run("a100", v, compile="default"), "params.sdpa": "AUTO", "params.compile_backend": "inductor",
                   "params.cuda_graph": "False"} for v in (1020, 1030)]
    other = [{**run("a100", v, compile="default"), "params.sdpa": "math"} for v in (500, 510)]
    trained = [{**run("a100", v, task="train"), "tags.vitreg_job": "train", "params.clip_grad": "1"}
               for v in (300, 310)]
    t = tidy(frame(*old, *at_default, *other, *trained))
    table = compare_gpus(t).table
    assert only(table, sdpa="auto", task="infer")["n_runs"] == 4
    assert only(table, sdpa="math")["n_runs"] == 2
    assert set(t.loc[t["task"] == "infer", "clip_grad"]) == {schema.NOT_APPLICABLE}
    assert set(t.loc[t["task"] == "train", "clip_grad"]) == {"1.0"}  # as the option parses it
    assert set(t.loc[t["task"] == "infer", "compile"]) == {"default"}


def test_the_configuration_columns_come_from_the_option_table(monkeypatch):
    """A new identity option is a configuration column with no other change (channels_last, issue 19)."""
    from vitreg.config import options as table
    columns = schema.config_columns()
    assert "sdpa" in columns and "compile_backend" not in columns  # shown in compile (default@eager)
    assert set(columns) == {schema.FOLDED_INTO.get(n, n) for c in schema.RUN_COMMANDS for n in identity_names(c)}
    added = table.Option("channels_last", "bool", False, "NHWC input.", ("bench",), identity=True)
    monkeypatch.setattr(table, "OPTIONS", (*table.OPTIONS, added))
    assert set(schema.config_columns()) == {*columns, "channels_last"}
    df = runs(*[{**run("a100", v), "params.channels_last": on} for v, on in ((100, "true"), (200, "false"))])
    assert sorted(df["channels_last"]) == ["false", "true"] and len(compare_gpus(df).table) == 2


def test_lower_is_better_metric_inverts_the_speedup():
    df = runs(*[run("a100", 1000, lat=v) for v in (10.0, 10.1, 9.9)],
               *[run("h200", 2000, lat=v) for v in (5.0, 5.05, 4.95)])
    c = compare_gpus(df, baseline="a100", metric="latency_ms_p50")
    h = only(c.table, gpu="h200")
    assert not c.higher_is_better
    assert h["speedup"] == pytest.approx(2.0)
    assert h["verdict"] == "faster"
    assert "latency_ms_p50_median" in c.table and "throughput_img_per_s" in c.table


def test_baseline_gpu_without_runs_names_the_gpus_present():
    df = runs(*repeats("a100", [1000, 1001]), *repeats("h200", [2000, 2001]))
    with pytest.raises(CompareError) as err:
        compare_gpus(df, baseline="v100")
    msg = str(err.value)
    assert "v100" in msg and "a100" in msg and "h200" in msg
    assert "\n" not in msg


def test_unknown_metric_lists_the_known_ones():
    df = runs(*repeats("a100", [1000, 1001]))
    with pytest.raises(CompareError, match="unknown metric 'imgs_per_sec'.*throughput_img_per_s"):
        compare_gpus(df, metric="imgs_per_sec")
    with pytest.raises(CompareError, match="no finished run recorded step_ms_p50"):
        compare_gpus(df, metric="step_ms_p50")  # a train metric on infer-only runs


def test_no_baseline_means_no_speedup_columns():
    df = runs(*repeats("a100", [1000, 1001]), *repeats("h200", [2000, 2001]))
    c = compare_gpus(df)
    assert not {"speedup", "ci_low", "ci_high", "verdict", "baseline"} & set(c.table.columns)
    assert c.geomean_speedup() == {} and c.verdict_counts == {}
    assert only(c.table, gpu="h200")["throughput_img_per_s_median"] == 2000.5


def test_bootstrap_is_reproducible_with_a_seed():
    # 12 runs a side: with 4, resampled medians take so few values that every seed gave the same interval,
    # and the test passed with the seed ignored
    df = runs(*repeats("a100", [1000 + 7 * (i * 5 % 12) for i in range(12)]),
              *repeats("h200", [1900 + 13 * (i * 7 % 12) for i in range(12)]))
    a = compare_gpus(df, baseline="a100", seed=7, n_boot=200).table
    pd.testing.assert_frame_equal(a, compare_gpus(df, baseline="a100", seed=7, n_boot=200).table)
    intervals = {tuple(compare_gpus(df, baseline="a100", seed=s, n_boot=200).table["ci_low"].dropna()) for s in range(4)}
    assert len(intervals) == 4  # each seed its own resamples


def test_compare_takes_the_tidy_frame_and_names_it_when_given_raw_runs():
    raw = frame(*repeats("a100", [1000, 1001]), *repeats("h200", [2000, 2001]))
    with pytest.raises(CompareError, match=r"not a tidy runs frame.*tidy\(\)"):
        compare_gpus(raw, "a100")
    assert only(compare_gpus(tidy(raw), "a100").table, gpu="h200")["speedup"] == pytest.approx(2000.5 / 1000.5)


# ------------------------------------------------------------------------ scaling and gains


def test_scaling_efficiency_hand_computed():
    df = runs(
        *repeats("h200", [1000, 1000], task="train", nproc=1),
        *repeats("h200", [1900], task="train", nproc=2),
        *repeats("h200", [3600, 3700, 3500], task="train", nproc=4),
        *repeats("a100", [500, 510], task="train"),  # no multi-process runs: not a scaling group
        *repeats("h200", [800], task="train", nproc=2, model="vit_base_patch16_224"),  # no nproc=1
    )
    s = compare_gpus(df, baseline="h200").scaling
    deit = s[s["model"] == "deit_small_patch16_224"].set_index("nproc")
    assert list(deit.index) == [1, 2, 4]
    assert deit.loc[1, "efficiency"] == pytest.approx(1.0)
    assert deit.loc[2, "efficiency"] == pytest.approx(1900 / (2 * 1000))  # 0.95
    assert deit.loc[4, "efficiency"] == pytest.approx(3600 / (4 * 1000))  # 0.90
    assert deit.loc[4, "speedup_vs_1"] == pytest.approx(3.6)
    assert deit.loc[4, "n_runs"] == 3
    assert "a100" not in set(s["gpu"])
    vit = s[s["model"] == "vit_base_patch16_224"]
    assert len(vit) == 1 and math.isnan(vit.iloc[0]["efficiency"])


def test_runs_granted_different_cpus_scale_apart_and_the_scaling_table_says_which():
    def granted(cpus, rows):
        return [{**r, "tags.cpus_granted": str(cpus), "tags.torch_threads": str(cpus)} for r in rows]

    df = runs(*granted(1, repeats("h200", [100, 100], task="train", nproc=1) + repeats("h200", [150], task="train",
                                                                                         nproc=2)),
              *granted(16, repeats("h200", [1000, 1000], task="train", nproc=1) + repeats("h200", [1900], task="train",
                                                                                            nproc=2)))
    c = compare_gpus(df)
    s = c.scaling.set_index(["cpus_granted", "nproc"])
    assert s.loc[(1, 2), "efficiency"] == pytest.approx(0.75) and s.loc[(16, 2), "efficiency"] == pytest.approx(0.95)
    scaling = format_table(c).split("scaling (train")[1]
    assert "cpus" in scaling.splitlines()[1] and "threads" in scaling.splitlines()[1], scaling


def test_ddp_settings_are_separate_configurations_that_scale_from_the_same_single_process_runs():
    df = runs(
        *repeats("h200", [1000, 1000], task="train", nproc=1, ddp=(25, False)),
        *repeats("h200", [1000], task="train", nproc=1, ddp=(100, True)),  # no DDP in 1 process: same config
        *repeats("h200", [1800], task="train", nproc=2),  # logged before the settings existed: torch defaults
        *repeats("h200", [1800], task="train", nproc=2, ddp=("25.0", False)),
        *repeats("h200", [1960, 1940], task="train", nproc=2, ddp=(100, True)),
        *repeats("h200", [1980], task="train", nproc=2, ddp=(25, False), ddp_comm_hook="bf16"),
    )
    table = compare_gpus(df).table
    assert sorted(table["ddp"]) == ["-", "bucket100+static", "bucket25", "bucket25+bf16"]
    assert only(table, ddp="-")["n_runs"] == 3
    assert only(table, ddp="bucket25")["n_runs"] == 2
    s = compare_gpus(df).scaling.set_index("ddp")
    assert list(s["nproc"]) == [1, 2, 2, 2]
    assert s.loc["bucket25", "efficiency"] == pytest.approx(1800 / 2000)
    assert s.loc["bucket100+static", "efficiency"] == pytest.approx(1950 / 2000)
    assert s.loc["bucket100+static", "n_runs"] == 2
    assert s.loc["bucket25+bf16", "efficiency"] == pytest.approx(0.99)
    assert "bucket100+static" in format_table(compare_gpus(df))


def test_nccl_variables_that_differ_between_ddp_runs_are_part_of_their_configuration():
    """The nccl_env tag as vitreg logs it: a variable set in some DDP runs and not others (or set to
    other values) is a configuration of its own; one every DDP run shares (NCCL_VERSION, or the
    TORCH_NCCL_* setting every graphed run makes) and the 1-process runs' variables are not shown."""
    def tagged(thr, nproc, env):
        row = run("h200", thr, task="train", nproc=nproc, ddp=(25, False))
        row["tags.nccl_env"] = env
        return row
    common = "NCCL_VERSION=2.28.3-1;TORCH_NCCL_ASYNC_ERROR_HANDLING=0"
    df = runs(
        tagged(1000, 1, "NCCL_VERSION=2.28.3-1"),
        tagged(1000, 1, "NCCL_MAX_CTAS=8;NCCL_VERSION=2.28.3-1"),  # no DDP in 1 process: same config
        tagged(1900, 2, common), tagged(1920, 2, common),
        tagged(1940, 2, "NCCL_MAX_CTAS=8;" + common),
        tagged(1800, 2, "NCCL_ALGO=Ring;NCCL_MAX_CTAS=2;" + common),
    )
    s = compare_gpus(df).scaling.set_index("ddp")
    assert list(s.index) == ["-", "bucket25", "bucket25+NCCL_ALGO=Ring+NCCL_MAX_CTAS=2", "bucket25+NCCL_MAX_CTAS=8"]
    assert s.loc["-", "n_runs"] == 2
    assert s.loc["bucket25", "n_runs"] == 2 and s.loc["bucket25", "efficiency"] == pytest.approx(0.955)
    assert s.loc["bucket25+NCCL_MAX_CTAS=8", "efficiency"] == pytest.approx(0.97)
    same = runs(tagged(1000, 1, ""), tagged(1900, 2, "NCCL_MAX_CTAS=8;" + common),
                 tagged(1920, 2, "NCCL_MAX_CTAS=8;" + common))
    assert list(compare_gpus(same).scaling["ddp"]) == ["-", "bucket25"]


def test_ddp_runs_whose_params_hold_the_requested_img_size_scale_from_the_resolved_one():
    """A DDP launcher logs the params before any rank builds the model: params.img_size=0 ("the
    model's default") next to the resolved tags.img_size=224 that the 1-process run also has."""
    one = run("h200", 1000, task="train", nproc=1)
    one["tags.img_size"] = "224"
    two = run("h200", 1940, task="train", nproc=2, img=0)
    two["tags.img_size"] = "224"
    s = compare_gpus(runs(one, two)).scaling.set_index("nproc")
    assert list(s.index) == [1, 2] and s.loc[2, "img_size"] == 224
    assert s.loc[2, "efficiency"] == pytest.approx(0.97)


def test_multi_host_runs_scale_by_their_world_size_not_the_per_host_nproc():
    two_hosts = run("h200", 3800, task="train", nproc=2)  # 2 processes on each of 2 hosts
    two_hosts["tags.world_size"] = "4"
    via_params = run("h200", 3700, task="train", nproc=2)  # logged by `mlflow run -P nnodes=2`, no tag
    via_params["params.nnodes"] = "2"
    df = runs(*repeats("h200", [1000], task="train", nproc=1), two_hosts, via_params,
               *repeats("h200", [1900], task="train", nproc=2))
    s = compare_gpus(df).scaling.set_index("nproc")
    assert list(s.index) == [1, 2, 4]
    assert s.loc[4, "n_runs"] == 2 and s.loc[4, "efficiency"] == pytest.approx(3750 / 4000)
    assert s.loc[2, "efficiency"] == pytest.approx(0.95)


def test_cuda_graph_runs_are_their_own_configuration_and_scale_from_graphed_single_process_runs():
    def graphed(rows, value="true"):
        for r in rows:
            r["params.cuda_graph"] = value
        return rows

    df = runs(
        *repeats("h200", [5000, 5200], task="train", nproc=1),  # before the option existed: plain
        *repeats("h200", [7800], task="train", nproc=2),
        *graphed(repeats("h200", [9000, 9200], task="train", nproc=1)),
        *graphed(repeats("h200", [17900], task="train", nproc=2)),
        *graphed(repeats("h200", [5100], task="train", nproc=1), "false"),
    )
    table = compare_gpus(df).table
    assert sorted(set(table["compile"])) == ["off", "off+cudagraph"]
    s = compare_gpus(df).scaling.set_index(["compile", "nproc"])
    assert s.loc[("off+cudagraph", 2), "efficiency"] == pytest.approx(17900 / (2 * 9100))
    assert s.loc[("off", 2), "efficiency"] == pytest.approx(7800 / (2 * 5100))  # median of 5000, 5100, 5200
    gains = compile_amp_gains(df).set_index(["change", "nproc"])["speedup"]
    assert gains[("compile=off+cudagraph", 1)] == pytest.approx(9100 / 5100)
    assert "off+cudagraph" in format_table(compare_gpus(df))


def test_compile_and_amp_gains():
    df = runs(
        *repeats("h200", [1000, 1000], amp="off", compile="off"),
        *repeats("h200", [1300, 1300], amp="off", compile="max-autotune"),
        *repeats("h200", [2000, 2000], amp="bf16", compile="off"),
        *repeats("h200", [2600], amp="bf16", compile="max-autotune"),
        *repeats("a100", [700], amp="bf16", compile="off"),  # nothing to pair with on a100
    )
    g = compile_amp_gains(df).set_index(["change", "held"])["speedup"]
    assert g[("compile=max-autotune", "amp=off")] == pytest.approx(1.3)
    assert g[("compile=max-autotune", "amp=bf16")] == pytest.approx(1.3)
    assert g[("amp=bf16", "compile=off")] == pytest.approx(2.0)
    assert g[("amp=bf16", "compile=max-autotune")] == pytest.approx(2.0)
    assert g[("amp=bf16+compile=max-autotune", "-")] == pytest.approx(2.6)
    assert len(g) == 5
    assert compile_amp_gains(df)["gpu"].eq("h200").all()


# ------------------------------------------------------------------------------ formatting


def _mixed_comparison():
    df = runs(
        *repeats("a100", [1000, 1012, 994], amp="off"), *repeats("h200", [2010, 1992, 2005], amp="off"),
        *repeats("a100", [2000, 2020], amp="bf16"), *repeats("h200", [4100, 4080], amp="bf16"),
        *repeats("a100", [2500], amp="bf16", compile="max-autotune"),
        *repeats("h200", [3900], amp="fp16"),
    )
    return compare_gpus(df, baseline="a100")


def test_format_table_is_aligned_and_moves_constants_to_a_header():
    text = format_table(_mixed_comparison())
    lines = text.splitlines()
    assert any(l.startswith("fixed:") and "batch_size=64" in l and "task=infer" in l for l in lines)
    header = next(l for l in lines if l.lstrip().startswith("model"))
    assert "speedup" in header and "verdict" in header and "batch" not in header
    body = lines[lines.index(header):]
    rule = body[1]
    assert set(rule) <= {"-", " "}
    # Every row ends its right-aligned columns where the rule's dashes end.
    ends = [i for i in range(len(rule)) if rule[i] == "-" and (i + 1 == len(rule) or rule[i + 1] == " ")]
    median_end = ends[header.split().index("median")]
    for row in body[2:]:
        assert row[median_end] != " " and (median_end + 1 >= len(row) or row[median_end + 1] == " ")
    assert "faster" in text and "no baseline" in text and "single run" not in text


def test_write_report_files_exist_and_round_trip(tmp_path):
    c = _mixed_comparison()
    out = tmp_path / "report"
    paths = write_report(c, out)
    names = {p.name for p in paths}
    assert {"comparison.md", "comparison.csv", "comparison.html", "throughput_by_gpu.png",
            "compile_amp_gains.png"} <= names
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temp dir left behind

    back = pd.read_csv(out / "comparison.csv")
    pd.testing.assert_frame_equal(back, c.table, check_dtype=False)

    for png in ("throughput_by_gpu.png", "compile_amp_gains.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "comparison.md").read_text()
    first_table = md.split("## Per configuration and GPU")[1].split("##")[0]
    header = next(l for l in first_table.splitlines() if l.startswith("|"))
    shown = [h.strip() for h in header.strip("|").split("|")]
    # What the MLflow UI's preview shows first: the GPU, the figure with its unit, the ratio, the verdict;
    # then only what varies (amp, compile) and the runs: the shared configuration is a line above the table.
    assert shown == ["gpu", "throughput_img_per_s median (img/s)", "vs a100", "verdict", "95% CI", "model", "amp",
                     "compile", "runs", "cv"]
    assert "- every row: task=infer, batch_size=64, img_size=224, sdpa=auto, nproc=1" in md
    assert first_table.count("| deit\\_small\\_patch16\\_224 |") == 0  # intraword _ left as written
    assert first_table.count("| deit_small_patch16_224 |") == len(c.table)
    assert "## torch.compile and AMP gains" in md and "`throughput_by_gpu.png`" in md
    html_text = (out / "comparison.html").read_text()
    assert html_text.count("<table") >= 2 and "throughput_by_gpu.png" in html_text
    first_html = html_text.split("<table")[1]
    assert first_html.count("<th>") == len(shown) and "every row: task=infer" in html_text
    parsed = pd.read_html(str(out / "comparison.html"))[0] if _has_lxml() else None
    if parsed is not None:
        assert list(parsed.columns) == shown


def test_markdown_tables_keep_cells_whole_and_align_numbers_right():
    md = markdown_table(pd.DataFrame({"gpu": ["a|b"], "img/s": ["1,000"]}), [False, True]).splitlines()
    assert [c.strip() for c in md[0].strip("|").split("|")] == ["gpu", "img/s"]
    assert md[1].startswith("|:") and md[1].endswith(":|")  # left, then right aligned
    assert "a\\|b" in md[2] and "1,000" in md[2]  # the pipe is escaped, the number kept as written


def _has_lxml():
    try:
        import lxml  # noqa: F401
        return True
    except ImportError:
        return False


def test_write_report_without_gains_skips_that_chart(tmp_path):
    df = runs(*repeats("a100", [1000, 1001]), *repeats("h200", [2000, 2001]))
    names = {p.name for p in write_report(compare_gpus(df), tmp_path)}
    assert "compile_amp_gains.png" not in names and "throughput_by_gpu.png" in names


def test_write_report_leaves_nothing_behind_on_error(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(plots, "plot_gains", boom)
    (tmp_path / "keep.txt").write_text("unrelated")
    with pytest.raises(RuntimeError, match="plot failed"):
        write_report(_mixed_comparison(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    with pytest.raises(RuntimeError):
        write_report(_mixed_comparison(), tmp_path / "new" / "report")
    assert not (tmp_path / "new").exists()  # directories it created are gone too


# ------------------------------------------------------------------------------ timm mixing


def test_imported_timm_runs_compare_against_own_runs():
    timm = runs_frame(read_timm_csv(DATA / "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv"))
    own = frame(*repeats("h200", [15400, 15500, 15450], amp="fp16", bs=1024))
    c = compare_gpus(tidy(pd.concat([timm, own], ignore_index=True)), baseline="rtx4090")
    h = only(c.table, gpu="h200")
    assert h["sources"] == "vitreg"
    assert h["verdict"] == "single run"  # a timm file holds one measurement per model
    assert h["speedup"] == pytest.approx(15450 / 7689.02)
    assert only(c.table, gpu="rtx4090", model="deit_small_patch16_224")["sources"] == "timm"


# ------------------------------------------------------------------------------ mislabelled runs

ON_CPU = {"tags.gpu_mismatch": "true", "tags.detected_gpu": "cpu", "tags.device": "cpu", "tags.gpu_name": "none"}


def filed(gpu, values, tags=ON_CPU, **kw):
    """Runs filed under ``gpu`` that carry ``tags`` (by default: what allow_gpu_mismatch=true on a CPU logs)."""
    return [{**r, **tags} for r in repeats(gpu, values, **kw)]


def _cpu_runs_as_a100_and_h200():
    # the case: CPU runs filed as a100 and h200 look 6.7x apart (test_vit at two batch sizes, say)
    return runs(*filed("a100", [100, 101, 99], mfu=0.0001), *filed("h200", [671, 675, 668], mfu=0.0004))


def test_mislabelled_runs_get_no_speedup_or_verdict_and_no_mfu():
    c = compare_runs(_cpu_runs_as_a100_and_h200(), baseline="a100")
    assert c.table["mismatch"].all() and (c.table["ran_on"] == "cpu").all()
    assert c.table["speedup"].isna().all() and c.table["mfu"].isna().all()
    assert set(c.table["verdict"]) == {"mislabelled"}
    assert c.geomean_speedup() == {} and c.summary()["n_mislabelled_runs"] == 6
    text = format_table(c)
    assert "faster" not in text and "6.7" not in text
    assert "MISLABELLED (!): 6 run(s) filed under a GPU that did not run them: a100 (ran on cpu), h200 (ran on cpu)" in text
    assert "left out of speedups and verdicts (include_mismatch=true" in text
    assert text.count("cpu (!)") == 2  # the "ran on" column of each row


def test_include_mismatch_compares_them_marked():
    c = compare_runs(_cpu_runs_as_a100_and_h200(), baseline="a100", include_mismatch=True)
    h = only(c.table, gpu="h200")
    assert h["speedup"] == pytest.approx(6.71) and h["verdict"] == "faster (mislabelled)"
    assert only(c.table, gpu="a100")["verdict"] == "baseline (mislabelled)"
    assert math.isnan(h["mfu"])  # never against a peak the hardware does not have
    text = format_table(c)
    assert "6.71x" in text and "faster (mislabelled)" in text and "NOT their label's" in text


def test_mislabelled_reports_mark_every_table_and_chart(tmp_path):
    c = compare_runs(_cpu_runs_as_a100_and_h200(), baseline="a100", include_mismatch=True)
    write_report(c, tmp_path)
    md = (tmp_path / "comparison.md").read_text()
    assert "MISLABELLED (!)" in md and len(re.findall(r"\| cpu \(MISLABELLED\) +\|", md)) == 2
    assert len(re.findall(r"\| (baseline|faster) \(mislabelled\) +\|", md)) == 2
    assert re.search(r"\| h200 +\| +6.71x \| MISLABELLED", md)  # the geometric mean too
    html_text = (tmp_path / "comparison.html").read_text()
    assert "MISLABELLED (!)" in html_text and html_text.count("<td>cpu (MISLABELLED)</td>") == 2
    assert html_text.count("<td>MISLABELLED</td>") == 1  # the geometric mean
    back = pd.read_csv(tmp_path / "comparison.csv")
    assert back["mismatch"].all() and set(back["verdict"]) == {"baseline (mislabelled)", "faster (mislabelled)"}
    fig = plots.plot_by_gpu(c, tmp_path / "again.png")
    texts = [t.get_text() for t in fig.findobj(_text_type()) if t.get_text()]
    assert any("MISLABELLED" in t for t in texts)  # the title and the legend say so
    assert any("a100: MISLABELLED (ran on cpu)" == t for t in texts)
    assert all(p.get_hatch() == plots.MISLABELLED_HATCH for p in fig.axes[0].patches)


@pytest.mark.parametrize("tags", [
    {"tags.detected_gpu": "a100"},  # a label that is not what was detected, without the tag (older runs)
    {"tags.device": "cpu"},  # a CPU run under a GPU label
    {"tags.gpu_name": "none"},  # no CUDA device at all
    {"tags.gpu_mismatch": "true"},  # the tag alone
], ids=["detected", "device", "gpu_name", "tag"])
def test_each_sign_of_other_hardware_marks_a_run(tags):
    t = runs(*filed("h200", [2000, 2010], tags=tags), *repeats("h200", [1000, 1010]), *repeats("a100", [500, 505]))
    assert t["mismatch"].sum() == 2
    c = compare_runs(t, baseline="a100")
    honest, bad = only(c.table, gpu="h200", mismatch=False), only(c.table, gpu="h200", mismatch=True)
    assert honest["n_runs"] == 2 and honest["speedup"] == pytest.approx(2.0)  # never pooled with the bad ones
    assert bad["verdict"] == "mislabelled"


def test_honest_runs_are_not_marked():
    t = runs(*filed("cpu", [10, 11], tags={"tags.device": "cpu", "tags.detected_gpu": "cpu", "tags.gpu_mismatch": "false"}),
             *filed("h200", [900, 905], tags={"tags.device": "cuda", "tags.detected_gpu": "h200", "tags.gpu_name": "NVIDIA H200"}))
    assert not t["mismatch"].any()
    assert "MISLABELLED" not in format_table(compare_runs(t, baseline="cpu"))


def test_mislabelled_runs_stay_out_of_gains_unless_asked():
    t = runs(*filed("h200", [100, 100], amp="off"), *filed("h200", [130, 130], amp="off", compile="default"),
             *repeats("a100", [1000, 1000], amp="off"), *repeats("a100", [1200, 1200], amp="off", compile="default"))
    assert list(compile_amp_gains(t)["gpu"]) == ["a100"]
    both = compile_amp_gains(t, include_mismatch=True).set_index("gpu")
    assert bool(both.loc["h200", "mismatch"]) and both.loc["h200", "speedup"] == pytest.approx(1.3)


# ------------------------------------------------------------------------------ compare along any axis


def versions(version, values, **kw):
    return filed("h200", values, tags={"tags.torch_version": version}, **kw)


def test_compare_by_torch_version_pairs_runs_that_differ_only_in_it():
    t = tidy(frame(*versions("2.8.0", [1000, 1010, 995]), *versions("2.9.0", [1200, 1190, 1210]),
                   *versions("2.8.0", [500, 505], amp="off"), *versions("2.9.0", [498, 503], amp="off"),
                   *repeats("a100", [400, 401])),  # no torch_version tag: its own "?" value
             axes=("torch_version",))
    c = compare_runs(t, by="torch_version", baseline="2.8.0")
    assert c.values[0] == "2.8.0" and c.by == "torch_version"
    assert only(c.table, torch_version="2.9.0", amp="bf16", gpu="h200")["verdict"] == "faster"
    assert only(c.table, torch_version="2.9.0", amp="off")["verdict"] == "within noise"
    assert only(c.table, torch_version="?")["verdict"] == "no baseline"  # a100 ran under no known version
    assert c.geomean_speedup() == {"2.9.0": pytest.approx(math.sqrt(1200 / 1000 * 500.5 / 502.5), rel=1e-3)}
    text = format_table(c)
    assert "compared along: torch_version" in text and "baseline: torch_version=2.8.0" in text


def test_compare_by_a_configuration_key():
    t = runs(*repeats("h200", [1000, 1002], compile="off"), *repeats("h200", [1500, 1504], compile="default"))
    c = compare_runs(t, by="compile", baseline="off")
    assert only(c.table, compile="default")["speedup"] == pytest.approx(1502 / 1001)
    assert only(c.table, compile="default")["verdict"] == "faster"


def test_compare_by_an_axis_no_run_records_names_the_fix():
    with pytest.raises(CompareError, match="no run records 'torch_version'.*--by gpu"):
        compare_runs(runs(*repeats("a100", [1, 2])), by="torch_version")
    t = tidy(frame(*versions("2.8.0", [1, 2])), axes=("torch_version",))
    with pytest.raises(CompareError, match="baseline torch_version '2.7.0'.*torch_version values present: 2.8.0"):
        compare_runs(t, by="torch_version", baseline="2.7.0")


# ------------------------------------------------------------------------------ charts read at a glance


def _text_type():
    from matplotlib.text import Text

    return Text


def _assert_readable(fig, png: Path):
    """Every text inside the figure, plain tick numbers, and the PNG the size the figure promised."""
    import matplotlib.image

    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    drawn = fig.get_tightbbox(renderer)  # inches: everything drawn, tick labels included
    assert drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= fig.get_figwidth() + 0.01 \
        and drawn.y1 <= fig.get_figheight() + 0.01, drawn
    ticks = {id(t) for ax in fig.axes for t in ax.get_xticklabels(which="both") + ax.get_yticklabels(which="both")}
    texts = [t for t in fig.findobj(_text_type()) if t.get_visible() and t.get_text().strip() and id(t) not in ticks]
    for t in texts:
        ext = t.get_window_extent(renderer)
        assert ext.x0 >= box.x0 - 1 and ext.y0 >= box.y0 - 1 and ext.x1 <= box.x1 + 1 and ext.y1 <= box.y1 + 1, \
            (t.get_text(), ext, box)
    for ax in fig.axes:
        ticks = [t.get_text() for t in ax.get_yticklabels() + ax.get_xticklabels() if t.get_text()]
        assert ticks and not any("$" in t or "x10" in t or "×" in t or "^" in t for t in ticks), ticks
        assert ax.get_xlabel() and ax.get_ylabel() or ax.get_xlabel()
    height, width = matplotlib.image.imread(png).shape[:2]
    assert (width, height) == tuple(round(v * plots.DPI) for v in fig.get_size_inches())
    return [t.get_text() for t in texts]


def test_throughput_chart_is_readable(tmp_path):
    # ViT-Ti next to ViT-L: 30x apart (the log axis case), with a long title (a baseline and a long model name)
    df = runs(*repeats("a100", [9000, 9100], model="vit_tiny_patch16_224"),
              *repeats("h200", [16000, 16100], model="vit_tiny_patch16_224"),
              *repeats("a100", [250, 252], model="vit_large_patch16_224"),
              *repeats("h200", [450, 455], model="vit_large_patch16_224"))
    c = compare_runs(df, baseline="a100")
    fig = plots.plot_by_gpu(c, tmp_path / "by_gpu.png")
    texts = _assert_readable(fig, tmp_path / "by_gpu.png")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and "(img/s)" in ax.get_ylabel() and ax.get_xlabel().startswith("configuration")
    assert "1,000" in [t.get_text() for t in ax.get_yticklabels()]  # not 10^3
    assert {"9,050", "16,050\n1.77x", "251", "452\n1.80x"} <= set(texts)  # every bar says its value
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert len(bars) == 4 and min(p.get_height() for p in bars) / max(p.get_height() for p in bars) < 0.03
    lo, hi = ax.get_ylim()
    # on the log axis the smallest bar takes a visible share of the plot's height
    assert math.log(251 / lo) / math.log(hi / lo) > 0.15


def test_linear_chart_and_gains_chart_are_readable(tmp_path):
    c = _mixed_comparison()
    fig = plots.plot_by_gpu(c, tmp_path / "by_gpu.png")
    _assert_readable(fig, tmp_path / "by_gpu.png")
    assert fig.axes[0].get_yscale() == "linear" and fig.axes[0].get_ylim()[0] == 0
    gains = plots.plot_gains(c, tmp_path / "gains.png")
    texts = _assert_readable(gains, tmp_path / "gains.png")
    assert {f"{v:.2f}x" for v in c.gains["speedup"]} <= {t.split(" (")[0] for t in texts}
    assert gains.axes[0].get_xlabel().startswith("speedup")
    single = c.gains[c.gains[["n_base", "n_new"]].min(axis=1) < 2]  # no spread to judge: grey and said so
    assert {f"{v:.2f}x (single run)" for v in single["speedup"]} <= set(texts)
    grey = [p for p in gains.axes[0].patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:gray")]
    assert len(grey) == len(single)


# ------------------------------------------------------------------------------ the compare command


def _log_bench_like(client, exp_id, gpu, values, tags=None):
    """Runs as `vitreg bench` logs them (params, resolved tags, per-task metrics), plus ``tags``."""
    for value in values:
        rid = client.create_run(exp_id, run_name=f"test_vit-{gpu}").info.run_id
        for k, v in {"gpu": gpu, "model": "test_vit", "task": "infer", "amp": "off", "compile": "off",
                     "batch_size": "2", "img_size": "32", "nproc": "1"}.items():
            client.log_param(rid, k, v)
        for k, v in {"gpu": gpu, "amp": "off", "vitreg_job": "bench", **(tags or {})}.items():
            client.set_tag(rid, k, v)
        client.log_metric(rid, "infer_throughput_img_per_s", value)
        client.log_metric(rid, "infer_mfu", 0.0001)
        client.set_terminated(rid, "FINISHED")


def _compare_cli(*args):
    from click.testing import CliRunner

    from vitreg.cli.main import main

    result = CliRunner().invoke(main, ["compare", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_compare_command_keeps_cpu_runs_filed_as_gpus_out_of_verdicts(sqlite_store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.create_experiment("filed")
    cpu = {"gpu_mismatch": "true", "detected_gpu": "cpu", "device": "cpu", "gpu_name": "none"}
    _log_bench_like(client, exp, "a100", [100, 101, 99], cpu)
    _log_bench_like(client, exp, "h200", [671, 675, 668], cpu)
    out = _compare_cli("--experiment", "filed", "--baseline", "a100")
    assert "faster" not in out and "6.71x" not in out and "MISLABELLED (!)" in out and "mislabelled" in out
    # filed apart from the runs it compared (the benchmarks' runs list stays benchmarks), and it says where
    assert [r.data.tags.get("vitreg_job") for r in client.search_runs([exp])].count("compare") == 0
    analysis = client.get_experiment_by_name("filed/analysis").experiment_id
    (run,) = [r for r in client.search_runs([analysis]) if r.data.tags.get("vitreg_job") == "compare"]
    assert f"experiment 'filed/analysis', id {analysis}" in out and run.data.metrics["n_mislabelled_runs"] == 6
    assert not [k for k in run.data.metrics if k.startswith("speedup_geomean")]
    out = _compare_cli("--experiment", "filed", "--baseline", "a100", "--include-mismatch", "true")
    assert "6.71x" in out and "faster (mislabelled)" in out  # the compare run of the first call was not compared


def test_compare_keeps_the_experiment_s_description_current_and_its_run_lists_its_gpus(sqlite_store):
    """Issue 47: the experiment's page answers "which GPU?" on first load: its description (MLflow's
    ``mlflow.note.content``, what the UI shows as the experiment's description) is the latest cross-GPU table;
    `vitreg runs` shows the GPUs a compare run compared, not ``unknown``."""
    from click.testing import CliRunner
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    client = MlflowClient()
    exp = client.create_experiment("which")
    _log_bench_like(client, exp, "a100", [100, 101, 99])
    _log_bench_like(client, exp, "h200", [201, 203, 199])
    _compare_cli("--experiment", "which", "--baseline", "a100")
    note = client.get_experiment(exp).tags["mlflow.note.content"]
    (run,) = [r for r in client.search_runs([client.get_experiment_by_name("which/analysis").experiment_id])]
    assert "2.01x" in note and "faster" in note and "h200" in note and "a100" in note and run.info.run_id in note
    _log_bench_like(client, exp, "h200", [300, 301, 302])  # a new run, then compare again: the page follows
    _compare_cli("--experiment", "which", "--baseline", "a100")
    assert "2.01x" not in client.get_experiment(exp).tags["mlflow.note.content"]
    listed = CliRunner().invoke(main, ["runs", "--experiment", "which/analysis"]).output
    assert "a100,h200" in listed and "unknown" not in listed, listed


def test_compare_command_by_torch_version(sqlite_store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.create_experiment("upgrade")
    _log_bench_like(client, exp, "h200", [1000, 1004, 998], {"torch_version": "2.8.0"})
    _log_bench_like(client, exp, "h200", [900, 903, 897], {"torch_version": "2.9.0"})
    out = _compare_cli("--experiment", "upgrade", "--by", "torch_version", "--baseline", "2.8.0")
    assert "compared along: torch_version" in out
    row = next(line for line in out.splitlines() if line.lstrip().startswith("2.9.0") or " 2.9.0 " in line)
    assert "slower" in row and "0.90x" in row
    analysis = client.get_experiment_by_name("upgrade/analysis").experiment_id
    (run,) = [r for r in client.search_runs([analysis]) if r.data.tags.get("vitreg_job") == "compare"]
    assert run.data.params["by"] == "torch_version" and run.data.metrics["speedup_geomean_2.9.0"] == pytest.approx(0.9, rel=0.01)


def test_compare_keeps_runs_granted_different_cpus_or_threads_apart_and_says_so(sqlite_store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.create_experiment("grants")
    _log_bench_like(client, exp, "cpu", [10, 11, 12], {"cpus_granted": "1", "torch_threads": "1"})  # a SLURM child
    _log_bench_like(client, exp, "cpu", [600, 610, 620], {"cpus_granted": "16", "torch_threads": "16"})  # a Ray child
    _log_bench_like(client, exp, "cpu", [300, 310], {"cpus_granted": "16", "torch_threads": "4"})
    _log_bench_like(client, exp, "cpu", [50, 51])  # logged before the fields existed
    out = _compare_cli("--experiment", "grants")
    header = next(line for line in out.splitlines() if "median" in line and "cpus" in line)
    assert "threads" in header
    rows = {tuple(line.split()[1:3]): line.split()[4] for line in out.splitlines()
            if line.startswith("test_vit ")}  # model, cpus, threads, gpu, n, median ...
    assert rows == {("1", "1"): "3", ("16", "16"): "3", ("16", "4"): "2", ("-", "-"): "2"}, out
    assert "CPU GRANTS DIFFER (cpus/threads; rows kept apart): -/-: 2 runs, 1/1: 3 runs, 16/16: 3 runs, " \
           "16/4: 2 runs" in out
    analysis = client.get_experiment_by_name("grants/analysis").experiment_id
    (run,) = [r for r in client.search_runs([analysis]) if r.data.tags.get("vitreg_job") == "compare"]
    assert run.data.metrics["n_runs"] == 10


def test_runs_that_predate_the_grant_tags_group_and_read_as_before(sqlite_store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.create_experiment("old")
    _log_bench_like(client, exp, "cpu", [50, 51, 52])
    _log_bench_like(client, exp, "cpu", [49, 53], {"cpus_granted": "", "torch_threads": ""})
    out = _compare_cli("--experiment", "old")
    (row,) = [line.split() for line in out.splitlines() if line.startswith("test_vit ")]
    assert row[row.index("cpu") + 1] == "5" and "cpus" not in out and "GRANTS" not in out, out  # one row of 5


def test_compare_names_the_folder_of_its_files_and_the_run_s_page_in_the_ui(sqlite_store):
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from vitreg.tracking.naming import runs_page

    client = MlflowClient()
    _log_bench_like(client, client.create_experiment("where"), "h200", [1000, 1004])
    out = _compare_cli("--experiment", "where")
    analysis = client.get_experiment_by_name("where/analysis").experiment_id
    (run,) = client.search_runs([analysis])
    line = next(line for line in out.splitlines() if line.startswith(f"[vitreg] compare run {run.info.run_id}"))
    folder = Path(line.split(" files in ")[1].split(" (")[0])
    assert folder.is_absolute() and folder.name == "comparison" and (folder / "comparison.md").is_file()
    named = line.split(" (")[-1].rstrip(")").split(", ")  # each file by its path under the folder, found there
    assert "comparison.md" in named and all((folder / name).is_file() for name in named), line
    assert f"http://127.0.0.1:5000/{runs_page(analysis, run.info.run_id)}" in out  # the page, once `mlflow ui` runs


def test_auto_batch_runs_are_one_configuration_and_the_table_shows_what_each_gpu_chose():
    rows = [run("a100", 1000, bs="auto"), run("a100", 1010, bs="auto"), run("h200", 2000, bs="auto"),
            run("h200", 2020, bs="auto")]
    for row, chosen in zip(rows, ["256", "256", "512", "1024"]):
        row["tags.infer_batch_size_chosen"] = chosen
    comparison = compare_gpus(runs(*rows), baseline="a100")
    table = comparison.table.set_index("gpu")
    assert list(table["n_runs"]) == [2, 2] and table["batch_size"].isna().all()  # one configuration: auto
    assert table.loc["a100", "batch_chosen"] == "256" and table.loc["h200", "batch_chosen"] == "512/1024"
    assert table.loc["h200", "verdict"] == "faster"
    text = format_table(comparison)
    assert "batch chosen" in text and "512/1024" in text
    fixed = compare_gpus(runs(run("a100", 1000), run("h200", 2000)), baseline="a100")
    assert fixed.table["batch_chosen"].isna().all() and "batch chosen" not in format_table(fixed)


# ------------------------------------------------------------------------------ user strings stay inert

# A run name, GPU label, model or tag value as a hostile user could type it: it closes a code fence, opens
# a heading, a link, emphasis and a code span, adds a table cell, and carries HTML.
HOSTILE = "evil\n```\n# owned </td><script>alert(1)</script> | [x](javascript:alert(1)) *b* `c` _u_"


def _unescaped(text: str, char: str) -> int:
    return len(re.findall(r"(?<!\\)" + re.escape(char), text))


def test_hostile_strings_in_comparison_reports_stay_text(tmp_path):
    hostile = [{**r, "tags.torch_version": HOSTILE} for r in repeats("a100", [1000, 1010], model=HOSTILE)]
    df = tidy(frame(*hostile, *repeats("a100", [900, 905])), axes=("torch_version",))
    c = compare_runs(df, by="torch_version", baseline="?")
    write_report(c, tmp_path)
    md = (tmp_path / "comparison.md").read_text()
    assert "<script" not in md and "&lt;script&gt;" in md
    assert not [l for l in md.splitlines() if l.startswith(("```", "~~~"))]  # no fence opened or closed
    assert [l for l in md.splitlines() if l.startswith("#")] == [
        "# vitreg torch_version comparison", "## Per configuration and torch_version"]
    for line in md.splitlines():
        assert "\\[x\\](javascript" in line or "[x](" not in line  # no link, no code span, no emphasis
        if "evil" in line:
            assert _unescaped(line, "`") == _unescaped(line, "*") == 0
    table = [l for l in md.split("## Per configuration")[1].splitlines() if l.startswith("|")]
    assert len({_unescaped(l, "|") for l in table}) == 1  # the hostile pipe added no cell
    html_text = (tmp_path / "comparison.html").read_text()
    assert "<script" not in html_text and html_text.count("&lt;script&gt;") >= 2  # the axis value and the model
    assert "</td><script" not in html_text


def test_a_hostile_run_name_cannot_close_the_report_s_command_block():
    import shlex
    from types import SimpleNamespace

    from vitreg.bench.results import report_markdown
    from vitreg.bench.results import BenchResult
    from vitreg.config.spec import BenchSpec
    from vitreg.models.factory import ModelInfo

    info = ModelInfo("test_vit", "timm", 224, 16, 1000, 5.7, False)
    result = BenchResult(BenchSpec(model="test_vit"), HOSTILE, "bf16", "cpu", info, 4.6, ())
    env = SimpleNamespace(gpu_name="", gpu_count=0, gpu_memory_gb=None, compute_capability=None, driver_version=None,
                          cuda_version=None, cudnn_version=None, nccl_version=None, torch_version="2", timm_version="1",
                          torchvision_version="0", mlflow_version="3", python_version="3", os="linux", cpu_model="x",
                          cpu_count=2, hostname="h", vitreg_git_sha="abc")
    command = f"vitreg bench --run-name {shlex.quote(HOSTILE + ' ````')}"
    lines = report_markdown(result, env, command).splitlines()
    opening = next(i for i, l in enumerate(lines) if l.startswith("```"))
    fence = lines[opening]
    assert set(fence) == {"`"} and len(fence) == 5  # longer than the longest run of backticks in the command
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("`" * len(fence)))
    assert "\n".join(lines[opening + 1:closing]) == command  # the whole command inside, as typed
    rest = "\n".join(lines[closing + 1:])
    assert "<script" not in rest and "```" not in rest and lines[0].startswith("# vitreg benchmark: test_vit on evil")
    assert not [l for l in lines[closing + 1:] if l.startswith("# ")]


def test_compare_along_an_identity_option_pairs_runs_that_differ_only_in_it():
    df = runs(*[{**run("cpu", v, amp="off"), "params.sdpa": kernel}
                for kernel, v in (("auto", 30), ("auto", 31), ("math", 20), ("math", 21))],
              *[{**run("cpu", v, amp="off", bs=8), "params.sdpa": "math"} for v in (5, 6)])
    c = compare_runs(df, by="sdpa", baseline="auto")
    assert only(c.table, sdpa="math", batch_size=64)["speedup"] == pytest.approx(20.5 / 30.5)
    assert only(c.table, sdpa="math", batch_size=8)["verdict"] == "no baseline"


# ------------------------------------------------------------------------ issue 32: compare reads at a glance

_TRAIN_ONLY = ("clip_grad", "data", "num_workers", "num_classes", "distillation", "teacher")


def _trained(gpu, values, **params):
    """Train runs as `vitreg train` logs them: resolved params (num_classes=1000, no teacher) and tags."""
    rows = []
    for v in values:
        row = {**run(gpu, v, task="train"), "tags.vitreg_job": "train", "params.num_classes": "1000",
               "tags.num_classes": "1000", "params.data": "synthetic", "tags.data": "synthetic"}
        row.update({f"params.{k}": val for k, val in params.items()})
        rows.append(row)
    return rows


def _as_mlflow_run_logs(rows):
    """The same runs with the params `mlflow run` logs before vitreg starts: as typed, shell-quoted
    (``num_classes=0``: the data's classes; ``teacher=''``: none), the resolved value in the tag."""
    return [{**row, "params.num_classes": "0", "params.teacher": "''", "params.data": "synthetic"} for row in rows]


def _infer_and_train():
    return runs(*repeats("a100", [1000, 1010]), *repeats("h200", [2000, 2020]),
                *_trained("a100", [300, 303]), *_trained("h200", [600, 606]),
                *_trained("a100", [280, 282], clip_grad="1"), *_trained("h200", [560, 565], clip_grad="1"))


def test_each_task_has_its_own_table_with_only_the_columns_that_vary_within_it(tmp_path):
    c = compare_gpus(_infer_and_train(), baseline="a100")
    text = format_table(c)
    infer, train = text.split("\nfixed: ")[1:3]  # one header line and table per task
    assert infer.startswith("task=infer") and train.startswith("task=train")
    for name in _TRAIN_ONLY:  # a training option is no column (nor a "-" cell) of the inference table
        assert name not in infer, infer
    assert infer.splitlines()[1].split() == ["model", "gpu", "n", "median", "min", "max", "cv", "speedup", "95%", "CI",
                                             "verdict"]
    assert train.splitlines()[1].split()[:3] == ["model", "clip_grad", "gpu"]
    md = (tmp_path / "comparison.md")
    write_report(c, tmp_path)
    section = md.read_text().split("## Per configuration and GPU")[1].split("\n## ")[0]
    tables = [block for block in section.split("\n\n") if block.startswith("|")]
    assert len(tables) == 2 and "clip" not in tables[0] and "clip_grad" in tables[1].splitlines()[0]
    assert "| - |" not in tables[0] and "- every row: task=infer" in md.read_text()


def test_chart_labels_name_what_varies_in_their_task_and_no_placeholder():
    c = compare_gpus(_infer_and_train(), baseline="a100")
    fig = plots.plot_by_gpu(c, Path(os.devnull))
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert sorted(labels) == ["infer", "train clip_grad=0.0", "train clip_grad=1.0"], labels
    assert "configuration (task, clip_grad)" == fig.axes[0].get_xlabel()


def test_a_gpu_keeps_its_colour_in_every_chart(tmp_path):
    first = compare_gpus(runs(*repeats("a100", [1000, 1010]), *repeats("h200", [2000, 2020])))
    second = compare_gpus(runs(*repeats("h200", [2000, 2020]), *repeats("l4", [500, 505]),
                               *repeats("rtx4090", [900, 909])))

    def colours(c):
        ax = plots.plot_by_gpu(c, tmp_path / "chart.png").axes[0]
        return {bars.get_label(): bars.patches[0].get_facecolor() for bars in ax.containers if hasattr(bars, "patches")}

    one, two = colours(first), colours(second)
    assert one["h200"] == two["h200"] and len({*one.values(), *two.values()}) == 4  # and four GPUs, four colours
    assert plots.gpu_colour("H200") == plots.gpu_colour("h200") == plots.gpu_colour("h200")


def test_as_typed_and_resolved_params_are_one_configuration_and_no_cell_is_a_lone_quote(tmp_path):
    typed = _as_mlflow_run_logs(_trained("a100", [300, 303]) + _trained("h200", [600, 606]))
    resolved = _trained("a100", [301]) + _trained("h200", [603])
    t = tidy(frame(*typed, *resolved))
    assert set(t["num_classes"]) == {"1000"} and set(t["teacher"]) == {""}
    c = compare_gpus(t, baseline="a100")
    assert len(c.table) == 2 and list(c.table["n_runs"]) == [3, 3], c.table
    for text in (format_table(c), *(p.read_text() for p in write_report(c, tmp_path) if p.suffix in (".md", ".html"))):
        assert "''" not in text and not re.search(r'(^|[\s|>])"([\s|<]|$)', text), text
    # a run that asked for other classes did other work: never pooled with them
    ten = [{**row, "params.num_classes": "10", "tags.num_classes": "10"} for row in _trained("h200", [900, 909])]
    table = compare_gpus(tidy(frame(*typed, *resolved, *ten)), baseline="a100").table
    assert sorted(table["num_classes"]) == ["10", "1000", "1000"]


def test_a_quoted_param_reads_as_the_value_it_stands_for():
    (quoted,), (plain,) = _trained("a100", [300], data="'/data/my set'"), _trained("a100", [303], data="/data/my set")
    assert set(tidy(frame(quoted, plain))["data"]) == {"/data/my set"}
    (odd,) = _trained("a100", [300], data="'unclosed")  # not MLflow's quoting: as logged
    assert set(tidy(frame(odd))["data"]) == {"'unclosed"}
