"""Compare recorded benchmark runs across GPUs, and say when a difference is real.

Everything here is a pure function over pandas DataFrames shaped like ``mlflow.search_runs()``
output (``run_id``, ``status``, ``start_time``, ``params.*``, ``tags.*``, ``metrics.*``); this
module never talks to MLflow itself, so the tracking layer decides which runs to fetch and where
the report goes.

The flow is::

    runs_df --tidy()--> one row per (run, task) --compare_gpus()--> Comparison
                                                                     |-- format_table()  (terminal)
                                                                     `-- write_report()  (md/csv/html/png)

The statistics are deliberately modest. Benchmarks repeat a handful of times, so every group is
summarised by its median and range, and a GPU is only called "faster" or "slower" than the
baseline when a bootstrap interval of the ratio of medians excludes 1 *and* the change is larger
than either side's own run-to-run spread. With one run on either side there is no way to tell
noise from signal, and the verdict says so ("single run") instead of guessing.
"""

from __future__ import annotations

import html
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from vitreg.errors import VitregError
from vitreg.config.spec import _TRUE, DDP_BUCKET_MB

__all__ = [
    "CONFIG_KEYS",
    "CompareError",
    "Comparison",
    "compare_gpus",
    "compile_amp_gains",
    "format_table",
    "scaling_efficiency",
    "tidy",
    "write_report",
]


class CompareError(VitregError):
    """The runs cannot be compared as asked; the one-line message names the fix."""


# A configuration is everything that changes the work done per image except the GPU. Two runs
# with equal keys measure the same thing, so their spread is noise and their GPUs are comparable.
CONFIG_KEYS = ("model", "task", "amp", "compile", "batch_size", "img_size", "nproc", "ddp")
TASKS = ("infer", "train")

# Metric names after the task prefix is stripped. tidy() guarantees these columns exist (NaN
# where a run did not record them) so downstream code and reports have a stable schema.
TASK_METRICS = {
    "infer": (
        "throughput_img_per_s",
        "latency_ms_p50",
        "latency_ms_p90",
        "latency_ms_p99",
        "peak_mem_allocated_mb",
        "mfu",
        "throughput_cv",
    ),
    "train": (
        "throughput_img_per_s",
        "step_ms_p50",
        "peak_mem_allocated_mb",
        "mfu",
        "throughput_cv",
        "world_size",
        "throughput_img_per_s_per_gpu",
    ),
}
# Metrics logged without a task prefix that still describe every task of the run.
SHARED_METRICS = ("fwd_gflops_per_img",)
ALL_METRICS = tuple(dict.fromkeys(TASK_METRICS["infer"] + TASK_METRICS["train"] + SHARED_METRICS))

# Which way is "better" decides what a speedup is.
_HIGHER_IS_BETTER = {"throughput_img_per_s", "throughput_img_per_s_per_gpu", "mfu"}
_LOWER_IS_BETTER = {"peak_mem_allocated_mb", "throughput_cv"}

# Columns of the tidy frame that are not measurements.
_ID_COLUMNS = ("run_id", "start_time", "source", "gpu") + CONFIG_KEYS

# Verdict vocabulary, kept in one place so the CLI and tests can refer to it.
FASTER, SLOWER, BETTER, WORSE = "faster", "slower", "better", "worse"
WITHIN_NOISE, SINGLE_RUN = "within noise", "single run"
BASELINE, NO_BASELINE = "baseline", "no baseline"

_MISSING = "?"  # shown for a configuration string nobody recorded


# --------------------------------------------------------------------------------------------
# tidy


