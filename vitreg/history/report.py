"""A check's summary (markdown, HTML, CSV) and one chart per series: the metric in run order, the history
window and the candidate marked, the change points and each segment's median, git shas on the axis."""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np

from vitreg.analysis.plots import figure
from vitreg.analysis.render import frame_html, frame_markdown
from vitreg.history.check import MISSING
from vitreg.history.verdict import CONFIDENCE, NOISE_FLOOR, REGRESSED, segment_medians

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
