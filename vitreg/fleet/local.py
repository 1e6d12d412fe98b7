"""``engine=local``: a sweep's children on this host, at once where it has several GPUs.

Each child is a ``vitreg bench`` process that sees only its own GPUs (``CUDA_VISIBLE_DEVICES``: ``nproc`` of
them); on CPU the children run one at a time (two at once would time each other). A child is stopped with its
parent: SIGINT/SIGTERM to the sweep sends SIGTERM to every running child, which ends its own run KILLED, and
Linux's parent-death signal ends a child whose parent died without a word (SIGKILL).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading

from vitreg.errors import VitregError
from vitreg.signals import interrupted_reason

STOP_GRACE_S = 30.0  # a child asked to stop has this long to end its run KILLED before it is killed
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child between fork and exec: SIGTERM when the thread that started it ends (Linux; elsewhere no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def host_gpus(device: str) -> list[str]:
    """The GPU indices children may be given here (``CUDA_VISIBLE_DEVICES`` first); empty on CPU."""
    if device == "cpu":
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


class HostPool:
    """The GPUs of this host shared among the running children, and how many children ran at once."""

    def __init__(self, gpus: list[str], max_parallel: int):
        self.gpus = list(gpus)
        self._free = collections.deque(self.gpus)
        self._max = max_parallel if self.gpus else 1
        self._cond = threading.Condition()
        self._running: dict[int, subprocess.Popen] = {}
        self._shared: dict[int, int] = {}
        self.stopping = ""  # why the sweep stops its children ("stopped by SIGTERM"), once it does

    @property
    def slots(self) -> int:
        return min(self._max, max(1, len(self.gpus)))

    def check_fits(self, need: int) -> None:
        if self.gpus and need > len(self.gpus):
            raise VitregError(f"a child asks for nproc={need} GPUs and this host has {len(self.gpus)}: pass "
                              f"nproc={len(self.gpus)} or less, or use engine=ray on a cluster with larger nodes")

    def take(self, need: int) -> list[str]:
        """Wait (in the main thread, where signals arrive) for ``need`` free GPUs and a free slot."""
        with self._cond:
            while not self._fits(need):
                self._cond.wait(0.2)
            self._max -= 1
            return [self._free.popleft() for _ in range(need if self.gpus else 0)]

    def _fits(self, need: int) -> bool:
        return self._max > 0 and (not self.gpus or len(self._free) >= need)

    def give(self, gpus: list[str]) -> None:
        with self._cond:
            self._free.extend(gpus)
            self._max += 1
            self._cond.notify_all()

    def launch(self, cmd: list[str], env: dict, gpus: list[str], on_line) -> tuple[int, str, int]:
        """Run one child to its end: (exit status, the tail of its stderr, the most children at once meanwhile)."""
        if self.gpus:
            env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        with self._cond:
            if self.stopping:
                return -signal.SIGTERM, "the sweep was stopped before this child started", 0
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=die_with_parent)
            self._running[proc.pid] = proc
            for pid in self._running:
                self._shared[pid] = max(self._shared.get(pid, 0), len(self._running))
        returncode, tail = relay(proc, on_line)
        if self.stopping:  # the last line is the reason its run is ended with, if it did not end it itself
            tail += f"\nits sweep was {self.stopping}\n"
        with self._cond:
            self._running.pop(proc.pid, None)
            return returncode, tail, self._shared.pop(proc.pid, 1)

    def stop_all(self, reason: str) -> None:
        """SIGTERM to every running child; SIGKILL to any still there after :data:`STOP_GRACE_S`."""
        with self._cond:
            self.stopping = reason
            procs = list(self._running.values())
        for proc in procs:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def relay(proc: subprocess.Popen, on_line) -> tuple[int, str]:
    """The child's stdout to ours as it comes, each stderr line to ``on_line``; (exit status, stderr tail)."""
    out = threading.Thread(target=lambda: sys.stdout.writelines(proc.stdout), daemon=True)
    out.start()
    tail: collections.deque = collections.deque(maxlen=40)
    for line in proc.stderr:
        tail.append(line)
        if line.strip():
            on_line(line.rstrip().removeprefix("[vitreg] "))
    out.join()
    return proc.wait(), "".join(tail)


def run_all(jobs: list, need_of, work, pool: HostPool) -> None:
    """``work(job, gpus)`` for every job, each in a thread with its GPUs, as many at once as the pool holds.
    SIGINT/SIGTERM (KeyboardInterrupt, here in the main thread) stops every running child, waits for the
    threads to record them, and goes on up."""
    threads: list[threading.Thread] = []

    def body(job, gpus):
        try:
            work(job, gpus)
        finally:
            pool.give(gpus)

    try:
        for job in jobs:
            gpus = pool.take(need_of(job))
            thread = threading.Thread(target=body, args=(job, gpus), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
    except KeyboardInterrupt as exc:
        pool.stop_all(interrupted_reason(exc))
        for thread in threads:
            thread.join(STOP_GRACE_S + 30)
        raise
