"""`vitreg runs` with no option: the newest runs of the store as a table, a suspect figure flagged on its row.

A real sqlite store; the runs are written with MLflow's client as vitreg's jobs tag them (no benchmark runs).
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from vitreg.cli.main import main


def _run(client, experiment_id, name, age_s, status="FINISHED", tags=(), metrics=(), params=()):
    run = client.create_run(experiment_id, start_time=int((time.time() - age_s) * 1000), run_name=name,
                            tags={"vitreg_job": "bench", "gpu": "cpu", **dict(tags)})
    for key, value in {"model": "deit_tiny_patch16_224", "gpu": "auto", **dict(params)}.items():
        client.log_param(run.info.run_id, key, value)
    for key, value in dict(metrics).items():
        client.log_metric(run.info.run_id, key, value)
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status)
    return run.info.run_id


@pytest.fixture
def runs(sqlite_store):
    """laptop: a quiet run (both tasks; train stopped short of the precision target), a busy-host one (infer), a
    failed one; other: one still RUNNING."""
    client = MlflowClient()
    laptop, other = client.create_experiment("laptop"), client.create_experiment("other")
    return {
        "quiet": _run(client, laptop, "deit_ti16 · cpu · quiet", 400, params={"task": "both"},
                      tags={"infer_timing_stop": "precision_met", "train_timing_stop": "max_time"},
                      metrics={"infer_throughput_img_per_s": 9.44, "train_throughput_img_per_s": 3.1}),
        "busy": _run(client, laptop, "deit_ti16 · cpu · busy", 300, params={"task": "infer"},
                     tags={"infer_busy_host": "true"}, metrics={"infer_throughput_img_per_s": 2.73}),
        "failed": _run(client, laptop, "deit_ti16 · cpu · failed", 200, status="FAILED", params={"task": "infer"}),
        "running": _run(client, other, "still going", 100, status="RUNNING"),
    }


def _rows(output: str) -> list[str]:
    """The table's body: the lines after its rule, up to the closing line."""
    lines = output.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "} and line)
    return lines[rule + 1:-1]


def test_bare_runs_lists_the_newest_runs_of_the_store_with_their_figures_and_flags(runs):
    result = CliRunner().invoke(main, ["runs"])
    assert result.exit_code == 0, result.output
    header = result.output.splitlines()[0].split()
    assert header[:3] == ["id", "started", "(UTC)"] and "experiment" in header and "flags" in header
    assert "infer img/s" in result.output and "train img/s" in result.output
    rows = _rows(result.output)
    assert [row.split()[0] for row in rows] == [runs[k] for k in ("running", "failed", "busy", "quiet")]
    busy, quiet = rows[2], rows[3]
    assert "2.73" in busy and busy.rstrip().endswith("busy host") and "FINISHED" in busy
    assert "9.44" in quiet and "3.10" in quiet and "busy host" not in quiet
    assert quiet.rstrip().endswith("precision missed") and "precision missed" not in busy  # issue 38
    assert "RUNNING" in rows[0] and "other" in rows[0]
    assert result.output.splitlines()[-1] == "4 runs, newest first"


def test_runs_takes_a_count_an_experiment_and_a_status(runs):
    runner = CliRunner()
    two = runner.invoke(main, ["runs", "-n", "2"])
    assert [row.split()[0] for row in _rows(two.output)] == [runs["running"], runs["failed"]]
    assert two.output.splitlines()[-1] == "2 runs, newest first; more: vitreg runs -n 4"
    laptop = runner.invoke(main, ["runs", "--experiment", "laptop", "--status", "finished"])
    assert [row.split()[0] for row in _rows(laptop.output)] == [runs["busy"], runs["quiet"]]
    assert "experiment" not in laptop.output.splitlines()[0], "one experiment: no column for it"
    one = runner.invoke(main, ["runs", "--experiment", "laptop", "--status", "FAILED"])
    assert one.exit_code == 0 and one.output.splitlines()[-1] == (
        "1 run in experiment 'laptop' with status FAILED, newest first")
    none = runner.invoke(main, ["runs", "--status", "killed"])
    assert none.exit_code == 0 and none.output.startswith("no runs with status KILLED at ")


@pytest.mark.parametrize("args,needle", [
    (["--status", "finised"], "status='finised' is not one of running, finished, failed, killed, scheduled "
                              "(did you mean status=finished?)"),
    (["--experiment", "nope"], "experiment 'nope' does not exist"),
    (["--fix"], "--fix ends runs left RUNNING by a process that is gone: pass --stale --fix"),
    (["--json"], "--json needs the experiment: pass --experiment NAME"),
    (["-n", "0"], "-n '0' is not a number of runs: pass e.g. -n 50"),
    (["--stale", "-n", "3"], "--stale lists every RUNNING run silent for --older-than seconds: pass it without -n "
                             "and --status"),
])
def test_runs_refuses_bad_input_in_one_line(runs, args, needle):
    result = CliRunner().invoke(main, ["runs", *args])
    assert result.exit_code == 2 and result.output.startswith(f"error: {needle}") and result.output.count("\n") == 1


