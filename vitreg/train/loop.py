"""The training loop: AdamW + warm-up/cosine LR, AMP, compile, DeiT distillation, checkpoints, callbacks.

No MLflow here: :func:`train` reports through :class:`Hooks` and returns a :class:`TrainResult`. It runs named
steps over :class:`_Setup` (built once) and :class:`_Tally` (what changes as updates run). An interrupt
(Ctrl-C, or SIGTERM/SIGHUP through :mod:`vitreg.signals`) stops it between updates: the open interval is
logged, the step reached is checkpointed, and the ``KeyboardInterrupt`` goes on carrying ``partial_result``.

Throughput is measured as bench's train task measures it: the first step timed apart, then a warm-up, then
per-step times (CUDA events or ``perf_counter``) read once per log interval, never a sync inside a step.
Under DDP the model is wrapped before torch.compile, as bench does, and the reducer all-reduces the loss
and img/s once per log boundary.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from vitreg.checkpoint import format as ckpt
from vitreg.console import progress
from vitreg.errors import VitregError, out_of_memory_as_error
from vitreg.measure.figures import Figures, Work
from vitreg.measure.timing import synchronize
from vitreg.signals import interrupted_reason, update_is_atomic
from vitreg.train.losses import build_criterion, check_distillable, create_teacher

THROUGHPUT_WARMUP_STEPS = 10  # as BenchSpec.warmup: steps after the first that are not timed into the result
WARMUP_LR_INIT = 1e-6  # DeiT's warmup_lr: where the linear warm-up starts


@dataclass(frozen=True)
class Hooks:
    """The loop's callbacks: ``on_step(step)`` after every update (host-only); ``on_log(step, metrics)`` every
    ``log_every`` updates and at the end; ``on_checkpoint(step, path)``; ``on_epoch_end(epoch, metrics)``."""

    on_step: Callable | None = None
    on_log: Callable | None = None
    on_checkpoint: Callable | None = None
    on_epoch_end: Callable | None = None
    progress: Callable = progress


@dataclass(frozen=True)
class Sources:
    """``data`` and the distillation ``teacher``; None: built from the spec."""

    data: object = None
    teacher: object = None


@dataclass(frozen=True)
class Checkpoints:
    """Where ``step-<N>/`` checkpoints go (None: none), the one to resume from, and extra spec.json keys."""

    directory: Path | None = None
    resume_from: object = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a DDP job; only ``is_main`` writes checkpoints and validates."""

    world_size: int = 1
    rank: int = 0
    is_main: bool = True
    wrap: Callable | None = None
    reducer: object = None


@dataclass(frozen=True)
class TrainResult:
    step: int  # optimizer updates reached, counting those before a resume
    start_step: int  # 0, or the step the run resumed at
    steps_run: int  # updates made by this run
    epoch: int  # completed epochs
    total_steps: int
    steps_per_epoch: int
    batch_size: int  # per process
    world_size: int
    figures: Figures  # train_final_loss, train_throughput_img_per_s, train_step_ms_p50, val_top1, ...
    last_checkpoint: str | None
    stopped_by: str | None = None  # why the run ended before total_steps (Ctrl-C, SIGTERM, SIGHUP); None: it did not

    def figure(self, name: str):
        return self.figures.get(name)

    def metrics(self) -> dict[str, float]:
        return self.figures.metrics()

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "figures"}
        return {**out, "figures": self.figures.to_dict(), "metrics": self.metrics()}


def resume_spec(spec, checkpoint: ckpt.VerifiedCheckpoint, info, progress=progress):
    """``spec`` with the checkpoint's ``seed``, which defines the data and its order (another seed trains another
    task); refuses a checkpoint of another model. Call it before building the data."""
    spec_json = ckpt.check_compatible(checkpoint, info)
    saved = spec_json.get("train_spec", {}).get("seed")
    if saved is not None and str(saved) != str(spec.seed):
        progress(f"resuming with the checkpoint's seed={saved}, not seed={spec.seed}: the seed defines the "
                 f"synthetic data and the sample order")
        spec = spec.replace(seed=int(saved))
    return spec


def total_steps_of(spec, steps_per_epoch: int) -> int:
    return spec.steps if spec.steps > 0 else spec.epochs * steps_per_epoch


@dataclass(frozen=True)
class _Setup:
    spec: object  # TrainSpec
    runtime: object
    model: object  # the plain module: checkpoints and validation use it
    net: object  # what the steps run: wrapped (DDP) and compiled
    info: object
    data: object
    criterion: Callable
    optimizer: object
    scheduler: object
    scaler: object
    params: list
    total: int
    steps_per_epoch: int
    start_step: int
    world_size: int
    is_main: bool
    reducer: object
    hooks: Hooks
    checkpoints: bool  # on every rank: when rank 0 saves, the others wait for it
    checkpoint_dir: Path | None  # where rank 0 saves; None on the others
    checkpoint_extra: dict

    @property
    def has_val(self) -> bool:
        return getattr(self.data, "val", None) is not None


