"""The ``bench`` job: options -> spec -> plan (this process, or torchrun) -> runner -> tracking.

The entry point and the ``vitreg bench`` command both call :func:`bench`. The options are parsed
once, in the process the user started, inside its run; the plan follows from the spec.

DDP (``nproc > 1``, or several hosts): this process becomes the launcher (:func:`_launch_bench`).
It holds the one MLflow run (system metrics included), checks what needs no GPU, runs the same
bench under torchrun and logs what the ranks hand back (:func:`vitreg.ddp.launcher.launched`). Each
rank runs :func:`bench` too, on its own GPU with ``batch_size`` images per GPU; the figures are
reduced over the ranks (:mod:`vitreg.ddp.world`) and rank 0 hands them to the launcher, which
also relates them to ``baseline_run``. With ``nproc == 1`` none of that happens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from vitreg.bench.report import report_markdown, results_table
from vitreg.bench.results import BenchResult
from vitreg.bench.runner import run_benchmark
from vitreg.config.spec import BenchSpec
from vitreg.console import progress, quiet
from vitreg.ddp import launcher as launch
from vitreg.ddp import world as distributed
from vitreg.errors import VitregError, first_line
from vitreg.hardware.env import capture_environment
from vitreg.hardware.profiles import detect_hardware, resolve_hardware
from vitreg.hardware.runtime import resolve_runtime
from vitreg.measure.graphs import require_cuda
from vitreg.models.factory import check_model_name, create_model
from vitreg.models.memory import check_ranks_fit
from vitreg.tracking import naming
from vitreg.tracking import runs as tracking
from vitreg.tracking.tags import label_launcher_run, log_setup, log_what_ran, resolved_tags, world_tags


def bench(options: dict, experiment: str | None = None, run_name: str | None = None,
          progress=progress, command: str | None = None, *, nnodes: int = 1, node_rank: int = 0,
          rdzv_endpoint: str | None = None, baseline_run: str | None = None) -> BenchResult | None:
    """Run one benchmark and log it as one MLflow run. Raises VitregError on bad input (run ends FAILED).

    ``nproc > 1`` (or ``nnodes > 1``) launches torchrun (``nnodes``/``node_rank``/``rdzv_endpoint``
    for several hosts) and returns None in this launching process. ``baseline_run``: the run id of
    a 1-process run of the same config; its throughput gives ``train_scaling_efficiency`` (and
    ``infer_scaling_efficiency``) = throughput_N / (N * throughput_1).
    """
    command = launch.typed_command(command)
    if distributed.inside_torchrun():  # one rank of a job: a vitreg launcher's or a torchrun the user started
        with launch.rank_run(run_name, experiment) as run:
            result, world = _bench_in_run(run, BenchSpec.from_options(options), run_name, progress, command,
                                          baseline_run)
        distributed.destroy()
        if world.is_main:
            print(results_table(result))
            if not launch.launched_by_vitreg():
                _print_logged(run)
        return result
    with launch.launcher_run(run_name, experiment, node_rank if nnodes > 1 else 0) as run:
        spec = BenchSpec.from_options(options)  # the one parse of the options in this process
        if launch.needs_torchrun(spec.nproc, nnodes):
            _launch_bench(run, spec, options, run_name, progress, nnodes, node_rank, rdzv_endpoint, baseline_run,
                          command)
            result = None
        else:
            result, _ = _bench_in_run(run, spec, run_name, progress, command, baseline_run)
            print(results_table(result))
    if run is not None:
        _print_logged(run)
    return result


def _print_logged(run) -> None:
    print(tracking.where_logged(run))


def _bench_in_run(run, spec: BenchSpec, run_name, progress, command, baseline_run):
    """One process's benchmark inside its run (a plain process, or one rank); returns ``(result, world)``."""
    check_model_name(spec.model)  # cheap, and before any device work
    world, wrap, reducer = distributed.join_job(spec, distributed.ResultReducer, cuda_graph=spec.cuda_graph)
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
    name = functools.partial(naming.run_name, hw.label, spec.model, runtime.amp, compile=spec.compile,
                             nproc=world.world_size, cuda_graph=spec.cuda_graph,
                             ran_on=detected.profile.label if hw.mismatch else None)
    run.set_name(run_name or name(spec.batch_size))  # GPU label first: the runs list cuts names short
    tags = {**env.to_tags(),
            **resolved_tags(spec, hw, runtime, info.img_size, task=spec.task, cuda_graph=spec.cuda_graph),
            **world_tags(world, runtime, env, spec if "train" in spec.tasks else None)}  # infer wraps no DDP
    run.set_tags(tags)
    params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
              "img_size": info.img_size}
    log_setup(run, params, env, progress)
    progress(f"run {run.run_id} at {tracking.tracking_uri()}; gpu={hw.label} ({detected.name}), "
             f"amp={runtime.amp}, compile={spec.compile}")

    result = run_benchmark(spec, hw, runtime, progress, model_factory=lambda: (model, info), wrap=wrap,
                           reducer=reducer)

    run.log_metrics(result.metrics())
    log_what_ran(run, result)
    run.log_dict(result.to_dict(), "results.json")
    if reducer is not None:
        run.log_dict(reducer.per_rank_report(), "ranks.json")  # each rank's own figures: stragglers show
        if baseline is not None:
            log_scaling_efficiency(run, baseline, result.metrics(), world.world_size, tracking.clean_tags(tags),
                                   progress)
    run.log_text(report_markdown(result, env, command), "report.md")
    if not run_name:  # now with the figure: the runs list reads without any column set-up
        run.set_name(name(result.tasks[0].batch_size, throughputs={t.task: t.throughput.median for t in result.tasks}))
    run.set_note(naming.run_note(result.to_dict(), ran_on=hw.detected.name if hw.mismatch else None))
    return result, world


