"""vitreg.analysis.timm_benchmark against timm benchmark.py's real CSV layout and file naming."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vitreg.analysis.timm_benchmark import (
    ImportedRun,
    TimmImportError,
    parse_timm_filename,
    read_timm_csv,
)
from vitreg.tracking.search import runs_frame, tidy

DATA = Path(__file__).parent / "data"
INFER = DATA / "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv"
TRAIN = DATA / "benchmark-train-amp-nchw-pt240-cu124-rtx4090.csv"

# Header timm writes for `--bench both` when a FLOP counter is installed.
BOTH_HEADER = ("model,infer_img_size,infer_samples_per_sec,infer_step_time,infer_batch_size,"
               "infer_gmacs,infer_macts,train_samples_per_sec,train_step_time,train_batch_size,"
               "train_img_size,param_count")


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text.strip() + "\n")
    return p


# ------------------------------------------------------------------------------ file names


@pytest.mark.parametrize("name, expected", [
    ("benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv",
     dict(task="infer", amp="fp16", precision="amp", layout="nchw", torch_version="2.4.0",
          cuda="12.4", gpu="rtx4090", cpu=None, compile="off")),
    ("benchmark-train-amp-nhwc-pt112-cu113-rtx3090.csv",
     dict(task="train", amp="fp16", layout="nhwc", torch_version="1.12", cuda="11.3", gpu="rtx3090")),
    ("benchmark-infer-amp_bf16-nchw-pt291-cu130-pro6000maxq-dynamo.csv",
     dict(task="infer", amp="bf16", precision="amp_bf16", torch_version="2.9.1", cuda="13.0",
          gpu="pro6000maxq", compile="default")),
    ("benchmark-infer-amp-nchw-pt291-cu128-4090.csv",  # newer files drop the "rtx"
     dict(gpu="rtx4090", cuda="12.8")),
    ("benchmark-infer-fp32-nchw-pt240-cpu-i7_12700h-dynamo.csv",
     dict(amp="off", precision="fp32", cuda=None, gpu="cpu", cpu="i7_12700h", compile="default")),
    ("benchmark-infer-bf16-nchw-pt291-cu130-pro6000maxq-dynamo.csv",
     dict(amp="bf16", precision="bf16")),
    ("benchmark-infer-amp-nchw-pt110-cu113-rtx3090.csv", dict(torch_version="1.10")),
    ("benchmark-infer-amp-nchw-pt210-cu121-rtx3090.csv", dict(torch_version="2.1.0", cuda="12.1")),
    ("/some/dir/BENCHMARK-INFER-AMP-NCHW-PT240-CU124-RTX4090.CSV", dict(task="infer", gpu="rtx4090")),
])
def test_parse_timm_filename(name, expected):
    got = parse_timm_filename(name)
    for key, value in expected.items():
        assert got[key] == value, key


def test_parse_timm_filename_of_other_names_is_all_none():
    got = parse_timm_filename("results.csv")
    assert set(got.values()) == {None}
    assert set(got) >= {"task", "amp", "torch_version", "cuda", "gpu"}


# --------------------------------------------------------------------------------- reading


def test_read_infer_fixture_maps_columns_to_vitreg_names():
    runs = read_timm_csv(INFER)
    assert len(runs) == 7 and all(isinstance(r, ImportedRun) for r in runs)
    deit = next(r for r in runs if r.params["model"] == "deit_small_patch16_224")
    assert deit.params == {
        "model": "deit_small_patch16_224", "task": "infer", "batch_size": "1024", "img_size": "224",
        "amp": "fp16", "compile": "off", "gpu": "rtx4090", "nproc": "1",
    }
    assert deit.metrics == {
        "infer_throughput_img_per_s": 7689.02,
        "infer_latency_ms_p50": 133.127,  # ms per batch of 1024, as timm measured it
        "fwd_gflops_per_img": pytest.approx(2 * 4.61),
    }
    assert deit.tags["source"] == "timm"
    assert deit.tags["gpu"] == "rtx4090" and deit.tags["amp"] == "fp16"
    assert deit.tags["timm_file"] == INFER.name
    assert deit.tags["torch_version"] == "2.4.0" and deit.tags["cuda_version"] == "12.4"
    assert deit.tags["timm_precision"] == "amp" and deit.tags["timm_layout"] == "nchw"
    assert deit.tags["timm_step_time"] == "mean"
    assert deit.run_name == "timm-deit_small_patch16_224-infer-rtx4090"
    assert all(isinstance(v, str) for r in runs for v in {**r.params, **r.tags}.values())
    assert next(r for r in runs if r.params["model"] == "vit_large_patch16_224").params["batch_size"] == "512"


def test_read_train_fixture():
    runs = read_timm_csv(TRAIN)
    vit = next(r for r in runs if r.params["model"] == "vit_base_patch16_224")
    assert vit.params["task"] == "train" and vit.params["batch_size"] == "256"
    assert vit.metrics == {"train_throughput_img_per_s": 781.36, "train_step_ms_p50": 327.539}


def test_both_rows_stay_one_run_unless_timm_shrank_a_batch(tmp_path):
    p = write(tmp_path, "benchmark-both-amp_bf16-nchw-pt240-cu124-a100.csv", f"""
{BOTH_HEADER}
deit_small_patch16_224,224,5230.1,48.9,256,4.61,11.95,1650.2,155.1,256,224,22.05
vit_large_patch16_224,224,610.4,419.3,256,59.7,43.77,190.5,671.9,128,224,304.33
""")
    runs = read_timm_csv(p)
    deit = [r for r in runs if r.params["model"] == "deit_small_patch16_224"]
    assert len(deit) == 1 and deit[0].params["task"] == "both"
    assert set(deit[0].metrics) == {"infer_throughput_img_per_s", "infer_latency_ms_p50",
                                    "fwd_gflops_per_img", "train_throughput_img_per_s",
                                    "train_step_ms_p50"}
    large = sorted((r.params["task"], r.params["batch_size"]) for r in runs
                   if r.params["model"] == "vit_large_patch16_224")
    assert large == [("infer", "256"), ("train", "128")]
    assert all(r.params["amp"] == "bf16" and r.params["gpu"] == "a100" for r in runs)


def test_imported_runs_tidy_like_tracked_runs():
    t = tidy(runs_frame(read_timm_csv(INFER) + read_timm_csv(TRAIN)))
    assert set(t["source"]) == {"timm"} and set(t["gpu"]) == {"rtx4090"}
    row = t[(t["model"] == "vit_base_patch16_224") & (t["task"] == "infer")].iloc[0]
    assert row["throughput_img_per_s"] == 2577.84 and row["latency_ms_p50"] == 397.191
    assert row["amp"] == "fp16" and row["compile"] == "off" and row["nproc"] == 1
    assert len(t[t["task"] == "train"]) == 3


# ------------------------------------------------------------------------------------ GPU


def test_gpu_disagreeing_with_file_name_names_both():
    with pytest.raises(TimmImportError) as err:
        read_timm_csv(INFER, gpu="a100")
    msg = str(err.value)
    assert "a100" in msg and "rtx4090" in msg and INFER.name in msg
    assert "\n" not in msg
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("spelling", ["rtx4090", "RTX 4090", "NVIDIA GeForce RTX 4090", "4090"])
def test_gpu_agreeing_in_another_spelling_is_accepted(spelling):
    runs = read_timm_csv(INFER, gpu=spelling)
    assert {r.params["gpu"] for r in runs} == {"rtx4090"}  # vitreg.hardware.profiles's label
    assert {r.tags["gpu"] for r in runs} == {"rtx4090"}


def test_gpu_names_map_to_vitreg_labels(tmp_path):
    p = tmp_path / "my-results.csv"
    shutil.copy(INFER, p)
    assert read_timm_csv(p, gpu="NVIDIA A100-SXM4-80GB", amp="bf16")[0].params["gpu"] == "a100-80gb"
    assert read_timm_csv(p, gpu="H200", amp="bf16")[0].params["gpu"] == "h200"


def test_file_without_gpu_in_its_name_needs_gpu_and_amp(tmp_path):
    p = tmp_path / "my-results.csv"
    shutil.copy(INFER, p)
    with pytest.raises(TimmImportError, match="pass --gpu"):
        read_timm_csv(p)
    with pytest.raises(TimmImportError, match="precision"):
        read_timm_csv(p, gpu="h200")
    runs = read_timm_csv(p, gpu="h200", amp="bf16")
    assert {(r.params["gpu"], r.params["amp"], r.params["task"]) for r in runs} == {("h200", "bf16", "infer")}
    assert "torch_version" not in runs[0].tags


# --------------------------------------------------------------------------------- errors


def test_validation_results_file_is_rejected_by_its_columns(tmp_path):
    p = write(tmp_path, "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv", """