@dataclass
class _Tally:
    step: int
    clock: StepClock
    loss_sum: torch.Tensor  # the interval's summed loss, on the device: no sync per step
    batches: object = None  # the epoch's batch iterator
    interval_steps: int = 0
    interval_waits: list = field(default_factory=list)
    step_ms: list = field(default_factory=list)  # every step of this run, in order
    waits: list = field(default_factory=list)  # host seconds blocked on the data iterator, per step
    lr: float = 0.0  # the LR the last update ran at
    norm: object = None  # the last gradient norm, a device tensor
    final_loss: float = float("nan")
    first_step_s: float = 0.0
    val_top1: float | None = None
    val_loss: float | None = None
    evaluated_at: int | None = None
    last_checkpoint: str | None = None


def train(spec, runtime, model, info, *, sources: Sources = Sources(), checkpoints: Checkpoints = Checkpoints(),
          hooks: Hooks = Hooks(), ranks: Ranks = Ranks()) -> TrainResult:
    """Train ``model`` as ``spec`` says; a resumed run continues with the checkpoint's optimizer, schedule,
    scaler and RNG states, and ``spec`` must then be :func:`resume_spec` of it."""
    progress = hooks.progress
    setup = _prepare(spec, runtime, model, info, sources, checkpoints, hooks, ranks)
    tally = _Tally(step=setup.start_step, clock=StepClock(runtime.device),
                   loss_sum=torch.zeros((), dtype=torch.float32, device=runtime.torch_device))
    stop = None
    try:
        with out_of_memory_as_error("training", spec.batch_size):
            while tally.step < setup.total:
                boundary = _step(setup, tally)
                if boundary:
                    _log(setup, tally)
                epoch_done = _maybe_end_epoch(setup, tally)
                checkpointed = _maybe_checkpoint(setup, tally)
                if setup.reducer is not None and tally.step < setup.total and (
                        checkpointed or (epoch_done and setup.has_val)):
                    # rank 0 validated or saved between steps, outside its clock; without this the other
                    # ranks would wait for it inside their next timed step (in DDP's all-reduce)
                    setup.reducer.align()
            if setup.is_main and setup.has_val and tally.evaluated_at != tally.step:
                _validate(setup, tally)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP through vitreg.signals: keep what was done
        stop = exc
        _stop_at_step(setup, tally, progress, interrupted_reason(exc))
    finally:
        if info.distilled and hasattr(model, "set_distilled_training"):
            model.set_distilled_training(False)
    synchronize(runtime.device)
    result = _finish(setup, tally, interrupted_reason(stop) if stop is not None else None)
    if stop is not None:
        stop.partial_result = result  # the job logs it, then lets the interrupt end the run KILLED
        raise stop
    return result


def _stop_at_step(setup: _Setup, tally: _Tally, progress, reason: str) -> None:
    """After an interrupt: the open interval's metrics and a checkpoint of the step reached. Under DDP the
    others may stop at another step, so nothing here needs them (no all-reduce)."""
    if tally.interval_steps and setup.reducer is None:
        _log(setup, tally)
    saved = tally.last_checkpoint is not None and Path(tally.last_checkpoint).name == f"step-{tally.step}"
    if setup.checkpoint_dir is not None and tally.step > setup.start_step and not saved:
        _save_checkpoint(setup, tally)
    where = f"; final checkpoint step-{tally.step}" if tally.last_checkpoint else ""
    progress(f"{reason}: stopped at step {tally.step}/{setup.total}{where}")


