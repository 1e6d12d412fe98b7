"""The ``bench`` job and the ``infer`` job (bench's body on a registered model's weights, linked to its version
both ways). Each resolves at its top one frozen :class:`BenchPlan`, which the body (:func:`benchmark_in_run`)
takes and nothing else. A process is a DDP job's launcher (:func:`_launch_bench`), one of its ranks, or a plain
process; which one relates the figures to ``baseline_run`` is decided in :func:`scaling_baseline`.
"""

from __future__ import annotations

import functools
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from vitreg.analysis.frame import FOLDED_INTO, SCALED_COLUMNS
from vitreg.bench.results import BenchResult, report_markdown, results_table, run_warning
from vitreg.bench.runner import run_benchmark
from vitreg.config.options import identity_names, option
from vitreg.config.parse import param_text
from vitreg.config.spec import BenchSpec, parse_int
from vitreg.console import CONSOLE_LOG, detail, progress, take_console
from vitreg.ddp import launcher as launch
from vitreg.ddp import world as distributed
from vitreg.ddp.context import JobContext, job_context
from vitreg.errors import VitregError, first_line
from vitreg.environment import capture_environment
from vitreg.measure.graphs import require_cuda
from vitreg.measure.metrics import job_metrics
from vitreg.measure.timing import PHASES
from vitreg.models.factory import ModelInfo, check_model_name, create_model
from vitreg.models.memory import check_ranks_fit
from vitreg.tracking import checkpoint_sources, naming
from vitreg.tracking import runs as tracking
from vitreg.tracking.spool import clean_tags
from vitreg.tracking.tags import log_setup, log_what_ran, resolved_tags, world_tags


def bench(options: dict, experiment: str | None = None, run_name: str | None = None, progress=progress,
          command: str | None = None, *, placement: launch.Placement | None = None,
          baseline_run: str | None = None) -> BenchResult | None:
    """Run one benchmark as one MLflow run; a DDP job's launcher returns None. ``baseline_run``: a 1-process run of
    the same config, for ``<task>_scaling_efficiency``."""
    PHASES.begin()  # from the process's start: what a command costs before its first timed step
    command = launch.typed_command(command)
    placement = placement or launch.Placement()
    if distributed.inside_torchrun():  # one rank of a job: a vitreg launcher's or a torchrun the user started
        with launch.rank_run(run_name, experiment) as run:
            plan = plan_bench(run, BenchSpec.from_options(options), run_name, command, baseline_run, progress)
            result = benchmark_in_run(plan)
        distributed.destroy()
        if plan.context.world.is_main:
            print(results_table(result))
            if not launch.launched_by_vitreg():
                _print_end(run, result)
        return result
    spec, built = _build_ahead(options, placement)
    with launch.launcher_run(run_name, experiment, placement.run_node) as run:
        spec = spec or BenchSpec.from_options(options)  # options that did not parse fail here, inside the run
        if launch.needs_torchrun(spec.nproc, placement.nnodes):
            job = launch.JobLaunch("bench", options, run_name, placement, command, spec.task, spec.cuda_graph)
            _launch_bench(run, spec, job, baseline_run, progress)
            result = None
        else:
            plan = plan_bench(run, spec, run_name, command, baseline_run, progress, built)
            result = benchmark_in_run(plan)
            print(results_table(result))
    if run is not None:
        _print_end(run, result)
    return result


