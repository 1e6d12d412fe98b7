"""The comparison's charts: the metric along the compared axis per configuration, and what compile / AMP buy;
and one run's step anatomy (``profile=true``). Matplotlib's object API with an explicit Agg canvas: no pyplot
global state, no GUI backend, the caller's matplotlib backend unchanged."""

from __future__ import annotations

import textwrap
import zlib
from pathlib import Path

import numpy as np
import pandas as pd

from vitreg.analysis.frame import DEFAULT_AXIS, MISSING, NOT_APPLICABLE, group_columns
from vitreg.analysis.render import by_task, cell, format_value, split_constant
from vitreg.hardware.profiles import PROFILES
from vitreg.measure.anatomy import CLASS_TEXT, CLASSES, FLOP_CLASSES
from vitreg.measure.metrics import BY_NAME

DPI = 110
# Above this max/min ratio a linear axis turns the small bars into slivers (ViT-Ti vs ViT-L: ~25x).
LOG_AXIS_RATIO = 30
MISLABELLED_HATCH = "//"


def figure(width: float, height: float, dpi: int = DPI, layout: str | None = "constrained"):
    """A figure on its own Agg canvas (``layout=None``: fixed margins, drawn once where a constrained one is drawn
    twice)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _wrapped(text: str, width_in: float, fontsize: float = 11) -> str:
    """``text`` broken into lines that fit ``width_in`` inches at ``fontsize`` (a character is ~0.6 em)."""
    return "\n".join(textwrap.wrap(text, max(20, int(width_in * 72 / (fontsize * 0.6)))))


def _plain_ticks(axis) -> None:
    """Tick labels as plain numbers (1,000 and 0.5, never 10^3 or 6x10^2), minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 10 else f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


_SHORT = {"batch_size": "bs", "img_size": "img", "nproc": "x"}  # bs64, img224, x2; other keys as key=value


def _varying(t: pd.DataFrame, keys: list[str]) -> dict[str, list[str]]:
    """Per task, the keys (but the model) whose values differ between its rows, and ``task`` where the rows'
    tasks differ: what a label names."""
    blocks = by_task(t)
    tasks = ["task"] if len(blocks) > 1 else []
    return {str(b["task"].iloc[0]) if "task" in b and len(b) else "": tasks + [
        k for k in split_constant(b, keys, min_rows=1)[1] if k not in ("model", "task")] for b in blocks}


def _label_bit(key: str, value) -> str:
    if key == "task":
        return str(value)
    return f"{_SHORT[key]}{cell(value)}" if key in _SHORT else f"{key}={cell(value)}"


def _config_labels(t: pd.DataFrame, keys: list[str]) -> list[str]:
    """Short labels for configurations: the keys that vary within its task, less a value that does not apply to
    the row (``-``) or was not recorded, and the task where there are several."""
    varying = _varying(t, keys)
    single_model = t["model"].nunique() == 1
    labels = []
    for _, r in t.iterrows():
        named = varying[str(r["task"]) if "task" in r and str(r["task"]) in varying else next(iter(varying))]
        bits = " ".join(_label_bit(k, r[k]) for k in named if cell(r[k]) not in (NOT_APPLICABLE, MISSING))
        labels.append(bits or str(r["model"]) if single_model else f"{r['model']}\n{bits}".strip())
    return labels


# One colour per GPU label in every chart (the comparison's bars, the energy and cost charts, any later
# compare): the GPU table's order picks it from tab10, so a100 is the same blue whatever else is drawn; a label
# the table does not know takes one of tab20's lighter shades, by a hash of its text (stable across runs).
_KNOWN = tuple(PROFILES)


def gpu_colour(label: str):
    from matplotlib import colormaps

    key = str(label).lower()
    if key in _KNOWN and _KNOWN.index(key) < 10:
        return colormaps["tab10"].colors[_KNOWN.index(key)]
    return colormaps["tab20"].colors[1 + 2 * (zlib.crc32(key.encode()) % 10)]


def _series(t: pd.DataFrame, c) -> list[tuple[str, bool]]:
    """The bars of each group: (axis value, mislabelled?) in the comparison's order, honest first."""
    present = set(zip(t[c.by].astype(str), t["mismatch"].astype(bool)))
    return [(v, m) for v in c.values for m in (False, True) if (v, m) in present]


