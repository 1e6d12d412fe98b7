"""The ``bench`` job: options -> spec -> hardware -> runtime -> runner -> tracking.

This is the whole data flow of DESIGN.md in one function; the entry point and the ``vitreg bench``
command both call :func:`bench`.

DDP (``nproc > 1``): the process the user started becomes the launcher (:func:`_launch_bench`): it
opens the one MLflow run (system metrics included), re-executes the same bench under torchrun, and
ends the run FAILED with the root cause if the ranks fail. Each rank then runs :func:`bench` itself,
on its own GPU with ``batch_size`` images per GPU, resumes the run through ``MLFLOW_RUN_ID``, and
only rank 0 logs the figures reduced over all ranks (:mod:`vitreg.dist.world`). With
``nproc == 1`` none of that happens and the path below is the single-process one.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from vitreg.dist import world as distributed

from vitreg.dist import launcher as launch

from vitreg.tracking import runs as tracking
from vitreg.console import progress, quiet
from vitreg.hardware.env import capture_environment, pip_freeze
from vitreg.errors import VitregError
from vitreg.measure.graphs import require_cuda
from vitreg.hardware.profiles import detect_hardware, resolve_hardware
from vitreg.models.factory import check_model_name, create_model
from vitreg.bench.report import report_markdown, results_table
from vitreg.bench.runner import BenchResult, run_benchmark
from vitreg.hardware.runtime import resolve_runtime
from vitreg.config.spec import BenchSpec


def log_setup(run, params: dict, env, progress) -> None:
    """Params (MLflow keeps what `mlflow run` logged as typed; resolved values are tags), then
    environment.json and pip_freeze.txt. Shared by bench, infer and train."""
    skipped = run.log_params(params)
    if skipped:
        progress("kept the params mlflow run logged as typed (" +
                 ", ".join(f"{k}={v}" for k, v in skipped.items()) + "); the resolved values are tags")
    run.log_text(env.to_json(), "environment.json")
    run.log_text(pip_freeze(), "pip_freeze.txt")


def resolved_tags(spec: BenchSpec, hw, runtime, img_size: int) -> dict:
    """What actually ran, under the names people group by (see tracking's note on params vs tags)."""
    tags = {
        "gpu": hw.label,
        "amp": runtime.amp,
        "device": runtime.device,
        "img_size": img_size,
        "model": spec.model,
        "task": spec.task,
        "compile": spec.compile,
        "batch_size": spec.batch_size,
        "nproc": spec.nproc,
        "gpu_mismatch": "true" if hw.mismatch else "false",
        "detected_gpu": hw.detected.profile.label,
        "vitreg_job": "bench",
    }
    return {**tags, **_graph_tag(spec)}


def _graph_tag(spec) -> dict:
    """``{"cuda_graph": "true"/"false"}`` for bench's and infer's specs; nothing for train's (it captures nothing)."""
    return {"cuda_graph": str(spec.cuda_graph).lower()} if hasattr(spec, "cuda_graph") else {}


def label_launcher_run(run, spec, job: str) -> None:
    """Params and the configuration tags on a DDP job's run before torchrun starts, so that a job
    whose ranks never get to log (a crash at start-up) is still found by model, task, batch and job
    in the UI. Rank 0 later adds the resolved tags (gpu, amp, ...) and the environment."""
    if run is None:
        return
    run.log_params(spec.to_params())
    run.set_tags({"model": spec.model, "task": spec.task, "compile": spec.compile, "batch_size": spec.batch_size,
                  "nproc": spec.nproc, "vitreg_job": job, **_graph_tag(spec)})


def bench(options: dict, experiment: str | None = None, run_name: str | None = None,
          progress=progress, command: str | None = None, *, nnodes: int = 1, node_rank: int = 0,
          rdzv_endpoint: str | None = None, baseline_run: str | None = None) -> BenchResult | None:
    """Run one benchmark and log it as one MLflow run. Raises VitregError on bad input (run ends FAILED).

    ``nproc > 1`` outside torchrun launches torchrun (``nnodes``/``node_rank``/``rdzv_endpoint`` for
    several hosts) and returns None in this launching process; the ranks log. ``baseline_run``: the
    run id of a 1-process run of the same config; its throughput gives ``train_scaling_efficiency``
    (and ``infer_scaling_efficiency``) = throughput_N / (N * throughput_1).
    """
    command = command or " ".join(shlex.quote(a) for a in sys.argv)
    if launch.wants_torchrun(options, nnodes):
        return _launch_bench(options, experiment, run_name, progress, nnodes, node_rank, rdzv_endpoint,
                             baseline_run)
    world = distributed.World()
    # Under a vitreg launcher, the launcher samples system metrics for the whole job (one sampler per run).
    with tracking.tracked_run(run_name=run_name, experiment=experiment,
                              system_metrics=not launch.launched_by_vitreg()) as run:
        spec = BenchSpec.from_options(options)
        check_model_name(spec.model)  # cheap, and before any device work
        world, wrap, reducer = distributed.join_job(spec, distributed.ResultReducer)
        if not world.is_main:
            progress = quiet  # rank 0 speaks for the job; errors still reach every rank's stderr
        # baseline_run under a torchrun the user started: rank 0 checks it now, before the GPU time
        # (under a vitreg launcher, the launcher checked it and relates the figures itself).
        baseline = None
        if baseline_run and world.distributed and world.is_main and not launch.launched_by_vitreg():
            baseline = read_baseline(baseline_run, spec)
        elif baseline_run and not world.distributed:
            progress(f"baseline_run={baseline_run} ignored: scaling efficiency is for nproc>1 runs")
        detected = detect_hardware(spec.device)
        hw = resolve_hardware(spec.gpu, detected, spec.allow_gpu_mismatch)
        runtime = resolve_runtime(spec.amp, spec.compile, spec.compile_backend, detected,
                                  device_index=world.local_rank if detected.device == "cuda" else 0)
        model, info = create_model(spec.model, spec.img_size)  # on the CPU: checks img_size before GPU work
        env = capture_environment()
        ddp = f"-ddp{world.world_size}" if world.distributed else ""
        graph = "-graph" if spec.cuda_graph else ""
        run.set_name(run_name or
                     f"{spec.model}-{hw.label}-{runtime.amp}-{spec.compile}{graph}-bs{spec.batch_size}{ddp}")
        run.set_tags({**env.to_tags(), **resolved_tags(spec, hw, runtime, info.img_size),
                      **world_tags(world, runtime, env, spec)})
        params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
                  "img_size": info.img_size}
        log_setup(run, params, env, progress)
        progress(f"run {run.run_id} at {tracking.tracking_uri()}; gpu={hw.label} ({detected.name}), "
                 f"amp={runtime.amp}, compile={spec.compile}")

        result = run_benchmark(spec, hw, runtime, progress, model_factory=lambda: (model, info),
                               wrap=wrap, reducer=reducer)

        run.log_metrics(result.metrics())
        run.log_dict(result.to_dict(), "results.json")
        if reducer is not None:
            run.log_dict(reducer.per_rank_report(), "ranks.json")  # each rank's own figures: stragglers show
            if baseline is not None:
                log_scaling_efficiency(run, baseline, result.metrics(), world.world_size, _config_tags(run), progress)
        run.log_text(report_markdown(result, env, command), "report.md")
    if world.distributed:
        distributed.destroy()
        if not world.is_main:
            return result
    print(results_table(result))
    print(f"logged run {run.run_id} to {tracking.tracking_uri()} (open it with `mlflow ui`)")
    return result


