"""Before long work, one line saying how long it will take here and how to make it short.

A GPU-sized command typed on a CPU (``vitreg bench --model vit_base_patch16_224 --batch-size 256``) was
still at work after minutes with nothing said. The estimate is the work's FLOPs (counted on the real
model, :mod:`vitreg.models.flops`) over this machine's measured speed: a matrix product timed on the
run's device, in a fraction of a second. A ViT's steps run below a bare matmul's rate, so the estimate
errs short; compiling comes on top. Quick work says nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vitreg.errors import VitregError

#: Work estimated to take longer than this gets the line.
LONG_S = 60.0
#: Work estimated to take longer than this is refused: a year is beyond any job one machine is meant to run,
#: and the estimate errs short, so what is refused would take longer still (`--warmup 10**30` on a CPU was
#: accepted after an estimate of 4.8e24 hours, and ran until killed).
ENDLESS_S = 365 * 24 * 3600.0
#: The CPU batch search's largest batch (:data:`vitreg.measure.autobatch.SEARCH_LIMITS`): batch_size=auto.
_CPU_AUTO_BATCH = 64
_GPU_AUTO_BATCH = 256


def measured_flops_per_s(device: str = "cpu", n: int | None = None) -> float:
    """FLOP/s of a square fp32 matrix product on ``device`` (best of three after one warm-up), with the
    threads this process has: what a ViT's matrix products can reach here at most."""
    import torch

    n = n or (4096 if device == "cuda" else 384)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(4):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / max(best, 1e-9)


@dataclass(frozen=True)
class WorkAhead:
    """What a command will do: images through the model, each costing ``flops_per_img``."""

    what: str  # "bench", "train"
    flops_per_img: float
    images: int
    shorter: str  # the options that make it short, as the user types them

    def seconds(self, flops_per_s: float) -> float:
        return self.flops_per_img * self.images / flops_per_s


def bench_work(spec, fwd_flops: float, train_flops: float, device: str) -> WorkAhead:
    """The images bench or infer puts through the model: per task, the warm-up and the timed windows
    (batch_size=auto: the batch search's largest batch, which it tries)."""
    auto = _GPU_AUTO_BATCH if device == "cuda" else _CPU_AUTO_BATCH
    batch = auto if str(spec.batch_size) == "auto" else int(spec.batch_size)
    iterations = spec.warmup + spec.steps * spec.repeats
    flops = (fwd_flops if "infer" in spec.tasks else 0) + (train_flops if "train" in spec.tasks else 0)
    return WorkAhead("bench", flops, batch * iterations,
                "--model deit_tiny_patch16_224 --batch-size 8 --warmup 3 --steps 5 --repeats 3")


def train_work(batch_size: int, total_steps: int, train_flops: float) -> WorkAhead:
    return WorkAhead("train", train_flops, batch_size * total_steps, "--model deit_tiny_patch16_224 --batch-size 8 --steps 20")


def duration_text(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``, ``32 h``, ``4.8e+24 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    return f"{hours:.1f} h" if hours < 10 else f"{hours:.0f} h" if hours < 1e6 else f"{hours:.2g} h"


def estimate_line(work: WorkAhead, flops_per_s: float, device: str, compiling: bool = False) -> str | None:
    """The line to say before ``work`` (None when it is quick): the estimate, its sum, how to make it short."""
    seconds = work.seconds(flops_per_s)
    if seconds <= LONG_S:
        return None
    where = "this CPU" if device == "cpu" else "this GPU"
    return (f"estimate: {work.what} will take at least {duration_text(seconds)} on {where} "
            f"({work.flops_per_img / 1e9:.3g} GFLOP/img x {work.images:,} images at a measured "
            f"{flops_per_s / 1e9:.0f} GFLOP/s{'; compiling comes on top' if compiling else ''}); "
            f"for a short run: {work.shorter}")


def refuse_if_endless(work: WorkAhead, flops_per_s: float, device: str) -> None:
    """One line, before the work starts, when it cannot finish here (longer than :data:`ENDLESS_S`)."""
    seconds = work.seconds(flops_per_s)
    if seconds > ENDLESS_S:
        where = "this CPU" if device == "cpu" else "this GPU"
        raise VitregError(f"{work.what} would take at least {duration_text(seconds)} on {where} "
                          f"({work.images:.3g} images at a measured {flops_per_s / 1e9:.0f} GFLOP/s), more than a "
                          f"year: it cannot finish; for a short run: {work.shorter}")


def say_if_long(work: WorkAhead, device: str, progress, compiling: bool = False) -> str | None:
    """Measure this machine, and say the estimate when the work is long; returns the line said. Work that
    cannot finish is refused (:func:`refuse_if_endless`)."""
    if work.flops_per_img <= 0 or work.images <= 0:
        return None
    flops_per_s = measured_flops_per_s(device)
    refuse_if_endless(work, flops_per_s, device)
    line = estimate_line(work, flops_per_s, device, compiling)
    if line:
        progress(line)
    return line
