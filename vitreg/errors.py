"""The exception types that mean "the user asked for something we cannot do": a one-line message that names
the fix; the CLI prints ``error: <message>`` and exits 2, the tracking layer marks the run FAILED with it
(``vitreg_error``, and the class name in ``vitreg_error_kind`` for a parent to branch on). Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import os
import shlex


class VitregError(ValueError):
    """Bad input or an unusable environment; the message is one line and says what to do."""

    exit_code = 2

    def __init__(self, message: str):
        # One line, always: the message ends up in a terminal, a tag and a table cell.
        # a value quoted whole is cut (a 125 KB JSON echoed was the whole "line")
        super().__init__(" ".join(w if len(w) <= 300 else f"{w[:60]}...({len(w):,} characters)"
                                  for w in str(message).split()))


class StoreError(VitregError):
    """The tracking store (a local database file or a server) cannot be used; the message names it."""


class CheckpointError(VitregError):
    """A checkpoint's files are there and match their manifest, but what they hold cannot be used (a
    spec.json with wrong types or keys, weights that are not safetensors or do not fit the model); the
    message names the file."""


class OutOfMemory(VitregError):
    """The GPU ran out of memory at this batch size: a smaller batch may fit (``sweep`` retries one)."""


@contextlib.contextmanager
def out_of_memory_as_error(what: str, batch_size: int):
    """Turn torch's out-of-memory error inside the block into :class:`OutOfMemory` naming a smaller batch, the
    memory given back first: the failed step's frames (its tensors) cleared, the cached blocks released."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as exc:
        import gc
        import traceback

        traceback.clear_frames(exc.__traceback__)  # frames still running (the caller's) are left as they are
        # what is left are young objects of the raise; a full collection walks every object (seconds)
        gc.collect(1)
        torch.cuda.empty_cache()
        raise OutOfMemory(f"{what} with batch_size={batch_size} ran out of GPU memory: use a smaller batch_size "
                          f"(e.g. {max(1, batch_size // 2)})") from None


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line, cut to ``limit`` characters (its class name when it has no text)."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def path_kind(path, what: str, fix: str) -> str:
    """``"dir"``, ``"file"`` or ``"missing"`` for a path the user typed as option ``what``; an OSError (a name too
    long, a link loop, no permission) as one line naming the option."""
    try:
        if path.is_dir():
            return "dir"
        return "file" if path.exists() else "missing"
    except OSError as exc:
        raise VitregError(f"{what}={path} cannot be read ({exc.strerror}): {fix}") from None


def unreadable(path, exc: OSError) -> str:
    """``path`` cannot be read, why, and the chmod that fixes it."""
    mode = "-R a+rX" if os.path.isdir(path) else "a+r"
    return (f"{path} cannot be read ({exc.strerror or first_line(exc)}): make it readable by this user "
            f"(chmod {mode} {shlex.quote(str(path))})")