# --------------------------------------------------------------------------------------------
# DDP: the launcher side and the rank side


def _launch_bench(options, experiment, run_name, progress, nnodes, node_rank, rdzv_endpoint, baseline_run):
    """The launcher: one run for the whole job, checks that need no GPU work, torchrun, the verdict."""
    with launch.launcher_run(run_name, experiment, node_rank) as run:  # None on a node other than 0
        spec = BenchSpec.from_options(options)
        check_model_name(spec.model)  # fail here, once, rather than in every rank
        launch.check_nodes(nnodes, node_rank, rdzv_endpoint)
        gpus = launch.visible_gpu_count()
        launch.check_nproc(spec.nproc, spec.device, gpus)
        if spec.cuda_graph and (spec.device == "cpu" or not gpus):
            require_cuda(True, "cpu")  # once here, not in every rank
        baseline = read_baseline(baseline_run, spec) if baseline_run and node_rank == 0 else None
        label_launcher_run(run, spec, "bench")
        argv = ["-m", "vitreg.cli", "bench", *launch.options_to_args(options)]
        if run_name:
            argv += ["--run-name", run_name]
        if run is not None:
            progress(f"run {run.run_id} at {tracking.tracking_uri()}: {spec.nproc} process(es) per node x {nnodes} "
                     f"node(s), batch_size={spec.batch_size} per process")
        launch.launch_tracked(argv, spec.nproc, run, nnodes, node_rank, rdzv_endpoint, progress)
        if baseline is not None and run is not None:
            logged = tracking.get_run(run.run_id)
            metrics = logged.data.metrics
            world_size = int(metrics.get("train_world_size") or metrics.get("infer_world_size") or spec.nproc * nnodes)
            log_scaling_efficiency(run, baseline, metrics, world_size, dict(logged.data.tags), progress)
    return None


