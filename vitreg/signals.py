"""SIGTERM, SIGHUP and SIGQUIT end a vitreg process the way Ctrl-C does: with a true status and clean-up.

Python's default is to die on the spot, the MLflow run left RUNNING. :func:`install` turns the first one into
:class:`Terminated`, a ``KeyboardInterrupt``, so every clean-up written for Ctrl-C runs for it too. A second
signal means the user insists: it cuts the clean-up short, or, in a block that must not be cut, exits once the
run's end is kept. Python runs a handler only between bytecodes of the main thread, so a watchdog thread ends a
main thread that has not acted within ``VITREG_STOP_GRACE_S`` (default 60 s), the run ended KILLED first.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
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


_received: list[int] = []  # every stop signal this process took (SIGINT included), in order
_acted = threading.Event()  # the main thread took the signal up (Terminated raised, or Ctrl-C's interrupt)
_last_words: list = []  # callables(reason) run by the watchdog before a forced exit
run_ends: list[str] = []  # one line per run this process ended: its status and where its data is (the CLI's last line)


def stop_grace_s() -> float:
    """``VITREG_STOP_GRACE_S`` (default 60): how long a stop signal may wait for the main thread."""
    from vitreg.config.parse import parse_float

    return parse_float(os.environ.get("VITREG_STOP_GRACE_S") or DEFAULT_STOP_GRACE_S, "VITREG_STOP_GRACE_S",
                       minimum=0.1)


def watchdog_grace_s() -> float:
    """:func:`stop_grace_s`, its default where the value is bad (a run refuses it before it opens)."""
    try:
        return stop_grace_s()
    except ValueError:
        return DEFAULT_STOP_GRACE_S


def _take(signum: int) -> str:
    """Note a stop signal: ``"first"``, ``"relayed"`` (a SIGTERM after a SIGINT: ``mlflow run`` and torchrun pass a
    Ctrl-C on as SIGTERM) or ``"again"`` (the user insisting)."""
    relayed = bool(_received) and signum == signal.SIGTERM and set(_received) == {signal.SIGINT}
    first = not _received
    _received.append(signum)
    return "first" if first else "relayed" if relayed else "again"


def _raise_stop(signum: int):
    """Raise what a stop signal raises in the main thread: Ctrl-C's ``KeyboardInterrupt``, else :class:`Terminated`.
    Raised is not taken up: a library may swallow it (torch.compile did, compiling on and on); the clean-up
    that gets it says so (:func:`interrupted_reason`), or the watchdog ends the process."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def _stop(signum, _frame):
    """The handler of every stop signal, Ctrl-C's too (its first one raises Python's ``KeyboardInterrupt``)."""
    taken = _take(signum)
    if taken == "first":
        _raise_stop(signum)
    if taken == "again":
        _insist(signum)


def _insist(signum: int):
    """A second stop outside any hold: with a run open, a new :class:`Terminated` cuts its clean-up short (it
    still ends KILLED); with none, exit at once."""
    if _last_words:
        raise Terminated(signum)
    _say(f"stopped by {signal.Signals(signum).name} again: exiting at once")
    os._exit(128 + signum)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _say(line: str) -> None:
    """One ``error:`` line, written straight to fd 2 (the process ends next, with ``os._exit``)."""
    _flush()
    with contextlib.suppress(Exception):
        os.write(2, f"error: {line}\n".encode())


def on_forced_exit(callback) -> None:
    """Run ``callback(reason)`` if the process has to end at once (registered by the tracked run)."""
    _last_words.append(callback)


def forget_forced_exit(callback) -> None:
    if callback in _last_words:
        _last_words.remove(callback)


def _exit_now(signum: int, reason: str) -> None:
    """End the process at once, the open run ended KILLED with ``reason`` first (its last words)."""
    print(f"[vitreg] {reason}", file=sys.stderr, flush=True)
    for callback in list(_last_words):
        try:
            callback(reason)
        except Exception as exc:  # noqa: BLE001 - last words must not keep the process alive
            print(f"[vitreg] while stopping: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    _flush()
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
        grace = watchdog_grace_s()
        if not _acted.wait(grace):
            _exit_now(stops[0], f"stopped by {signal.Signals(stops[0]).name}: the step in progress did not end "
                                f"within {grace:g} s (VITREG_STOP_GRACE_S), so no checkpoint of it was written")
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
    """Route SIGTERM/SIGHUP/SIGQUIT through :class:`Terminated` and start the watchdog (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    # ignored too: a shell starts a background job so (`vitreg bench &`), and `kill -INT` then did nothing at all
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, signal.SIG_IGN):
        signal.signal(signal.SIGINT, _stop)
    _start_watchdog()


def interrupted_reason(exc: KeyboardInterrupt) -> str:
    """What a run that ended KILLED says in its ``vitreg_error`` tag."""
    _acted.set()  # a Ctrl-C's KeyboardInterrupt reached the clean-up
    return str(exc) if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"


# Stopping a training between optimizer updates, never inside one: raised inside an update, a stop would leave
# some parameters moved and others not, or the weights one update ahead of the step their checkpoint names.
# The same hold keeps a signal out of a fork (starting torchrun), whose at-fork hooks would lose the exception.


@contextlib.contextmanager
def held(insist, takes_up: bool = False):
    """Hold the stop signals inside the block, deliver the first after it; one that insists calls ``insist(signum)``.
    ``takes_up``: the block is the process's answer to a stop (a run's end): the watchdog does not time it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    held_signals: list[int] = []

    def hold(signum, _frame):
        taken = _take(signum)
        if taken == "first":
            held_signals.append(signum)
            if takes_up:
                _acted.set()
        elif taken == "again":
            insist(signum)

    previous = {sig: signal.signal(sig, hold) for sig in ALL_STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held_signals:
            _deliver(held_signals[0], previous[held_signals[0]])


def _exits_now(what: str):
    """``insist`` for a hold whose block cannot be cut: the open run ends KILLED, the process exits."""
    return lambda signum: _exit_now(signum, f"stopped by {signal.Signals(signum).name} again {what}")


def update_is_atomic():
    """Hold the stop signals inside one optimizer update; a second one exits at once, the run ended KILLED first
    (a collective whose peer died never ends)."""
    return held(_exits_now("inside an optimizer update: no checkpoint of it was written"))


def starting_a_process():
    """Hold the stop signals while a child process is forked; the caller stops the child when it is raised."""
    return held(_exits_now("while a process started"))


@contextlib.contextmanager
def run_ending(kept_line):
    """Hold the stop signals while a run's end is written (none may leave it RUNNING with no end in its spool); one
    that insists exits as soon as ``kept_line()`` says where the end is kept."""
    def insist(signum):
        line = kept_line()
        if line:
            _say(f"stopped by {signal.Signals(signum).name} again before the tracking store took the run's "
                 f"end: {line}")
            os._exit(128 + signum)

    with held(insist, takes_up=True):
        yield


def _deliver(signum: int, handler) -> None:
    """What ``signum`` would have done without the hold: vitreg's stop, another handler, the default, or nothing."""
    if handler is _stop:
        _raise_stop(signum)
    elif callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


@functools.cache
def freeze_at_exit() -> None:
    """Skip interpreter shutdown's garbage collections, which walk the millions of objects torch, timm and mlflow
    make: 1.5-1.7 s after the last line of work, frozen 0.2 s. Registered before those imports, this runs after
    their exit handlers, which all still run; the OS reclaims the garbage anyway."""
    atexit.register(gc.freeze)
