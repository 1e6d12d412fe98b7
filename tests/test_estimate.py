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


def test_work_longer_than_a_year_is_refused_and_a_year_is_not():
    from vitreg.errors import VitregError
    from vitreg.measure.estimate import ENDLESS_S, refuse_if_endless

    year = train_work(1, 1, ENDLESS_S)  # one image of a year's FLOPs at 1 FLOP/s
    refuse_if_endless(year, flops_per_s=1.0, device="cpu")
    with pytest.raises(VitregError) as err:
        refuse_if_endless(train_work(2, 1, ENDLESS_S), flops_per_s=1.0, device="cuda")
    message = str(err.value)
    assert message.startswith("train would take at least 17520 h on this GPU") and "cannot finish" in message
    spec = BenchSpec(model="deit_tiny_patch16_224", batch_size=8, warmup=10**9)  # the most the option allows
    with pytest.raises(VitregError, match=r"at least 2.2e\+06 h on this CPU"):
        refuse_if_endless(bench_work(spec, 1e9, 0, "cpu"), flops_per_s=1e9, device="cpu")
    assert duration_text(4.8e24 * 3600) == "4.8e+24 h"


@pytest.mark.parametrize("command", ["bench", "train"])
def test_a_run_says_its_estimate_before_the_work(sqlite_store, monkeypatch, command):
    monkeypatch.setattr(estimate, "LONG_S", 0.0)  # test_vit is quick: make any work "long"
    tiny = ["--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--device", "cpu"]
    own = (["--task", "infer", "--warmup", "1", "--steps", "1", "--repeats", "1"] if command == "bench" else
           ["--steps", "2", "--warmup-steps", "1", "--num-classes", "10", "--num-workers", "0"])
    result = CliRunner().invoke(main, [command, *tiny, *own])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("[vitreg] estimate: ")]
    first_work = next(i for i, line in enumerate(lines) if ": first call" in line or "step" in line.split(":")[0])
    assert len(said) == 1 and said[0] < first_work, result.output
    assert "for a short run: " in lines[said[0]]
