"""The training loop: AdamW + warm-up/cosine LR, AMP, compile, DeiT distillation, checkpoints, callbacks.

No MLflow here (DESIGN.md: runners never log). :func:`train` reports through callbacks, which
:mod:`vitreg.train.job` turns into batched MLflow calls, and returns a typed :class:`TrainResult`:

- ``on_step(step)`` after every optimizer update: host-only, for a progress bar; it gets no values,
  because reading a loss off the GPU would be a CPU-GPU sync every step.
- ``on_log(step, metrics)`` every ``log_every`` updates and at the end, with ``train_loss`` (mean
  over the interval), ``lr``, ``train_img_per_s``, ``grad_norm``, ``data_wait_frac``, ``epoch``.
  This is the one sync point of an interval: per-step CUDA events recorded in the interval are read
  here, so timing never adds a sync inside a step.
- ``on_checkpoint(step, path)`` after a checkpoint directory is written (every ``checkpoint_every``
  updates and at the end).
- ``on_epoch_end(epoch, metrics)`` at each epoch boundary, with ``val_top1``/``val_loss`` when the
  data has a ``val/`` split.

Throughput is measured as bench's train task measures it: the first step (compilation, lazy init)
is timed apart, the next steps are a warm-up, and the rest are timed per step (CUDA events on the
GPU, ``perf_counter`` on the CPU); ``throughput_img_per_s`` is images over the sum of those step
times, so checkpoint writes, validation and logging between steps are not counted.

DDP: pass ``wrap`` (a function that wraps the model, e.g. in DistributedDataParallel; applied before
torch.compile, as bench does), ``world_size``/``rank`` (data sharding), ``is_main=False`` on ranks
that must not write checkpoints or run validation, and ``reducer`` (a
:class:`vitreg.dist.world.TrainReducer`): at each log boundary it all-reduces the interval's loss
(mean over ranks) and img/s (sum), one collective per boundary and none per step; at the end the
job's throughput is the sum of the ranks' and its step time the slowest rank's. Every rank must
make the same number of steps (the data gives each rank the same number of batches).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from vitreg.train import checkpoint as ckpt
from vitreg.console import progress
from vitreg.errors import VitregError
from vitreg.bench.runner import loss_of
from vitreg.measure.timing import summarize, synchronize

THROUGHPUT_WARMUP_STEPS = 10  # as BenchSpec.warmup: steps after the first that are not timed into the result
WARMUP_LR_INIT = 1e-6  # DeiT's warmup_lr: where the linear warm-up starts


# --------------------------------------------------------------------------- loss


class DistillationLoss(torch.nn.Module):
    """DeiT's distillation loss (facebookresearch/deit ``losses.py``), unchanged in substance.

    ``outputs`` is ``(class_head, dist_head)`` for a distilled model in training mode. The base
    criterion trains the class head on the labels; the distillation head learns from the teacher:

    - ``none``: base loss only;
    - ``soft``: KL(student_dist/tau || teacher/tau) * tau^2, summed and divided by the number of logits;
    - ``hard``: cross-entropy of the distillation head against the teacher's argmax;

    and the loss is ``(1 - alpha) * base + alpha * distillation``. The teacher runs under
    ``torch.no_grad`` (and under whatever autocast the caller opened, so it shares the student's
    precision).
    """

    def __init__(self, base_criterion, teacher_model, distillation_type: str, alpha: float, tau: float):
        super().__init__()
        if distillation_type not in ("none", "soft", "hard"):
            raise ValueError(f"distillation_type {distillation_type!r}")
        self.base_criterion = base_criterion
        self.teacher_model = teacher_model
        self.distillation_type = distillation_type
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            outputs, outputs_kd = outputs  # (class head, distillation head)
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == "none":
            return base_loss
        if outputs_kd is None:
            raise ValueError("distillation needs a model that returns (class, distillation) outputs in training: "
                             "a deit_*_distilled_* model with set_distilled_training(True)")
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)
        if self.distillation_type == "soft":
            T = self.tau
            # log_target=True: both sides are log-probabilities, which is stabler than probabilities
            distillation_loss = F.kl_div(
                F.log_softmax(outputs_kd / T, dim=1),
                F.log_softmax(teacher_outputs / T, dim=1),
                reduction="sum",
                log_target=True,
            ) * (T * T) / outputs_kd.numel()
        else:
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
        return base_loss * (1 - self.alpha) + distillation_loss * self.alpha


class TwoHeadLoss(torch.nn.Module):
    """``distillation=none`` on a distilled DeiT: both heads on the labels, averaged (bench's train loss).

    DeiT itself trains only the class head then, leaving the distillation head random while the
    eval output averages the two; training both keeps the eval output meaningful and the step
    identical to what ``vitreg bench`` times.
    """

    def __init__(self, base_criterion):
        super().__init__()
        self.base_criterion = base_criterion

    def forward(self, inputs, outputs, labels):
        return loss_of(outputs, labels, self.base_criterion)


def check_distillable(spec, info) -> None:
    """DeiT distillation trains the distillation token's head: the student must have one."""
    if spec.distillation != "none" and not info.distilled:
        raise VitregError(f"distillation={spec.distillation} needs a distillation token, which {info.name} lacks: "
                          f"use a deit_*_distilled_* model (e.g. deit_tiny_distilled_patch16_224) or distillation=none")


def build_criterion(spec, info, teacher=None):
    """``criterion(inputs, outputs, labels)`` for the spec: label-smoothed CE, with DeiT distillation."""
    # torch's label_smoothing is the same loss as timm's LabelSmoothingCrossEntropy
    # ((1 - s) * NLL + s * mean(-log p)) and compiles without a custom op
    base = torch.nn.CrossEntropyLoss(label_smoothing=spec.label_smoothing)
    if spec.distillation == "none":
        return TwoHeadLoss(base)
    check_distillable(spec, info)
    if teacher is None:
        raise VitregError(f"distillation={spec.distillation} needs teacher=...: a timm name, models:/<name>@<alias> "
                          f"or a checkpoint directory")
    return DistillationLoss(base, teacher, spec.distillation, spec.distill_alpha, spec.distill_tau)


def create_teacher(spec, info, device, loader: Callable | None = None, progress=progress):
    """The teacher for ``spec.teacher``, in eval mode on ``device``, without gradients.

    - ``models:/...`` or ``runs:/...``: ``loader(uri)`` (the registry's loader, passed in so the engine
      does not import the registry); it returns a module or a ``(module, ...)`` tuple;
    - a local checkpoint directory: :func:`vitreg.train.checkpoint.load_model`;
    - otherwise a timm model name, built with **random weights** (vitreg never downloads from a
      hub): fine for timing distillation, useless for accuracy. For a real teacher, train or
      register one and pass its ``models:/`` URI.
    """
    from vitreg.models.factory import create_model

    name = spec.teacher
    if "://" in name or name.startswith(("models:/", "runs:/")):
        if loader is None:
            raise VitregError(f"teacher={name} needs the model registry loader (vitreg.tracking.registry.load_model), "
                              f"which is not available here: pass a checkpoint directory or a timm name")
        loaded = loader(name)
        teacher = loaded[0] if isinstance(loaded, (tuple, list)) else loaded
    elif Path(name).expanduser().is_dir():
        teacher, _, _ = ckpt.load_model(Path(name).expanduser())
    else:
        teacher, _ = create_model(name, info.img_size, info.num_classes)
        progress(f"teacher {name} has random weights (vitreg builds timm models with pretrained=False): "
                 f"distillation from it only exercises the code path; pass teacher=models:/<name>@<alias> "
                 f"for a trained teacher")
    classes = getattr(teacher, "num_classes", None)
    if isinstance(classes, int) and classes != info.num_classes:
        raise VitregError(f"teacher {name} has {classes} classes, the student {info.num_classes}: "
                          f"use a teacher trained on the same classes (or num_classes={classes})")
    teacher = teacher.to(device).eval()
    teacher.requires_grad_(False)
    return teacher


# --------------------------------------------------------------------------- optimizer and schedule


def build_optimizer(model, spec, runtime):
    """AdamW, weight decay off for biases, norms, position embeddings and tokens (as DeiT/timm).

    ``fused=True`` on CUDA: one kernel for all parameters, and it reads GradScaler's scale and inf
    flag on the device, so an fp16 step needs no host sync for the inf check.
    """
    from timm.optim import param_groups_weight_decay

    no_decay = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    groups = param_groups_weight_decay(model, spec.weight_decay, no_weight_decay_list=no_decay)
    kwargs = {"fused": True} if runtime.device == "cuda" else {}
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.999), **kwargs)


