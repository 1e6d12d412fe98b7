"""torchrun as a child that never outlives its launcher, stopped without torchrun's traceback.

- A launcher SIGKILLed (the OOM killer, ``kill -9``) runs no clean-up, so the OS must do it: torchrun
  starts with the parent-death signal set (``prctl(PR_SET_PDEATHSIG, SIGTERM)``), and so does each
  worker shim (:func:`die_with_parent`): the launcher's death stops torchrun, whose death stops its
  workers. A SIGTERM is the clean stop; each rank ends as it would for ``kill <pid>``.
- A launcher asked to stop (SIGTERM, SIGHUP, SIGQUIT, Ctrl-C) stops torchrun with SIGTERM, which stops
  the workers; torchrun then prints its own ``SignalException`` traceback, which says nothing the
  launcher's one line does not. torchrun's stderr passes through :class:`_Forwarder`: every line as it is
  while the job runs; once the launcher stops it, only the ranks' own lines (``[rank<N>]:``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the OS send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere).
    A parent that died before the call already made this process an orphan: then ``sig`` at once."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


class _Forwarder(threading.Thread):
    """Copies torchrun's stderr to ours, line by line; after :meth:`stopping`, only the ranks' lines."""

    def __init__(self, stream, rank_prefix: str):
        super().__init__(name="vitreg-torchrun-stderr", daemon=True)
        self.stream, self.rank_prefix = stream, rank_prefix
        self._stopping = threading.Event()

    def stopping(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        for line in iter(self.stream.readline, b""):
            if not self._stopping.is_set() or line.startswith(self.rank_prefix):
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()


def start(cmd: list[str], env: dict, rank_prefix: str = "[rank") -> subprocess.Popen:
    """Start torchrun (``cmd``) so that it dies with this process and its stderr is forwarded."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, preexec_fn=die_with_parent)
    proc.forwarder = _Forwarder(proc.stderr, rank_prefix.encode())
    proc.forwarder.start()
    return proc


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Stop torchrun and its workers (SIGTERM: each rank stops cleanly), SIGKILL after ``timeout_s``."""
    forwarder = getattr(proc, "forwarder", None)
    if forwarder is not None:
        forwarder.stopping()
    proc.terminate()  # torchrun turns SIGTERM into stopping its workers
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finish(proc)


def finish(proc: subprocess.Popen) -> None:
    """After torchrun exited: the last of its stderr forwarded."""
    forwarder = getattr(proc, "forwarder", None)
    if forwarder is not None:
        forwarder.join(5)
