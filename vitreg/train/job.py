"""The ``train`` job: options -> TrainSpec -> hardware -> runtime -> engine -> tracking.

The same shape as :mod:`vitreg.bench.job`. The engine reports through callbacks; this module turns
them into MLflow calls that never run inside a step:

- curves (``train_loss``, ``lr``, ``train_img_per_s``, ``grad_norm``, ``data_wait_frac``, ``epoch``,
  ``val_top1``) as one ``log_metrics`` batch per ``log_every`` steps;
- checkpoints as run artifacts ``checkpoints/step-<N>/`` and then ``checkpoints/last/`` (so ``last`` is
  always the newest, and a process killed while ``last`` is copied still leaves an intact
  ``step-<N>``);
- the summary metrics, ``results.json``, environment and pip freeze at the end.

Those calls go through one background thread (in order) when the tracker is bound to its run id
(``Tracker.thread_safe``; MLflow's active run is thread-local, so a fluent call from another thread
would open a new run); otherwise they run inline at the log boundary, still outside any timed step.

Registration (``register_as``) is delegated to ``vitreg.tracking.registry.register_checkpoint`` at
:func:`register_if_requested`.

DDP (``nproc > 1``), as ``bench`` does it: the process the user started becomes the launcher
(:func:`_launch_train`). It holds the one MLflow run (or resumes ``mlflow run``'s), checks what
needs no GPU (model name, data layout, ``nproc`` against the visible GPUs; any ``nproc`` on the
CPU, with gloo), and runs the same ``train`` under torchrun through
:func:`vitreg.dist.launcher.launched`, which logs what rank 0 hands back, ends the run FAILED with
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

import math
import queue
import shlex
import shutil
import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path

from vitreg.dist import world as distributed

from vitreg.dist import launcher as launch

from vitreg.tracking import runs as tracking
from vitreg.tracking.tags import label_launcher_run, resolved_tags, world_tags
from vitreg.console import progress, quiet
from vitreg.hardware.env import capture_environment, pip_freeze
from vitreg.errors import VitregError
from vitreg.hardware.profiles import detect_hardware, mfu, resolve_hardware
from vitreg.models.factory import check_model_name, create_model
from vitreg.hardware.runtime import resolve_runtime
from vitreg.config.spec import TrainSpec

CHECKPOINT_ARTIFACTS = "checkpoints"


# --------------------------------------------------------------------------- background logging


class RunLogger:
    """MLflow calls for one run, in submission order, off the training thread when that is safe.

    With a thread-safe tracker (bound to its run id) a single daemon thread runs the calls; the
    training loop only enqueues. Otherwise :meth:`submit` runs the call at once. An error in the
    thread is raised at the next :meth:`submit` or at :meth:`close`.
    """

    def __init__(self, tracker):
        self.tracker = tracker
        # a NullTracker (ranks other than 0) does nothing: no thread for it
        self.threaded = bool(getattr(tracker, "thread_safe", False)) and not isinstance(tracker, tracking.NullTracker)
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
                              f"{str(error).splitlines()[0] if str(error) else ''}") from error

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
    """Logs each checkpoint as ``checkpoints/step-<N>`` then ``checkpoints/last``, then deletes the local
    copies of older checkpoints (the newest stays, for registration)."""

    def __init__(self, logger: RunLogger):
        self.logger = logger
        self._uploaded: list[Path] = []

    def __call__(self, step: int, path: Path) -> None:
        self.logger.submit(self._upload, step, Path(path))

    def _upload(self, step: int, path: Path) -> None:
        tracker = self.logger.tracker
        tracker.log_artifacts(path, f"{CHECKPOINT_ARTIFACTS}/step-{step}")
        tracker.log_artifacts(path, f"{CHECKPOINT_ARTIFACTS}/last")
        for old in self._uploaded:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        self._uploaded = [path]


# --------------------------------------------------------------------------- progress


class Progress:
    """A tqdm bar on a terminal (step, loss, img/s); plain lines at each log when stderr is not a terminal."""

    def __init__(self, total: int, initial: int = 0, progress=progress, enabled: bool = True):
        self.total = total
        self.progress = progress
        self.enabled = enabled  # False on DDP ranks other than 0: rank 0 speaks for the job
        self.tty = enabled and sys.stderr.isatty()
        self.bar = None
        if self.tty:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
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
        if self.tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"[vitreg] {text}", file=sys.stderr)
        else:
            if self.tty:
                print(file=sys.stderr)
            self.progress(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            print(file=sys.stderr)


# --------------------------------------------------------------------------- sources


def resolve_checkpoint_source(source: str, what: str = "resume", dst=None) -> Path:
    """A local checkpoint directory for ``runs:/<run_id>/checkpoints/last`` (downloaded) or a local path."""
    if "://" in source or source.startswith(("runs:/", "models:/")):
        try:
            if dst is not None:
                Path(dst).mkdir(parents=True, exist_ok=True)
            return tracking.download_artifacts(source, str(dst) if dst is not None else None)
        except VitregError:
            raise
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise VitregError(f"{what}={source} cannot be downloaded from {tracking.tracking_uri()} "
                              f"({type(exc).__name__}: {first}): check the run id and that the run has "
                              f"{CHECKPOINT_ARTIFACTS}/last (MLFLOW_TRACKING_URI must be the run's store)") from None
    path = Path(source).expanduser()
    if not path.exists():
        raise VitregError(f"{what}={source} does not exist: pass runs:/<run_id>/checkpoints/last or a checkpoint "
                          f"directory")
    return path


def teacher_loader(uri: str):
    """models:/ URIs through the registry's loader; runs:/ checkpoints through download + load_model."""
    from vitreg.train import checkpoint

    if uri.startswith("models:/"):
        try:
            from vitreg.tracking.registry import load_model
        except ImportError:
            raise VitregError(f"teacher={uri} needs vitreg.tracking.registry.load_model, which this install lacks: pass the "
                              f"teacher's checkpoint as runs:/<run_id>/checkpoints/last or a directory") from None
        model, _, _ = load_model(uri)  # (model, ModelInfo, spec): the teacher is the model
        return model
    if "://" in uri or uri.startswith("runs:/"):
        # downloaded into a folder of our own that goes once the weights are in memory
        with tempfile.TemporaryDirectory(prefix="vitreg-teacher-") as tmp:
            model, _, _ = checkpoint.load_model(resolve_checkpoint_source(uri, "teacher", dst=tmp))
        return model
    model, _, _ = checkpoint.load_model(resolve_checkpoint_source(uri, "teacher"))
    return model


