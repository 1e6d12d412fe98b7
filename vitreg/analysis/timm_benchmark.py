"""timm ``benchmark.py`` result CSVs read as vitreg runs, so published numbers sit next to ours.

timm writes one row per model: ``model, param_count`` and, per task, ``<task>_samples_per_sec``, ``_step_time``
(the *mean* ms per batch), ``_batch_size``, ``_img_size`` (``infer_gmacs``: GMACs of one image). Its published
files name their setup: ``benchmark-{infer|train}-{precision}-{nchw|nhwc}-pt{torch}-{cu<ver>|cpu}-{device}
[-dynamo].csv``, e.g. ``benchmark-infer-amp_bf16-nchw-pt291-cu130-pro6000maxq-dynamo.csv``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from vitreg.errors import VitregError, first_line


class TimmImportError(VitregError):
    """The file is not a timm benchmark CSV we can import; the one-line message names the fix."""


@dataclass
class ImportedRun:
    """One model (and task) from a timm CSV in vitreg's names."""

    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def run_name(self) -> str:
        return f"timm-{self.params['model']}-{self.params['task']}-{self.params['gpu']}"


# Precision token in the file name -> vitreg's amp. timm's bf16/fp16 cast the whole model where vitreg's amp is
# autocast: filed under the same dtype, the closest setting, with the token in the timm_precision tag.
_PRECISIONS = {"amp": "fp16", "amp_fp16": "fp16", "amp_float16": "fp16", "amp_bf16": "bf16", "amp_bfloat16": "bf16",
               "fp32": "off", "float32": "off", "tf32": "off", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
               "float16": "fp16"}
_TASKS = {"infer": "infer", "inference": "infer", "train": "train", "both": "both"}
_COMPILE_TOKENS = {"dynamo", "compile", "compiled", "inductor"}

# Columns timm's benchmark.py writes; prefixed columns outside this list are tolerated (timm adds
# some now and then) but a file with other unprefixed columns is not a benchmark.py result.
_REQUIRED = ("samples_per_sec", "step_time", "batch_size", "img_size")
_KNOWN_TASK_COLUMNS = _REQUIRED + ("gmacs", "macts", "param_count", "fwd_time", "bwd_time", "opt_time")
_KNOWN_PLAIN = ("model", "param_count", "error")


def parse_timm_filename(name) -> dict:
    """The setup a timm result file's name says, in vitreg's terms (``amp``, ``gpu``) and timm's (``precision``);
    None where it says nothing (all of them for a name not ``benchmark-...``)."""
    tokens = re.sub(r"\.csv$", "", Path(str(name)).name, flags=re.IGNORECASE).lower().split("-")
    out = dict.fromkeys(("task", "amp", "precision", "layout", "torch_version", "cuda", "gpu", "cpu", "compile"))
    if tokens[0] != "benchmark":
        return out
    out["compile"] = "off"
    device = []
    for tok in tokens[1:]:
        if tok in _TASKS and out["task"] is None:
            out["task"] = _TASKS[tok]
        elif tok in _PRECISIONS and out["precision"] is None:
            out["precision"], out["amp"] = tok, _PRECISIONS[tok]
        elif tok in ("nchw", "nhwc"):
            out["layout"] = tok
        elif re.fullmatch(r"pt\d{2,4}", tok):
            out["torch_version"] = _torch_version(tok[2:])
        elif re.fullmatch(r"cu\d{2,4}", tok):
            out["cuda"] = f"{tok[2:-1]}.{tok[-1]}"  # cu124 -> 12.4, cu92 -> 9.2
        elif tok == "cpu":
            out["gpu"] = "cpu"
        elif tok in _COMPILE_TOKENS:
            out["compile"] = "default"
        elif tok:
            device.append(tok)
    if out["gpu"] == "cpu":
        out["cpu"] = "-".join(device) or None
    elif device:
        out["gpu"] = _gpu_label("-".join(device))
    return out


