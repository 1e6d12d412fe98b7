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

#: Work estimated to take longer than this gets the line.
LONG_S = 60.0
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
    shorter: dict  # the options (option-table names) that make it short and are not already in use

    def seconds(self, flops_per_s: float) -> float:
        return self.flops_per_img * self.images / flops_per_s


#: The short runs the estimate offers (the README's CPU-sized commands), as option-table names and values.
SHORT_BENCH = {"model": "deit_tiny_patch16_224", "batch_size": 8, "warmup": 3, "steps": 5, "repeats": 3}
SHORT_TRAIN = {"model": "deit_tiny_patch16_224", "batch_size": 8, "steps": 20}


def not_in_use(short: dict, current: dict) -> dict:
    """The options of ``short`` that would change the run ``current`` describes: a count only where it is
    lower than the one in use, another model where it is another; never one the command already has."""
    def shortens(name, value) -> bool:
        now = current.get(name)
        if isinstance(value, int) and isinstance(now, int):
            return now > value
        return str(now) != str(value)

    return {name: value for name, value in short.items() if shortens(name, value)}


def bench_work(spec, fwd_flops: float, train_flops: float, device: str) -> WorkAhead:
    """The images bench or infer puts through the model: per task, the warm-up and the timed windows
    (batch_size=auto: the batch search's largest batch, which it tries)."""
    auto = _GPU_AUTO_BATCH if device == "cuda" else _CPU_AUTO_BATCH
    batch = auto if str(spec.batch_size) == "auto" else int(spec.batch_size)
    iterations = spec.warmup + spec.steps * spec.repeats
    flops = (fwd_flops if "infer" in spec.tasks else 0) + (train_flops if "train" in spec.tasks else 0)
    current = {"model": spec.model, "batch_size": batch, "warmup": spec.warmup, "steps": spec.steps,
               "repeats": spec.repeats}
    return WorkAhead("bench", flops, batch * iterations, not_in_use(SHORT_BENCH, current))


def train_work(batch_size: int, total_steps: int, train_flops: float, model: str = "") -> WorkAhead:
    current = {"model": model, "batch_size": batch_size, "steps": total_steps}
    return WorkAhead("train", train_flops, batch_size * total_steps, not_in_use(SHORT_TRAIN, current))


def spelled(options: dict, command: str = "") -> str:
    """``options`` as the command that was typed spells them: ``-P name=value`` under ``mlflow run``,
    ``name=value`` in a ``vitreg.api`` call, ``--name value`` on the command line (``--batch-size`` for
    ``batch_size``, the option table's rule)."""
    if command.startswith("mlflow run"):
        return " ".join(f"-P {name}={value}" for name, value in options.items())
    if command.startswith("vitreg.api."):
        return ", ".join(f"{name}={value!r}" for name, value in options.items())
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in options.items())


def duration_text(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``, ``32 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    return f"{hours:.1f} h" if hours < 10 else f"{hours:.0f} h"


def estimate_line(work: WorkAhead, flops_per_s: float, device: str, compiling: bool = False,
                  command: str = "") -> str | None:
    """The line to say before ``work`` (None when it is quick): the estimate, its sum, how to make it short
    (in ``command``'s spelling; see :func:`spelled`)."""
    seconds = work.seconds(flops_per_s)
    if seconds <= LONG_S:
        return None
    where = "this CPU" if device == "cpu" else "this GPU"
    shorter = f"; for a short run: {spelled(work.shorter, command)}" if work.shorter else ""
    return (f"estimate: {work.what} will take at least {duration_text(seconds)} on {where} "
            f"({work.flops_per_img / 1e9:.3g} GFLOP/img x {work.images:,} images at a measured "
            f"{flops_per_s / 1e9:.0f} GFLOP/s{'; compiling comes on top' if compiling else ''}){shorter}")


def say_if_long(work: WorkAhead, device: str, progress, compiling: bool = False, command: str = "") -> str | None:
    """Measure this machine, and say the estimate when the work is long; returns the line said. ``command``:
    what the user typed (the advice takes its spelling)."""
    if work.flops_per_img <= 0 or work.images <= 0:
        return None
    line = estimate_line(work, measured_flops_per_s(device), device, compiling, command)
    if line:
        progress(line)
    return line
