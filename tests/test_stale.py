"""Runs left RUNNING by a process that is gone: found by their heartbeat, ended KILLED with the reason.

Real sqlite stores; the slow test SIGKILLs a real process in the middle of its run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from vitreg.cli.main import runs as runs_command
from vitreg.errors import VitregError
from vitreg.tracking.delivery import HEARTBEAT_TAG, SpoolingTracker
from vitreg.tracking.runs import find_stale, mark_killed
from vitreg.tracking.store import prepare_store

from conftest import REPO, subprocess_env, wait_until


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("VITREG_", "MLFLOW_HTTP")):
            monkeypatch.delenv(name)


@pytest.fixture
def store(sqlite_store):
    prepare_store(sqlite_store)
    return sqlite_store


def make_run(client, experiment_id, name, age_s, heartbeat_age_s=None, status="RUNNING"):
    start_ms = int((time.time() - age_s) * 1000)
    run = client.create_run(experiment_id, start_time=start_ms, run_name=name)
    if heartbeat_age_s is not None:
        client.set_tag(run.info.run_id, HEARTBEAT_TAG, f"{time.time() - heartbeat_age_s:.0f}")
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def test_find_stale_uses_the_heartbeat_or_else_the_start(store):
    client = MlflowClient()
    exp = client.create_experiment("train")
    other = client.create_experiment("bench")
    silent = make_run(client, exp, "silent", age_s=5000, heartbeat_age_s=1000)
    alive = make_run(client, exp, "alive", age_s=5000, heartbeat_age_s=5)
    never_beat = make_run(client, other, "never", age_s=2000)
    young = make_run(client, other, "young", age_s=10)
    make_run(client, exp, "done", age_s=5000, status="FINISHED")

    found = find_stale(600)
    assert [r.run_id for r in found] == [never_beat, silent], "oldest first; alive/young/ended are not stale"
    assert [r.heartbeat for r in found] == [False, True]
    assert [r.run_id for r in find_stale(600, experiment="train")] == [silent]
    assert {r.run_id for r in find_stale(1)} == {silent, never_beat, alive, young}

    assert mark_killed(found) == 2
    for run_id in (silent, never_beat):
        run = client.get_run(run_id)
        assert run.info.status == "KILLED"
        assert run.data.tags["vitreg_error"].startswith("stale: no heartbeat")
    assert "since" in client.get_run(silent).data.tags["vitreg_error"]
    assert client.get_run(alive).info.status == "RUNNING"
    assert mark_killed(found) == 0, "already ended: nothing to do"
    with pytest.raises(VitregError, match="experiment 'nope' does not exist"):
        find_stale(600, experiment="nope")


def test_runs_command(store):
    client = MlflowClient()
    exp = client.create_experiment("train")
    silent = make_run(client, exp, "silent", age_s=5000, heartbeat_age_s=1000)
    runner = CliRunner()

    listed = runner.invoke(runs_command, ["--stale"])
    assert listed.exit_code == 0, listed.output
    assert silent in listed.output and "end them with: vitreg runs --stale --fix" in listed.output
    assert client.get_run(silent).info.status == "RUNNING", "listing changes nothing"

    fixed = runner.invoke(runs_command, ["--stale", "--fix", "--experiment", "train"])
    assert fixed.exit_code == 0 and "marked 1 run(s) KILLED" in fixed.output
    assert client.get_run(silent).info.status == "KILLED"
    assert "no RUNNING run silent" in runner.invoke(runs_command, ["--stale"]).output

    for args, message in ((["--fix"], "pass --stale"), (["--stale", "--older-than", "soon"], "not a number"),
                          (["--stale", "--experiment", "nope"], "does not exist")):
        bad = runner.invoke(runs_command, args)
        assert bad.exit_code == 2 and bad.output.startswith("error: ") and message in bad.output
        assert bad.output.count("\n") == 1


def test_an_unreachable_store_is_one_line(monkeypatch, ports_tried):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cret@127.0.0.1:{port}")
    import mlflow

    mlflow.set_tracking_uri(f"http://alice:s3cret@127.0.0.1:{port}")
    result = CliRunner().invoke(runs_command, ["--stale"])
    assert [p for _, p in ports_tried].count(port) == 1, "one attempt, no retries: MLflow's own take minutes"
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "Connection refused" in result.output and "s3cret" not in result.output
    mlflow.set_tracking_uri(None)


def test_a_live_tracker_keeps_its_run_out_of_the_stale_list(store, tmp_path):
    tracker = SpoolingTracker.open("live", root=tmp_path / "spool", heartbeat_s=0.3)
    tracker.log_metrics({"loss": 1.0}, step=0)
    beats = set()

    def refreshed_twice() -> bool:  # the heartbeat is refreshed while the process lives
        if tracker.run_id:
            beats.add(MlflowClient().get_run(tracker.run_id).data.tags.get(HEARTBEAT_TAG))
            beats.discard(None)
        return len(beats) >= 2

    wait_until(refreshed_twice, what="a refreshed heartbeat")
    stale = find_stale(older_than_s=3, now=time.time() + 1)
    assert tracker.run_id not in {r.run_id for r in stale}
    assert tracker.close(timeout_s=30) is True
    # an ended run's heartbeat is bookkeeping in the UI's tag list: gone; the delivery's sequence tag stays
    ended = MlflowClient().get_run(tracker.run_id)
    assert ended.info.status == "FINISHED" and HEARTBEAT_TAG not in ended.data.tags
    assert any(key.startswith("vitreg_spool_seq.") for key in ended.data.tags)


CHILD = textwrap.dedent("""
    import sys, time
    from vitreg.tracking.delivery import SpoolingTracker
    tracker = SpoolingTracker.open("victim", run_name="killed", root=sys.argv[1], heartbeat_s=0.5)
    for step in range(10):
        tracker.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    while tracker.run_id is None:
        time.sleep(0.1)
    print(tracker.run_id, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_a_process_killed_while_running_is_found_and_fixed(store, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "spool")], cwd=tmp_path,
                             env=subprocess_env(store, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
    try:
        run_id = child.stdout.readline().strip()
        assert run_id, "the child never started its run"
        wait_until(lambda: HEARTBEAT_TAG in MlflowClient().get_run(run_id).data.tags, what="the child's heartbeat")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    client = MlflowClient()
    assert client.get_run(run_id).info.status == "RUNNING", "SIGKILL leaves the run RUNNING"

    runner = CliRunner()
    assert run_id not in runner.invoke(runs_command, ["--stale", "--older-than", "30"]).output
    listed = []

    def listed_as_stale() -> bool:  # silent for over 2 s, which no heartbeat of a killed process interrupts
        listed.append(runner.invoke(runs_command, ["--stale", "--older-than", "2", "--experiment", "victim"]))
        return run_id in listed[-1].output

    wait_until(listed_as_stale, what="the killed run in the stale list")
    assert listed[-1].exit_code == 0 and "heartbeat" in listed[-1].output
    fixed = runner.invoke(runs_command, ["--stale", "--older-than", "2", "--fix"])
    assert fixed.exit_code == 0 and "marked 1 run(s) KILLED" in fixed.output
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["vitreg_error"].startswith("stale: no heartbeat since")
