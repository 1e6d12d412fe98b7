"""The comparison for people: a fixed-width terminal table, markdown and HTML tables, cell formats; and the rows of
a bench result's table. The CSV keeps full precision; these show each column with one precision."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import pandas as pd

from vitreg.analysis.frame import (DEFAULT_AXIS, GRANT_COLUMNS, NOT_APPLICABLE, SCALED_COLUMNS, config_columns,
                                   group_columns)
from vitreg.measure.metrics import BY_NAME, REPORT_COLUMNS

#: the bench report's results table (report.md, the terminal, the run's note): one row per task
RESULT_HEADERS = ["task", "batch"] + [col.header for col in REPORT_COLUMNS]


def format_table(comparison) -> str:
    """The comparison as aligned text for a terminal: one table per task (:func:`by_task`), the configuration
    every row of it shares on a line above it, so a table shows only what varies within its task."""
    m = comparison.metric
    direction = "higher is better" if comparison.higher_is_better else "lower is better"
    lines = [f"metric: {m} (median over runs, {direction})"]
    if comparison.baseline:
        lines.append(
            f"baseline: {comparison.baseline_label}; speedup >1 = better than baseline; "
            f"{comparison.confidence:.0%} bootstrap CI ({comparison.n_boot} resamples)"
        )
    lines += caveats(comparison)
    for n, block in enumerate(by_task(comparison.table, comparison.by)):
        lines += ([""] if n else []) + _task_table(comparison, block)
    if not comparison.scaling.empty:
        lines += ["", "scaling (train, weak scaling vs nproc=1):", _scaling_table(comparison.scaling)]
    return "\n".join(lines)


def by_task(t: pd.DataFrame, axis: str = DEFAULT_AXIS) -> list[pd.DataFrame]:
    """The rows of ``t`` one task at a time (a task's configuration columns are its own: ``clip_grad`` is a
    training option); all rows at once when the comparison goes along ``task`` itself."""
    if axis == "task" or "task" not in t or t["task"].nunique(dropna=False) < 2:
        return [t]
    return [t[t["task"] == task] for task in sorted(t["task"].unique())]


_HEADS = {"n_runs": "n", "batch_size": "batch", "img_size": "img", "ran_on": "ran on",
          "batch_chosen": "batch chosen", "shared_host": "shared host", "shared_node": "shared node",
          "cpus_granted": "cpus", "torch_threads": "threads"}


def _task_table(comparison, t: pd.DataFrame) -> list[str]:
    """The terminal lines of one task's rows: the configuration they share, then the table of the rest."""
    m, by = comparison.metric, comparison.by
    fixed, varying = split_constant(t, shown_keys(t, by))
    cols = varying + [by] + (["ran_on"] if t["mismatch"].any() else [])
    cols += ["batch_chosen"] if t["batch_chosen"].notna().any() else []  # batch_size=auto runs
    cols += ["shared_host"] if "shared_host" in t and (t["shared_host"] > 1).any() else []  # sweep children at once
    cols += ["shared_node"] if "shared_node" in t and t["shared_node"].notna().any() else []  # share_node=true
    cols += ["n_runs", f"{m}_median", f"{m}_min", f"{m}_max", f"{m}_cv"]
    cols += ["speedup", "ci", "verdict"] if comparison.baseline else []
    cols += ["flags"] if "flags" in t and t["flags"].notna().any() else []  # on the row that prints it
    heads = {f"{m}_median": "median", f"{m}_min": "min", f"{m}_max": "max", f"{m}_cv": "cv",
             "ci": f"{comparison.confidence:.0%} CI", **_HEADS}
    right = [c not in (*_text_keys(), "gpu", "ran_on", "verdict", "flags", by) for c in cols]
    table = fixed_width([heads.get(c, c) for c in cols], _cells(t, cols, "(!)").values.tolist(), right)
    return (["fixed: " + " ".join(f"{k}={cell(v)}" for k, v in fixed.items())] if fixed else []) + [table]


def _cells(t: pd.DataFrame, cols: list[str], mark: str) -> pd.DataFrame:
    """``t[cols]`` as text (``ci``: the interval), ``ran_on`` blank on honest rows (their hardware is their label)
    and ``mark``-ed on mislabelled ones."""
    if "ci" in cols:
        t = t.assign(ci=[_format_ci(lo, hi) for lo, hi in zip(t["ci_low"], t["ci_high"])])
    view = display(t[cols])
    if "ran_on" in view:
        view["ran_on"] = [f"{r} {mark}" if bad else "" for r, bad in zip(view["ran_on"], t["mismatch"])]
    return view


_RUN_HEADS = {"run_id": "id", "start_time": "started (UTC)", "infer_img_per_s": "infer img/s",
              "train_img_per_s": "train img/s"}
