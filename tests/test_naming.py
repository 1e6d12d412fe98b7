"""vitreg.tracking.naming: run names that read in the MLflow runs list, and the run's note (its description)."""

from __future__ import annotations

import json
import re

import pytest

from vitreg.bench import results as report
from vitreg.bench.results import BenchResult, TaskResult
from vitreg.config.spec import BenchSpec
from vitreg.measure.figures import Figures, Work
from vitreg.measure.metrics import ITERATION_TIME
from vitreg.models.factory import ModelInfo
from vitreg.tracking.naming import (NBSP, NOTE_TAG, RunTitle, analysis_experiment, check_run_name, compare_note,
                                   compare_run_name, rate, results_markdown, run_note, runs_page, short_model,
                                   spaced_cells, sweep_run_name)


def _task(task: str, compiled: bool = True, **values) -> TaskResult:
    figures = Figures(task, {"window_img_per_s": (1200.0, 1234.5, 1250.0),
                             ITERATION_TIME[task]: (3.0, 3.0, 4.0, 5.0, 5.0), "first_call_s": 12.5, "warmup_s": 0.75,
                             "gflops_per_img": 4.6, "peak_mem_allocated_mb": 12345.6, "peak_mem_reserved_mb": 13000.0})
    figures = figures.summarized().completed(Work(compiled=compiled)).with_values(**{"mfu": 0.0123, **values})
    return TaskResult(task, 64, 224, 3, 3, figures)


def _bench(*tasks: TaskResult) -> BenchResult:
    info = ModelInfo("test_vit", "timm", 224, 16, 1000, 5.7, False)
    return BenchResult(BenchSpec(model="test_vit"), "h200", "bf16", "cuda", info, 4.6, tuple(tasks))


@pytest.mark.parametrize("model,short", [
    ("vit_base_patch16_224", "vit_b16"),
    ("deit_tiny_patch16_224", "deit_ti16"),
    ("deit3_small_patch16_384", "deit3_s16_384"),
    ("vit_large_patch14_clip_224", "vit_l14_clip"),
    ("deit_base_distilled_patch16_224", "deit_base_distilled_patch16_224"),  # nothing it knows: as is
    ("test_vit", "test_vit"),
    ("torchvision:vit_b_16", "torchvision:vit_b_16"),
])
def test_short_model_names(model, short):
    assert short_model(model) == short


def test_run_name_puts_the_gpu_and_the_figure_with_its_unit_first_then_the_workload():
    vit_b16 = RunTitle("h200", "vit_base_patch16_224", "bf16", "default", img_size=224)
    assert vit_b16.name(256) == "h200 · vit_b16 img224 · bf16 · bs256 · compile"
    assert (vit_b16.name(256, throughputs={"infer": 8635.4})
            == "h200 · 8,635 img/s infer · vit_b16 img224 · bf16 · bs256 · compile")
    assert (RunTitle("a100", "deit_small_patch16_224", "off", "max-autotune", nproc=2, cuda_graph=True, img_size=384)
            .name(64, throughputs={"infer": 3000.0, "train": 1000.4})
            == "a100 · 3,000 img/s infer · 1,000 img/s train · deit_s16 img384 · fp32 · bs64 · max-autotune"
               " · cudagraph · x2")
    assert (RunTitle("cpu", "test_vit", "off", img_size=32).name(2, throughputs={"infer": 6.0708})
            == "cpu · 6.07 img/s infer · test_vit img32 · fp32 · bs2")
    assert RunTitle("cpu", "test_vit", "off").name(2) == "cpu · test_vit · fp32 · bs2"  # size not known yet


def test_a_train_run_carries_its_throughput_and_a_mislabelled_run_says_what_ran_it():
    assert (RunTitle("cpu", "deit_tiny_patch16_224", "off", job="train", img_size=224).name(64)
            == "cpu · train · deit_ti16 img224 · fp32 · bs64")
    mislabelled = RunTitle("a100", "deit_tiny_patch16_224", "off", job="train", ran_on="cpu", img_size=224)
    assert (mislabelled.name(64, throughputs={"train": 25.23})
            == "a100≠cpu · 25.2 img/s train · deit_ti16 img224 · fp32 · bs64")
    assert RunTitle("a100", "test_vit", "off", ran_on="a100").name(2) == "a100 · test_vit · fp32 · bs2"  # no mismatch


