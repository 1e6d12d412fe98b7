"""``vitreg check`` on a tidy runs frame. Its series: the runs of each configuration x GPU (label and model) x CPU
grant in run order, the candidate and its history (mislabelled runs never enter one); per series, the verdict, the
likely cause of a change and the change points."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from vitreg.analysis.frame import GRANT_COLUMNS, identity_options
from vitreg.console import plural
from vitreg.errors import VitregError
from vitreg.history.verdict import IMPROVED, REGRESSED, UNJUDGED, VERDICTS, change_points, judge, needs
from vitreg.measure.energy import slowed
from vitreg.measure.metrics import BY_NAME, HIGHER, LOWER

HARDWARE = ("gpu", "gpu_name")
# The environment fingerprint (tags every run carries) that can explain a change, then the batch that
# batch_size=auto chose (the tidy frame's batch_chosen, from the <task>_batch_size_chosen tag).
ENVIRONMENT = ("torch_version", "cuda_version", "cudnn_version", "driver_version", "timm_version", "vitreg_git_sha")
CAUSES = ENVIRONMENT + ("batch_chosen",)
# What the timed windows met (tidy frame columns): a change of these is the GPU's or the host's, not the code's
CONDITIONS = ("throttle", "busy_host", "sm_clock_mhz")
DEFAULT_WINDOW = 10
MISSING = "-"  # a key nobody recorded (a run that predates the option)
# bad input is VitregError's exit code, 2; EXIT_CANNOT_JUDGE: nothing regressed, but some series has too little
# or too noisy a history to say so (each such line says what it needs): a CI gate must not read that as a pass
EXIT_OK, EXIT_REGRESSED, EXIT_CANNOT_JUDGE = 0, 1, 3
# An SM clock this much under the history's median: the GPU ran slower (heat, a cap, another tenant's load)
CLOCK_DROP = 0.03


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
        if len(self.regressions):
            return EXIT_REGRESSED
        return EXIT_CANNOT_JUDGE if self.table["verdict"].isin(UNJUDGED).any() else EXIT_OK

    def counts(self) -> dict[str, int]:
        return {v: int((self.table["verdict"] == v).sum()) for v in VERDICTS}

    def run_ids(self) -> list[str]:
        """Every run the check read (candidates and histories)."""
        ids = [i for s in self.series for i in (*s.history["run_id"], *s.candidate["run_id"])]
        return list(dict.fromkeys(ids))

    def ordered(self) -> pd.DataFrame:
        """The table, regressions first, then improvements, then the rest."""
        order = self.table["verdict"].map({REGRESSED: 0, IMPROVED: 1}).fillna(2)
        return self.table.iloc[np.argsort(order.to_numpy(), kind="stable")]

    def lines(self) -> list[str]:
        return [verdict_line(r) for _, r in self.ordered().iterrows()]


def check_runs(frame: pd.DataFrame, metric: str = "throughput_img_per_s", selection: Selection = Selection(),
               seed: int = 0) -> CheckResult:
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
        rows.append({"series": label, **s.key, **asdict(verdict), "needs": needs(verdict),
                     "cause": likely_cause(s.history, s.candidate), "conditions": conditions(s.history, s.candidate),
                     "candidate_runs": ",".join(s.candidate["run_id"]), "history_runs": ",".join(s.history["run_id"]),
                     "change_points": ",".join(s.runs["run_id"].iloc[p] for p in points)})
    return CheckResult(metric, higher, selection, pd.DataFrame(rows), series, changes,
                       int(frame["mismatch"].astype(bool).sum()), labels)


def likely_cause(history: pd.DataFrame, candidate: pd.DataFrame) -> str:
    """``torch_version 2.8.0 -> 2.9.0; batch_chosen 256 -> 128``: where the candidate's environment differs from
    the history's last run's."""
    if history.empty:
        return ""
    before, now = history.iloc[-1].map(cell_text), candidate.iloc[-1].map(cell_text)
    changed = [col for col in CAUSES if col in history and before[col] != now[col]]
    return "; ".join(f"{col} {before[col]} -> {now[col]}" for col in changed)


def conditions(history: pd.DataFrame, candidate: pd.DataFrame) -> str:
    """``throttled: hw_thermal (history: sw_power_cap); SM clock 1,500 MHz (history 1,740)``: what the candidate's
    timed windows met where the history's did not ("" when nothing differs); the power cap only where the
    history held it differently (an H200 under ViT-B sits at its cap in every sample)."""
    now, said = candidate.iloc[-1], []
    throttle, usual = cell_text(now.get("throttle")), _usual(history.get("throttle"))
    if throttle != MISSING and ((usual not in (None, throttle)) or slowed(throttle)):
        said.append(f"throttled: {throttle}" + (f" (history: {usual})" if usual not in (None, throttle) else ""))
    clock, past = now.get("sm_clock_mhz"), pd.to_numeric(history.get("sm_clock_mhz"), errors="coerce")
    if past is not None and pd.notna(clock) and past.notna().any() and clock < past.median() * (1 - CLOCK_DROP):
        said.append(f"SM clock {clock:,.0f} MHz (history {past.median():,.0f})")
    if cell_text(now.get("busy_host")) == "true" and _usual(history.get("busy_host")) != "true":
        said.append("busy host (other processes used the CPUs during the timed windows)")
    return "; ".join(said)


def _usual(values) -> str | None:
    """The most common recorded value of a history column (None: nothing recorded)."""
    recorded = [] if values is None else [cell_text(v) for v in values if cell_text(v) != MISSING]
    return max(set(recorded), key=recorded.count) if recorded else None


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
    runs = f"{r['candidate_runs']} vs {plural(len(hist), 'run')}" + (f" ({hist[0]}..{hist[-1]})" if hist else "")
    cause = f"; changed: {r['cause']}" if r["cause"] else ""
    met = r.get("conditions") or ""
    if met:  # the GPU or the host, not the code, where the windows met what the history's did not
        cause += f"; likely cause: {met}" + (", not the code" if r["verdict"] in (REGRESSED, IMPROVED) else "")
    need = f"; {r['needs']}" if r.get("needs") else ""
    return f"{r['verdict'].upper()}: {r['series']} on {r['gpu']}: {ratio}{ci}{limit}; {runs}{cause}{need}"

