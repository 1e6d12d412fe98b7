"""The ``sweep`` job: every combination of its axes, each a child run of one parent run in its own ``vitreg bench``
process, on this host's GPUs, a Ray cluster or SLURM; the parent logs the comparison of its children."""

from __future__ import annotations

import json
import math
import tempfile
import threading
from dataclasses import dataclass, field

from vitreg.config.options import option
from vitreg.config.parse import masked_runtime_env
from vitreg.console import progress
from vitreg.errors import VitregError
from vitreg.fleet import children
from vitreg.fleet.axes import LIST_AXES, Combination, axis_texts_of, check_size, collect_axes, count, plan
from vitreg.fleet.board import Board, Clock, format_seconds
from vitreg.tracking import runs as tracking
from vitreg.tracking.spool import offline_mode

SWEEP_LISTS = tuple(LIST_AXES)
#: the wall time of one tiny child (start-up, imports, the model, logging: 22.7 s for test_vit on this project's
#: loaded 2-core host, docs/benchmarks.md, suite sweep); the estimate before a sweep starts is built on it
CHILD_START_S = 23.0
#: a later child's in a warm worker (its run, model, logging: 1-4 s on the H200, ~1.5 s on a 2-core CPU,
#: benchmarks/results/h200-2026-12-03-tta/)
WARM_CHILD_S = 2.0
#: on each child run: its combination's options and the sweep's common ones (JSON), what --rerun-failed runs again
OPTIONS_TAG = "sweep_child_options"
#: on the parent: the sweep's own options as given (its engine, Ray address, SLURM partition...), JSON: a re-run's
SETTINGS_TAG = "sweep_settings"
#: the parent's artifact: the common options and every combination in sweep_index order, what a re-run starts
#: again when a combination never got a child (the sweep was stopped first)
COMBINATIONS_FILE = "sweep_combinations.json"


@dataclass(frozen=True)
class SweepSettings:
    engine: str
    ray_address: str
    max_parallel: int
    max_combinations: int
    experiment: str | None
    rerun_failed: str  # a parent run id: re-run its failed children instead of a new sweep
    isolate: str  # engine=local: "worker" (a warm process per GPU runs its children) or "process" (one a child)
    share_node: bool  # engine=ray/slurm: CPU children may share a node (else each has its node alone)
    own: dict = field(default_factory=dict, compare=False)  # all of them, as given (engine=slurm reads its own)

    def given(self) -> dict:
        """The engine's options given other than their defaults (click fills those in): what the parent records and
        a re-run's command line changes."""
        skip = ("rerun_failed", "experiment", "axes", *SWEEP_LISTS)
        return {k: v for k, v in self.own.items() if k not in skip and v not in (None, option("sweep", k).default,
                                                                                 option("sweep", k).default_text)}

    @classmethod
    def parse(cls, own: dict) -> "SweepSettings":
        def value(name):
            return option("sweep", name).parse(own.get(name, option("sweep", name).default))

        return cls(value("engine"), str(value("ray_address") or "auto"), value("max_parallel"),
                   value("max_combinations"), own.get("experiment"), str(value("rerun_failed") or "").strip(),
                   value("isolate"), value("share_node"), dict(own))