def read_timm_csv(path, gpu: str | None = None, *, amp: str | None = None) -> list[ImportedRun]:
    """One :class:`ImportedRun` per model row (a ``both`` row: one ``task=both`` run, or two when timm's
    out-of-memory retry shrank one half's batch); rows with an error or no throughput are skipped. ``gpu`` and
    ``amp`` default to the file name's (a given GPU must agree with it)."""
    path = Path(path)
    if not path.is_file():
        raise TimmImportError(f"timm CSV not found: {path}; pass the path of a benchmark-*.csv file")
    info = parse_timm_filename(path.name)
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        raise TimmImportError(f"{path.name} is empty; expected a timm benchmark.py results CSV with a header "
                              "row") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise TimmImportError(f"{path.name} is not a readable CSV ({first_line(e)}); pass a timm benchmark.py results "
                              "file") from None
    df.columns = [str(c).strip() for c in df.columns]
    tasks = _check_columns(df, path.name, info["task"])
    label = _resolve_gpu(gpu, info, path.name)
    amp_value = _resolve_amp(amp, info, path.name)
    runs = []
    for i, row in df.iterrows():
        line, model = i + 2, row["model"].strip()  # the header is line 1
        if row.get("error", "").strip() or not model:
            continue
        halves = {task: vals for task in tasks if (vals := {
            k: _number(row, f"{task}_{k}", path.name, line) for k in _KNOWN_TASK_COLUMNS if f"{task}_{k}" in df.columns
        }).get("samples_per_sec") is not None}
        if not halves:
            continue
        param_count = _number(row, "param_count", path.name, line) if "param_count" in df else None
        shape = {(h.get("batch_size"), h.get("img_size")) for h in halves.values()}
        for group in [tuple(halves)] if len(shape) == 1 else [(t,) for t in halves]:
            runs.append(_make_run(model, group, halves, info, label, amp_value, param_count, path.name))
    if not runs:
        raise TimmImportError(f"{path.name} has no importable rows (all rows errored or lack a throughput); "
                              "check that timm's benchmark.py finished")
    return runs


def _check_columns(df: pd.DataFrame, name: str, file_task: str | None) -> tuple[str, ...]:
    cols = list(df.columns)
    unknown = [c for c in cols if c not in _KNOWN_PLAIN and not re.match(r"(infer|train)_", c)]
    if unknown:
        raise TimmImportError(f"{name} has column(s) {', '.join(unknown)} that timm's benchmark.py does not write; "
                              "pass a benchmark.py results CSV (not e.g. a validation results-*.csv)")
    if "model" not in cols:
        raise TimmImportError(f"{name} has no 'model' column; pass a timm benchmark.py results CSV")
    tasks = tuple(t for t in ("infer", "train") if f"{t}_samples_per_sec" in cols)
    if not tasks:
        raise TimmImportError(f"{name} has neither infer_samples_per_sec nor train_samples_per_sec; "
                              "it looks like a profile-only run, which has no throughput to import")
    for t in tasks:
        missing = [f"{t}_{k}" for k in _REQUIRED if f"{t}_{k}" not in cols]
        if missing:
            raise TimmImportError(f"{name} lacks column(s) {', '.join(missing)} needed to import its {t} results; "
                                  "re-export the full benchmark.py CSV")
    wanted = {"infer": ("infer",), "train": ("train",), "both": ("infer", "train")}.get(file_task)
    if wanted and not set(wanted) <= set(tasks):
        raise TimmImportError(f"{name} says task={file_task} in its name but has only {'/'.join(tasks)} columns; "
                              "rename the file to match its contents")
    return tasks


def _resolve_gpu(gpu: str | None, info: dict, name: str) -> str:
    file_gpu = info["gpu"]
    if gpu is not None and str(gpu).strip():
        given = _gpu_label(gpu)
        if file_gpu is not None and given != file_gpu:
            raise TimmImportError(f"--gpu {str(gpu).strip()} ({given}) disagrees with the GPU in the file name "
                                  f"({file_gpu}, from {name}); drop --gpu or import the right file")
        return given
    if file_gpu is None:
        raise TimmImportError(f"cannot tell which GPU {name} was measured on (its name does not follow "
                              "benchmark-<task>-<precision>-<layout>-pt<ver>-cu<ver>-<gpu>.csv); pass --gpu")
    return file_gpu


