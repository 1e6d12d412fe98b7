"""The ``train`` job, read top to bottom: resolve the plan -> launch -> run the loop -> log and register.

:func:`train` resolves one :class:`TrainPlan` at its top; later steps read only the plan. Then this process
either launches torchrun (:func:`_launch_train`, as ``bench`` does: the launcher holds the one MLflow run, rank 0
hands its calls back) or trains (:func:`_train_in_run`). The loop's callbacks become MLflow calls off the
training thread (:class:`RunLogger`): curves per ``log_every`` steps, checkpoints (:class:`CheckpointUploader`),
then summary metrics, ``results.json`` and ``register_as``. Under DDP the curves carry the loss averaged and img/s
summed over the ranks (``ranks.json`` keeps each rank's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import shutil
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from vitreg.checkpoint import format as ckpt
from vitreg.config.spec import TrainSpec
from vitreg.console import CONSOLE_LOG, detail, progress, take_console
from vitreg.ddp import launcher as launch
from vitreg.ddp import world as distributed
from vitreg.ddp.context import JobContext, job_context
from vitreg.errors import VitregError, first_line
from vitreg.environment import capture_environment, pip_freeze
from vitreg.hardware.runtime import run_context
from vitreg.measure.estimate import say_if_long, train_work
from vitreg.measure.figures import Work
from vitreg.models.factory import ModelInfo, check_model_name, create_model
from vitreg.models.memory import check_batch_fits, check_ranks_fit
from vitreg.tracking import checkpoint_sources, model_registry, naming
from vitreg.tracking import runs as tracking
from vitreg.tracking.handoff import HandoffTracker
from vitreg.tracking.tags import resolved_tags, world_tags

CHECKPOINT_ARTIFACTS = "checkpoints"


def train(options: dict, experiment: str | None = None, run_name: str | None = None, progress=progress,
          command: str | None = None, *, placement: launch.Placement | None = None):
    """Train one model and log it as one MLflow run; returns the loop's TrainResult, or None in a process that
    launches torchrun (``nproc > 1`` or a ``placement`` over several hosts)."""
    run_node = (placement or launch.Placement()).run_node
    workdir = Path(tempfile.mkdtemp(prefix="vitreg-train-"))  # downloaded resume source + local checkpoints
    world = distributed.World()
    try:
        opened = (launch.rank_run(run_name, experiment) if distributed.inside_torchrun() else
                  launch.launcher_run(run_name, experiment, run_node))
        with opened as run:  # a refusal while the plan is resolved ends this run FAILED, with its error
            plan = resolve_plan(run, options, workdir, run_name=run_name, command=command, placement=placement,
                                progress=progress)
            if plan.launches:
                return _launch_train(plan)
            world = plan.world
            result = _train_in_run(plan)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if world.distributed:
        # Rank 0 gets here after its uploads: until then the other ranks wait, so torchrun never
        # sees the job "done" (or tears it down) while rank 0 is still handing back or logging.
        distributed.barrier()
        distributed.destroy()
    if world.is_main:  # rank 0 speaks for a DDP job
        _print_summary(result, run)
    return result


@dataclass(frozen=True)
class TrainPlan:
    """What every step after :func:`resolve_plan` reads. A launcher's plan stops at ``num_classes``."""

    options: dict  # as they came: a launcher forwards them to every rank
    spec: TrainSpec  # a resumed run's carries the checkpoint's seed
    run: object  # this process's tracker (None: a launcher on a node other than 0)
    run_name: str | None  # the name asked for; None: named from the title, then with the throughput
    command: str  # what the user typed, for results.json and the ranks' report.md
    placement: launch.Placement
    workdir: Path  # the downloaded resume source and the local checkpoints; removed when the job ends
    progress: Callable  # quiet on DDP ranks other than 0: rank 0 speaks for the job
    launches: bool  # this process launches torchrun and trains nothing itself
    num_classes: int  # the head size: num_classes, else the class folders of data
    ctx: JobContext | None = None  # a training process's world, hardware, runtime, wrap and reducer
    model: object = None  # the student, built with the seed: its facts (info) come from building it
    info: ModelInfo | None = None
    resume: object = None  # the VerifiedCheckpoint resume= names, checked against this model
    teacher: object = None  # the distillation teacher teacher= names (None without distillation)
    gflops: float | None = None  # GFLOPs of one training image (rank 0 counts them; None on the others)
    title: naming.RunTitle | None = None  # what the run's name says besides its batch and throughput

    @property
    def world(self) -> distributed.World:
        return self.ctx.world

    @property
    def runtime(self):
        return self.ctx.runtime

    @property
    def hardware(self):
        return self.ctx.hardware