def world_tags(world: distributed.World, runtime, env, spec=None) -> dict:
    """Tags of a DDP run; none for a single process (its tags stay as they were)."""
    if not world.distributed:
        return {}
    tags = {"world_size": world.world_size, "nnodes": world.nnodes, "dist_backend": world.backend,
            "host_gpu_count": env.gpu_count}
    if spec is not None and spec.task != "infer":  # inference runs no DDP: each rank its own copy
        tags.update(ddp_bucket_mb=f"{spec.ddp_bucket_mb:g}", ddp_static_graph=str(spec.ddp_static_graph).lower(),
                    ddp_comm_hook=spec.ddp_comm_hook)
    if runtime.device == "cuda":
        tags["gpu_count"] = world.world_size  # the GPUs this run used, not the ones the host has
    return tags


# --------------------------------------------------------------------------------------------
# scaling efficiency against a 1-process baseline run

# Resolved values (tags) that must agree for two runs to measure the same work per process.
SCALING_CONFIG_TAGS = ("model", "gpu", "amp", "compile", "cuda_graph", "batch_size", "img_size", "device")


@dataclass(frozen=True)
class Baseline:
    run_id: str
    metrics: dict
    tags: dict


def _config_tags(run) -> dict:
    return dict(tracking.get_run(run.run_id).data.tags)


def read_baseline(run_id: str, spec: BenchSpec) -> Baseline:
    """Fetch and check ``baseline_run`` before any GPU time is spent on the scaled run."""
    try:
        base = tracking.get_run(run_id)
    except Exception as exc:  # MlflowException (no such run), or the server
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise VitregError(f"baseline_run={run_id!r} cannot be read from {tracking.tracking_uri()}: {first}") from None
    metrics, tags, params = dict(base.data.metrics), dict(base.data.tags), dict(base.data.params)
    if base.info.status != "FINISHED":
        raise VitregError(f"baseline_run={run_id} is {base.info.status}, not FINISHED: pass a finished nproc=1 run")
    ranks = int(metrics.get("train_world_size") or metrics.get("infer_world_size") or 1)
    if ranks != 1 or params.get("nproc", "1") != "1":
        raise VitregError(f"baseline_run={run_id} ran {max(ranks, int(params.get('nproc', '1') or 1))} processes: "
                          f"the baseline must be a 1-process (nproc=1) run of the same config")
    if not any(f"{t}_throughput_img_per_s" in metrics for t in spec.tasks):
        raise VitregError(f"baseline_run={run_id} has no {' or '.join(t + '_throughput_img_per_s' for t in spec.tasks)}: "
                          f"pass a run of task={spec.task} (or both)")
    # What is already concrete in the spec must match now; auto values are compared after the run.
    wanted = {"model": spec.model, "compile": spec.compile, "batch_size": str(spec.batch_size), **_graph_tag(spec)}
    if spec.gpu != "auto":
        wanted["gpu"] = spec.gpu
    if spec.amp != "auto":
        wanted["amp"] = spec.amp
    if spec.img_size:
        wanted["img_size"] = str(spec.img_size)
    diff = [f"{k}={tags.get(k)} there, {v} here" for k, v in wanted.items() if tags.get(k) not in (None, v)]
    if diff:
        raise VitregError(f"baseline_run={run_id} is another config ({'; '.join(diff)}): pass a 1-process run "
                          f"of the same model, batch_size, amp, compile, cuda_graph and gpu")
    return Baseline(run_id, metrics, tags)


def scaling_efficiency(baseline_metrics: dict, metrics: dict, world_size: int) -> dict[str, float]:
    """``{task}_scaling_efficiency = throughput_N / (N * throughput_1)`` for each task both runs timed."""
    out = {}
    for task in ("infer", "train"):
        one, many = baseline_metrics.get(f"{task}_throughput_img_per_s"), metrics.get(f"{task}_throughput_img_per_s")
        if one and many and world_size > 0:
            out[f"{task}_scaling_efficiency"] = many / (world_size * one)
    return out


def log_scaling_efficiency(run, baseline: Baseline, metrics: dict, world_size: int, tags: dict, progress) -> dict:
    """Log the efficiencies if the two runs' resolved configs agree; say why not otherwise."""
    diff = [f"{k}={baseline.tags.get(k)} vs {tags.get(k)}" for k in SCALING_CONFIG_TAGS
            if baseline.tags.get(k) is not None and tags.get(k) is not None and baseline.tags[k] != tags[k]]
    if diff:
        progress(f"not logging scaling efficiency: baseline_run={baseline.run_id} is another config ({'; '.join(diff)})")
        return {}
    eff = scaling_efficiency(baseline.metrics, metrics, world_size)
    if eff:
        run.log_metrics(eff)
        run.set_tags({"scaling_baseline_run": baseline.run_id})
        progress("scaling vs baseline_run " + baseline.run_id + ": " +
                 ", ".join(f"{k}={v:.3f}" for k, v in eff.items()))
    return eff
