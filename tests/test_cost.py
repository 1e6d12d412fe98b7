"""Cost per image and images per joule in compare (vitreg.analysis.cost): prices from the user, verdicts as
for throughput, throttle and busy-host marks; and `vitreg compare --prices` keeping the prices in the
experiment. The H200 rows carry the figures and tags the H200 run logged (ViT-B/16 infer bs256 bf16 compiled,
benchmarks/results/h200-2026-12-02-energy/); the A100 and L4 rows and every price are made up for the test."""

import itertools

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from vitreg.analysis.cost import (COST, NO_PRICE, condition_lines, energy_and_cost, parse_prices, price_text,
                                  with_costs)
from vitreg.analysis.frame import CompareError
from vitreg.tracking.search import tidy

_ids = itertools.count()
H200 = {"img_s": 10930.7, "img_j": 15.6935}  # as logged on the H200


def _run(gpu, img_s, img_j=None, throttle=None, busy=None, nproc=1):
    row = {"run_id": f"c{next(_ids):04d}", "status": "FINISHED", "start_time": pd.Timestamp("2026-12-02", tz="UTC"),
           "params.model": "vit_base_patch16_224", "params.task": "infer", "tags.gpu": gpu, "tags.amp": "bf16",
           "params.compile": "default", "params.batch_size": "256", "params.img_size": "224",
           "params.nproc": str(nproc), "metrics.infer_throughput_img_per_s": img_s}
    if img_j is not None:
        row["metrics.infer_img_per_j"] = img_j
    if throttle is not None:
        row["tags.infer_throttle"] = throttle
    if busy is not None:
        row["tags.infer_busy_host"] = busy
    return row


def _runs(scale=1.0, throttle="sw_power_cap"):
    rng = np.random.default_rng(0)
    rows = [_run("h200", H200["img_s"] * rng.normal(1, 0.003), H200["img_j"] * rng.normal(1, 0.003), throttle,
                 "false") for _ in range(4)]
    rows += [_run("a100", 2900 * scale * rng.normal(1, 0.003), 7.3 * rng.normal(1, 0.003), "sw_power_cap", "false")
             for _ in range(4)]
    rows += [_run("l4", 1050 * rng.normal(1, 0.003)) for _ in range(3)]  # predates energy: no img/J, no tags
    return tidy(pd.DataFrame(rows))


def test_prices_come_as_pairs_or_a_csv_or_toml_file_and_bad_ones_are_one_line(tmp_path):
    assert parse_prices("H200=3.50, l4=$0.80") == {"h200": 3.5, "l4": 0.8}
    assert parse_prices("") == {} and price_text({"l4": 0.8, "h200": 3.5}) == "h200=3.5,l4=0.8"
    (tmp_path / "p.csv").write_text("gpu,usd_per_hour\nh200,3.5\nA100,1.29\n")
    (tmp_path / "p.toml").write_text("[usd_per_gpu_hour]\nh200 = 3.5\nl4 = 0.8\n")
    (tmp_path / "flat.toml").write_text("h200 = 3.5\n")
    assert parse_prices(str(tmp_path / "p.csv")) == {"h200": 3.5, "a100": 1.29}
    assert parse_prices(str(tmp_path / "p.toml")) == {"h200": 3.5, "l4": 0.8}
    assert parse_prices(str(tmp_path / "flat.toml")) == {"h200": 3.5}
    for bad, needle in (("h200=free", "not a positive price"), ("h200=-1", "not a positive price"),
                        ("h200=3,l4", "not LABEL=USD_PER_HOUR"), (str(tmp_path / "none.csv"), "no such file")):
        with pytest.raises(CompareError, match=needle):
            parse_prices(bad)


def test_cost_per_million_images_is_the_price_over_the_rate_for_every_gpu_of_the_job():
    frame = with_costs(tidy(pd.DataFrame([_run("h200", 10000.0), _run("h200", 20000.0, nproc=2),
                                          _run("l4", 1000.0)])), {"h200": 3.6})
    by_rate = dict(zip(frame["throughput_img_per_s"], frame[COST]))
    assert by_rate[10000.0] == pytest.approx(0.1)  # $3.60/h = $0.001/s over 10,000 img/s: $0.10 per 1M images
    assert by_rate[20000.0] == pytest.approx(0.1)  # two GPUs at twice the rate cost the same per image
    assert np.isnan(by_rate[1000.0])  # no price for the l4: no cost, never 0


def test_compare_ranks_gpus_by_cost_per_image_with_verdicts_and_says_so():
    out = energy_and_cost(_runs(), {"h200": 3.50, "a100": 1.29, "l4": 0.80}, "h200")
    cost = out.comparisons[COST].table.set_index("gpu")
    # h200: 3.50/3600/10,931 x 1e6 = $0.0889; a100 1.29/3600/2,900 x 1e6 = $0.1236; l4 $0.2116 per 1M images
    assert cost.loc["h200", f"{COST}_median"] == pytest.approx(3.5 / 3600 / H200["img_s"] * 1e6, rel=0.01)
    assert cost.loc["a100", "speedup"] == pytest.approx(0.0889 / 0.1236, rel=0.01)  # < 1: dearer than the h200
    assert cost.loc["a100", "verdict"] == "worse" and cost.loc["a100", "ci_high"] < 1
    assert cost.loc["l4", "verdict"] == "worse"
    said = "\n".join(out.lines)
    a100 = next(line for line in out.lines if "the a100 is" in line and "per image" in line)
    assert a100.startswith("on vit_base_patch16_224 infer (batch 256), the a100 is 1.39x dearer per image than the "
                           "h200 ($ 0.1239 per 1M images), 95% interval [1.3"), a100
    lo, hi = (float(v) for v in a100.split("interval [")[1].split("]")[0].split(", "))
    assert 1.3 < lo <= 1.395 <= hi < 1.5  # the noise-free ratio 0.1236/0.0889, inside
    assert ": dearer" in said and "the h200: $ 0.08884 per 1M images (baseline)" in said
    # images per joule where runs logged it (not the l4's): the h200 gives 2.15x the a100's, with a verdict
    energy = out.comparisons["img_per_j"].table.set_index("gpu")
    assert set(energy.index) == {"h200", "a100"} and energy.loc["a100", "verdict"] == "worse"
    assert "every run's timed windows met throttle: sw_power_cap (the software power cap" in said


