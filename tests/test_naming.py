"""vitreg.tracking.naming: run names that read in the MLflow runs list, and the run's note (its description)."""

from __future__ import annotations

import json

import pytest

from vitreg.bench import results as report
from vitreg.bench.results import BenchResult, TaskResult
from vitreg.config.spec import BenchSpec
from vitreg.measure.figures import Figures, Work
from vitreg.measure.metrics import ITERATION_TIME
from vitreg.models.factory import ModelInfo
from vitreg.tracking.naming import (NOTE_TAG, RunTitle, compare_note, compare_run_name, results_markdown, run_note,
                                   short_model)


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


def test_run_name_puts_the_gpu_first_then_the_figure_with_its_unit_then_the_model():
    vit_b16 = RunTitle("h200", "vit_base_patch16_224", "bf16", "default")
    assert vit_b16.name(256) == "h200 · vit_b16 · bf16 · bs256 · compile"
    assert (vit_b16.name(256, throughputs={"infer": 8635.4})
            == "h200 · infer 8,635 img/s · vit_b16 · bf16 · bs256 · compile")
    assert (RunTitle("a100", "deit_small_patch16_224", "off", "max-autotune", nproc=2, cuda_graph=True)
            .name(64, throughputs={"infer": 3000.0, "train": 1000.4})
            == "a100 · infer 3,000 img/s · deit_s16 · train 1,000 img/s · fp32 · bs64 · max-autotune · cudagraph · x2")
    assert (RunTitle("cpu", "test_vit", "off").name(2, throughputs={"infer": 6.0708})
            == "cpu · infer 6.07 img/s · test_vit · fp32 · bs2")


def test_a_train_run_carries_its_throughput_and_a_mislabelled_run_says_what_ran_it():
    assert RunTitle("cpu", "deit_tiny_patch16_224", "off", job="train").name(64) == "cpu · train · deit_ti16 · fp32 · bs64"
    mislabelled = RunTitle("a100", "deit_tiny_patch16_224", "off", job="train", ran_on="cpu")
    assert (mislabelled.name(64, throughputs={"train": 25.23})
            == "a100≠cpu · train 25.2 img/s · deit_ti16 · fp32 · bs64")
    assert RunTitle("a100", "test_vit", "off", ran_on="a100").name(2) == "a100 · test_vit · fp32 · bs2"  # no mismatch


def test_the_first_22_characters_hold_the_gpu_the_figure_and_its_unit():
    for throughputs in ({"infer": 8635.4}, {"infer": 3.58, "train": 1.3}, {"train": 25.2}):
        shown = RunTitle("h200", "vit_base_patch16_224", "bf16").name(256, throughputs=throughputs)[:24]
        task, value = next(iter(throughputs.items()))
        assert shown.startswith(f"h200 · {task} ") and "img/s" in shown, shown


def test_compare_runs_are_named_by_what_they_compare_and_described():
    summary = {"by": "gpu", "baseline": "a100", "n_runs": 6, "n_mislabelled_runs": 1, "metric": "throughput_img_per_s",
               "n_configurations": 1, "verdicts": {"faster": 1}}
    assert compare_run_name("laptop", summary) == "compare gpu vs a100 · laptop · 6 runs · 1 mislabelled"
    plain = {**summary, "by": "torch_version", "baseline": None, "n_mislabelled_runs": 0}
    assert compare_run_name("upgrade", plain) == "compare torch_version · upgrade · 6 runs"
    note = compare_note("laptop", summary, "gpu  img/s\na100  10\nh200  20")
    assert note.startswith("**throughput_img_per_s** of experiment **laptop** along **gpu**, against `a100`: 6 runs")
    assert "1 mislabelled" in note and "faster" in note and "h200  20" in note and "comparison.md" in note


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
    assert table in note
    assert "report.md" in note and "MISLABELLED" not in note and "1.2%" in note  # MFU of the infer row
    assert NOTE_TAG == "mlflow.note.content"


def test_note_of_a_mislabelled_run_says_so_and_has_no_mfu():
    note = run_note(_bench(_task("infer")).to_dict(), ran_on="cpu")
    assert note.splitlines()[2].startswith("**MISLABELLED**: filed as `h200` but ran on `cpu`")
    assert "1.2%" not in note and "1,234.5" in note
