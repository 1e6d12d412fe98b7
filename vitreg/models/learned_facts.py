"""What earlier processes learned about timm's models, for a process that checks a model but builds none.

A DDP launcher or a sweep's parent checks the model's name and memory floor, which means importing timm (3-4 s);
so a process that imports timm keeps what it learned in the user's cache, and those look there first. A process
that builds a model never reads it; a missing or edited file only costs the import. A name no process listed is
looked up in timm's source (:func:`source_names`: 0.19 s against 5 s for the import).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
from importlib import metadata
from pathlib import Path

from vitreg.environment import user_cache_dir
from vitreg.files import parse_json, read_bytes

# Footprints kept (the most recent): a launcher asks for the model it runs, so a short memory serves; a
# fuzzing test or a sweep over image sizes does not grow the file without end.
MAX_SIZES = 64


def cache_file() -> Path | None:
    spec = importlib.util.find_spec("timm")  # finds timm's folder without importing it
    if spec is None or not spec.origin:
        return None
    try:
        version = metadata.version("timm")
    except metadata.PackageNotFoundError:
        return None
    install = hashlib.sha256(spec.origin.encode()).hexdigest()[:12]  # one file per environment
    return user_cache_dir() / f"timm-{version}-{install}.json"


def _load() -> dict:
    path = cache_file()
    try:
        data = parse_json(read_bytes(path)) if path else {}
    except (OSError, ValueError):  # a cache, rebuilt when unreadable (FileFault is a ValueError: too deep, ...)
        return {}
    return data if isinstance(data, dict) else {}


def names() -> frozenset[str]:
    listed = _load().get("names")
    return frozenset(n for n in listed if isinstance(n, str)) if isinstance(listed, list) else frozenset()


#: timm's registration, as its source spells it: the decorator, then the function whose name is the model's
_REGISTERED = re.compile(r"^@register_model\s*\ndef\s+(\w+)\s*\(", re.MULTILINE)


def source_names() -> frozenset[str]:
    """Every model name timm registers, read from its source (empty where it cannot be: then ask timm)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    found: set[str] = set()
    try:
        for path in (Path(next(iter(spec.submodule_search_locations))) / "models").glob("*.py"):
            text = path.read_text(encoding="utf-8")
            if "@register_model" in text:
                found.update(_REGISTERED.findall(text))
    except (OSError, UnicodeDecodeError):
        return frozenset()
    return frozenset(found)


def sizes(key: str) -> tuple[int, ...] | None:
    kept = _load().get("sizes", {})
    value = kept.get(key) if isinstance(kept, dict) else None
    if isinstance(value, list) and value and all(type(v) is int and v >= 0 for v in value):
        return tuple(value)
    return None


def keep(names: tuple[str, ...] | None = None, sizes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Add what this process learned. Two processes writing at once may lose one's entry: a later miss."""
    path = cache_file()
    if path is None:
        return
    data = _load()
    if names is not None:
        data["names"] = sorted(names)
    if sizes:
        kept = data.get("sizes") if isinstance(data.get("sizes"), dict) else {}
        kept = {k: v for k, v in kept.items() if k not in sizes}
        kept.update({k: list(v) for k, v in sizes.items()})  # newest last
        data["sizes"] = dict(list(kept.items())[-MAX_SIZES:])
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data), encoding="utf-8")  # unsorted: the order of "sizes" is their age
        os.replace(tmp, path)  # whole or not at all, for a process reading it meanwhile
    except OSError:  # a read-only cache only costs the next launcher the import
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
