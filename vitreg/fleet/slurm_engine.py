"""``engine=slurm``: each child of a sweep a SLURM job, submitted through submitit, asking for its GPU type.

A child filed under a GPU label asks SLURM for that type: ``--gres=gpu:TYPE:N`` (``slurm_gpu_by=gres``, N =
``nproc``, one on CPU so the node's GPU is held) or ``--constraint=TYPE`` (``slurm_gpu_by=constraint``, node
features), TYPE from :data:`vitreg.hardware.profiles.SLURM_GPU_TYPES`. Each job is one task (torchrun starts
the ``nproc`` ranks itself) with ``nproc`` CPUs. The job runs :func:`run_child` on its node: ``vitreg bench``
logging into the child run the parent made; a node that cannot reach the tracking server (``offline=auto``,
the default) logs to a spool in the shared ``slurm_folder`` instead, and the parent delivers it once the job
ended (:func:`vitreg.tracking.sync.sync`, exactly once: a delivered spool is removed).

The parent follows its jobs with ``squeue`` once a second (SLURM's accounting, ``sacct``, is often off):
a job the cluster cancelled or whose node failed ends its child FAILED with SLURM's state and reason; a
pending job whose GPU type no node in service has any more is cancelled and FAILED. SIGINT/SIGTERM to the
parent cancels every job (``scancel``: the running child gets SIGTERM and ends its run KILLED) and ends every
child run KILLED; the parent waits until none of its jobs is left in the queue.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vitreg import signals
from vitreg.config.options import option
from vitreg.errors import VitregError
from vitreg.fleet import children
from vitreg.fleet.board import Clock
from vitreg.hardware.profiles import SLURM_GPU_TYPES, normalize_label
from vitreg.signals import interrupted_reason
from vitreg.tracking import runs as tracking

POLL_S = 1.0  # squeue once a second: the parent's whole load on slurmctld
STOP_GRACE_S = 60.0  # after scancel, how long the parent waits for its jobs to leave the queue
COMMAND_TIMEOUT_S = 30.0
FORGOTTEN_S = 60.0  # a job squeue has not shown for this long, with no result file, ended unseen
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}
_OUT_OF_SERVICE = ("down", "drain", "fail", "maint", "unknown", "not_responding", "inval", "future")


def _submitit():
    try:
        import submitit
    except ImportError:
        raise VitregError("engine=slurm needs submitit: pip install 'vitreg[slurm]' (or pip install submitit)") from None
    return submitit


def slurm(*args: str) -> str:
    """A SLURM command's stdout; one line naming the command and its complaint when it fails."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise VitregError(f"engine=slurm runs `{args[0]}` and it is not on PATH: run the sweep on a host of the "
                          f"SLURM cluster (a login node)") from None
    except subprocess.TimeoutExpired:
        raise VitregError(f"`{' '.join(args)}` did not answer in {COMMAND_TIMEOUT_S:.0f} s: is slurmctld up "
                          f"(`scontrol ping`)?") from None
    if done.returncode:
        complaint = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise VitregError(f"`{' '.join(args[:2])}` failed: {complaint}")
    return done.stdout


@dataclass(frozen=True)
class Node:
    """One node as ``sinfo -N`` shows it: its state, the GPU types of its gres, its features."""

    name: str
    state: str
    gpus: dict  # gres type -> count ("" for untyped GPUs)
    features: frozenset

    @property
    def in_service(self) -> bool:
        return not any(word in self.state.lower() for word in _OUT_OF_SERVICE)


def _gres_gpus(gres: str) -> dict:
    """``gpu:h100:2(S:0),gpu:a100:1`` -> {"h100": 2, "a100": 1}; ``gpu:4`` -> {"": 4}."""
    found: dict = {}
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] != "gpu":
            continue
        kind, count = (parts[1], parts[2]) if len(parts) > 2 else ("", parts[1] if len(parts) > 1 else "1")
        found[kind] = found.get(kind, 0) + int(count) if count.isdigit() else found.get(kind, 0) + 1
    return found


def cluster_nodes(partition: str = "") -> list[Node]:
    """The partition's nodes (every node when none is named)."""
    args = ["sinfo", "-h", "-N", "-o", "%N|%T|%G|%f"] + (["-p", partition] if partition else [])
    nodes = {}
    for line in slurm(*args).splitlines():
        name, state, gres, features = (line.split("|") + ["", "", ""])[:4]
        feature_set = frozenset(f for f in features.split(",") if f and f != "(null)")
        nodes[name] = Node(name, state, _gres_gpus(gres), feature_set)
    return list(nodes.values())


