"""vitreg.tracking.naming: run names that read in the MLflow runs list, and the run's note (its description)."""

from __future__ import annotations

import json

import pytest

from vitreg.bench import report
from vitreg.bench.results import BenchResult, TaskResult
from vitreg.config.spec import BenchSpec
from vitreg.measure.figures import Figures, Work
from vitreg.measure.metrics import ITERATION_TIME
from vitreg.models.factory import ModelInfo
from vitreg.tracking.naming import NOTE_TAG, run_name, run_note, results_markdown, short_model


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


def test_run_name_puts_the_gpu_first_and_the_throughput_second():
    assert run_name("h200", "vit_base_patch16_224", "bf16", 256, "default") == "h200 · vit_b16 · bf16 · bs256 · compile"
    assert (run_name("h200", "vit_base_patch16_224", "bf16", 256, "default", throughputs={"infer": 8635.4})
            == "h200 · 8,635 img/s · vit_b16 · bf16 · bs256 · compile")
    assert (run_name("a100", "deit_small_patch16_224", "off", 64, "max-autotune", nproc=2, cuda_graph=True,
                     throughputs={"infer": 3000.0, "train": 1000.4})
            == "a100 · infer 3,000 · train 1,000 img/s · deit_s16 · fp32 · bs64 · max-autotune · cudagraph · x2")
    assert run_name("cpu", "test_vit", "off", 2, throughputs={"infer": 6.0708}) == "cpu · 6.07 img/s · test_vit · fp32 · bs2"


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
