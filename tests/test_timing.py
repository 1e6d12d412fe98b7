import time

import pytest

from vitreg.measure.timing import percentile, summarize, time_window, wall_seconds


def test_perf_counter_window_measures_a_known_sleep():
    win = time_window(lambda: time.sleep(0.02), 5, "cpu")
    assert win.iters == 5
    for ms in win.iter_ms:
        assert 19.5 <= ms < 40  # sleep never returns early; allow scheduler jitter above
    assert win.total_ms == pytest.approx(sum(win.iter_ms), rel=0.01)


def test_wall_seconds():
    assert 0.03 <= wall_seconds(lambda: time.sleep(0.03), "cpu") < 0.1


def test_percentile_matches_numpy_linear():
    data = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(data, 50) == 5.5
    assert percentile(data, 90) == pytest.approx(9.1)
    assert percentile(data, 0) == 1 and percentile(data, 100) == 10


def test_summarize_median_spread_cv():
    s = summarize([100.0, 110.0, 90.0])
    assert s.median == 100.0 and s.min == 90.0 and s.max == 110.0 and s.n == 3
    assert s.cv == pytest.approx(8.16497 / 100.0, rel=1e-4)
    assert summarize([5.0]).cv == 0.0
    with pytest.raises(ValueError):
        summarize([])