def infer(model_uri: str, options: dict, experiment: str | None = None, run_name: str | None = None,
          progress=progress, command: str | None = None) -> BenchResult:
    """Pull ``model_uri`` and benchmark it (task=infer unless ``options['task']`` says otherwise) as one run."""
    PHASES.begin()
    command = launch.typed_command(command)
    model_uri = str(model_uri or "").strip()
    options = {"task": "infer", **{k: v for k, v in options.items() if v is not None}}
    for key in FROM_CHECKPOINT:
        if key in options:
            raise VitregError(f"{key} comes from the registered model's spec.json: drop {key}= and pass model_uri")
    if parse_int(options.get("nproc", 1), "nproc", 1) != 1:
        raise VitregError("infer benchmarks one process: pass nproc=1 (multi-GPU scaling is `bench`'s job)")
    with tracking.tracked_run(run_name=run_name, experiment=experiment) as run:
        if not model_uri:
            raise VitregError("model_uri is empty: pass e.g. model_uri=models:/deit-tiny@champion")
        plan = plan_infer(run, model_uri, options, run_name, command, progress)
        run.log_dict(plan.pulled.spec, "model_spec.json")
        result = benchmark_in_run(plan)
    print(results_table(result))
    if plan.pulled.version_uri:
        print(f"tagged {plan.pulled.version_uri} last_infer_run_id={run.run_id}")
    _print_end(run, result)
    return result


def _print_end(run, result: BenchResult | None) -> None:
    """The run's last lines: where its data is and the warning, last (what a user must not miss), unless the run is
    still in the local spool: there the `vitreg sync` that delivers it comes last, or the data is lost."""
    warning = [said] if (said := run_warning(result)) else []
    where = tracking.where_logged(run)
    print("\n".join([*warning, where] if tracking.still_spooled(run) else [where, *warning]))


#: Options that the registered checkpoint decides, not the user.
FROM_CHECKPOINT = ("model", "img_size")


@dataclass(frozen=True)
class BenchPlan:
    """One process of a bench or infer job, resolved at its top: nothing later goes back to the options."""

    context: JobContext  # spec, detected and resolved hardware, runtime, DDP world (wrap, reducer), run, progress
    model: object  # the model to benchmark, on the CPU: built (bench) or pulled (infer)
    info: ModelInfo  # its facts: name, img_size, params, classes
    title: naming.RunTitle  # the run's name, before the figures and with them
    run_name: str | None  # the user's name for the run: then kept as given
    command: str  # what the user typed, for report.md
    baseline: Baseline | None = None  # this process relates the figures to it (scaling efficiency)
    ddp_spec: BenchSpec | None = None  # the spec whose DDP settings wrapped the model (train); None: nothing wrapped
    model_uri: str | None = None  # infer: what the user asked for
    pulled: checkpoint_sources.PullResult | None = None  # infer: the checkpoint benchmarked, linked both ways
    params: dict = field(default_factory=dict)  # params besides the spec's and the resolved ones


def _build_ahead(options: dict, placement: launch.Placement) -> tuple[BenchSpec | None, Future | None]:
    """The one parse of the options in this process and a plain process's model, built on a thread while its run
    opens and the hardware is read (MLflow's import and the store take seconds of the mission's command, ViT-B's
    weights one more): the same model, sooner. No model where torchrun's ranks build it; neither where the options
    do not parse (the run then says why)."""
    try:
        spec = BenchSpec.from_options(options)
    except VitregError:
        return None, None
    if launch.needs_torchrun(spec.nproc, placement.nnodes):
        return spec, None
    pool = ThreadPoolExecutor(1, thread_name_prefix="vitreg-model")
    try:
        return spec, pool.submit(create_model, spec.model, spec.img_size)
    finally:
        pool.shutdown(wait=False)  # no wait here: its thread ends with the build


def plan_bench(run, spec: BenchSpec, run_name: str | None, command: str, baseline_run: str | None,
               progress, built: Future | None = None) -> BenchPlan:
    """A plain process's or a rank's bench: the model name checked before any device work, the world joined, the
    baseline read before the GPU time, the model built on the CPU (``built``: on a thread, since the start)."""
    check_model_name(spec.model)  # cheap, and before any device work
    ctx = job_context(run, spec, progress, distributed.ResultReducer, cuda_graph=spec.cuda_graph)
    world, hw = ctx.world, ctx.hardware
    # a rank under a vitreg launcher leaves the baseline to its launcher; one under a torchrun the user
    # started: rank 0 reads it now
    baseline = scaling_baseline(baseline_run, spec, scaled=world.distributed,
                                speaks=world.is_main and not launch.launched_by_vitreg(), progress=ctx.progress)
    model, info = built.result() if built is not None else create_model(spec.model, spec.img_size)
    title = naming.RunTitle(hw.label, spec.model, ctx.runtime.amp, spec.compile, world.world_size, spec.cuda_graph,
                            ran_on=hw.detected.profile.label if hw.mismatch else None, img_size=info.img_size)
    return BenchPlan(ctx, model, info, title, run_name, command, baseline,
                     ddp_spec=spec if "train" in spec.tasks else None)  # infer wraps no DDP


