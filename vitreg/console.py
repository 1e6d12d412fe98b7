"""Progress messages on the terminal: one prefix, on stderr (stdout carries the results table); and the
libraries' own console lines that a successful run does not need, silenced where they come from.

Every message goes through :func:`vitreg.tracking.uris.scrub`: a URI in it is printed with its
credentials masked, and the tracking URI's own credentials never appear, whoever composed the message.
"""

import logging
import os
import sys

from vitreg.tracking.uris import scrub

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