def _prepare(spec, runtime, model, info, sources: Sources, checkpoints: Checkpoints, hooks: Hooks,
             ranks: Ranks) -> _Setup:
    from vitreg.train.data import build_data

    device = runtime.torch_device
    model = model.to(device)
    model.train()
    data, teacher, progress = sources.data, sources.teacher, hooks.progress
    if data is None:
        data = build_data(spec, info, device, model=model, rank=ranks.rank, world_size=ranks.world_size)
    if data.num_classes != info.num_classes:
        raise VitregError(f"the data has {data.num_classes} classes, the model head {info.num_classes}: "
                          f"pass num_classes=0 to take it from the data")
    spe = max(1, int(data.steps_per_epoch))
    total = total_steps_of(spec, spe)
    check_distillable(spec, info)
    if spec.distillation != "none" and teacher is None:
        teacher = create_teacher(spec, info, device, progress=progress)
    criterion = build_criterion(spec, info, teacher)
    if info.distilled and hasattr(model, "set_distilled_training"):
        model.set_distilled_training(True)  # DeiT: training returns (class, distillation) outputs
    optimizer = build_optimizer(model, spec, runtime)
    scheduler = build_scheduler(optimizer, spec, total)
    scaler = runtime.grad_scaler()
    start_step = 0
    if checkpoints.resume_from is not None:
        start_step = _restore(checkpoints.resume_from, model, optimizer, scheduler, scaler, total, spe, progress)
    net = runtime.compile_model(ranks.wrap(model) if ranks.wrap else model)
    directory = checkpoints.directory
    return _Setup(
        spec=spec, runtime=runtime, model=model, net=net, info=info, data=data, criterion=criterion,
        optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        params=[p for p in model.parameters() if p.requires_grad], total=total, steps_per_epoch=spe,
        start_step=start_step, world_size=ranks.world_size, is_main=ranks.is_main, reducer=ranks.reducer,
        hooks=hooks, checkpoints=directory is not None,
        checkpoint_dir=Path(directory) if directory is not None and ranks.is_main else None,
        checkpoint_extra=dict(checkpoints.extra))


def _restore(resume_from, model, optimizer, scheduler, scaler, total: int, spe: int, progress) -> int:
    checkpoint = ckpt.ensure_verified(resume_from)
    fresh = {k: getattr(scheduler, k) for k in ("t_initial", "warmup_t", "lr_min", "base_values")}
    start_step, _ = ckpt.load_training_state(checkpoint, model, optimizer, scheduler, scaler)
    if start_step >= total:
        raise VitregError(f"checkpoint {checkpoint.directory} is at step {start_step}, and this run trains {total} "
                          f"steps in all: pass steps > {start_step} (steps count from the start, not the resume)")
    loaded = {k: getattr(scheduler, k) for k in fresh}
    if loaded != fresh:
        progress(f"resuming with the checkpoint's LR schedule (warm-up {loaded['warmup_t']}, cosine over "
                 f"{loaded['t_initial']} steps to {loaded['lr_min']:g}), not this run's")
    scheduler.step_update(start_step)  # the LR of update start_step, exactly as the first run had it
    progress(f"resumed from {checkpoint.directory} at step {start_step} (epoch {start_step // spe})")
    return start_step


