"""The one reader of every small file vitreg parses (a checkpoint's files, a spool journal, a ``--prices`` table),
each read as hostile: a regular file (a fifo could block) of at most :data:`MAX_BYTES`, strict UTF-8 without NUL,
nested at most :data:`MAX_DEPTH` deep (the parsers recurse per level); a fault is one line naming file and fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from pathlib import Path

from vitreg.errors import VitregError, unreadable

#: 1 MiB: what vitreg writes into these files is a few KiB at most (a manifest of a few files, a price table)
MAX_BYTES = 1 << 20
#: vitreg's own files nest 3 deep; 64 leaves room for any hand-written table, far from the recursion limit
MAX_DEPTH = 64

# what may hold a bracket that is not nesting: strings (and TOML's comments), removed before counting
_JSON_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: a third of the time of (a|b)* on a long line
_TOML_STRINGS = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\n]*\'|#[^\n]*')
_NOT_A_BRACKET, _INNERMOST = re.compile(r"[^\[\]{}]+"), re.compile(r"\[\]|\{\}")


class FileFault(ValueError):
    """What is wrong with a file's content, in a few words (the caller names the file and the fix)."""


def decoded(data: bytes) -> str:
    """``data`` as strict UTF-8 without NUL (which no text vitreg reads holds, and C code cuts at)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileFault(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    if "\0" in text:
        raise FileFault(f"holds a NUL byte (at offset {text.index(chr(0))}): not a text file")
    return text


def check_depth(text: str, strings: re.Pattern = _JSON_STRINGS) -> str:
    """``text`` itself, unless its brackets (outside ``strings``) nest deeper than :data:`MAX_DEPTH`."""
    brackets = _NOT_A_BRACKET.sub("", strings.sub("", text))
    for _ in range(MAX_DEPTH + 1):  # each pass takes off the innermost level (in C: a line costs microseconds)
        inner = _INNERMOST.sub("", brackets)
        if inner == brackets:  # what is left is not nesting (stray brackets): the parser says what is wrong
            return text
        brackets = inner
    raise FileFault(f"nested more than {MAX_DEPTH} levels deep, more than a vitreg file may hold")


def bounded_lines(fh, limit: int):
    """``(line, ended)`` for each line of binary file ``fh``, its line end cut off; a line over ``limit`` bytes is
    ``(None, ended)``, read past in pieces, never held whole (a torn 300 MB line took 1.4 GB and 110 s)."""
    while line := fh.readline(limit + 1):
        rest = line
        while len(line) > limit and rest and not rest.endswith(b"\n"):
            rest = fh.readline(MAX_BYTES)
        ended = rest.endswith(b"\n")
        yield (None if len(line) > limit else line.removesuffix(b"\n")), ended


def parse_json(data: bytes | str):
    """One JSON value from ``data``, checked; FileFault for anything else."""
    import json

    text = check_depth(decoded(data) if isinstance(data, bytes) else data)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise FileFault(f"not valid JSON ({exc})") from None
    # written as \u0000 (a raw one is refused above): no name or value vitreg reads holds one, and a store
    # refuses it; the text is searched first, the value walked only where it may hold one
    if "\\u0000" in text and _holds_nul(value):
        raise FileFault("holds a NUL character (\\u0000) in a name or value")
    return value


def _holds_nul(value) -> bool:
    """Whether a string anywhere in the parsed JSON ``value`` holds a NUL."""
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    return isinstance(value, list) and any(_holds_nul(v) for v in value)


def read_bytes(path, limit: int = MAX_BYTES) -> bytes:
    """At most ``limit`` bytes of the regular file ``path`` (opened without blocking: a fifo is refused, not waited
    on); FileFault for a larger file or anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileFault("not a regular file (a folder, a fifo, a device or a socket)")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise FileFault(f"larger than the {limit} bytes a vitreg file may hold")
    return data


def read_text(path, fix: str, error: type[VitregError] = VitregError, where: str | None = None,
              limit: int = MAX_BYTES) -> str:
    """The text of ``path``; else ``error`` naming ``where`` (default: the path), what is wrong and ``fix``."""
    with faults_as(error, where or str(path), fix):
        return decoded(read_bytes(path, limit))


def read_json(path, fix: str, error: type[VitregError] = VitregError, where: str | None = None):
    """The JSON value in ``path``, read as :func:`read_text` does."""
    with faults_as(error, where or str(path), fix):
        return parse_json(read_bytes(path))


def read_toml(path, fix: str, error: type[VitregError] = VitregError) -> dict:
    """The TOML table in ``path``, read as :func:`read_text` does."""
    import tomllib

    with faults_as(error, str(path), fix):
        text = check_depth(decoded(read_bytes(path)), _TOML_STRINGS)
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise FileFault(f"not TOML ({exc})") from None


@contextlib.contextmanager
def faults_as(error: type[VitregError], where: str, fix: str):
    """Inside: a FileFault or an OSError becomes ``error`` naming ``where``, what is wrong and ``fix``."""
    try:
        yield
    except FileFault as exc:
        raise error(f"{where}: {exc}: {fix}") from None
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise error(f"{where} does not exist: {fix}") from None
        reason = unreadable(exc.filename or where, exc)
        named = where == str(exc.filename or where)  # else where says what the file is: "checkpoint D: spec.json"
        raise error(f"{reason}; or {fix}" if named else f"{where}: {reason}; or {fix}") from None


def inside(root, path, within: str = "") -> Path | None:
    """``path`` with every link followed, if that lies inside ``root / within``, else None: the one rule for a path
    read from a folder vitreg was given (checking the name's text lets a linked folder lead anywhere)."""
    resolved, home = Path(path).resolve(), Path(root).resolve() / within
    return resolved if resolved.is_relative_to(home) else None