def _series_label(t: pd.DataFrame, c, value: str, mismatch: bool) -> str:
    if not mismatch:
        return value
    ran_on = sorted(t.loc[(t[c.by].astype(str) == value) & t["mismatch"], "ran_on"].dropna().astype(str).unique())
    return f"{value}: MISLABELLED (ran on {', '.join(ran_on) or '?'})"


def _bar_label(c, m: str, r) -> str:
    """The value printed on a bar: its median and, against a baseline, the speedup or why there is none."""
    med = float(r[f"{m}_median"])
    text = f"{med:,.0f}" if abs(med) >= 100 else format_value(m, med)
    if c.baseline is None or r[c.by] == c.baseline and not r["mismatch"]:
        return text
    if pd.notna(r["speedup"]):
        return f"{text}\n{r['speedup']:.2f}x"
    return f"{text}\n{r['verdict']}" if r["mismatch"] else text


def plot_by_gpu(c, path: Path):
    """Grouped bars of the metric's median per configuration and axis value (whiskers: the runs' min..max),
    saved to ``path``; returns the figure."""
    t = c.table.reset_index(drop=True)
    m = c.metric
    keys = group_columns(c.by)
    cfg = t[keys].astype(object).where(t[keys].notna(), None)
    row_keys = [tuple(r) for r in cfg.itertuples(index=False)]
    configs = list(dict.fromkeys(row_keys))
    labels = dict(zip(row_keys, _config_labels(t, keys)))
    series = _series(t, c)
    n_cfg, n_bar = len(configs), max(1, len(series))
    width_in = min(40.0, max(7.0, 2.5 + n_cfg * (0.8 + 0.5 * n_bar)))
    fig = figure(width_in, 5.5)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / n_bar
    pos = {k: i for i, k in enumerate(configs)}
    for j, (value, mismatch) in enumerate(series):
        sel = ((t[c.by].astype(str) == value) & (t["mismatch"] == mismatch)).to_numpy()
        rows = t[sel]
        x = np.array([pos[k] for k, s in zip(row_keys, sel) if s], float) + (j - (n_bar - 1) / 2) * width
        med = rows[f"{m}_median"].to_numpy(float)
        err = np.vstack([med - rows[f"{m}_min"].to_numpy(float), rows[f"{m}_max"].to_numpy(float) - med])
        colour = {"color": gpu_colour(value)} if c.by == DEFAULT_AXIS else {}  # other axes: matplotlib's cycle
        bars = ax.bar(x, med, width, yerr=err, capsize=3, label=_series_label(t, c, value, mismatch), **colour,
                      hatch=MISLABELLED_HATCH if mismatch else None, edgecolor="black" if mismatch else None,
                      alpha=0.55 if mismatch else 1.0)
        for b, top, (_, r) in zip(bars, rows[f"{m}_max"].to_numpy(float), rows.iterrows()):
            # above the whisker, not on it
            ax.annotate(_bar_label(c, m, r), (b.get_x() + b.get_width() / 2, top), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
    _value_axis(ax, t, m)
    ax.set_xticks(range(n_cfg))
    ticks = [labels[k] for k in configs]
    longest = max((len(line) for tick in ticks for line in tick.splitlines()), default=0)
    # Long labels would run into each other under narrow groups; slant them instead.
    slant = dict(rotation=25, ha="right") if longest * 0.07 > 0.8 + 0.5 * n_bar else {}
    ax.set_xticklabels(ticks, fontsize=8, **slant)
    varying = list(dict.fromkeys(k for named in _varying(t, keys).values() for k in named))
    ax.set_xlabel("configuration" + (f" ({', '.join(varying)})" if varying else ""))
    fig.suptitle(_wrapped(_title(c, t), width_in - 0.4))
    fig.legend(title=c.by, fontsize=8, loc="outside lower center", ncols=min(n_bar, 4))
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=DPI)
    return fig


def _title(c, t: pd.DataFrame) -> str:
    title = f"{c.metric} by {c.by}"
    if t["model"].nunique() == 1:
        title = f"{t['model'].iloc[0]}: {title}"
    if c.baseline:
        title += f" (on the bars: median; speedup vs {c.baseline})"
    if t["mismatch"].any():
        title += "; hatched: MISLABELLED runs" + ("" if c.include_mismatch else ", no speedup")
    return title