# The runs list of MLflow 3.17 cuts a name to its 146-px column: 20-24 characters of these names are shown
# (tests/test_ui.py checks it on screen in Chromium). What answers "which GPU, how fast" must sit within 20
# (issue 47: `deit_ti16 img224 · cpu · i...` cut the figure, the one thing the name is for).
@pytest.mark.parametrize("gpu", ["h200", "a100≠cpu", "rtx4090"])
def test_the_first_20_characters_hold_the_gpu_and_the_figure(gpu):
    label, _, ran_on = gpu.partition("≠")
    for throughputs in ({"infer": 8635.4}, {"infer": 3.58, "train": 1.3}, {"train": 25.2}):
        shown = RunTitle(label, "vit_large_patch14_clip_224", "bf16", ran_on=ran_on or None,
                         img_size=224).name(256, throughputs=throughputs)[:20]
        figure = rate(next(iter(throughputs.values())))
        assert shown.startswith(f"{gpu} · {figure} img"), shown


def test_sweep_parents_and_check_runs_are_named_by_what_they_did():
    axes = {"amp": ["off", "bf16"], "batch_size": ["4", "8"], "compile": ["off"]}
    assert (sweep_run_name(axes, {"model": "deit_tiny_patch16_224", "img_size": 224}, 4)
            == "sweep deit_ti16 img224 · amp×batch_size · 4 runs")
    assert sweep_run_name({"model": ["a", "b"]}, {}, 2) == "sweep 2 models · model · 2 runs"
    assert sweep_run_name({"amp": ["bf16"]}, {"model": "test_vit"}, 1) == "sweep test_vit · 1 run"
    assert check_run_name("ci", "regressed") == "check · ci · regressed"


def test_compare_and_check_runs_are_filed_apart_and_links_open_the_runs_list():
    assert analysis_experiment("laptop") == "laptop/analysis"
    # MLflow 3 opens on its GenAI layout unless the page asks for the "Model training" one
    assert runs_page("3") == "#/experiments/3/runs?workflowType=machine_learning"
    assert runs_page("3", "abc") == "#/experiments/3/runs/abc?workflowType=machine_learning"


def test_compare_runs_are_named_by_what_they_compare_and_described():
    summary = {"by": "gpu", "baseline": "a100", "n_runs": 6, "n_mislabelled_runs": 1, "metric": "throughput_img_per_s",
               "n_configurations": 1, "verdicts": {"faster": 1}}
    assert compare_run_name("laptop", summary) == "compare gpu vs a100 · laptop · 6 runs · 1 mislabelled"
    plain = {**summary, "by": "torch_version", "baseline": None, "n_mislabelled_runs": 0}
    assert compare_run_name("upgrade", plain) == "compare torch_version · upgrade · 6 runs"
    note = compare_note("laptop", summary, "gpu  img/s\na100  10\nh200  20")
    assert note.startswith("**throughput_img_per_s** of experiment **laptop** along **gpu**, against `a100`: 6 runs")
    assert "1 mislabelled" in note and "faster" in note and "h200  20" in note and "comparison.md" in note
    # first what answers the question: an experiment's description shows one line until opened (issue 47)
    best = compare_note("laptop", {**summary, "best": {"h200": 1}, "geomean_speedup": {"h200": 2.0}}, "t")
    assert best.startswith("best gpu: **h200** in 1 of 1 configuration; geomean **h200** 2.00x **a100**.\n\n**thr")


def test_one_run_is_one_run_not_1_runs(sqlite_store):
    from mlflow.tracking import MlflowClient

    from vitreg.history.check import verdict_line
    from vitreg.tracking.search import experiment_links

    one = {"by": "gpu", "baseline": None, "n_runs": 1, "n_mislabelled_runs": 0, "metric": "throughput_img_per_s",
           "n_configurations": 1, "verdicts": {}}
    assert compare_run_name("laptop", one) == "compare gpu · laptop · 1 run"
    assert ": 1 run, 1 configuration." in compare_note("laptop", one, "gpu  img/s\ncpu  9")
    client = MlflowClient()
    experiment_id = client.create_experiment("laptop")
    client.create_run(experiment_id)
    ui = "http://127.0.0.1:5000"
    assert experiment_links(sqlite_store, ui) == [f"laptop (1 run): {ui}/{runs_page(experiment_id)}"]
    row = {"ratio": 0.9, "ci_low": 0.8, "ci_high": 0.95, "threshold": 0.02, "history_runs": "abc", "candidate_runs": "new",
           "cause": "", "verdict": "regressed", "series": "deit_ti16 infer", "gpu": "cpu"}
    assert "; new vs 1 run (abc..abc)" in verdict_line(row)


