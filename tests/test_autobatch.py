"""batch_size=auto: the search against fake probes with known answers, and against a real tiny model on CPU."""

import pytest
import torch

from vitreg.errors import VitregError
from vitreg.measure.autobatch import (SEARCH_LIMITS, SearchLimits, decay_step, find_batch, is_out_of_memory,
                                      timed_probe)

GPU = SearchLimits(start=64, limit=4096, max_probes=10, max_seconds=1e9)


class OutOfMemory(VitregError):
    """Stands in for vitreg.errors.OutOfMemory (the runner's translation of torch's error)."""


def fake_probe(fits_up_to: int, rate=lambda b: 10_000 * b / (b + 64), error=torch.OutOfMemoryError):
    def probe(batch):
        if batch > fits_up_to:
            raise error("CUDA out of memory")
        return rate(batch)
    return probe


def test_decay_steps_down_the_grid_of_powers_of_two_and_midpoints():
    steps, batch = [], 2048
    while batch:
        steps.append(batch)
        batch = decay_step(batch)
    assert steps == [2048, 1536, 1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert decay_step(100) == 96 and decay_step(97) == 96 and decay_step(96) == 64


def test_doubles_while_it_fits_then_backs_off_between_the_last_fit_and_the_oom():
    choice = find_batch(fake_probe(700), GPU)
    assert [(p.batch, p.fits) for p in choice.probes] == [
        (64, True), (128, True), (256, True), (512, True), (1024, False), (768, False)]
    assert (choice.batch, choice.stopped) == (512, "oom")
    assert choice.summary().endswith("512:8889,1024:oom,768:oom")
    assert [b for b, _ in choice.series()] == [64, 128, 256, 512]


def test_a_midpoint_that_fits_is_taken_when_it_is_clearly_faster():
    choice = find_batch(fake_probe(800), GPU)  # 768: 9231 img/s, 3.8 % over 512's 8889
    assert choice.batch == 768 and choice.probes[-1].batch == 768 and choice.probes[-1].fits
    slower = find_batch(fake_probe(800, rate=lambda b: min(b, 512 * 1.005)), GPU)  # 768: +0.5 % only
    assert slower.batch == 512 and slower.probes[-1].batch == 768


def test_stops_doubling_when_throughput_no_longer_improves():
    flat = fake_probe(10_000, rate=lambda b: min(b, 256) * 10.0 + b * 0.001)
    choice = find_batch(flat, GPU)
    assert [p.batch for p in choice.probes] == [64, 128, 256, 512]
    assert (choice.batch, choice.stopped) == (256, "plateau")  # 512 is faster by a hair only: not worth it


def test_a_start_that_does_not_fit_is_decayed_first():
    choice = find_batch(fake_probe(20), GPU)
    assert [p.batch for p in choice.probes] == [64, 48, 32, 24, 16, 32, 24]
    assert choice.batch == 16


def test_the_limit_and_the_budgets_bound_the_search():
    assert find_batch(fake_probe(10**6), SearchLimits(64, 256, 10, 1e9)).stopped == "limit"
    few = find_batch(fake_probe(10**6), SearchLimits(64, 4096, 3, 1e9))
    assert (len(few.probes), few.stopped, few.batch) == (3, "budget", 256)
    ticks = iter(range(0, 1000, 10))  # every probe "takes" 10 s
    timed = find_batch(fake_probe(10**6), SearchLimits(64, 4096, 99, 25.0), clock=lambda: next(ticks))
    assert len(timed.probes) == 2 and timed.stopped == "budget"


def test_vitregs_own_out_of_memory_error_counts_and_other_errors_propagate():
    assert find_batch(fake_probe(100, error=OutOfMemory), GPU).batch == 96
    assert is_out_of_memory(OutOfMemory("x")) and not is_out_of_memory(RuntimeError("out of memory"))
    with pytest.raises(ValueError):
        find_batch(fake_probe(100, error=ValueError), GPU)


def test_nothing_fits_is_one_line_naming_the_fix():
    with pytest.raises(VitregError, match=r"tried 64, 48, .*, 1\): use a smaller model or img_size"):
        find_batch(fake_probe(0), SearchLimits(64, 4096, 99, 1e9))
    with pytest.raises(VitregError, match=r"tried 64, 48, 32\)"):  # the probe budget ran out first
        find_batch(fake_probe(0), SearchLimits(64, 4096, 3, 1e9))


def test_a_real_search_on_cpu_is_small_and_picks_the_smallest_batch_near_the_fastest():
    import timm

    model = timm.create_model("test_vit", pretrained=False, img_size=32).eval()

    def make_step(batch):
        x = torch.randn(batch, 3, 32, 32)

        def step():
            with torch.inference_mode():
                model(x)
        return step

    limits = SEARCH_LIMITS["cpu"]
    choice = find_batch(timed_probe(make_step, "cpu", steps=2, warmup=1), limits)
    assert 1 <= len(choice.probes) <= limits.max_probes and all(p.fits for p in choice.probes)
    assert all(p.batch <= limits.limit for p in choice.probes) and choice.probes[0].batch == limits.start
    fastest = max(p.img_per_s for p in choice.probes)
    assert choice.batch == min(p.batch for p in choice.probes if p.img_per_s * (1 + limits.min_gain) >= fastest)