# --------------------------------------------------------------------------- registration hook


def check_registration(spec: TrainSpec) -> None:
    """``register_as``/``alias`` checked against the registry before training (no-op without them)."""
    if not spec.register_as:
        return
    try:
        from vitreg.tracking.registry import check_registration as check
    except ImportError:
        return  # register_if_requested says so at the end
    check(spec.register_as, spec.alias, spec.model)


def register_if_requested(tracker, spec: TrainSpec, checkpoint_dir, tags: dict, progress=progress):
    """REGISTRATION HOOK: when ``register_as`` is set, hand the final checkpoint to the registry.

    ``tracker.register_checkpoint(checkpoint_dir, name, alias, tags)`` creates the model version from the
    checkpoint (already logged under ``checkpoints/last``) and sets the alias. Under a vitreg launcher
    rank 0's tracker hands the request back, and the launcher calls this again with its own run.
    """
    if not spec.register_as:
        return None
    if checkpoint_dir is None:
        raise VitregError(f"register_as={spec.register_as} but this run wrote no checkpoint")
    try:
        return tracker.register_checkpoint(Path(checkpoint_dir), spec.register_as, spec.alias, tags)
    except VitregError as exc:
        # the training is done and its checkpoint logged: say how to register it once the cause is fixed
        raise VitregError(f"{exc} (the checkpoint is logged: once fixed, `vitreg register "
                          f"runs:/{tracker.run_id}/{CHECKPOINT_ARTIFACTS}/last --name {spec.register_as}"
                          + (f" --alias {spec.alias}`)" if spec.alias.lower() != "latest" else "`)")) from None