@dataclass(frozen=True)
class SlurmOptions:
    """The sweep's ``slurm_*`` and ``offline`` options, parsed."""

    partition: str
    account: str
    qos: str
    time_min: int
    sbatch: dict
    gpu_by: str
    folder: Path
    offline: str

    @classmethod
    def parse(cls, own: dict) -> "SlurmOptions":
        def value(name):
            return option("sweep", name).parse(own.get(name, option("sweep", name).default))

        return cls(str(value("slurm_partition") or ""), str(value("slurm_account") or ""),
                   str(value("slurm_qos") or ""), value("slurm_time_min"), _sbatch_options(value("slurm_sbatch")),
                   value("slurm_gpu_by"), Path(str(value("slurm_folder"))).expanduser().absolute(),
                   value("offline"))


def _sbatch_options(text) -> dict:
    """``mem=16G;exclude=node3;exclusive`` -> {"mem": "16G", "exclude": "node3", "exclusive": True}."""
    found = {}
    for item in str(text or "").split(";"):
        name, has_value, value = item.strip().partition("=")
        if name:
            found[name.strip().lstrip("-").replace("-", "_")] = value.strip() if has_value else True
    return found


class SlurmEngine:
    """The sweep's children as SLURM jobs; :meth:`run` submits them and follows them to their end."""

    def __init__(self, own: dict, max_parallel: int, progress):
        self.options = SlurmOptions.parse(own)
        self.submitit = _submitit()
        self.max_parallel = max_parallel
        self.progress = progress
        nodes = cluster_nodes(self.options.partition)
        if not nodes:
            raise VitregError(f"the SLURM partition {self.options.partition or '(default)'} has no node: pass "
                              f"slurm_partition= one that `sinfo` lists")
        self.slots = max(1, min(max_parallel, len(nodes)))
        part = f"partition {self.options.partition}" if self.options.partition else "its default partition"
        self.where = f"SLURM ({len(nodes)} node{'s' if len(nodes) > 1 else ''}, {part})"

    def offered_types(self, in_service_only: bool = False) -> list[str]:
        """The GPU types the cluster's nodes offer, as SLURM names them (gres types, or node features)."""
        nodes = [n for n in cluster_nodes(self.options.partition) if n.in_service or not in_service_only]
        if self.options.gpu_by == "gres":
            return sorted({kind for n in nodes for kind in n.gpus if kind})
        return sorted({f for n in nodes for f in n.features})

    def expand_gpus(self, axes: dict) -> None:
        """``gpu=all``: one child per GPU type of the cluster; named labels must be types a node has."""
        from vitreg.fleet.axes import GPU_ALL

        types = self.offered_types()
        how = "gres type" if self.options.gpu_by == "gres" else "feature"
        if axes.get("gpu") and GPU_ALL in axes["gpu"]:
            if not types:
                raise VitregError(f"gpu=all: no node of the SLURM cluster has a GPU {how}: pass gpu=auto, or "
                                  f"slurm_gpu_by={'constraint' if how == 'gres type' else 'gres'}")
            axes["gpu"] = [label_of_slurm_type(t) for t in types]
        for label in axes.get("gpu", []):
            wanted = slurm_type(label)
            if wanted and wanted not in types:
                raise VitregError(f"gpu={label}: no node of the SLURM cluster has GPU {how} {wanted} (it has: "
                                  f"{', '.join(types) or 'none'}): pass gpu=all or the labels of the types it has")

    def check(self, combos: list, common: dict) -> None:
        """Every child's GPUs fit on one node of its type (a job that can never start is refused now)."""
        nodes = cluster_nodes(self.options.partition)
        for combo in combos:
            need, wanted = self._request(combo, common)
            counts = [n.gpus.get(wanted, 0) if self.options.gpu_by == "gres" and wanted else sum(n.gpus.values())
                      for n in nodes if not wanted or self.options.gpu_by == "gres" or wanted in n.features]
            if need and max(counts, default=0) < need:
                most = max(counts, default=0)
                fix = f"pass nproc={most} or less" if most else "pass device=cpu, or a partition with GPUs"
                raise VitregError(f"{combo.label} asks for {need} GPUs{f' of type {wanted}' if wanted else ''} and "
                                  f"no node of the SLURM cluster has them (the most a node has: {most}): {fix}")

    def _request(self, combo, common: dict) -> tuple[int, str | None]:
        """(GPUs, SLURM GPU type) a child's job asks for; a CPU child of a type holds one GPU of it."""
        device = str(combo.get("device", common.get("device") or "auto"))
        nproc = int(combo.get("nproc", common.get("nproc") or 1))
        wanted = slurm_type(str(combo.get("gpu", common.get("gpu") or "auto")))
        if device == "cpu":
            return (1 if wanted and self.options.gpu_by == "gres" else 0), wanted
        return nproc, wanted

    def job_parameters(self, combo, common: dict, name: str) -> dict:
        """submitit's SlurmExecutor parameters of one child's job."""
        need, wanted = self._request(combo, common)
        nproc = int(combo.get("nproc", common.get("nproc") or 1))
        opts = self.options
        params = {"job_name": name[:100], "time": opts.time_min, "nodes": 1, "ntasks_per_node": 1,
                  "cpus_per_task": nproc, "partition": opts.partition or None, "account": opts.account or None,
                  "qos": opts.qos or None, "stderr_to_stdout": False, "additional_parameters": dict(opts.sbatch)}
        if need and opts.gpu_by == "gres":
            params["gres"] = f"gpu:{wanted}:{need}" if wanted else f"gpu:{need}"
        elif need:
            params["gpus_per_node"] = need
        if wanted and opts.gpu_by == "constraint":
            params["constraint"] = wanted
        return {k: v for k, v in params.items() if v is not None}

    def run(self, ctx, combos: list) -> None:
        Follower(self, ctx, combos).run()

    def close(self) -> None:
        pass


