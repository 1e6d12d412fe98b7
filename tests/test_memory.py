"""Sizes nobody can run are refused from their memory floor, before anything is allocated."""

import pytest

from vitreg.errors import VitregError
from vitreg.models.factory import create_model
from vitreg.models.memory import GIB, check_step_fits, footprint, minimum_bytes


def test_footprint_matches_the_real_model():
    fp = footprint("test_vit", 32)
    model, info = create_model("test_vit", 32)
    assert fp.params == sum(p.numel() for p in model.parameters())
    assert fp.tokens == model.pos_embed.shape[1] and fp.width == model.embed_dim and fp.depth == len(model.blocks)


def test_torchvision_footprint():
    fp = footprint("torchvision:vit_b_16", 224)
    assert (fp.tokens, fp.width, fp.depth) == (197, 768, 12) and 86e6 < fp.params < 87e6


def test_an_image_a_million_pixels_wide_is_refused_before_building():
    with pytest.raises(VitregError, match=r"img_size=1000000 has .* M parameters .* use a smaller img_size"):
        create_model("vit_base_patch16_224", 1_000_000)  # ~12 TB of position embeddings: never allocated


def test_a_batch_of_millions_is_refused_with_a_batch_that_fits():
    fp = footprint("vit_base_patch16_224")
    with pytest.raises(VitregError, match=r"batch_size=2000000, .* needs at least .* GPU 0 has 139.0 GiB free: "
                                          r"use batch_size=\d+ or less"):
        check_step_fits(fp, 2_000_000, train=True, available=139 * GIB, where="GPU 0")
    check_step_fits(fp, 256, train=True, available=139 * GIB, where="GPU 0")  # timm's default batch fits


def test_the_floor_is_below_what_a_real_step_holds():
    """The bound never refuses what runs: a real CPU training step holds more than the floor (weights,
    gradients and AdamW's moments counted from the tensors, activations from what autograd saves)."""
    import torch

    fp = footprint("test_vit", 32)
    model, _ = create_model("test_vit", 32)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 3, 32, 32)
    saved = []

    def keep(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = model(x).sum()
    loss.backward()
    opt.step()
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    held = sum(t.numel() * t.element_size() for t in tensors) + x.numel() * x.element_size() + sum(saved)
    assert 0 < minimum_bytes(fp, 8, train=True) <= held


def test_check_batch_fits_takes_a_model_info_and_the_dearer_task():
    from vitreg.models.memory import check_batch_fits

    _, info = create_model("test_vit", 32, 10)
    fp = footprint("test_vit", 32, 10)
    infer_only = minimum_bytes(fp, 64, train=False)
    check_batch_fits(info, 64, ("infer",), "cpu", available=infer_only)  # exactly the floor fits
    with pytest.raises(VitregError, match=r"train at batch_size=64, img_size=32 .* this host has"):
        check_batch_fits(info, 64, ("infer", "train"), "cpu", available=infer_only)
    with pytest.raises(VitregError, match=r"GPU 1 has"):
        check_batch_fits("vit_base_patch16_224", 10**6, ("infer",), "cuda", device_index=1, available=GIB)


def test_a_batch_in_the_millions_is_refused_by_train_before_any_step(sqlite_store):
    from click.testing import CliRunner
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    res = CliRunner().invoke(main, ["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "100000000",
                                    "--steps", "2", "--num-classes", "10", "--device", "cpu", "--experiment", "huge"])
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output[-2000:], res.exception)
    assert "error: train at batch_size=100000000" in res.output and "use batch_size=" in res.output
    c = MlflowClient()
    (run,) = c.search_runs([c.get_experiment_by_name("huge").experiment_id])
    assert run.info.status == "FAILED"


def test_nproc_beyond_the_host_is_refused_with_the_number_that_fits():
    from vitreg.models.memory import PROCESS_BASELINE_BYTES, check_nproc_fits

    fp = footprint("test_vit", 32, 10)
    check_nproc_fits(4, fp, "cuda", available=4 * (PROCESS_BASELINE_BYTES + fp.weight_bytes))
    with pytest.raises(VitregError, match=r"nproc=64 processes need at least .* free: use nproc=8 or less"):
        check_nproc_fits(64, fp, "cuda", available=8 * (PROCESS_BASELINE_BYTES + fp.weight_bytes) + 1)
    with pytest.raises(VitregError, match=r"use a smaller model"):
        check_nproc_fits(2, fp, "cpu", available=PROCESS_BASELINE_BYTES)


@pytest.mark.slow
def test_the_process_baseline_is_below_what_a_bare_torch_process_holds():
    """The floor per process stays under the unique memory of `python -c "import torch, timm"` here."""
    import subprocess
    import sys

    from vitreg.models.memory import PROCESS_BASELINE_BYTES

    code = "import psutil, torch, timm; print(psutil.Process().memory_full_info().uss)"
    uss = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert PROCESS_BASELINE_BYTES < uss