def run_sweep(own: dict, common: dict | None = None, max_oom_retries: int = 3, progress=progress) -> dict:
    """Run every combination as a child run, everything checked before a child starts. A failed child is recorded
    FAILED and the sweep goes on; one out of GPU memory is retried with a smaller batch."""
    common = dict(common or {})
    settings = SweepSettings.parse(own)
    if settings.rerun_failed:
        return rerun_failed(settings, max_oom_retries, progress)
    axes = _axes(own, common)
    if offline_mode():
        raise VitregError("sweep needs the tracking store (its runs are child runs of one parent run there): "
                          "unset VITREG_OFFLINE, or run `vitreg bench --offline true` once per combination")
    engine = _engine(settings, common, progress)
    try:
        engine.expand_gpus(axes)
        check_size(count(axes), settings.max_combinations)
        combos = plan(axes, common)
        engine.check(combos, common)
        rounds = math.ceil(len(combos) / engine.slots)
        warm = isinstance(engine, LocalEngine) and settings.isolate == "worker"
        start_s = CHILD_START_S + (rounds - 1) * WARM_CHILD_S if warm else rounds * CHILD_START_S
        each = (f"~{CHILD_START_S:.0f} s for a GPU's warm worker, ~{WARM_CHILD_S:.0f} s a child in it" if warm
                else f"~{CHILD_START_S:.0f} s a child")
        progress(f"sweep: {len(combos)} combinations, {engine.slots} at once on {engine.where}: about "
                 f"{format_seconds(start_s)} of start-up alone ({each}), plus each child's work")
        tracking.check_server()
        return _run_parent(settings, axes, combos, common, engine, max_oom_retries, progress)
    finally:
        engine.close()


def check_options(own: dict, common: dict) -> None:
    """What :func:`run_sweep` checks before its engine starts and its parent run exists, so a typo costs neither:
    the settings, the size (``gpu=all`` as one type: a lower bound), every combination, each GPU label here."""
    from vitreg.hardware.profiles import check_label_here

    settings = SweepSettings.parse(own)
    if settings.rerun_failed:  # the combinations are the failed children's own, read from their runs
        _refuse_new_work(own, common)
        return
    common = dict(common)
    axes = _axes(own, common)
    check_size(count(axes), settings.max_combinations)
    combos = plan(axes, common)
    if settings.engine == "local" and "gpu" not in axes:  # several GPU types: the local engine says why not
        for combo in combos:
            check_label_here(str(combo.get("gpu", common.get("gpu") or "auto")), str(common.get("device") or "auto"),
                             option("bench", "allow_gpu_mismatch").parse(common.get("allow_gpu_mismatch", False)))


def _refuse_new_work(own: dict, common: dict) -> None:
    """A re-run runs each combination with the options it was started with: an axis or a bench option given with
    it (other than its default) is refused by name, never dropped in silence."""
    work = {**{name: own.get(name) for name in (*SWEEP_LISTS, "axes")}, **common}
    given = [option("sweep", k).flags[0] for k, v in work.items()
             if v and v not in (option("sweep", k).default, option("sweep", k).default_text)]
    if given:
        raise VitregError(f"--rerun-failed re-runs each combination with the options it was started with, so "
                          f"{', '.join(given)} would not apply: leave {'them' if len(given) > 1 else 'it'} out (only "
                          f"the engine's options may change), or start a new sweep with them")


def _axes(own: dict, common: dict) -> dict:
    return collect_axes({name: own.get(name, option("sweep", name).default) for name in SWEEP_LISTS},
                        axis_texts_of(own.get("axes", "")), common)


def _engine(settings: SweepSettings, common: dict, progress):
    if settings.engine == "slurm":
        from vitreg.fleet.slurm_engine import SlurmEngine

        return SlurmEngine(settings.own, settings.max_parallel, progress, settings.share_node)
    if settings.engine == "ray":
        from vitreg.fleet.ray_engine import RayEngine

        return RayEngine(settings.ray_address, settings.max_parallel, progress, settings.share_node,
                         str(common.get("device") or "auto"),
                         option("sweep", "ray_runtime_env").parse(settings.own.get("ray_runtime_env")))
    return LocalEngine(settings.max_parallel, str(common.get("device") or "auto"), settings.isolate)


