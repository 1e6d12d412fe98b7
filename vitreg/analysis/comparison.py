"""Compare recorded runs along one axis (the GPU by default), configuration by configuration: speedups against a
baseline value, multi-process scaling, what torch.compile / AMP buy. Mislabelled runs are shown, marked, and kept
out of speedups and verdicts unless asked for. Pure functions over the tidy runs frame."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from vitreg.analysis.frame import (CHOSEN_COLUMNS, CONDITION_COLUMNS, DEFAULT_AXIS, GRANT_COLUMNS, HARDWARE_COLUMNS,
                                   MISSING, SCALED_COLUMNS, SHARED_METRICS, CompareError, config_columns, group_columns,
                                   id_columns, require_tidy)
from vitreg.analysis.stats import MISLABELLED, cv, improvement, spread, versus
from vitreg.measure.energy import FLAGS, suspect_flags
from vitreg.measure.metrics import BY_NAME, HIGHER, LOWER

SHARED_HOST = "shared host"  # the flag of a figure timed while other children of its sweep ran on its host

#: what compile_amp_gains pairs runs along (the rest of the configuration must agree)
GAINED_COLUMNS = ("amp", "compile")
#: the metrics every comparison row carries (medians) besides the one compared
COMPANIONS = ("throughput_img_per_s", "latency_ms_p50", "step_ms_p50", "peak_mem_allocated_mb", "mfu", "img_per_j",
              "usd_per_1m_img")


@dataclass
class Comparison:
    """The result of :func:`compare_runs`: ``table`` has one row per (configuration, axis value, mislabelled or
    not); ``speedup`` > 1 is better whichever way the metric goes. ``values``: the axis values, the baseline first."""

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
    by: str = DEFAULT_AXIS
    values: list[str] = field(default_factory=list)
    include_mismatch: bool = False

    @property
    def verdict_counts(self) -> dict[str, int]:
        """How many table rows got each verdict (empty without a baseline)."""
        if "verdict" not in self.table:
            return {}
        return {str(k): int(v) for k, v in self.table["verdict"].value_counts().items()}

    @property
    def baseline_label(self) -> str | None:
        """``a100`` when comparing GPUs, ``torch_version=2.8.0`` along another axis."""
        if self.baseline is None:
            return None
        return self.baseline if self.by == DEFAULT_AXIS else f"{self.by}={self.baseline}"

    @property
    def mislabelled(self) -> pd.DataFrame:
        """The table rows of mislabelled runs (filed under a GPU that did not run them)."""
        return self.table[self.table["mismatch"]]

    def geomean_speedup(self) -> dict[str, float]:
        """Per non-baseline axis value, the geometric mean speedup over configurations both ran."""
        from scipy.stats import gmean

        if self.baseline is None:
            return {}
        rows = self.table[(self.table[self.by] != self.baseline) & (self.table["speedup"] > 0)]
        return {str(value): float(gmean(g["speedup"])) for value, g in rows.groupby(self.by, sort=True)}

    def best(self) -> dict[str, int]:
        """Per axis value, in how many configurations its median is the best (mislabelled rows left out unless
        included): what a reader asks first."""
        t = self.table if self.include_mismatch else self.table[~self.table["mismatch"]]
        keys = [c for c in config_columns() if c in t and c != self.by]
        if t.empty or not keys:
            return {}
        medians = t.groupby(keys, dropna=False)[f"{self.metric}_median"]
        winners = t.loc[medians.idxmax() if self.higher_is_better else medians.idxmin(), self.by]
        return {str(value): int(n) for value, n in winners.value_counts().items()}

    def summary(self) -> dict:
        """Flat facts about the comparison, for MLflow params/metrics or JSON."""
        cfg = self.table[list(config_columns())].drop_duplicates()
        return {"metric": self.metric, "by": self.by, "baseline": self.baseline, "values": list(self.values),
                "gpus": list(self.gpus), "n_runs": int(self.runs["run_id"].nunique()),
                "n_mislabelled_runs": int(self.runs.loc[self.runs["mismatch"], "run_id"].nunique()),
                "include_mismatch": self.include_mismatch, "n_configurations": int(len(cfg)),
                "n_rows": int(len(self.table)), "verdicts": self.verdict_counts,
                "geomean_speedup": self.geomean_speedup(), "best": self.best()}


@dataclass(frozen=True)
class _Question:
    """What :func:`compare_runs` was asked, as every block of runs needs it."""

    metric: str
    by: str
    baseline: str | None
    higher: bool
    include_mismatch: bool
    n_boot: int
    confidence: float
    rng: np.random.Generator
    companions: tuple[str, ...]


def compare_runs(
    runs: pd.DataFrame,
    baseline: str | None = None,
    metric: str = "throughput_img_per_s",
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    by: str = DEFAULT_AXIS,
    include_mismatch: bool = False,
) -> Comparison:
    """Compare the tidy frame's ``runs`` along ``by`` (the GPU, or any column it carries), grouped by
    :func:`~vitreg.analysis.frame.group_columns`: each group's median of ``metric`` and its spread, and with
    ``baseline`` (an axis value, matched case-blind) a speedup with a bootstrap interval and a verdict
    (:func:`vitreg.analysis.stats.versus`). Mislabelled runs are rows of their own with no speedup (verdict
    "mislabelled"), unless ``include_mismatch``."""
    if n_boot < 100:
        raise CompareError(f"n_boot={n_boot} is too few bootstrap resamples; use at least 100 (default 2000)")
    if not 0.5 <= confidence < 1:
        raise CompareError(f"confidence={confidence} must be in [0.5, 1), e.g. 0.95")
    require_tidy(runs)
    higher = _polarity(metric, runs)
    measured = _along(_measured(runs, metric), by)
    values = sorted(measured[by].unique())
    baseline = _baseline(baseline, values, metric, by)
    ask = _Question(metric, by, baseline, higher, include_mismatch, n_boot, confidence,
                    np.random.default_rng(seed), tuple(m for m in COMPANIONS if m != metric))
    keys = group_columns(by)
    ordered = ([baseline] if baseline else []) + [v for v in values if v != baseline]
    rows = []
    # dropna=False: a configuration with an unrecorded batch size is still a configuration.
    for config, cfg_runs in measured.groupby(keys, dropna=False, sort=True):
        rows += _block(dict(zip(keys, config)), cfg_runs, ask)
    return Comparison(
        _table(rows, ask), metric, baseline, higher, confidence, n_boot, seed,
        gpus=ordered if by == DEFAULT_AXIS else sorted(measured["gpu"].astype(str).unique()),
        runs=measured.reset_index(drop=True), scaling=scaling_efficiency(runs, include_mismatch=include_mismatch),
        gains=compile_amp_gains(runs, include_mismatch=include_mismatch), by=by, values=ordered,
        include_mismatch=include_mismatch)


#: the name bench/sweep.py (and code written before compare --by) calls it by
compare_gpus = compare_runs


def _block(config: dict, cfg_runs: pd.DataFrame, ask: _Question) -> list[dict]:
    """The rows of one configuration: one per (axis value, mislabelled or not), each against the baseline."""
    groups = {(str(v), bool(m)): grp for (v, m), grp in cfg_runs.groupby([ask.by, "mismatch"], sort=True)}
    base_key = next((k for k in ((ask.baseline, False), (ask.baseline, True))
                     if k in groups and (ask.include_mismatch or not k[1])), None)
    base_vals = groups[base_key][ask.metric].to_numpy(float) if base_key else None
    # Baseline first, then honest rows best-first, then mislabelled ones, so each block reads top-down.
    sign = -1 if ask.higher else 1
    order = sorted(groups, key=lambda k: (k != base_key, k[1], sign * float(groups[k][ask.metric].median())))
    rows = []
    for key in order:
        row = _summary_row({**config, ask.by: key[0]}, groups[key], ask)
        rows.append(row)
        if ask.baseline is None:
            continue
        if key[1] and not ask.include_mismatch:
            row.update(speedup=np.nan, ci_low=np.nan, ci_high=np.nan, verdict=MISLABELLED)
        else:
            vals = groups[key][ask.metric].to_numpy(float)
            row.update(versus(vals, base_vals, key == base_key, ask.higher, BY_NAME[ask.metric].speed, ask.n_boot,
                              ask.rng, ask.confidence))
            row["verdict"] += f" ({MISLABELLED})" if key[1] else ""
        row["baseline"] = ask.baseline
    return rows


def _along(measured: pd.DataFrame, by: str) -> pd.DataFrame:
    """The runs with the axis as strings (so ``64`` and ``"2.8.0"`` match a typed baseline alike);
    CompareError when no run records it."""
    if by not in measured or measured[by].isna().all():
        raise CompareError(
            f"no run records {by!r} (as a tag or param); compare --by gpu (the default) or another tag or "
            "param the runs carry: torch_version, timm_version, vitreg_git_sha, compile, amp, batch_size"
        )
    return measured.assign(**{by: measured[by].astype(str).where(measured[by].notna(), MISSING)})


def _measured(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    measured = runs[runs[metric].notna()]
    if measured.empty:
        raise CompareError(
            f"no finished run recorded {metric} (runs have task {', '.join(sorted(runs['task'].unique()))}); pick a "
            f"metric of those tasks, e.g. {'latency_ms_p50' if (runs['task'] == 'infer').any() else 'step_ms_p50'}")
    return measured


def _baseline(baseline: str | None, values: list[str], metric: str, by: str) -> str | None:
    """The baseline as the runs spell it (matched case-blind); CompareError when none ran."""
    if baseline is None:
        return None
    match = [v for v in values if v.lower() == str(baseline).strip().lower()]
    if not match:
        what, present = ("GPU", "GPUs present") if by == DEFAULT_AXIS else (by, f"{by} values present")
        raise CompareError(f"baseline {what} {baseline!r} has no finished runs with {metric}; {present}: "
                           f"{', '.join(values)}; pass one of them as the baseline")
    return match[0]


def _summary_row(row: dict, grp: pd.DataFrame, ask: _Question) -> dict:
    """One (configuration, axis value) group: its runs' median and spread of the metric, companions' medians."""
    m, vals = ask.metric, grp[ask.metric].to_numpy(float)
    # sweep children: the most that shared a run's host; with share_node=true, how many runs may have shared it
    shared = pd.Series(grp.get("on_shared_node", []), dtype=object) == "true"
    return {**row, "n_runs": len(vals), "sources": "+".join(sorted(grp["source"].astype(str).unique())),
            "mismatch": bool(grp["mismatch"].any()),
            "ran_on": "+".join(sorted(grp["ran_on"].dropna().astype(str).unique())) or np.nan,
            "shared_host": grp.get("children_on_host", pd.Series(dtype=float)).astype(float).max(),
            "shared_node": np.nan if not shared.any() else "yes" if shared.all() else f"{shared.sum()}/{len(shared)}",
            "batch_chosen": "/".join(sorted(grp["batch_chosen"].dropna().astype(str).unique(), key=int)) or np.nan,
            "flags": _flags(grp), f"{m}_median": float(np.median(vals)), f"{m}_min": float(vals.min()),
            f"{m}_max": float(vals.max()), f"{m}_cv": cv(vals), f"{m}_spread": spread(vals),
            **{c: float(grp[c].median()) if grp[c].notna().any() else np.nan for c in ask.companions}}


def _flags(grp: pd.DataFrame) -> str | float:
    """What makes the group's figures suspect, as ``vitreg runs`` and a run's name flag it (busy host, throttled,
    ...): each word once, with how many of the runs it holds for when not all (``busy host 1/3``); NaN: none."""
    words = [word if mask.all() else f"{word} {int(mask.sum())}/{len(mask)}"
             for word, mask in suspect_masks(grp).items() if mask.any()]
    return ", ".join(words) or np.nan


def suspect_masks(runs: pd.DataFrame) -> dict[str, pd.Series]:
    """Each word ``vitreg runs`` flags a suspect figure with (:func:`vitreg.measure.energy.suspect_flags`: busy
    host, throttled, wide spread, precision missed, eager fp8; and ``shared host``: a sweep's child that ran beside
    others on its host, whatever its engine) as a mask over the rows of the tidy frame ``runs``, from its condition
    columns (NaN for runs that predate them): the runs list, compare and a sweep's table flag alike."""
    present = [c for c in CONDITION_COLUMNS if c in runs]
    flags = [suspect_flags({k: v for k, v in zip(present, row) if isinstance(v, str)})
             for row in runs[present].itertuples(index=False)]
    masks = {word: pd.Series([word in f for f in flags], index=runs.index, dtype=bool) for word in FLAGS}
    return {**masks, SHARED_HOST: runs.get("children_on_host", pd.Series(index=runs.index)).astype(float) > 1}


