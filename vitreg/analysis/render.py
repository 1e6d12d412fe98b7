"""The comparison for people: a fixed-width terminal table, markdown and HTML tables, cell formats;
and the rows of a bench result's table.

Pure formatting over frames (:class:`vitreg.analysis.comparison.Comparison` and the bench report's
rows); the CSV keeps full precision, these show each column with one precision.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from vitreg.analysis.frame import CONFIG_KEYS, DEFAULT_AXIS
from vitreg.measure.metrics import REPORT_COLUMNS

#: the bench report's results table (report.md, the terminal, the run's note): one row per task
RESULT_HEADERS = ["task", "batch"] + [col.header for col in REPORT_COLUMNS]


def format_table(comparison) -> str:
    """The comparison as fixed-width, aligned text for a terminal.

    Configuration keys that are the same on every row move to a header line so the table only
    shows what varies; exact values are in the CSV written by :func:`vitreg.analysis.report.write_report`.
    Mislabelled runs get a "ran on" column and a warning line that says what was done with them.
    """
    t = comparison.table
    m = comparison.metric
    by = comparison.by
    fixed, varying = split_constant(t, [k for k in (*CONFIG_KEYS, "gpu") if k != by])
    direction = "higher is better" if comparison.higher_is_better else "lower is better"
    lines = [f"metric: {m} (median over runs, {direction})"]
    if comparison.baseline:
        lines.append(
            f"baseline: {comparison.baseline_label}; speedup >1 = better than baseline; "
            f"{comparison.confidence:.0%} bootstrap CI ({comparison.n_boot} resamples)"
        )
    lines += caveats(comparison)
    if fixed:
        lines.append("fixed: " + " ".join(f"{k}={cell(v)}" for k, v in fixed.items()))
    marked = bool(t["mismatch"].any())
    cols = varying + [by] + (["ran_on"] if marked else [])
    cols += ["batch_chosen"] if t["batch_chosen"].notna().any() else []  # batch_size=auto runs
    cols += ["shared_host"] if "shared_host" in t and (t["shared_host"] > 1).any() else []  # sweep children at once
    cols += ["n_runs", f"{m}_median", f"{m}_min", f"{m}_max", f"{m}_cv"]
    heads = {f"{m}_median": "median", f"{m}_min": "min", f"{m}_max": "max", f"{m}_cv": "cv",
             "n_runs": "n", "batch_size": "batch", "img_size": "img", "ran_on": "ran on",
             "batch_chosen": "batch chosen", "shared_host": "shared host"}
    body = _rows(t, cols)
    if marked:  # the hardware of honest rows is their label: leave the cell blank, flag the others
        for row, mismatch in zip(body, t["mismatch"]):
            row[cols.index("ran_on")] = f"{row[cols.index('ran_on')]} (!)" if mismatch else ""
    header = [heads.get(c, c) for c in cols]
    right = [c not in ("model", "task", "amp", "compile", "gpu", "ran_on", by) for c in cols]
    if comparison.baseline:
        header += ["speedup", f"{comparison.confidence:.0%} CI", "verdict"]
        right += [True, True, False]
        for row, (_, r) in zip(body, t.iterrows()):
            row += [format_value("speedup", r["speedup"]), _format_ci(r["ci_low"], r["ci_high"]),
                    str(r["verdict"])]
    lines.append(_fixed_width(header, body, right))
    if not comparison.scaling.empty:
        lines += ["", "scaling (train, weak scaling vs nproc=1):", _scaling_table(comparison.scaling, heads)]
    return "\n".join(lines)


def caveats(comparison) -> list[str]:
    """How to read the rows beyond metric and baseline: the axis when it is not the GPU, and what was
    done with mislabelled runs (the terminal's header lines; the reports' list items)."""
    c = comparison
    lines = []
    if c.by != DEFAULT_AXIS:
        lines.append(f"compared along: {c.by} (runs that differ only in {c.by}: same GPU and configuration)")
    bad = c.mislabelled
    if len(bad):
        filed = ", ".join(sorted({f"{g} (ran on {cell(r)})" for g, r in zip(bad["gpu"], bad["ran_on"])}))
        what = ("included as asked (include_mismatch=true): their speedups are NOT their label's"
                if c.include_mismatch else
                "left out of speedups and verdicts (include_mismatch=true compares them anyway)")
        lines.append(f"MISLABELLED (!): {int(bad['n_runs'].sum())} run(s) filed under a GPU that did not run "
                     f"them: {filed}; {what}")
    return lines


def _scaling_table(s: pd.DataFrame, heads: dict) -> str:
    scols = split_constant(s, ["model", "amp", "compile", "batch_size", "img_size"])[1]
    scols += ["gpu"] + (["mismatch"] if s["mismatch"].any() else [])
    scols += ["nproc", "ddp", "n_runs", s.columns[-3], "speedup_vs_1", "efficiency"]
    return _fixed_width(
        [heads.get(c, c if c != s.columns[-3] else "median") for c in scols],
        _rows(s, scols),
        [c not in ("model", "amp", "compile", "gpu", "ddp", "mismatch") for c in scols],
    )


def _rows(df: pd.DataFrame, cols: list[str]) -> list[list[str]]:
    """Formatted cells of ``df[cols]``, row-major."""
    formatted = [format_column(c, df[c].astype(object)) for c in cols]
    return [list(r) for r in zip(*formatted)] if formatted else []


def split_constant(t: pd.DataFrame, keys) -> tuple[dict, list[str]]:
    fixed, varying = {}, []
    for k in keys:
        vals = t[k].astype(object).where(t[k].notna(), None).unique() if len(t) else []
        if len(t) > 1 and len(vals) == 1 and k != "model":
            fixed[k] = vals[0]
        else:
            varying.append(k)
    return fixed, varying


def _fixed_width(header: list[str], body: list[list[str]], right: list[bool]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]

    def line(cells):
        out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule] + [line(r) for r in body])


def cell(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA else str(v)


def format_column(col: str, values) -> list[str]:
    """Format a whole column with one precision, so digits line up (1,012 next to 994, not 994.0)."""
    vals = list(values)
    nums = [float(v) for v in vals if isinstance(v, (float, np.floating)) and not math.isnan(v)]
    plain = not (col.endswith(("_cv", "_spread", "mfu")) or col in _RATIO_COLUMNS
                 or col == "efficiency" or col in _COUNT_COLUMNS)
    if not nums or not plain:
        return [format_value(col, v) for v in vals]
    scale = max(abs(x) for x in nums)
    spec = ",.0f" if scale >= 1000 else ".1f" if scale >= 100 else ".2f" if scale >= 1 else ".3g"
    out = []
    for v in vals:
        if isinstance(v, (float, np.floating)) and not math.isnan(v):
            out.append(format(float(v), spec))
        else:
            out.append(format_value(col, v))
    return out


_RATIO_COLUMNS = ("speedup", "ci_low", "ci_high", "speedup_vs_1", "geomean_speedup")
_COUNT_COLUMNS = ("n_runs", "n_base", "n_new", "nproc", "batch_size", "img_size", "world_size")


def format_value(col: str, v) -> str:
    """Human formatting of one cell; the CSV keeps full precision."""
    if v is None or v is pd.NA or (isinstance(v, (float, np.floating)) and math.isnan(v)):
        return "-"
    if col == "mismatch":  # the mark of a mislabelled run; honest rows stay quiet
        return "MISLABELLED" if v else ""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        return str(v)
    if col.endswith("_cv") or col.endswith("_spread") or col == "efficiency":
        return f"{v * 100:.1f}%"
    if col in _RATIO_COLUMNS:
        return f"{v:.2f}x"
    if col.endswith("mfu"):
        return f"{v:.3f}"
    if isinstance(v, (int, np.integer)) or (float(v).is_integer() and col in _COUNT_COLUMNS):
        return str(int(v))
    a = abs(float(v))
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _format_ci(lo, hi) -> str:
    if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
        return "-"
    return f"[{lo:.2f}, {hi:.2f}]"


def display(df: pd.DataFrame) -> pd.DataFrame:
    """A string copy of ``df`` with every cell formatted for humans (markdown, HTML)."""
    out = pd.DataFrame(index=df.index)
    for c in df.columns:
        out[c] = format_column(c, df[c].astype(object))
    return out


def readable(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without columns nobody recorded (all NaN); the CSV keeps the full schema."""
    return df.loc[:, [c for c in df.columns if not df[c].isna().all()]] if len(df) else df