# --------------------------------------------------------------------------- the job


def train_tags(spec: TrainSpec, hw, runtime, info, data_kind: str) -> dict:
    """bench's resolved tags (names people group by) plus the training ones."""
    return {
        **resolved_tags(spec, hw, runtime, info.img_size, task="train"),
        "vitreg_job": "train",
        "num_classes": info.num_classes,
        "data": data_kind,
        "distillation": spec.distillation,
        "teacher": spec.teacher or None,
        "resumed_from": spec.resume or None,
    }


def _flops_metrics(model, info, runtime) -> dict:
    """FLOPs of one training image (student only), counted without touching the training RNG stream."""
    import torch

    from vitreg.models.flops import train_flops_per_image
    from vitreg.bench.runner import loss_of

    criterion = torch.nn.CrossEntropyLoss()
    devices = [runtime.device_index] if runtime.device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        flops = train_flops_per_image(model, info.img_size, runtime.torch_device,
                                      lambda out, y: loss_of(out, y, criterion))
    return {"train_gflops_per_img": flops / 1e9, "params_m": info.params_m}


def train(options: dict, experiment: str | None = None, run_name: str | None = None, progress=progress,
          command: str | None = None, *, sampler_factory=None, nnodes: int = 1, node_rank: int = 0,
          rdzv_endpoint: str | None = None):
    """Train one model and log it as one MLflow run; returns the engine's TrainResult.

    ``nproc > 1`` (or ``nnodes > 1``) launches torchrun (see the module docstring) and returns None
    in this launching process; ``nnodes``/``node_rank``/``rdzv_endpoint`` spread the job over
    several hosts (the same command on each; node 0 holds rank 0, the run, the checkpoints and the
    registration). Inside torchrun (a vitreg launcher's, or one the user started) this is one rank
    of the job. ``sampler_factory(dataset)`` replaces the built-in rank-sharded sampler of
    ImageFolder data (it must give every rank the same number of batches).
    """
    command = command or " ".join(shlex.quote(a) for a in sys.argv)
    inside = distributed.inside_torchrun()
    workdir = Path(tempfile.mkdtemp(prefix="vitreg-train-"))  # downloaded resume source + local checkpoints
    world = distributed.World()
    try:
        opened = (launch.rank_run(run_name, experiment) if inside else
                  launch.launcher_run(run_name, experiment, node_rank if nnodes > 1 else 0))
        with opened as run:
            spec = None if inside else TrainSpec.from_options(options)  # the launcher's plan
            if spec is not None and launch.needs_torchrun(spec.nproc, nnodes):
                return _launch_train(run, spec, options, run_name, progress, nnodes, node_rank, rdzv_endpoint)
            result, world = _train_in_run(run, options, workdir, progress, command, run_name,
                                          sampler_factory=sampler_factory)
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


def _launch_train(run, spec: TrainSpec, options, run_name, progress, nnodes=1, node_rank=0, rdzv_endpoint=None):
    """The launcher (``run`` is None on a node other than 0): the checks that need no GPU, torchrun,
    then the registration rank 0 asked for, against the run its hand-off was logged into."""
    from vitreg.train.data import resolve_num_classes

    check_model_name(spec.model)  # fail here, once, rather than in every rank
    launch.check_nodes(nnodes, node_rank, rdzv_endpoint)
    if node_rank == 0:
        check_registration(spec)
    resolve_num_classes(spec.replace(num_classes=0))  # data=PATH: its layout, once (not per rank)
    if spec.resume and not spec.resume.startswith(("runs:/", "models:/")) and "://" not in spec.resume:
        resolve_checkpoint_source(spec.resume)  # a local path that does not exist
    launch.check_nproc(spec.nproc, spec.device, launch.visible_gpu_count())
    label_launcher_run(run, spec, "train", task="train")
    argv = ["-m", "vitreg.cli", "train", *launch.options_to_args(options)]
    if run_name:
        argv += ["--run-name", run_name]
    world = spec.nproc * nnodes
    if run is not None:
        progress(f"run {run.run_id} at {tracking.tracking_uri()}: {spec.nproc} process(es) per node x {nnodes} "
                 f"node(s) (DDP), batch_size={spec.batch_size} per process ({world * spec.batch_size} images "
                 f"per step)")
    with launch.launched(argv, spec.nproc, run, nnodes, node_rank, rdzv_endpoint, progress) as handed:
        request = handed.registration
        if run is not None and request is not None:
            register_if_requested(run, spec, request["path"], request["tags"], progress)
    return None