NAME_WIDTH = 34  # a run's name is long (its figures, precision, batch...): the table keeps what tells runs apart


def runs_table(runs: pd.DataFrame) -> str:
    """``vitreg runs``' table of :func:`vitreg.tracking.search.run_list`'s rows (the experiment only when they are
    of several, each task's img/s only where some row measured it)."""
    cols = ["run_id", "start_time"] + (["experiment"] if runs["experiment"].nunique() > 1 else [])
    cols += ["name", "status", "gpu"] + [c for c in runs if c.endswith("_img_per_s") and runs[c].notna().any()]
    cols += ["flags"] if (runs["flags"] != "").any() else []
    started = pd.to_datetime(runs["start_time"], utc=True, errors="coerce").dt.strftime("%Y-%m-%d %H:%M")
    names = runs["name"].map(lambda n: n if len(n) <= NAME_WIDTH else n[:NAME_WIDTH - 1] + "…")
    body = display(runs.assign(start_time=started, name=names)[cols]).values.tolist()
    return fixed_width([_RUN_HEADS.get(c, c) for c in cols], body, [c.endswith("_img_per_s") for c in cols])


def caveats(comparison) -> list[str]:
    """How to read the rows beyond metric and baseline: the axis when it is not the GPU, and what was done with
    mislabelled runs."""
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


def _scaling_table(s: pd.DataFrame) -> str:
    cols = split_constant(s, [k for k in shown_keys(s, "gpu") if k not in ("task", *SCALED_COLUMNS)])[1]
    cols += ["gpu"] + (["mismatch"] if s["mismatch"].any() else [])
    cols += ["nproc", "ddp", "n_runs", s.columns[-3], "speedup_vs_1", "efficiency"]
    heads = [_HEADS.get(c, c if c != s.columns[-3] else "median") for c in cols]
    return fixed_width(heads, display(s[cols]).values.tolist(),
                       [c not in (*_text_keys(), "gpu", "ddp", "mismatch") for c in cols])


def _text_keys() -> tuple[str, ...]:
    """The configuration columns shown left-aligned: all but the counts."""
    return tuple(k for k in config_columns() if k not in _COUNT_COLUMNS)


def shown_keys(t: pd.DataFrame, by: str) -> list[str]:
    """The keys the rows ``t`` are told apart by, less a grant no row recorded (runs that predate ``cpus_granted``:
    their tables read as before)."""
    return [k for k in group_columns(by) if k not in GRANT_COLUMNS or t[k].notna().any()]


def split_constant(t: pd.DataFrame, keys, min_rows: int = 2) -> tuple[dict, list[str]]:
    """``keys`` split into those with one value on every row of ``t`` (``{key: value}``, shown once above a table,
    never ``model``; none under ``min_rows`` rows) and those that vary (its columns). A key no row's command takes
    (all :data:`~vitreg.analysis.frame.NOT_APPLICABLE`) is in neither: unused options cost a reader nothing."""
    fixed, varying = {}, []
    for k in keys:
        vals = t[k].astype(object).where(t[k].notna(), None).unique() if len(t) else []
        if len(t) and all(isinstance(v, str) and v == NOT_APPLICABLE for v in vals):
            continue
        if len(t) >= min_rows and len(vals) == 1 and k != "model":
            fixed[k] = vals[0]
        else:
            varying.append(k)
    return fixed, varying


def fixed_width(header: list[str], body: list[list[str]], right: list[bool]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]

    def line(cells):
        out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule] + [line(r) for r in body])


def cell(v) -> str:
    """A configuration value in a line of text: ``-`` where none was recorded, ``none`` for an empty setting
    (``teacher=""``: no teacher; quotes would read as a stray ``"``)."""
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return "-"
    return str(v) if str(v) != "" else "none"


def format_column(col: str, values) -> list[str]:
    """Format a whole column with one precision, so digits line up (1,012 next to 994, not 994.0)."""
    vals = list(values)
    nums = [abs(float(v)) for v in vals if _number(v)]
    plain = not (col.endswith(("_cv", "_spread", "mfu")) or col in (*_RATIO_COLUMNS, *_COUNT_COLUMNS, "efficiency"))
    scale = max(nums) if nums and plain else None
    return [format(float(v), _magnitude(scale)) if scale is not None and _number(v) else format_value(col, v)
            for v in vals]


def _number(v) -> bool:
    return isinstance(v, (float, np.floating)) and not math.isnan(v)


def _magnitude(a: float) -> str:
    """The format of a figure of about ``a``: no decimals from 1,000 on, three significant digits below 1."""
    return ",.0f" if a >= 1000 else ".1f" if a >= 100 else ".2f" if a >= 1 else ".3g"


