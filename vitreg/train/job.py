"""The ``train`` job: options -> TrainSpec -> hardware -> runtime -> loop -> results -> tracking.

The same shape as :mod:`vitreg.bench.job`. The loop (:mod:`vitreg.train.loop`) reports through
callbacks; :mod:`vitreg.train.run_logger` turns them into MLflow calls that never run inside a step:

- curves (``train_loss``, ``lr``, ``train_img_per_s``, ``grad_norm``, ``data_wait_frac``, ``epoch``,
  ``val_top1``) as one ``log_metrics`` batch per ``log_every`` steps;
- checkpoints as run artifacts ``checkpoints/step-<N>/`` and then ``checkpoints/last/`` (so ``last`` is
  always the newest, and a process killed while ``last`` is copied still leaves an intact
  ``step-<N>``);
- the summary metrics, ``results.json``, environment and pip freeze at the end.

Those calls go through one background thread (in order) when the tracker is bound to its run id
(``Tracker.thread_safe``; MLflow's active run is thread-local, so a fluent call from another thread
would open a new run); otherwise they run inline at the log boundary, still outside any timed step.

Checkpoint sources (``resume=``, ``teacher=``) go through the one resolver,
:func:`vitreg.tracking.checkpoint_sources.resolve_checkpoint`; registration (``register_as``) through
:mod:`vitreg.train.registration`.

DDP (``nproc > 1``), as ``bench`` does it: the process the user started becomes the launcher
(:func:`_launch_train`). It holds the one MLflow run (or resumes ``mlflow run``'s), checks what
needs no GPU (model name, data layout, ``nproc`` against the visible GPUs; any ``nproc`` on the
CPU, with gloo), and runs the same ``train`` under torchrun through
:func:`vitreg.ddp.launcher.launch_job`, which logs what rank 0 hands back, ends the run FAILED with
the failing rank's error and passes its exit status on. Each rank joins the process group, trains
its own shard (an ``EpochSampler`` shard of an ImageFolder, or synthetic batches seeded by rank)
with ``batch_size`` images per process; no rank talks to MLflow: rank 0's tracker hands its calls
(curves, checkpoints, the registration request) to the launcher, the others get a NullTracker.
Curves carry the loss averaged over the ranks and img/s summed over them; the summary throughput
is the sum of the ranks' rates and the step time the slowest rank's (``ranks.json`` keeps each
rank's). The ranks wait for rank 0 at a barrier before leaving, so none exits while rank 0 still
hands back its checkpoints. The launcher registers the checkpoint once the hand-off is logged.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from vitreg.config.spec import TrainSpec
from vitreg.console import progress
from vitreg.ddp import launcher as launch
from vitreg.ddp import world as distributed
from vitreg.ddp.context import JobContext, job_context
from vitreg.environment import capture_environment, pip_freeze
from vitreg.hardware.runtime import run_context
from vitreg.measure.estimate import say_if_long, train_work
from vitreg.measure.figures import Work
from vitreg.models.factory import check_model_name, create_model
from vitreg.models.memory import check_batch_fits, check_ranks_fit
from vitreg.tracking import checkpoint_sources, naming
from vitreg.tracking import runs as tracking
from vitreg.tracking.tags import resolved_tags, world_tags
from vitreg.train.progress import Progress
from vitreg.train.registration import check_registration, register_if_requested
from vitreg.train.run_logger import CHECKPOINT_ARTIFACTS, CheckpointUploader, RunLogger


# --------------------------------------------------------------------------- sources


def resolve_checkpoint_source(source: str, dst=None, progress=progress):
    """The verified checkpoint ``resume=`` names (a runs:/ or models:/ one downloaded into ``dst``)."""
    return checkpoint_sources.resolve_checkpoint(source, dst, what="resume", progress=progress).checkpoint


def teacher_loader(uri: str):
    """The teacher model a ``teacher=`` URI names, downloaded into a folder that goes once it is loaded."""
    model, _, _ = checkpoint_sources.load_model(uri)
    return model


# --------------------------------------------------------------------------- the job


def train_tags(spec: TrainSpec, hw, runtime, info, data_kind: str) -> dict:
    """bench's resolved tags (names people group by) plus the training ones."""
    return {
        **resolved_tags(spec, hw, runtime, info.img_size, task="train"),
        "vitreg_job": "train",
        "precision": runtime.precision.label,  # what ran: fp32, tf32, autocast-bf16, autocast-fp16
        "sdpa": spec.sdpa,
        "num_classes": info.num_classes,
        "data": data_kind,
        "distillation": spec.distillation,
        "teacher": spec.teacher or None,
        "resumed_from": spec.resume or None,
    }