model,top1,top1_err,top5,top5_err,param_count,img_size,crop_pct,interpolation
deit_small_patch16_224,79.86,20.14,94.97,5.03,22.05,224,0.875,bicubic
""")
    with pytest.raises(TimmImportError, match="top1, top1_err, top5, top5_err, img_size, crop_pct"):
        read_timm_csv(p)


def test_missing_required_column(tmp_path):
    p = write(tmp_path, "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv", """
model,infer_samples_per_sec,infer_batch_size,infer_img_size
deit_small_patch16_224,7689.02,1024,224
""")
    with pytest.raises(TimmImportError, match="lacks column.*infer_step_time"):
        read_timm_csv(p)


def test_profile_only_file_has_nothing_to_import(tmp_path):
    p = write(tmp_path, "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv", """
model,infer_gmacs,infer_macts,infer_batch_size,infer_img_size,param_count
deit_small_patch16_224,4.61,11.95,1,224,22.05
""")
    with pytest.raises(TimmImportError, match="neither infer_samples_per_sec nor train_samples_per_sec"):
        read_timm_csv(p)


def test_name_and_columns_disagree_on_task(tmp_path):
    p = tmp_path / "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv"
    shutil.copy(TRAIN, p)
    with pytest.raises(TimmImportError, match="task=infer in its name but has only train columns"):
        read_timm_csv(p)


def test_error_rows_are_skipped_and_bad_numbers_reported(tmp_path):
    p = write(tmp_path, "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv", """