def _run_parent(settings, axes, combos, common, engine, max_oom_retries, progress) -> dict:
    from vitreg.tracking import naming  # here: it imports pandas (analysis.render), which a typo check must not pay

    outcome = {"finished": [], "failed": []}
    parent_name = naming.sweep_run_name(axes, common, len(combos))
    with tracking.tracked_run(run_name=parent_name, experiment=settings.experiment, system_metrics=False) as parent:
        parent.set_name(parent_name)  # under mlflow run the parent arrives with a random name
        parent.set_tags({"vitreg_job": "sweep", "sweep_engine": settings.engine,
                         SETTINGS_TAG: json.dumps(masked_runtime_env(settings.given()), default=str)})
        parent.log_dict({"common": common, "combinations": [{"label": c.label, "options": dict(c.options)}
                                                            for c in combos]}, COMBINATIONS_FILE)
        parent.log_params({**{f"axis_{name}": ",".join(map(str, values))[:500] for name, values in axes.items()},
                           "n_combinations": len(combos), "engine": settings.engine})
        context = _Context(parent, common, len(combos), max_oom_retries, outcome, progress,
                           Board(engine.slots, progress))
        # the comparison's libraries (pandas, matplotlib: ~1.5 s) load while the children run, not after them
        threading.Thread(target=_import_comparison, daemon=True).start()
        engine.run(context, combos)
        _conclude(parent, context.last_ok, progress)
    return outcome


def _conclude(parent, last_ok: dict, progress) -> None:
    """The parent's counts and comparison; it ends FAILED when any combination's last attempt did not finish."""
    failed = sorted(index for index, ok in last_ok.items() if not ok)
    parent.log_metrics({"n_finished": len(last_ok) - len(failed), "n_failed": len(failed)})
    if len(failed) < len(last_ok):
        _log_comparison(parent)
    summary = f"sweep {parent.run_id}: {len(last_ok) - len(failed)} finished, {len(failed)} failed"
    if failed:
        raise VitregError(f"{summary} (see the vitreg_error tags of the child runs): re-run the failed ones under the "
                          f"same parent with `vitreg sweep --rerun-failed {parent.run_id}`")
    progress(summary)


def rerun_failed(settings: SweepSettings, max_oom_retries: int = 3, progress=progress) -> dict:
    """``--rerun-failed PARENT``: each combination of that sweep with no FINISHED child runs again as a new child of
    the same parent, with its options, on the parent's engine and engine options (those given now win: :func:`_refuse_new_work`); the child
    it replaces is tagged ``sweep_superseded_by``. The parent ends with the status of all its combinations."""
    parent_run, runs = tracking.run_and_children(settings.rerun_failed)
    latest = _latest_child_per_combination(parent_run, runs)
    common, again = _unfinished(parent_run, latest)
    outcome = {"finished": [], "failed": []}
    if not again:
        progress(f"sweep {parent_run.info.run_id}: no failed child to re-run ({len(latest)} finished)")
        return outcome
    settings = _settings_of(parent_run, settings)
    combos = list(again.values())
    engine = _engine(settings, common, progress)
    try:
        engine.check(combos, common)
        total = parent_run.data.params.get("n_combinations", len(latest))
        progress(f"sweep {parent_run.info.run_id}: re-running {len(combos)} of its {total} combinations (those "
                 f"with no finished child) on {engine.where}")
        with tracking.reopened_run(parent_run.info.run_id) as parent:
            context = _Context(parent, common, len(combos), max_oom_retries, outcome, progress,
                               Board(engine.slots, progress), indices=list(again),
                               superseded={i: latest[i].info.run_id for i in again if i in latest})
            context.last_ok.update({index: True for index in latest if index not in again})
            engine.run(context, combos)
            _conclude(parent, context.last_ok, progress)
    finally:
        engine.close()
    return outcome


def _latest_child_per_combination(parent_run, runs: list) -> dict:
    """sweep_index -> the child run started last for it (retries and re-runs come later)."""
    if parent_run.data.tags.get("vitreg_job") != "sweep":
        raise VitregError(f"run {parent_run.info.run_id} is not a sweep's parent run: pass the id the sweep printed "
                          f"(`sweep RUN_ID: ...`)")
    if parent_run.info.status in ("RUNNING", "SCHEDULED"):  # its own process may still start or end children
        raise VitregError(f"sweep {parent_run.info.run_id} is still {parent_run.info.status}: re-run its failed "
                          f"children once it has ended (its process gone: `vitreg runs --stale --fix` ends it)")
    latest: dict = {}
    for run in sorted(runs, key=lambda r: r.info.start_time or 0):
        if "sweep_index" in run.data.tags:
            latest[int(run.data.tags["sweep_index"])] = run
    return latest


