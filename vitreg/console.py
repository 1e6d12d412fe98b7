"""What vitreg prints on the terminal: progress messages with one prefix, on stderr (stdout carries the
results table), a heartbeat while a long call runs, and the libraries' own console lines that a successful
run does not need, silenced where they come from.

Every line goes through :func:`scrub`: a URI in it is printed with its credentials masked, and the
tracking URI's own credentials never appear, whoever composed the line. One rule, :func:`redact`, whatever the
names: the whole userinfo (``http://user:password@host``, a token alone ``http://TOKEN@host`` or
``http://TOKEN:@host``, ``s3://KEY:SECRET@bucket`` all show ``***@host``), every query value (``?passwd=``,
``?accessToken=``, a presigned ``X-Amz-Signature=``: a name says nothing reliable about its value) and every
``name=value`` of the fragment. :func:`scrub` does it for every URI inside a message, and also masks the
literal values of this process's tracking URI wherever they appear (an MLflow error may quote them out of
their URI). The CLI routes everything it prints through it (:func:`mask_console`: vitreg's lines, click's,
a library's logging, warnings, tracebacks); the tracking layer stores tags and params through the same
functions. The masking lives here, below every layer that prints or stores text. It reads the four variables
that hold the tracking credentials (:data:`CREDENTIAL_VARIABLES`) only to mask their values.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
import urllib.parse
import warnings

MASK = "***"
# a URI inside a message, less the punctuation that ends a sentence or a bracket after it
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*[^\s'\"<>`.,;:!?)\]}]")
# a value in a query string or fragment: whatever follows ``name=`` up to the next separator
_VALUE = re.compile(r"=[^&;#]+")


def _mask_query(query: str) -> str:
    """Every value of a query string masked, whatever its name: a name says nothing reliable about what its
    value holds (``passwd``, ``accessToken``, ``X-Amz-Signature``, ``sig``...), and a value with no name
    (``?TOKEN``) is masked whole."""
    return "&".join(_VALUE.sub(f"={MASK}", item) if "=" in item else (MASK if item else item)
                    for item in query.split("&"))


def _mask_fragment(fragment: str) -> str:
    """Every ``name=value`` value of a fragment masked (an OAuth ``#access_token=``), the rest kept. A
    fragment that starts with ``/`` is a page's route, not data sent by a server: the MLflow UI's links that
    vitreg prints (``#/experiments/1/runs/abc?workflowType=machine_learning``) stay as they are."""
    if fragment.startswith("/"):
        return fragment
    return _VALUE.sub(f"={MASK}", fragment)


def redact(uri: str) -> str:
    """A URI as vitreg may print or store it: the whole userinfo masked (``scheme://user:pw@host``,
    ``http://TOKEN@host`` and ``http://TOKEN:@host`` all show ``***@host``: which part holds the secret
    depends on the server), every query value masked whatever its name, and every ``name=value`` of the
    fragment; a URI with none of these unchanged."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:  # an unparseable URI is shown as its scheme only, if it could hold anything
        return uri.partition("://")[0] + f"://{MASK}" if re.search(r"[@?#=]", uri) else uri
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    masked = parts._replace(netloc=netloc, query=_mask_query(parts.query), fragment=_mask_fragment(parts.fragment))
    return uri if masked == parts else urllib.parse.urlunsplit(masked)


def _secrets_of(uri: str) -> set[str]:
    """The literal credentials a URI carries, raw and percent-decoded, for masking where they appear outside
    their URI: the password (or the user, when there is no password: a token alone), every query value and
    every fragment value; at least 4 characters long (shorter ones would mask common words)."""
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


def known_secrets() -> set[str]:
    """The credentials of this process's tracking and registry URIs (from the environment: a rank that never
    imports mlflow knows them too)."""
    uris, secrets = CREDENTIAL_VARIABLES
    found = set()
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
    """``sys.stdout`` or ``sys.stderr`` with every write scrubbed (:func:`scrub`): whatever prints through it,
    vitreg's own lines, click's messages, a library's logging handler or a warning, a traceback, the bytes a
    launcher forwards through ``.buffer``, shows no credential. A write is scrubbed whole: Python's print,
    logging, warnings and tracebacks each write a message (and a URI in it) in one call."""

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


def mask_console() -> None:
    """Route everything this process prints through :func:`scrub`: ``sys.stdout`` and ``sys.stderr`` each
    become a :class:`MaskedStream`, and a logging handler made earlier with the bare stream writes to the
    masked one (MLflow's and Python's last-resort handler look ``sys.stderr`` up at each write). Called first
    by the CLI; repeated calls change nothing."""
    for name in ("stdout", "stderr"):
        bare = getattr(sys, name)
        if bare is None or isinstance(bare, MaskedStream):
            continue
        masked = MaskedStream(bare)
        setattr(sys, name, masked)
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for handler in (h for logger in loggers for h in getattr(logger, "handlers", ())):
            if isinstance(handler, logging.StreamHandler) and handler.stream is bare:
                handler.setStream(masked)


#: Kineto (the C++ half of torch.profiler, which vitreg runs to read the SDPA backend that ran and for
#: ``profile=true``) writes ``USDT: ... profiler_start/stop`` at every profile and, without a GPU,
#: ``ERROR: ... gpuGetDeviceCount failed with code 35`` (no CUDA driver) straight to fd 2. It reads
#: KINETO_LOG_LEVEL when the first profile starts (libkineto_init); its levels are VERBOSE=0 ... ERROR=4,
#: USDT=5, so 6 silences it. A KINETO_LOG_LEVEL the user set is kept (e.g. 0 to debug the profiler).
KINETO_QUIET = "6"


class _DropMessage(logging.Filter):
    """Drops the records whose message starts with ``prefix`` (only those: the logger's others pass)."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


#: torch.profiler warns once per process, when a profile prepares its trace a second time (on a GPU, as
#: the profile starts), that events are cleared at the end of each cycle: vitreg runs each profile for one
#: cycle and reads it whole, so the warning only interrupts the progress lines.
_PROFILER_CYCLE_WARNING = "Warning: Profiler clears events at the end of each cycle"


@contextlib.contextmanager
def quiet_profiler():
    """Around a torch.profiler profile: kineto's trace markers and driver probe off (:data:`KINETO_QUIET`, set
    before the first profile starts kineto), and torch's cycle warning off; the profile itself unchanged."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(_PROFILER_CYCLE_WARNING), category=UserWarning)
        yield


#: timm's CosineLRScheduler warns when its cosine has one step (``t_initial == 1``), which vitreg's
#: schedule makes on purpose for runs with at most one update after the warm-up (tests, smoke runs).
_SHORT_COSINE = _DropMessage("Cosine annealing scheduler will have no effect")


def quiet_libraries() -> None:
    """A successful run's console holds vitreg's lines only: silence kineto's trace markers and driver
    probe, and timm's short-cosine warning; the libraries' other warnings go to the run's log (``-v``: also
    to the console). Their real failures still reach vitreg, which checks what it
    reads (an empty profile, a failed schedule) and says so in its own ``error:`` line."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)  # inherited by the torchrun ranks
    warnings.showwarning = _warning_to_log
    cosine = logging.getLogger("timm.scheduler.cosine_lr")
    if _SHORT_COSINE not in cosine.filters:
        cosine.addFilter(_SHORT_COSINE)


def plural(n: int, word: str) -> str:
    """``1 run``, ``2 runs``, ``0 runs``: a count as a line says it (a plain ``s``; every word vitreg counts
    takes one)."""
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
    """A line a reader of the run's log may want but the console does not need (the overhead by phase, the
    energy source, a spread already in the run's warning): printed through ``say`` with ``-v`` only, kept in
    the run's log (:func:`take_console`) either way. A rank that says nothing (:func:`quiet`) keeps nothing."""
    if say is quiet:
        return
    if verbose():
        say(message)
    else:
        _LOG.append(f"[vitreg] {scrub(message)}")


def take_console() -> str:
    """This process's progress and detail lines since the last call, as the run's :data:`CONSOLE_LOG` artifact
    holds them: taken, so a second run in the same process (CliRunner, the Python API) logs its own lines,
    and the first one also what was said before it started (an import's warning)."""
    text = "\n".join(_LOG) + "\n"
    _LOG.clear()
    return text


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    """A library's warning (a deprecation, torchao's SyntaxWarning in a sweep child) as a detail line: the
    run's log keeps it, ``-v`` prints it; vitreg's own warnings are its ``warning:`` lines, not these."""
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
