"""The ``sweep`` job: every combination of its axes (models x amp x compile x batch size, and any bench option
through ``--axis``), each a child run of one parent run, each in its own ``vitreg bench`` process; on this host
(``engine=local``: one child per GPU at once) or on a Ray cluster (``engine=ray``). The parent logs the comparison
of its children."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field

from vitreg.config.options import option
from vitreg.console import progress
from vitreg.errors import VitregError
from vitreg.fleet import children
from vitreg.fleet.axes import LIST_AXES, Combination, axis_texts_of, check_size, collect_axes, count, plan
from vitreg.fleet.board import Board, Clock, format_seconds
from vitreg.tracking import naming, runs as tracking
from vitreg.tracking.spool import offline_mode

SWEEP_LISTS = tuple(LIST_AXES)
#: the wall time of one tiny child (start-up, imports, the model, logging: 22.7 s for test_vit on this project's
#: loaded 2-core host, docs/benchmarks.md "A fleet"); the estimate before a sweep starts is built on it
CHILD_START_S = 23.0
HOST_SHARE_TAG = "sweep_children_on_host"  # how many children shared the child's host while it ran


@dataclass(frozen=True)
class SweepSettings:
    """The sweep's own options, parsed."""

    engine: str
    ray_address: str
    max_parallel: int
    max_combinations: int
    experiment: str | None
    own: dict = field(default_factory=dict, compare=False)  # all of them, as given (engine=slurm reads its own)

    @classmethod
    def parse(cls, own: dict) -> "SweepSettings":
        def value(name):
            return option("sweep", name).parse(own.get(name, option("sweep", name).default))

        return cls(value("engine"), str(value("ray_address") or "auto"), value("max_parallel"),
                   value("max_combinations"), own.get("experiment"), dict(own))


def run_sweep(own: dict, common: dict | None = None, max_oom_retries: int = 3, progress=progress) -> dict:
    """Run every combination as a child run of one parent run, each in its own process.

    Everything is checked before a child starts: every combination as a BenchSpec, the sweep's size against
    ``max_combinations``, the engine (the GPUs here, or the Ray cluster's nodes and GPU types). A child that
    fails is recorded FAILED with its reason and the sweep goes on; a child that ran out of GPU memory (its
    run's ``vitreg_error_kind`` tag is ``OutOfMemory``) is retried with a smaller batch
    (:func:`vitreg.fleet.children.decay_batch`).
    SIGINT/SIGTERM stops every running child, which ends KILLED, and the parent with it.
    """
    common = dict(common or {})
    settings = SweepSettings.parse(own)
    axes = collect_axes({name: own.get(name, option("sweep", name).default) for name in SWEEP_LISTS},
                        axis_texts_of(own.get("axes", "")), common)
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
        progress(f"sweep: {len(combos)} combinations, {engine.slots} at once on {engine.where}: about "
                 f"{format_seconds(rounds * CHILD_START_S)} of start-up alone (~{CHILD_START_S:.0f} s a child), "
                 f"plus each child's timed work")
        tracking.check_server()
        return _run_parent(settings, axes, combos, common, engine, max_oom_retries, progress)
    finally:
        engine.close()


def check_options(own: dict, common: dict) -> None:
    """What :func:`run_sweep` checks before its engine starts (torch, a Ray cluster, SLURM) and its parent run
    exists, checked first so a typo costs no engine and no run: the settings, the size (``gpu=all`` counted as
    one type: a lower bound), every combination as a BenchSpec and its model (timm is not imported), and on
    this host (engine=local) each GPU label."""
    from vitreg.hardware.profiles import check_label_here

    settings = SweepSettings.parse(own)
    common = dict(common)
    axes = collect_axes({name: own.get(name, option("sweep", name).default) for name in SWEEP_LISTS},
                        axis_texts_of(own.get("axes", "")), common)
    check_size(count(axes), settings.max_combinations)
    combos = plan(axes, common)
    if settings.engine == "local" and "gpu" not in axes:  # several GPU types: the local engine says why not
        for combo in combos:
            check_label_here(str(combo.get("gpu", common.get("gpu") or "auto")), str(common.get("device") or "auto"),
                             option("bench", "allow_gpu_mismatch").parse(common.get("allow_gpu_mismatch", False)))


