import time

import pytest

from vitreg.measure.timing import percentile, summarize, time_window, wall_seconds


class FakeClock:
    """A clock that moves only when the timed call says how long it took."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def call_taking(self, durations_s):
        pending = iter(durations_s)

        def fn():
            self.now += next(pending)

        return fn


def test_window_times_each_call_between_its_own_stamps():
    clock = FakeClock()
    durations = [0.020, 0.0215, 0.019, 0.025, 0.020]
    win = time_window(clock.call_taking(durations), 5, "cpu", clock=clock)
    assert win.iters == 5
    assert win.iter_ms == pytest.approx(tuple(d * 1e3 for d in durations))
    assert win.total_ms == pytest.approx(sum(durations) * 1e3)
    with pytest.raises(ValueError):
        time_window(lambda: None, 0, "cpu")


def test_wall_seconds_is_the_call_alone():
    clock = FakeClock()
    assert wall_seconds(clock.call_taking([0.03]), "cpu", clock=clock) == pytest.approx(0.03)


def test_a_real_window_is_bounded_by_its_sleeps_and_the_time_around_it():
    """On the real clock: a sleep never returns early (the lower bound), and the window cannot hold
    more than the time measured around the whole call in this same test (the upper bound), however
    loaded the machine is."""
    start = time.perf_counter()
    win = time_window(lambda: time.sleep(0.005), 4, "cpu")
    around_ms = (time.perf_counter() - start) * 1e3
    assert all(ms >= 4.99 for ms in win.iter_ms)  # 10 us for the two clocks sleep and perf_counter read
    assert sum(win.iter_ms) == pytest.approx(win.total_ms) and win.total_ms <= around_ms


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
