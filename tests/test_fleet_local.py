"""Sweeps of this host, for real: ``engine=local`` (a `vitreg sweep` process stopped by SIGTERM, one child per
visible GPU at once) and ``ray_address=local`` (a one-node Ray cluster the sweep starts and stops itself).
Children are real ``vitreg bench`` processes of tiny timm models on the CPU. Apart from tests/test_fleet.py,
whose tests share one two-node Ray cluster, so that the two files can run in two workers at once."""

from __future__ import annotations

import signal
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from conftest import migrated_store, subprocess_env
from test_fleet import CHILD, LONG, SHORT, SWEEP, _bench_processes, _children, _end, _running_child, _start, _wait

pytestmark = pytest.mark.slow


def test_sigterm_to_a_local_sweep_ends_its_child_killed_with_it(tmp_path):
    """Issue 20: the running child was not stopped; it died later on a closed pipe, FAILED BrokenPipeError."""
    uri = migrated_store(tmp_path)
    client = MlflowClient(uri)
    sweep = _start(uri, tmp_path, *CHILD, *LONG)
    try:
        child = _wait(lambda: _running_child(client), 240, "a running child")
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=120)
    finally:
        _end(sweep)
    assert sweep.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("fleet").experiment_id])}
    assert {r.info.status for r in runs.values()} == {"KILLED"}, {r.info.run_name: r.info.status for r in runs.values()}
    assert "stopped by SIGTERM" in runs[child.info.run_id].data.tags["vitreg_error"]
    assert not _bench_processes(set(runs)), "a child outlived its sweep"


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