@pytest.mark.slow
@pytest.mark.parametrize("job", [["train", "--steps", "2", "--num-classes", "10"], ["bench", "--task", "train"]])
def test_nproc_far_above_the_host_is_refused_before_torchrun(sqlite_store, job):
    """`train|bench --nproc 100000 --device cpu`: refused by the launcher, one line, its run FAILED, no worker
    started."""
    from click.testing import CliRunner
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    res = CliRunner().invoke(main, [*job, "--model", "test_vit", "--img-size", "32", "--batch-size", "2",
                                    "--device", "cpu", "--nproc", "100000", "--experiment", "many"])
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output[-2000:], res.exception)
    assert "error: nproc=100000 processes need at least" in res.output
    c = MlflowClient()
    runs = c.search_runs([c.get_experiment_by_name("many").experiment_id])
    assert runs and all(r.info.status == "FAILED" for r in runs)


def test_sizes_whose_tensors_overflow_64_bits_are_one_line():
    """Found by the property test: img_size=10**10 overflowed torch's size arithmetic on the meta device."""
    with pytest.raises(VitregError, match=r"img_size=10000000000 is past torch's integer range .* use a smaller"):
        create_model("test_vit", 10**10)
    with pytest.raises(VitregError, match=r"img_size=1600000000 .* cannot be built .*overflow.*: use a smaller"):
        footprint("torchvision:vit_b_16", 1_600_000_000)  # the image fits int64, its position embedding does not


def _saved_bytes(model, x, sdpa: str) -> int:
    """Bytes autograd saves for the backward of one training forward under ``sdpa``."""
    import torch

    from vitreg.hardware.sdpa import sdpa_context

    saved = []

    def keep(t):
        saved.append(t.numel() * t.element_size())
        return t

    with sdpa_context(sdpa), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(x).sum()
    return sum(saved)


def test_the_floor_counts_attention_scores_where_they_are_materialised():
    """sdpa=math (or a model that does not fuse attention) keeps heads x tokens x tokens scores per block: the
    floor counts them, and stays below what such a real step saves; fused attention keeps none."""
    import torch

    fp = footprint("test_vit", 128, 10)  # 65 tokens
    scores = 4 * fp.heads * fp.tokens**2 * 2 * fp.depth  # batch 4, half-width bytes, every block
    assert minimum_bytes(fp, 4, train=True, sdpa="math") - minimum_bytes(fp, 4, train=True) == scores
    model, _ = create_model("test_vit", 128, 10)
    x = torch.randn(4, 3, 128, 128)
    math_saved, fused_saved = _saved_bytes(model, x, "math"), _saved_bytes(model, x, "flash")
    assert math_saved - fused_saved >= scores  # the real difference (fp32 scores, softmax and dropout kept)
    assert minimum_bytes(fp, 4, train=True, sdpa="math") - fp.weight_bytes * 4 <= math_saved + x.numel() * 4
    for block in model.blocks:
        block.attn.fused_attn = False  # timm's own q @ k.T: the footprint of such a model counts scores always
    assert _saved_bytes(model, x, "auto") >= math_saved - 1024


def test_attention_decides_the_floor_at_large_image_sizes():
    """test_vit at 4096 px: 65,537 tokens. Fused attention fits 20 GiB at batch 1; the math backend's scores
    (2 heads x 65,537^2, half-width, in each of 6 blocks: 96 GiB) cannot, refused before anything is allocated."""
    fp = footprint("test_vit", 4096, 10)
    check_step_fits(fp, 1, train=True, available=20 * GIB, where="this host")
    with pytest.raises(VitregError, match=r"train at batch_size=1, img_size=4096 needs at least 9\d\.\d GiB .* "
                                          r"use a smaller img_size"):
        check_step_fits(fp, 1, train=True, available=20 * GIB, where="this host", sdpa="math")


def test_a_batch_of_100000_is_refused_by_bench_train_before_allocation(sqlite_store):
    """test_vit (160 px) at batch 100,000: the floor counts what each block keeps for the backward (the
    residual, q, k, v, the attention output, the MLP's input and hidden), 70 GB of activations, not the
    one width per token (8 GB) that let such a batch pass to the OOM killer on a large host."""
    from click.testing import CliRunner
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    fp = footprint("test_vit", 0, 1000)
    assert minimum_bytes(fp, 100_000, train=True) > 64 * GIB  # refused on a 64 GiB host too
    res = CliRunner().invoke(main, ["bench", "--model", "test_vit", "--task", "train", "--batch-size", "100000",
                                    "--device", "cpu", "--experiment", "huge-bench"])
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output[-2000:], res.exception)
    (line,) = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert line.startswith("error: train at batch_size=100000, img_size=160") and "use batch_size=" in line
    c = MlflowClient()
    (run,) = c.search_runs([c.get_experiment_by_name("huge-bench").experiment_id])
    assert run.info.status == "FAILED"


def test_an_image_size_past_torchs_integer_range_is_one_line_from_the_cli(sqlite_store):
    from click.testing import CliRunner

    from vitreg.cli.main import main

    res = CliRunner().invoke(main, ["bench", "--model", "test_vit", "--img-size", str(10**30), "--batch-size", "1",
                                    "--device", "cpu", "--experiment", "wide"])
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output[-2000:], res.exception)
    assert f"error: img_size={10**30} is past torch's integer range" in res.output
