"""vitreg.history on synthetic series whose answer is known: verdicts, change points, series, the likely cause."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from vitreg.history.verdict import change_points
from vitreg.analysis.frame import identity_options
from vitreg.history.check import CheckError, Selection, carried_columns, check_runs, likely_cause, parse_tag
from vitreg.history.verdict import (IMPROVED, NOISE_FLOOR, NOT_ENOUGH, REGRESSED, WITHIN_NOISE, judge,
                                    threshold_of)
from vitreg.config.options import identity_names
from vitreg.tracking.search import tidy

SEEDS = range(100)


def _series(seed, n_history=10, cv=0.01, step=1.0, n_after=1):
    x = np.random.default_rng([7, seed]).normal(1.0, cv, n_history + n_after) * 1000
    x[n_history:] *= step
    return x[n_history:], x[:n_history]


def test_a_5_percent_step_at_1_percent_noise_is_flagged_in_95_of_100_seeds():
    flagged = sum(judge(*_series(s, step=0.95), seed=s).verdict == REGRESSED for s in SEEDS)
    assert flagged >= 95


@pytest.mark.parametrize("cv", [0.01, 0.02, 0.03])
def test_pure_noise_is_flagged_in_at_most_5_of_100_seeds(cv):
    verdicts = [judge(*_series(s, cv=cv), seed=s).verdict for s in SEEDS]
    assert sum(v != WITHIN_NOISE for v in verdicts) <= 5  # flagged either way
    assert NOT_ENOUGH not in verdicts


def test_one_run_of_history_is_not_enough_never_a_verdict():
    for hist in ([1000.0], [1000.0, 1001.0]):
        v = judge([500.0], hist)
        assert v.verdict == NOT_ENOUGH and np.isnan(v.ci_low) and v.n_history == len(hist)


def test_an_improvement_and_a_lower_is_better_metric():
    cand, hist = _series(0, step=1.10)
    assert judge(cand, hist).verdict == IMPROVED
    assert judge(cand, hist, higher=False).verdict == REGRESSED  # latency 10 % up is worse


def test_the_threshold_follows_the_spread_and_never_goes_below_the_floor():
    assert threshold_of(0.0001, 10, 1) == NOISE_FLOOR
    assert threshold_of(0.03, 10, 1) > threshold_of(0.03, 30, 1) > NOISE_FLOOR  # fewer runs: wider
    quiet = [1000.0] * 10
    assert judge([985.0], quiet).verdict == WITHIN_NOISE  # -1.5 %: under the floor
    assert judge([985.0], quiet, run_cvs=[0.0001]).threshold == NOISE_FLOOR
    # the runs' own window spread widens the threshold where the history looks quieter than it is
    assert judge([950.0], quiet, run_cvs=[0.03] * 11).verdict == WITHIN_NOISE
    assert judge([950.0], quiet).verdict == REGRESSED


def test_change_points_find_the_step_and_not_the_noise():
    found = sum(change_points(np.concatenate(_series(s, step=0.95, n_after=10)[::-1])) == [10] for s in SEEDS)
    assert found >= 95
    spurious = sum(bool(change_points(np.concatenate(_series(s, cv=0.02, n_history=20)[::-1]))) for s in SEEDS)
    assert spurious <= 5
    assert change_points([1000.0] * 5) == []  # too short for two segments


def test_the_configuration_is_the_option_tables_identity():
    names = identity_options()
    assert set(identity_names("bench")) <= set(names) and "sdpa" in names and "seed" not in names
    assert set(names) <= set(carried_columns(Selection()))


def _frame(rows):
    return tidy(pd.DataFrame(rows), axes=carried_columns(Selection(candidate_tag=("pr", "1"))))


def _row(i, value, sdpa="auto", mismatch=False, torch="2.8", **extra):
    return {"run_id": f"r{i:03d}{sdpa}", "status": "FINISHED",
            "start_time": pd.Timestamp("2026-01-01", tz="UTC") + pd.Timedelta(minutes=i),
            "params.model": "test_vit", "params.task": "infer", "params.sdpa": sdpa, "params.batch_size": "8",
            "tags.gpu": "a100" if mismatch else "cpu", "tags.gpu_mismatch": str(mismatch).lower(),
            "tags.torch_version": torch, "metrics.infer_throughput_img_per_s": value, **extra}


def test_runs_differing_in_one_identity_option_are_two_series_and_mislabelled_runs_none():
    rng = np.random.default_rng(0)
    rows = [_row(i, 1000 * rng.normal(1, 0.01), sdpa) for i in range(11) for sdpa in ("auto", "math")]
    rows[-1]["metrics.infer_throughput_img_per_s"] *= 0.9  # the newest math run
    rows.append(_row(99, 10.0, mismatch=True))  # filed as a100, ran on the CPU: newest, and far off
    result = check_runs(_frame(rows))
    by = result.table.set_index("sdpa")
    assert list(by.index) == ["auto", "math"] and set(by["gpu"]) == {"cpu"}
    assert by.loc["math", "verdict"] == REGRESSED and by.loc["auto", "verdict"] == WITHIN_NOISE
    assert by.loc["math", "n_history"] == 10 and "r099auto" not in ",".join(result.run_ids())
    assert result.exit_code == 1 and result.lines()[0].startswith("REGRESSED: test_vit sdpa=math on cpu")


def test_window_candidate_and_tags_pick_the_runs():
    rows = [_row(i, 1000.0 + i % 3) for i in range(8)] + [_row(8, 900.0, **{"tags.pr": "1"}), _row(9, 1001.0)]
    rows[2]["tags.release"] = rows[3]["tags.release"] = rows[4]["tags.release"] = "2.4"
    frame = tidy(pd.DataFrame(rows), axes=carried_columns(Selection(candidate_tag=("pr", "1"),
                                                                    baseline_tag=("release", "2.4"))))
    newest = check_runs(frame, selection=Selection(window=3)).table.iloc[0]
    assert newest["candidate_runs"] == "r009auto" and newest["history_runs"] == "r006auto,r007auto,r008auto"
    tagged = check_runs(frame, selection=Selection(candidate_tag=("pr", "1"))).table.iloc[0]
    assert tagged["candidate_runs"] == "r008auto" and tagged["n_history"] == 8 and tagged["verdict"] == REGRESSED
    release = check_runs(frame, selection=Selection(candidate="r009auto", baseline_tag=("release", "2.4")))
    assert release.table.iloc[0]["history_runs"] == "r002auto,r003auto,r004auto"
    with pytest.raises(CheckError, match=r"--baseline-tag release=2\.5: no finished run has it \(its values: 2\.4\)"):
        check_runs(frame, selection=Selection(baseline_tag=("release", "2.5")))


def test_likely_cause_names_what_changed():
    hist = pd.DataFrame({"torch_version": ["2.8", "2.8"], "batch_chosen": ["256", "256"], "timm_version": ["1", "1"]})
    cand = pd.DataFrame({"torch_version": ["2.9"], "batch_chosen": ["128"], "timm_version": ["1"]})
    assert likely_cause(hist, cand) == "torch_version 2.8 -> 2.9; batch_chosen 256 -> 128"
    assert likely_cause(hist, hist.tail(1)) == "" and likely_cause(hist.iloc[0:0], cand) == ""


@pytest.mark.parametrize("bad, match", [
    (dict(window=0), "window=0: the history needs at least one run"),
    (dict(candidate="r1", candidate_tag=("a", "b")), "not both"),
])
def test_bad_selections_are_one_line_errors(bad, match):
    with pytest.raises(CheckError, match=match):
        Selection(**bad)


def test_tags_are_key_value():
    assert parse_tag(" release = 2.4 ", "--baseline-tag") == ("release", "2.4") and parse_tag("", "--x") is None
    with pytest.raises(CheckError, match="--baseline-tag 'release' is not KEY=VALUE"):
        parse_tag("release", "--baseline-tag")


def test_bad_days_v_case14_an_interval_wholly_below_the_catch_is_a_regression_however_noisy():
    """A history measured on a loaded host (window spread 33-97 %) and a newest run at 30 % of its throughput was
    "TOO NOISY: 0.189x [0.136, 0.300] ... sees only changes over 117.5 %", exit 3. An interval wholly past the
    15 % the check must see is a change, however noisy; "too noisy" is for one that straddles it."""
    history = np.random.default_rng(45).normal(1.0, 0.15, 10) * 1000
    cvs = np.linspace(0.33, 0.97, 10)
    slow = judge([300.0], history, run_cvs=cvs)
    assert slow.threshold > 1 and slow.ci_high < 0.85 and slow.verdict == REGRESSED, slow
    assert judge([3000.0], history, run_cvs=cvs).verdict == IMPROVED
    assert judge([900.0], history, run_cvs=cvs).verdict == "too noisy"  # its interval straddles 0.85
