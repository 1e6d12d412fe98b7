import time

import pytest

from vitreg.measure.timing import summarize, time_window, wall_seconds


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


def test_percentiles_match_numpy_linear():
    stats = summarize([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert stats.median == 5.5 and stats.p90 == pytest.approx(9.1) and stats.p10 == pytest.approx(1.9)


def test_summarize_median_spread_cv():
    s = summarize([100.0, 110.0, 90.0])
    assert s.median == 100.0 and s.min == 90.0 and s.max == 110.0 and s.n == 3
    assert s.cv == pytest.approx(8.16497 / 100.0, rel=1e-4)
    assert summarize([5.0]).cv == 0.0
    with pytest.raises(ValueError):
        summarize([])


# --------------------------------------------------------------------------------------------
# the median's interval and the stopping rule, on synthetic timings


def test_the_median_interval_is_the_order_statistics_with_95_percent_coverage():
    from vitreg.measure.timing import median_halfwidth_pct, median_interval

    assert median_interval([10, 11, 12, 13, 14]) is None  # five values: [x(1), x(5)] covers only 93.8 %
    assert median_interval([15, 10, 11, 12, 13, 14]) == (10, 15)  # six: [x(1), x(6)], 96.9 %
    # twenty values: the textbook ranks 6 and 15 (coverage 95.9 %; ranks 7 and 14 reach only 88.5 %)
    assert median_interval(range(1, 21)) == (6, 15)
    # the farther end from the median, in % of it: median 12.5, ends 10 and 15
    assert median_halfwidth_pct([15, 10, 11, 12, 13, 14]) == pytest.approx(2.5 / 12.5 * 100)
    assert median_halfwidth_pct([1, 2]) is None


def test_three_to_five_values_read_students_t_interval_which_one_outlier_widens():
    from vitreg.measure.timing import median_halfwidth_pct

    # mean 1000, sample std 2: t(2) = 4.303 -> 4.303 * 2 / sqrt(3) = 4.97 img/s, 0.497 % of the median
    assert median_halfwidth_pct([998.0, 1000.0, 1002.0]) == pytest.approx(4.303 * 2 / 3 ** 0.5 / 1000 * 100)
    assert median_halfwidth_pct([1000.0, 1001.0, 999.0, 1000.5, 999.5]) < 0.1
    assert median_halfwidth_pct([1000.0, 1001.0, 999.0, 1000.5, 900.0]) > 5  # a throttled window: no early stop


def test_the_median_interval_of_thousands_of_step_times_is_exact_and_quick():
    """Issue 35: over the 7,000 step times of a noisy small-batch task, exact binomial sums in integers took 10.8 s
    (the report phase of a bs32 child on the H200); in floats the interval is the same, in linear time."""
    import math
    import random
    from types import SimpleNamespace

    from vitreg.measure import timing
    from vitreg.measure.timing import median_interval

    def exact(values):
        data, below, best = sorted(values), 0.0, None
        for k in range(1, len(data) // 2 + 1):
            below += math.comb(len(data), k - 1) / 2 ** len(data)
            if 1 - 2 * below < 0.95:
                break
            best = k
        return None if best is None else (data[best - 1], data[len(data) - best])

    rng = random.Random(0)
    for n in [*range(1, 130), 700]:
        values = [rng.random() for _ in range(n)]
        assert median_interval(values) == exact(values), n

    def terms(n):  # the float math calls one interval makes, counted rather than timed (a loaded host stalls)
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(timing, "math", SimpleNamespace(log=math.log, exp=lambda x: calls.append(x) or math.exp(x),
                                                       lgamma=lambda x: calls.append(x) or math.lgamma(x)))
            median_interval([rng.random() for _ in range(n)])
        return len(calls)

    assert terms(7000) <= 11 * terms(700)  # linear in n, each term one float lgamma or exp (the integer sums
    # of C(n, k) cost O(n) digits a term: ~1,000x the time for 10x the values)

def test_adaptive_windows_stop_at_the_target_from_three_windows_on():
    from vitreg.measure.timing import STOP_PRECISION, StopRule

    rule = StopRule(precision_pct=1.0, max_time_s=60.0)
    tight = [1000.0, 1002.0, 998.0, 1001.0, 999.0, 1000.5]  # an H100's bs512 windows agree to ~0.2 %
    assert [rule.reason(tight[:n], elapsed_s=n, next_window_s=1.0) for n in range(1, 3)] == [None] * 2
    assert rule.reason(tight[:3], elapsed_s=3, next_window_s=1.0) == STOP_PRECISION
    wide = [1000.0, 1015.0, 985.0, 1008.0, 992.0, 1001.0, 999.0, 1000.0, 1003.0]  # +-1.5 %: three are not sure
    assert [rule.reason(wide[:n], elapsed_s=n, next_window_s=1.0) for n in range(1, 9)] == [None] * 8
    assert rule.reason(wide, elapsed_s=9, next_window_s=1.0) == STOP_PRECISION
    noisy = tight[:5] + [1200.0, 800.0]  # +-20 %: time another window
    assert rule.reason(noisy, elapsed_s=7, next_window_s=1.0) is None


def test_a_run_that_cannot_reach_its_target_stops_at_a_limit_and_says_which():
    from vitreg.measure.timing import STOP_FIXED, STOP_MAX_TIME, STOP_MAX_WINDOWS, StopRule

    import numpy as np

    scatter = list(np.random.default_rng(0).uniform(700.0, 1300.0, 60))  # +-30 %: the median is not sure to 1 %
    rule = StopRule(precision_pct=1.0, max_time_s=60.0)
    assert rule.reason(scatter[:59], elapsed_s=30, next_window_s=0.5) is None
    assert rule.reason(scatter[:60], elapsed_s=30, next_window_s=0.5) == STOP_MAX_WINDOWS
    # the cap: no window starts that would end past max_time_s, before or after six windows
    assert rule.reason(scatter[:3], elapsed_s=59.2, next_window_s=1.0) == STOP_MAX_TIME
    assert rule.reason(scatter[:10], elapsed_s=58.0, next_window_s=1.0) is None
    # fixed mode (repeats given): exactly that many windows, whatever the noise or the time
    fixed = StopRule(precision_pct=1.0, max_time_s=1.0, repeats=5)
    assert [fixed.reason(scatter[:n], elapsed_s=100, next_window_s=1) for n in (4, 5)] == [None, STOP_FIXED]


def test_a_window_lasts_at_least_the_minimum_in_whole_steps():
    from vitreg.measure.timing import steps_for_window

    assert steps_for_window(1.0, 0.045) == 23  # 1.03 s / 45 ms = 22.9 -> 23 whole steps
    assert steps_for_window(1.0, 3.0) == 1  # one step longer than the window
    assert steps_for_window(1.0, None) == 1  # step time unknown: one, then recalibrated from the window


def test_the_phase_clock_counts_every_phase_but_the_timed_windows(monkeypatch):
    from vitreg.measure import timing

    now = {"s": 1000.0}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now["s"])  # the phases after the import one
    monkeypatch.setattr(timing, "process_age_s", lambda: 10.0)
    clock = timing.PhaseClock()
    clock.begin()  # the process started 10 s ago: the import phase
    for phase, seconds in (("setup", 2.0), ("warmup", 1.0), ("timed", 30.0), ("warmup", 0.5), ("report", 0.25)):
        now["s"] += seconds
        clock.mark(phase)
    assert clock.overhead_s() == {"overhead_import_s": 10.0, "overhead_setup_s": 2.0, "overhead_warmup_s": 1.5,
                                  "overhead_report_s": 0.25, "overhead_total_s": 13.75}
    clock.begin()  # a second command in the same process (the Python API): from now on, no import phase
    assert clock.overhead_s() == {"overhead_import_s": 0.0, "overhead_total_s": 0.0}


def test_the_process_age_is_the_kernel_s_start_record():
    """The import phase's length: this process's age from /proc on the boot-time clock. psutil reads the same
    start record but adds it to the boot time in whole wall-clock seconds (/proc/stat's btime), so the two agree
    to within a second; and the age moves with the monotonic clock, tick for tick."""
    import psutil

    from vitreg.measure.timing import process_age_s

    by_wall_clock = time.time() - psutil.Process().create_time()
    age, began = process_age_s(), time.perf_counter()
    assert by_wall_clock > 0 and age == pytest.approx(by_wall_clock, abs=1.0)
    sum(range(3_000_000))  # some CPU work between the two reads
    assert process_age_s() - age == pytest.approx(time.perf_counter() - began, abs=0.005)
