"""Progress messages on the terminal: one prefix, on stderr (stdout carries the results table).

Every message goes through :func:`vitreg.tracking.uris.scrub`: a URI in it is printed with its
credentials masked, and the tracking URI's own credentials never appear, whoever composed the message.
"""

import sys

from vitreg.tracking.uris import scrub


def progress(message: str) -> None:
    """Print ``[vitreg] message`` to stderr, flushed (long jobs report as they go)."""
    print(f"[vitreg] {scrub(message)}", file=sys.stderr, flush=True)


def quiet(message: str) -> None:
    """A progress callback that says nothing (ranks other than 0 of a DDP job)."""