def test_note_holds_the_report_table_from_the_results_dict():
    result = _bench(_task("infer"), _task("train", compiled=False, mfu=None))
    as_json = json.loads(json.dumps(result.to_dict()))  # as results.json holds it
    table = results_markdown(as_json)
    assert table.splitlines()[0].startswith("| task ") and "img/s median (min-max)" in table
    # the same cells as report.md's table: one writer for both
    assert [row[:3] for row in report._rows(result)] == [["infer", "64", "1,234.5 (1,200.0-1,250.0)"],
                                                         ["train", "64", "1,234.5 (1,200.0-1,250.0)"]]
    for row in report._rows(result):
        assert all(cell in table for cell in row)
    note = run_note(as_json)
    assert note.startswith("**test_vit** on **h200** (cuda, precision bf16): infer **1,234 img/s**; train **1,234 img/s**")
    assert spaced_cells(table) in note
    assert "report.md" in note and "MISLABELLED" not in note and "1.2%" in note  # MFU of the infer row
    assert NOTE_TAG == "mlflow.note.content"


def test_note_of_a_mislabelled_run_says_so_and_has_no_mfu():
    note = run_note(_bench(_task("infer")).to_dict(), ran_on="cpu")
    assert note.splitlines()[2].startswith("**MISLABELLED**: filed as `h200` but ran on `cpu`")
    assert "1.2%" not in note and "1,234.5" in note


def test_the_notes_table_keeps_its_cells_apart_where_mlflow_renders_it():
    """MLflow's run page draws a description's table without padding and collapses spaces: `1.7%4.00 / 5.00`.
    Every cell gets a no-break space each side; the header separator stays, the blank lines around it too."""
    note = run_note(_bench(_task("infer")).to_dict())
    lines = note.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("|"))
    header, separator, row = lines[at:at + 3]
    assert lines[at - 1] == "" and re.fullmatch(r"(\|:?-+:?)+\|", separator)
    assert header.startswith(f"| {NBSP}task{NBSP} | {NBSP}batch{NBSP} |")
    assert row.startswith(f"| {NBSP}infer{NBSP} | {NBSP}64{NBSP} | {NBSP}1,234.5 (1,200.0-1,250.0){NBSP} |")
    cells = [c for c in row.split("|")[1:-1]]
    assert len(cells) == len(header.split("|")[1:-1]) and all(c.startswith(f" {NBSP}") and c.endswith(f"{NBSP} ")
                                                             for c in cells)
    assert spaced_cells("| a \\| b | c |") == f"| {NBSP}a \\| b{NBSP} | {NBSP}c{NBSP} |"  # an escaped bar is text


def test_a_run_measured_beside_other_load_says_so_in_its_name(sqlite_store, monkeypatch):
    """Issue 38: a figure measured on a busy host is flagged where it is read, the run's name too (after the
    figures: the GPU and the figure still lead the runs list's ~20 characters)."""
    import mlflow

    from vitreg.bench.job import bench
    from vitreg.measure import energy

    monkeypatch.setattr(energy, "BUSY_CPUS", -1.0)  # any load beside the run makes the host busy
    monkeypatch.setattr(energy, "BUSY_SHARE", -1.0)
    bench(dict(model="test_vit", img_size=32, task="infer", batch_size=2, warmup=1, steps=2, repeats=2,
               device="cpu"), experiment="flags")
    (name,) = mlflow.search_runs(experiment_names=["flags"])["tags.mlflow.runName"]
    assert re.match(r"cpu · [\d.,]+ img/s infer · test_vit img32 · ", name) and " · busy host" in name, name
