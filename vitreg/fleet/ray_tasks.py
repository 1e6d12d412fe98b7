"""The Ray side of ``engine=ray``: the task that runs one child on its node, the actor through which tasks
say they started, and :class:`Follower`, the parent's loop that submits the tasks and follows them."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vitreg.environment import RAY_CPUS_VAR
from vitreg.errors import first_line
from vitreg.fleet import children
from vitreg.fleet.local import STOP_GRACE_S, run_remote_child
from vitreg.tracking import runs as tracking


@ray.remote(num_cpus=0)
class Tally:
    """Which children have started, on which host (a task says so before it starts its process)."""

    def __init__(self):
        self.started: dict[str, str] = {}

    def start(self, child_id: str, host: str) -> None:
        self.started[child_id] = host

    def read(self) -> dict[str, str]:
        return dict(self.started)


@ray.remote(max_retries=0)
def run_child(child_id: str, argv: list[str], env: dict, tally) -> tuple[int, str, str, str]:
    """On the node Ray chose: ``python argv...`` with the child's run in ``env``; (exit status, stderr tail,
    node id, its stdout and stderr: the parent keeps them in its run, a node's worker log being out of reach).
    Cancelled (SIGINT/SIGTERM to the sweep): the child gets SIGTERM and ends its run KILLED."""
    node_id = ray.get_runtime_context().get_node_id()
    # not waited for: a task blocked in ray.get lends its CPUs back meanwhile, and Ray would start another child
    # on them beside this one (it reserves its node's every CPU so that none can)
    tally.start.remote(child_id, socket.gethostname())
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)  # its grant, which Ray does not pin
    returncode, tail, log = run_remote_child(argv, {**os.environ, **env, RAY_CPUS_VAR: str(int(cpus))})
    return returncode, tail, node_id, log


def _build_failure() -> str | None:
    """The error of a failed runtime_env build in this host's Ray log of the job (its last 64 KB), if any."""
    try:
        path = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / \
            f"runtime_env_setup-{ray.get_runtime_context().get_job_id()}.log"
        with open(path, "rb") as log:
            log.seek(max(0, path.stat().st_size - 65536))
            lines = log.read().decode(errors="replace").splitlines()
    except (AttributeError, OSError):  # a Ray client, or no build on this host
        return None
    errors = [line.strip() for line in lines if line.strip().startswith("ERROR: ")]
    return first_line(Exception(errors[-1]), 300) if errors else None


class Follower(children.Follower):
    """Submits a sweep's tasks (at most ``max_parallel`` in flight) and ends each child run with its outcome."""

    engine_name, type_tag = "ray", "ray_accelerator_type"

    def __init__(self, engine, ctx, combos: list):
        super().__init__(engine, ctx, combos)
        # on the parent's own node: it lives as long as the sweep does, whichever other node dies
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.tally = Tally.options(scheduling_strategy=here).remote()
        self.reasons: dict[str, str] = {}  # child run id -> why the parent cancelled it (its GPU type is gone)
        self.seen: dict[str, str] = {}  # child run id -> host, as the tally last said
        self.reading = None  # the tally's answer on its way: never waited for (its actor waits for the runtime_env)
        self.since, self.said = time.monotonic(), False

    def _submit(self, child, argv: list[str], env: dict, need: int, wanted: str | None):
        options = self.engine.task_options(child.combo, self.ctx.common)
        return run_child.options(**options).remote(child.run_id, argv, env, self.tally)

    def _poll(self) -> None:
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=1.0)
        for ref in ready:
            self._settle(ref, self.pending.pop(ref))
        self.reading = self.reading or self.tally.read.remote()
        if ray.wait([self.reading], timeout=0)[0]:
            with contextlib.suppress(ray.exceptions.RayError):  # its actor never started: the tasks say why
                self.seen = ray.get(self.reading)
            self.reading = None
        for child in self.pending.values():
            if child.run_id in self.seen and not child.started:
                self._started(child, host=self.seen[child.run_id])
        self._cancel_unplaceable()
        self._follow_build()

    def _follow_build(self) -> None:
        """While the runtime_env's packages are built (before any child starts), a word after 10 s; the build's
        failure, where its log is on this host, fails the children at once with Ray's reason (Ray itself retries
        it three times first: minutes)."""
        if not self.engine.builds or any(child.started for child in self.pending.values()):
            return
        waited = time.monotonic() - self.since
        if waited > 10 and not self.said:
            self.said = True
            self.ctx.progress(f"sweep: Ray is building the runtime_env's {', '.join(self.engine.builds)} on the "
                              f"nodes before a child starts ({waited:.0f} s so far; its log on each node: "
                              f"runtime_env_setup-{ray.get_runtime_context().get_job_id()}.log)")
        reason = _build_failure()
        for ref, child in self.pending.items() if reason else ():
            if child.run_id not in self.reasons:
                self.reasons[child.run_id] = f"Ray could not build the runtime_env: {reason}"
                ray.cancel(ref)

    def _settle(self, ref, child) -> None:
        stopped, log = False, ""
        try:
            returncode, tail, node_id, log = ray.get(ref)
            tags = {"ray_node_id": node_id, **self._placed(child)}
        except ray.exceptions.TaskCancelledError:
            returncode, tail, tags = -15, self.reasons.get(child.run_id, "cancelled"), {}
            stopped = child.run_id not in self.reasons
        except ray.exceptions.RayError as exc:  # the node or worker died, or the task itself raised
            returncode, tail, tags = -1, f"ray: {type(exc).__name__}: {first_line(exc, 300)}", {}
        reason = tracking.finish_child_run(child.run_id, returncode, tail, stopped=stopped, tags=tags, log=log)
        self._ended(child, returncode == 0, reason)

    def _cancel_unplaceable(self) -> None:
        """A queued task whose GPU type no alive node has any more (its node died) never starts: cancel it."""
        types = set(self.engine.types_of(self.engine._nodes()))
        for ref, child in list(self.pending.items()):
            _, wanted = self.engine.request(child.combo, self.ctx.common)
            if wanted and wanted not in types and not child.started and child.run_id not in self.reasons:
                self.reasons[child.run_id] = (f"no alive node of the Ray cluster has accelerator type {wanted} "
                                              f"(its node died)")
                ray.cancel(ref)

    def _cancel_all(self, reason: str) -> None:
        """SIGINT/SIGTERM: cancel every task (a running one stops its child), then end every open child KILLED."""
        for ref in self.pending:
            ray.cancel(ref)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=1.0)
            for ref in ready:
                child = self.pending.pop(ref)
                tracking.finish_child_run(child.run_id, -15, f"its sweep was {reason}", stopped=True,
                                          tags=self._placed(child))
        for ref, child in self.pending.items():
            ray.cancel(ref, force=True)
            tracking.finish_child_run(child.run_id, -9, f"its sweep was {reason}; its task did not stop in time",
                                      stopped=True)