def _flops_metrics(model, info, runtime) -> float:
    """GFLOPs of one training image (student only), counted without touching the training RNG stream."""
    import torch

    from vitreg.models.flops import train_flops_per_image
    from vitreg.train.losses import loss_of

    criterion = torch.nn.CrossEntropyLoss()
    devices = [runtime.device_index] if runtime.device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        flops = train_flops_per_image(model, info.img_size, runtime.torch_device,
                                      lambda out, y: loss_of(out, y, criterion))
    return flops / 1e9


def train(options: dict, experiment: str | None = None, run_name: str | None = None, progress=progress,
          command: str | None = None, *, sampler_factory=None, placement: launch.Placement | None = None):
    """Train one model and log it as one MLflow run; returns the loop's TrainResult.

    ``nproc > 1`` (or a ``placement`` over several hosts) launches torchrun (see the module docstring)
    and returns None in this launching process; with several hosts the same command runs on each
    (node 0 holds rank 0, the run, the checkpoints and the registration). Inside torchrun (a vitreg
    launcher's, or one the user started) this is one rank of the job. ``sampler_factory(dataset)``
    replaces the built-in rank-sharded sampler of ImageFolder data (it must give every rank the same
    number of batches).
    """
    command = launch.typed_command(command)
    placement = placement or launch.Placement()
    inside = distributed.inside_torchrun()
    workdir = Path(tempfile.mkdtemp(prefix="vitreg-train-"))  # downloaded resume source + local checkpoints
    world = distributed.World()
    try:
        opened = (launch.rank_run(run_name, experiment) if inside else
                  launch.launcher_run(run_name, experiment, placement.run_node))
        with opened as run:
            spec = None if inside else TrainSpec.from_options(options)  # the launcher's plan
            if spec is not None and launch.needs_torchrun(spec.nproc, placement.nnodes):
                return _launch_train(run, spec, launch.JobLaunch("train", options, run_name, placement, command),
                                     progress)
            result, world = _train_in_run(run, options, workdir, progress, command, run_name, sampler_factory)
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


def _launch_train(run, spec: TrainSpec, job: launch.JobLaunch, progress) -> None:
    """The launcher (``run`` is None on a node other than 0): the checks that need no GPU, torchrun,
    then the registration rank 0 asked for, against the run its hand-off was logged into."""
    from vitreg.train.data import resolve_num_classes

    gpus = launch.check(spec, job.placement)
    check_model_name(spec.model)  # fail here, once, rather than in every rank
    if job.placement.node_rank == 0:
        check_registration(spec)
    resolve_num_classes(spec.replace(num_classes=0))  # data=PATH: its layout, once (not per rank)
    if spec.resume and not spec.resume.startswith(("runs:/", "models:/")) and "://" not in spec.resume:
        resolve_checkpoint_source(spec.resume)  # a local path that does not exist
    # host memory for every rank, before any is started: past it the OOM killer takes the launcher
    check_ranks_fit(spec.nproc, spec.model, spec.img_size, resolve_num_classes(spec),
                    "cpu" if spec.device == "cpu" or not gpus else "cuda")
    with launch.launch_job(run, spec, job, progress) as handoff:
        request = handoff.registration
        if run is not None and request is not None:
            register_if_requested(run, spec, request["path"], request["tags"])