def tidy(runs_df: pd.DataFrame) -> pd.DataFrame:
    """Reshape ``mlflow.search_runs()`` output into one row per (run, task).

    Keeps FINISHED runs and runs imported from timm (``tags.source == "timm"``); everything else
    (FAILED, RUNNING, KILLED) is dropped because its numbers are partial or absent.

    Columns of the result: ``run_id, start_time, source, gpu`` and the configuration keys
    :data:`CONFIG_KEYS` (``task`` is the row's own task, ``infer`` or ``train``: a ``task=both``
    run yields one row of each, so it is comparable with single-task runs), followed by the
    task's metrics with the ``infer_`` / ``train_`` prefix stripped (``throughput_img_per_s``,
    ``latency_ms_p50``, ``step_ms_p50``, ...; all of :data:`ALL_METRICS` are present, NaN where
    not recorded, plus any other ``metrics.<task>_*`` the runs carry).

    ``gpu`` is the resolved ``tags.gpu``, falling back to ``params.gpu``; ``amp`` and ``img_size``
    likewise prefer the resolved ``tags.amp`` / ``tags.img_size``. ``compile`` ends in
    ``+cudagraph`` for ``cuda_graph=true`` runs. ``nproc`` is the number of processes in the whole job: the
    ``world_size`` tag of DDP runs (``nproc x nnodes`` for several hosts), else ``params.nproc``
    (times ``params.nnodes``), else 1. ``batch_size``, ``img_size`` and ``nproc``
    are nullable integers.

    Raises :class:`CompareError` when the frame is empty or holds no finished run with metrics.
    """
    if runs_df is None or len(runs_df) == 0:
        raise CompareError(
            "no runs to compare; record some with `vitreg bench`, or check the experiment name "
            "and tracking URI"
        )
    df = runs_df.reset_index(drop=True)

    status = _text(df, "status")
    if status is None:
        # A frame built by hand (or by timm_import.to_runs_frame) may omit status; such rows
        # are results, not in-flight runs.
        status = pd.Series("FINISHED", index=df.index, dtype=object)
    source = _text(df, "tags.source")
    source = source.fillna("vitreg") if source is not None else pd.Series("vitreg", index=df.index)
    keep = (status.str.upper() == "FINISHED") | (source == "timm")
    if not keep.any():
        counts = status.fillna("UNKNOWN").value_counts()
        seen = ", ".join(f"{n}x {s}" for s, n in counts.items())
        raise CompareError(
            f"none of the {len(df)} runs finished ({seen}); only FINISHED runs are compared, "
            "so re-run the failed benchmarks (their error is in the vitreg_error tag)"
        )
    df = df[keep].reset_index(drop=True)
    source = source[keep].reset_index(drop=True)

    base = pd.DataFrame(index=df.index)
    base["run_id"] = _text(df, "run_id") if "run_id" in df else df.index.astype(str)
    base["start_time"] = df["start_time"] if "start_time" in df else pd.NaT
    base["source"] = source
    gpu = _coalesce(df, "tags.gpu", "params.gpu")
    # params.gpu may be the request ("auto"), which says nothing about the hardware.
    gpu = gpu.where(gpu.str.lower() != "auto")
    base["gpu"] = gpu.fillna("unknown")
    base["model"] = _coalesce(df, "params.model", "tags.model").fillna(_MISSING)
    task_param = _coalesce(df, "params.task").str.lower()
    base["amp"] = _coalesce(df, "tags.amp", "params.amp").fillna(_MISSING)
    base["compile"] = _with_cuda_graph(df, _coalesce(df, "params.compile", "tags.compile").fillna(_MISSING))
    base["batch_size"] = _integer(df, "params.batch_size")
    # the resolved size (tag) first: params.img_size may be the request, 0 = "the model's default",
    # as a DDP launcher logs it before any rank has built the model
    img = _integer(df, "tags.img_size")
    img = img.where(img > 0, pd.NA)
    base["img_size"] = img.fillna(_integer(df, "params.img_size"))
    # processes in the whole job: a multi-host run's params.nproc is per host, its world_size tag is
    # what scaled (runs without the tag: nproc x nnodes, which is what the launcher starts)
    per_host = _integer(df, "params.nproc").fillna(1)
    base["nproc"] = _integer(df, "tags.world_size").fillna(per_host * _integer(df, "params.nnodes").fillna(1))
    base["ddp"] = _ddp_setting(df, base["nproc"])

    parts = []
    for task in TASKS:
        prefix = f"metrics.{task}_"
        mcols = [c for c in df.columns if c.startswith(prefix)]
        values = {c[len(prefix):]: pd.to_numeric(df[c], errors="coerce") for c in mcols}
        recorded = pd.Series(False, index=df.index)
        for v in values.values():
            recorded |= v.notna()
        # The task param is authoritative; without it (hand-made frames) trust the metrics.
        wanted = task_param.isin([task, "both"]).fillna(False) | (task_param.isna() & recorded)
        wanted &= recorded  # a task that logged nothing has nothing to compare
        if not wanted.any():
            continue
        part = base[wanted].copy()
        part["task"] = task
        for name in TASK_METRICS[task]:
            part[name] = np.nan
        for name, v in values.items():
            part[name] = v[wanted].astype(float)
        for name in SHARED_METRICS:
            col = f"metrics.{name}"
            part[name] = pd.to_numeric(df.loc[wanted, col], errors="coerce") if col in df else np.nan
        parts.append(part)

    if not parts:
        raise CompareError(
            f"the {len(df)} finished runs carry no metrics.infer_* or metrics.train_* values; "
            "check that they are vitreg benchmark runs (vitreg bench / vitreg import-timm)"
        )
    out = pd.concat(parts, ignore_index=True)
    for name in ALL_METRICS:
        if name not in out:
            out[name] = np.nan
    extra = [c for c in out.columns if c not in _ID_COLUMNS and c not in ALL_METRICS]
    out = out[list(_ID_COLUMNS) + list(ALL_METRICS) + sorted(extra)]
    return out.sort_values(["model", "task", "gpu", "run_id"], kind="stable").reset_index(drop=True)


