"""SIGTERM and SIGHUP end a vitreg process the way Ctrl-C does: with a true status and clean-up.

Schedulers (Slurm, Kubernetes, ``timeout``) stop jobs with SIGTERM; a closed terminal sends SIGHUP.
Python's default for both is to die on the spot, leaving the MLflow run RUNNING and temporary folders
behind. :func:`install` turns the first one into :class:`Terminated`, raised in the main thread; it is a
``KeyboardInterrupt``, so every clean-up path written for Ctrl-C (the tracked run ending KILLED, the
launcher stopping torchrun, ``finally`` blocks removing temp folders) runs for it too. A second signal
while that clean-up runs exits at once.
"""

from __future__ import annotations

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
