"""Before long work, one line with the estimate (FLOPs over this machine's measured speed) and how to make
it short; quick work says nothing."""

from __future__ import annotations

import time

import pytest
import torch
from click.testing import CliRunner

from vitreg.cli.main import main
from vitreg.config.spec import BenchSpec
from vitreg.measure import estimate
from vitreg.measure.estimate import bench_work, duration_text, estimate_line, measured_flops_per_s, train_work


def test_the_probe_measures_what_a_matmul_takes_here(monkeypatch):
    """The probe's rate is 2 n^3 FLOPs over its fastest n x n product (a wrong FLOP count is off by 2**k or
    n). Each product runs for real and takes a known time on a clock of the test's own (the probe reads
    ``time.perf_counter``), so the rate is exact whatever the machine's load."""
    clock, products = {"now": 0.0}, []
    takes_s = iter([0.009, 0.004, 0.002, 0.003])  # the warm-up, then the three timed ones: the best is 2 ms
    real_matmul = torch.Tensor.__matmul__

    def timed_matmul(a, b):
        products.append((tuple(a.shape), tuple(b.shape)))
        clock["now"] += next(takes_s)
        return real_matmul(a, b)

    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(torch.Tensor, "__matmul__", timed_matmul)
    rate = measured_flops_per_s("cpu", n=256)
    monkeypatch.undo()
    assert products == [((256, 256), (256, 256))] * 4
    assert rate == pytest.approx(2 * 256**3 / 0.002)


def test_the_work_of_a_gpu_sized_bench_is_its_images_times_its_flops():
    spec = BenchSpec(model="vit_base_patch16_224", batch_size=256, warmup=10, steps=30, repeats=5, task="both")
    work = bench_work(spec, fwd_flops=35e9, train_flops=105e9, device="cpu")
    assert work.images == 256 * (10 + 30 * 5) and work.flops_per_img == 140e9
    infer_auto = bench_work(BenchSpec(model="test_vit", task="infer"), 1e9, 3e9, "cpu")
    assert infer_auto.flops_per_img == 1e9 and infer_auto.images == 64 * (10 + 30 * 5)  # auto: the search's top
    assert train_work(64, 100, 3e9).images == 6400


def test_long_work_gets_the_estimate_and_the_short_options_and_quick_work_nothing():
    spec = BenchSpec(model="vit_base_patch16_224", batch_size=256, task="both")
    line = estimate_line(bench_work(spec, 35e9, 105e9, "cpu"), flops_per_s=50e9, device="cpu", compiling=True)
    assert line.startswith("estimate: bench will take at least 32 h on this CPU"), line
    assert "compiling comes on top" in line and "for a short run: --model deit_tiny_patch16_224 --batch-size 8" in line
    small = BenchSpec(model="deit_tiny_patch16_224", batch_size=8, warmup=3, steps=5, repeats=3)
    assert estimate_line(bench_work(small, 2.5e9, 7.5e9, "cpu"), flops_per_s=50e9, device="cpu") is None
    assert [duration_text(s) for s in (45, 600, 5 * 3600)] == ["45 s", "10 min", "5.0 h"]


@pytest.mark.parametrize("command", ["bench", "train"])
def test_a_run_says_its_estimate_before_the_work(sqlite_store, monkeypatch, command):
    monkeypatch.setattr(estimate, "LONG_S", 0.0)  # test_vit is quick: make any work "long"
    tiny = ["--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--device", "cpu"]
    own = (["--task", "infer", "--warmup", "1", "--steps", "1", "--repeats", "1"] if command == "bench" else
           ["--steps", "2", "--warmup-steps", "1", "--num-classes", "10", "--num-workers", "0"])
    result = CliRunner().invoke(main, [command, *tiny, *own], prog_name=f"entry_points/{command}.py")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("[vitreg] estimate: ")]
    first_work = next(i for i, line in enumerate(lines) if ": first call" in line or "step" in line.split(":")[0])
    assert len(said) == 1 and said[0] < first_work, result.output
    assert "for a short run: " in lines[said[0]]
    # as the MLproject entry point runs it (`mlflow run . -e ...`): its spelling, and only what is not in use
    # (batch 2 and the few steps are already shorter than the short run's)
    assert lines[said[0]].endswith("for a short run: -P model=deit_tiny_patch16_224"), lines[said[0]]


def test_the_advice_leaves_out_the_options_already_in_use_and_spells_the_command_typed():
    """A long run whose model and batch are already the short run's gets only what would shorten it, spelled
    as it was typed: ``-P name=value`` under ``mlflow run``, ``name=value`` in Python, ``--name value`` on the
    command line (the advice once repeated the options in use, in the CLI's spelling under `mlflow run`)."""
    spec = BenchSpec(model="deit_tiny_patch16_224", batch_size=8, warmup=3, steps=500, repeats=40, task="both")
    work = bench_work(spec, 2.5e9, 7.5e9, "cpu")
    assert work.shorter == {"steps": 5, "repeats": 3}
    lines = {typed: estimate_line(work, flops_per_s=50e9, device="cpu", command=typed) for typed in
             ("mlflow run . -e bench -P model=deit_tiny_patch16_224 -P steps=500", "vitreg bench --steps 500",
              "vitreg.api.bench(steps=500)")}
    shorter = [line.split("; for a short run: ")[1] for line in lines.values()]
    assert shorter == ["-P steps=5 -P repeats=3", "--steps 5 --repeats 3", "steps=5, repeats=3"]
    assert train_work(8, 5000, 7.5e9, "deit_tiny_patch16_224").shorter == {"steps": 20}
    assert train_work(64, 5000, 7.5e9, "vit_base_patch16_224").shorter == \
        {"model": "deit_tiny_patch16_224", "batch_size": 8, "steps": 20}
    # nothing left to shorten: the estimate alone
    done = bench_work(BenchSpec(model="deit_tiny_patch16_224", batch_size=8, warmup=3, steps=5, repeats=3), 1e12, 0,
                      "cpu")
    line = estimate_line(done, flops_per_s=1e9, device="cpu")
    assert line.startswith("estimate: bench will take") and "for a short run" not in line