def resolve_plan(run, options: dict, workdir: Path, *, run_name=None, command=None, placement=None,
                 progress=progress) -> TrainPlan:
    """The plan of this process: what needs no step is checked here, before any training or launch."""
    from vitreg.train.data import resolve_num_classes

    spec = TrainSpec.from_options(options)
    placement = placement or launch.Placement()
    launches = not distributed.inside_torchrun() and launch.needs_torchrun(spec.nproc, placement.nnodes)
    # who checks register_as against the registry: node 0's launcher; else rank 0, unless a vitreg launcher holds
    # the run (it checked already; its ranks never import mlflow, ~2.8 s of CPU, nor talk to the registry)
    registers = placement.node_rank == 0 if launches else distributed.is_main_process() and not launch.launched_by_vitreg()
    check_model_name(spec.model)  # fail here, once, rather than in every rank
    if registers and spec.register_as:  # a bad register_as fails before any training
        model_registry.check_registration(spec.register_as, spec.alias, spec.model)
    # data=PATH's layout, even where num_classes is given, and its image headers: once per job (a launcher or
    # rank 0), not in every rank
    data_classes = resolve_num_classes(spec.replace(num_classes=0), check_images=distributed.is_main_process())
    plan = TrainPlan(options, spec, run, run_name, launch.typed_command(command), placement, workdir, progress, launches,
                     num_classes=spec.num_classes or data_classes)
    if launches:
        if spec.resume and not spec.resume.startswith(("runs:/", "models:/")) and "://" not in spec.resume:
            resolve_checkpoint_source(spec.resume)  # a local path that does not exist
        return plan
    return _training_plan(plan, job_context(run, spec, progress, distributed.TrainReducer))


def _training_plan(plan: TrainPlan, ctx: JobContext) -> TrainPlan:
    import torch

    from vitreg.train import loop
    from vitreg.train.losses import check_distillable

    spec, runtime = plan.spec, ctx.runtime
    torch.manual_seed(spec.seed)  # the model's init, as --seed promises (DDP then copies rank 0's weights)
    model, info = create_model(spec.model, spec.img_size, plan.num_classes)
    check_batch_fits(info, spec.batch_size, ("train",), runtime.device, runtime.device_index, sdpa=spec.sdpa)  # before any step
    check_distillable(spec, info)
    resume = None
    if spec.resume:  # every rank reads it; verified here, once, and handed to the loop
        resume = resolve_checkpoint_source(spec.resume, plan.workdir / "resume", ctx.progress)
        spec = loop.resume_spec(spec, resume, info, ctx.progress)  # another model fails here, early
    hw = ctx.hardware
    title = naming.RunTitle(hw.label, spec.model, runtime.amp, spec.compile, ctx.world.world_size, job="train",
                            ran_on=hw.detected.profile.label if hw.mismatch else None, img_size=info.img_size)
    plan = dataclasses.replace(plan, spec=spec, progress=ctx.progress, ctx=dataclasses.replace(ctx, spec=spec),
                               model=model, info=info, resume=resume, title=title)
    plan = dataclasses.replace(plan, teacher=_teacher(plan))
    model.to(runtime.torch_device)  # in place: a Module's to() moves its own parameters
    return dataclasses.replace(plan, gflops=_flops_metrics(plan) if ctx.world.is_main else None)


def _teacher(plan: TrainPlan):
    """The distillation teacher, built before the data and the run's setup, so a bad teacher= fails early; on a
    forked RNG, so the student's data and dropout stream is the one it would be without a teacher."""
    if plan.spec.distillation == "none":  # TrainSpec holds a teacher exactly when it distills
        return None
    import torch

    from vitreg.train.losses import create_teacher

    with torch.random.fork_rng(devices=[]):
        return create_teacher(plan.spec, plan.info, plan.runtime.torch_device, plan.progress)


def _flops_metrics(plan: TrainPlan) -> float:
    """GFLOPs of one training image (student only), on a forked RNG."""
    import torch

    from vitreg.models.flops import train_flops_per_image
    from vitreg.train.losses import loss_of

    runtime = plan.runtime
    criterion = torch.nn.CrossEntropyLoss()
    devices = [runtime.device_index] if runtime.device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        flops = train_flops_per_image(plan.model, plan.info.img_size, runtime.torch_device,
                                      lambda out, y: loss_of(out, y, criterion))
    return flops / 1e9