def _train_in_run(run, options, workdir: Path, progress, command, run_name, *, sampler_factory):
    """One process's training inside its run; returns ``(TrainResult, World)``."""
    from vitreg.train import checkpoint
    from vitreg.train import loop as engine
    from vitreg.train.data import build_data, resolve_num_classes

    spec = TrainSpec.from_options(options)
    check_model_name(spec.model)
    if distributed.is_main_process():
        check_registration(spec)  # rank 0 registers: a bad register_as fails before any training
    world, wrap, reducer = distributed.join_job(spec, distributed.TrainReducer)
    main = world.is_main
    if not main:
        progress = quiet  # rank 0 speaks for the job; errors still reach every rank's stderr
    detected = detect_hardware(spec.device)
    hw = resolve_hardware(spec.gpu, detected, spec.allow_gpu_mismatch)
    runtime = resolve_runtime(spec.amp, spec.compile, spec.compile_backend, detected,
                              device_index=world.local_rank if detected.device == "cuda" else 0)
    num_classes = resolve_num_classes(spec)  # checks data=PATH before any model or device work
    import torch

    torch.manual_seed(spec.seed)  # the model's init, as --seed promises (DDP then copies rank 0's weights)
    model, info = create_model(spec.model, spec.img_size, num_classes)
    engine.check_distillable(spec, info)
    resume_dir = None
    if spec.resume:
        resume_dir = resolve_checkpoint_source(spec.resume, dst=workdir / "resume")  # every rank reads it
        spec = engine.resume_spec(spec, resume_dir, info, progress)  # another model fails here, early

    data = build_data(spec, info, runtime.torch_device, model=model, rank=world.rank, world_size=world.world_size,
                      sampler_factory=sampler_factory)
    if main:
        env = capture_environment()
        run.set_name(run_name or run_name_for(spec, hw, runtime, world.world_size))
        tags = train_tags(spec, hw, runtime, info, data.kind)
        run.set_tags({**env.to_tags(), **tags, **world_tags(world, runtime, env, spec)})
        params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
                  "img_size": info.img_size, "num_classes": info.num_classes}
        skipped = run.log_params(params)
        if skipped:
            progress("kept the params mlflow run logged as typed (" +
                     ", ".join(f"{k}={v}" for k, v in skipped.items()) + "); the resolved values are tags")
        ddp = f", {world.world_size} ranks ({world.backend})" if world.distributed else ""
        progress(f"run {run.run_id} at {tracking.tracking_uri()}; {spec.model} ({info.params_m:.1f} M params, "
                 f"{info.img_size}px, {info.num_classes} classes) on {runtime.device} ({detected.name}){ddp}, "
                 f"amp={runtime.amp}, compile={spec.compile}, data={data.kind}")
        run.log_text(env.to_json(), "environment.json")
        run.log_text(pip_freeze(), "pip_freeze.txt")

    model = model.to(runtime.torch_device)
    summary = _flops_metrics(model, info, runtime) if main else {}
    logger = RunLogger(run)
    start = checkpoint.read_spec(resume_dir)["step"] if resume_dir else 0
    bar = Progress(engine.total_steps_of(spec, data.steps_per_epoch), initial=start, progress=progress,
                   enabled=main)
    ok = False
    try:
        def on_log(step, metrics):
            bar.log(step, metrics)
            logger.metrics(metrics, step)

        def on_epoch_end(epoch, metrics):
            if "val_top1" in metrics:
                bar.message(f"epoch {epoch}: val top-1 {metrics['val_top1']:.2f}%")
            logger.metrics({k: v for k, v in metrics.items() if k != "epoch"}, epoch * data.steps_per_epoch)

        result = engine.train(
            spec, runtime, model, info, data=data, teacher_loader=teacher_loader,
            checkpoint_dir=workdir / CHECKPOINT_ARTIFACTS, resume_from=resume_dir,
            checkpoint_extra={"run_id": run.run_id}, on_step=bar.step, on_log=on_log,
            on_checkpoint=CheckpointUploader(logger), on_epoch_end=on_epoch_end, wrap=wrap,
            world_size=world.world_size, rank=world.rank, sampler_factory=sampler_factory, is_main=main,
            reducer=reducer, progress=bar.message)
        bar.close()
        if main:
            _log_results(run, logger, spec, hw, runtime, info, data, result, summary, reducer, command, progress)
        ok = True
    finally:
        bar.close()
        logger.close(timeout=None if ok else 60)  # on the error path, do not hang on a dead server
    return result, world


