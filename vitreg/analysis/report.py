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
from vitreg.analysis.render import caveats, cell, comparison_views, frame_html, frame_markdown, inert, markdown_table


def write_report(comparison: Comparison, out_dir) -> list[Path]:
    """Write the comparison as files in ``out_dir`` and return their paths.

    Always ``comparison.md``, ``comparison.csv`` (exactly ``comparison.table``, full precision),
    ``comparison.html`` and ``throughput_by_gpu.png`` (grouped bars of the metric's median per
    configuration and GPU, error bars spanning the runs' min..max); ``compile_amp_gains.png`` /
    ``compile_amp_gains.csv`` when compile or AMP variants can be paired, ``scaling.csv`` when
    multi-process train runs exist.

    Files are rendered into a hidden temporary directory inside ``out_dir`` and moved into place
    only when all of them succeeded, so a failure leaves no half-written report behind: existing
    files of the same name are replaced only on success, and directories this call created are
    removed again.
    """
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
    names = []
    c.table.to_csv(d / "comparison.csv", index=False)
    names.append("comparison.csv")
    plots.plot_by_gpu(c, d / "throughput_by_gpu.png")
    names.append("throughput_by_gpu.png")
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
    """The lines above the table, as plain text (each goes out through :func:`inert`)."""
    direction = "higher is better" if c.higher_is_better else "lower is better"
    s = c.summary()
    lines = [
        f"metric: {c.metric} (median over repeated runs, {direction})",
        f"runs: {s['n_runs']} finished runs, {s['n_configurations']} configurations, "
        f"GPUs: {', '.join(c.gpus)}" + ("" if c.by == DEFAULT_AXIS else f", {c.by}: {', '.join(c.values)}"),
        *caveats(c),
    ]
    if c.baseline:
        lines += [
            f"baseline: {c.baseline_label}; speedup > 1 means better than the baseline on the same "
            "configuration",
            f"verdict: faster/slower only when the {c.confidence:.0%} bootstrap interval of the "
            f"ratio of medians ({c.n_boot} resamples, seed {c.seed}) excludes 1 and the change "
            "exceeds both sides' run-to-run spread; 'single run' when either side ran once",
        ]
    return lines


def _same_everywhere(fixed: dict) -> str:
    """The configuration every row shares, as one line above the table."""
    return "every row: " + ", ".join(f"{k}={cell(v)}" for k, v in fixed.items()) if fixed else ""


def _geomeans(c: Comparison) -> pd.DataFrame:
    """The geometric-mean speedups as a table; ``mismatch`` marks a value whose mean takes in mislabelled
    runs (only with include_mismatch)."""
    geo = c.geomean_speedup()
    rows = c.table[c.table["speedup"].notna()] if c.baseline else c.table.iloc[:0]
    marked = {str(v) for v in rows.loc[rows["mismatch"], c.by]}
    return pd.DataFrame({c.by: list(geo), "geomean_speedup": list(geo.values()),
                         "mismatch": [v in marked for v in geo]})


_CHART = "throughput_by_gpu.png"


def _report_markdown(c: Comparison, names: list[str]) -> str:
    """comparison.md: the GPU, the figure with its unit, the ratio and the verdict lead the first table (the
    MLflow UI's preview shows a table's first columns); one table per task, the configuration every row of
    it shares a line above it, not columns; every user string goes out through :func:`inert`."""
    parts = [f"# vitreg {inert(_axis(c))} comparison", ""]
    parts += [f"- {inert(line)}" for line in _about(c) if line]
    parts += ["", f"## Per configuration and {inert(_axis(c))}", ""]
    for fixed, view, right in comparison_views(c):
        parts += [f"- {inert(_same_everywhere(fixed))}", ""] if fixed else []
        parts += [markdown_table(view, right), ""]
    geo = _geomeans(c)
    if not geo.empty:
        parts += ["## Geometric-mean speedup vs baseline", "", frame_markdown(geo), ""]
    parts += [f"Chart: `{_CHART}` (median per configuration and {inert(_axis(c))}, whiskers: the runs' "
              "min..max), in this run's artifacts:", "", f"![metric by {inert(_axis(c))}]({_CHART})", ""]
    if not c.scaling.empty:
        parts += ["## Multi-process scaling (train)", "", frame_markdown(c.scaling), ""]
    if not c.gains.empty:
        parts += ["## torch.compile and AMP gains", "", frame_markdown(c.gains), ""]
        if "compile_amp_gains.png" in names:
            parts += ["![compile and AMP gains](compile_amp_gains.png)", ""]
    parts += ["Every column at full precision: `comparison.csv`.", ""]
    return "\n".join(parts)


def _report_html(c: Comparison, names: list[str]) -> str:
    """comparison.html, laid out like comparison.md: the shared configuration above a table of the varying
    columns only, so the table stays narrow (GPU, figure, ratio and verdict in view without scrolling)."""
    axis = inert(_axis(c), "html")
    body = [f"<h1>vitreg {axis} comparison</h1>", "<ul>"]
    body += [f"<li>{inert(line, 'html')}</li>" for line in _about(c) if line]
    body += ["</ul>", f"<h2>Per configuration and {axis}</h2>"]
    for fixed, view, _ in comparison_views(c):
        body += [f"<p>{inert(_same_everywhere(fixed), 'html')}</p>"] if fixed else []
        body.append(view.to_html(index=False, escape=True, border=0, na_rep="-"))
    geo = _geomeans(c)
    if not geo.empty:
        body += ["<h2>Geometric-mean speedup vs baseline</h2>", frame_html(geo)]
    body.append(f'<p><img src="{_CHART}" alt="metric by {axis}"></p>')
    if not c.scaling.empty:
        body += ["<h2>Multi-process scaling (train)</h2>", frame_html(c.scaling)]
    if not c.gains.empty:
        body += ["<h2>torch.compile and AMP gains</h2>", frame_html(c.gains)]
        if "compile_amp_gains.png" in names:
            body.append('<p><img src="compile_amp_gains.png" alt="compile and AMP gains"></p>')
    style = ("body{font-family:sans-serif;margin:2em;max-width:1000px}table{border-collapse:collapse;"
             "font-size:90%}th,td{border:1px solid #ccc;padding:2px 8px;text-align:right}"
             "th{background:#f4f4f4}img{max-width:100%}")
    head = f"<title>vitreg {axis} comparison</title><style>{style}</style>"
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\">{head}</head>\n<body>\n" + "\n".join(body) +
            "\n</body></html>\n")
