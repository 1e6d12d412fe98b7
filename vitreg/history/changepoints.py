"""Where a series' level changed: change points found by ``ruptures`` (``KernelCPD`` with the linear kernel:
the least-squares cost of a shift in the mean, solved by ruptures' C implementation of PELT, Killick et al.
2012; its Python ``Pelt`` took 2.2 s on 500 runs, this 0.5 ms), not by a hand-written detector.

The series is made relative (value / its median) and divided by its noise, estimated from the run-to-run
differences (their median absolute value, which a few steps do not move, unlike the standard deviation);
a change point must then pay a BIC-like penalty of :data:`PENALTY` x log(n). A level shift much smaller
than :data:`vitreg.history.verdict.NOISE_FLOOR` is never a change point: the noise is taken as at least a
quarter of the floor.
"""

from __future__ import annotations

import math

import numpy as np

from vitreg.history.verdict import NOISE_FLOOR

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
    """``(start, end, median)`` of each segment between change points (end exclusive)."""
    v = np.asarray(values, float)
    bounds = [0, *points, len(v)]
    return [(a, b, float(np.median(v[a:b]))) for a, b in zip(bounds, bounds[1:])]
