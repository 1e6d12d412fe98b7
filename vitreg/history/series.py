"""The series of a check: the runs of each configuration x GPU (label and model) x CPU grant in run order, and
which are the candidate and which its history. Mislabelled runs never enter a series."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from vitreg.analysis.frame import GRANT_COLUMNS, identity_options
from vitreg.errors import VitregError

HARDWARE = ("gpu", "gpu_name")
# The environment fingerprint (tags every run carries) that can explain a change, then the batch that
# batch_size=auto chose (the tidy frame's batch_chosen, from the <task>_batch_size_chosen tag).
ENVIRONMENT = ("torch_version", "cuda_version", "cudnn_version", "driver_version", "timm_version", "vitreg_git_sha")
CAUSES = ENVIRONMENT + ("batch_chosen",)
# What the timed windows met (tidy frame columns): a change of these is the GPU's or the host's, not the code's
CONDITIONS = ("throttle", "busy_host", "sm_clock_mhz")
DEFAULT_WINDOW = 10
MISSING = "-"  # a key nobody recorded (a run that predates the option)


class CheckError(VitregError):
    """The check cannot be made as asked; the one-line message names the fix."""


@dataclass(frozen=True)
class Selection:
    """Which runs are compared: the candidate (``candidate`` run id, or the runs tagged ``candidate_tag``,
    else the newest run of each series) against the ``window`` runs before it (or the newest ``window``
    runs tagged ``baseline_tag``)."""

    window: int = DEFAULT_WINDOW
    candidate: str | None = None
    candidate_tag: tuple[str, str] | None = None
    baseline_tag: tuple[str, str] | None = None

    def __post_init__(self):
        if self.window < 1:
            raise CheckError(f"window={self.window}: the history needs at least one run; pass --window 10 "
                             "(the default) or any number >= 1")
        if self.candidate and self.candidate_tag:
            raise CheckError("pass --candidate RUN_ID or --candidate-tag KEY=VALUE, not both")

    @property
    def tag_keys(self) -> tuple[str, ...]:
        return tuple(t[0] for t in (self.candidate_tag, self.baseline_tag) if t)

    def describe(self) -> str:
        cand = (f"run {self.candidate}" if self.candidate else
                f"runs tagged {'='.join(self.candidate_tag)}" if self.candidate_tag else "the newest run")
        base = f"runs tagged {'='.join(self.baseline_tag)}" if self.baseline_tag else "runs before it"
        return f"candidate: {cand} of each series; history: the last {self.window} {base}"


def parse_tag(text: str | None, flag: str) -> tuple[str, str] | None:
    text = (text or "").strip()
    if not text:
        return None
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise CheckError(f"{flag} {text!r} is not KEY=VALUE: pass e.g. {flag} release=2.4")
    return key.strip(), value.strip()


def carried_columns(selection: Selection) -> tuple[str, ...]:
    """The tags/params the tidy frame must carry for a check (``tidy(..., axes=...)``)."""
    return tuple(dict.fromkeys(identity_options() + HARDWARE + ENVIRONMENT + selection.tag_keys))


@dataclass(frozen=True)
class Series:
    """One configuration on one GPU: its runs in order (``run_id``, ``start_time``, ``value``, ``cv``, the
    environment), the candidate rows and the history rows (both subsets of ``runs``)."""

    key: dict
    runs: pd.DataFrame
    candidate: pd.DataFrame
    history: pd.DataFrame


def key_columns(frame: pd.DataFrame) -> list[str]:
    """The columns that tell series apart (runs that predate a tag share one value, <NA>)."""
    return [n for n in identity_options() + HARDWARE + GRANT_COLUMNS if n in frame]


def honest(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of runs that ran on the GPU they are filed under (a mislabelled run is no one's history)."""
    return frame[~frame["mismatch"].astype(bool)]


def require_tags(frame: pd.DataFrame, selection: Selection) -> None:
    for flag, tag in (("--candidate-tag", selection.candidate_tag), ("--baseline-tag", selection.baseline_tag)):
        if tag and not (frame.get(tag[0], pd.Series(dtype=object)).astype(str) == tag[1]).any():
            seen = sorted({str(v) for v in frame.get(tag[0], pd.Series(dtype=object)).dropna()})[:8]
            found = f"its values: {', '.join(seen)}" if seen else "no run carries that tag"
            raise CheckError(f"{flag} {tag[0]}={tag[1]}: no finished run has it ({found}); tag runs with "
                             f"`mlflow.set_tag` or pick a value that exists")


def series_of(frame: pd.DataFrame, metric: str, selection: Selection) -> list[Series]:
    """Every series of the tidy ``frame`` that holds a candidate under ``selection``, in key order."""
    rows = honest(frame)
    rows = rows[pd.to_numeric(rows[metric], errors="coerce").notna()]
    keys = key_columns(rows)
    text = pd.DataFrame({k: rows[k].map(cell_text) for k in keys}, index=rows.index)
    out = []
    for values, index in text.groupby(keys, sort=True).groups.items():
        runs = _runs(rows.loc[index], metric, selection.tag_keys)
        split = _split(runs, selection)
        if split is not None:
            out.append(Series(dict(zip(keys, values)), runs, *split))
    return out


def _runs(rows: pd.DataFrame, metric: str, tags: tuple[str, ...]) -> pd.DataFrame:
    """A series' runs, oldest first: id, start, the metric, the run's own spread of it, the environment."""
    out = pd.DataFrame({"run_id": rows["run_id"], "start_time": rows["start_time"],
                        "value": pd.to_numeric(rows[metric], errors="coerce").astype(float)})
    # the runs' window-to-window spread measures throughput only (throughput_cv)
    out["cv"] = rows["throughput_cv"] if metric.startswith("throughput") and "throughput_cv" in rows else np.nan
    for col in dict.fromkeys(CAUSES + CONDITIONS + tags):
        if col in rows:
            out[col] = rows[col]
    return out.sort_values(["start_time", "run_id"], kind="stable").reset_index(drop=True)


def _split(runs: pd.DataFrame, sel: Selection) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(candidate rows, history rows) of one series; None when it holds no candidate."""
    if sel.candidate:
        is_candidate = runs["run_id"] == sel.candidate
    elif sel.candidate_tag:
        is_candidate = _tagged(runs, sel.candidate_tag)
    else:
        is_candidate = pd.Series(runs.index == runs.index[-1], index=runs.index)
    if not is_candidate.any():
        return None
    candidate, rest = runs[is_candidate], runs[~is_candidate]
    if sel.baseline_tag:
        pool = rest[_tagged(rest, sel.baseline_tag)]
    else:
        pool = rest[rest.index < candidate.index.min()]  # runs are in run order: those before the candidate
    return candidate, pool.tail(sel.window)


def _tagged(runs: pd.DataFrame, tag: tuple[str, str]) -> pd.Series:
    key, value = tag
    return runs[key].astype(str) == value if key in runs else pd.Series(False, index=runs.index)


def cell_text(value) -> str:
    """A cell as text (None, NaN and <NA> as :data:`MISSING`), so that values of any dtype compare alike."""
    return MISSING if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)
