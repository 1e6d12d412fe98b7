"""batch_size=auto: the search against fake probes with known answers, and against a real tiny model on CPU."""

import dataclasses
import json

import pytest
import torch

from vitreg.errors import VitregError
from vitreg.measure import batch_cache
from vitreg.measure.autobatch import (SEARCH_LIMITS, SearchLimits, decay_step, find_batch, is_out_of_memory,
                                      search_batch, timed_probe)
from vitreg.measure.batch_cache import CacheKey

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


def test_a_doubling_counts_only_where_its_gain_is_clear_of_the_probes_spread():
    noisy = {256: (2690.0, 0.4), 512: (2819.0, 0.6), 1024: (2848.0, 0.6), 2048: (2872.0, 0.5)}  # H200 train's rates
    choice = find_batch(lambda b: noisy[b], SearchLimits(256, 4096, 10, 1e9, min_gain=0.01))
    assert (choice.batch, choice.stopped) == (512, "plateau")  # +1.0 % to 1024 is inside 0.6 + 0.6 % of spread
    assert [p.batch for p in choice.probes] == [256, 512, 1024] and choice.probes[1].spread_pct == 0.6
    quiet = {b: (rate, 0.1) for b, (rate, _) in noisy.items()}  # the same rates, measured tighter
    assert find_batch(lambda b: quiet[b], SearchLimits(256, 4096, 10, 1e9, min_gain=0.01)).batch == 1024


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


# --- the probe cache (vitreg.measure.batch_cache): a later run of the same work reuses the kept batch ---

KEY = CacheKey(machine="cpu:test", model="test_vit", img_size=32, precision="off", compile="off", sdpa="auto",
               torch=torch.__version__, task="infer")


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VITREG_BATCH_CACHE")  # conftest's per-test file: here the user's own place is tested
    # a short search (each probe empties the allocator and collects garbage: ~1 s on a busy CPU)
    monkeypatch.setitem(SEARCH_LIMITS, "cpu", SearchLimits(start=8, limit=16, max_probes=3, max_seconds=60.0,
                                                           probe_steps=1, probe_warmup=1))
    return tmp_path / "vitreg" / "autobatch.json"


class Steps:
    """A real CPU step (a matmul) per batch; batches above ``fits_up_to`` run out of memory. Counts the batches
    asked for, so a test sees which probes ran."""

    def __init__(self, fits_up_to=10**6):
        self.fits_up_to, self.asked = fits_up_to, []
        self.weight = torch.randn(64, 64)

    def __call__(self, batch):
        self.asked.append(batch)
        if batch > self.fits_up_to:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        x = torch.randn(batch, 64)
        return lambda: x @ self.weight


def search(steps, key=KEY, distributed=False):
    said = []
    choice = search_batch(steps, "infer", "cpu", torch.device("cpu"), distributed, said.append, key=key)
    return choice, said


def test_a_second_run_reuses_the_kept_batch_without_a_probe_and_says_so(user_cache):
    first, _ = search(Steps())
    assert first.source == "probe" and len(first.probes) > 1 and user_cache.exists()
    steps = Steps()
    second, said = search(steps)
    assert (second.batch, second.source, second.stopped) == (first.batch, "cache", "cache")
    assert steps.asked == [] and second.probes == ()  # the task's warm-up is its check
    assert second.summary() == f"{first.summary()} ({user_cache})"  # the probes that chose it, and where
    assert any(f"batch {first.batch}, kept in {user_cache}" in line for line in said)
    other, _ = search(Steps(), key=dataclasses.replace(KEY, precision="bf16"))  # other work: searched anew
    assert other.source == "probe"


MISSION_H100 = CacheKey(machine="NVIDIA H100 80GB HBM3", torch="2.14.1", task="train", **batch_cache.MISSION)


def test_a_fresh_machine_takes_the_measured_batch_of_its_gpu_for_the_mission_and_searches_anything_else(user_cache):
    batch, probes, source = batch_cache.MEASURED[("NVIDIA H100 80GB HBM3", "train")]
    steps = Steps()
    choice, said = search(steps, key=MISSION_H100)  # another torch than the measurement's: the warm-up checks it
    assert (choice.batch, choice.source, steps.asked) == (batch, "measured", [])
    assert choice.summary() == f"{probes} (measured on {source})"
    assert any(f"batch {batch}, measured on {source}" in line for line in said)
    for other in (dataclasses.replace(MISSION_H100, machine="NVIDIA A100-SXM4-80GB"),  # a GPU never measured
                  dataclasses.replace(MISSION_H100, compile="default"), dataclasses.replace(MISSION_H100, img_size=224)):
        assert batch_cache.lookup(other) == (None, None)
    batch_cache.keep(MISSION_H100, 512, "512:2700")  # a batch searched on this machine wins
    assert batch_cache.lookup(MISSION_H100)[0].batch == 512


def test_a_kept_batch_that_ran_out_of_memory_is_forgotten_also_where_a_measured_one_stands(user_cache):
    from vitreg.measure.autobatch import forget_kept

    said = []
    forget_kept(MISSION_H100, "train", 1024, said.append)
    assert said == ["train: batch_size=auto: the kept batch 1024 no longer fits (out of memory: another process may "
                    "hold memory): probing again"]
    assert batch_cache.lookup(MISSION_H100) == (None, None)
    batch_cache.keep(MISSION_H100, 512, "512:2700")
    assert batch_cache.lookup(MISSION_H100)[0].img_per_s == 2700.0


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\x00\xff"])
def test_a_corrupt_cache_file_is_one_line_then_a_search_and_a_good_file(user_cache, text):
    user_cache.parent.mkdir(parents=True)
    user_cache.write_text(text, encoding="latin-1")
    choice, said = search(Steps())
    notes = [line for line in said if "batch cache" in line]
    assert len(notes) == 1 and "\n" not in notes[0] and "probing, then rewriting it" in notes[0]
    assert choice.source == "probe" and json.loads(user_cache.read_text())  # rewritten, readable
    assert batch_cache.lookup(KEY)[0].batch == choice.batch


@pytest.mark.parametrize("entry", [{"batch": "64"}, {"batch": -1}, {"batch": True}, [64], None])
def test_an_entry_of_the_wrong_shape_counts_as_missing(user_cache, entry):
    user_cache.parent.mkdir(parents=True)
    user_cache.write_text(json.dumps({KEY.text(): entry}))
    choice, said = search(Steps())
    assert choice.source == "probe" and not any("batch cache" in line for line in said)


def test_ddp_never_reads_or_writes_the_cache(user_cache):
    batch_cache.keep(KEY, 8, "8:1")
    choice, _ = search(Steps(), distributed=True)  # ranks must agree: each searches, the smallest wins
    assert choice.source == "probe" and batch_cache.lookup(KEY)[0].batch == 8


def test_the_key_names_the_machine_the_work_and_torch():
    from vitreg.config.spec import BenchSpec
    from vitreg.hardware.runtime import Runtime

    key = batch_cache.key_for(BenchSpec(model="test_vit", img_size=32), Runtime("cpu", "off", "default"), "train")
    assert key.machine.startswith("cpu:") and (key.model, key.img_size, key.compile, key.task) == (
        "test_vit", 32, "default", "train")
    assert key.torch == torch.__version__ and key.text() != dataclasses.replace(key, sdpa="flash").text()
