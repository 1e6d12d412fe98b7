"""What earlier runs measured, kept in the user's cache so a later run of the same work skips it: the batch
``batch_size=auto`` chose (``autobatch.json``, or ``$VITREG_BATCH_CACHE``: the probes cost 15-60 s on a GPU; a
kept batch is checked by the task's own warm-up, and on the GPUs vitreg has run on the mission's batches come
measured with the package, :data:`MEASURED`), FLOP counts (``flops.json``) and each graph's last compile time,
cold and warm (``compile.json``, what the estimate counts). A file that cannot be read is said and rewritten.
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


@dataclass(frozen=True)
class Kept:
    """A batch kept for a key: by this machine's cache, or :data:`MEASURED` with the package."""

    batch: int
    probes: str  # the search's summary, ``256:8952,512:9061,1024:oom``
    origin: str  # where it comes from, for the run's line: the cache file, or the measurement's source
    source: str = "cache"  # "cache": this machine's file; "measured": MEASURED (the BatchChoice's source)

    @property
    def img_per_s(self) -> float | None:
        """The probe's img/s at the kept batch, when the summary has it."""
        rates = dict(part.split(":", 1) for part in self.probes.split(",") if ":" in part)
        try:
            return float(rates[str(self.batch)])
        except (KeyError, ValueError):
            return None


#: The mission's defaults (ViT-B/16 as ``mlflow run . -e bench`` runs it), whose batches :data:`MEASURED` holds.
MISSION = {"model": "vit_base_patch16_224", "img_size": 0, "precision": "bf16", "compile": "off", "sdpa": "auto"}
#: What batch_size=auto chose for :data:`MISSION` on each GPU vitreg has run on, with every probe's img/s, read as a
#: fresh machine's cache entries (a batch searched on this machine wins): (device name, task) -> (batch, probes,
#: source). Measured, never guessed: the run each comes from, its commit and versions; a new GPU searches.
MEASURED = {
    ("NVIDIA H200", "infer"): (512, "256:8952,512:9061,1024:8853", "H200, 2026-12-03, be996c6, torch 2.11.0, "
                               "timm 1.0.29: benchmarks/results/h200-2026-12-03-stop44/call1"),
    ("NVIDIA H200", "train"): (1024, "256:2690,512:2819,1024:2848,2048:2872", "H200, 2026-12-03, be996c6, torch "
                               "2.11.0, timm 1.0.29: benchmarks/results/h200-2026-12-03-stop44/call1"),
    ("NVIDIA H100 80GB HBM3", "infer"): (512, "256:8608,512:8758,1024:8640", "H100 80GB HBM3, 2026-12-06, "
                                         "1ae7e00, torch 2.11, timm 1.0.29: benchmarks/results/h100-2026-12-06-tta"),
    ("NVIDIA H100 80GB HBM3", "train"): (1024, "256:2529,512:2657,1024:2694,2048:oom,1536:oom", "H100 80GB HBM3, "
                                         "2026-12-06, 8b9dd89, torch 2.11, timm 1.0.29: benchmarks/results/"
                                         "h100-2026-12-06-tta/call2"),
}


def lookup(key: CacheKey) -> tuple[Kept | None, str | None]:
    """``(kept batch or None, note or None)``: this machine's entry for ``key``, else a measured one."""
    entries, note = _read()
    entry = entries.get(key.text())
    if isinstance(entry, dict):  # a forgotten entry ({"batch": null}) hides a measured one
        batch = entry.get("batch")
        good = type(batch) is int and batch > 0
        return (Kept(batch, str(entry.get("probes", "")), str(cache_file())) if good else None), note
    measured = MEASURED.get((key.machine, key.task))
    if measured and {name: getattr(key, name) for name in MISSION} == MISSION:
        return Kept(measured[0], measured[1], f"measured on {measured[2]}", "measured"), note
    return None, note


def keep(key: CacheKey, batch: int, probes: str) -> None:
    """Keep ``batch`` for ``key`` (``probes``: the search's one-line summary, for a reader of the file)."""
    _keep(cache_file(), key.text(), {"batch": batch, "probes": probes})


def forget(key: CacheKey) -> None:
    """The kept batch no longer fits: searched the next time, also where :data:`MEASURED` holds one."""
    _keep(cache_file(), key.text(), {"batch": None, "probes": "forgotten: out of memory"})


def _keep(path: Path, text: str, value) -> None:
    """``value`` under ``text`` in the file at ``path``, newest last, the :data:`MAX_ENTRIES` newest kept."""
    entries, _ = _read(path)
    entries.pop(text, None)
    entries[text] = value
    _write(dict(list(entries.items())[-MAX_ENTRIES:]), path)


def _write(entries: dict, path: Path) -> None:
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
    """The FLOPs ``count()`` gives for the work ``key`` names, counted once and read back after."""
    path, text = cache_file().with_name("flops.json"), json.dumps(key, sort_keys=True)
    kept = _read(path)[0].get(text)
    if type(kept) is int and kept > 0:
        return kept
    flops = int(count())
    _keep(path, text, flops)
    return flops


def compile_seconds(key: CacheKey, warm: bool) -> float | None:
    """The last compile (with its first call) of ``key``'s graph timed with the compile cache ``warm`` or cold;
    None before one was. The batch is not in the key: a ViT's graph compiles in about the same time at any."""
    kept = _read(cache_file().with_name("compile.json"))[0].get(key.text())
    value = kept.get("warm" if warm else "cold") if isinstance(kept, dict) else None
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None


def keep_compile_seconds(key: CacheKey, state: str | None, seconds: float) -> None:
    """Keep a compile's time under the cache state it met: ``partial`` counts as cold, ``unused`` not at all."""
    if state not in ("warm", "cold", "partial"):
        return
    path = cache_file().with_name("compile.json")
    kept = _read(path)[0].get(key.text())
    kept = {**(kept if isinstance(kept, dict) else {}), "warm" if state == "warm" else "cold": round(seconds, 2)}
    _keep(path, key.text(), kept)