def _log_results(run, logger, spec, hw, runtime, info, data, result, summary, reducer, command, progress):
    """Rank 0 (or the one process): summary metrics, results.json, ranks.json, registration."""
    metrics = {**summary, **result.metrics()}
    if result.throughput_img_per_s:
        achieved = summary["train_gflops_per_img"] * result.throughput_img_per_s / 1e3
        metrics["train_achieved_tflops"] = achieved
        metrics["train_mfu"] = mfu(achieved / result.world_size, hw.profile, runtime.amp, _tf32_on())
    logger.metrics(metrics)
    logger.flush()  # every checkpoint is logged before results.json says where the last one is
    results = {
        "spec": spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
        "model": asdict(info), "data": data.kind, "result": result.to_dict(),
        "metrics": {k: v for k, v in metrics.items() if v is not None},
        "checkpoint": run.artifact_uri(f"{CHECKPOINT_ARTIFACTS}/last") if result.last_checkpoint else None,
        "command": command,
    }
    run.log_dict(results, "results.json")
    if reducer is not None:
        run.log_dict({"train": reducer.per_rank}, "ranks.json")  # each rank's own figures: stragglers show
    reg_tags = {"model": spec.model, "gpu": hw.label, "img_size": info.img_size,
                "num_classes": info.num_classes, "steps": result.step, "source_run_id": run.run_id,
                "train_final_loss": result.final_loss, "val_top1": result.val_top1}
    register_if_requested(run, spec, result.last_checkpoint, reg_tags, progress)


def run_name_for(spec: TrainSpec, hw, runtime, world_size: int = 1) -> str:
    ddp = f"-ddp{world_size}" if world_size > 1 else ""
    return f"train-{spec.model}-{hw.label}-{runtime.amp}-bs{spec.batch_size}{ddp}"


def _tf32_on() -> bool:
    import torch

    return torch.get_float32_matmul_precision() != "highest"


def _print_summary(result, run) -> None:
    def fmt(value, spec=",.1f"):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    print(f"trained {result.steps_run} steps (to step {result.step}/{result.total_steps}); final loss "
          f"{fmt(result.final_loss, '.4f')}; {fmt(result.throughput_img_per_s)} img/s, step p50 "
          f"{fmt(result.step_ms_p50, '.2f')} ms, data wait {fmt(result.data_wait_frac, '.1%')}"
          + (f"; val top-1 {result.val_top1:.2f}%" if result.val_top1 is not None else ""))
    if result.last_checkpoint:
        print(f"checkpoint: {run.artifact_uri(CHECKPOINT_ARTIFACTS + '/last')}")
    print(f"logged run {run.run_id} to {tracking.tracking_uri()} (open it with `mlflow ui`)")