def plan_infer(run, model_uri: str, options: dict, run_name: str | None, command: str, progress) -> BenchPlan:
    """infer's one process: the cheap checks first (option values, GPU label), then the download."""
    ctx = job_context(run, BenchSpec.from_options({**options, "model": "pending"}), progress)
    with tempfile.TemporaryDirectory(prefix="vitreg-infer-") as tmp:
        pulled = checkpoint_sources.pull(model_uri, dst=tmp, progress=progress)
    info = pulled.info
    ctx = replace(ctx, spec=BenchSpec.from_options({**options, "model": info.name, "img_size": info.img_size}))
    spec, hw = ctx.spec, ctx.hardware
    what = (f"{pulled.registered_model_name}-v{pulled.registered_model_version}" if pulled.version_uri
            else f"{info.name}-run-{(pulled.run_id or 'local')[:8]}")
    title = naming.RunTitle(hw.label, what, ctx.runtime.amp, spec.compile, cuda_graph=spec.cuda_graph, job="infer",
                            ran_on=hw.detected.profile.label if hw.mismatch else None, img_size=info.img_size)
    return BenchPlan(ctx, pulled.model, info, title, run_name, command, model_uri=model_uri, pulled=pulled,
                     params={"model_uri": model_uri})


def benchmark_in_run(plan: BenchPlan) -> BenchResult:
    """The run's name, tags and params; the benchmark; what it measured logged; the run renamed with its figure."""
    ctx, info = plan.context, plan.info
    run, spec, hw, runtime = ctx.run, ctx.spec, ctx.hardware, ctx.runtime
    env = capture_environment()
    run.set_name(plan.run_name or plan.title.name(spec.batch_size))  # model and image size first: the runs list cuts names
    tags = {**env.to_tags(), **resolved_tags(spec, hw, runtime, info.img_size, task=spec.task,
                                             cuda_graph=spec.cuda_graph),
            **world_tags(ctx.world, runtime, env, plan.ddp_spec), **(link_tags(plan.pulled) if plan.pulled else {})}
    run.set_tags(tags)
    params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
              "img_size": info.img_size, **plan.params}
    log_setup(run, params, env, functools.partial(detail, say=ctx.progress))  # the params echo: the log's
    what = f"{plan.pulled.version_uri or plan.model_uri} ({info.name}) on " if plan.pulled else ""
    ctx.progress(f"run {run.run_id} at {tracking.tracking_uri()}; {what}gpu={hw.label} ({ctx.detected.name}), "
                 f"amp={runtime.amp}, compile={spec.compile}")

    PHASES.mark("setup")
    result = run_benchmark(spec, hw, runtime, ctx.progress, model_factory=lambda: (plan.model, info), wrap=ctx.wrap,
                           reducer=ctx.reducer, command=plan.command)

    run.log_metrics(result.metrics())
    log_what_ran(run, result)
    run.log_dict(result.to_dict(), "results.json")
    if ctx.reducer is not None:
        run.log_dict(ctx.reducer.per_rank_report(), "ranks.json")  # each rank's own figures: stragglers show
    if plan.baseline is not None:
        log_scaling_efficiency(run, plan.baseline, result.metrics(), ctx.world.world_size, clean_tags(tags),
                               ctx.progress)
    if plan.pulled is not None:
        checkpoint_sources.link_infer_run(plan.pulled, run.run_id, result.metrics(), gpu=hw.label)
    run.log_text(report_markdown(result, env, plan.command), "report.md")
    if not plan.run_name:  # now with the figure: the runs list reads without any column set-up
        throughputs = {t.task: t.throughput_img_per_s for t in result.tasks}
        name = plan.title.name(result.tasks[0].batch_size, throughputs=throughputs)
        run.set_name(naming.SEP.join([name, *result.flags]))  # a suspect figure says so where it is read
    run.set_note(naming.run_note(result.to_dict(), ran_on=hw.detected.name if hw.mismatch else None))
    _log_overhead(run, ctx.progress)
    run.log_text(take_console(), CONSOLE_LOG)  # what -v would have printed too, for whoever reads the run later
    return result