def _train_in_run(run, options, workdir: Path, progress, command, run_name, sampler_factory):
    """One process's training inside its run; returns ``(TrainResult, World)``."""
    spec = TrainSpec.from_options(options)
    check_model_name(spec.model)
    if distributed.is_main_process():
        check_registration(spec)  # rank 0 registers: a bad register_as fails before any training
    ctx, model, info, resume = _model_of(job_context(run, spec, progress, distributed.TrainReducer), workdir)
    teacher = _teacher(ctx.spec, info, ctx.runtime, ctx.progress)  # a teacher= that cannot load fails early
    from vitreg.train.data import build_data

    data = build_data(ctx.spec, info, ctx.runtime.torch_device, model=model, rank=ctx.world.rank,
                      world_size=ctx.world.world_size, sampler_factory=sampler_factory)
    if ctx.world.is_main:
        _log_setup(ctx, info, data, run_name)
    model = model.to(ctx.runtime.torch_device)
    gflops = _flops_metrics(model, info, ctx.runtime) if ctx.world.is_main else None
    if ctx.world.is_main:  # a GPU-sized run on a CPU says so before it starts
        from vitreg.train import loop

        steps = loop.total_steps_of(ctx.spec, data.steps_per_epoch)
        say_if_long(train_work(ctx.spec.batch_size * ctx.world.world_size, steps, gflops * 1e9), ctx.runtime.device,
                    ctx.progress)
    logger = RunLogger(run)
    ok, stop = False, None
    try:
        try:
            # TF32 switches (amp=tf32), the SDPA backend and the compile cache, around every step
            with run_context(ctx.runtime, model, ctx.spec.sdpa, ctx.spec.compile_cache, train=True):
                result = _run_loop(ctx, logger, model, info, data, resume, workdir, teacher)
        except KeyboardInterrupt as exc:  # stopped between updates: log what was done, then end the run KILLED
            result, stop = getattr(exc, "partial_result", None), exc
            if result is None:
                raise
        result = _completed(result, gflops, info, ctx)
        if ctx.world.is_main:
            _log_results(ctx, logger, info, data, result, command,
                         register=stop is None)  # a stopped run's model is not the one register_as asked for
            throughput = result.figure("throughput_img_per_s")
            if not run_name and throughput:  # now with the figure: the runs list reads at a glance
                run.set_name(run_name_for(ctx.spec, ctx.hardware, ctx.runtime, ctx.world.world_size, throughput))
        ok = True
    finally:
        logger.close(timeout=None if ok else 60)  # on the error path, do not hang on a dead server
    if stop is not None:
        raise stop
    return result, ctx.world


def _model_of(ctx: JobContext, workdir: Path):
    """The model to train and the checkpoint it resumes from: ``(ctx, model, info, resume)``, ``ctx``
    with the spec a resume continues with (its seed). Checks what needs no step first."""
    import torch

    from vitreg.train import loop
    from vitreg.train.data import resolve_num_classes
    from vitreg.train.losses import check_distillable

    spec, runtime, world = ctx.spec, ctx.runtime, ctx.world
    num_classes = resolve_num_classes(spec)  # checks data=PATH before any model or device work
    torch.manual_seed(spec.seed)  # the model's init, as --seed promises (DDP then copies rank 0's weights)
    model, info = create_model(spec.model, spec.img_size, num_classes)
    check_batch_fits(info, spec.batch_size, ("train",), runtime.device, runtime.device_index, sdpa=spec.sdpa)  # before any step
    check_distillable(spec, info)
    resume = None
    if spec.resume:  # every rank reads it; verified here, once, and handed to the loop
        resume = resolve_checkpoint_source(spec.resume, workdir / "resume", ctx.progress)
        spec = loop.resume_spec(spec, resume, info, ctx.progress)  # another model fails here, early
        if world.is_main and isinstance(resume.spec.get("run_id"), str):  # the run that saved it
            ctx.run.set_tags({tracking.RESUMED_FROM_TAG: resume.spec["run_id"]})
            tracking.close_resumed(resume.spec["run_id"], ctx.run.run_id, ctx.progress)
    return ctx.with_spec(spec), model, info, resume


def _completed(result, gflops: float | None, info, ctx: JobContext):
    """The result with the job-level figures the loop cannot know (the work per image, parameters,
    achieved TFLOP/s and MFU against this GPU's peak): computed as bench computes them."""
    figures = result.figures.with_values(gflops_per_img=gflops, params_m=info.params_m if gflops else None)
    return dataclasses.replace(result, figures=figures.completed(Work.of(ctx.runtime, ctx.hardware, result.world_size)))


def _teacher(spec, info, runtime, progress):
    """The distillation teacher (None without distillation), built before the data, the run's setup and
    the FLOPs count: a teacher= that cannot be loaded is refused before that work. A timm-name
    teacher's random init draws on a forked RNG, so the student's data and dropout stream is the one
    it would be without a teacher."""
    if spec.distillation == "none":  # TrainSpec holds a teacher exactly when it distills
        return None
    import torch

    from vitreg.train.losses import create_teacher

    with torch.random.fork_rng(devices=[]):
        return create_teacher(spec, info, runtime.torch_device, teacher_loader, progress)


