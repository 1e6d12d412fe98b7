"""Sweeps of this host, for real: ``engine=local`` (a `vitreg sweep` process stopped by SIGTERM, one child per
visible GPU at once) and ``ray_address=local`` (a one-node Ray cluster the sweep starts and stops itself).
Children are real ``vitreg bench`` processes of tiny timm models on the CPU. Apart from tests/test_fleet.py,
whose tests share one two-node Ray cluster, so that the two files can run in two workers at once."""

from __future__ import annotations

import signal
import subprocess

import psutil

import pytest
from mlflow.tracking import MlflowClient

from conftest import migrated_store, subprocess_env
from test_fleet import (CHILD, LONG, SHORT, SWEEP, _bench_processes, _children, _end, _failing_children, _parent,
                        _running_child, _start, _sweep_in_process, _wait, child_log)

pytestmark = pytest.mark.slow


def _started_child(client):
    """A RUNNING child whose job has begun (its environment tags are logged: the worker runs it)."""
    return next((r for r in _children(client) if r.info.status == "RUNNING" and "torch_version" in r.data.tags), None)


def _workers(uri: str) -> list[psutil.Process]:
    """The live warm workers of the sweeps that log to ``uri``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if ("vitreg.cli.worker" in " ".join(proc.info["cmdline"] or ()) and proc.status() != psutil.STATUS_ZOMBIE
                    and proc.environ().get("MLFLOW_TRACKING_URI") == uri):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_sigterm_to_a_local_sweep_ends_its_child_killed_with_it(tmp_path):
    """Issue 20: the running child was not stopped; it died later on a closed pipe, FAILED BrokenPipeError.
    The child runs in the sweep's warm worker, which ends with it."""
    uri = migrated_store(tmp_path)
    client = MlflowClient(uri)
    sweep = _start(uri, tmp_path, *CHILD, *LONG)
    try:
        child = _wait(lambda: _started_child(client), 240, "a running child")
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=120)
    finally:
        _end(sweep)
    assert sweep.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("fleet").experiment_id])}
    assert {r.info.status for r in runs.values()} == {"KILLED"}, {r.info.run_name: r.info.status for r in runs.values()}
    assert "stopped by SIGTERM" in runs[child.info.run_id].data.tags["vitreg_error"]
    assert not _bench_processes(set(runs)) and not _workers(uri), "a child outlived its sweep"


def test_a_warm_worker_runs_its_children_in_turn_and_outlives_a_failed_one(tmp_path):
    """Issue 35: one worker runs every child of this CPU; the second child, refused inside its run (img_size 33
    is no multiple of the patch), ends FAILED with its own line and the worker runs the third; the later
    children pay no import (``overhead_import_s`` 0: the worker's imports were the first child's)."""
    uri = migrated_store(tmp_path)
    sweep = _start(uri, tmp_path, "--models", "test_vit", *CHILD[2:8], "--axis", "img_size=32,33,48",
                   *CHILD[10:], *SHORT)
    try:
        _, err = sweep.communicate(timeout=400)
    finally:
        _end(sweep)
    assert sweep.returncode == 2 and "2 finished, 1 failed" in err, err[-3000:]
    children = sorted(_children(MlflowClient(uri)), key=lambda c: c.info.start_time)
    assert [c.info.status for c in children] == ["FINISHED", "FAILED", "FINISHED"]
    assert "not a multiple of test_vit's patch size 16" in children[1].data.tags["vitreg_error"]
    assert children[0].data.metrics["overhead_import_s"] > 0.5
    assert children[2].data.metrics["overhead_import_s"] == 0, "the third child paid imports: not the warm worker"
    assert "Traceback" not in err, err[-3000:]
    assert not _workers(uri), "the worker outlived its sweep"


def test_a_crashed_worker_ends_only_its_child(tmp_path):
    """Issue 35: a worker killed while it runs a child (as a kernel fault or the OOM killer would) ends that
    child FAILED, saying so; the sweep starts a new worker for the next child, which finishes."""
    uri = migrated_store(tmp_path)
    client = MlflowClient(uri)
    sweep = _start(uri, tmp_path, *CHILD[2:], "--models", "test_vit", "--axis", "repeats=100000,2")
    try:
        first = _wait(lambda: _started_child(client), 240, "the first child at work")
        (worker,) = _workers(uri)
        worker.kill()
        _, err = sweep.communicate(timeout=300)
    finally:
        _end(sweep)
    assert sweep.returncode == 2 and "1 finished, 1 failed" in err, err[-3000:]
    runs = {r.info.run_id: r for r in _children(client)}
    assert runs[first.info.run_id].info.status == "FAILED"
    assert "warm worker" in runs[first.info.run_id].data.tags["vitreg_error"]
    assert "died with exit status -9" in runs[first.info.run_id].data.tags["vitreg_error"]
    assert [r.info.status for r in runs.values() if r.info.run_id != first.info.run_id] == ["FINISHED"]


