"""SIGTERM and SIGHUP end a vitreg process the way Ctrl-C does: with a true status and clean-up.

Schedulers (Slurm, Kubernetes, ``timeout``) stop jobs with SIGTERM; a closed terminal sends SIGHUP.
Python's default for both is to die on the spot, leaving the MLflow run RUNNING and temporary folders
behind. :func:`install` turns the first one into :class:`Terminated`, raised in the main thread; it is a
``KeyboardInterrupt``, so every clean-up path written for Ctrl-C (the tracked run ending KILLED, the
launcher stopping torchrun, ``finally`` blocks removing temp folders) runs for it too. A second signal
while that clean-up runs exits at once.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by ``signum``; the exit status is 128 + signum, as a shell's."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_received: list[int] = []


def _stop(signum, _frame):
    if _received:  # a second signal during the clean-up: the user means it
        os._exit(128 + signum)
    _received.append(signum)
    raise Terminated(signum)


def install() -> None:
    """Route SIGTERM/SIGHUP through :class:`Terminated` (main thread only; a no-op elsewhere)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)


def interrupted_reason(exc: KeyboardInterrupt) -> str:
    """What a run that ended KILLED says in its ``vitreg_error`` tag."""
    return str(exc) if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"


_freeze_registered = False


def freeze_at_exit() -> None:
    """Skip interpreter shutdown's garbage collections in this process (once; called by the CLI and the
    torchrun worker shim when they start, not on import: a library importer keeps its own exit).

    A process that has imported torch, timm and mlflow holds millions of objects, and the garbage
    collections of interpreter shutdown walk all of them: 1.5-1.7 s after the last line of work, in
    every vitreg process (the CLI, the launcher, each DDP rank). Freezing them when the exit handlers
    run skips those walks (0.2 s). Registered before the work imports torch or mlflow, this handler runs
    after every handler they register (mlflow's flushes, multiprocessing's clean-up), so those all still
    run; what is skipped is collecting cyclic garbage that the OS reclaims a moment later anyway.
    """
    global _freeze_registered
    if not _freeze_registered:
        atexit.register(gc.freeze)
        _freeze_registered = True
