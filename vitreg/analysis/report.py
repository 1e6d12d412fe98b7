"""The comparison as files: comparison.md / .csv / .html, the charts, and the gains and scaling CSVs."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from vitreg.analysis import plots
from vitreg.analysis.comparison import Comparison
from vitreg.analysis.frame import DEFAULT_AXIS
from vitreg.analysis.render import (by_task, caveats, cell, comparison_view, frame_html, frame_markdown, inert,
                                    markdown_table)

_CHART = "throughput_by_gpu.png"


def write_report(comparison: Comparison, out_dir) -> list[Path]:
    """The comparison as files in ``out_dir`` (returns their paths), rendered in a hidden folder there and moved
    into place only when every one succeeded: a failure replaces no file and removes the folders this call made."""
    out_dir = Path(out_dir)
    missing = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    # Same filesystem as the destination, so the final moves are atomic renames.
    tmp = Path(tempfile.mkdtemp(prefix=".vitreg-report-", dir=out_dir))
    try:
        names = _render(comparison, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in missing:  # innermost first: only the directories this call created
            try:
                p.rmdir()
            except OSError:
                break
        raise
    written = []
    try:
        for name in names:
            os.replace(tmp / name, out_dir / name)
            written.append(out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def _render(c: Comparison, d: Path) -> list[str]:
    c.table.to_csv(d / "comparison.csv", index=False)
    plots.plot_by_gpu(c, d / _CHART)
    names = ["comparison.csv", _CHART]
    if not c.gains.empty:
        c.gains.to_csv(d / "compile_amp_gains.csv", index=False)
        plots.plot_gains(c, d / "compile_amp_gains.png")
        names += ["compile_amp_gains.csv", "compile_amp_gains.png"]
    if not c.scaling.empty:
        c.scaling.to_csv(d / "scaling.csv", index=False)
        names.append("scaling.csv")
    (d / "comparison.md").write_text(_report_markdown(c, names), encoding="utf-8")
    (d / "comparison.html").write_text(_report_html(c, names), encoding="utf-8")
    return ["comparison.md", "comparison.html"] + names


def _axis(c: Comparison) -> str:
    return "GPU" if c.by == DEFAULT_AXIS else c.by


def _about(c: Comparison) -> list[str]:
    """The lines above the table, as plain text."""
    direction = "higher is better" if c.higher_is_better else "lower is better"
    s = c.summary()
    lines = [f"metric: {c.metric} (median over repeated runs, {direction})",
             f"runs: {s['n_runs']} finished runs, {s['n_configurations']} configurations, GPUs: {', '.join(c.gpus)}"
             + ("" if c.by == DEFAULT_AXIS else f", {c.by}: {', '.join(c.values)}"), *caveats(c)]
    if c.baseline:
        lines += [f"baseline: {c.baseline_label}; speedup > 1 means better than the baseline on the same configuration",
                  f"verdict: faster/slower only when the {c.confidence:.0%} bootstrap interval of the ratio of medians "
                  f"({c.n_boot} resamples, seed {c.seed}) excludes 1 and the change exceeds both sides' run-to-run "
                  "spread; 'single run' when either side ran once"]
    return lines


def _geomeans(c: Comparison) -> pd.DataFrame:
    """The geometric-mean speedups as a table; ``mismatch`` marks a value whose mean takes in mislabelled
    runs (only with include_mismatch)."""
    geo = c.geomean_speedup()
    rows = c.table[c.table["speedup"].notna()] if c.baseline else c.table.iloc[:0]
    marked = {str(v) for v in rows.loc[rows["mismatch"], c.by]}
    return pd.DataFrame({c.by: list(geo), "geomean_speedup": list(geo.values()),
                         "mismatch": [v in marked for v in geo]})


def _blocks(c: Comparison, names: list[str]) -> list[tuple[str, object]]:
    """What comparison.md and .html show, in order, as ``(kind, content)``: one table per task, the configuration
    every row of it shares on a line above it."""
    axis = _axis(c)
    out = [("h1", f"vitreg {axis} comparison"), ("ul", [line for line in _about(c) if line]),
           ("h2", f"Per configuration and {axis}")]
    for fixed, view, right in (comparison_view(c, block) for block in by_task(c.table, c.by)):
        out += [("fixed", "every row: " + ", ".join(f"{k}={cell(v)}" for k, v in fixed.items()))] if fixed else []
        out.append(("view", (view, right)))
    geo = _geomeans(c)
    out += [("h2", "Geometric-mean speedup vs baseline"), ("frame", geo)] if not geo.empty else []
    out.append(("chart", axis))
    out += [("h2", "Multi-process scaling (train)"), ("frame", c.scaling)] if not c.scaling.empty else []
    if not c.gains.empty:
        out += [("h2", "torch.compile and AMP gains"), ("frame", c.gains)]
        out += [("gains chart", None)] if "compile_amp_gains.png" in names else []
    return out


def _report_markdown(c: Comparison, names: list[str]) -> str:
    def lines(kind: str, x) -> list[str]:
        if kind == "chart":
            return [f"Chart: `{_CHART}` (median per configuration and {inert(x)}, whiskers: the runs' min..max), in "
                    "this run's artifacts:", "", f"![metric by {inert(x)}]({_CHART})"]
        return {"h1": lambda: [f"# {inert(x)}"], "h2": lambda: [f"## {inert(x)}"],
                "ul": lambda: [f"- {inert(line)}" for line in x], "fixed": lambda: [f"- {inert(x)}"],
                "view": lambda: [markdown_table(*x)], "frame": lambda: [frame_markdown(x)],
                "gains chart": lambda: ["![compile and AMP gains](compile_amp_gains.png)"]}[kind]()

    parts = [line for kind, x in _blocks(c, names) for line in [*lines(kind, x), ""]]
    return "\n".join(parts + ["Every column at full precision: `comparison.csv`.", ""])


def _report_html(c: Comparison, names: list[str]) -> str:
    def html(kind: str, x) -> list[str]:
        return {"h1": lambda: [f"<h1>{inert(x, 'html')}</h1>"], "h2": lambda: [f"<h2>{inert(x, 'html')}</h2>"],
                "ul": lambda: ["<ul>", *(f"<li>{inert(line, 'html')}</li>" for line in x), "</ul>"],
                "fixed": lambda: [f"<p>{inert(x, 'html')}</p>"],
                "view": lambda: [x[0].to_html(index=False, escape=True, border=0, na_rep="-")],
                "frame": lambda: [frame_html(x)],
                "chart": lambda: [f'<p><img src="{_CHART}" alt="metric by {inert(x, "html")}"></p>'],
                "gains chart": lambda: ['<p><img src="compile_amp_gains.png" alt="compile and AMP gains"></p>']}[kind]()

    body = [line for kind, x in _blocks(c, names) for line in html(kind, x)]
    style = ("body{font-family:sans-serif;margin:2em;max-width:1000px}table{border-collapse:collapse;"
             "font-size:90%}th,td{border:1px solid #ccc;padding:2px 8px;text-align:right}"
             "th{background:#f4f4f4}img{max-width:100%}")
    head = f"<title>vitreg {inert(_axis(c), 'html')} comparison</title><style>{style}</style>"
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\">{head}</head>\n<body>\n" + "\n".join(body) +
            "\n</body></html>\n")