def test_a_cheaper_gpu_is_named_cheaper_and_runs_without_a_price_show_the_rest_and_say_how_to_add_one():
    out = energy_and_cost(_runs(scale=4.0), {"h200": 3.50, "a100": 1.29}, "h200")  # an a100 as fast as an h200
    assert any("the a100 is 2.87x cheaper per image than the h200" in line and line.endswith(": cheaper")
               for line in out.lines), out.lines
    unpriced = energy_and_cost(_runs(), {}, "h200")
    assert COST not in unpriced.comparisons and "img_per_j" in unpriced.comparisons
    assert unpriced.lines[-1] == NO_PRICE and "--prices h200=3.50,l4=0.80" in NO_PRICE


def test_throttle_that_differs_heat_and_a_busy_host_are_marked():
    runs = _runs(throttle="sw_power_cap")
    h200 = runs.index[runs["gpu"] == "h200"]
    runs.loc[h200[0], "throttle"] = "hw_thermal,sw_power_cap"
    runs.loc[h200[1], "busy_host"] = "true"
    runs["spread_over_target"] = runs["spread_over_target"].astype(object)  # no run tagged it: all NaN
    runs.loc[h200[2], "spread_over_target"] = "true"
    lines = condition_lines(runs)
    assert lines[3] == f"SPREAD: 1 run(s) whose window spread was over 5% (the windows' CV): {runs.loc[h200[2], 'run_id']}"
    assert lines[0] == "THROTTLE DIFFERS between the runs compared: a100: sw_power_cap, h200: hw_thermal,sw_power_cap/" \
                       "sw_power_cap"
    assert lines[1].startswith("THROTTLED by heat or a hardware brake: 1 run(s): ")
    assert lines[2].startswith("BUSY HOST: 1 run(s) measured while other processes loaded the host")
    assert condition_lines(_runs().assign(throttle=np.nan, busy_host=np.nan)) == []  # runs that predate the tags


def test_an_eager_fp8_run_is_flagged_from_its_tag():
    """amp=fp8 without compile runs at about half of bf16's speed (issue 37): its <task>_eager_fp8 tag makes compare
    say so and `vitreg runs` flag it, like a busy host."""
    from vitreg.analysis.comparison import suspect_masks

    rows = [_run("h200", 4866.0), _run("h200", 12285.0)]
    rows[0]["tags.infer_eager_fp8"] = "true"
    runs = tidy(pd.DataFrame(rows))
    assert suspect_masks(runs)["eager fp8"].tolist() == [True, False]
    (line,) = condition_lines(runs)
    assert line == (f"EAGER FP8: 1 run(s) ran fp8 without compile, about half of bf16's speed on an H200 "
                    f"(--compile default fuses the quantize steps): {rows[0]['run_id']}")


def test_vitreg_compare_with_prices_prints_the_ranking_and_keeps_the_prices_in_the_experiment(sqlite_store):
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    client = MlflowClient()
    exp = client.create_experiment("gpus")
    for row in _runs().itertuples():
        run = client.create_run(exp, tags={"vitreg_job": "bench", "gpu": row.gpu, "amp": "bf16",
                                           **({"infer_throttle": row.throttle} if isinstance(row.throttle, str) else {})})
        for k, v in {"model": row.model, "task": "infer", "compile": "default", "batch_size": "256",
                     "img_size": "224", "nproc": "1"}.items():
            client.log_param(run.info.run_id, k, v)
        client.log_metric(run.info.run_id, "infer_throughput_img_per_s", row.throughput_img_per_s)
        if row.img_per_j == row.img_per_j:
            client.log_metric(run.info.run_id, "infer_img_per_j", row.img_per_j)
        client.set_terminated(run.info.run_id)
    result = CliRunner().invoke(main, ["compare", "--experiment", "gpus", "--baseline", "h200",
                                       "--prices", "h200=3.50,a100=1.29,l4=0.80"])
    assert result.exit_code == 0, result.output
    assert "the a100 is 1.39x dearer per image than the h200" in result.output
    assert client.get_experiment(exp).tags["vitreg_prices"] == "a100=1.29,h200=3.5,l4=0.8"
    again = CliRunner().invoke(main, ["compare", "--experiment", "gpus", "--baseline", "h200"])
    assert "the l4 is 2.38x dearer per image than the h200" in again.output and NO_PRICE not in again.output
    analysis = client.get_experiment_by_name("gpus/analysis").experiment_id  # filed apart from the benchmarks
    (compare_run,) = [r for r in client.search_runs([analysis], "tags.vitreg_job = 'compare'")][:1]
    listed = [a.path for a in client.list_artifacts(compare_run.info.run_id, "comparison/energy_and_cost")]
    assert "comparison/energy_and_cost/summary.md" in listed
    assert "comparison/energy_and_cost/usd_per_1m_img" in listed