def resolve_checkpoint_source(source: str, dst=None, progress=progress):
    """The verified checkpoint ``resume=`` names (a runs:/ or models:/ one downloaded into ``dst``)."""
    return checkpoint_sources.resolve_checkpoint(source, dst, what="resume", progress=progress).checkpoint


def _launch_train(plan: TrainPlan) -> None:
    spec = plan.spec
    gpus = launch.check(spec, plan.placement)
    # host memory for every rank, before any is started: past it the OOM killer takes the launcher
    check_ranks_fit(spec.nproc, spec.model, spec.img_size, plan.num_classes,
                    "cpu" if spec.device == "cpu" or not gpus else "cuda")
    job = launch.JobLaunch("train", plan.options, plan.run_name, plan.placement, plan.command)
    with launch.launch_job(plan.run, spec, job, plan.progress) as handoff:
        request = handoff.registration
        if plan.run is not None and request is not None:
            _register(plan.run, spec, request["path"], request["tags"])


def _train_in_run(plan: TrainPlan):
    from vitreg.train.data import build_data

    spec, world = plan.spec, plan.world
    data = build_data(spec, plan.info, plan.runtime.torch_device, model=plan.model, rank=world.rank,
                      world_size=world.world_size)
    if world.is_main:
        from vitreg.train import loop

        _log_setup(plan, data)
        steps = loop.total_steps_of(spec, data.steps_per_epoch)
        say_if_long(train_work(spec.batch_size * world.world_size, steps, plan.gflops * 1e9, spec.model),
                    plan.runtime.device, plan.progress, command=plan.command)
    logger = RunLogger(plan.run)
    ok, stop = False, None
    try:
        try:
            with run_context(plan.runtime, plan.model, spec.sdpa, spec.compile_cache, train=True):
                result = _run_loop(plan, logger, data)
        except KeyboardInterrupt as exc:  # stopped between updates: log what was done, then end the run KILLED
            result, stop = getattr(exc, "partial_result", None), exc
            if result is None:
                raise
        result = _completed(plan, result)
        if world.is_main:
            _log_results(plan, logger, data, result,
                         register=stop is None)  # a stopped run's model is not the one register_as asked for
            throughput = result.figure("throughput_img_per_s")
            if not plan.run_name and throughput:  # now with the figure: the runs list reads at a glance
                plan.run.set_name(_run_name(plan, throughput))
            plan.run.log_text(take_console(), CONSOLE_LOG)  # what -v would have printed too
        ok = True
    finally:
        logger.close(timeout=None if ok else 60)  # on the error path, do not hang on a dead server
    if stop is not None:
        raise stop
    return result


def _run_loop(plan: TrainPlan, logger: RunLogger, data):
    from vitreg.train import loop

    spec, world, ctx = plan.spec, plan.world, plan.ctx
    bar = ProgressBar(loop.total_steps_of(spec, data.steps_per_epoch), initial=plan.resume.step if plan.resume else 0,
                      progress=plan.progress, enabled=world.is_main)

    def on_log(step, metrics):
        bar.log(step, metrics)
        logger.metrics(metrics, step)

    def on_epoch_end(epoch, metrics):
        if "val_top1" in metrics:
            bar.message(f"epoch {epoch}: val top-1 {metrics['val_top1']:.2f}%")
        logger.metrics({k: v for k, v in metrics.items() if k != "epoch"}, epoch * data.steps_per_epoch)

    hooks = loop.Hooks(bar.step, on_log, CheckpointUploader(logger, spec.keep_checkpoints), on_epoch_end, bar.message)
    ranks = loop.Ranks(world.world_size, world.rank, world.is_main, ctx.wrap, ctx.reducer)
    checkpoints = loop.Checkpoints(plan.workdir / CHECKPOINT_ARTIFACTS, plan.resume, {"run_id": plan.run.run_id})
    try:
        return loop.train(spec, plan.runtime, plan.model, plan.info,
                          sources=loop.Sources(data, plan.teacher), checkpoints=checkpoints, hooks=hooks,
                          ranks=ranks)
    finally:
        bar.close()  # before the results are logged, so their lines print below the bar


def _completed(plan: TrainPlan, result):
    """The result with the job-level figures (work per image, TFLOP/s, MFU), computed as bench computes them."""
    figures = result.figures.with_values(gflops_per_img=plan.gflops, params_m=plan.info.params_m if plan.gflops else None)
    work = Work.of(plan.runtime, plan.hardware, result.world_size)
    return dataclasses.replace(result, figures=figures.completed(work))