def _text(df: pd.DataFrame, col: str) -> pd.Series | None:
    """The column as object-dtype strings, with NaN/None/'' all meaning missing."""
    if col not in df:
        return None
    s = df[col].astype(object)
    s = s.where(s.notna(), None).map(lambda v: None if v is None else str(v).strip())
    return s.where(s.map(lambda v: bool(v)), None).astype(object)


def _coalesce(df: pd.DataFrame, *cols: str) -> pd.Series:
    """First non-missing value across ``cols``, row by row (missing stays NaN)."""
    out = pd.Series([None] * len(df), index=df.index, dtype=object)
    for col in cols:
        s = _text(df, col)
        if s is not None:
            out = out.where(out.notna(), s)
    return out.where(out.notna(), np.nan).astype(object)


def _is_true(value) -> bool:
    """A logged boolean param ('true', 'True', '1', ...) as the spec parsed it; missing is false."""
    return isinstance(value, str) and value.strip().lower() in _TRUE


def _with_cuda_graph(df: pd.DataFrame, compile_: pd.Series) -> pd.Series:
    """``compile`` plus ``+cudagraph`` for runs whose steps were replayed from a CUDA graph
    (``cuda_graph=true``): a different way of running the same step, kept apart like a compile mode
    (and, in :func:`compile_amp_gains`, compared with plain ``off`` as one)."""
    on = _coalesce(df, "params.cuda_graph", "tags.cuda_graph").map(_is_true).astype(bool)
    return compile_.where(~on, compile_.astype(str) + "+cudagraph")


def _ddp_setting(df: pd.DataFrame, nproc: pd.Series) -> pd.Series:
    """The DDP settings as one configuration string: ``-`` for single-process runs (the settings do
    nothing there), else ``bucket<MB>`` plus ``+static`` for ``ddp_static_graph=true``, ``+bf16``
    / ``+fp16`` for a ``ddp_comm_hook``, and ``+NAME=VALUE`` for each NCCL variable of the run's
    ``nccl_env`` tag that is not the same in every multi-process run compared (``NCCL_MAX_CTAS=8`` on
    some runs and not on others; a variable every run has, such as the image's ``NCCL_VERSION``, says
    nothing and is left out). Runs that predate the settings (no params) ran with torch's defaults,
    which is what they get here."""
    bucket = pd.to_numeric(df["params.ddp_bucket_mb"], errors="coerce") if "params.ddp_bucket_mb" in df else None
    static = _text(df, "params.ddp_static_graph")
    hook = _text(df, "params.ddp_comm_hook")
    multi = [i for i in range(len(df)) if nproc.iloc[i] is not pd.NA and int(nproc.iloc[i]) > 1]
    nccl = _nccl_differences(_text(df, "tags.nccl_env"), multi)
    out = ["-"] * len(df)
    for i in multi:
        mb = bucket.iloc[i] if bucket is not None and pd.notna(bucket.iloc[i]) else DDP_BUCKET_MB
        static_on = static is not None and _is_true(static.iloc[i])
        comm = hook.iloc[i] if hook is not None else None
        out[i] = (f"bucket{mb:g}" + ("+static" if static_on else "")
                  + (f"+{comm.lower()}" if isinstance(comm, str) and comm.lower() != "none" else "")
                  + "".join(f"+{k}={v}" for k, v in nccl[i]))
    return pd.Series(out, index=df.index, dtype=object)


def _nccl_differences(tags: pd.Series | None, rows: list[int]) -> dict[int, list[tuple[str, str]]]:
    """For each of ``rows``: the ``(name, value)`` pairs of its ``nccl_env`` tag (``"K=V;K=V"``)
    whose variable is not set to one same value in all of ``rows``, sorted by name."""
    env = {i: _nccl_vars(tags.iloc[i] if tags is not None else None) for i in rows}
    varying = {k for k in set().union(*env.values()) if len({e.get(k) for e in env.values()}) > 1}
    return {i: sorted((k, v) for k, v in e.items() if k in varying) for i, e in env.items()}


