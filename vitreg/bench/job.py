"""The ``bench`` job: options -> spec -> plan (this process, or torchrun) -> runner -> tracking.

The entry point and the ``vitreg bench`` command both call :func:`bench`. The options are parsed
once, in the process the user started, inside its run; the plan follows from the spec.

DDP (``nproc > 1``, or several hosts): this process becomes the launcher (:func:`_launch_bench`, through
the launcher sequence both DDP jobs share, :func:`vitreg.ddp.launcher.launch_job`).
It holds the one MLflow run (system metrics included), checks what needs no GPU, runs the same
bench under torchrun and logs what the ranks hand back (:func:`vitreg.ddp.launcher.launched`). Each
rank runs :func:`bench` too, on its own GPU with ``batch_size`` images per GPU; the figures are
reduced over the ranks (:mod:`vitreg.ddp.world`) and rank 0 hands them to the launcher, which
also relates them to ``baseline_run``. With ``nproc == 1`` none of that happens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from vitreg.analysis.frame import FOLDED_INTO, SCALED_COLUMNS
from vitreg.bench.report import report_markdown, results_table
from vitreg.bench.results import BenchResult
from vitreg.bench.runner import run_benchmark
from vitreg.config.options import identity_names, option
from vitreg.config.parse import param_text
from vitreg.config.spec import BenchSpec
from vitreg.console import progress
from vitreg.ddp import launcher as launch
from vitreg.ddp import world as distributed
from vitreg.ddp.context import JobContext, job_context
from vitreg.errors import VitregError, first_line
from vitreg.hardware.env import capture_environment
from vitreg.measure.graphs import require_cuda
from vitreg.models.factory import check_model_name, create_model
from vitreg.models.memory import check_ranks_fit
from vitreg.tracking import naming
from vitreg.tracking import runs as tracking
from vitreg.tracking.spool import clean_tags
from vitreg.tracking.tags import log_setup, log_what_ran, resolved_tags, world_tags


def bench(options: dict, experiment: str | None = None, run_name: str | None = None, progress=progress,
          command: str | None = None, *, placement: launch.Placement | None = None,
          baseline_run: str | None = None) -> BenchResult | None:
    """Run one benchmark and log it as one MLflow run. Raises VitregError on bad input (run ends FAILED).

    ``nproc > 1`` (or a ``placement`` over several hosts: nnodes, node_rank, rdzv_endpoint) launches
    torchrun and returns None in this launching process. ``baseline_run``: the run id of a 1-process
    run of the same config; its throughput gives ``train_scaling_efficiency`` (and
    ``infer_scaling_efficiency``) = throughput_N / (N * throughput_1).
    """
    command = launch.typed_command(command)
    placement = placement or launch.Placement()
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
    with launch.launcher_run(run_name, experiment, placement.run_node) as run:
        spec = BenchSpec.from_options(options)  # the one parse of the options in this process
        if launch.needs_torchrun(spec.nproc, placement.nnodes):
            job = launch.JobLaunch("bench", options, run_name, placement, command, spec.task, spec.cuda_graph)
            _launch_bench(run, spec, job, progress, baseline_run)
            result = None
        else:
            result, _ = _bench_in_run(run, spec, run_name, progress, command, baseline_run)
            print(results_table(result))
    if run is not None:
        _print_logged(run)
    return result


def _print_logged(run) -> None:
    print(tracking.where_logged(run))


@dataclass(frozen=True)
class Logged:
    """What a bench-shaped job (bench, infer) logs of its own around the runner: its run's name
    (``name(batch_size, throughputs=None)``), tags and params besides the resolved ones, what the
    progress line calls the model, and a hook ``after(result, tags)`` once results.json is logged."""

    run_name: str | None
    command: str
    name: Callable
    tags: Callable  # tags(env) -> the job's own tags
    params: dict = field(default_factory=dict)
    what: str = ""  # the progress line's "<model_uri> (<model>) on "
    after: Callable = lambda result, tags: None


def benchmark_in_run(ctx: JobContext, info, model_factory, logged: Logged) -> BenchResult:
    """The body bench and infer share: the run's name, tags, params and environment; the benchmark;
    its metrics, what ran, results.json and report.md; the run renamed with its throughput, its note."""
    run, spec, hw, runtime = ctx.run, ctx.spec, ctx.hardware, ctx.runtime
    env = capture_environment()
    run.set_name(logged.run_name or logged.name(spec.batch_size))  # GPU label first: the runs list cuts names
    tags = {**env.to_tags(), **resolved_tags(spec, hw, runtime, info.img_size, task=spec.task,
                                             cuda_graph=spec.cuda_graph), **logged.tags(env)}
    run.set_tags(tags)
    params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
              "img_size": info.img_size, **logged.params}
    log_setup(run, params, env, ctx.progress)
    ctx.progress(f"run {run.run_id} at {tracking.tracking_uri()}; {logged.what}gpu={hw.label} ({ctx.detected.name}), "
                 f"amp={runtime.amp}, compile={spec.compile}")

    result = run_benchmark(spec, hw, runtime, ctx.progress, model_factory=model_factory, wrap=ctx.wrap,
                           reducer=ctx.reducer)

    run.log_metrics(result.metrics())
    log_what_ran(run, result)
    run.log_dict(result.to_dict(), "results.json")
    logged.after(result, tags)
    run.log_text(report_markdown(result, env, logged.command), "report.md")
    if not logged.run_name:  # now with the figure: the runs list reads without any column set-up
        throughputs = {t.task: t.throughput_img_per_s for t in result.tasks}
        run.set_name(logged.name(result.tasks[0].batch_size, throughputs=throughputs))
    run.set_note(naming.run_note(result.to_dict(), ran_on=hw.detected.name if hw.mismatch else None))
    return result


def _bench_in_run(run, spec: BenchSpec, run_name, progress, command, baseline_run):
    """One process's benchmark inside its run (a plain process, or one rank); returns ``(result, world)``."""
    check_model_name(spec.model)  # cheap, and before any device work
    ctx = job_context(run, spec, progress, distributed.ResultReducer, cuda_graph=spec.cuda_graph)
    world = ctx.world
    # baseline_run under a torchrun the user started: rank 0 checks it now, before the GPU time
    # (under a vitreg launcher, the launcher checked it and relates the figures itself).
    baseline = None
    if baseline_run and world.distributed and world.is_main and not launch.launched_by_vitreg():
        baseline = read_baseline(baseline_run, spec)
    elif baseline_run and not world.distributed:
        ctx.progress(f"baseline_run={baseline_run} ignored: scaling efficiency is for nproc>1 runs")
    model, info = create_model(spec.model, spec.img_size)  # on the CPU: checks img_size before GPU work

    def after(result, tags):
        if ctx.reducer is None:
            return
        run.log_dict(ctx.reducer.per_rank_report(), "ranks.json")  # each rank's own figures: stragglers show
        if baseline is not None:
            log_scaling_efficiency(run, baseline, result.metrics(), world.world_size, clean_tags(tags),
                                   ctx.progress)

    hw = ctx.hardware
    name = naming.RunTitle(hw.label, spec.model, ctx.runtime.amp, spec.compile, world.world_size, spec.cuda_graph,
                           ran_on=hw.detected.profile.label if hw.mismatch else None).name
    world_spec = spec if "train" in spec.tasks else None  # infer wraps no DDP
    logged = Logged(run_name, command, name, lambda env: world_tags(world, ctx.runtime, env, world_spec), after=after)
    return benchmark_in_run(ctx, info, lambda: (model, info), logged), world


