"""``batch_size=auto``: the batch with the best throughput that fits, found by short probes.

:func:`find_batch` doubles the batch while throughput improves clearly and it fits; after an out-of-memory it steps
back down a grid of powers of two and their midpoints (2048 -> 1536 -> 1024, as timm's batch decay does). A gain
is clear when it passes both ``min_gain`` and the two probes' own spread (their median's interval): a doubling that
noise could give is no gain. The choice is the smallest batch not clearly slower than the fastest probe: a larger
one costs memory and latency, and would not repeat from run to run.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

from vitreg.errors import VitregError
from vitreg.measure import batch_cache
from vitreg.measure.timing import median_halfwidth_pct, time_window


@dataclass(frozen=True)
class SearchLimits:
    start: int
    limit: int  # the largest batch ever probed
    max_probes: int
    max_seconds: float
    min_gain: float = 0.03  # a doubling must add 3 % throughput to be worth its memory and latency
    probe_steps: int = 3  # timed steps per probe (timed_probe)
    probe_warmup: int = 2


# A GPU search starts at 256, timm benchmark.py's default batch: batch_size=auto (bench's default)
# then never times a smaller batch than timm's defaults on a GPU where 256 fits.
# On a GPU a doubling must add 1 %: on an H200, ViT-B/16 inference gains 1.8 % from 256 to 512 (8,849 ->
# 9,008 img/s in the probes), which a 3 % rule left on the table and the mission's command below timm's
# 8,635 img/s (benchmarks/results/h200-2026-12-01/); the probes' own spread is ~0.3 %.
SEARCH_LIMITS = {"cuda": SearchLimits(start=256, limit=4096, max_probes=10, max_seconds=240.0, probe_steps=10,
                                     probe_warmup=3, min_gain=0.01),
                 "cpu": SearchLimits(start=8, limit=64, max_probes=4, max_seconds=60.0)}


@dataclass(frozen=True)
class Probe:
    batch: int
    img_per_s: float | None  # None: out of memory
    spread_pct: float | None = None  # the half-width of its steps' median interval, % (None: too few steps)

    @property
    def fits(self) -> bool:
        return self.img_per_s is not None


@dataclass(frozen=True)
class BatchChoice:
    batch: int
    probes: tuple[Probe, ...]  # in the order they ran
    stopped: str  # why the search ended: "plateau", "oom", "limit", "budget", or "cache" (no search)
    source: str = "probe"  # "probe": searched now; "cache": kept here by an earlier run; "measured": MEASURED
    kept: str = ""  # a batch not searched now: the probes that chose it, and where they ran

    def series(self) -> list[tuple[int, float]]:
        """``(batch, img/s)`` of the probes that fit, for a metric logged with step=batch."""
        return [(p.batch, p.img_per_s) for p in self.probes if p.fits]

    def summary(self) -> str:
        """One line for a tag: ``64:8100,128:9050,256:oom`` (a kept batch: its probes, and where they ran)."""
        return self.kept or ",".join(f"{p.batch}:{p.img_per_s:.0f}" if p.fits else f"{p.batch}:oom" for p in self.probes)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA out-of-memory error, or vitreg's translation of it (a class named ``OutOfMemory``)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or any(
        cls.__name__ == "OutOfMemory" for cls in type(exc).__mro__)


def decay_step(batch: int) -> int:
    """The next smaller batch on the grid 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (0 below 1)."""
    if batch <= 1:
        return 0
    power = 1 << (batch - 1).bit_length() - 1  # the largest power of two below batch
    midpoint = power + power // 2
    return midpoint if power >= 2 and midpoint < batch else power


class _Budget(Exception):
    """The probe count or time bound was reached."""


def clearly_faster(fast: Probe, slow: Probe, min_gain: float) -> bool:
    """``fast`` beats ``slow`` by more than ``min_gain`` and more than the two probes' spreads together."""
    noise = ((fast.spread_pct or 0.0) + (slow.spread_pct or 0.0)) / 100
    return fast.img_per_s > slow.img_per_s * (1 + max(min_gain, noise))


def find_batch(probe, limits: SearchLimits, clock=time.monotonic) -> BatchChoice:
    """``probe(batch)`` returns img/s, or ``(img/s, spread %)``, or raises out of memory; VitregError if no probed
    batch fits."""
    probes: list[Probe] = []
    t0 = clock()

    def run(batch: int) -> Probe:
        if len(probes) >= limits.max_probes or clock() - t0 > limits.max_seconds:
            raise _Budget
        try:
            rate = probe(batch)
            result = Probe(batch, *(rate if isinstance(rate, tuple) else (float(rate),)))
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            result = Probe(batch, None)
        probes.append(result)
        return result

    try:
        stopped = _search(run, limits)
    except _Budget:
        stopped = "budget"
    fitting = [p for p in probes if p.fits]
    if not fitting:
        tried = ", ".join(str(p.batch) for p in probes)
        raise VitregError(f"batch_size=auto found no batch that fits (tried {tried}): "
                          f"use a smaller model or img_size, or give batch_size=<n>")
    fastest = max(fitting, key=lambda p: p.img_per_s)
    chosen = min(p.batch for p in fitting if not clearly_faster(fastest, p, limits.min_gain))
    return BatchChoice(chosen, tuple(probes), stopped)