def _table(rows: list[dict], ask: _Question) -> pd.DataFrame:
    table = pd.DataFrame(rows)
    identity = list(dict.fromkeys([*group_columns(), ask.by]))
    lead = identity + ["n_runs", "sources", *HARDWARE_COLUMNS, "shared_host", "shared_node", *CHOSEN_COLUMNS,
                       "flags"]
    stats = [f"{ask.metric}_{s}" for s in ("median", "min", "max", "cv", "spread")]
    tail = ["baseline", "speedup", "ci_low", "ci_high", "verdict"] if ask.baseline is not None else []
    table = table[lead + stats + list(ask.companions) + tail]
    for key in ("batch_size", "img_size", "nproc", *GRANT_COLUMNS):
        if key != ask.by:  # the axis stays as the strings the baseline was matched against
            table[key] = table[key].astype("Int64")
    return table.reset_index(drop=True)


def _polarity(metric: str, runs: pd.DataFrame) -> bool:
    """True when a larger value of ``metric`` is better (the metric table says); CompareError for
    a metric the runs do not have or one with no better direction."""
    measurable = [c for c in runs.columns if c not in id_columns() and c not in SHARED_METRICS
                  and pd.api.types.is_numeric_dtype(runs[c])]
    if metric not in measurable:
        raise CompareError(f"unknown metric {metric!r}; use one of: {', '.join(sorted(measurable))} "
                           "(names without the infer_/train_ prefix)")
    declared = BY_NAME.get(metric)
    if declared is None or declared.better not in (HIGHER, LOWER):
        raise CompareError(f"metric {metric!r} has no better direction vitreg knows of; compare on "
                           "throughput_img_per_s, latency_ms_p50, step_ms_p50, peak_mem_allocated_mb or mfu")
    return declared.better == HIGHER


