"""A real ``vitreg train`` process whose real ``mlflow server`` is SIGKILLed by PID in the middle of the
run and stays down: the training ends on time (exit 0, one line saying where the run is kept), its
checkpoints and every loss point survive in the spool, and ``vitreg sync`` delivers them once the
server is back, to the run that was started on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from conftest import free_port, premigrated, subprocess_env
from vitreg.cli.main import sync as sync_command
from vitreg.tracking.spool import Spool

# 200 steps: after the first points reach the server (its delivery rounds are a second apart) the training still
# has 190 steps to run when the server is killed
STEPS, LOG_EVERY, CHECKPOINT_EVERY = 200, 10, 100
TRAIN = [sys.executable, "-m", "vitreg.cli", "train", "--model", "test_vit", "--img-size", "32", "--batch-size", "4",
         "--num-classes", "10", "--num-workers", "0", "--steps", str(STEPS), "--log-every", str(LOG_EVERY),
         "--checkpoint-every", str(CHECKPOINT_EVERY), "--device", "cpu", "--experiment", "outage"]
# waited out in full once the training ends (the server is down): 1 s shows the bound as well as 3 s did
FLUSH_TIMEOUT_S = 1


def _first_points_on(client: MlflowClient, train: subprocess.Popen, timeout_s: float = 120) -> tuple[str, int]:
    """Wait until the server holds the run and its first loss points; return the run id and their count. (The
    run is looked up until found, then only its loss history is asked for: one request per poll, not three.)"""
    deadline = time.monotonic() + timeout_s
    run_id = None
    while True:
        assert train.poll() is None, "the training ended before the server could be killed: make it longer"
        assert time.monotonic() < deadline, "no loss point reached the live server"
        if run_id is None:
            exp = client.get_experiment_by_name("outage")
            runs = client.search_runs([exp.experiment_id]) if exp else []
            run_id = runs[0].info.run_id if runs else None
        points = len(client.get_metric_history(run_id, "train_loss")) if run_id else 0
        if points:
            return run_id, points
        time.sleep(0.1)


@pytest.mark.slow
def test_server_killed_mid_train_stays_down_and_nothing_is_lost(tmp_path):
    from vitreg.deploy import server
    from vitreg.deploy.server import ServerConfig

    cfg = ServerConfig(port=free_port(), data_dir=premigrated(tmp_path / "server"))
    proc = server.start(cfg, timeout=90, quiet=True)
    try:
        client = MlflowClient(cfg.url)
        started = time.monotonic()
        train = subprocess.Popen(TRAIN, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=subprocess_env(cfg.url, VITREG_SPOOL_DIR=str(tmp_path / "spool"),
                                                    VITREG_FLUSH_TIMEOUT_S=str(FLUSH_TIMEOUT_S)))
        run_id, delivered_before = _first_points_on(client, train)
        baseline_s = time.monotonic() - started  # the process's start-up and its first LOG_EVERY steps
        os.killpg(proc.pid, signal.SIGKILL)  # the server and its workers, no clean shutdown; it stays down
        proc.wait(timeout=10)
        killed = time.monotonic()
        assert train.poll() is None, "the training ended before the server died: make it longer"
        assert delivered_before < STEPS // LOG_EVERY
        out, err = train.communicate(timeout=300)
        ended_at = time.time()
        ended_after = time.monotonic() - killed

        assert train.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        (spool,) = Spool.find(tmp_path / "spool")
        assert out.strip().splitlines()[-1] == (
            f"the run is kept in {spool.path}: deliver it with `vitreg sync --spool {spool.path}`")
        assert f"did not take it in {FLUSH_TIMEOUT_S} s" in err
        kept = {r["artifact_path"] for r in spool.records() if r["kind"] == "artifact"}
        last_files = [r for r in spool.records() if r["kind"] == "artifact" and r["path"].endswith("/last")]
        assert f"checkpoints/step-{STEPS}" in kept and last_files, "the final checkpoint waits in the spool"
        assert last_files[-1]["artifact_path"] == "checkpoints"  # the file checkpoints/last names it

        proc = server.start(cfg, timeout=90, quiet=True)
        res = CliRunner().invoke(sync_command, ["--spool", str(tmp_path / "spool")], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        assert f"-> run {run_id} " in res.output
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        points = client.get_metric_history(run_id, "train_loss")
        steps = sorted(m.step for m in points)
        assert steps == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)), "every loss point, exactly once"
        # after its last step the process ends within the flush timeout plus its own start-up time (the baseline
        # measured above): MLflow's own retries held such a process 757 s
        after_last_step_s = ended_at - max(m.timestamp for m in points) / 1000
        assert after_last_step_s < FLUSH_TIMEOUT_S + baseline_s, (after_last_step_s, baseline_s, ended_after)
        folders = {a.path for a in client.list_artifacts(run_id, "checkpoints")}
        # keep_checkpoints=1: the step-{CHECKPOINT_EVERY} folder was delivered, then deleted in order
        assert folders == {"checkpoints/last", f"checkpoints/step-{STEPS}"}, folders
        assert len(client.search_runs([run.info.experiment_id])) == 1
    finally:
        server.stop(proc)


@pytest.mark.slow
def test_a_spool_removed_under_a_running_train_ends_it_in_one_line(tmp_path):
    """The spool of a training that cannot deliver (offline: the server is away) is removed mid-run: the
    process says in one line that it can no longer keep what it measures and ends (exit 2), never "the run
    is kept in"; `vitreg sync` of the removed path is an error. Bound: the time the run took to log its
    first points (the baseline, measured here)."""
    import shutil

    spools = tmp_path / "spool"
    args = [a if a != str(STEPS) else "100000" for a in TRAIN]
    started = time.monotonic()
    train = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=subprocess_env(f"http://127.0.0.1:{free_port()}", VITREG_SPOOL_DIR=str(spools),
                                                VITREG_OFFLINE="1"))
    try:
        while True:  # the event: the journal holds loss points
            assert train.poll() is None, train.communicate()[1][-3000:]
            journals = list(spools.glob("*/journal.jsonl"))
            if journals and '"train_loss"' in journals[0].read_text():
                break
            time.sleep(0.05)
        baseline_s = time.monotonic() - started
        spool_dir = journals[0].parent
        shutil.rmtree(spool_dir)
        removed = time.monotonic()
        out, err = train.communicate(timeout=baseline_s + 120)
        took = time.monotonic() - removed
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 2 and took < baseline_s, (train.returncode, took, baseline_s, err[-3000:])
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(spool_dir) in errors[0] and "cannot be kept" in errors[0], err[-3000:]
    assert "Traceback" not in err and "the run is kept in" not in out + err, out + err
    assert not spool_dir.exists(), "a write re-created the removed spool"
    res = CliRunner().invoke(sync_command, ["--spool", str(spool_dir)])
    assert res.exit_code == 2 and "there is no spool at" in res.output, res.output
