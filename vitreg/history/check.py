"""``vitreg check`` on a tidy runs frame. Its series: the runs of each configuration x GPU (label and model) x CPU
grant in run order, the candidate and its history (mislabelled runs never enter one); per series, the verdict, the
likely cause of a change and the change points; the report: summary.md / .html, verdicts.csv and one chart per
series (the metric in run order, the history and the candidate marked, each segment's median, git shas)."""

from __future__ import annotations

import html
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from vitreg.analysis.frame import GRANT_COLUMNS, identity_options
from vitreg.analysis.plots import figure
from vitreg.analysis.render import frame_html, frame_markdown
from vitreg.console import plural
from vitreg.errors import VitregError
from vitreg.history.verdict import (CONFIDENCE, IMPROVED, NOISE_FLOOR, REGRESSED, UNJUDGED, VERDICTS, change_points,
                                    judge, needs, segment_medians)
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


# ---------------------------------------------------------------- the report

DPI = 80
# more runs than this: every k-th run is labelled (tick labels are most of a chart's drawing time)
MAX_TICKS = 10

_SHOWN = ("series", "gpu", "verdict", "ratio", "ci_low", "ci_high", "threshold", "n_history", "candidate_runs",
          "cause", "change_points")


def write_check(result, out_dir) -> list[Path]:
    """summary.md, summary.html, verdicts.csv and series/<name>.png under ``out_dir``; returns the paths."""
    out = Path(out_dir)
    (out / "series").mkdir(parents=True, exist_ok=True)
    charts = [plot_series(result, i, out / "series" / f"{i:03d}-{_slug(label)}.png")
              for i, label in enumerate(result.labels)]
    names = [f"series/{c.name}" for c in charts]
    files = [out / "summary.md", out / "summary.html", out / "verdicts.csv"]
    files[0].write_text(summary_markdown(result, names))
    files[1].write_text(_summary_html(result, names))
    result.table.to_csv(files[2], index=False)
    return files + charts


def about(result) -> list[str]:
    """What was compared and how (the head of the summary, and the run's note)."""
    c = result.counts()
    return [f"metric `{result.metric}` ({'higher' if result.higher else 'lower'} is better); "
            f"{result.selection.describe()}.",
            f"{len(result.table)} series: " + ", ".join(f"{n} {v}" for v, n in c.items()) + "; "
            f"{result.n_mislabelled} mislabelled run rows left out.",
            f"A verdict needs the {CONFIDENCE:.0%} bootstrap interval of the ratio to exclude 1 and the change to "
            f"exceed the threshold (the configuration's own spread, never below {NOISE_FLOOR:.0%})."]


def summary_markdown(result, charts: list[str]) -> str:
    lines = ["# vitreg check", "", *about(result), "", *[f"- {line}" for line in result.lines()], "",
             frame_markdown(result.table.filter(items=_SHOWN)), ""]
    for label, chart in zip(result.labels, charts):
        lines += [f"## {label}", "", f"![{label}]({chart})", ""]
    return "\n".join(lines)


def _summary_html(result, charts: list[str]) -> str:
    body = "".join(f"<p>{html.escape(line)}</p>" for line in about(result))
    body += "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in result.lines()) + "</ul>"
    body += frame_html(result.table.filter(items=_SHOWN))
    body += "".join(f"<h2>{html.escape(label)}</h2><img src='{chart}' alt='{html.escape(label)}'>"
                    for label, chart in zip(result.labels, charts))
    head = "<head><meta charset='utf-8'><title>vitreg check</title></head>"
    return f"<!doctype html><html>{head}<body>{body}</body></html>"


def plot_series(result, index: int, path: Path) -> Path:
    """The chart of series ``index``: every run's value in run order, the candidate marked, its history shaded,
    each segment between change points at its median, short git shas on the x axis."""
    s, points, row = result.series[index], result.changes[index], result.table.iloc[index]
    values = s.runs["value"].to_numpy()
    x = np.arange(len(values))
    fig = figure(8, 3.6, DPI, layout=None)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.2, top=0.9)
    ax = fig.add_subplot()
    if len(s.history):
        ax.axvspan(s.history.index.min() - 0.5, s.history.index.max() + 0.5, color="0.9", label="history")
    ax.plot(x, values, "o-", color="0.35", ms=4, lw=1, label="runs")
    ax.plot(s.candidate.index, s.candidate["value"], "o", color="red" if row["verdict"] == REGRESSED else "blue",
            ms=7, label=f"candidate: {row['verdict']}")
    for start, end, median in segment_medians(values, points):
        ax.hlines(median, start - 0.4, end - 0.6, colors="orange", linestyles="--", lw=1.5)
    for p in points:
        ax.axvline(p - 0.5, color="orange", lw=1)
    step = max(1, int(np.ceil(len(x) / MAX_TICKS)))
    shas = s.runs["vitreg_git_sha"] if "vitreg_git_sha" in s.runs else [MISSING] * len(x)
    ax.set_xticks(x[::step], [str(v)[:7] for v in list(shas)[::step]], fontsize=7)
    ax.set_xlabel("run (oldest first), vitreg git sha")
    ax.set_ylabel(result.metric)
    ax.set_title(f"{row['series']} on {row['gpu']}: {row['verdict']}", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.savefig(path, pil_kwargs={"compress_level": 1})  # a chart is small either way; zlib's default is slow
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80].strip("_") or "series"