def build_scheduler(optimizer, spec, total_steps: int):
    """timm's CosineLRScheduler, stepped per update: linear warm-up from 1e-6 over ``warmup_steps``, then a
    cosine from ``lr`` to ``min_lr`` over the remaining ``total_steps - warmup_steps`` updates.

    Update ``u`` (0-based) runs at ``lr_at(u)``: call ``scheduler.step_update(u + 1)`` after it.
    """
    from timm.scheduler import CosineLRScheduler

    warmup = min(spec.warmup_steps, max(total_steps - 1, 0))  # a run shorter than its warm-up still decays
    return CosineLRScheduler(optimizer, t_initial=max(1, total_steps - warmup), lr_min=spec.min_lr,
                             warmup_t=warmup, warmup_lr_init=min(WARMUP_LR_INIT, spec.lr), warmup_prefix=True,
                             t_in_epochs=False)


def resume_spec(spec, resume_from, info, progress=progress):
    """The spec a resumed run trains with: this one, with the checkpoint's ``seed``.

    The seed defines the synthetic data set (its class prototypes) and the sample order of an
    ImageFolder, so continuing with another one would train on another task. Refuses a checkpoint of
    another model (name, img_size, num_classes).
    """
    spec_json = ckpt.check_compatible(resume_from, info)
    saved = spec_json.get("train_spec", {}).get("seed")
    if saved is not None and str(saved) != str(spec.seed):
        progress(f"resuming with the checkpoint's seed={saved}, not seed={spec.seed}: the seed defines the "
                 f"synthetic data and the sample order")
        spec = spec.replace(seed=int(saved))
    return spec


