"""Compare recorded benchmark runs across GPUs: configuration by configuration, with speedups
against a baseline GPU, multi-process scaling and what torch.compile / AMP buy.

Everything here is a pure function over the tidy runs frame (:mod:`vitreg.analysis.frame`, built
by :func:`vitreg.tracking.search.tidy`); whether a difference is real is :mod:`vitreg.analysis.stats`'
call, and rendering is :mod:`vitreg.analysis.render`'s. The flow is::

    tidy frame --compare_gpus()--> Comparison --format_table()  (terminal)
                                              `-write_report()  (md/csv/html/png)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from vitreg.analysis.frame import CONFIG_KEYS, ID_COLUMNS, SHARED_METRICS, CompareError, require_tidy
from vitreg.analysis.stats import cv, geomean, improvement, spread, versus
from vitreg.measure.metrics import BY_NAME, HIGHER, LOWER

__all__ = ["Comparison", "compare_gpus", "compile_amp_gains", "scaling_efficiency"]

# The companion metrics every comparison row carries (medians), besides the one compared.
COMPANIONS = ("throughput_img_per_s", "latency_ms_p50", "step_ms_p50", "peak_mem_allocated_mb", "mfu")


@dataclass
class Comparison:
    """The result of :func:`compare_gpus`.

    ``table`` has one row per (configuration, gpu): the :data:`CONFIG_KEYS`, ``gpu``, ``n_runs``,
    ``sources``, ``<metric>_median/_min/_max/_cv/_spread`` (cv = sample std / mean; spread =
    (max-min)/median), medians of the companion metrics, and, when a baseline was chosen,
    ``baseline``, ``speedup`` (improvement factor vs the baseline's median for the same
    configuration: >1 is better, so for latency-like metrics it is baseline/gpu), ``ci_low``,
    ``ci_high`` (bootstrap interval of that factor) and ``verdict``.

    ``scaling`` is :func:`scaling_efficiency` of the same runs, ``gains`` is
    :func:`compile_amp_gains`, ``runs`` the tidy rows the numbers came from.
    """

    table: pd.DataFrame
    metric: str
    baseline: str | None
    higher_is_better: bool
    confidence: float
    n_boot: int
    seed: int
    gpus: list[str]
    runs: pd.DataFrame = field(repr=False)
    scaling: pd.DataFrame = field(repr=False)
    gains: pd.DataFrame = field(repr=False)

    @property
    def verdict_counts(self) -> dict[str, int]:
        """How many (configuration, gpu) rows got each verdict (empty without a baseline)."""
        if "verdict" not in self.table:
            return {}
        return {str(k): int(v) for k, v in self.table["verdict"].value_counts().items()}

    def geomean_speedup(self) -> dict[str, float]:
        """Per non-baseline GPU, the geometric mean speedup over configurations both ran.

        A one-number summary for tags/metrics; the per-configuration rows stay the real answer.
        """
        if self.baseline is None:
            return {}
        rows = self.table[(self.table["gpu"] != self.baseline) & self.table["speedup"].notna()]
        means = {str(gpu): geomean(g["speedup"]) for gpu, g in rows.groupby("gpu", sort=True)}
        return {gpu: m for gpu, m in means.items() if m is not None}

    def summary(self) -> dict:
        """Flat facts about the comparison, convenient for MLflow params/metrics or JSON."""
        cfg = self.table[list(CONFIG_KEYS)].drop_duplicates()
        return {
            "metric": self.metric,
            "baseline": self.baseline,
            "gpus": list(self.gpus),
            "n_runs": int(self.runs["run_id"].nunique()),
            "n_configurations": int(len(cfg)),
            "n_rows": int(len(self.table)),
            "verdicts": self.verdict_counts,
            "geomean_speedup": self.geomean_speedup(),
        }


def compare_gpus(
    runs: pd.DataFrame,
    baseline: str | None = None,
    metric: str = "throughput_img_per_s",
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> Comparison:
    """Compare GPUs configuration by configuration.

    ``runs`` is a tidy runs frame. Runs are grouped by :data:`CONFIG_KEYS` plus ``gpu``; each
    group is summarised by the median of ``metric`` and its spread. With ``baseline`` (a GPU label
    such as ``"a100"``, matched case-insensitively) each group also gets a speedup against the
    baseline GPU's group for the same configuration:

    * both sides have >= 2 runs: percentile bootstrap (``n_boot`` resamples of each side's runs,
      independently, ``seed`` for reproducibility) of the ratio of medians. The verdict is
      "faster"/"slower" ("better"/"worse" for non-speed metrics) only when the interval excludes
      1 *and* the relative change exceeds both sides' own spread ((max-min)/median of the runs);
      otherwise "within noise".
    * either side has a single run: point estimate only, verdict "single run".
    * the baseline GPU never ran the configuration: verdict "no baseline".

    ``baseline=None`` gives the per-GPU summary without speedup columns.

    Raises :class:`CompareError` for an empty frame, an unknown ``metric`` (the message lists the
    available ones), a metric no run recorded, or a baseline GPU with no runs (the message lists
    the GPUs present).
    """
    if n_boot < 100:
        raise CompareError(f"n_boot={n_boot} is too few bootstrap resamples; use at least 100 (default 2000)")
    if not 0.5 <= confidence < 1:
        raise CompareError(f"confidence={confidence} must be in [0.5, 1), e.g. 0.95")
    require_tidy(runs)
    higher = _polarity(metric, runs)
    measured = _measured(runs, metric)
    gpus = sorted(measured["gpu"].astype(str).unique())
    baseline = _baseline(baseline, gpus, metric)
    rng = np.random.default_rng(seed)
    speed = BY_NAME[metric].speed
    companions = [m for m in COMPANIONS if m != metric]
    rows = []
    # dropna=False: a configuration with an unrecorded batch size is still a configuration.
    for config, cfg_runs in measured.groupby(list(CONFIG_KEYS), dropna=False, sort=True):
        by_gpu = {str(g): grp for g, grp in cfg_runs.groupby("gpu", sort=True)}
        base_vals = by_gpu[baseline][metric].to_numpy(float) if baseline in by_gpu else None
        # Baseline first, then the rest best-first, so each block reads top-down.
        for gpu in sorted(by_gpu, key=lambda g: (g != baseline, _sort_value(by_gpu[g][metric], higher))):
            row = _summary_row(config, gpu, by_gpu[gpu], metric, companions)
            if baseline is not None:
                vals = by_gpu[gpu][metric].to_numpy(float)
                row.update(versus(vals, base_vals, gpu == baseline, higher, speed, n_boot, rng, confidence))
                row["baseline"] = baseline
            rows.append(row)
    return Comparison(
        table=_table(rows, metric, companions, baseline is not None),
        metric=metric,
        baseline=baseline,
        higher_is_better=higher,
        confidence=confidence,
        n_boot=n_boot,
        seed=seed,
        gpus=([baseline] if baseline else []) + [g for g in gpus if g != baseline],
        runs=measured.reset_index(drop=True),
        scaling=scaling_efficiency(runs),
        gains=compile_amp_gains(runs),
    )


def _measured(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    measured = runs[runs[metric].notna()]
    if measured.empty:
        have = sorted(runs["task"].unique())
        raise CompareError(
            f"no finished run recorded {metric} (runs have task {', '.join(have)}); pick a metric "
            f"of those tasks, e.g. {_suggest_metric(runs)}"
        )
    return measured


def _baseline(baseline: str | None, gpus: list[str], metric: str) -> str | None:
    """The baseline GPU as the runs spell it (matched case-blind); CompareError when none ran."""
    if baseline is None:
        return None
    match = [g for g in gpus if g.lower() == str(baseline).strip().lower()]
    if not match:
        raise CompareError(
            f"baseline GPU {baseline!r} has no finished runs with {metric}; GPUs present: "
            f"{', '.join(gpus)}; pass one of them as the baseline"
        )
    return match[0]


def _summary_row(config: tuple, gpu: str, grp: pd.DataFrame, metric: str, companions: list[str]) -> dict:
    """One (configuration, gpu) group: its runs' median and spread of ``metric``, companions' medians."""
    vals = grp[metric].to_numpy(float)
    row = dict(zip(CONFIG_KEYS, config))
    row.update(
        gpu=gpu,
        n_runs=int(len(vals)),
        sources="+".join(sorted(grp["source"].astype(str).unique())),
        **{
            f"{metric}_median": float(np.median(vals)),
            f"{metric}_min": float(vals.min()),
            f"{metric}_max": float(vals.max()),
            f"{metric}_cv": cv(vals),
            f"{metric}_spread": spread(vals),
        },
    )
    for m in companions:
        row[m] = float(grp[m].median()) if grp[m].notna().any() else np.nan
    return row


def _table(rows: list[dict], metric: str, companions: list[str], versus_baseline: bool) -> pd.DataFrame:
    table = pd.DataFrame(rows)
    lead = list(CONFIG_KEYS) + ["gpu", "n_runs", "sources"]
    stats = [f"{metric}_{s}" for s in ("median", "min", "max", "cv", "spread")]
    tail = ["baseline", "speedup", "ci_low", "ci_high", "verdict"] if versus_baseline else []
    table = table[lead + stats + companions + tail]
    for key in ("batch_size", "img_size", "nproc"):
        table[key] = table[key].astype("Int64")
    return table.reset_index(drop=True)


def _sort_value(s: pd.Series, higher: bool) -> float:
    med = float(s.median())
    return -med if higher else med


def _polarity(metric: str, runs: pd.DataFrame) -> bool:
    """True when a larger value of ``metric`` is better (the metric table says); CompareError for
    a metric the runs do not have or one with no better direction."""
    measurable = [c for c in runs.columns if c not in ID_COLUMNS and c not in SHARED_METRICS]
    if metric not in measurable:
        raise CompareError(
            f"unknown metric {metric!r}; use one of: {', '.join(sorted(measurable))} "
            "(names without the infer_/train_ prefix)"
        )
    declared = BY_NAME.get(metric)
    if declared is None or declared.better not in (HIGHER, LOWER):
        raise CompareError(
            f"metric {metric!r} has no better direction vitreg knows of; compare on "
            "throughput_img_per_s, latency_ms_p50, step_ms_p50, peak_mem_allocated_mb or mfu"
        )
    return declared.better == HIGHER


def _suggest_metric(runs: pd.DataFrame) -> str:
    return "latency_ms_p50" if (runs["task"] == "infer").any() else "step_ms_p50"


# --------------------------------------------------------------------------------------------
# scaling and compile/amp gains


def scaling_efficiency(runs: pd.DataFrame, metric: str = "throughput_img_per_s") -> pd.DataFrame:
    """Multi-process (DDP) scaling of train runs.

    Train runs are grouped by configuration minus ``nproc`` (same per-process batch, i.e. weak
    scaling) and GPU. For every ``nproc`` N of a group that has some N > 1:
    ``speedup_vs_1 = median(N) / median(1)`` and ``efficiency = median(N) / (N * median(1))``,
    where ``metric`` is the global ``train_throughput_img_per_s``. Both are NaN when the group
    has no single-process run to scale from. Returns an empty frame (same columns) when no
    multi-process train runs exist.
    """
    keys = ["model", "task", "amp", "compile", "batch_size", "img_size", "gpu"]
    columns = keys + ["nproc", "ddp", "n_runs", f"{metric}_median", "speedup_vs_1", "efficiency"]
    require_tidy(runs)
    train = runs[(runs["task"] == "train") & runs[metric].notna()]
    rows = []
    for key, grp in train.groupby(keys, dropna=False, sort=True):
        if not (grp["nproc"] > 1).any():
            continue
        # every DDP setting (ddp column) of N > 1 scales from the same single-process runs
        stats = grp.groupby(["nproc", "ddp"])[metric].agg(["median", "count"]).sort_index()
        ones = grp.loc[grp["nproc"] == 1, metric]
        one = float(ones.median()) if len(ones) else np.nan
        for (n, ddp), (med, count) in stats.iterrows():
            rows.append(dict(
                zip(keys, key),
                nproc=int(n),
                ddp=ddp,
                n_runs=int(count),
                **{f"{metric}_median": float(med)},
                speedup_vs_1=float(med / one) if one == one else np.nan,
                efficiency=float(med / (n * one)) if one == one else np.nan,
            ))
    out = pd.DataFrame(rows, columns=columns)
    return out.astype({"nproc": "Int64", "batch_size": "Int64", "img_size": "Int64"})


def compile_amp_gains(runs: pd.DataFrame, metric: str = "throughput_img_per_s") -> pd.DataFrame:
    """What ``torch.compile`` and mixed precision buy, per (model, task, gpu, batch, img, nproc).

    Compares medians of ``metric`` between configurations that differ only in ``compile`` or
    ``amp``, on the same GPU:

    * ``change="compile=<mode>"``, ``held="amp=<x>"``: compile mode vs ``compile=off``;
    * ``change="amp=<dtype>"``, ``held="compile=<y>"``: bf16/fp16 vs ``amp=off``;
    * ``change="amp=<dtype>+compile=<mode>"``, ``held="-"``: both vs neither.

    Rows appear only where both sides exist. ``speedup = new/base`` (throughput) or base/new for
    time-like metrics, so >1 always means the change helped.
    """
    keys = ["model", "task", "gpu", "batch_size", "img_size", "nproc", "ddp"]
    columns = keys + ["change", "held", "base_median", "new_median", "speedup", "n_base", "n_new"]
    require_tidy(runs)
    higher = _polarity(metric, runs)
    runs = runs[runs[metric].notna()]
    rows = []
    for key, grp in runs.groupby(keys, dropna=False, sort=True):
        stats = grp.groupby(["amp", "compile"])[metric].agg(["median", "count"])
        cells = {idx: (float(r["median"]), int(r["count"])) for idx, r in stats.iterrows()}

        def add(change, held, base_idx, new_idx):
            if base_idx in cells and new_idx in cells:
                (bm, bn), (nm, nn) = cells[base_idx], cells[new_idx]
                rows.append(dict(zip(keys, key), change=change, held=held, base_median=bm,
                                 new_median=nm, speedup=improvement(nm, bm, higher),
                                 n_base=bn, n_new=nn))

        for amp, comp in sorted(cells):
            if comp != "off":
                add(f"compile={comp}", f"amp={amp}", (amp, "off"), (amp, comp))
        for amp, comp in sorted(cells):
            if amp != "off":
                add(f"amp={amp}", f"compile={comp}", ("off", comp), (amp, comp))
        for amp, comp in sorted(cells):
            if amp != "off" and comp != "off":
                add(f"amp={amp}+compile={comp}", "-", ("off", "off"), (amp, comp))
    out = pd.DataFrame(rows, columns=columns)
    return out.astype({"nproc": "Int64", "batch_size": "Int64", "img_size": "Int64"})