def _nccl_vars(tag: str | None) -> dict[str, str]:
    """An ``nccl_env`` tag (``"K=V;K=V"``, as :func:`vitreg.hardware.env.nccl_env` writes it) as a dict; missing: empty."""
    return dict(kv.split("=", 1) for kv in (tag or "").split(";") if "=" in kv)


def _integer(df: pd.DataFrame, col: str) -> pd.Series:
    """A param column ('64', '64.0', NaN) as a nullable integer."""
    if col not in df:
        return pd.Series(pd.NA, index=df.index, dtype="Int64")
    num = pd.to_numeric(df[col], errors="coerce")
    return num.round().astype("Int64")


def _ensure_tidy(frame: pd.DataFrame) -> pd.DataFrame:
    """Accept either raw search_runs output or an already tidy frame."""
    if frame is not None and len(frame) and "gpu" in frame and "task" in frame:
        if not any(str(c).startswith("metrics.") for c in frame.columns):
            return frame
    return tidy(frame)


# --------------------------------------------------------------------------------------------
# comparison


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
        out = {}
        for gpu, g in rows.groupby("gpu", sort=True):
            s = g["speedup"].to_numpy(float)
            s = s[s > 0]
            if len(s):
                out[str(gpu)] = float(np.exp(np.mean(np.log(s))))
        return out

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
    runs_df: pd.DataFrame,
    baseline: str | None = None,
    metric: str = "throughput_img_per_s",
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> Comparison:
    """Compare GPUs configuration by configuration.

    ``runs_df`` is ``mlflow.search_runs()`` output (or :func:`tidy` output). Runs are grouped by
    :data:`CONFIG_KEYS` plus ``gpu``; each group is summarised by the median of ``metric`` and its
    spread. With ``baseline`` (a GPU label such as ``"a100"``, matched case-insensitively) each
    group also gets a speedup against the baseline GPU's group for the same configuration:

    * both sides have >= 2 runs: percentile bootstrap (``n_boot`` resamples of each side's runs,
      independently, ``seed`` for reproducibility) of the ratio of medians. The verdict is
      "faster"/"slower" ("better"/"worse" for non-speed metrics) only when the interval excludes
      1 *and* the relative change exceeds both sides' own spread ((max-min)/median of the runs);
      otherwise "within noise".
    * either side has a single run: point estimate only, verdict "single run".
    * the baseline GPU never ran the configuration: verdict "no baseline".

    ``baseline=None`` gives the per-GPU summary without speedup columns.

    Raises :class:`CompareError` for an empty frame, no finished runs, an unknown ``metric``
    (the message lists the available ones), or a baseline GPU with no runs (the message lists
    the GPUs present).
    """
    if n_boot < 100:
        raise CompareError(f"n_boot={n_boot} is too few bootstrap resamples; use at least 100 (default 2000)")
    if not 0.5 <= confidence < 1:
        raise CompareError(f"confidence={confidence} must be in [0.5, 1), e.g. 0.95")
    runs = _ensure_tidy(runs_df)
    higher = _polarity(metric, runs)

    measured = runs[runs[metric].notna()]
    if measured.empty:
        have = sorted(runs["task"].unique())
        raise CompareError(
            f"no finished run recorded {metric} (runs have task {', '.join(have)}); pick a metric "
            f"of those tasks, e.g. {_suggest_metric(runs)}"
        )
    gpus = sorted(measured["gpu"].astype(str).unique())

    if baseline is not None:
        match = [g for g in gpus if g.lower() == str(baseline).strip().lower()]
        if not match:
            raise CompareError(
                f"baseline GPU {baseline!r} has no finished runs with {metric}; GPUs present: "
                f"{', '.join(gpus)}; pass one of them as the baseline"
            )
        baseline = match[0]

    rng = np.random.default_rng(seed)
    # Time and rate metrics speak of speed; memory, MFU and CV of better/worse.
    speed = "throughput_img" in metric or metric.startswith(("latency_ms", "step_ms"))
    up, down = (FASTER, SLOWER) if speed else (BETTER, WORSE)
    companions = [m for m in ("throughput_img_per_s", "latency_ms_p50", "step_ms_p50",
                              "peak_mem_allocated_mb", "mfu") if m != metric]

    rows = []
    # dropna=False: a configuration with an unrecorded batch size is still a configuration.
    for config, cfg_runs in measured.groupby(list(CONFIG_KEYS), dropna=False, sort=True):
        by_gpu = {str(g): grp for g, grp in cfg_runs.groupby("gpu", sort=True)}
        base_vals = by_gpu[baseline][metric].to_numpy(float) if baseline in by_gpu else None
        # Baseline first, then the rest best-first, so each block reads top-down.
        order = sorted(by_gpu, key=lambda g: (g != baseline, _sort_value(by_gpu[g][metric], higher)))
        for gpu in order:
            grp = by_gpu[gpu]
            vals = grp[metric].to_numpy(float)
            med = float(np.median(vals))
            row = dict(zip(CONFIG_KEYS, config))
            row.update(
                gpu=gpu,
                n_runs=int(len(vals)),
                sources="+".join(sorted(grp["source"].astype(str).unique())),
                **{
                    f"{metric}_median": med,
                    f"{metric}_min": float(vals.min()),
                    f"{metric}_max": float(vals.max()),
                    f"{metric}_cv": _cv(vals),
                    f"{metric}_spread": _spread(vals),
                },
            )
            for m in companions:
                row[m] = float(grp[m].median()) if grp[m].notna().any() else np.nan
            if baseline is not None:
                row.update(_versus(vals, base_vals, gpu == baseline, higher, up, down, n_boot, rng,
                                   confidence))
                row["baseline"] = baseline
            rows.append(row)

    table = pd.DataFrame(rows)
    lead = list(CONFIG_KEYS) + ["gpu", "n_runs", "sources"]
    stats = [f"{metric}_{s}" for s in ("median", "min", "max", "cv", "spread")]
    tail = ["baseline", "speedup", "ci_low", "ci_high", "verdict"] if baseline is not None else []
    table = table[lead + stats + companions + tail]
    for key in ("batch_size", "img_size", "nproc"):
        table[key] = table[key].astype("Int64")

    return Comparison(
        table=table.reset_index(drop=True),
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


def _versus(vals, base_vals, is_baseline, higher, up, down, n_boot, rng, confidence) -> dict:
    """Speedup, interval and verdict of one GPU group against the baseline group."""
    if is_baseline:
        return dict(speedup=1.0, ci_low=np.nan, ci_high=np.nan, verdict=BASELINE)
    if base_vals is None:
        return dict(speedup=np.nan, ci_low=np.nan, ci_high=np.nan, verdict=NO_BASELINE)
    med, base_med = float(np.median(vals)), float(np.median(base_vals))
    speedup = _improvement(med, base_med, higher)
    if len(vals) < 2 or len(base_vals) < 2:
        return dict(speedup=speedup, ci_low=np.nan, ci_high=np.nan, verdict=SINGLE_RUN)
    lo, hi = _bootstrap_ci(vals, base_vals, higher, n_boot, rng, confidence)
    # Relative change of the metric itself, judged against each side's run-to-run range: a CI
    # from 3 runs can exclude 1 by luck, but not while the change is smaller than the scatter.
    change = abs(med - base_med) / abs(base_med) if base_med else math.inf
    noise = max(_spread(vals), _spread(base_vals))
    if (lo > 1 or hi < 1) and change > noise:
        verdict = up if speedup > 1 else down
    else:
        verdict = WITHIN_NOISE
    return dict(speedup=speedup, ci_low=lo, ci_high=hi, verdict=verdict)


def _bootstrap_ci(vals, base_vals, higher, n_boot, rng, confidence) -> tuple[float, float]:
    """Percentile bootstrap of the improvement factor, resampling each side's runs independently."""
    a = np.asarray(vals, float)
    b = np.asarray(base_vals, float)
    ma = np.median(a[rng.integers(0, len(a), size=(n_boot, len(a)))], axis=1)
    mb = np.median(b[rng.integers(0, len(b), size=(n_boot, len(b)))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = ma / mb if higher else mb / ma
    ratios = ratios[np.isfinite(ratios)]
    if not len(ratios):
        return np.nan, np.nan
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return float(lo), float(hi)


def _improvement(value: float, base: float, higher: bool) -> float:
    num, den = (value, base) if higher else (base, value)
    return float(num / den) if den else np.nan


def _cv(vals: np.ndarray) -> float:
    if len(vals) < 2 or not np.mean(vals):
        return np.nan
    return float(np.std(vals, ddof=1) / abs(np.mean(vals)))


def _spread(vals: np.ndarray) -> float:
    med = np.median(vals)
    return float((np.max(vals) - np.min(vals)) / abs(med)) if med else np.nan


def _sort_value(s: pd.Series, higher: bool) -> float:
    med = float(s.median())
    return -med if higher else med


def _polarity(metric: str, runs: pd.DataFrame) -> bool:
    """True when a larger value of ``metric`` is better; CompareError for unknown metrics."""
    measurable = [c for c in runs.columns if c not in _ID_COLUMNS and c not in SHARED_METRICS]
    if metric not in measurable:
        raise CompareError(
            f"unknown metric {metric!r}; use one of: {', '.join(sorted(measurable))} "
            "(names without the infer_/train_ prefix)"
        )
    if metric in _HIGHER_IS_BETTER or "throughput_img" in metric or metric.endswith("mfu"):
        return True
    if metric in _LOWER_IS_BETTER or "_ms" in metric or "mem" in metric or metric.endswith("_cv"):
        return False
    raise CompareError(
        f"metric {metric!r} has no better direction vitreg knows of; compare on "
        "throughput_img_per_s, latency_ms_p50, step_ms_p50, peak_mem_allocated_mb or mfu"
    )


def _suggest_metric(runs: pd.DataFrame) -> str:
    return "latency_ms_p50" if (runs["task"] == "infer").any() else "step_ms_p50"


# --------------------------------------------------------------------------------------------
# scaling and compile/amp gains


def scaling_efficiency(runs_df: pd.DataFrame, metric: str = "throughput_img_per_s") -> pd.DataFrame:
    """Multi-process (DDP) scaling of train runs.

    Train runs are grouped by configuration minus ``nproc`` (same per-process batch, i.e. weak
    scaling) and GPU. For every ``nproc`` N of a group that has some N > 1:
    ``speedup_vs_1 = median(N) / median(1)`` and ``efficiency = median(N) / (N * median(1))``,
    where ``metric`` is the global ``train_throughput_img_per_s``. Both are NaN when the group
    has no single-process run to scale from. Returns an empty frame (same columns) when no
    multi-process train runs exist. Accepts raw search_runs output or :func:`tidy` output.
    """
    keys = ["model", "task", "amp", "compile", "batch_size", "img_size", "gpu"]
    columns = keys + ["nproc", "ddp", "n_runs", f"{metric}_median", "speedup_vs_1", "efficiency"]
    runs = _ensure_tidy(runs_df)
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


def compile_amp_gains(tidy_df: pd.DataFrame, metric: str = "throughput_img_per_s") -> pd.DataFrame:
    """What ``torch.compile`` and mixed precision buy, per (model, task, gpu, batch, img, nproc).

    Compares medians of ``metric`` between configurations that differ only in ``compile`` or
    ``amp``, on the same GPU:

    * ``change="compile=<mode>"``, ``held="amp=<x>"``: compile mode vs ``compile=off``;
    * ``change="amp=<dtype>"``, ``held="compile=<y>"``: bf16/fp16 vs ``amp=off``;
    * ``change="amp=<dtype>+compile=<mode>"``, ``held="-"``: both vs neither.

    Rows appear only where both sides exist. ``speedup = new/base`` (throughput) or base/new for
    time-like metrics, so >1 always means the change helped. Accepts raw search_runs output too.
    """
    keys = ["model", "task", "gpu", "batch_size", "img_size", "nproc", "ddp"]
    columns = keys + ["change", "held", "base_median", "new_median", "speedup", "n_base", "n_new"]
    runs = _ensure_tidy(tidy_df)
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
                                 new_median=nm, speedup=_improvement(nm, bm, higher),
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


# --------------------------------------------------------------------------------------------
# formatting


def format_table(comparison: Comparison) -> str:
    """The comparison as fixed-width, aligned text for a terminal.

    Configuration keys that are the same on every row move to a header line so the table only
    shows what varies; exact values are in the CSV written by :func:`write_report`.
    """
    t = comparison.table
    m = comparison.metric
    fixed, varying = _split_constant(t, CONFIG_KEYS)
    direction = "higher is better" if comparison.higher_is_better else "lower is better"
    lines = [f"metric: {m} (median over runs, {direction})"]
    if comparison.baseline:
        lines.append(
            f"baseline: {comparison.baseline}; speedup >1 = better than baseline; "
            f"{comparison.confidence:.0%} bootstrap CI ({comparison.n_boot} resamples)"
        )
    if fixed:
        lines.append("fixed: " + " ".join(f"{k}={_cell(v)}" for k, v in fixed.items()))

    cols = varying + ["gpu", "n_runs", f"{m}_median", f"{m}_min", f"{m}_max", f"{m}_cv"]
    heads = {f"{m}_median": "median", f"{m}_min": "min", f"{m}_max": "max", f"{m}_cv": "cv",
             "n_runs": "n", "batch_size": "batch", "img_size": "img"}
    body = _rows(t, cols)
    header = [heads.get(c, c) for c in cols]
    right = [c not in ("model", "task", "amp", "compile", "gpu") for c in cols]
    if comparison.baseline:
        header += ["speedup", f"{comparison.confidence:.0%} CI", "verdict"]
        right += [True, True, False]
        for row, (_, r) in zip(body, t.iterrows()):
            row += [_format_value("speedup", r["speedup"]), _format_ci(r["ci_low"], r["ci_high"]),
                    str(r["verdict"])]
    lines.append(_fixed_width(header, body, right))
    if not comparison.scaling.empty:
        s = comparison.scaling
        lines.append("\nscaling (train, weak scaling vs nproc=1):")
        scols = _split_constant(s, ["model", "amp", "compile", "batch_size", "img_size"])[1]
        scols += ["gpu", "nproc", "ddp", "n_runs", s.columns[-3], "speedup_vs_1", "efficiency"]
        lines.append(_fixed_width(
            [heads.get(c, c if c != s.columns[-3] else "median") for c in scols],
            _rows(s, scols),
            [c not in ("model", "amp", "compile", "gpu", "ddp") for c in scols],
        ))
    return "\n".join(lines)


def _rows(df: pd.DataFrame, cols: list[str]) -> list[list[str]]:
    """Formatted cells of ``df[cols]``, row-major."""
    formatted = [_format_column(c, df[c].astype(object)) for c in cols]
    return [list(r) for r in zip(*formatted)] if formatted else []


def _split_constant(t: pd.DataFrame, keys) -> tuple[dict, list[str]]:
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


def _cell(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA else str(v)


def _format_column(col: str, values) -> list[str]:
    """Format a whole column with one precision, so digits line up (1,012 next to 994, not 994.0)."""
    vals = list(values)
    nums = [float(v) for v in vals if isinstance(v, (float, np.floating)) and not math.isnan(v)]
    plain = not (col.endswith(("_cv", "_spread", "mfu")) or col in _RATIO_COLUMNS
                 or col == "efficiency" or col in _COUNT_COLUMNS)
    if not nums or not plain:
        return [_format_value(col, v) for v in vals]
    scale = max(abs(x) for x in nums)
    spec = ",.0f" if scale >= 1000 else ".1f" if scale >= 100 else ".2f" if scale >= 1 else ".3g"
    out = []
    for v in vals:
        if isinstance(v, (float, np.floating)) and not math.isnan(v):
            out.append(format(float(v), spec))
        else:
            out.append(_format_value(col, v))
    return out


_RATIO_COLUMNS = ("speedup", "ci_low", "ci_high", "speedup_vs_1", "geomean_speedup")
_COUNT_COLUMNS = ("n_runs", "n_base", "n_new", "nproc", "batch_size", "img_size", "world_size")


def _format_value(col: str, v) -> str:
    """Human formatting of one cell; the CSV keeps full precision."""
    if v is None or v is pd.NA or (isinstance(v, (float, np.floating)) and math.isnan(v)):
        return "-"
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


def _display(df: pd.DataFrame) -> pd.DataFrame:
    """A string copy of ``df`` with every cell formatted for humans (markdown, HTML)."""
    out = pd.DataFrame(index=df.index)
    for c in df.columns:
        out[c] = _format_column(c, df[c].astype(object))
    return out


def _readable(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without columns nobody recorded (all NaN); the CSV keeps the full schema."""
    return df.loc[:, [c for c in df.columns if not df[c].isna().all()]] if len(df) else df


def _markdown(df: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table (tabulate is not a dependency)."""
    if df.empty:
        return "_(none)_"
    df = _readable(df)
    shown = _display(df)
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    header = "| " + " | ".join(esc(c) for c in df.columns) + " |"
    rule = "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"
    rows = ["| " + " | ".join(esc(v) for v in r) + " |" for r in shown.itertuples(index=False)]
    return "\n".join([header, rule] + rows)


# --------------------------------------------------------------------------------------------
# report


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
    _plot_by_gpu(c, d / "throughput_by_gpu.png")
    names.append("throughput_by_gpu.png")
    if not c.gains.empty:
        c.gains.to_csv(d / "compile_amp_gains.csv", index=False)
        _plot_gains(c, d / "compile_amp_gains.png")
        names += ["compile_amp_gains.csv", "compile_amp_gains.png"]
    if not c.scaling.empty:
        c.scaling.to_csv(d / "scaling.csv", index=False)
        names.append("scaling.csv")
    (d / "comparison.md").write_text(_report_markdown(c, names), encoding="utf-8")
    (d / "comparison.html").write_text(_report_html(c, names), encoding="utf-8")
    return ["comparison.md", "comparison.html"] + names


def _about(c: Comparison) -> list[str]:
    direction = "higher is better" if c.higher_is_better else "lower is better"
    s = c.summary()
    lines = [
        f"metric: `{c.metric}` (median over repeated runs, {direction})",
        f"runs: {s['n_runs']} finished runs, {s['n_configurations']} configurations, "
        f"GPUs: {', '.join(c.gpus)}",
    ]
    if c.baseline:
        lines += [
            f"baseline: `{c.baseline}`; speedup > 1 means better than the baseline on the same "
            "configuration",
            f"verdict: faster/slower only when the {c.confidence:.0%} bootstrap interval of the "
            f"ratio of medians ({c.n_boot} resamples, seed {c.seed}) excludes 1 and the change "
            "exceeds both sides' run-to-run spread; 'single run' when either side ran once",
        ]
    return lines


def _report_markdown(c: Comparison, names: list[str]) -> str:
    parts = ["# vitreg GPU comparison", ""] + [f"- {line}" for line in _about(c)]
    parts += ["", "## Per configuration and GPU", "", _markdown(c.table), ""]
    geo = c.geomean_speedup()
    if geo:
        parts += ["## Geometric-mean speedup vs baseline", "",
                  _markdown(pd.DataFrame({"gpu": list(geo), "geomean_speedup": list(geo.values())})),
                  ""]
    parts += ["![metric by GPU](throughput_by_gpu.png)", ""]
    if not c.scaling.empty:
        parts += ["## Multi-process scaling (train)", "", _markdown(c.scaling), ""]
    if not c.gains.empty:
        parts += ["## torch.compile and AMP gains", "", _markdown(c.gains), ""]
        if "compile_amp_gains.png" in names:
            parts += ["![compile and AMP gains](compile_amp_gains.png)", ""]
    return "\n".join(parts)


def _report_html(c: Comparison, names: list[str]) -> str:
    def table(df):
        return _display(_readable(df)).to_html(index=False, escape=True, border=0, na_rep="-")

    body = ["<h1>vitreg GPU comparison</h1>", "<ul>"]
    body += [f"<li>{html.escape(line).replace('`', '')}</li>" for line in _about(c)]
    body += ["</ul>", "<h2>Per configuration and GPU</h2>", table(c.table)]
    geo = c.geomean_speedup()
    if geo:
        body += ["<h2>Geometric-mean speedup vs baseline</h2>",
                 table(pd.DataFrame({"gpu": list(geo), "geomean_speedup": list(geo.values())}))]
    body.append('<p><img src="throughput_by_gpu.png" alt="metric by GPU"></p>')
    if not c.scaling.empty:
        body += ["<h2>Multi-process scaling (train)</h2>", table(c.scaling)]
    if not c.gains.empty:
        body += ["<h2>torch.compile and AMP gains</h2>", table(c.gains)]
        if "compile_amp_gains.png" in names:
            body.append('<p><img src="compile_amp_gains.png" alt="compile and AMP gains"></p>')
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:90%}"
             "th,td{border:1px solid #ccc;padding:2px 8px;text-align:right}"
             "th{background:#f4f4f4}img{max-width:100%}")
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>vitreg GPU comparison"
            f"</title><style>{style}</style></head>\n<body>\n" + "\n".join(body) +
            "\n</body></html>\n")


def _figure(width: float, height: float):
    # The object API with an explicit Agg canvas: no pyplot global state and no GUI backend,
    # so this works headless and does not change the caller's matplotlib backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _config_labels(t: pd.DataFrame) -> list[str]:
    """Short labels for configurations, naming only the keys that vary between them."""
    fixed, varying = _split_constant(t, CONFIG_KEYS)
    single_model = t["model"].nunique() == 1
    short = {"batch_size": "bs", "img_size": "img", "nproc": "x"}
    labels = []
    for _, r in t.iterrows():
        bits = " ".join(f"{short.get(k, '')}{_cell(r[k])}" for k in varying if k != "model")
        labels.append(bits or str(r["model"]) if single_model else f"{r['model']}\n{bits}".strip())
    return labels


def _plot_by_gpu(c: Comparison, path: Path) -> None:
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


def _plot_gains(c: Comparison, path: Path) -> None:
    g = c.gains
    labels = [f"{r.model} {r.task} {r.gpu} bs{_cell(r.batch_size)}: {r.change}"
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