def _log_setup(plan: TrainPlan, data) -> None:
    run, spec, hw, runtime, world, info = plan.run, plan.spec, plan.hardware, plan.runtime, plan.world, plan.info
    resumed_run = plan.resume.spec.get("run_id") if plan.resume else None
    if isinstance(resumed_run, str):  # the run that saved the checkpoint this one resumes
        run.set_tags({tracking.RESUMED_FROM_TAG: resumed_run})
        tracking.close_resumed(resumed_run, run.run_id, plan.progress)
    env = capture_environment()
    run.set_name(plan.run_name or _run_name(plan))
    run.set_tags({**env.to_tags(), **_train_tags(plan, data.kind), **world_tags(world, runtime, env, spec)})
    params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
              "img_size": info.img_size, "num_classes": info.num_classes}
    skipped = run.log_params(params)
    tracking.note_skipped_params(skipped, functools.partial(detail, say=plan.progress))  # the params echo: the log's
    ddp = f", {world.world_size} ranks ({world.backend})" if world.distributed else ""
    plan.progress(f"run {run.run_id} at {tracking.tracking_uri()}; {spec.model} ({info.params_m:.1f} M params, "
                  f"{info.img_size}px, {info.num_classes} classes) on {runtime.device} ({plan.ctx.detected.name})"
                  f"{ddp}, amp={runtime.amp}, compile={spec.compile}, data={data.kind}")
    run.log_text(env.to_json(), "environment.json")
    run.log_text(pip_freeze(), "pip_freeze.txt")


def _train_tags(plan: TrainPlan, data_kind: str) -> dict:
    spec, runtime, info = plan.spec, plan.runtime, plan.info
    return {**resolved_tags(spec, plan.hardware, runtime, info.img_size, task="train"), "vitreg_job": "train",
            "precision": runtime.precision.label,  # what ran: fp32, tf32, autocast-bf16, autocast-fp16
            "sdpa": spec.sdpa, "num_classes": info.num_classes, "data": data_kind, "distillation": spec.distillation,
            "teacher": spec.teacher or None, "resumed_from": spec.resume or None}


def _run_name(plan: TrainPlan, throughput: float | None = None) -> str:
    return plan.title.name(plan.spec.batch_size, throughputs={"train": throughput} if throughput else None)


def _log_results(plan: TrainPlan, logger: RunLogger, data, result, register=True) -> None:
    run, spec, hw, runtime, info = plan.run, plan.spec, plan.hardware, plan.runtime, plan.info
    metrics = result.metrics()
    logger.metrics(metrics)
    logger.flush()  # every checkpoint is logged before results.json says where the last one is
    results = {
        "spec": spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
        "model": asdict(info), "data": data.kind, "result": result.to_dict(), "metrics": metrics,
        "checkpoint": run.artifact_uri(f"{CHECKPOINT_ARTIFACTS}/last") if result.last_checkpoint else None,
        "command": plan.command,
    }
    run.log_dict(results, "results.json")
    if plan.ctx.reducer is not None:
        run.log_dict({"train": plan.ctx.reducer.per_rank}, "ranks.json")  # each rank's own figures: stragglers show
    if not register:
        return
    reg_tags = {"model": spec.model, "gpu": hw.label, "img_size": info.img_size,
                "num_classes": info.num_classes, "steps": result.step, "source_run_id": run.run_id,
                "train_final_loss": result.figure("final_loss"), "val_top1": result.figure("val_top1")}
    _register(run, spec, result.last_checkpoint, reg_tags)


def _register(tracker, spec: TrainSpec, checkpoint_dir, tags: dict):
    """Register the logged final checkpoint as ``register_as`` (None when unset); under a vitreg launcher rank 0
    hands the request back and the launcher calls this with its run."""
    if not spec.register_as:
        return None
    if checkpoint_dir is None:
        raise VitregError(f"register_as={spec.register_as} but this run wrote no checkpoint")
    try:
        if isinstance(tracker, HandoffTracker):  # rank 0 under a vitreg launcher: the launcher registers
            return tracker.hand_back_registration(Path(checkpoint_dir), spec.register_as, spec.alias, tags)
        return model_registry.register_checkpoint(tracker, Path(checkpoint_dir), spec.register_as, spec.alias, tags)
    except VitregError as exc:
        # the training is done and its checkpoint logged: say how to register it once the cause is fixed
        raise VitregError(f"{exc} (the checkpoint is logged: once fixed, `vitreg register "
                          f"runs:/{tracker.run_id}/{CHECKPOINT_ARTIFACTS}/last --name {spec.register_as}"
                          + (f" --alias {spec.alias}`)" if spec.alias.lower() != "latest" else "`)")) from None