def markdown_table(df: pd.DataFrame, right: list[bool] | None = None) -> str:
    """``df``'s cells as they are, as a GitHub-flavoured markdown table (``DataFrame.to_markdown``);
    ``right`` right-aligns those columns. Pipes in cells are escaped, so a cell stays one cell."""
    def esc(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    shown = pd.DataFrame([[esc(v) for v in r] for r in df.itertuples(index=False)],
                         columns=[esc(c) for c in df.columns])
    align = None if right is None else ["right" if r else "left" for r in right]
    return shown.to_markdown(index=False, disable_numparse=True, colalign=align)


def frame_markdown(df: pd.DataFrame) -> str:
    """A result frame as markdown: recorded columns only, formatted for humans, numbers right-aligned."""
    if df.empty:
        return "_(none)_"
    df = readable(df)
    return markdown_table(display(df), [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
                                        for c in df.columns])


def frame_html(df: pd.DataFrame) -> str:
    """A result frame as an HTML table, recorded columns only, formatted like :func:`frame_markdown`."""
    return display(readable(df)).to_html(index=False, escape=True, border=0, na_rep="-")


def result_rows(tasks) -> list[list[str]]:
    """The cells of :data:`RESULT_HEADERS`, one row per task of a bench result. ``tasks``: dicts with
    ``task``, ``batch_size`` and ``metrics`` (``<task>_``-prefixed names), as results.json holds them."""
    rows = []
    for t in tasks:
        prefix = f"{t['task']}_"
        values = {k[len(prefix):]: v for k, v in t["metrics"].items() if k.startswith(prefix)}
        rows.append([t["task"], str(t["batch_size"])] + [col.render(t["task"], values) for col in REPORT_COLUMNS])
    return rows