def _engine(settings: SweepSettings, common: dict, progress):
    if settings.engine == "slurm":
        from vitreg.fleet.slurm_engine import SlurmEngine

        return SlurmEngine(settings.own, settings.max_parallel, progress)
    if settings.engine == "ray":
        from vitreg.fleet.ray_engine import RayEngine

        return RayEngine(settings.ray_address, settings.max_parallel, progress)
    return LocalEngine(settings.max_parallel, str(common.get("device") or "auto"))


def _run_parent(settings, axes, combos, common, engine, max_oom_retries, progress) -> dict:
    outcome = {"finished": [], "failed": []}
    parent_name = naming.sweep_run_name(axes, common, len(combos))
    with tracking.tracked_run(run_name=parent_name, experiment=settings.experiment, system_metrics=False) as parent:
        parent.set_name(parent_name)  # under mlflow run the parent arrives with a random name
        parent.set_tags({"vitreg_job": "sweep", "sweep_engine": settings.engine})
        parent.log_params({**{f"axis_{name}": ",".join(map(str, values))[:500] for name, values in axes.items()},
                           "n_combinations": len(combos), "engine": settings.engine})
        context = _Context(parent, common, len(combos), max_oom_retries, outcome, progress,
                           Board(engine.slots, progress))
        engine.run(context, combos)
        parent.log_metrics({"n_finished": len(outcome["finished"]), "n_failed": len(outcome["failed"])})
        if outcome["finished"]:
            _log_comparison(parent)
    progress(f"sweep {parent.run_id}: {len(outcome['finished'])} finished, {len(outcome['failed'])} failed")
    return outcome


@dataclass
class _Context:
    """What every child of one sweep shares: the parent run, the common options, the outcome, the live line."""

    parent: object
    common: dict
    total: int
    max_oom_retries: int
    outcome: dict
    progress: object
    board: Board

    def child_run(self, combo: Combination, index: int, attempt: int, extra_tags: dict | None = None) -> str:
        name = combo.label + (f"-retry{attempt}" if attempt else "")
        tags = {"requested_batch_size": combo.batch_size, "sweep_index": index, "sweep_label": combo.label,
                **(extra_tags or {})}  # the label stays a tag: bench names its run after its result
        return tracking.create_child_run(self.parent, name, tags)

    def record(self, child_id: str, ok: bool) -> None:
        self.outcome["finished" if ok else "failed"].append(child_id)


class LocalEngine:
    """``engine=local``: this host's GPUs, one child per ``nproc`` of them at once; on CPU one at a time."""

    def __init__(self, max_parallel: int, device: str):
        from vitreg.fleet.local import HostPool, host_gpus

        self.pool = HostPool(host_gpus(device), max_parallel)
        self.slots = self.pool.slots
        self.where = f"this host ({len(self.pool.gpus)} GPUs)" if self.pool.gpus else "this host's CPU"

    def expand_gpus(self, axes: dict) -> None:
        if "gpu" in axes:
            raise VitregError(f"gpu={','.join(axes['gpu'])} names several GPU types and this host has one: pass one "
                              f"gpu label (or auto), or use engine=ray on a cluster that has them")

    def check(self, combos: list[Combination], common: dict) -> None:
        for combo in combos:
            self.pool.check_fits(_nproc(combo, common))

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
            env = tracking.env_for_run(dict(os.environ), child_id, ctx.parent.experiment_id)
            returncode, tail, shared = self.pool.launch(children.child_command(combo, bs, ctx.common), env, gpus,
                                                        lambda line: ctx.progress(f"{label}: {line}"))
            reason = tracking.finish_child_run(child_id, returncode, tail, stopped=bool(self.pool.stopping),
                                               tags={HOST_SHARE_TAG: shared})
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
        pass


def _nproc(combo: Combination, common: dict) -> int:
    return int(combo.get("nproc", common.get("nproc") or 1))


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