def _resolve_amp(amp: str | None, info: dict, name: str) -> str:
    if amp is not None:
        value = str(amp).strip().lower()
        if value not in ("off", "bf16", "fp16"):
            raise TimmImportError(f"amp {amp!r} is not one of off, bf16, fp16")
        return value
    if info["amp"] is None:
        raise TimmImportError(f"cannot tell the precision of {name} from its name (expected a token like amp, "
                              "amp_bf16, fp32); pass amp=off/bf16/fp16 (--amp)")
    return info["amp"]


def _make_run(model, group, halves, info, gpu, amp, param_count, file_name) -> ImportedRun:
    first = halves[group[0]]
    task = "both" if len(group) == 2 else group[0]
    params = {"model": model, "task": task, "batch_size": _int_text(first.get("batch_size")),
              "img_size": _int_text(first.get("img_size")), "amp": amp, "compile": info["compile"] or "off",
              "gpu": gpu, "nproc": "1"}
    # timm's step time is a mean over its timed steps, not the p50 vitreg measures.
    tags = {"source": "timm", "gpu": gpu, "amp": amp, "timm_file": file_name, "timm_step_time": "mean"}
    for key, tag in (("torch_version", "torch_version"), ("cuda", "cuda_version"),
                     ("precision", "timm_precision"), ("layout", "timm_layout"), ("cpu", "cpu")):
        if info.get(key):
            tags[tag] = info[key]
    if param_count is not None:
        tags["timm_param_count_m"] = f"{param_count:g}"
    metrics = {}
    for t in group:
        h = halves[t]
        metrics[f"{t}_throughput_img_per_s"] = h["samples_per_sec"]
        if h.get("step_time") is not None:
            metrics["infer_latency_ms_p50" if t == "infer" else "train_step_ms_p50"] = h["step_time"]
        if t == "infer" and h.get("gmacs"):
            metrics["fwd_gflops_per_img"] = 2.0 * h["gmacs"]
    return ImportedRun(params=params, tags=tags, metrics=metrics)


def _number(row, col: str, name: str, line: int) -> float | None:
    text = str(row.get(col, "")).strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise TimmImportError(f"{name} line {line}: {col}={text!r} is not a number; fix or delete that row") from None


def _int_text(v: float | None) -> str:
    return "" if v is None else str(int(round(v)))


def _torch_version(digits: str) -> str:
    """``240`` -> ``2.4.0``, ``291`` -> ``2.9.1``, ``112`` -> ``1.12``, ``2100`` -> ``2.10.0``."""
    major, rest = digits[0], digits[1:]
    if major == "1" and len(rest) == 2 and rest[0] == "1":
        # timm published 1.10-1.13 as pt110..pt113; torch 1.1.x predates these result files.
        return f"1.{rest}"
    return f"{major}.{rest[:-1]}.{rest[-1]}" if len(rest) >= 2 else f"{major}.{rest}"


def _gpu_label(text: str) -> str:
    """The vitreg label for a GPU name as timm files and people spell it (``4090``, ``NVIDIA GeForce RTX 4090``
    -> ``rtx4090``), so imported runs group with tracked ones; a card with no profile keeps a compact slug."""
    from vitreg.hardware.profiles import PROFILES, match_profile, normalize_label

    label = normalize_label(str(text))
    if label in PROFILES:
        return label
    compact = re.sub(r"[\s_]+", "", label)
    compact = re.sub(r"^(nvidia)?(geforce)?", "", compact)
    # Newer timm files drop the prefix ("4090"); GeForce cards are rtx<number> in vitreg.
    if re.fullmatch(r"[2-5]0[5-9]0(ti|super)?", compact):
        compact = "rtx" + compact
    compact = normalize_label(compact)
    if compact in PROFILES:
        return compact
    profile = match_profile(str(text))
    return profile.label if profile.label in PROFILES else compact