def _search(run, limits: SearchLimits) -> str:
    batch = min(limits.start, limits.limit)
    current = run(batch)
    while not current.fits:  # too big to start with: decay until one fits
        batch = decay_step(batch)
        if batch == 0:
            return "oom"
        current = run(batch)
    while current.batch * 2 <= limits.limit:
        bigger = run(current.batch * 2)
        if not bigger.fits:  # try the grid points between the two, largest first
            batch = decay_step(bigger.batch)
            while batch > current.batch and not run(batch).fits:
                batch = decay_step(batch)
            return "oom"
        if not clearly_faster(bigger, current, limits.min_gain):
            return "plateau"
        current = bigger
    return "limit"


def timed_probe(make_step, device: str, steps: int = 3, warmup: int = 2):
    """A probe for :func:`find_batch`: ``warmup`` untimed steps of ``make_step(batch)``, then the img/s of ``steps``
    in one timed window and the spread of its steps; the step dropped and the allocator's cache emptied after it,
    for the next probe."""

    def probe(batch: int) -> tuple[float, float | None]:
        step = make_step(batch)
        try:
            for _ in range(warmup):
                step()
            window = time_window(step, steps, device)
            return window.img_per_s(batch), median_halfwidth_pct([batch / ms for ms in window.iter_ms])
        finally:
            del step
            release_memory(device)

    return probe


def search_batch(make_step, task: str, device: str, torch_device, distributed: bool, progress,
                 key=None) -> BatchChoice:
    """The runner's search over the eager ``make_step`` (a compiled probe recompiles per batch) within
    :data:`SEARCH_LIMITS`; under DDP the ranks' smallest choice. ``key`` (not under DDP): a batch kept for it is
    reused without a probe (the task's warm-up checks it: the runner forgets it on an out-of-memory and searches
    again); what a search finds is kept."""
    limits = SEARCH_LIMITS[device]
    probe = timed_probe(make_step, device, limits.probe_steps, limits.probe_warmup)
    key = None if distributed else key
    reused = _reuse(key, task, progress) if key is not None else None
    if reused is not None:
        return reused
    progress(f"{task}: batch_size=auto: probing batches {limits.start} to {limits.limit} on {device}")
    choice = find_batch(probe, limits)
    if key is not None:
        batch_cache.keep(key, choice.batch, choice.summary())
    if distributed:
        choice = replace(choice, batch=smallest_over_ranks(choice.batch, torch_device))
    progress(f"{task}: batch_size=auto chose {choice.batch} (img/s per probe {choice.summary()}; "
             f"stopped: {choice.stopped})")
    return choice


def _reuse(key, task: str, progress) -> BatchChoice | None:
    """The batch kept for ``key`` (None: search), said with where it comes from and its probes."""
    kept, note = batch_cache.lookup(key)
    if note:
        progress(f"{task}: batch_size=auto: {note}")
    if kept is None:
        return None
    progress(f"{task}: batch_size=auto: batch {kept.batch}, {'kept in ' if kept.source == 'cache' else ''}{kept.origin} "
             f"(img/s per probe {kept.probes}); the warm-up checks it (delete {batch_cache.cache_file()} or pass a "
             f"batch size to search again)")
    return BatchChoice(kept.batch, (), "cache", source=kept.source, kept=f"{kept.probes} ({kept.origin})")


def forget_kept(key, task: str, batch: int, progress) -> None:
    """A kept batch ran out of memory in its warm-up: forgotten (the next search keeps its own), and said."""
    batch_cache.forget(key)
    progress(f"{task}: batch_size=auto: the kept batch {batch} no longer fits (out of memory: another process may "
             f"hold memory): probing again")


def smallest_over_ranks(batch: int, torch_device) -> int:
    """The smallest ``batch`` over the ranks of the process group (``batch`` itself without one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return batch
    value = torch.tensor([batch], device=torch_device)  # on the GPU for NCCL, on the CPU for gloo
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def release_memory(device: str, reset_peak: bool = False) -> None:
    """Garbage collected and the CUDA allocator's cache emptied (``reset_peak``: its peak statistics too)."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
