"""What vitreg prints on the terminal: progress messages with one prefix, on stderr (stdout carries the
results table), a heartbeat while a long call runs, and the libraries' own console lines that a successful
run does not need, silenced where they come from.

Every message goes through :func:`scrub`: a URI in it is printed with its credentials masked, and the
tracking URI's own credentials never appear, whoever composed the message. A URI carries credentials in
its userinfo (``http://user:password@host``, a token alone ``http://TOKEN@host``, ``postgresql://user:pw@db``,
``s3://KEY:SECRET@bucket``) or in its query string (``?token=``, ``?password=``, a presigned
``X-Amz-Signature=``): :func:`redact` masks every one of them; :func:`scrub` does it for every URI inside a
message, and also masks the literal credentials of this process's tracking URI wherever they appear (an
MLflow error may quote them out of their URI). The masking lives here, below every layer that prints or
stores text; the tracking layer stores tags and params through the same two functions. It reads the four
variables that hold the tracking credentials (:data:`CREDENTIAL_VARIABLES`) only to mask their values.
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
# query keys whose value is a credential (case-insensitive, as a whole word of the key)
_SECRET_KEY = re.compile(r"(pass(word)?|pwd|secret|token|key|auth|credential|signature|sig|session|apikey)",
                         re.IGNORECASE)
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def _mask_query(query: str) -> str:
    if not query:
        return query
    pairs = []
    for part in query.split("&"):
        key, eq, value = part.partition("=")
        secret = eq and value and any(_SECRET_KEY.fullmatch(word) for word in re.split(r"[-_.]", key) if word)
        pairs.append(f"{key}={MASK}" if secret else part)
    return "&".join(pairs)


def redact(uri: str) -> str:
    """``scheme://user:secret@host/db?token=t`` -> ``scheme://user:***@host/db?token=***``; a token alone
    in the userinfo (``http://TOKEN@host``) -> ``http://***@host``; a URI without credentials unchanged."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return MASK if "@" in uri else uri
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostinfo = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{hostinfo}" if colon else f"{MASK}@{hostinfo}"
    query = _mask_query(parts.query)
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def _secrets_of(uri: str) -> set[str]:
    """The literal credentials a URI carries (raw and percent-decoded), at least 4 characters long (shorter
    ones would mask common words)."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return set()
    found = set()
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        user, colon, password = userinfo.partition(":")
        found.add(password if colon else user)
    for key, _, value in (p.partition("=") for p in parts.query.split("&") if p):
        if value and _mask_query(f"{key}={value}") != f"{key}={value}":
            found.add(value)
    found |= {urllib.parse.unquote(s) for s in found}
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
    probe, and timm's short-cosine warning. Their real failures still reach vitreg, which checks what it
    reads (an empty profile, a failed schedule) and says so in its own ``error:`` line."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)  # inherited by the torchrun ranks
    cosine = logging.getLogger("timm.scheduler.cosine_lr")
    if _SHORT_COSINE not in cosine.filters:
        cosine.addFilter(_SHORT_COSINE)


def progress(message: str) -> None:
    """Print ``[vitreg] message`` to stderr, flushed (long jobs report as they go)."""
    print(f"[vitreg] {scrub(message)}", file=sys.stderr, flush=True)


def quiet(message: str) -> None:
    """A progress callback that says nothing (ranks other than 0 of a DDP job)."""


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
