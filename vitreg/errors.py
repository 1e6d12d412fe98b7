"""The exception types that mean "the user asked for something we cannot do".

Every check on user input raises :class:`VitregError` with a one-line message that names the fix.
The CLI turns it into ``error: <message>`` on stderr and exit status 2; the tracking layer marks the
MLflow run FAILED, stores the message in the ``vitreg_error`` tag and the class name in
``vitreg_error_kind`` (so a parent process, e.g. ``sweep``, branches on the kind, not on the text).
Anything else is a bug and keeps its traceback.
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
        super().__init__(" ".join(str(message).split()))


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
    """Turn torch's out-of-memory error inside the block into :class:`OutOfMemory` naming a smaller batch.

    The cached blocks are released first, so whatever runs after the error (the run's tracking, a
    retry in the same process) has the memory back. The failed step's locals (its batch, activations,
    gradients) live on in torch's error's traceback, which the OutOfMemory raised here keeps as its
    ``__context__`` for as long as the caller holds it: those frames are cleared, so the tensors go at once.
    """
    import torch

    try:
        yield
    except torch.OutOfMemoryError as exc:
        import gc
        import traceback

        traceback.clear_frames(exc.__traceback__)  # frames still running (the caller's) are left as they are
        # What is left is what the raise itself made (its frames, traceback, the cycles between them): young
        # objects. A full collection walks every object of the process: 0.3 s after torch and timm are
        # imported, seconds in a process that has run for a while (10 s in a test worker).
        gc.collect(1)
        torch.cuda.empty_cache()
        raise OutOfMemory(f"{what} with batch_size={batch_size} ran out of GPU memory: use a smaller batch_size "
                          f"(e.g. {max(1, batch_size // 2)})") from None


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line, cut to ``limit`` characters, for a one-line error (its class name
    when it has no text). Library errors often run to a paragraph or a traceback-like dump."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def path_kind(path, what: str, fix: str) -> str:
    """``"dir"``, ``"file"`` or ``"missing"`` for a path the user typed as option ``what``.

    ``Path.exists()`` swallows only "no such file"; a name too long for the file system, a symlink
    loop or a folder without permission raise OSError, which becomes one line naming the option.
    """
    try:
        if path.is_dir():
            return "dir"
        return "file" if path.exists() else "missing"
    except OSError as exc:
        raise VitregError(f"{what}={path} cannot be read ({exc.strerror}): {fix}") from None


def unreadable(path, exc: OSError) -> str:
    """``path`` cannot be read, why, and the fix: this process's user needs read permission (and, for a
    folder, permission to enter it and everything inside)."""
    mode = "-R a+rX" if os.path.isdir(path) else "a+r"
    return (f"{path} cannot be read ({exc.strerror or first_line(exc)}): make it readable by this user "
            f"(chmod {mode} {shlex.quote(str(path))})")
