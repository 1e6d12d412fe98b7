"""What ``batch_size=auto`` measured, kept in the user's cache, so a later run of the same work skips the probes.

The probes cost ~60 s of the mission's command on an H200 (issue 23; reusing them saved 14.4 s of
its 82.9 s on 2026-12-02, benchmarks/results/h200-2026-12-02/), and their answer only changes with the work and the
machine. An entry is keyed by all of these: the GPU model (or the CPU's), the model,
the image size, the precision, the compile mode, the SDPA backend asked for, the torch version and the
task. A run that finds its key checks the kept batch with one probe (it must still fit: another process
may hold memory now) and times it; a batch that runs out of memory is dropped and the full search runs
again, said in one line. The file is one JSON object (``autobatch.json`` under
:func:`vitreg.environment.user_cache_dir`, or ``$VITREG_BATCH_CACHE``): a file that cannot be read is
said in one line and rewritten, an entry of the wrong shape counts as missing. Delete the file to forget every choice.

Beside it, ``flops.json`` keeps the FLOP counts (:func:`counted_flops`): a forward and a training step of the
same model at the same size count the same every time, and counting them runs the real model under torch's
FlopCounterMode (a CPU run of ViT-B/16 spent seconds on it; every sweep child of one model counted again). And
``compile.json`` the last compile time of each graph, cold and warm (:func:`compile_seconds`): what the estimate
counts for a compile once one was timed (a typical figure put ViT-B's at 40 s where the H200 took 10-12 s).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from vitreg.environment import user_cache_dir

MAX_ENTRIES = 256  # the most recent kept: a sweep over sizes does not grow the file without end


@dataclass(frozen=True)
class CacheKey:
    """The work and the machine a kept batch was measured for."""

    machine: str  # the GPU's name as the driver reports it, or the CPU model
    model: str
    img_size: int  # 0: the model's default
    precision: str  # the resolved amp mode
    compile: str
    sdpa: str
    torch: str
    task: str

    def text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def key_for(spec, runtime, task: str) -> CacheKey:
    """The key of a bench spec's task under a resolved :class:`vitreg.hardware.runtime.Runtime`."""
    import torch

    if runtime.device == "cuda":
        machine = torch.cuda.get_device_name(runtime.device_index)
    else:
        from vitreg.environment import cpu_model

        machine = f"cpu:{cpu_model()}"
    return CacheKey(machine, spec.model, spec.img_size, runtime.amp, runtime.compile, spec.sdpa,
                    torch.__version__, task)


ENV_VAR = "VITREG_BATCH_CACHE"  # another file (the test suite gives each test its own)


def cache_file() -> Path:
    return Path(os.environ[ENV_VAR]).expanduser() if os.environ.get(ENV_VAR) else user_cache_dir() / "autobatch.json"


def _read(path: Path | None = None) -> tuple[dict, str | None]:
    """``(entries, note)``: the note is one line when the file exists but cannot be used."""
    path = path or cache_file()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as exc:
        return {}, f"the batch cache {path} is unreadable ({type(exc).__name__}): probing, then rewriting it"
    if not isinstance(data, dict):
        return {}, f"the batch cache {path} holds no JSON object: probing, then rewriting it"
    return data, None


def lookup(key: CacheKey) -> tuple[int | None, str | None]:
    """``(kept batch or None, note or None)``."""
    entries, note = _read()
    entry = entries.get(key.text())
    batch = entry.get("batch") if isinstance(entry, dict) else None
    return (batch if type(batch) is int and batch > 0 else None), note


def keep(key: CacheKey, batch: int, probes: str) -> None:
    """Keep ``batch`` for ``key`` (``probes``: the search's one-line summary, for a reader of the file)."""
    entries, _ = _read()
    entries.pop(key.text(), None)
    entries[key.text()] = {"batch": batch, "probes": probes}  # newest last
    _write(dict(list(entries.items())[-MAX_ENTRIES:]))


def forget(key: CacheKey) -> None:
    entries, _ = _read()
    if entries.pop(key.text(), None) is not None:
        _write(entries)


def _write(entries: dict, path: Path | None = None) -> None:
    path = path or cache_file()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
        os.replace(tmp, path)  # whole or not at all, for a process reading it meanwhile
    except OSError:  # a read-only cache costs the next run its probes, nothing else
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# FLOP counts


def counted_flops(key: dict, count) -> int:
    """The FLOPs ``count()`` gives for the work ``key`` names (the model, its size, classes and distillation,
    its parameters, the library versions, forward or training step), counted once and read back after."""
    kept = _kept("flops.json", json.dumps(key, sort_keys=True))
    if type(kept) is int and kept > 0:
        return kept
    flops = int(count())
    _keep("flops.json", json.dumps(key, sort_keys=True), flops)
    return flops


# --------------------------------------------------------------------------------------------
# compile times: what the estimate counts for a compile, once one of the same graph was timed


def compile_seconds(key: CacheKey, warm: bool) -> float | None:
    """The last compile (with its first call) of ``key``'s graph timed with the compile cache ``warm`` or cold;
    None before one was. The batch is not in the key: a ViT's graph compiles in about the same time at any."""
    kept = _kept("compile.json", key.text())
    value = kept.get("warm" if warm else "cold") if isinstance(kept, dict) else None
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None


def keep_compile_seconds(key: CacheKey, state: str | None, seconds: float) -> None:
    """Keep a compile's time under the cache state it met (:class:`vitreg.hardware.compile_cache.CacheProbe`:
    ``warm``, ``cold``; a ``partial`` one counts as cold, an ``unused`` one is not a compile of this cache)."""
    if state not in ("warm", "cold", "partial"):
        return
    kept = _kept("compile.json", key.text())
    _keep("compile.json", key.text(), {**(kept if isinstance(kept, dict) else {}),
                                         "warm" if state == "warm" else "cold": round(seconds, 2)})


def _kept(name: str, text: str):
    return _read(cache_file().with_name(name))[0].get(text)


def _keep(name: str, text: str, value) -> None:
    path = cache_file().with_name(name)
    entries, _ = _read(path)
    entries.pop(text, None)
    entries[text] = value  # newest last
    _write(dict(list(entries.items())[-MAX_ENTRIES:]), path)