def _log_setup(ctx: JobContext, info, data, run_name) -> None:
    """Rank 0, before the first step: the run's name, tags, params, environment and pip freeze."""
    run, spec, hw, runtime, world = ctx.run, ctx.spec, ctx.hardware, ctx.runtime, ctx.world
    env = capture_environment()
    run.set_name(run_name or run_name_for(spec, hw, runtime, world.world_size))
    tags = train_tags(spec, hw, runtime, info, data.kind)
    run.set_tags({**env.to_tags(), **tags, **world_tags(world, runtime, env, spec)})
    params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
              "img_size": info.img_size, "num_classes": info.num_classes}
    skipped = run.log_params(params)
    if skipped:
        ctx.progress("kept the params mlflow run logged as typed (" +
                     ", ".join(f"{k}={v}" for k, v in skipped.items()) + "); the resolved values are tags")
    ddp = f", {world.world_size} ranks ({world.backend})" if world.distributed else ""
    ctx.progress(f"run {run.run_id} at {tracking.tracking_uri()}; {spec.model} ({info.params_m:.1f} M params, "
                 f"{info.img_size}px, {info.num_classes} classes) on {runtime.device} ({ctx.detected.name}){ddp}, "
                 f"amp={runtime.amp}, compile={spec.compile}, data={data.kind}")
    run.log_text(env.to_json(), "environment.json")
    run.log_text(pip_freeze(), "pip_freeze.txt")


def _run_loop(ctx: JobContext, logger, model, info, data, resume, workdir, teacher):
    """The loop, its callbacks wired to the progress bar and the run logger; returns its TrainResult."""
    from vitreg.train import loop

    spec, world = ctx.spec, ctx.world
    bar = Progress(loop.total_steps_of(spec, data.steps_per_epoch), initial=resume.step if resume else 0,
                   progress=ctx.progress, enabled=world.is_main)

    def on_log(step, metrics):
        bar.log(step, metrics)
        logger.metrics(metrics, step)

    def on_epoch_end(epoch, metrics):
        if "val_top1" in metrics:
            bar.message(f"epoch {epoch}: val top-1 {metrics['val_top1']:.2f}%")
        logger.metrics({k: v for k, v in metrics.items() if k != "epoch"}, epoch * data.steps_per_epoch)

    hooks = loop.Hooks(bar.step, on_log, CheckpointUploader(logger), on_epoch_end, bar.message)
    ranks = loop.Ranks(world.world_size, world.rank, world.is_main, ctx.wrap, ctx.reducer)
    checkpoints = loop.Checkpoints(workdir / CHECKPOINT_ARTIFACTS, resume, {"run_id": ctx.run.run_id})
    try:
        return loop.train(spec, ctx.runtime, model, info, sources=loop.Sources(data, teacher, teacher_loader),
                          checkpoints=checkpoints, hooks=hooks, ranks=ranks)
    finally:
        bar.close()  # before the results are logged, so their lines print below the bar


def _log_results(ctx: JobContext, logger, info, data, result, command, register=True):
    """Rank 0 (or the one process): summary metrics, results.json, ranks.json, registration."""
    run, spec, hw, runtime = ctx.run, ctx.spec, ctx.hardware, ctx.runtime
    metrics = result.metrics()
    logger.metrics(metrics)
    logger.flush()  # every checkpoint is logged before results.json says where the last one is
    results = {
        "spec": spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
        "model": asdict(info), "data": data.kind, "result": result.to_dict(), "metrics": metrics,
        "checkpoint": run.artifact_uri(f"{CHECKPOINT_ARTIFACTS}/last") if result.last_checkpoint else None,
        "command": command,
    }
    run.log_dict(results, "results.json")
    if ctx.reducer is not None:
        run.log_dict({"train": ctx.reducer.per_rank}, "ranks.json")  # each rank's own figures: stragglers show
    if not register:
        return
    reg_tags = {"model": spec.model, "gpu": hw.label, "img_size": info.img_size,
                "num_classes": info.num_classes, "steps": result.step, "source_run_id": run.run_id,
                "train_final_loss": result.figure("final_loss"), "val_top1": result.figure("val_top1")}
    register_if_requested(run, spec, result.last_checkpoint, reg_tags)


def run_name_for(spec: TrainSpec, hw, runtime, world_size: int = 1, throughput: float | None = None) -> str:
    """GPU label first, then (once measured) the training throughput, as every vitreg run is named (the runs
    list cuts names short); a run filed under a GPU that did not run it says so (``a100≠cpu``)."""
    title = naming.RunTitle(hw.label, spec.model, runtime.amp, spec.compile, world_size, job="train",
                            ran_on=hw.detected.profile.label if hw.mismatch else None)
    return title.name(spec.batch_size, throughputs={"train": throughput} if throughput else None)


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
