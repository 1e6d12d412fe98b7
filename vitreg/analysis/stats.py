"""When is a difference between two groups of benchmark runs real? Deliberately modest: benchmarks repeat a
handful of times, so a group is its median and range, and "faster" or "slower" needs a bootstrap interval of the
ratio of medians that excludes 1 *and* a change larger than either side's run-to-run spread. With one run on
either side the verdict says "single run" instead of guessing."""

from __future__ import annotations

import math

import numpy as np

FASTER, SLOWER, BETTER, WORSE = "faster", "slower", "better", "worse"
WITHIN_NOISE, SINGLE_RUN = "within noise", "single run"
BASELINE, NO_BASELINE = "baseline", "no baseline"
# A run filed under a GPU that did not run it: no speedup and no verdict unless asked for (then a suffix).
MISLABELLED = "mislabelled"


def improvement(value: float, base: float, higher: bool) -> float:
    """The factor by which ``value`` is better than ``base`` (>1: better), NaN against zero."""
    num, den = (value, base) if higher else (base, value)
    return float(num / den) if den else np.nan


def cv(vals: np.ndarray) -> float:
    """Sample std / |mean|; NaN for fewer than two values or a zero mean."""
    if len(vals) < 2 or not np.mean(vals):
        return np.nan
    return float(np.std(vals, ddof=1) / abs(np.mean(vals)))


def spread(vals: np.ndarray) -> float:
    """(max - min) / |median|: the runs' own range, relative."""
    med = np.median(vals)
    return float((np.max(vals) - np.min(vals)) / abs(med)) if med else np.nan


def bootstrap_ci(vals, base_vals, higher: bool, n_boot: int, rng, confidence: float) -> tuple[float, float]:
    """Percentile bootstrap interval of the improvement factor (ratio of medians), each side resampled apart. A
    side of one run stays fixed (the interval then holds the other side's uncertainty alone;
    :mod:`vitreg.history.verdict` adds the lone run's own noise to its threshold); NaN, NaN when neither has two."""
    from scipy.stats import bootstrap

    vals, base_vals = np.asarray(vals, float), np.asarray(base_vals, float)

    def ratio(a, b, axis=-1):
        ma, mb = np.median(a, axis=axis), np.median(b, axis=axis)
        with np.errstate(divide="ignore", invalid="ignore"):
            return ma / mb if higher else mb / ma

    samples, statistic = (vals, base_vals), ratio
    if len(vals) < 2 and len(base_vals) < 2:
        return np.nan, np.nan
    if len(vals) < 2:
        samples, statistic = (base_vals,), lambda b, axis=-1: ratio(vals, b, axis)
    elif len(base_vals) < 2:
        samples, statistic = (vals,), lambda a, axis=-1: ratio(a, base_vals, axis)
    res = bootstrap(samples, statistic, n_resamples=n_boot, confidence_level=confidence, method="percentile",
                    paired=False, vectorized=True, rng=rng)
    lo, hi = res.confidence_interval
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return np.nan, np.nan
    return float(lo), float(hi)


def versus(vals, base_vals, is_baseline: bool, higher: bool, speed: bool, n_boot: int, rng,
           confidence: float) -> dict:
    """Speedup, interval and verdict of one group of runs against the baseline group; ``speed``: a rate or a time,
    "faster"/"slower" rather than "better"/"worse"."""
    if is_baseline:
        return dict(speedup=1.0, ci_low=np.nan, ci_high=np.nan, verdict=BASELINE)
    if base_vals is None:
        return dict(speedup=np.nan, ci_low=np.nan, ci_high=np.nan, verdict=NO_BASELINE)
    med, base_med = float(np.median(vals)), float(np.median(base_vals))
    speedup = improvement(med, base_med, higher)
    if len(vals) < 2 or len(base_vals) < 2:
        return dict(speedup=speedup, ci_low=np.nan, ci_high=np.nan, verdict=SINGLE_RUN)
    lo, hi = bootstrap_ci(vals, base_vals, higher, n_boot, rng, confidence)
    # Relative change of the metric itself, judged against each side's run-to-run range: a CI
    # from 3 runs can exclude 1 by luck, but not while the change is smaller than the scatter.
    change = abs(med - base_med) / abs(base_med) if base_med else math.inf
    noise = max(spread(vals), spread(base_vals))
    if (lo > 1 or hi < 1) and change > noise:
        up, down = (FASTER, SLOWER) if speed else (BETTER, WORSE)
        verdict = up if speedup > 1 else down
    else:
        verdict = WITHIN_NOISE
    return dict(speedup=speedup, ci_low=lo, ci_high=hi, verdict=verdict)