def total_steps_of(spec, steps_per_epoch: int) -> int:
    return spec.steps if spec.steps > 0 else spec.epochs * steps_per_epoch


# --------------------------------------------------------------------------- result


@dataclass(frozen=True)
class TrainResult:
    """What a training run did and how fast. Throughput is global (all ranks), images per second."""

    final_loss: float  # mean train loss of the last logged interval
    step: int  # optimizer updates reached, counting those before a resume
    start_step: int  # 0, or the step the run resumed at
    steps_run: int  # updates made by this run
    epoch: int  # completed epochs
    total_steps: int
    steps_per_epoch: int
    batch_size: int  # per process
    world_size: int
    images: int  # images trained on by this run, all ranks
    throughput_img_per_s: float | None  # after the first step and the warm-up
    step_ms_p50: float | None
    step_ms_p90: float | None
    measured_steps: int
    data_wait_frac: float | None  # host time blocked on the loader / step time, same steps
    first_step_s: float  # the first step alone: compilation (if any) + lazy init
    compile_time_s: float | None  # first_step_s when compile is on
    val_top1: float | None  # percent, last evaluation
    val_loss: float | None
    last_checkpoint: str | None

    def metrics(self) -> dict[str, float]:
        m = {
            "train_final_loss": self.final_loss,
            "train_throughput_img_per_s": self.throughput_img_per_s,
            "train_step_ms_p50": self.step_ms_p50,
            "train_step_ms_p90": self.step_ms_p90,
            "train_data_wait_frac": self.data_wait_frac,
            "train_first_step_s": self.first_step_s,
            "compile_time_s": self.compile_time_s,
            "val_top1": self.val_top1,
            "val_loss": self.val_loss,
            "train_images": float(self.images),
            "train_steps": float(self.step),
        }
        if self.world_size > 1 and self.throughput_img_per_s is not None:
            m["train_world_size"] = float(self.world_size)
            m["train_throughput_img_per_s_per_gpu"] = self.throughput_img_per_s / self.world_size
        return {k: v for k, v in m.items() if v is not None}

    def to_dict(self) -> dict:
        return {**asdict(self), "metrics": self.metrics()}


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, data, runtime) -> tuple[float, float]:
    """Top-1 (percent) and mean CE over ``data.val``, on the plain model in eval mode (a distilled DeiT
    averages its two heads there)."""
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


