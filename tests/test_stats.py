"""vitreg.analysis.stats: the bootstrap interval is the seed's, and only the seed's."""

from __future__ import annotations

import numpy as np

from vitreg.analysis.stats import bootstrap_ci

# 12 runs a side with spread: the interval's ends move from one resampling to the next (with 3-4 runs the
# medians of resamples take so few values that any two seeds can give the same percentiles).
VALS = np.random.default_rng(1).normal(1000, 30, 12)
BASE = np.random.default_rng(2).normal(900, 30, 12)


def _ci(seed):
    return bootstrap_ci(VALS, BASE, True, 200, np.random.default_rng(seed), 0.95)


def test_bootstrap_interval_is_reproducible_with_a_seed_and_changes_with_it():
    assert _ci(7) == _ci(7)
    assert len({_ci(seed) for seed in range(5)}) == 5  # a seed that is ignored gives one interval


def test_a_side_of_one_run_stays_fixed():
    lo, hi = bootstrap_ci([950.0], [1000.0, 990.0, 1010.0, 1005.0], True, 500, np.random.default_rng(0), 0.95)
    assert 950 / 1010 <= lo <= hi <= 950 / 990
    assert np.isnan(bootstrap_ci([1.0], [2.0], True, 100, np.random.default_rng(0), 0.95)[0])
