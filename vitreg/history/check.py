"""``vitreg check`` on a tidy runs frame: per configuration x GPU, the candidate against its history, the
likely cause of a change and the change points of the series. Pure: the job reads the frame and logs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from vitreg.history.verdict import change_points
from vitreg.history.series import CAUSES, HARDWARE, MISSING, CheckError, Selection, Series, honest, require_tags, series_of
from vitreg.history.verdict import IMPROVED, REGRESSED, VERDICTS, judge
from vitreg.measure.metrics import BY_NAME, HIGHER, LOWER

EXIT_OK, EXIT_REGRESSED = 0, 1  # bad input is VitregError's exit code, 2


@dataclass
class CheckResult:
    """What a check found: ``table`` has one row per series (its configuration and GPU, the verdict and
    its figures, the runs compared, what changed); ``series`` the runs behind each row, same order."""

    metric: str
    higher: bool
    selection: Selection
    table: pd.DataFrame
    series: list[Series]
    changes: list[list[int]]  # change points of each series (positions in its runs)
    n_mislabelled: int = 0
    labels: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> pd.DataFrame:
        return self.table[self.table["verdict"] == REGRESSED]

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSED if len(self.regressions) else EXIT_OK

    def counts(self) -> dict[str, int]:
        return {v: int((self.table["verdict"] == v).sum()) for v in VERDICTS}

    def run_ids(self) -> list[str]:
        """Every run the check read (candidates and histories), oldest first."""
        ids = [i for s in self.series for i in (*s.history["run_id"], *s.candidate["run_id"])]
        return list(dict.fromkeys(ids))

    def ordered(self) -> pd.DataFrame:
        """The table, regressions first, then improvements, then the rest."""
        order = self.table["verdict"].map({REGRESSED: 0, IMPROVED: 1}).fillna(2)
        return self.table.iloc[np.argsort(order.to_numpy(), kind="stable")]

    def lines(self) -> list[str]:
        """One line per series, regressions first: verdict, configuration, GPU, ratio and interval, runs, cause."""
        return [verdict_line(r) for _, r in self.ordered().iterrows()]


def check_runs(frame: pd.DataFrame, metric: str = "throughput_img_per_s", selection: Selection = Selection(),
               seed: int = 0) -> CheckResult:
    """Check every configuration x GPU of the tidy ``frame`` (:func:`vitreg.tracking.search.tidy`, with
    :func:`vitreg.history.series.carried_columns` carried) under ``selection``."""
    higher = _higher(metric, frame)
    require_tags(honest(frame), selection)
    series = series_of(frame, metric, selection)
    if not series:
        raise CheckError(_no_candidate(selection))
    labels = _labels([s.key for s in series])
    rows, changes = [], []
    for label, s in zip(labels, series):
        verdict = judge(s.candidate["value"], s.history["value"], higher,
                        run_cvs=pd.concat([s.history["cv"], s.candidate["cv"]]).tolist(), seed=seed)
        points = change_points(s.runs["value"].to_numpy())
        changes.append(points)
        rows.append({"series": label, **s.key, **verdict.to_dict(),
                     "cause": likely_cause(s.history, s.candidate),
                     "candidate_runs": ",".join(s.candidate["run_id"]), "history_runs": ",".join(s.history["run_id"]),
                     "change_points": ",".join(s.runs["run_id"].iloc[p] for p in points)})
    return CheckResult(metric, higher, selection, pd.DataFrame(rows), series, changes,
                       int(frame["mismatch"].astype(bool).sum()), labels)


def likely_cause(history: pd.DataFrame, candidate: pd.DataFrame) -> str:
    """``torch_version 2.8.0 -> 2.9.0; batch_chosen 256 -> 128``: the environment of the candidate where it
    differs from the history's last run ("" when nothing differs or there is no history)."""
    if history.empty:
        return ""
    before, now = history.iloc[-1], candidate.iloc[-1]
    changed = []
    for col in CAUSES:
        if col in history and _cell(before[col]) != _cell(now[col]):
            changed.append(f"{col} {_cell(before[col])} -> {_cell(now[col])}")
    return "; ".join(changed)


def _higher(metric: str, frame: pd.DataFrame) -> bool:
    declared = BY_NAME.get(metric)
    if declared is None or declared.better not in (HIGHER, LOWER) or metric not in frame:
        known = sorted(m.name for m in BY_NAME.values() if m.better in (HIGHER, LOWER) and m.name in frame)
        raise CheckError(f"metric {metric!r} cannot be checked: use one of {', '.join(known)} "
                         "(names without the infer_/train_ prefix)")
    return declared.better == HIGHER


def _no_candidate(selection: Selection) -> str:
    if selection.candidate:
        return (f"run {selection.candidate} is in no series of honest runs with the metric (a mislabelled run, or one "
                "that did not record it): pass another --candidate, or leave it out to check the newest runs")
    return "no honest run (filed under the GPU that ran it) recorded the metric: record some with `vitreg bench`"


def _labels(keys: list[dict]) -> list[str]:
    """Short names of the series: the model, then each other key that differs between the series checked."""
    varying = [k for k in keys[0] if k not in HARDWARE + ("model",) and len({d[k] for d in keys}) > 1]
    if len({(d.get("gpu"), d.get("gpu_name")) for d in keys}) > len({d.get("gpu") for d in keys}):
        varying.append("gpu_name")  # one label, two GPU models: say which (the line says the label)
    return [" ".join([d.get("model", MISSING)] + [f"{k}={d[k]}" for k in varying]) for d in keys]


def verdict_line(r) -> str:
    ratio = "-" if not np.isfinite(r["ratio"]) else f"{r['ratio']:.3f}x"
    ci = f" [{r['ci_low']:.3f}, {r['ci_high']:.3f}]" if np.isfinite(r["ci_low"]) else ""
    limit = f", threshold {r['threshold']:.1%}" if np.isfinite(r["threshold"]) else ""
    hist = r["history_runs"].split(",") if r["history_runs"] else []
    runs = f"{r['candidate_runs']} vs {len(hist)} runs" + (f" ({hist[0]}..{hist[-1]})" if hist else "")
    cause = f"; changed: {r['cause']}" if r["cause"] else ""
    return f"{r['verdict'].upper()}: {r['series']} on {r['gpu']}: {ratio}{ci}{limit}; {runs}{cause}"


def _cell(v) -> str:
    return MISSING if v is None or (not isinstance(v, str) and pd.isna(v)) else str(v)
