"""The Ray side of ``engine=ray``: the task that runs one child on its node, the actor through which tasks
say they started, and :class:`Follower`, the parent's loop that submits the tasks and follows them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vitreg import signals
from vitreg.fleet import children
from vitreg.fleet.board import Clock
from vitreg.fleet.local import die_with_parent, relay, stop
from vitreg.signals import interrupted_reason
from vitreg.tracking import runs as tracking

STOP_GRACE_S = 30.0


@ray.remote(num_cpus=0)
class Tally:
    """Which children have started (a task says so before it starts its process): queued vs running."""

    def __init__(self):
        self.started: dict[str, str] = {}

    def start(self, child_id: str, node_id: str) -> None:
        self.started[child_id] = node_id

    def read(self) -> dict[str, str]:
        return dict(self.started)


@ray.remote(max_retries=0)
def run_child(child_id: str, argv: list[str], env: dict, tally) -> tuple[int, str, str]:
    """On the node Ray chose: ``python argv...`` with the child's run in ``env``; (exit status, stderr tail,
    node id). Cancelled (SIGINT/SIGTERM to the sweep): the child gets SIGTERM and ends its run KILLED."""
    node_id = ray.get_runtime_context().get_node_id()
    ray.get(tally.start.remote(child_id, node_id))
    proc = subprocess.Popen([sys.executable, *argv], env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    try:
        returncode, tail = relay(proc, lambda line: None)
    except KeyboardInterrupt:  # ray.cancel: stop the child the way the parent was stopped
        stop(proc)
        raise
    return returncode, tail, node_id


class Follower:
    """Submits a sweep's tasks (at most ``max_parallel`` in flight) and ends each child run with its outcome."""

    def __init__(self, engine, ctx, combos: list):
        self.engine, self.ctx = engine, ctx
        self.queue = [_Child(index, combo, 0, combo.batch_size) for index, combo in enumerate(combos, 1)]
        self.pending: dict = {}  # ObjectRef -> _Child
        # on the parent's own node: it lives as long as the sweep does, whichever other node dies
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.tally = Tally.options(scheduling_strategy=here).remote()
        self.started: set[str] = set()  # child run ids
        self.reasons: dict[str, str] = {}  # child run id -> why the parent cancelled it (its GPU type is gone)

    def run(self) -> None:
        for child in self.queue:
            self.ctx.board.queued(_key(child.combo))
        try:
            while self.queue or self.pending:
                self._submit()
                ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    self._settle(ref, self.pending.pop(ref))
                self._note_started()
                self._cancel_unplaceable()
        except KeyboardInterrupt as exc:
            stop = _as_received(exc)
            self._cancel_all(interrupted_reason(stop))
            raise stop from None

    def _submit(self) -> None:
        while self.queue and len(self.pending) < self.engine.max_parallel:
            child = self.queue.pop(0)
            need, wanted = self.engine._request(child.combo, self.ctx.common)
            argv, env = children.start_remote(self.ctx, child, "ray", "ray_accelerator_type", wanted)
            options = {"num_cpus": 1, "num_gpus": need, **({"accelerator_type": wanted} if wanted else {})}
            ref = run_child.options(**options).remote(child.run_id, argv, env, self.tally)
            child.clock = Clock()
            self.pending[ref] = child

    def _note_started(self) -> None:
        started = ray.get(self.tally.read.remote())
        for child in self.pending.values():
            if child.run_id in started and child.run_id not in self.started:
                self.started.add(child.run_id)
                tracking.set_child_status(child.run_id, "RUNNING")
                self.ctx.board.started(_key(child.combo))

    def _settle(self, ref, child: "_Child") -> None:
        child_id, combo = child.run_id, child.combo
        was = "running" if child_id in self.started else "queued"
        stopped = False
        try:
            returncode, tail, node_id = ray.get(ref)
            tags = {"ray_node_id": node_id}
        except ray.exceptions.TaskCancelledError:
            returncode, tail, tags = -15, self.reasons.get(child_id, "cancelled"), {}
            stopped = child_id not in self.reasons
        except ray.exceptions.RayError as exc:  # the node or worker died, or the task itself raised
            returncode, tail, tags = -1, f"ray: {type(exc).__name__}: {_first_line(exc)}", {}
        reason = tracking.finish_child_run(child_id, returncode, tail, stopped=stopped, tags=tags)
        ok = returncode == 0
        self.ctx.record(child_id, ok)
        self.ctx.board.ended(_key(combo), ok, child.clock.seconds() if ok else None, was=was)
        if not ok:
            self.ctx.progress(f"sweep {child.index}/{self.ctx.total} {combo.label}: FAILED: {reason}")
            self._retry_smaller(child)

    def _retry_smaller(self, child: "_Child") -> None:
        """An out-of-memory child goes back to the queue with a smaller batch (as engine=local does)."""
        retries_left = child.attempt < self.ctx.max_oom_retries
        smaller = children.smaller_batch(child.combo.batch_size, child.run_id) if retries_left else 0
        if smaller >= 1:
            self.ctx.progress(f"out of memory at batch {child.combo.batch_size}: retrying with batch {smaller}")
            self.queue.append(_Child(child.index, child.combo.with_batch(smaller), child.attempt + 1, child.requested))
            self.ctx.board.requeued(_key(child.combo))

    def _cancel_unplaceable(self) -> None:
        """A queued task whose GPU type no alive node has any more (its node died) never starts: cancel it."""
        types = set(self.engine.accelerator_types())
        for ref, child in list(self.pending.items()):
            _, wanted = self.engine._request(child.combo, self.ctx.common)
            if wanted and wanted not in types and child.run_id not in self.started | set(self.reasons):
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
                tracking.finish_child_run(child.run_id, -15, f"its sweep was {reason}", stopped=True)
        for ref, child in self.pending.items():
            ray.cancel(ref, force=True)
            tracking.finish_child_run(child.run_id, -9, f"its sweep was {reason}; its task did not stop in time",
                                      stopped=True)


@dataclass
class _Child:
    """One attempt at one combination: its place in the sweep, the batch first asked for, its run once made."""

    index: int
    combo: object
    attempt: int
    requested: object
    run_id: str = ""
    clock: Clock | None = None


def _as_received(exc: KeyboardInterrupt) -> KeyboardInterrupt:
    """Ray's wait turns the Terminated that vitreg's SIGTERM handler raised into a plain KeyboardInterrupt:
    the signal that came is what the runs and the exit status say."""
    if not isinstance(exc, signals.Terminated) and signals._received:
        return signals.Terminated(signals._received[0])
    return exc


def _key(combo) -> str:
    return str(combo.get("gpu") or "any")


def _first_line(exc) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else ""