# ---------------------------------------------------------------- scaling and compile/amp gains

def _paired(runs: pd.DataFrame, metric: str, include_mismatch: bool, along: tuple[str, ...]):
    """``(keys, groups)``: the runs with ``metric`` grouped by configuration and GPU but the columns ``along``, and
    by ``mismatch``: mislabelled runs are left out unless ``include_mismatch`` (then paired among themselves)."""
    keys = [k for k in group_columns() if k not in along] + ["mismatch"]
    runs = runs[runs[metric].notna() & (include_mismatch | ~runs["mismatch"])]
    return keys, runs.groupby(keys, dropna=False, sort=True)


def _frame(rows: list[dict], columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=columns).astype({"nproc": "Int64", "batch_size": "Int64", "img_size": "Int64"})


def scaling_efficiency(runs: pd.DataFrame, metric: str = "throughput_img_per_s",
                       include_mismatch: bool = False) -> pd.DataFrame:
    """Weak scaling of train runs: per configuration but :data:`SCALED_COLUMNS` with some ``nproc`` N > 1,
    ``speedup_vs_1 = median(N) / median(1)`` and ``efficiency = speedup_vs_1 / N`` (NaN without a single-process
    run)."""
    require_tidy(runs)
    keys, groups = _paired(runs[runs["task"] == "train"], metric, include_mismatch, SCALED_COLUMNS)
    rows = []
    for key, grp in groups:
        if not (grp["nproc"] > 1).any():
            continue
        # every DDP setting (ddp column) of N > 1 scales from the same single-process runs
        stats = grp.groupby(["nproc", "ddp"])[metric].agg(["median", "count"]).sort_index()
        one = float(grp.loc[grp["nproc"] == 1, metric].median())  # NaN without one
        for (n, ddp), (med, count) in stats.iterrows():
            rows.append(dict(zip(keys, key), nproc=int(n), ddp=ddp, n_runs=int(count), **{f"{metric}_median": med},
                             speedup_vs_1=med / one, efficiency=med / (n * one)))
    return _frame(rows, keys + ["nproc", "ddp", "n_runs", f"{metric}_median", "speedup_vs_1", "efficiency"])