def _print_summary(result, run) -> None:
    def fmt(value, spec=",.1f"):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    top1 = result.figure("val_top1")
    print(f"trained {result.steps_run} steps (to step {result.step}/{result.total_steps}); final loss "
          f"{fmt(result.figure('final_loss'), '.4f')}; {fmt(result.figure('throughput_img_per_s'))} img/s, step p50 "
          f"{fmt(result.figure('step_ms_p50'), '.2f')} ms, data wait {fmt(result.figure('data_wait_frac'), '.1%')}"
          + (f"; val top-1 {top1:.2f}%" if top1 is not None else ""))
    if result.last_checkpoint:
        print(f"checkpoint: {run.artifact_uri(CHECKPOINT_ARTIFACTS + '/last')}")
    print(tracking.where_logged(run))


class RunLogger:
    """MLflow calls for one run, in order, on one daemon thread when the tracker is thread-safe, else at once.
    An error in the thread is raised at the next :meth:`submit` or at :meth:`close`."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.threaded = bool(getattr(tracker, "thread_safe", False))  # a NullTracker's is False: no thread for it
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = None
        if self.threaded:
            self._thread = threading.Thread(target=self._work, name="vitreg-mlflow-logger", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    fn, args = item
                    fn(*args)
            except BaseException as exc:  # keep the first; the training thread raises it
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, VitregError):
                raise error
            raise VitregError(f"logging to MLflow at {tracking.tracking_uri()} failed: {type(error).__name__}: "
                              f"{first_line(error)}") from error

    def submit(self, fn, *args) -> None:
        if not self.threaded:
            fn(*args)
            return
        self._raise()
        self._queue.put((fn, args))

    def metrics(self, metrics: dict, step: int | None = None) -> None:
        self.submit(self.tracker.log_metrics, dict(metrics), step)

    def flush(self) -> None:
        if self.threaded:
            self._queue.join()
            self._raise()

    def close(self, timeout: float | None = None) -> None:
        """Drain and stop the thread (``timeout`` seconds at most, on the error path)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None
        self._raise()


class CheckpointUploader:
    """Logs ``checkpoints/step-<N>``, then points ``last`` at it, then deletes all but the newest ``keep`` (0: all
    kept) and older local copies: in that order, so a kill at any point leaves ``last`` naming a whole folder."""

    def __init__(self, logger: RunLogger, keep: int = 1):
        self.logger = logger
        self.keep = keep
        self._uploaded: list[Path] = []
        self._kept: list[int] = []  # the steps this run holds under checkpoints/, oldest first

    def __call__(self, step: int, path: Path) -> None:
        self.logger.submit(self._upload, step, Path(path))

    def _upload(self, step: int, path: Path) -> None:
        tracker = self.logger.tracker
        tracker.log_artifacts(path, f"{CHECKPOINT_ARTIFACTS}/{ckpt.step_folder(step)}")
        tracker.log_text(ckpt.last_pointer(step), f"{CHECKPOINT_ARTIFACTS}/{ckpt.LAST}")
        self._kept = [s for s in self._kept if s != step] + [step]
        while self.keep and len(self._kept) > self.keep:
            tracker.delete_artifacts(f"{CHECKPOINT_ARTIFACTS}/{ckpt.step_folder(self._kept.pop(0))}")
        for old in self._uploaded:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        self._uploaded = [path]


class ProgressBar:
    """A tqdm bar on a terminal (step, loss, img/s); plain lines at each log when stderr is not a terminal."""

    def __init__(self, total: int, initial: int = 0, progress=progress, enabled: bool = True):
        self.total = total
        self.progress = progress
        self.enabled = enabled  # False on DDP ranks other than 0: rank 0 speaks for the job
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True,
                            desc="train")

    def step(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        loss, ips = metrics.get("train_loss"), metrics.get("train_img_per_s")
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{ips:,.0f}" if ips else "-", refresh=False)
            return
        line = f"[vitreg] step {step}/{self.total}  loss {loss:.4f}  " + (f"{ips:,.1f} img/s" if ips else "")
        print(line, file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"[vitreg] {text}", file=sys.stderr)
        else:
            self.progress(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