def slurm_type(label: str) -> str | None:
    """The SLURM GPU type a child filed under ``label`` asks for; None for auto and cpu."""
    label = normalize_label(label)
    if label in ("auto", "cpu"):
        return None
    return SLURM_GPU_TYPES.get(label, label)


def label_of_slurm_type(kind: str) -> str:
    return {slurm: label for label, slurm in SLURM_GPU_TYPES.items()}.get(kind, normalize_label(kind))


# ------------------------------------------------------------------ on the node


def run_child(argv: list[str], env: dict, spool_dir: str, offline: str) -> tuple[int, str, bool]:
    """In the job, on its node: ``python argv...`` logging into the child run (``env``); (exit status, stderr
    tail, whether it spooled). ``offline=auto``: a node that cannot reach the tracking server spools to
    ``spool_dir`` (in the shared folder) and the parent delivers it; ``true``: always spool."""
    from vitreg.fleet.local import relay, stop

    os.environ.update(env)
    spooled = offline == "true" or (offline == "auto" and not _reaches_server())
    if spooled:
        # the experiment by name: an offline child cannot ask the server which one MLFLOW_EXPERIMENT_ID is
        os.environ.update(VITREG_OFFLINE="1", VITREG_SPOOL_DIR=spool_dir)
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    proc = subprocess.Popen([sys.executable, *argv], env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        returncode, tail = relay(proc, lambda line: None)
    except BaseException:  # scancel's SIGTERM reached this process first: the child ends its run KILLED
        stop(proc)
        raise
    return returncode, tail, spooled


def _reaches_server() -> bool:
    try:
        tracking.check_server()
    except VitregError:
        return False
    return True


# ------------------------------------------------------------------ on the submitting host


@dataclass
class _Child:
    """One attempt at one combination: its place in the sweep, its run and its SLURM job once made."""

    index: int
    combo: object
    attempt: int
    requested: object
    run_id: str = ""
    job: object = None
    clock: Clock | None = None
    started: bool = False
    node: str = ""
    unseen_polls: int = 0  # polls in a row that squeue did not show the job

    @property
    def key(self) -> str:
        return str(self.combo.get("gpu") or "any")


@dataclass
class _JobState:
    state: str
    reason: str
    node: str


class Follower:
    """Submits a sweep's jobs (at most ``max_parallel`` in the queue) and ends each child run with its outcome."""

    def __init__(self, engine: SlurmEngine, ctx, combos: list):
        self.engine, self.ctx = engine, ctx
        self.queue = [_Child(index, combo, 0, combo.batch_size) for index, combo in enumerate(combos, 1)]
        self.pending: dict[str, _Child] = {}  # SLURM job id -> child
        folder = engine.options.folder / f"sweep-{ctx.parent.run_id}"
        self.jobs_dir, self.spools_dir = folder / "jobs", folder / "spool"
        self.executor = engine.submitit.SlurmExecutor(folder=str(self.jobs_dir / "%j"), max_num_timeout=0)
        self._last_types_check = 0.0

    def run(self) -> None:
        for child in self.queue:
            self.ctx.board.queued(child.key)
        try:
            while self.queue or self.pending:
                self._submit()
                time.sleep(POLL_S)
                self._follow(self._states())
        except KeyboardInterrupt as exc:
            stop = _as_received(exc)
            self._cancel_all(interrupted_reason(stop))
            raise stop from None

    def _submit(self) -> None:
        while self.queue and len(self.pending) < self.engine.max_parallel:
            child = self.queue.pop(0)
            need, wanted = self.engine._request(child.combo, self.ctx.common)
            tags = {"sweep_engine": "slurm", "requested_batch_size": child.requested, "slurm_gpu_type": wanted}
            child.run_id = self.ctx.child_run(child.combo, child.index, child.attempt,
                                              {k: v for k, v in tags.items() if v is not None})
            tracking.set_child_status(child.run_id, "SCHEDULED")
            argv = children.child_command(child.combo, child.combo.batch_size, self.ctx.common)[1:]
            env = {**tracking.remote_child_env(child.run_id, self.ctx.parent.experiment_id),
                   "MLFLOW_EXPERIMENT_NAME": self.ctx.parent.experiment_name}
            self.executor.update_parameters(**self.engine.job_parameters(child.combo, self.ctx.common,
                                                                         f"vitreg-{child.combo.label}"))
            child.job = self.executor.submit(run_child, argv, env, str(self.spools_dir / child.run_id),
                                             self.engine.options.offline)
            child.clock = Clock()
            self.pending[child.job.job_id] = child

    def _states(self) -> dict[str, _JobState]:
        """Every pending job's state as squeue shows it (ended jobs too, while slurmctld remembers them)."""
        if not self.pending:
            return {}
        try:
            out = slurm("squeue", "-h", "-t", "all", "-j", ",".join(self.pending), "-o", "%i|%T|%r|%N")
        except VitregError:  # every job id forgotten (squeue refuses the list), or slurmctld busy: next poll
            return {}
        states = {}
        for line in out.splitlines():
            job_id, state, reason, node = (line.split("|") + ["", "", ""])[:4]
            states[job_id.strip()] = _JobState(state.strip(), reason.strip(), node.strip())
        return states

    def _follow(self, states: dict[str, _JobState]) -> None:
        for job_id, child in list(self.pending.items()):
            now = states.get(job_id)
            if now is None and not Path(child.job.paths.result_pickle).exists():
                child.unseen_polls += 1  # just submitted, or slurmctld forgot it (MinJobAge) without a result
                if child.unseen_polls * POLL_S >= FORGOTTEN_S:
                    self._settle(self.pending.pop(job_id), _JobState("UNKNOWN", "slurmctld no longer knows the "
                                                                     "job and it left no result", child.node))
                continue
            child.unseen_polls = 0
            if now is not None and now.state == "RUNNING" and not child.started:
                child.started, child.node = True, now.node
                tracking.set_child_status(child.run_id, "RUNNING")
                self.ctx.board.started(child.key)
            if now is None or now.state in ENDED:
                self._settle(self.pending.pop(job_id), now or _JobState("COMPLETED", "", child.node))
        self._cancel_unplaceable(states)

    def _settle(self, child: _Child, now: _JobState) -> None:
        """A job ended: deliver its spool (once), end its run with the outcome, retry an out-of-memory child."""
        returncode, tail, spooled = self._outcome(child, now)
        if spooled:
            self._deliver(child)
        tags = {"slurm_job_id": child.job.job_id, "slurm_state": now.state, "slurm_node": now.node or child.node,
                "slurm_spooled": spooled}  # true: the node could not reach the server; the parent delivered it
        if now.state != "COMPLETED":  # the cluster ended it (cancelled, node failure, time limit): FAILED
            tags[tracking.ERROR_TAG] = tail
        reason = tracking.finish_child_run(child.run_id, returncode, tail, stopped=False, tags=tags)
        if now.state != "COMPLETED":  # whatever the child made of the SIGTERM it got (KILLED), SLURM ended it
            tracking.set_child_status(child.run_id, "FAILED")
            reason = tail
        ok = returncode == 0 and now.state == "COMPLETED"
        self.ctx.record(child.run_id, ok)
        self.ctx.board.ended(child.key, ok, child.clock.seconds() if ok else None,
                             was="running" if child.started else "queued")
        if not ok:
            self.ctx.progress(f"sweep {child.index}/{self.ctx.total} {child.combo.label}: FAILED: {reason}")
            self._retry_smaller(child)

    def _outcome(self, child: _Child, now: _JobState) -> tuple[int, str, bool]:
        """(exit status, reason or stderr tail, spooled) from the job's result file, else from SLURM's word."""
        result = Path(child.job.paths.result_pickle)
        if result.exists() and now.state == "COMPLETED":
            outcome, value = self.engine.submitit.core.utils.pickle_load(result)
            if outcome == "success":
                return value
            return -1, f"the job's python failed: {str(value).strip().splitlines()[-1][:300]}", False
        where = f" on {now.node or child.node}" if (now.node or child.node) else ""
        why = f" ({now.reason})" if now.reason and now.reason != "None" else ""
        return -1, f"slurm: job {child.job.job_id} {now.state}{why}{where}", self._has_spool(child)

    def _has_spool(self, child: _Child) -> bool:
        return (self.spools_dir / child.run_id).is_dir()

    def _deliver(self, child: _Child) -> None:
        """The child's spool from the shared folder to the tracking store, once; then the folder goes."""
        from vitreg.tracking.sync import sync

        folder = self.spools_dir / child.run_id
        if folder.is_dir():
            for synced in sync(folder):
                self.ctx.progress(f"sweep {child.index}/{self.ctx.total}: {synced.describe()}")
            shutil.rmtree(folder, ignore_errors=True)

    def _retry_smaller(self, child: _Child) -> None:
        retries_left = child.attempt < self.ctx.max_oom_retries
        smaller = children.smaller_batch(child.combo.batch_size, child.run_id) if retries_left else 0
        if smaller >= 1:
            self.ctx.progress(f"out of memory at batch {child.combo.batch_size}: retrying with batch {smaller}")
            self.queue.append(_Child(child.index, child.combo.with_batch(smaller), child.attempt + 1, child.requested))
            self.ctx.board.requeued(child.key)

    def _cancel_unplaceable(self, states: dict[str, _JobState]) -> None:
        """A pending job whose GPU type no node in service has any more (its node died) never starts: cancel it
        (it then ends FAILED with that reason, through :meth:`_follow`)."""
        waiting = [c for j, c in self.pending.items() if states.get(j) and states[j].state == "PENDING"]
        if not waiting or time.monotonic() - self._last_types_check < 5 * POLL_S:
            return
        self._last_types_check = time.monotonic()
        types = set(self.engine.offered_types(in_service_only=True))
        for child in waiting:
            _, wanted = self.engine._request(child.combo, self.ctx.common)
            if wanted and wanted not in types:
                self.pending.pop(child.job.job_id)
                slurm("scancel", child.job.job_id)
                reason = f"no node of the SLURM cluster in service has GPU type {wanted} (its nodes are down)"
                tracking.finish_child_run(child.run_id, -1, reason, tags={tracking.ERROR_TAG: reason})
                self.ctx.record(child.run_id, False)
                self.ctx.board.ended(child.key, False, was="queued")
                self.ctx.progress(f"sweep {child.index}/{self.ctx.total} {child.combo.label}: FAILED: {reason}")

    def _cancel_all(self, reason: str) -> None:
        """SIGINT/SIGTERM: scancel every job (a running child gets SIGTERM and ends its run KILLED), wait until
        none is left in the queue, deliver what spooled, then end every child run still open KILLED."""
        ids = list(self.pending)
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, timeout=COMMAND_TIMEOUT_S)
        deadline = time.monotonic() + STOP_GRACE_S
        while ids and time.monotonic() < deadline:
            left = [j for j, s in self._states().items() if s.state not in ENDED]
            if not left:
                break
            time.sleep(POLL_S)
        for child in self.pending.values():
            if self._has_spool(child):
                self._deliver(child)
            tracking.finish_child_run(child.run_id, -15, f"its sweep was {reason}", stopped=True)


def _as_received(exc: KeyboardInterrupt) -> KeyboardInterrupt:
    """The signal that came is what the runs and the exit status say."""
    if not isinstance(exc, signals.Terminated) and signals._received:
        return signals.Terminated(signals._received[0])
    return exc