def test_a_local_sweep_runs_one_child_per_visible_gpu_at_once(tmp_path):
    """The host pool on this CPU machine: told of two GPUs (CUDA_VISIBLE_DEVICES=0,1, as a 2-GPU host says), it
    runs the two children at once, each given one index, each tagged with the two that shared the host."""
    uri = migrated_store(tmp_path)
    device_auto = [a for a in CHILD if a not in ("--device", "cpu")]  # device=auto: the GPUs the host shows
    sweep = subprocess.Popen([*SWEEP, *device_auto, *SHORT, "--experiment", "fleet"], cwd=tmp_path,
                             env=subprocess_env(uri, CUDA_VISIBLE_DEVICES="0,1"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _, err = sweep.communicate(timeout=400)
    finally:
        _end(sweep)
    assert sweep.returncode == 0, err[-3000:]
    assert "2 at once on this host (2 GPUs)" in err, err[-2000:]
    children = _children(MlflowClient(uri))
    assert len(children) == 2 and {c.info.status for c in children} == {"FINISHED"}
    assert [c.data.tags["sweep_children_on_host"] for c in children] == ["2", "2"]
    first, second = sorted(children, key=lambda c: c.info.start_time)
    assert second.info.start_time < first.info.end_time, "the two children did not overlap"


def test_gpu_all_on_a_cluster_without_gpus_is_refused(tmp_path):
    """ray_address=local: a one-node cluster of this host, started for the sweep and shut down after it."""
    sweep = _start(migrated_store(tmp_path), tmp_path, "--engine", "ray", "--ray-address", "local", "--gpu", "all",
                   *CHILD)
    _, err = sweep.communicate(timeout=180)
    assert sweep.returncode == 2
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "gpu=all: the Ray cluster at local has no GPU node" in line


def test_a_sweep_whose_children_all_failed_ends_its_parent_failed(sqlite_store, tmp_path, monkeypatch):
    """Issue 29: the parent of a sweep whose every child failed ended FINISHED (the command exited 2)."""
    _failing_children(tmp_path, monkeypatch, "test_vit,test_vit2")
    result = _sweep_in_process("--isolate", "process", *CHILD, *SHORT, "--experiment", "fleet")
    client = MlflowClient(sqlite_store)
    parent = _parent(client)
    assert result.exit_code == 2, result.output[-3000:]
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert f"sweep {parent.info.run_id}: 0 finished, 2 failed" in line
    assert f"vitreg sweep --rerun-failed {parent.info.run_id}" in line
    assert parent.info.status == "FAILED" and "2 failed" in parent.data.tags["vitreg_error"]
    assert parent.data.metrics["n_failed"] == 2 and parent.data.metrics["n_finished"] == 0
    assert {c.info.status for c in _children(client)} == {"FAILED"}
    for child in _children(client):  # a child that failed before its run opened (no console.log) left its words
        log = child_log(client, child, tmp_path)
        assert "error: this child refuses its model (the test says so)" in log, log


def test_rerun_failed_completes_a_parent_under_the_same_run(sqlite_store, tmp_path, monkeypatch):
    """One child of two fails (the parent ends FAILED, exit 2); `--rerun-failed PARENT` runs only that
    combination again, with the options its child had, as a new child of the same parent, which ends FINISHED."""
    flag = _failing_children(tmp_path, monkeypatch, "test_vit2")
    first = _sweep_in_process("--isolate", "process", *CHILD, *SHORT, "--experiment", "fleet")
    client = MlflowClient(sqlite_store)
    assert first.exit_code == 2 and "1 finished, 1 failed" in first.output, first.output[-3000:]
    parent_id = _parent(client).info.run_id
    assert _parent(client).info.status == "FAILED"
    (done,) = [c for c in _children(client) if c.info.status == "FINISHED"]

    flag.unlink()  # the cause is fixed
    again = _sweep_in_process("--isolate", "process", "--rerun-failed", parent_id)
    assert again.exit_code == 0, again.output[-3000:]
    assert f"sweep {parent_id}: 2 finished, 0 failed" in again.output
    parent = _parent(client)
    assert parent.info.run_id == parent_id and parent.info.status == "FINISHED"
    assert "vitreg_error" not in parent.data.tags and parent.data.metrics["n_failed"] == 0
    children = _children(client)
    by_model = {m: sorted((c for c in children if c.data.params.get("model", c.data.tags["sweep_label"]) == m),
                          key=lambda c: c.info.start_time) for m in ("test_vit", "test_vit2")}
    assert [c.info.run_id for c in by_model["test_vit"]] == [done.info.run_id]  # the finished child stays as it was
    assert client.get_run(done.info.run_id).info.end_time == done.info.end_time
    failed, rerun = by_model["test_vit2"]
    assert failed.info.status == "FAILED" and rerun.info.status == "FINISHED"
    assert rerun.data.tags["mlflow.parentRunId"] == parent_id
    assert rerun.data.tags["sweep_index"] == failed.data.tags["sweep_index"]
    assert (rerun.data.params["img_size"], rerun.data.params["steps"]) == ("32", "2")  # the options it had
    assert failed.data.tags["sweep_superseded_by"] == rerun.info.run_id  # issue 40: the old one says it was replaced
    assert "sweep_superseded_by" not in rerun.data.tags and "sweep_superseded_by" not in done.data.tags
    from vitreg.tracking.search import benchmark_runs  # what compare and check read: the replaced child left out

    assert set(benchmark_runs("fleet")["run_id"]) == {done.info.run_id, rerun.info.run_id}


def test_rerun_failed_runs_the_combinations_a_stopped_sweep_never_started(sqlite_store, monkeypatch):
    """Issue 39: a sweep stopped by SIGTERM after its first child leaves its second combination without a child;
    `--rerun-failed` ran only FAILED and KILLED children, so it said there was nothing to re-run and the parent
    stayed KILLED with one of its two combinations never measured."""
    from vitreg import signals
    from vitreg.bench.sweep import LocalEngine

    real_run = LocalEngine.run

    def stopped_after_the_first(engine, ctx, combos):
        real_run(engine, ctx, combos[:1])
        raise signals.Terminated(signal.SIGTERM)  # as the signal arrives between two children

    monkeypatch.setattr(LocalEngine, "run", stopped_after_the_first)
    first = _sweep_in_process(*CHILD, *SHORT, "--experiment", "fleet")
    client = MlflowClient(sqlite_store)
    parent_id = _parent(client).info.run_id
    assert first.exit_code == 128 + signal.SIGTERM and _parent(client).info.status == "KILLED", first.output[-3000:]
    assert [c.data.tags["sweep_index"] for c in _children(client)] == ["1"]

    monkeypatch.setattr(LocalEngine, "run", real_run)
    again = _sweep_in_process("--rerun-failed", parent_id)
    assert again.exit_code == 0 and f"sweep {parent_id}: 2 finished, 0 failed" in again.output, again.output[-3000:]
    assert "re-running 1 of its 2 combinations" in again.output
    assert _parent(client).info.status == "FINISHED"
    children = {c.data.tags["sweep_index"]: c for c in _children(client)}
    assert sorted(children) == ["1", "2"] and {c.info.status for c in children.values()} == {"FINISHED"}
    assert children["2"].data.params["model"] == "test_vit2" and children["2"].data.params["img_size"] == "32"


def test_rays_own_log_lines_go_to_the_file_the_sweep_names(tmp_path):
    """Issue 29: `--ray-address` at a port that is not Ray printed Ray's C++ retry lines ("Failed to connect to
    GCS ...") into the sweep's console. They go to $TMPDIR/vitreg-ray-PID.log, which the sweep names."""
    import socket

    not_ray = socket.create_server(("127.0.0.1", 0))  # answers TCP (so the sweep gets past its connect check)
    try:
        address = f"127.0.0.1:{not_ray.getsockname()[1]}"
        sweep = subprocess.Popen([*SWEEP, "--engine", "ray", "--ray-address", address, "--models", "test_vit",
                                  "--device", "cpu"], cwd=tmp_path,
                                 env=subprocess_env(migrated_store(tmp_path), TMPDIR=str(tmp_path)),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ray_log = tmp_path / f"vitreg-ray-{sweep.pid}.log"
        try:
            _wait(lambda: ray_log.exists() and "Failed to connect to GCS" in ray_log.read_text(), 120,
                  "Ray's first retry line in the file")
        finally:
            _end(sweep)  # its wait for a GCS is another item of issue 29; here it is ended by its PID
        out, err = sweep.communicate(timeout=60)
    finally:
        not_ray.close()
    assert f"Ray's own log lines go to {ray_log}" in err, err[-2000:]
    assert "Failed to connect" not in err + out and "gcs_client" not in err + out, err[-2000:]