def _launch_bench(run, spec: BenchSpec, job: launch.JobLaunch, progress, baseline_run) -> None:
    """The launcher (``run`` is None on a node other than 0): the checks that need no GPU work, torchrun,
    then the scaling efficiency of what rank 0 handed back."""
    baseline = []

    def check(gpus: int) -> None:
        check_model_name(spec.model)  # fail here, once, rather than in every rank
        # host memory for every rank, before any is started: past it the OOM killer takes the launcher
        device = "cpu" if spec.device == "cpu" or not gpus else "cuda"
        check_ranks_fit(spec.nproc, spec.model, spec.img_size, 1000, device)
        if spec.cuda_graph and (spec.device == "cpu" or not gpus):
            require_cuda(True, "cpu")  # once here, not in every rank
        if baseline_run and job.placement.node_rank == 0:
            baseline.append(read_baseline(baseline_run, spec))

    def handed(handoff) -> None:
        if baseline:
            metrics = handoff.metrics
            world_size = int(metrics.get("train_world_size") or metrics.get("infer_world_size")
                             or spec.nproc * job.placement.nnodes)
            log_scaling_efficiency(run, baseline[0], metrics, world_size, handoff.tags, progress)

    launch.launch_job(run, spec, dataclasses.replace(job, check=check, handed=handed), progress)


# --------------------------------------------------------------------------------------------
# scaling efficiency against a 1-process baseline run

# Resolved values (tags) that must agree for two runs to measure the same work per process: every identity
# option of bench but the task (a task=both baseline scales a train run) and what scaling goes along (nproc,
# nnodes, the DDP settings), and the hardware.
SCALING_CONFIG_TAGS = tuple(n for n in identity_names("bench") if n != "task"
                            and FOLDED_INTO.get(n, n) not in SCALED_COLUMNS) + ("gpu", "device")


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
    # (a tag the baseline lacks: its param, else it predates the option and ran at its default)
    wanted = {k: param_text(getattr(spec, k)) for k in SCALING_CONFIG_TAGS if k != "device"}
    wanted = {k: v for k, v in wanted.items() if v not in ("auto", "0")}  # auto (and img_size=0) resolve later
    there = {k: tags.get(k, params.get(k, option("bench", k).default_text if k != "gpu" else None)) for k in wanted}
    diff = [f"{k}={there[k]} there, {v} here" for k, v in wanted.items() if there[k] not in (None, v)]
    if diff:
        raise VitregError(f"baseline_run={run_id} is another config ({'; '.join(diff)}): pass a 1-process run "
                          f"of the same {', '.join(k for k in SCALING_CONFIG_TAGS if k != 'device')}")
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
