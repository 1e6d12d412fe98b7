"""The SLURM side of ``engine=slurm``: :func:`run_child`, the job's function on its node, and :class:`Follower`,
the parent's loop that submits the jobs (submitit) and follows them (``squeue``: ``sacct`` is often off) to their
end."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from vitreg.errors import VitregError
from vitreg.fleet import children
from vitreg.fleet.children import RemoteChild
from vitreg.fleet.local import LOG_MAX_CHARS, run_remote_child
from vitreg.tracking import runs as tracking

COMMAND_TIMEOUT_S = 30.0
POLL_S = 1.0  # squeue once a second: the parent's whole load on slurmctld
STOP_GRACE_S = 60.0  # after scancel, how long the parent waits for its jobs to leave the queue
FORGOTTEN_S = 60.0  # a job squeue has not shown for this long, with no result file, ended unseen
#: the job parameters one child sets and another may not: each submission names them all (submitit's executor
#: keeps what an earlier update set), unset ones as None, which submitit leaves out of the sbatch script
PER_CHILD = ("gres", "gpus_per_node", "constraint", "exclusive", "cpus_per_task")
ATTEMPTS_TAG = "sweep_child_attempts"  # on a child whose job SLURM requeued: how many times the job started
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}


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


# ------------------------------------------------------------------ on the node


def run_child(argv: list[str], env: dict, spool_dir: str, offline: str, workdir: str) -> tuple[int, str, bool]:
    """In the job, on its node: ``python argv...`` logging into the child run (``env``); (exit status, stderr
    tail, whether it spooled). ``offline=auto``: a node that cannot reach the tracking server spools to
    ``spool_dir`` (in the shared folder) for the parent to deliver; ``true``: always. The child runs in
    ``workdir``, the submitting folder, where the sweep's relative paths point (when the node has it). A job SLURM
    requeued (``scontrol requeue``, preemption) runs again into the same run (its id came with the submission):
    RUNNING again, tagged :data:`ATTEMPTS_TAG`, what an earlier attempt spooled dropped; a bench logs its figures at
    its end, so they come once, from the attempt that finished."""
    os.environ.update(env)
    spooled = offline == "true" or (offline == "auto" and not _reaches_server())
    attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
    if attempt > 1:
        shutil.rmtree(spool_dir, ignore_errors=True)
        if not spooled:
            tracking.reopen(env["MLFLOW_RUN_ID"], {ATTEMPTS_TAG: attempt})
    if spooled:
        os.environ.update(VITREG_OFFLINE="1", VITREG_SPOOL_DIR=spool_dir)
    # the child's output goes to the job's log files too, which the parent keeps in the child run
    returncode, tail, _ = run_remote_child(argv, dict(os.environ), cwd=workdir if os.path.isdir(workdir) else None)
    return returncode, tail, spooled


def _reaches_server() -> bool:
    try:
        tracking.check_server()
    except VitregError:
        return False
    return True


# ------------------------------------------------------------------ on the submitting host


def job_log(job) -> str:
    """A job's log files (submitit's stdout and stderr of it, in the shared folder: what the job's python and the
    child printed, the traceback of a job that failed before the child) as one text; "" where none was written."""
    parts = []
    for stream, path in (("stdout", Path(job.paths.stdout)), ("stderr", Path(job.paths.stderr))):
        if path.is_file():
            parts.append(f"==> the job's {stream} ({path}) <==\n{path.read_text(errors='replace')[-LOG_MAX_CHARS:]}")
    return "\n".join(parts)


@dataclass
class _JobState:
    state: str
    reason: str
    node: str


class Follower(children.Follower):
    """Submits a sweep's jobs (at most ``max_parallel`` in the queue) and ends each child run with its outcome."""

    engine_name, type_tag = "slurm", "slurm_gpu_type"

    def __init__(self, engine, ctx, combos: list):
        super().__init__(engine, ctx, combos)
        folder = engine.options.folder / f"sweep-{ctx.parent.run_id}"
        self.jobs_dir, self.spools_dir = folder / "jobs", folder / "spool"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)  # every job starts in it (sbatch --chdir)
        self.executor = engine.submitit.SlurmExecutor(folder=str(self.jobs_dir / "%j"), max_num_timeout=0)
        self._last_types_check = 0.0

    def _submit(self, child: RemoteChild, argv: list[str], env: dict, need: int, wanted: str | None) -> str:
        env["MLFLOW_EXPERIMENT_NAME"] = self.ctx.parent.experiment_name
        params = self.engine.job_parameters(child.combo, self.ctx.common, f"vitreg-{child.combo.label}", self.jobs_dir)
        self.executor.update_parameters(**{**dict.fromkeys(PER_CHILD), **params})
        child.job = self.executor.submit(run_child, argv, env, str(self.spools_dir / child.run_id),
                                         self.engine.options.offline, os.getcwd())
        return child.job.job_id

    def _poll(self) -> None:
        time.sleep(POLL_S)
        self._follow(self._states())

    def _states(self) -> dict[str, _JobState]:
        """Every pending job's state as squeue shows it (ended jobs too, while slurmctld remembers them)."""
        if not self.pending:
            return {}
        try:
            out = slurm("squeue", "-h", "-t", "all", "-j", ",".join(self.pending), "-o", "%i|%T|%r|%N")
        except VitregError:  # every job id forgotten (squeue refuses the list), or slurmctld busy: next poll
            return {}
        rows = ([f.strip() for f in (line.split("|") + ["", "", ""])[:4]] for line in out.splitlines())
        return {job_id: _JobState(state, reason, node) for job_id, state, reason, node in rows}

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
                self._started(child, now.node, {n.name: n.host for n in self.engine._nodes()}.get(now.node, ""))
            if now is None or now.state in ENDED:
                self._settle(self.pending.pop(job_id), now or _JobState("COMPLETED", "", child.node))
        self._cancel_unplaceable(states)

    def _settle(self, child: RemoteChild, now: _JobState) -> None:
        """A job ended: deliver its spool (once), end its run with the outcome, retry an out-of-memory child."""
        returncode, tail, spooled = self._outcome(child, now)
        if spooled:
            self._deliver(child)
        tags = {**self._job_tags(child, now.node), "slurm_state": now.state,
                "slurm_spooled": spooled}  # true: the node could not reach the server; the parent delivered it
        if now.state != "COMPLETED":  # the cluster ended it (cancelled, node failure, time limit): FAILED
            tags[tracking.ERROR_TAG] = tail
        reason = tracking.finish_child_run(child.run_id, returncode, tail, stopped=False, tags=tags,
                                           log=job_log(child.job))
        if now.state != "COMPLETED":  # whatever the child made of the SIGTERM it got (KILLED), SLURM ended it
            tracking.set_child_status(child.run_id, "FAILED")
            reason = tail
        self._ended(child, returncode == 0 and now.state == "COMPLETED", reason)

    def _outcome(self, child: RemoteChild, now: _JobState) -> tuple[int, str, bool]:
        """(exit status, reason or stderr tail, spooled): the child's own from the job's result file when SLURM
        let the job complete; else SLURM's state and reason (or the job's own python error, when it raised)."""
        result = Path(child.job.paths.result_pickle)
        outcome, value = self.engine.submitit.core.utils.pickle_load(result) if result.exists() else (None, None)
        if outcome == "success" and now.state == "COMPLETED":
            return value
        spooled = value[2] if outcome == "success" else (self.spools_dir / child.run_id).is_dir()
        if outcome == "error":  # run_child itself raised: vitreg or its python is missing on the node
            return -1, f"the job's python failed: {str(value).strip().splitlines()[-1][:300]}", spooled
        where = f" on {now.node or child.node}" if (now.node or child.node) else ""
        why = f" ({now.reason})" if now.reason and now.reason != "None" else ""
        return -1, f"slurm: job {child.job.job_id} {now.state}{why}{where}", spooled

    def _deliver(self, child: RemoteChild) -> None:
        """The child's spool from the shared folder to the tracking store, once; then the folder goes."""
        from vitreg.tracking.sync import sync

        folder = self.spools_dir / child.run_id
        if folder.is_dir():
            for synced in sync(folder):
                self.ctx.progress(f"sweep {child.index}/{self.ctx.total}: {synced.describe()}")
            shutil.rmtree(folder, ignore_errors=True)

    def _cancel_unplaceable(self, states: dict[str, _JobState]) -> None:
        """A pending job whose GPU type no node in service has any more (its node died) never starts: cancel it
        (it then ends FAILED with that reason, through :meth:`_follow`)."""
        waiting = [c for j, c in self.pending.items() if states.get(j) and states[j].state == "PENDING"]
        if not waiting or time.monotonic() - self._last_types_check < 5 * POLL_S:
            return
        self._last_types_check = time.monotonic()
        types = set(self.engine.types_of([n for n in self.engine._nodes() if n.in_service]))
        for child in waiting:
            _, wanted = self.engine.request(child.combo, self.ctx.common)
            if wanted and wanted not in types:
                self.pending.pop(child.job.job_id)
                slurm("scancel", child.job.job_id)
                reason = f"no node of the SLURM cluster in service has GPU type {wanted} (its nodes are down)"
                tracking.finish_child_run(child.run_id, -1, reason, tags={tracking.ERROR_TAG: reason})
                self._ended(child, False, reason, retry=False)

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
            self._deliver(child)
            tracking.finish_child_run(child.run_id, -15, f"its sweep was {reason}", stopped=True,
                                      tags=self._job_tags(child), log=job_log(child.job))

    def _job_tags(self, child: RemoteChild, node: str = "") -> dict:
        """Its job, the node it ran on (where it started) and how many children shared its host."""
        node = node or child.node
        return {"slurm_job_id": child.job.job_id, **({"slurm_node": node} if node else {}), **self._placed(child)}