model,infer_img_size,infer_samples_per_sec,infer_step_time,infer_batch_size,param_count,error
deit_small_patch16_224,224,7689.02,133.127,1024,22.05,
vit_huge_patch14_224,,,,,,CUDA out of memory
""")
    assert [r.params["model"] for r in read_timm_csv(p)] == ["deit_small_patch16_224"]
    bad = write(tmp_path, "benchmark-infer-amp-nchw-pt240-cu124-rtx3090.csv", """
model,infer_img_size,infer_samples_per_sec,infer_step_time,infer_batch_size
deit_small_patch16_224,224,fast,133.127,1024
""")
    with pytest.raises(TimmImportError, match="line 2: infer_samples_per_sec='fast'"):
        read_timm_csv(bad)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TimmImportError, match="not found"):
        read_timm_csv(tmp_path / "nope.csv")
    empty = tmp_path / "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv"
    empty.write_text("")
    with pytest.raises(TimmImportError, match="empty"):
        read_timm_csv(empty)
    header_only = write(tmp_path, "benchmark-train-amp-nchw-pt240-cu124-rtx4090.csv",
                        "model,train_samples_per_sec,train_step_time,train_batch_size,train_img_size")
    with pytest.raises(TimmImportError, match="no importable rows"):
        read_timm_csv(header_only)