def _log_overhead(run, progress) -> None:
    """The command's time outside its timed windows by phase, up to here (the run's end and exit come after)."""
    PHASES.mark("report")
    overhead = job_metrics(PHASES.overhead_s())
    run.log_metrics(overhead)
    detail("overhead outside the timed windows: " + ", ".join(
        f"{name[len('overhead_'):-2]} {s:.2f} s" for name, s in overhead.items()), progress)


def link_tags(pulled: checkpoint_sources.PullResult) -> dict:
    tags = {"vitreg_job": "infer", "model_uri": pulled.uri, "source_run_id": pulled.run_id,
            "checkpoint_step": pulled.spec.get("step")}
    if pulled.version_uri:
        tags.update(registered_model_name=pulled.registered_model_name,
                    registered_model_version=pulled.registered_model_version,
                    registered_model_alias=pulled.alias)
    return tags


def _launch_bench(run, spec: BenchSpec, job: launch.JobLaunch, baseline_run: str | None, progress) -> None:
    """The launcher (``run`` is None on a node other than 0): the checks that need no GPU, torchrun, then the
    scaling efficiency of what rank 0 handed back."""
    gpus = launch.check(spec, job.placement)
    check_model_name(spec.model)  # fail here, once, rather than in every rank
    # host memory for every rank, before any is started: past it the OOM killer takes the launcher
    device = "cpu" if spec.device == "cpu" or not gpus else "cuda"
    check_ranks_fit(spec.nproc, spec.model, spec.img_size, 1000, device)
    if spec.cuda_graph and device == "cpu":
        require_cuda(True, "cpu")  # once here, not in every rank
    baseline = scaling_baseline(baseline_run, spec, scaled=True, speaks=job.placement.node_rank == 0,
                                progress=progress)
    with launch.launch_job(run, spec, job, progress) as handoff:
        if baseline is not None:
            world_size = _world_size(handoff.metrics) or spec.nproc * job.placement.nnodes
            log_scaling_efficiency(run, baseline, handoff.metrics, world_size, handoff.tags, progress)


def _world_size(metrics: dict) -> int:
    return int(metrics.get("train_world_size") or metrics.get("infer_world_size") or 0)


# Resolved values (tags) that must agree for two runs to measure the same work per process: every identity
# option of bench but the task (a task=both baseline scales a train run) and what scaling goes along (nproc,
# nnodes, the DDP settings), and the hardware.
SCALING_CONFIG_TAGS = tuple(n for n in identity_names("bench") if n != "task"
                            and FOLDED_INTO.get(n, n) not in SCALED_COLUMNS) + ("gpu", "device")


def scaling_baseline(baseline_run: str | None, spec: BenchSpec, *, scaled: bool, speaks: bool,
                     progress) -> Baseline | None:
    """Whether this process relates its figures to ``baseline_run``: read and checked by the process that
    ``speaks`` for a ``scaled`` job, before any GPU time; a job of one process says it ignores it."""
    if not baseline_run:
        return None
    if not scaled:
        progress(f"baseline_run={baseline_run} ignored: scaling efficiency is for nproc>1 runs")
        return None
    return read_baseline(baseline_run, spec) if speaks else None


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
    ranks = _world_size(metrics) or 1
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
    """``{task}_scaling_efficiency = throughput_N / (N * throughput_1)``, each task both runs timed."""
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