def _settings_of(parent_run, settings: SweepSettings) -> SweepSettings:
    """The parent's settings (an older vitreg's: its engine tag), those given now over them."""
    saved = parent_run.data.tags.get(SETTINGS_TAG)
    try:
        recorded = json.loads(saved) if saved else {"engine": parent_run.data.tags.get("sweep_engine", "local")}
    except ValueError:  # cut at MLflow's 8,000 characters by an older vitreg
        raise VitregError(f"sweep {parent_run.info.run_id}'s {SETTINGS_TAG} tag is cut short ({len(saved):,} "
                          f"characters): run that sweep again") from None
    return SweepSettings.parse({**recorded, **settings.given(), "rerun_failed": settings.rerun_failed})


def _unfinished(parent_run, latest: dict) -> tuple[dict, dict]:
    """(the common options, sweep_index -> combination) of the combinations with no FINISHED child."""
    def unfinished(index: int) -> bool:
        return index not in latest or latest[index].info.status != "FINISHED"

    planned = tracking.load_run_dict(parent_run.info.run_id, COMBINATIONS_FILE)
    if planned is None:  # a parent of an older vitreg records none: its children's tags say what started
        again = [index for index in latest if unfinished(index)]
        common, combos = _combinations_of([latest[index] for index in again]) if again else ({}, [])
        return common, dict(zip(again, combos))
    return planned["common"], {index: Combination(tuple(c["options"].items()), c["label"])
                               for index, c in enumerate(planned["combinations"], 1) if unfinished(index)}


def _combinations_of(child_runs) -> tuple[dict, list[Combination]]:
    """The sweep's common options and each child's combination, read back from its :data:`OPTIONS_TAG`."""
    saved = [(run, run.data.tags.get(OPTIONS_TAG)) for run in child_runs]
    missing = [run.info.run_id for run, text in saved if not text]
    if missing:
        raise VitregError(f"child run {missing[0]} does not say which options it ran with (no {OPTIONS_TAG} tag: "
                          f"made by an older vitreg): run that sweep again")
    loaded = [(run, json.loads(text)) for run, text in saved]
    combos = [Combination(tuple(opts["combination"].items()), run.data.tags.get("sweep_label", run.info.run_name))
              for run, opts in loaded]
    return loaded[0][1]["common"], combos


@dataclass
class _Context:
    """What every child of one sweep shares."""

    parent: object
    common: dict
    total: int
    max_oom_retries: int
    outcome: dict
    progress: object
    board: Board
    # a re-run's combinations by the engines' count (1, 2, ...) -> their sweep_index in the first run; [] at first
    indices: list = field(default_factory=list)
    last_ok: dict = field(default_factory=dict)  # sweep_index -> whether its latest child finished
    superseded: dict = field(default_factory=dict)  # a re-run's sweep_index -> the child its first child replaces
    _index_of: dict = field(default_factory=dict)  # child run id -> sweep_index

    def child_run(self, combo: Combination, index: int, attempt: int, extra_tags: dict | None = None) -> str:
        index = self.indices[index - 1] if self.indices else index
        name = combo.label + (f"-retry{attempt}" if attempt else "")
        tags = {"requested_batch_size": combo.batch_size, "sweep_index": index, "sweep_label": combo.label,
                **(extra_tags or {})}  # the label stays a tag: bench names its run after its result
        # a re-run starts again from the batch first asked for, not from an out-of-memory retry's smaller one
        first = {**dict(combo.options), "batch_size": tags["requested_batch_size"]}
        tags[OPTIONS_TAG] = json.dumps({"common": self.common, "combination": first}, default=str)
        child_id = tracking.create_child_run(self.parent, name, tags)
        self._index_of[child_id] = index
        if index in self.superseded:  # the old child stays (its failure is history): it says what replaced it
            tracking.set_run_tags(self.superseded.pop(index), {tracking.SUPERSEDED_TAG: child_id})
        return child_id

    def record(self, child_id: str, ok: bool) -> None:
        self.outcome["finished" if ok else "failed"].append(child_id)
        self.last_ok[self._index_of[child_id]] = ok


