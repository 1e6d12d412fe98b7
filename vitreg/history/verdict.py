"""Did a candidate run get slower than its history? The verdict on one configuration x GPU, and change points.

"regressed" or "improved" needs the bootstrap interval of the ratio of medians (> 1 is better) to exclude 1
*and* the change to exceed a threshold from the configuration's own spread, scaled by Student's t, never below
:data:`NOISE_FLOOR`. tests/test_check_stats.py: a 5 % step after 10 runs at 1 % noise is flagged in >= 95 of
100 seeds, pure noise at 1-3 % CV in <= 5 of 100. Change points: ``ruptures`` (``KernelCPD``, linear kernel:
PELT in C, 0.5 ms on 500 runs) on the series relative to its robust run-to-run noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vitreg.analysis.stats import bootstrap_ci

REGRESSED, IMPROVED, WITHIN_NOISE, NOT_ENOUGH = "regressed", "improved", "within noise", "not enough history"
TOO_NOISY = "too noisy"
VERDICTS = (REGRESSED, IMPROVED, WITHIN_NOISE, NOT_ENOUGH, TOO_NOISY)
#: the verdicts of a series the check cannot judge: it says what it needs, and exits with a code of its own
UNJUDGED = (NOT_ENOUGH, TOO_NOISY)

# The change a gate must be able to see: a series whose threshold is wider is "too noisy", not "within noise"
# (a loaded 2-core host gave a threshold of 3444 %). 15 %: ten runs at 3 % CV stay judged in every seed of
# tests/test_check_stats.py; at 10 %, 6 of 100 came out too noisy by the luck of their scatter.
CATCH = 0.15

# Fewer than three earlier runs give no estimate of their scatter worth a verdict: "not enough history".
MIN_HISTORY = 3

# The smallest change ever called a regression: runs on separate machine starts differ more than the windows
# inside a run (the same ViT-B DDP control moved 1.8 % between two starts of the same pair of GPUs).
NOISE_FLOOR = 0.02

# Two-sided, for the interval and the threshold's t quantile: in 300 simulated seeds pure noise crossed either
# threshold in 2.7-4.3 %, a 5 % step at 1 % noise was caught in 98.7 % (0.99 caught only 89 %).
CONFIDENCE = 0.95
N_BOOT = 2000


@dataclass(frozen=True)
class Verdict:
    verdict: str  # one of VERDICTS
    ratio: float  # median(candidate) / median(history); for a lower-is-better metric inverted: > 1 is better
    ci_low: float  # bootstrap interval of ratio (NaN without enough history)
    ci_high: float
    threshold: float  # the relative change a verdict needs (>= NOISE_FLOOR)
    noise: float  # the relative spread of one run that the threshold comes from
    n_history: int
    n_candidate: int


def noise_of(history, run_cvs=()) -> float:
    """The relative spread of one run of this configuration: the history's scatter (sample standard deviation over
    the median), or the median of the runs' own ``throughput_cv`` where that is larger (a short history can look
    quieter than it is)."""
    cvs = np.asarray([c for c in run_cvs if c is not None and math.isfinite(c)], float)
    own = float(np.median(cvs)) if len(cvs) else 0.0
    v = np.asarray(history, float)
    med = np.median(v) if len(v) else 0.0
    scatter = float(np.std(v, ddof=1) / abs(med)) if len(v) >= 2 and med else 0.0
    return max(own, scatter if math.isfinite(scatter) else 0.0)


def threshold_of(noise: float, n_history: int, n_candidate: int) -> float:
    """The relative change pure noise stays within with :data:`CONFIDENCE` (Student's t), at least the floor."""
    from scipy.stats import t

    quantile = float(t.ppf(1 - (1 - CONFIDENCE) / 2, n_history - 1))
    return max(NOISE_FLOOR, quantile * noise * math.sqrt(1 / n_candidate + 1 / n_history))


def judge(candidate, history, higher: bool = True, run_cvs=(), seed: int = 0, n_boot: int = N_BOOT) -> Verdict:
    """The verdict on the candidate runs' values against the earlier runs' ``history``; ``run_cvs``: the runs' own
    ``throughput_cv``."""
    cand, hist = np.asarray(candidate, float), np.asarray(history, float)
    med_c, med_h = float(np.median(cand)), (float(np.median(hist)) if len(hist) else np.nan)
    ratio = (med_c / med_h if higher else med_h / med_c) if len(hist) and med_h and med_c else np.nan
    if len(hist) < MIN_HISTORY or not math.isfinite(ratio):
        return Verdict(NOT_ENOUGH, ratio, np.nan, np.nan, np.nan, np.nan, len(hist), len(cand))
    noise = noise_of(hist, run_cvs)
    threshold = threshold_of(noise, len(hist), len(cand))
    lo, hi = bootstrap_ci(cand, hist, higher, n_boot, np.random.default_rng(seed), CONFIDENCE)
    # an interval wholly past CATCH is a change whatever the noise: "too noisy" is for one that straddles it
    if hi < 1 and (1 - ratio > threshold or hi < 1 - CATCH):
        verdict = REGRESSED
    elif lo > 1 and (ratio - 1 > threshold or lo > 1 + CATCH):
        verdict = IMPROVED
    elif threshold > CATCH:
        verdict = TOO_NOISY
    else:
        verdict = WITHIN_NOISE
    return Verdict(verdict, ratio, lo, hi, threshold, noise, len(hist), len(cand))


def needs(verdict: Verdict) -> str:
    """What a series the check cannot judge needs ("" for a judged one): more runs, or quieter ones."""
    if verdict.verdict == NOT_ENOUGH:
        more = MIN_HISTORY - verdict.n_history
        return (f"needs {MIN_HISTORY} earlier runs of this configuration on this GPU, has {verdict.n_history}: "
                f"bench it {more} more time(s)")
    if verdict.verdict != TOO_NOISY:
        return ""
    quiet = verdict.noise * CATCH / verdict.threshold  # the noise at which this history would see CATCH
    # the fewest history runs at this noise whose threshold is within CATCH (none up to 100: say nothing)
    longer = next((n for n in range(verdict.n_history + 1, 101)
                   if threshold_of(verdict.noise, n, verdict.n_candidate) <= CATCH), None)
    more = f", or {longer} runs of history at this noise" if longer else ""
    return (f"sees only changes over {verdict.threshold:.1%}, not {CATCH:.0%}: needs runs with under {quiet:.1%} "
            f"spread (now {verdict.noise:.1%}: a quiet host, longer windows){more}")


# ---------------------------------------------------------------- change points

MIN_SEGMENT = 3  # runs on each side of a change: one odd run is an outlier, not a new level
PENALTY = 4.0  # x log(n); pure 1-3 % noise gave a spurious change in few series (tests/test_check_stats.py)
MAD_TO_SD = 1.4826  # the median absolute deviation of a normal sample times this is its standard deviation


def noise_scale(values) -> float:
    """The relative run-to-run noise of ``values``: robust standard deviation of the successive
    differences over sqrt(2), at least NOISE_FLOOR / 4."""
    v = np.asarray(values, float)
    med = float(np.median(v))
    if len(v) < 3 or not med:
        return NOISE_FLOOR / 4
    diffs = np.diff(v / med)
    return max(float(np.median(np.abs(diffs - np.median(diffs)))) * MAD_TO_SD / math.sqrt(2), NOISE_FLOOR / 4)


def change_points(values) -> list[int]:
    """The positions where a new level starts (0 < i < len(values)), oldest first; none in a series too
    short to hold two segments of :data:`MIN_SEGMENT` runs."""
    import ruptures

    v = np.asarray(values, float)
    if len(v) < 2 * MIN_SEGMENT or not np.all(np.isfinite(v)):
        return []
    signal = (v / np.median(v) / noise_scale(v)).reshape(-1, 1)
    ends = ruptures.KernelCPD(kernel="linear", min_size=MIN_SEGMENT).fit(signal).predict(pen=PENALTY * math.log(len(v)))
    points = [int(e) for e in ends[:-1]]  # ruptures ends every segment, the last at len(v)
    # A last run far off pulls in a segment of MIN_SEGMENT runs whose median moved by less than the floor.
    segments = segment_medians(v, points)
    return [p for p, (_, _, left), (_, _, right) in zip(points, segments, segments[1:])
            if abs(right / left - 1) >= NOISE_FLOOR]


def segment_medians(values, points: list[int]) -> list[tuple[int, int, float]]:
    v = np.asarray(values, float)
    bounds = [0, *points, len(v)]
    return [(a, b, float(np.median(v[a:b]))) for a, b in zip(bounds, bounds[1:])]