def test_runs_json_is_the_csv_frame_as_records(runs):
    result = CliRunner().invoke(main, ["runs", "--experiment", "laptop", "--json", "-n", "2"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.output)
    assert [(r["run_id"], r["task"]) for r in records] == [(runs["busy"], "infer")], "the failed run has no figure"
    assert records[0]["busy_host"] == "true" and records[0]["throughput_img_per_s"] == pytest.approx(2.73)


def test_runs_makes_no_store_where_there_is_none(tmp_path, monkeypatch):
    """MLflow would create ./mlflow.db (in a checkout: a file to commit by mistake) to find no runs in it."""
    import mlflow.tracking._tracking_service.utils as tracking_service

    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.setattr(tracking_service, "_tracking_uri", None)  # what an earlier test set in this process
    result = CliRunner().invoke(main, ["runs"])
    assert result.exit_code == 0 and result.output == f"no runs at sqlite:///{db}; `vitreg bench` logs one\n"
    assert not db.exists()


def test_the_listing_reads_a_sqlite_store_as_mlflow_s_search_does(runs):
    """`vitreg runs` reads a sqlite store's tables itself (importing MLflow and opening its store: 2.5 s of CPU,
    issue 47): the same runs, columns and values as MLflow's search_runs."""
    import mlflow
    import pandas as pd

    from vitreg.tracking.runs import newest_runs

    ours = newest_runs(3, None, None)
    exps = [e.experiment_id for e in MlflowClient().search_experiments()]
    theirs = mlflow.search_runs(exps, order_by=["attributes.start_time DESC"], max_results=3)
    assert list(ours["run_id"]) == list(theirs["run_id"]) == [runs[k] for k in ("running", "failed", "busy")]
    assert sorted(ours.columns) == sorted([*theirs.columns, "experiment"])
    pd.testing.assert_frame_equal(ours[theirs.columns], theirs, check_dtype=False)
    assert list(newest_runs(None, "laptop", "FINISHED")["run_id"]) == [runs["busy"], runs["quiet"]]


@pytest.mark.slow
@pytest.mark.parametrize("with_runs", [False, True], ids=["no store", "a store"])
def test_runs_lists_without_importing_mlflow(tmp_path, with_runs):
    """`vitreg runs` answers without importing MLflow (~2.5 s of CPU with its store; issue 47: 1.9 s of CPU to say
    "no runs" before): in a folder without a store, and over a sqlite store it reads itself."""
    import os
    import subprocess
    import sys

    from conftest import REPO, migrated_store

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PYTHONPATH=str(REPO), PYTHONPROFILEIMPORTTIME="1")
    if with_runs:
        env["MLFLOW_TRACKING_URI"] = migrated_store(tmp_path / "store")
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        run_id = _run(client, client.create_experiment("laptop"), "deit_ti16 · cpu", 10,
                      metrics={"infer_throughput_img_per_s": 9.44})
    (tmp_path / "here").mkdir()
    proc = subprocess.run([sys.executable, "-m", "vitreg", "runs"], cwd=tmp_path / "here", env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if with_runs:
        assert run_id in proc.stdout and "9.44" in proc.stdout and proc.stdout.endswith("1 run, newest first\n")
    else:
        assert proc.stdout.startswith(f"no runs at sqlite:///{tmp_path}/here/mlflow.db"), proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not {name.split(".")[0] for name in imported} & {"mlflow", "sqlalchemy"}
    assert list((tmp_path / "here").iterdir()) == []


def test_a_running_run_vitreg_never_started_is_shown_as_such_with_the_command_that_ends_it(runs):
    """`mlflow run . -e bench` without conda: MLflow makes the run, then fails before the entry point; the run stays
    RUNNING for good, with no heartbeat and no vitreg tag (issue 47). A run two minutes old or less may be a vitreg
    process still starting: not flagged yet."""
    import shlex

    client = MlflowClient()
    other = client.get_experiment_by_name("other").experiment_id
    orphan = client.create_run(other, start_time=int((time.time() - 900) * 1000), run_name="learned-cow-402",
                               tags={"mlflow.project.entryPoint": "bench"}).info.run_id
    client.log_param(orphan, "gpu", "h100")
    young = client.create_run(other, start_time=int((time.time() - 20) * 1000), run_name="starting").info.run_id
    result = CliRunner().invoke(main, ["runs"])
    rows = {row.split()[0]: row for row in _rows(result.output.rsplit("\n", 2)[0] + "\n")}
    assert "RUNNING, not vitreg's" in rows[orphan] and "not vitreg" not in rows[young], result.output
    assert "not vitreg" not in rows[runs["running"]]  # vitreg's own (its vitreg_job tag)
    last = result.output.splitlines()[-1]
    assert last.startswith("1 run RUNNING that vitreg never started"), result.output
    command = shlex.split(last.rsplit("end them KILLED with: ", 1)[1])
    assert command[:4] == ["vitreg", "runs", "--stale", "--fix"], command
    ended = CliRunner().invoke(main, command[1:])
    assert ended.exit_code == 0, ended.output
    assert client.get_run(orphan).info.status == "KILLED" and client.get_run(young).info.status == "RUNNING"
