"""``engine=local``: a sweep's children on this host, at once where it has several GPUs.

Each child is a ``vitreg bench`` command that sees only its own GPUs (``CUDA_VISIBLE_DEVICES``: ``nproc`` of
them), run in the warm worker of those GPUs (:mod:`vitreg.fleet.worker`: one process per GPU runs its children
one after another) or, with ``isolate=process``, in a process of its own; on CPU the children run one at a
time (two at once would time each other). A child is stopped with its parent: SIGINT/SIGTERM to the sweep
sends SIGTERM to every running child's process, whose run ends KILLED, and Linux's parent-death signal ends a
child whose parent died without a word (SIGKILL).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading

from vitreg.ddp.launcher import die_with_parent, stop_child
from vitreg.environment import cpu_grant
from vitreg.errors import VitregError
from vitreg.fleet.worker import DONE, cli_args, python_command
from vitreg.signals import interrupted_reason
from vitreg.tracking.runs import without_requested_run

STOP_GRACE_S = 30.0  # a child asked to stop has this long to end its run KILLED before it is killed
_TAIL_LINES = 40  # a child's last stderr lines, for the reason it failed
LOG_MAX_CHARS = 1_000_000  # the most of a cluster child's output its run keeps (the last lines)


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

    def __init__(self, gpus: list[str], max_parallel: int, isolate: str = "worker"):
        self.gpus = list(gpus)
        self.isolate = isolate
        self._workers: dict[tuple, Worker] = {}  # the idle and busy warm workers, by the GPUs they see
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

    def launch(self, command: list[str], run_env: dict, gpus: list[str], on_line) -> tuple[int, str, int, str]:
        """Run one child (``command``, with ``run_env`` over this process's variables: its run) to its end, in the
        warm worker of its GPUs or in a process of its own: (exit status, the tail of its stderr, the most
        children at once meanwhile, its stdout and stderr: a process's own, "" from a warm worker, whose stdout
        its children share)."""
        env, log = self._env(gpus), ChildLog()
        with self._cond:
            if self.stopping:
                return -signal.SIGTERM, "the sweep was stopped before this child started", 0, ""
            worker = self._worker(tuple(gpus), env) if self.isolate == "worker" else None
            proc = worker.proc if worker else subprocess.Popen(
                command, env={**env, **run_env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=die_with_parent)
            self._running[proc.pid] = proc
            for pid in self._running:
                self._shared[pid] = max(self._shared.get(pid, 0), len(self._running))
        returncode, tail = (worker.run(cli_args(command), run_env, on_line) if worker
                            else relay(proc, on_line, log.keep_stdout_echoed))
        if self.stopping:  # the last line is the reason its run is ended with, if it did not end it itself
            tail += f"\nits sweep was {self.stopping}\n"
        with self._cond:
            self._running.pop(proc.pid, None)
            return returncode, tail, self._shared.pop(proc.pid, 1), log.text()

    def warm_up(self) -> None:
        """Start the warm workers of the one-GPU children (the CPU's one on a host without GPUs) now, so that
        their imports overlap what the sweep does before its first child (its parent run, its checks)."""
        if self.isolate != "worker":
            return
        with self._cond:
            for gpus in [(gpu,) for gpu in self.gpus[:self.slots]] or [()]:
                self._worker(gpus, self._env(gpus))

    def _env(self, gpus) -> dict:
        """A child's variables but its run's: this process's, its GPUs made the only ones it sees."""
        env = without_requested_run(dict(os.environ))  # the run is the child's own (run_env), never a worker's
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return env

    def _worker(self, gpus: tuple, env: dict) -> Worker:
        """The warm worker of ``gpus``, started on first use or after the last one died; an idle worker that
        sees any of them (a child of another nproc) is ended first: two processes would hold one GPU."""
        worker = self._workers.get(gpus)
        if worker is not None and worker.alive:
            return worker
        for other in [g for g in self._workers if set(g) & set(gpus)]:
            self._workers.pop(other).close()
        self._workers[gpus] = Worker(env)
        return self._workers[gpus]

    def close(self) -> None:
        """End every warm worker (idle now: the sweep's children have all ended)."""
        with self._cond:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.close()

    def stop_all(self, reason: str) -> None:
        """SIGTERM to every running child; SIGKILL to any still there after :data:`STOP_GRACE_S`."""
        with self._cond:
            self.stopping = reason
            procs = list(self._running.values())
        for proc in procs:
            stop_child(proc, STOP_GRACE_S)


class Worker:
    """The parent's handle on one warm worker process, started with ``env`` (its GPUs in it)."""

    def __init__(self, env: dict):
        # no parent-death signal: it would end the worker with the child's thread that started it (the
        # worker watches its parent itself)
        self.proc = subprocess.Popen(python_command("vitreg.cli.worker"), env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        _copy_stdout(self.proc)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, args: list[str], env: dict, on_line) -> tuple[int, str]:
        """Run ``vitreg ARGS`` in the worker with ``env`` set for its length, to its end: (exit status, the tail
        of its stderr); each stderr line to ``on_line`` as it comes."""
        tail: collections.deque = collections.deque(maxlen=_TAIL_LINES)
        try:
            self.proc.stdin.write(json.dumps({"args": args, "env": env}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died between two children
            pass
        for line in self.proc.stderr:
            if line.startswith(DONE):
                return int(line[len(DONE):]), "".join(tail)
            tail.append(line)
            if line.strip():
                on_line(line.rstrip().removeprefix("[vitreg] "))
        returncode = self.proc.wait()  # no DONE: the worker died with this child (a kernel fault, the OOM killer)
        tail.append(f"the sweep's warm worker (pid {self.proc.pid}) died with exit status {returncode} while it ran "
                    f"this child\n")
        return returncode or 1, "".join(tail)

    def close(self) -> None:
        """End an idle worker: its stdin closed, it exits; killed after :data:`STOP_GRACE_S`."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        stop_child(self.proc, STOP_GRACE_S, sig=None)


def relay(proc: subprocess.Popen, on_line, keep=None) -> tuple[int, str]:
    """The child's stdout to ours as it comes, each stderr line to ``on_line``; (exit status, stderr tail).
    ``keep(line, stream)``, where given, takes every line of both instead, with the stream of ours it belongs to."""
    out = _copy_stdout(proc, keep)
    tail: collections.deque = collections.deque(maxlen=_TAIL_LINES)
    for line in proc.stderr:
        tail.append(line)
        if keep:
            keep(line, sys.stderr)
        if line.strip():
            on_line(line.rstrip().removeprefix("[vitreg] "))
    if out is not None:
        out.join()
    return proc.wait(), "".join(tail)


class ChildLog:
    """A cluster child's stdout and stderr lines as they came, each also written to this process's own stream (a
    SLURM job's log files, a Ray worker's log); :meth:`text` holds the last :data:`LOG_MAX_CHARS` of them."""

    def __init__(self):
        self._lines: collections.deque = collections.deque()
        self._chars = 0
        self._lock = threading.Lock()

    def keep(self, line: str, stream) -> None:
        if stream is not None:
            stream.write(line)
            stream.flush()  # a job's log file holds each line at once: a job SLURM kills keeps what it printed
        with self._lock:
            self._lines.append(line)
            self._chars += len(line)
            while self._chars > LOG_MAX_CHARS and len(self._lines) > 1:
                self._chars -= len(self._lines.popleft())

    def keep_stdout_echoed(self, line: str, stream) -> None:
        """:meth:`keep` echoing only stdout lines: a local child's stderr reaches the console as the sweep's lines."""
        self.keep(line, stream if stream is sys.stdout else None)

    def text(self) -> str:
        with self._lock:
            return "".join(self._lines)


def run_remote_child(argv: list[str], env: dict, cwd: str | None = None) -> tuple[int, str, str]:
    """A cluster's child on its node (a Ray task's, a SLURM job's): ``python argv...`` with ``env``, to its end:
    (exit status, stderr tail, its stdout and stderr as they came: :class:`ChildLog`, also written to this
    process's). Its torch and OpenMP threads are its scheduler's grant (:func:`vitreg.environment.cpu_grant`),
    not the host's CPUs, nor an ``OMP_NUM_THREADS`` the submitting host passed on. Stopped with SIGTERM (its run
    ends KILLED) when this process is stopped (``ray.cancel``, ``scancel``) or dies."""
    env = {**env, "OMP_NUM_THREADS": str(cpu_grant(env)[0])}
    proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, preexec_fn=die_with_parent)
    log = ChildLog()
    try:
        returncode, tail = relay(proc, lambda line: None, log.keep)
    except BaseException:
        stop_child(proc, STOP_GRACE_S)
        raise
    return returncode, tail, log.text()


def _copy_stdout(proc: subprocess.Popen, keep=None) -> threading.Thread | None:
    """A thread copying the child's stdout to ours as it comes (through ``keep(line, sys.stdout)`` where given);
    None where it is not piped."""
    if proc.stdout is None:
        return None
    keep = keep or (lambda line, stream: stream.write(line))

    def copy():
        for line in proc.stdout:
            keep(line, sys.stdout)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


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