class LocalEngine:
    """``engine=local``: this host's GPUs, one child per ``nproc`` of them at once (CPU: one at a time), in the
    warm worker of its GPUs (``isolate=worker``) or a process of its own."""

    def __init__(self, max_parallel: int, device: str, isolate: str = "worker"):
        from vitreg.fleet.local import HostPool, host_gpus

        self.pool = HostPool(host_gpus(device), max_parallel, isolate)
        self.slots = self.pool.slots
        self.where = f"this host ({len(self.pool.gpus)} GPUs)" if self.pool.gpus else "this host's CPU"

    def expand_gpus(self, axes: dict) -> None:
        if "gpu" in axes:
            raise VitregError(f"gpu={','.join(axes['gpu'])} names several GPU types and this host has one: pass one "
                              f"gpu label (or auto), or use engine=ray on a cluster that has them")

    def check(self, combos: list[Combination], common: dict) -> None:
        for combo in combos:
            self.pool.check_fits(_nproc(combo, common))
        self.pool.warm_up()  # the children are sound: their workers import while the parent run is made

    def run(self, ctx: _Context, combos: list[Combination]) -> None:
        from vitreg.fleet.local import run_all

        for _ in combos:
            ctx.board.queued("local")
        indexed = list(enumerate(combos, 1))
        run_all(indexed, lambda job: _nproc(job[1], ctx.common),
                lambda job, gpus: self._combination(ctx, job[1], job[0], gpus), self.pool)

    def _combination(self, ctx: _Context, combo: Combination, index: int, gpus: list[str]) -> None:
        """One combination: a child run, and a retry with a smaller batch after each out-of-memory failure."""
        label = f"sweep {index}/{ctx.total}"
        bs = combo.batch_size
        for attempt in range(ctx.max_oom_retries + 1):
            ctx.progress(f"{label}: {combo.label} (batch {bs})")
            ctx.board.started("local")
            clock = Clock()
            child_id = ctx.child_run(combo, index, attempt)
            run_env = tracking.env_for_run({}, child_id, ctx.parent.experiment_id)
            returncode, tail, shared, log = self.pool.launch(children.child_command(combo, bs, ctx.common), run_env,
                                                             gpus, lambda line: ctx.progress(f"{label}: {line}"))
            reason = tracking.finish_child_run(child_id, returncode, tail, stopped=bool(self.pool.stopping),
                                               tags={children.HOST_SHARE_TAG: shared}, log=log)
            ctx.record(child_id, returncode == 0)
            ctx.board.ended("local", returncode == 0, clock.seconds())
            if returncode == 0 or self.pool.stopping:
                return
            ctx.progress(f"{label}: FAILED: {reason}")
            smaller = children.smaller_batch(bs, child_id) if attempt < ctx.max_oom_retries else 0
            if smaller < 1:
                return
            ctx.progress(f"out of memory at batch {bs}: retrying with batch {smaller}")
            ctx.board.requeued("local")
            bs = smaller

    def close(self) -> None:
        self.pool.close()


def _nproc(combo: Combination, common: dict) -> int:
    return int(combo.get("nproc", common.get("nproc") or 1))


def _import_comparison() -> None:
    import matplotlib.backends.backend_agg  # noqa: F401  what the plots render with

    from vitreg.analysis import comparison, render, report  # noqa: F401
    from vitreg.tracking import search  # noqa: F401


def _log_comparison(parent) -> None:
    from vitreg.analysis.comparison import compare_gpus
    from vitreg.analysis.render import format_table
    from vitreg.analysis.report import write_report
    from vitreg.tracking.search import tidy

    comparison = compare_gpus(tidy(tracking.child_runs(parent)), baseline=None)
    with tempfile.TemporaryDirectory(prefix="vitreg-sweep-") as tmp:
        for f in write_report(comparison, tmp):
            parent.log_artifact(f, "comparison")
    print(format_table(comparison))
