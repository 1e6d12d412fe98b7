"""SIGTERM, SIGHUP and SIGQUIT end a vitreg process the way Ctrl-C does: with a true status and clean-up.

The signals that stop a run cleanly are :data:`STOP_SIGNALS` plus SIGINT (Ctrl-C, Python's own
``KeyboardInterrupt``). Schedulers (Slurm, Kubernetes, ``timeout``) stop jobs with SIGTERM; a closed
terminal sends SIGHUP; Ctrl-\\ sends SIGQUIT. Python's default for these is to die on the spot (SIGQUIT
with a core dump), leaving the MLflow run RUNNING and temporary folders behind. :func:`install` turns the
first one into :class:`Terminated`, raised in the main thread; it is a ``KeyboardInterrupt``, so every
clean-up path written for Ctrl-C (the tracked run ending KILLED, the launcher stopping torchrun, ``finally``
blocks removing temp folders) runs for it too. A second signal while that clean-up runs exits at once.
SIGKILL cannot be caught: a run killed so is found by its heartbeat (``vitreg runs --stale``).

A bound on the wait: Python runs a handler only between bytecodes of the main thread, so a main thread
inside one long C call (a collective whose peer died, a step at 16000 px) would never see the signal,
and a signal held for one optimizer update (:func:`update_is_atomic`) waits for that update. The C
level handler also writes the signal to a wake-up pipe; a watchdog thread reads it and, if the main thread
has not acted on it within :func:`stop_grace_s` (``VITREG_STOP_GRACE_S``, default 60 s), runs the
registered last words (:func:`on_forced_exit`: the tracked run ends KILLED with the reason) and exits
with 128 + N.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
ALL_STOP_SIGNALS = (signal.SIGINT, *STOP_SIGNALS)  # what stops a run cleanly, Ctrl-C included
DEFAULT_STOP_GRACE_S = 60.0


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by ``signum``; the exit status is 128 + signum, as a shell's."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_received: list[int] = []
_acted = threading.Event()  # the main thread took the signal up (Terminated raised, or Ctrl-C's interrupt)
_last_words: list = []  # callables(reason) run by the watchdog before a forced exit
killed_runs: list[str] = []  # the runs this process ended KILLED (what the CLI's last line names)


def stop_grace_s() -> float:
    """``VITREG_STOP_GRACE_S`` (default 60): how long a stop signal may wait for the main thread."""
    from vitreg.config.parse import parse_float

    return parse_float(os.environ.get("VITREG_STOP_GRACE_S") or DEFAULT_STOP_GRACE_S, "VITREG_STOP_GRACE_S",
                       minimum=0.1)


def _stop(signum, _frame):
    if _received:  # a second signal during the clean-up: the user means it
        os._exit(128 + signum)
    _received.append(signum)
    _acted.set()
    raise Terminated(signum)


def _interrupt(signum, frame):
    """Ctrl-C as Python does it (``KeyboardInterrupt``), noted as taken up for the watchdog."""
    _acted.set()
    signal.default_int_handler(signum, frame)


def on_forced_exit(callback) -> None:
    """Run ``callback(reason)`` if the watchdog has to end the process (registered by the tracked run)."""
    _last_words.append(callback)


def forget_forced_exit(callback) -> None:
    if callback in _last_words:
        _last_words.remove(callback)


def _force_exit(signum: int, grace: float) -> None:
    name = signal.Signals(signum).name
    reason = (f"stopped by {name}: the step in progress did not end within {grace:g} s "
              f"(VITREG_STOP_GRACE_S), so no checkpoint of it was written")
    print(f"[vitreg] {reason}", file=sys.stderr, flush=True)
    for callback in list(_last_words):
        try:
            callback(reason)
        except Exception as exc:  # noqa: BLE001 - last words must not keep the process alive
            print(f"[vitreg] while stopping: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _watch(read_fd: int) -> None:
    """The watchdog: a stop signal the main thread has not acted on within the grace ends the process."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        stops = [b for b in data if b in ALL_STOP_SIGNALS]
        if not stops:
            continue
        grace = stop_grace_s()
        if not _acted.wait(grace):
            _force_exit(stops[0], grace)
        return  # acted on: the clean-up runs in the main thread (a second signal exits at once)


_watchdog: list[threading.Thread] = []


def _start_watchdog() -> None:
    if _watchdog:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_fd)
        os.close(write_fd)
        return
    thread = threading.Thread(target=_watch, args=(read_fd,), name="vitreg-stop-watchdog", daemon=True)
    thread.start()
    _watchdog.append(thread)


def install() -> None:
    """Route SIGTERM/SIGHUP/SIGQUIT through :class:`Terminated` and start the watchdog that bounds how long
    any stop signal (Ctrl-C too) waits for the main thread (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    _start_watchdog()


def interrupted_reason(exc: KeyboardInterrupt) -> str:
    """What a run that ended KILLED says in its ``vitreg_error`` tag."""
    _acted.set()  # a Ctrl-C's KeyboardInterrupt reached the clean-up
    return str(exc) if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"


# Stopping a training between optimizer updates, never inside one. Raised between optimizer.step() and
# the step counter's increment, a KeyboardInterrupt would leave the weights one update ahead of the step,
# and the final checkpoint would resume one update ahead of its data; raised inside AdamW's update, some
# parameters would have moved and others not. update_is_atomic holds the stop signals for the few lines
# of one update and delivers the held one, to the handler that was installed, when the update is
# complete. It lives here, beside the handlers it holds back, and imports nothing heavy.


@contextlib.contextmanager
def update_is_atomic():
    """Hold SIGINT/SIGTERM/SIGHUP/SIGQUIT inside the block; deliver the first one after it. A second one inside
    the block exits at once (the user means it), as a second signal during clean-up does. An update that
    does not end within ``VITREG_STOP_GRACE_S`` is not waited for: the watchdog ends
    the process then (a collective whose peer died never ends)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    held: list[int] = []

    def hold(signum, _frame):
        if held:
            os._exit(128 + signum)
        held.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in ALL_STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            _deliver(held[0], previous[held[0]])


def _deliver(signum: int, handler) -> None:
    """What ``signum`` would have done without the hold: the Python handler (Ctrl-C's KeyboardInterrupt,
    :class:`Terminated`), or the default action (the process ends), or nothing (ignored)."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


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
