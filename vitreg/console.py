"""What vitreg prints: progress lines on stderr (stdout carries the results table), a heartbeat while a long call
runs, the libraries' needless lines silenced. Every line goes through :func:`scrub`: each URI :func:`redact`-ed
(a name says nothing reliable about its value, so every value goes) and this process's tracking credentials
masked wherever they appear (an MLflow error may quote them out of their URI); the tracking layer stores tags and
params through the same functions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
import traceback
import urllib.parse
import warnings

MASK = "***"
# a URI inside a message, less the punctuation that ends a sentence or a bracket after it
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*[^\s'\"<>`.,;:!?)\]}]")
# a value in a query string or fragment: whatever follows ``name=`` up to the next separator
_VALUE = re.compile(r"=[^&;#]+")


def redact(uri: str) -> str:
    """A URI as vitreg may print or store it: the whole userinfo masked (``user:pw@``, ``TOKEN@`` and ``TOKEN:@``
    all show ``***@``: which part holds the secret depends on the server), every query value (a nameless one,
    ``?TOKEN``, whole) and every fragment value (an OAuth ``#access_token=``; a UI route ``#/...`` kept)."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:  # an unparseable URI is shown as its scheme only, if it could hold anything
        return uri.partition("://")[0] + f"://{MASK}" if re.search(r"[@?#=]", uri) else uri
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    query = "&".join(_VALUE.sub(f"={MASK}", item) if "=" in item else (MASK if item else item)
                     for item in parts.query.split("&"))
    fragment = parts.fragment if parts.fragment.startswith("/") else _VALUE.sub(f"={MASK}", parts.fragment)
    masked = parts._replace(netloc=netloc, query=query, fragment=fragment)
    return uri if masked == parts else urllib.parse.urlunsplit(masked)


def _secrets_of(uri: str) -> set[str]:
    """The literal credentials a URI carries, raw and percent-decoded, of 4 characters or more (shorter ones would
    mask common words)."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return set()
    found = set()
    if "@" in parts.netloc:
        user, colon, password = parts.netloc.rpartition("@")[0].partition(":")
        found.add(password or user)
    for text in (parts.query, parts.fragment):
        found |= {value[1:] for value in _VALUE.findall(text)}
    found |= {item for item in parts.query.split("&") if item and "=" not in item}
    found |= {urllib.parse.unquote(s) for s in found} | {urllib.parse.unquote_plus(s) for s in found}
    return {s for s in found if len(s) >= 4}


#: The environment variables holding the tracking credentials: (URIs that may carry them, the secrets alone)
CREDENTIAL_VARIABLES = (("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"), ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"))


_GIVEN: set[str] = set()  # more secrets this process was given (a Ray runtime_env's env_vars values)


def add_secrets(values) -> None:
    """Mask ``values`` too, wherever this process prints or stores them, from now on."""
    _GIVEN.update(v for v in values if len(v) >= 4)


def known_secrets() -> set[str]:
    """The credentials of this process's tracking and registry URIs, from the environment, and those given."""
    uris, secrets = CREDENTIAL_VARIABLES
    found = set(_GIVEN)
    for name in uris:
        found |= _secrets_of(os.environ.get(name, ""))
    for name in secrets:
        if len(os.environ.get(name, "")) >= 4:
            found.add(os.environ[name])
    return found


def scrub(text: str) -> str:
    """``text`` with every URI in it redacted and every known credential masked: what vitreg prints or stores."""
    if not text:
        return text
    text = _URI_IN_TEXT.sub(lambda m: redact(m.group(0)), text)
    for secret in sorted(known_secrets(), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


class MaskedStream:
    """A stream with every write scrubbed (its ``.buffer`` too), whoever writes: print, logging, warnings and
    tracebacks each write a message in one call."""

    def __init__(self, stream, encoding: str | None = None):
        self.stream = stream
        self._encoding = encoding  # set for the byte stream below ``.buffer``

    def write(self, data):
        if self._encoding is not None and isinstance(data, (bytes, bytearray)):
            self.stream.write(scrub(bytes(data).decode(self._encoding, "surrogateescape"))
                              .encode(self._encoding, "surrogateescape"))
        elif self._encoding is None and isinstance(data, str):
            self.stream.write(scrub(data))
        else:
            return self.stream.write(data)  # the stream's own TypeError: click probes a stream with b""
        return len(data)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    @property
    def buffer(self):
        return MaskedStream(self.stream.buffer, self.stream.encoding or "utf-8")

    def __getattr__(self, name):  # everything else is the stream's: fileno, isatty, encoding, flush...
        if name == "stream":  # not set yet (a copy being made): no endless lookup
            raise AttributeError(name)
        return getattr(self.stream, name)


def _mask_streams() -> dict:
    """``sys.stdout`` and ``sys.stderr`` made :class:`MaskedStream`: ``{name: (bare, masked)}`` of those swapped."""
    swapped = {}
    for name in ("stdout", "stderr"):
        bare = getattr(sys, name)
        if bare is not None and not isinstance(bare, MaskedStream):
            swapped[name] = (bare, MaskedStream(bare))
            setattr(sys, name, swapped[name][1])
    return swapped


def mask_console() -> None:
    """Route everything this process prints through :func:`scrub`, logging handlers made earlier with a bare
    stream included."""
    for bare, masked in _mask_streams().values():
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for handler in (h for logger in loggers for h in getattr(logger, "handlers", ())):
            if isinstance(handler, logging.StreamHandler) and handler.stream is bare:
                handler.setStream(masked)


_masked_calls = 0  # Python API calls inside masked_output(); the last one out restores
_masked_lock = threading.Lock()
_saved_printers: dict = {}


@contextlib.contextmanager
def masked_output():
    """For the length of a Python API call, what is printed is scrubbed as the CLI's is: the streams masked and every
    logging record made scrubbed (:func:`_scrubbing`: whatever handler or stream the caller configured). The last
    call out puts back the streams and record factory it found, unless the caller replaced them meanwhile."""
    global _masked_calls
    with _masked_lock:
        if _masked_calls == 0:
            _saved_printers.clear()
            _saved_printers.update(_mask_streams())
            factory = logging.getLogRecordFactory()
            _saved_printers["records"] = (factory, _scrubbing(factory))
            logging.setLogRecordFactory(_saved_printers["records"][1])
        _masked_calls += 1
    try:
        yield
    finally:
        with _masked_lock:
            _masked_calls -= 1
            if _masked_calls == 0:
                for name in ("stdout", "stderr"):
                    if name in _saved_printers and getattr(sys, name) is _saved_printers[name][1]:
                        setattr(sys, name, _saved_printers[name][0])
                factory, ours = _saved_printers["records"]
                if logging.getLogRecordFactory() is ours:
                    logging.setLogRecordFactory(factory)
                _saved_printers.clear()


def _scrubbing(factory):
    """A log record factory whose records have their message, traceback and stack scrubbed, formatted at once (a
    record is only made once its level passes), so no handler, formatter or kept record sees a credential."""

    def make(*args, **kwargs):
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: logging's handler reports it as it would
            return record
        record.msg, record.args = scrub(message), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return record

    return make


#: Kineto (torch.profiler's C++ half) writes ``USDT: ... profiler_start/stop`` at every profile and, without a
#: GPU, ``ERROR: ... gpuGetDeviceCount failed``, straight to fd 2; its levels end at USDT=5, so 6 silences it.
#: A KINETO_LOG_LEVEL the user set is kept.
KINETO_QUIET = "6"


#: torch.profiler's warning at a second profile: vitreg runs each profile for one cycle and reads it whole.
_PROFILER_CYCLE_WARNING = "Warning: Profiler clears events at the end of each cycle"


def profiled(step, steps: int, cuda: bool):
    """torch.profiler's profile of ``steps`` calls of ``step`` (CUDA too on a GPU), synchronized at both ends, with
    kineto's lines (:data:`KINETO_QUIET`) and torch's cycle warning off."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if cuda:
        torch.cuda.synchronize()
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(_PROFILER_CYCLE_WARNING), category=UserWarning)
        with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * cuda]) as prof:
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
    return prof


def _short_cosine(record: logging.LogRecord) -> bool:
    """False for timm's warning of a one-step cosine, which vitreg makes on purpose for the shortest runs."""
    return not str(record.msg).startswith("Cosine annealing scheduler will have no effect")


def quiet_libraries() -> None:
    """A successful run's console holds vitreg's lines only: kineto's and timm's short-cosine lines silenced, the
    libraries' other warnings sent to the run's log (``-v``: also to the console)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)  # inherited by the torchrun ranks
    warnings.showwarning = _warning_to_log
    cosine = logging.getLogger("timm.scheduler.cosine_lr")
    if _short_cosine not in cosine.filters:
        cosine.addFilter(_short_cosine)


def plural(n: int, word: str) -> str:
    """``1 run``, ``2 runs``, ``0 runs``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


#: Set (``1``) by ``-v/--verbose``, in the environment so the torchrun ranks inherit it: the detail lines
#: (:func:`detail`) are printed too, not only kept for the run's log.
VERBOSE_ENV = "VITREG_VERBOSE"
#: The run's console log artifact: every progress and detail line of this process, whether printed or not
CONSOLE_LOG = "console.log"
_LOG: list[str] = []


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def progress(message: str) -> None:
    """Print ``[vitreg] message`` to stderr, flushed (long jobs report as they go); kept for the run's log."""
    line = f"[vitreg] {scrub(message)}"
    _LOG.append(line)
    print(line, file=sys.stderr, flush=True)


def quiet(message: str) -> None:
    """A progress callback that says nothing (ranks other than 0 of a DDP job)."""


def detail(message: str, say=progress) -> None:
    """A line for the run's log, printed through ``say`` with ``-v`` only; a :func:`quiet` rank keeps nothing."""
    if say is quiet:
        return
    if verbose():
        say(message)
    else:
        _LOG.append(f"[vitreg] {scrub(message)}")


def take_console() -> str:
    """This process's lines since the last call (the run's :data:`CONSOLE_LOG`): a second run logs its own."""
    text = "\n".join(_LOG) + "\n"
    _LOG.clear()
    return text


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    """A library's warning as a :func:`detail` line."""
    detail(f"{category.__name__}: {message} ({filename}:{lineno})")


@contextlib.contextmanager
def ticking(what: str, every_s: float = 10.0, say=progress):
    """Say ``{what} ... N s`` every ``every_s`` seconds while the block runs (nothing if it is quicker)."""
    done = threading.Event()
    start = time.perf_counter()

    def tick():
        while not done.wait(every_s):
            say(f"{what} ... {time.perf_counter() - start:.0f} s")

    thread = threading.Thread(target=tick, name="vitreg-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