# --------------------------------------------------------------------------- timing


class _StepClock:
    """Per-step times without a sync per step: CUDA events recorded around each step, read in a batch
    at :meth:`collect` (the log boundary); ``perf_counter`` on the CPU, where work is synchronous."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self._open = None
        self._pending: list = []

    def start(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open = event
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending.append((self._open, event))
        else:
            self._pending.append((self._open, time.perf_counter()))

    def collect(self) -> list[float]:
        """Milliseconds of each step since the last collect; synchronises on the last event (CUDA)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        if self.cuda:
            pending[-1][1].synchronize()  # the one CPU-GPU sync point of the interval
            return [a.elapsed_time(b) for a, b in pending]
        return [(b - a) * 1e3 for a, b in pending]


def _grad_norm(parameters) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


# --------------------------------------------------------------------------- the loop


def train(spec, runtime, model, info, *, data=None, teacher=None, teacher_loader: Callable | None = None,
          checkpoint_dir=None, resume_from=None, checkpoint_extra: dict | None = None,
          on_step: Callable | None = None, on_log: Callable | None = None, on_checkpoint: Callable | None = None,
          on_epoch_end: Callable | None = None, wrap: Callable | None = None, world_size: int = 1, rank: int = 0,
          sampler_factory: Callable | None = None, is_main: bool = True, reducer=None,
          progress=progress) -> TrainResult:
    """Train ``model`` (built by :func:`vitreg.models.factory.create_model`, described by ``info``) as ``spec`` says.

    ``data`` defaults to :func:`vitreg.train.data.build_data`; ``teacher`` to :func:`create_teacher` when
    the spec distills. ``checkpoint_dir``: where ``step-<N>/`` checkpoint directories are written
    (None: no checkpoints). ``resume_from``: a checkpoint directory to continue from, at its step,
    with its optimizer, LR schedule, scaler and RNG states.
    """
    from vitreg.train.data import build_data

    device = runtime.torch_device
    model = model.to(device)
    model.train()
    if resume_from:
        spec = resume_spec(spec, Path(resume_from), info, progress)
    if data is None:
        data = build_data(spec, info, device, model=model, rank=rank, world_size=world_size,
                          sampler_factory=sampler_factory)
    if data.num_classes != info.num_classes:
        raise VitregError(f"the data has {data.num_classes} classes, the model head {info.num_classes}: "
                          f"pass num_classes=0 to take it from the data")
    spe = max(1, int(data.steps_per_epoch))
    total = total_steps_of(spec, spe)
    check_distillable(spec, info)
    if spec.distillation != "none" and teacher is None:
        teacher = create_teacher(spec, info, device, teacher_loader, progress)
    criterion = build_criterion(spec, info, teacher)
    if info.distilled and hasattr(model, "set_distilled_training"):
        model.set_distilled_training(True)  # DeiT: training returns (class, distillation) outputs

    optimizer = build_optimizer(model, spec, runtime)
    scheduler = build_scheduler(optimizer, spec, total)
    scaler = runtime.grad_scaler()
    start_step = 0
    if resume_from:
        resume_from = Path(resume_from)
        fresh = {k: getattr(scheduler, k) for k in ("t_initial", "warmup_t", "lr_min", "base_values")}
        start_step, _ = ckpt.load_training_state(resume_from, model, optimizer, scheduler, scaler)
        if start_step >= total:
            raise VitregError(f"checkpoint {resume_from} is at step {start_step}, and this run trains {total} steps "
                              f"in all: pass steps > {start_step} (steps count from the start, not the resume)")
        loaded = {k: getattr(scheduler, k) for k in fresh}
        if loaded != fresh:
            progress(f"resuming with the checkpoint's LR schedule (warm-up {loaded['warmup_t']}, cosine over "
                     f"{loaded['t_initial']} steps to {loaded['lr_min']:g}), not this run's")
        scheduler.step_update(start_step)  # the LR of update start_step, exactly as the first run had it
        progress(f"resumed from {resume_from} at step {start_step} (epoch {start_step // spe})")

    net = wrap(model) if wrap else model
    net = runtime.compile_model(net)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = spec.clip_grad
    images_per_step = spec.batch_size * world_size
    checkpoints = checkpoint_dir is not None  # on every rank: when rank 0 saves, the others wait for it
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None and is_main else None
    has_val = getattr(data, "val", None) is not None
    clock = _StepClock(runtime.device)

    step = start_step
    last_checkpoint = None
    step_ms: list[float] = []  # every step of this run, in order
    waits: list[float] = []  # host seconds blocked on the data iterator, per step
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    interval_steps = 0
    interval_waits: list[float] = []
    final_loss = float("nan")
    norm = None
    first_step_s = 0.0
    val_top1 = val_loss = None
    evaluated_at = None
    batches = None

    def save(at_step: int) -> None:
        nonlocal last_checkpoint
        extra = {"classes": list(data.classes) if data.kind == "folder" else None, "data": data.kind,
                 "train_loss": final_loss if math.isfinite(final_loss) else None, "world_size": world_size,
                 **(checkpoint_extra or {})}
        path = ckpt.save_checkpoint(checkpoint_dir / f"step-{at_step}", model, optimizer=optimizer,
                                    scheduler=scheduler, scaler=scaler, step=at_step, epoch=at_step // spe,
                                    spec=spec.to_params(), model_info=info, extra=extra)
        last_checkpoint = str(path)
        if on_checkpoint:
            on_checkpoint(at_step, path)

    def run_val(at_step: int) -> None:
        nonlocal val_top1, val_loss, evaluated_at
        val_top1, val_loss = evaluate(model, data, runtime)
        evaluated_at = at_step

    try:
        while step < total:
            if batches is None:
                batches = data.batches(step // spe, step % spe)
            first = step == start_step
            if first:
                synchronize(runtime.device)
                t_first = time.perf_counter()
            clock.start()
            t0 = time.perf_counter()
            try:
                images, labels = next(batches)
            except StopIteration:  # a custom sampler with fewer batches than steps_per_epoch: next epoch
                batches = data.batches(step // spe + 1, 0)
                images, labels = next(batches)
            wait = time.perf_counter() - t0

            runtime.mark_step()
            with runtime.autocast():
                outputs = net(images)
                loss = criterion(images, outputs, labels)
            scaler.scale(loss).backward()
            boundary = (step + 1) % spec.log_every == 0 or step + 1 == total
            if clip > 0 or boundary:
                scaler.unscale_(optimizer)  # true gradients for the norm (fp16); step() knows they are unscaled
                norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip > 0 else _grad_norm(params)
            lr_used = optimizer.param_groups[0]["lr"]
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float()  # stays on the device: no sync
            clock.stop()
            step += 1
            scheduler.step_update(step)
            if first:
                synchronize(runtime.device)
                first_step_s = time.perf_counter() - t_first
            interval_steps += 1
            interval_waits.append(wait)
            if on_step:
                on_step(step)

            if boundary:
                times = clock.collect()  # syncs (CUDA) once for the interval
                step_ms.extend(times)
                waits.extend(interval_waits)
                seconds = sum(times) / 1e3
                if reducer is not None:  # one all-reduce: the job's mean loss and summed img/s
                    local_rate = spec.batch_size * len(times) / seconds if seconds > 0 else None
                    final_loss, img_per_s = reducer.interval(loss_sum / interval_steps, local_rate)
                else:
                    final_loss = (loss_sum / interval_steps).item()
                    img_per_s = images_per_step * len(times) / seconds if seconds > 0 else None
                if not math.isfinite(final_loss):  # the same (reduced) value on every rank: all stop here
                    raise VitregError(f"the training loss became {final_loss} by step {step}: lower lr (now "
                                      f"{spec.lr:g}), set clip_grad=1.0, or use amp=bf16 instead of fp16")
                metrics = {
                    "train_loss": final_loss,
                    "lr": lr_used,
                    "train_img_per_s": img_per_s,
                    "grad_norm": float(norm) if norm is not None else None,
                    "data_wait_frac": min(1.0, sum(interval_waits) / seconds) if seconds > 0 else None,
                    "epoch": step / spe,
                }
                loss_sum.zero_()
                interval_steps = 0
                interval_waits = []
                if on_log:
                    on_log(step, {k: v for k, v in metrics.items() if v is not None})

            epoch_done = step % spe == 0
            if epoch_done:
                batches = None
                epoch_metrics = {"epoch": step // spe}
                if is_main and getattr(data, "val", None) is not None:
                    run_val(step)
                    epoch_metrics.update(val_top1=val_top1, val_loss=val_loss)
                if on_epoch_end:
                    on_epoch_end(step // spe, epoch_metrics)
            checkpoint_due = checkpoints and (
                step == total or bool(spec.checkpoint_every and step % spec.checkpoint_every == 0))
            if checkpoint_dir is not None and checkpoint_due:
                if step == total and is_main and has_val and evaluated_at != step:
                    run_val(step)  # the checkpoint carries the final val_top1
                save(step)
            if reducer is not None and step < total and (checkpoint_due or (epoch_done and has_val)):
                # rank 0 validated or saved between steps, outside its clock; without this the other
                # ranks would wait for it inside their next timed step (in DDP's all-reduce)
                reducer.align()
        if is_main and getattr(data, "val", None) is not None and evaluated_at != step:
            run_val(step)
    except torch.OutOfMemoryError:
        if runtime.device == "cuda":
            torch.cuda.empty_cache()
        raise VitregError(f"training with batch_size={spec.batch_size} ran out of GPU memory: use a smaller "
                          f"batch_size (e.g. {max(1, spec.batch_size // 2)})") from None
    finally:
        if info.distilled and hasattr(model, "set_distilled_training"):
            model.set_distilled_training(False)
    synchronize(runtime.device)

    steps_run = step - start_step
    warm = 0 if steps_run <= 1 else 1 + min(THROUGHPUT_WARMUP_STEPS, (steps_run - 1) // 2)
    measured = step_ms[warm:]
    measured_s = sum(measured) / 1e3
    stats = summarize(measured) if measured else None
    figures = {  # this rank's
        "throughput_img_per_s": spec.batch_size * len(measured) / measured_s if measured_s > 0 else None,
        "step_ms_p50": stats.median if stats else None, "step_ms_p90": stats.p90 if stats else None,
        "data_wait_frac": min(1.0, sum(waits[warm:]) / measured_s) if measured_s > 0 else None,
        "first_step_s": first_step_s, "measured_steps": len(measured),
    }
    if reducer is not None:
        figures = reducer.figures(figures)  # sum of the ranks' rates, the slowest rank's times
    elif figures["throughput_img_per_s"] is not None:
        figures["throughput_img_per_s"] *= world_size  # no reducer: every rank assumed as fast as this one
    return TrainResult(
        final_loss=final_loss, step=step, start_step=start_step, steps_run=steps_run, epoch=step // spe,
        total_steps=total, steps_per_epoch=spe, batch_size=spec.batch_size, world_size=world_size,
        images=steps_run * images_per_step,
        throughput_img_per_s=figures["throughput_img_per_s"],
        step_ms_p50=figures["step_ms_p50"], step_ms_p90=figures["step_ms_p90"],
        measured_steps=int(figures["measured_steps"]), data_wait_frac=figures["data_wait_frac"],
        first_step_s=figures["first_step_s"],
        compile_time_s=figures["first_step_s"] if runtime.compile != "off" else None,
        val_top1=val_top1, val_loss=val_loss, last_checkpoint=last_checkpoint,
    )