def _launch_bench(run, spec: BenchSpec, options, run_name, progress, nnodes, node_rank, rdzv_endpoint, baseline_run,
                  command):
    """The launcher (``run`` is None on a node other than 0): the checks that need no GPU work, torchrun,
    then the scaling efficiency of what rank 0 handed back."""
    check_model_name(spec.model)  # fail here, once, rather than in every rank
    launch.check_nodes(nnodes, node_rank, rdzv_endpoint)
    gpus = launch.visible_gpu_count()
    launch.check_nproc(spec.nproc, spec.device, gpus)
    # host memory for every rank, before any is started: past it the OOM killer takes the launcher
    check_ranks_fit(spec.nproc, spec.model, spec.img_size, 1000, "cpu" if spec.device == "cpu" or not gpus else "cuda")
    if spec.cuda_graph and (spec.device == "cpu" or not gpus):
        require_cuda(True, "cpu")  # once here, not in every rank
    baseline = read_baseline(baseline_run, spec) if baseline_run and node_rank == 0 else None
    label_launcher_run(run, spec, "bench", task=spec.task, cuda_graph=spec.cuda_graph)
    argv = ["-m", "vitreg.cli", "bench", *launch.options_to_args(options)]
    if run_name:
        argv += ["--run-name", run_name]
    if run is not None:
        progress(f"run {run.run_id} at {tracking.tracking_uri()}: {spec.nproc} process(es) per node x {nnodes} "
                 f"node(s), batch_size={spec.batch_size} per process")
    with launch.launched(argv, spec.nproc, run, nnodes, node_rank, rdzv_endpoint, progress, command) as handed:
        if baseline is not None:
            metrics = handed.metrics
            world_size = int(metrics.get("train_world_size") or metrics.get("infer_world_size") or spec.nproc * nnodes)
            log_scaling_efficiency(run, baseline, metrics, world_size, handed.tags, progress)


# --------------------------------------------------------------------------------------------
# scaling efficiency against a 1-process baseline run

# Resolved values (tags) that must agree for two runs to measure the same work per process.
SCALING_CONFIG_TAGS = ("model", "gpu", "amp", "compile", "cuda_graph", "batch_size", "img_size", "device")


@dataclass(frozen=True)
class Baseline:
    run_id: str
    metrics: dict
    tags: dict


def read_baseline(run_id: str, spec: BenchSpec) -> Baseline:
    """Fetch and check ``baseline_run`` before any GPU time is spent on the scaled run."""
    try:
        base = tracking.get_run(run_id)
    except Exception as exc:  # MlflowException (no such run), or the server
        raise VitregError(f"baseline_run={run_id!r} cannot be read from {tracking.tracking_uri()}: "
                          f"{first_line(exc)}") from None
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
    wanted = {"model": spec.model, "compile": spec.compile, "batch_size": str(spec.batch_size),
              "cuda_graph": str(spec.cuda_graph).lower()}
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