def compile_amp_gains(runs: pd.DataFrame, metric: str = "throughput_img_per_s",
                      include_mismatch: bool = False) -> pd.DataFrame:
    """What ``torch.compile`` and mixed precision buy, per configuration but ``amp`` and ``compile``: medians of
    ``metric`` paired where both sides exist, ``change="compile=<mode>"`` (``held="amp=<x>"``) against compile
    off, ``"amp=<dtype>"`` against amp off, ``"amp=<dtype>+compile=<mode>"`` against neither; ``speedup`` > 1:
    the change helped."""
    require_tidy(runs)
    higher = _polarity(metric, runs)
    keys, groups = _paired(runs, metric, include_mismatch, GAINED_COLUMNS)
    rows = []
    for key, grp in groups:
        cells = grp.groupby(["amp", "compile"])[metric].agg(["median", "count"]).sort_index()
        pairs = [(f"compile={c}", f"amp={a}", (a, "off"), (a, c)) for a, c in cells.index if c != "off"]
        pairs += [(f"amp={a}", f"compile={c}", ("off", c), (a, c)) for a, c in cells.index if a != "off"]
        pairs += [(f"amp={a}+compile={c}", "-", ("off", "off"), (a, c)) for a, c in cells.index
                  if a != "off" and c != "off"]
        for change, held, base, new in pairs:
            if base in cells.index:
                (bm, bn), (nm, nn) = cells.loc[base], cells.loc[new]
                rows.append(dict(zip(keys, key), change=change, held=held, base_median=bm, new_median=nm,
                                 speedup=improvement(nm, bm, higher), n_base=int(bn), n_new=int(nn)))
    return _frame(rows, keys + ["change", "held", "base_median", "new_median", "speedup", "n_base", "n_new"])