_RATIO_COLUMNS = ("speedup", "ci_low", "ci_high", "speedup_vs_1", "geomean_speedup")
_COUNT_COLUMNS = ("n_runs", "n_base", "n_new", "nproc", "batch_size", "img_size", "world_size", *GRANT_COLUMNS)


def format_value(col: str, v) -> str:
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
    return format(v, _magnitude(abs(float(v))))


def _format_ci(lo, hi) -> str:
    return "-" if pd.isna(lo) or pd.isna(hi) else f"[{lo:.2f}, {hi:.2f}]"


def display(df: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({c: format_column(c, df[c].astype(object)) for c in df.columns}, index=df.index)


def readable(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without columns nobody recorded (all NaN); the CSV keeps the full schema."""
    return df.dropna(axis=1, how="all") if len(df) else df


_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*\[\]|~])")  # code spans, emphasis, links, table cells, strikeouts
_LONE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")  # emphasis; deit_small_patch16 stays as is
_LINE_START = re.compile(r"^([#+\-]+(?=\s|$)|[>=])")  # a heading, list item, rule, quote or setext underline
_NUMBERED = re.compile(r"^(\d+)([.)])(?=\s|$)")  # a numbered list item


def inert(text, to: str = "markdown") -> str:
    """``text`` (anything a user typed) shown as written and doing nothing where it goes: ``to="markdown"`` (a
    heading or list item), ``"cell"`` (a markdown table cell) or ``"html"``. One line (a newline could open a
    fence, a heading or a list); in markdown ``&<>`` become entities and what opens code, emphasis, links, cells
    or, at a line's start, a block is backslash-escaped."""
    line = " ".join(str(text).splitlines()).strip()
    if to == "html":
        return html.escape(line)
    line = _MARKDOWN_PUNCTUATION.sub(r"\\\1", html.escape(line, quote=False))
    line = _LONE_UNDERSCORE.sub(r"\\_", line)
    if to == "cell":
        return line
    return _NUMBERED.sub(r"\1\\\2", _LINE_START.sub(r"\\\1", line))


def code_block(text: str) -> str:
    """``text`` as a fenced markdown code block that it cannot close: the fence is longer than any run of
    backticks in it (CommonMark closes a fence only with one at least as long)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def markdown_table(df: pd.DataFrame, right: list[bool] | None = None) -> str:
    """``df``'s cells as a GitHub-flavoured markdown table, every cell and header through :func:`inert`;
    ``right`` right-aligns those columns."""
    shown = pd.DataFrame([[inert(v, "cell") for v in r] for r in df.itertuples(index=False)],
                         columns=[inert(c, "cell") for c in df.columns])
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


def comparison_view(c, t: pd.DataFrame) -> tuple[dict, pd.DataFrame, list[bool]]:
    """The rows ``t`` of comparison ``c`` as comparison.md / .html show them: the configuration every row shares
    (``{column: value}``), the table as text (the axis value, the median, the ratio and the verdict lead: the
    MLflow UI's preview shows a table's first columns) and which of its columns are right-aligned."""
    m = c.metric
    fixed, varying = split_constant(t, shown_keys(t, c.by), min_rows=1)
    cols = [c.by, f"{m}_median"] + (["speedup", "verdict", "ci"] if c.baseline else [])
    cols += varying + ["n_runs", f"{m}_cv"] + (["ran_on"] if t["mismatch"].any() else [])
    cols += ["batch_chosen"] if t["batch_chosen"].notna().any() else []
    cols += ["flags"] if "flags" in t and t["flags"].notna().any() else []
    view = _cells(t, cols, "(MISLABELLED)")
    unit = BY_NAME[m].unit if m in BY_NAME else ""
    heads = {**_HEADS, f"{m}_median": f"{m} median" + (f" ({unit})" if unit else ""), "n_runs": "runs",
             f"{m}_cv": "cv", "speedup": f"vs {c.baseline_label}", "ci": f"{c.confidence:.0%} CI"}
    right = [col not in (*_text_keys(), "gpu", "verdict", "ran_on", c.by) for col in view.columns]
    return fixed, view.rename(columns=heads).reset_index(drop=True), right


def result_rows(tasks) -> list[list[str]]:
    """The cells of :data:`RESULT_HEADERS`, one row per task of a bench result (``tasks`` as results.json holds
    them)."""
    rows = []
    for t in tasks:
        prefix = f"{t['task']}_"
        values = {k[len(prefix):]: v for k, v in t["metrics"].items() if k.startswith(prefix)}
        rows.append([t["task"], str(t["batch_size"])] + [col.render(t["task"], values) for col in REPORT_COLUMNS])
    return rows