def _value_axis(ax, t: pd.DataFrame, m: str) -> None:
    """The metric's axis: its unit in the label, plain ticks, room above the bars for their labels, and
    a log scale only where a linear one would shrink the small bars to slivers."""
    unit = BY_NAME[m].unit if m in BY_NAME else ""
    top = float(np.nanmax(t[f"{m}_max"].to_numpy(float)))
    low = t[f"{m}_min"].to_numpy(float)
    low = low[np.isfinite(low) & (low > 0)]
    log = bool(len(low)) and top / low.min() > LOG_AXIS_RATIO
    what = f"{m}" + (f" ({unit})" if unit else "") + ", median of runs"
    if log:
        ax.set_yscale("log")
        ax.set_ylim(low.min() / 4, top * 3)  # the smallest bar keeps a fifth of the height or so
        what += ", log scale"
    elif np.isfinite(top) and top > 0:
        ax.set_ylim(0, top * 1.3)
    ax.set_ylabel(_wrapped(what + "; whiskers: min..max", 5.0, 10), fontsize=9)
    _plain_ticks(ax.yaxis)


def plot_gains(c, path: Path):
    """Horizontal bars of what compile / AMP changed (speedup of the median), saved to ``path``."""
    g = c.gains.reset_index(drop=True)
    labels = [f"{r.model} {r.task} {r.gpu} bs{cell(r.batch_size)}: {r.change}"
              + ("" if r.held == "-" else f" ({r.held})") + (" [MISLABELLED]" if r.mismatch else "")
              for r in g.itertuples(index=False)]
    fig = figure(10.0, min(40.0, max(3.0, 1.4 + 0.34 * len(g))))
    ax = fig.add_subplot(1, 1, 1)
    y = np.arange(len(g))[::-1]
    s = g["speedup"].to_numpy(float)
    # one run a side has no spread to judge against: grey and marked, never painted a gain or a loss
    single = (np.minimum(g["n_base"].to_numpy(), g["n_new"].to_numpy()) < 2).tolist()
    ax.barh(y, s, color=["tab:gray" if one else "tab:green" if v >= 1 else "tab:red" for v, one in zip(s, single)],
            hatch=[MISLABELLED_HATCH if bad else None for bad in g["mismatch"]])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    finite = s[np.isfinite(s)]
    ax.set_xlim(0, max(1.0, float(finite.max()) if len(finite) else 1.0) * 1.2)  # room for the labels
    _plain_ticks(ax.xaxis)
    ax.set_xlabel("speedup of median throughput_img_per_s (x; >1 = the change helped)")
    fig.suptitle("torch.compile and AMP gains" + ("; MISLABELLED runs hatched" if g["mismatch"].any() else ""))
    for yy, v, one in zip(y, s, single):
        if np.isfinite(v):
            ax.annotate(f"{v:.2f}x" + (" (single run)" if one else ""), (v, yy), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=7)
    fig.savefig(path, dpi=DPI)
    return fig


def plot_anatomy(anatomy, task: str, path: Path):
    """A step's anatomy (:class:`vitreg.measure.anatomy.Anatomy`): a bar of ms per image per kernel class, each
    labelled with its share and, for matmul and attention, the TFLOP/s reached; saved to ``path``."""
    ms = [anatomy.ms_per_img(c) for c in CLASSES]
    fig = figure(8.0, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    y = np.arange(len(CLASSES))[::-1]  # the table's order, top down
    ax.barh(y, ms, color=["tab:gray" if c == "idle" else "tab:blue" for c in CLASSES])
    ax.set_yticks(y)
    ax.set_yticklabels([CLASS_TEXT[c] for c in CLASSES], fontsize=9)
    for yy, c, v in zip(y, CLASSES, ms):
        tflops = anatomy.tflops(c) if c in FLOP_CLASSES else None
        ceiling = anatomy.ceiling_tflops.get(c)
        of = f" ({100 * tflops / ceiling:.0f} % of {ceiling:,.0f})" if tflops and ceiling else ""
        reached = f", {tflops:,.4g} TFLOP/s{of}" if tflops else ""
        ax.annotate(f"{v:.4f} ms, {anatomy.pct(c):.1f} %{reached}", (v, yy), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, max(max(ms), 1e-9) * 1.6)  # room for the labels
    ax.set_xlabel("ms per image (" + ("host: CPU op self time" if anatomy.host else "GPU kernel time") + ")")
    fig.suptitle(f"{task}: step anatomy, {anatomy.steps} profiled steps of {anatomy.batch} images")
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=DPI)
    return fig
