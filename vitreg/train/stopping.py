"""Stopping a training between optimizer updates, never inside one.

Ctrl-C (SIGINT) and, through :mod:`vitreg.signals`, SIGTERM/SIGHUP raise a ``KeyboardInterrupt``
wherever the main thread is. Raised between ``optimizer.step()`` and the step counter's increment,
the weights would hold one more update than the step says, and the final checkpoint would resume
one update ahead of its data; raised inside AdamW's update, some parameters would have moved and
others not. :func:`update_is_atomic` holds those signals for the few lines of one update and
delivers the held one, to the handler that was installed, when the update is complete.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # vitreg.signals.ALL_STOP_SIGNALS


@contextlib.contextmanager
def update_is_atomic():
    """Hold SIGINT/SIGTERM/SIGHUP/SIGQUIT inside the block; deliver the first one after it. A second one inside
    the block exits at once (the user means it), as a second signal during clean-up does. An update that
    does not end within ``VITREG_STOP_GRACE_S`` is not waited for: :mod:`vitreg.signals`' watchdog ends
    the process then (a collective whose peer died never ends)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    held: list[int] = []

    def hold(signum, _frame):
        if held:
            os._exit(128 + signum)
        held.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            _deliver(held[0], previous[held[0]])


def _deliver(signum: int, handler) -> None:
    """What ``signum`` would have done without the hold: the Python handler (Ctrl-C's KeyboardInterrupt,
    vitreg.signals' Terminated), or the default action (the process ends), or nothing (ignored)."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)
