"""The comparison's charts: the metric by GPU per configuration, and what compile / AMP buy.

Matplotlib's object API with an explicit Agg canvas: no pyplot global state and no GUI backend,
so this works headless and does not change the caller's matplotlib backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from vitreg.analysis.frame import CONFIG_KEYS
from vitreg.analysis.render import cell, split_constant


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _config_labels(t: pd.DataFrame) -> list[str]:
    """Short labels for configurations, naming only the keys that vary between them."""
    fixed, varying = split_constant(t, CONFIG_KEYS)
    single_model = t["model"].nunique() == 1
    short = {"batch_size": "bs", "img_size": "img", "nproc": "x"}
    labels = []
    for _, r in t.iterrows():
        bits = " ".join(f"{short.get(k, '')}{cell(r[k])}" for k in varying if k != "model")
        labels.append(bits or str(r["model"]) if single_model else f"{r['model']}\n{bits}".strip())
    return labels


def plot_by_gpu(c, path: Path) -> None:
    t = c.table
    m = c.metric
    cfg = t[list(CONFIG_KEYS)].astype(object).where(t[list(CONFIG_KEYS)].notna(), None)
    keys = [tuple(r) for r in cfg.itertuples(index=False)]
    configs = list(dict.fromkeys(keys))
    labels = dict(zip(keys, _config_labels(t)))
    gpus = c.gpus
    n_cfg, n_gpu = len(configs), max(1, len(gpus))
    fig = _figure(min(40.0, max(6.0, 1.0 + n_cfg * (0.8 + 0.45 * n_gpu))), 5.0)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / n_gpu
    pos = {k: i for i, k in enumerate(configs)}
    for j, gpu in enumerate(gpus):
        sel = t["gpu"] == gpu
        rows = t[sel]
        x = np.array([pos[k] for k, s in zip(keys, sel) if s], float) + (j - (n_gpu - 1) / 2) * width
        med = rows[f"{m}_median"].to_numpy(float)
        err = np.vstack([med - rows[f"{m}_min"].to_numpy(float), rows[f"{m}_max"].to_numpy(float) - med])
        bars = ax.bar(x, med, width, yerr=err, capsize=3, label=gpu)
        if c.baseline and gpu != c.baseline:
            tops = rows[f"{m}_max"].to_numpy(float)  # above the error bar, not on it
            for b, s, top in zip(bars, rows["speedup"], tops):
                if pd.notna(s):
                    ax.annotate(f"{s:.2f}x", (b.get_x() + b.get_width() / 2, top),
                                ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                                textcoords="offset points")
    positive = t[f"{m}_min"].to_numpy(float)
    positive = positive[np.isfinite(positive) & (positive > 0)]
    if len(positive) and t[f"{m}_max"].max() / positive.min() > 30:
        # ViT-Ti and ViT-L differ ~25x in throughput; on a linear axis the small bars vanish.
        ax.set_yscale("log")
        ax.set_ylabel(f"{m} (median, log scale; bars: min..max of runs)")
    ax.set_xticks(range(n_cfg))
    ticks = [labels[k] for k in configs]
    longest = max((len(line) for tick in ticks for line in tick.splitlines()), default=0)
    # Long labels would run into each other under narrow groups; slant them instead.
    slant = dict(rotation=25, ha="right") if longest * 0.07 > 0.8 + 0.45 * n_gpu else {}
    ax.set_xticklabels(ticks, fontsize=8, **slant)
    if ax.get_yscale() == "linear":
        ax.set_ylabel(f"{m} (median; bars: min..max of runs)")
    title = f"{m} by GPU"
    if t["model"].nunique() == 1:
        title = f"{t['model'].iloc[0]}: {title}"
    if c.baseline:
        title += f" (speedup vs {c.baseline} above bars)"
    ax.set_title(title)
    ax.legend(title="gpu", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_gains(c, path: Path) -> None:
    g = c.gains
    labels = [f"{r.model} {r.task} {r.gpu} bs{cell(r.batch_size)}: {r.change}"
              + ("" if r.held == "-" else f" ({r.held})") for r in g.itertuples(index=False)]
    fig = _figure(9.0, min(40.0, max(2.5, 0.8 + 0.32 * len(g))))
    ax = fig.add_subplot(1, 1, 1)
    y = np.arange(len(g))[::-1]
    s = g["speedup"].to_numpy(float)
    ax.barh(y, s, color=["tab:green" if v >= 1 else "tab:red" for v in s])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("speedup of median throughput (>1 = the change helped)")
    ax.set_title("torch.compile and AMP gains")
    for yy, v in zip(y, s):
        if np.isfinite(v):
            ax.annotate(f"{v:.2f}x", (v, yy), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