def _step(setup: _Setup, tally: _Tally) -> bool:
    spec, runtime, spe = setup.spec, setup.runtime, setup.steps_per_epoch
    if tally.batches is None:
        tally.batches = setup.data.batches(tally.step // spe, tally.step % spe)
    first = tally.step == setup.start_step
    if first:
        synchronize(runtime.device)
        t_first = time.perf_counter()
    tally.clock.start()
    t0 = time.perf_counter()
    try:
        images, labels = next(tally.batches)
    except StopIteration:  # a custom sampler with fewer batches than steps_per_epoch: next epoch
        tally.batches = setup.data.batches(tally.step // spe + 1, 0)
        images, labels = next(tally.batches)
    wait = time.perf_counter() - t0

    runtime.mark_step()
    with runtime.autocast():
        outputs = setup.net(images)
        loss = setup.criterion(images, outputs, labels)
    setup.scaler.scale(loss).backward()
    boundary = (tally.step + 1) % spec.log_every == 0 or tally.step + 1 == setup.total
    if spec.clip_grad > 0 or boundary:
        setup.scaler.unscale_(setup.optimizer)  # true gradients for the norm (fp16); step() knows they are unscaled
        tally.norm = torch.nn.utils.clip_grad_norm_(setup.params, spec.clip_grad) if spec.clip_grad > 0 \
            else grad_norm(setup.params)
    with update_is_atomic():  # Ctrl-C/SIGTERM wait for the update and the step count to agree
        tally.lr = setup.optimizer.param_groups[0]["lr"]
        setup.scaler.step(setup.optimizer)
        setup.scaler.update()
        setup.optimizer.zero_grad(set_to_none=True)
        tally.loss_sum += loss.detach().float()  # stays on the device: no sync
        tally.clock.stop()
        tally.step += 1
        setup.scheduler.step_update(tally.step)
        if first:
            synchronize(runtime.device)
            tally.first_step_s = time.perf_counter() - t_first
        tally.interval_steps += 1
        tally.interval_waits.append(wait)
    if setup.hooks.on_step:
        setup.hooks.on_step(tally.step)
    return boundary


def _log(setup: _Setup, tally: _Tally) -> None:
    """The interval's one sync: its step times, its loss (reduced over ranks) and rate, to ``on_log``."""
    spec = setup.spec
    times = tally.clock.collect()  # syncs (CUDA) once for the interval
    # the live rate leaves out the first step, as the summary does: it holds compilation and lazy init
    # (with it, a compiled run's first interval read 1.1 img/s against a summary of 12.9)
    timed = times[1:] if not tally.step_ms else times
    tally.step_ms.extend(times)
    tally.waits.extend(tally.interval_waits)
    seconds = sum(timed) / 1e3
    if setup.reducer is not None:  # one all-reduce: the job's mean loss and summed img/s
        local_rate = spec.batch_size * len(timed) / seconds if seconds > 0 else None
        tally.final_loss, img_per_s = setup.reducer.interval(tally.loss_sum / tally.interval_steps, local_rate)
    else:
        tally.final_loss = (tally.loss_sum / tally.interval_steps).item()
        img_per_s = spec.batch_size * setup.world_size * len(timed) / seconds if seconds > 0 else None
    if not math.isfinite(tally.final_loss):  # the same (reduced) value on every rank: all stop here
        raise VitregError(f"the training loss became {tally.final_loss} by step {tally.step}: lower lr (now "
                          f"{spec.lr:g}), set clip_grad=1.0, or use amp=bf16 instead of fp16")
    metrics = {
        "train_loss": tally.final_loss,
        "lr": tally.lr,
        "train_img_per_s": img_per_s,
        "grad_norm": float(tally.norm) if tally.norm is not None else None,
        "data_wait_frac": min(1.0, sum(tally.interval_waits) / (sum(times) / 1e3)) if times else None,
        "epoch": tally.step / setup.steps_per_epoch,
    }
    tally.loss_sum.zero_()
    tally.interval_steps = 0
    tally.interval_waits = []
    if setup.hooks.on_log:
        setup.hooks.on_log(tally.step, {k: v for k, v in metrics.items() if v is not None})


def _maybe_end_epoch(setup: _Setup, tally: _Tally) -> bool:
    spe = setup.steps_per_epoch
    if tally.step % spe:
        return False
    tally.batches = None
    epoch_metrics = {"epoch": tally.step // spe}
    if setup.is_main and setup.has_val:
        _validate(setup, tally)
        epoch_metrics.update(val_top1=tally.val_top1, val_loss=tally.val_loss)
    if setup.hooks.on_epoch_end:
        setup.hooks.on_epoch_end(tally.step // spe, epoch_metrics)
    return True


def _maybe_checkpoint(setup: _Setup, tally: _Tally) -> bool:
    """Returns whether a checkpoint was due (on every rank); rank 0 writes it."""
    step, spec = tally.step, setup.spec
    every = spec.checkpoint_every
    due = setup.checkpoints and (step == setup.total or bool(every and step % every == 0))
    if setup.checkpoint_dir is None or not due:
        return due
    if step == setup.total and setup.has_val and tally.evaluated_at != step:
        _validate(setup, tally)  # the checkpoint carries the final val_top1
    _save_checkpoint(setup, tally)
    return due


def _save_checkpoint(setup: _Setup, tally: _Tally) -> None:
    step, spec = tally.step, setup.spec
    data, loss = setup.data, tally.final_loss
    extra = {"classes": list(data.classes) if data.kind == "folder" else None, "data": data.kind,
             "train_loss": loss if math.isfinite(loss) else None, "world_size": setup.world_size,
             **setup.checkpoint_extra}
    path = ckpt.save_checkpoint(setup.checkpoint_dir / f"step-{step}", setup.model,
                                state=ckpt.TrainingState(setup.optimizer, setup.scheduler, setup.scaler), step=step,
                                epoch=step // setup.steps_per_epoch, spec=spec.to_params(), model_info=setup.info,
                                extra=extra)
    tally.last_checkpoint = str(path)
    if setup.hooks.on_checkpoint:
        setup.hooks.on_checkpoint(step, path)


def _validate(setup: _Setup, tally: _Tally) -> None:
    tally.val_top1, tally.val_loss = evaluate(setup.model, setup.data, setup.runtime)
    tally.evaluated_at = tally.step


def _warm_steps(steps_run: int) -> int:
    """Steps not timed: the first (compilation) and a warm-up, at most half of the rest (a short run measures)."""
    return 0 if steps_run <= 1 else 1 + min(THROUGHPUT_WARMUP_STEPS, (steps_run - 1) // 2)


def _finish(setup: _Setup, tally: _Tally, stopped_by: str | None = None) -> TrainResult:
    spec, world_size = setup.spec, setup.world_size
    steps_run = tally.step - setup.start_step
    warm = _warm_steps(steps_run)
    measured = tuple(tally.step_ms[warm:])
    measured_s = sum(measured) / 1e3
    # this rank's: the statistics of its own steps (the step times themselves stay here: thousands of them)
    local = Figures("train", {"step_ms": measured}).summarized().values
    figures = Figures("train", {
        **{k: v for k, v in local.items() if k != "step_ms"},
        "throughput_img_per_s": spec.batch_size * len(measured) / measured_s if measured_s > 0 else None,
        "data_wait_frac": min(1.0, sum(tally.waits[warm:]) / measured_s) if measured_s > 0 else None,
        "first_step_s": tally.first_step_s, "measured_steps": len(measured),
    })
    if setup.reducer is not None and stopped_by is None:  # stopped: the others may be inside another collective
        figures = setup.reducer.figures(figures)  # sum of the ranks' rates, the slowest rank's times
    elif figures["throughput_img_per_s"] is not None:  # no reducer: every rank assumed as fast as this one
        figures = figures.with_values(throughput_img_per_s=figures["throughput_img_per_s"] * world_size)
    figures = figures.with_values(final_loss=tally.final_loss, images=steps_run * spec.batch_size * world_size,
                                  steps=tally.step, val_top1=tally.val_top1, val_loss=tally.val_loss)
    work = Work(world_size, setup.runtime.compile != "off")  # MFU needs the GPU: the job completes it
    return TrainResult(
        step=tally.step, start_step=setup.start_step, steps_run=steps_run, epoch=tally.step // setup.steps_per_epoch,
        total_steps=setup.total, steps_per_epoch=setup.steps_per_epoch, batch_size=spec.batch_size,
        world_size=world_size, figures=figures.completed(work), last_checkpoint=tally.last_checkpoint,
        stopped_by=stopped_by)


def build_optimizer(model, spec, runtime):
    """AdamW, no weight decay for biases, norms, position embeddings and tokens (as DeiT/timm). ``fused`` on CUDA:
    it reads GradScaler's scale and inf flag on the device, so an fp16 step needs no host sync."""
    from timm.optim import param_groups_weight_decay

    no_decay = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    groups = param_groups_weight_decay(model, spec.weight_decay, no_weight_decay_list=no_decay)
    kwargs = {"fused": True} if runtime.device == "cuda" else {}
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.999), **kwargs)


def build_scheduler(optimizer, spec, total_steps: int):
    """timm's CosineLRScheduler per update: linear warm-up from 1e-6, then a cosine to ``min_lr``. Call
    ``step_update(u + 1)`` after update ``u``."""
    from timm.scheduler import CosineLRScheduler

    warmup = min(spec.warmup_steps, max(total_steps - 1, 0))  # a run shorter than its warm-up still decays
    return CosineLRScheduler(optimizer, t_initial=max(1, total_steps - warmup), lr_min=spec.min_lr,
                             warmup_t=warmup, warmup_lr_init=min(WARMUP_LR_INIT, spec.lr), warmup_prefix=True,
                             t_in_epochs=False)


class StepClock:
    """Per-step times with no sync per step: CUDA events read at :meth:`collect`; ``perf_counter`` on the CPU."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self._open = None
        self._pending: list = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._open = self._now()

    def stop(self) -> None:
        self._pending.append((self._open, self._now()))

    def collect(self) -> list[float]:
        pending, self._pending = self._pending, []
        if not pending:
            return []
        if self.cuda:
            pending[-1][1].synchronize()  # the one CPU-GPU sync point of the interval
            return [a.elapsed_time(b) for a, b in pending]
        return [(b - a) * 1e3 for a, b in pending]


@torch.no_grad()
def evaluate(model, data, runtime) -> tuple[float, float]:
    """Top-1 (percent) and mean CE over ``data.val`` in eval mode (a distilled DeiT averages its heads)."""
    was_training = model.training
    model.eval()
    device = runtime.torch_device
    correct = torch.zeros((), dtype=torch.long, device=device)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    count = 0
    try:
        for images, labels in data.val_batches():
            with runtime.autocast():
                out = model(images)
            if isinstance(out, (tuple, list)):
                out = sum(out) / len(out)
            out = out.float()
            loss_sum += F.cross_entropy(out, labels, reduction="sum")
            correct += (out.argmax(dim=1) == labels).sum()
            count += labels.numel()
    finally:
        model.train(was_training)
    if not count:
        return float("nan"), float("nan")
    return correct.item() * 100.0 / count, loss_sum.item() / count  # the sync, once, after the loop


def grad_norm(parameters) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
