"""Progress messages on the terminal: one prefix, on stderr (stdout carries the results table)."""

import sys


def progress(message: str) -> None:
    """Print ``[vitreg] message`` to stderr, flushed (long jobs report as they go)."""
    print(f"[vitreg] {message}", file=sys.stderr, flush=True)


def quiet(message: str) -> None:
    """A progress callback that says nothing (ranks other than 0 of a DDP job)."""
