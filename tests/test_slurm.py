"""``engine=slurm`` against a real SLURM cluster on this host (tests/_slurm_cluster.py: munged, slurmctld and two
slurmd nodes, ``gpu-h100`` and ``gpu-a100``, each offering one stand-in GPU of its type as gres and feature).
Children are real ``vitreg bench`` processes of tiny timm models on the CPU, filed under the stand-in GPU labels
(allow_gpu_mismatch), submitted through submitit. Every test ends what it started; none leaves a job queued."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import migrated_store, subprocess_env
from test_fleet import (CHILD, LONG, SHORT, _bench_processes, _children, _end, _failing_children, _parent,
                        _sweep_in_process, _wait, assert_output_kept, child_log)

pytestmark = pytest.mark.slow
SWEEP = [sys.executable, "-m", "vitreg.cli", "sweep", "--engine", "slurm"]
NODE_OF = {"h100": "gpu-h100", "a100": "gpu-a100"}


def _start(cluster, uri: str, tmp_path, *args, sweep=SWEEP, experiment="fleet") -> subprocess.Popen:
    return subprocess.Popen([*sweep, *args, "--slurm-folder", str(tmp_path / "shared"), "--experiment", experiment],
                            cwd=tmp_path, env=subprocess_env(uri, **cluster.env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _job(cluster, job_id: str) -> dict:
    """What slurmctld says of a job: its state, node, gres asked for (TRES per node), constraint, and whether other
    jobs may share its node (``NO``: it asked ``--exclusive``; ``OK``: its CPUs are its own, the node's others not)."""
    line = cluster.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%N|%b|%f|%h").strip()
    return dict(zip(("state", "node", "gres", "constraint", "oversubscribe"), line.split("|")))


def _queue_is_empty(cluster) -> bool:
    return not cluster.run("squeue", "-h", "-t", "pending,running,completing,configuring,suspended").strip()


@pytest.fixture
def uri(slurm_cluster, tmp_path):
    slurm_cluster.cut_off(None)
    yield migrated_store(tmp_path)
    assert _queue_is_empty(slurm_cluster), slurm_cluster.queue()


def _readme_sweep() -> list[str]:
    """The README's engine=slurm sweep, its options as printed."""
    from test_readme import bash_blocks

    (words,) = [w for block in bash_blocks() for w in block if w[:2] == ["vitreg", "sweep"] and "slurm" in w]
    return words[2:]


def test_two_gpu_types_by_two_batch_sizes_give_four_children_each_on_a_node_of_its_type(slurm_cluster, uri,
                                                                                         tmp_path):
    """The README's command (its partition, time limit, task, experiment), with the stand-in types, a tiny
    model on the CPU and this test's folder given after it (the last value of an option is the one taken). Each
    child run keeps its job's log files, the child's stdout and stderr in them (logs/child.log)."""
    sweep = _start(slurm_cluster, uri, tmp_path, *_readme_sweep(), "--gpu", "h100,a100", *CHILD[2:], "--models",
                   "test_vit", "--batch-size", "1,2", *SHORT)
    try:
        _, err = sweep.communicate(timeout=600)
    finally:
        _end(sweep)
    assert sweep.returncode == 0, err[-3000:]
    assert "sweep: a100 2 done, 0 running, 0 queued, 0 failed | h100 2 done" in err, err[-2000:]
    children = _children(MlflowClient(uri))
    assert len(children) == 4 and {c.info.status for c in children} == {"FINISHED"}, err[-3000:]
    assert len({c.data.tags["mlflow.parentRunId"] for c in children}) == 1
    for child in children:
        gpu = child.data.tags["sweep_label"].rsplit("-", 1)[1]
        job = _job(slurm_cluster, child.data.tags["slurm_job_id"])
        assert job["gres"] == f"gres:gpu:{gpu}:1" and job["node"] == NODE_OF[gpu], (gpu, job)
        assert job["oversubscribe"] == "NO", job  # a CPU child has its node alone (issue 40)
        assert child.data.tags["slurm_node"] == NODE_OF[gpu] and child.data.tags["slurm_spooled"] == "False"
        log = child_log(MlflowClient(uri), child, tmp_path)  # the job's log files, the child's lines in them
        assert "==> the job's stdout (" in log and "==> the job's stderr (" in log, log[-3000:]
        assert_output_kept(log, child)


def test_a_sweep_submitted_beside_a_folder_called_vitreg_imports_the_installed_package(slurm_cluster, uri,
                                                                                          tmp_path):
    """Issue 40: submitit starts the job in the submitting folder with `python -m`, so a clone's `vitreg/` there
    was imported instead of the package and every child failed. Typed as a user does: the `vitreg` script."""
    shadow = tmp_path / "vitreg"
    (shadow / "tracking").mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the folder beside the clone, not the package')\n")
    sweep = _start(slurm_cluster, uri, tmp_path, "--gpu", "a100", *CHILD[2:], "--models", "test_vit", *SHORT,
                   sweep=[str(Path(sys.executable).parent / "vitreg"), *SWEEP[3:]])
    try:
        _, err = sweep.communicate(timeout=600)
    finally:
        _end(sweep)
    assert sweep.returncode == 0, err[-3000:]
    assert [c.info.status for c in _children(MlflowClient(uri))] == ["FINISHED"], err[-3000:]


def test_an_unknown_gpu_type_is_refused_in_one_line_naming_the_types_the_cluster_has(slurm_cluster, uri, tmp_path):
    sweep = _start(slurm_cluster, uri, tmp_path, "--gpu", "v100,h100", *CHILD, *SHORT)
    try:
        _, err = sweep.communicate(timeout=120)
    finally:
        _end(sweep)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert sweep.returncode == 2 and len(errors) == 1, err[-2000:]
    assert "gpu=v100: no node of the SLURM cluster has GPU gres type v100 (it has: a100, h100)" in errors[0]
    assert not _children(MlflowClient(uri))


def test_sigterm_on_the_parent_cancels_every_job_and_ends_every_child_killed(slurm_cluster, uri, tmp_path):
    """Asked by constraint (node features) this time: two children run, two wait in the queue."""
    client = MlflowClient(uri)
    sweep = _start(slurm_cluster, uri, tmp_path, "--slurm-gpu-by", "constraint", "--gpu", "h100,a100", *CHILD[2:],
                   "--models", "test_vit", "--batch-size", "1,2", *LONG)
    try:
        running = _wait(lambda: [c for c in _children(client) if c.info.status == "RUNNING"
                                 and _bench_processes({c.info.run_id})], 300, "a running child")
        job = _job(slurm_cluster, slurm_cluster.run("squeue", "-h", "-o", "%i").split()[0])
        assert job["constraint"] in ("h100", "a100") and job["gres"] in ("", "N/A"), job
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=180)
    finally:
        _end(sweep)
    assert sweep.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("fleet").experiment_id])
    assert len(runs) == 5 and {r.info.status for r in runs} == {"KILLED"}, {r.info.run_name: r.info.status
                                                                           for r in runs}
    assert "stopped by SIGTERM" in client.get_run(running[0].info.run_id).data.tags["vitreg_error"]
    assert _queue_is_empty(slurm_cluster), slurm_cluster.queue()
    assert not _bench_processes({r.info.run_id for r in runs}), "a child outlived its sweep"


def test_a_node_killed_mid_sweep_fails_its_children_with_slurms_reason_and_the_rest_finish(slurm_cluster, uri,
                                                                                           tmp_path):
    client = MlflowClient(uri)
    sweep = _start(slurm_cluster, uri, tmp_path, "--gpu", "h100,a100", *CHILD[2:], "--models", "test_vit",
                   "--batch-size", "1,2", "--repeats", "40")
    try:
        _wait(lambda: [c for c in _children(client) if c.info.status == "RUNNING" and c.data.tags.get(
            "slurm_gpu_type") == "h100" and _bench_processes({c.info.run_id})], 300, "a running h100 child")
        slurm_cluster.kill_node("gpu-h100")
        _, err = sweep.communicate(timeout=600)
    finally:
        _end(sweep)
        slurm_cluster.resume_node("gpu-h100")
    children = {c.info.run_id: c for c in _children(client)}
    by_type = {gpu: [c for c in children.values() if c.data.tags["slurm_gpu_type"] == gpu] for gpu in NODE_OF}
    assert [c.info.status for c in by_type["a100"]] == ["FINISHED"] * 2, err[-3000:]
    assert [c.info.status for c in by_type["h100"]] == ["FAILED"] * 2, err[-3000:]
    reasons = sorted(c.data.tags["vitreg_error"] for c in by_type["h100"])
    assert any("NODE_FAIL" in r and "gpu-h100" in r for r in reasons), reasons
    assert all("NODE_FAIL" in r or "no node of the SLURM cluster in service has GPU type h100" in r
               for r in reasons), reasons
    assert "a100 2 done" in err and "h100 0 done, 0 running, 0 queued, 2 failed" in err, err[-3000:]
    (parent_id,) = {c.data.tags["mlflow.parentRunId"] for c in children.values()}
    assert sweep.returncode == 2 and client.get_run(parent_id).info.status == "FAILED", err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "2 finished, 2 failed" in line and f"--rerun-failed {parent_id}" in line, line


def test_children_without_a_route_to_the_server_spool_and_the_parent_syncs_each_once(slurm_cluster, mlflow_server,
                                                                                    tmp_path):
    """On the run's shared server (tests/conftest.py), in an experiment of its own."""
    from vitreg.tracking.sync import pending

    server = mlflow_server.url
    slurm_cluster.cut_off("gpu-a100")
    try:
        sweep = _start(slurm_cluster, server, tmp_path, "--gpu", "h100,a100", *CHILD[2:], "--models", "test_vit",
                       *SHORT, experiment="slurm-spooled")
        try:
            _, err = sweep.communicate(timeout=600)
        finally:
            _end(sweep)
    finally:
        slurm_cluster.cut_off(None)
    assert sweep.returncode == 0, err[-3000:]
    client = MlflowClient(server)
    children = {c.data.tags["slurm_gpu_type"]: c for c in _children(client, "slurm-spooled")}
    assert {gpu: c.info.status for gpu, c in children.items()} == {"h100": "FINISHED", "a100": "FINISHED"}
    assert children["a100"].data.tags["slurm_spooled"] == "True" and children["h100"].data.tags[
        "slurm_spooled"] == "False"
    assert err.count(f"-> run {children['a100'].info.run_id}") == 1, err[-3000:]
    assert children["a100"].data.metrics["infer_throughput_img_per_s"] > 0
    assert not pending(tmp_path / "shared"), "a spool was left behind: a later `vitreg sync` would send it again"
    parent = {c.data.tags["mlflow.parentRunId"] for c in children.values()}
    assert len(parent) == 1 and client.get_run(parent.pop()).data.params["n_combinations"] == "2"


def test_a_job_the_cluster_cancels_ends_its_child_failed_with_slurms_word(slurm_cluster, uri, tmp_path):
    client = MlflowClient(uri)
    sweep = _start(slurm_cluster, uri, tmp_path, "--gpu", "a100", *CHILD[2:], "--models", "test_vit", *LONG)
    try:
        child = _wait(lambda: [c for c in _children(client) if c.info.status == "RUNNING"
                               and _bench_processes({c.info.run_id})], 300, "a running child")[0]
        (job_id,) = slurm_cluster.run("squeue", "-h", "-o", "%i").split()
        slurm_cluster.run("scancel", job_id)  # an administrator, or the cluster's own policy
        _, err = sweep.communicate(timeout=180)
    finally:
        _end(sweep)
    run = client.get_run(child.info.run_id)
    assert run.info.status == "FAILED", err[-3000:]
    assert run.data.tags["vitreg_error"].startswith(f"slurm: job {job_id} CANCELLED"), run.data.tags["vitreg_error"]
    assert sweep.returncode == 2 and "0 finished, 1 failed" in err, err[-2000:]
    assert client.get_run(run.data.tags["mlflow.parentRunId"]).info.status == "FAILED"


def test_rerun_failed_of_a_slurm_sweep_reruns_its_failed_child_as_a_slurm_job(slurm_cluster, uri, tmp_path,
                                                                              monkeypatch):
    """Issue 40: `--rerun-failed` of a SLURM parent ran the failed child on this host's CPU, untagged, beside the
    old one. Given no engine option, it submits it to SLURM again (into the parent's folder); the old one says
    which run replaced it. The first sweep lets CPU children share a node (`--share-node`: no `--exclusive`),
    and the re-run keeps that (the parent's settings): its console line and its child run say so."""
    import mlflow

    for key, value in {"MLFLOW_TRACKING_URI": uri, **slurm_cluster.env}.items():
        monkeypatch.setenv(key, value)
    mlflow.set_tracking_uri(uri)
    monkeypatch.chdir(tmp_path)
    flag = _failing_children(tmp_path, monkeypatch, "test_vit2")
    first = _sweep_in_process("--engine", "slurm", "--slurm-folder", str(tmp_path / "shared"), *CHILD, *SHORT,
                              "--share-node", "--experiment", "fleet")
    client = MlflowClient(uri)
    assert first.exit_code == 2 and "1 finished, 1 failed" in first.output, first.output[-3000:]
    parent_id = _parent(client).info.run_id
    flag.unlink()
    again = _sweep_in_process("--rerun-failed", parent_id)
    assert again.exit_code == 0 and f"sweep {parent_id}: 2 finished, 0 failed" in again.output, again.output[-3000:]
    assert "re-running 1 of its 2 combinations (those with no finished child) on SLURM" in again.output
    assert "CPU children sharing a node (share_node=true)" in again.output, again.output[-3000:]
    failed, rerun = sorted((c for c in _children(client) if c.data.tags["sweep_label"] == "test_vit2"),
                           key=lambda c: c.info.start_time)
    assert rerun.info.status == "FINISHED" and rerun.data.tags["sweep_engine"] == "slurm"
    assert rerun.data.tags["sweep_shared_node"] == "true"
    assert _job(slurm_cluster, rerun.data.tags["slurm_job_id"])["oversubscribe"] != "NO"  # not --exclusive
    assert rerun.data.tags["slurm_job_id"] != failed.data.tags["slurm_job_id"]
    assert (tmp_path / "shared" / f"sweep-{parent_id}" / "jobs" / rerun.data.tags["slurm_job_id"]).is_dir()
    assert failed.data.tags["sweep_superseded_by"] == rerun.info.run_id


def test_a_requeued_child_resumes_into_its_run_and_is_logged_once(slurm_cluster, uri, tmp_path):
    """Issue 40: `scontrol requeue` (an administrator, or preemption) restarts a running child's job. The new
    attempt logs into the same run (its id is the submission's), which holds one set of figures, no metric step
    twice, ends FINISHED and says it was requeued; the parent counts the child once."""
    client = MlflowClient(uri)
    sweep = _start(slurm_cluster, uri, tmp_path, "--gpu", "a100", *CHILD[2:], "--models", "test_vit",
                   "--repeats", "1500")  # ~10 s of timing: still running when requeued after its first system sample
                                         # (300 windows, ~2.4 s, ended before the requeue once windows got cheaper)
    try:
        _wait(lambda: [c for c in _children(client) if c.info.status == "RUNNING" and _bench_processes(
            {c.info.run_id}) and any(k.startswith("system/") for k in c.data.metrics)], 300, "a child logging")
        (job_id,) = slurm_cluster.run("squeue", "-h", "-o", "%i").split()
        # requeueable, as a cluster's jobs are by default (this one's are not: JobRequeue=0, a dead node fails them)
        slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "Requeue=1")
        slurm_cluster.run("scontrol", "requeue", job_id)
        _, err = sweep.communicate(timeout=600)
    finally:
        _end(sweep)
    (run,) = _children(client)
    assert sweep.returncode == 0 and "1 finished, 0 failed" in err, err[-3000:]
    assert run.info.status == "FINISHED" and "vitreg_error" not in run.data.tags, run.data.tags
    assert run.data.tags["slurm_job_id"] == job_id and run.data.tags["sweep_child_attempts"] == "2"
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)) and (key.startswith("system/") or len(steps) == 1), (key, steps)
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["n_finished"] == 1


def _grant(child) -> tuple:
    tags = child.data.tags
    return tuple(tags.get(name) for name in ("cpus_granted", "cpus_granted_from", "torch_threads", "omp_threads"))


def test_fleet_iv_1_2_shared_children_run_on_their_grant_and_say_they_shared_the_host(slurm_cluster, uri, tmp_path):
    """Issue 48, points 1 and 2, on a cluster that pins no CPU (`task/none`): with `--share-node`, a child in a
    1-CPU job ran with torch_threads=2 and recorded cpus_granted=2 (the affinity mask, the host's), and two
    children that ran at once on the one host (its two nodes) were not said to. Each child now takes its job's
    grant (SLURM_CPUS_PER_TASK) for torch and OpenMP, records it and where it came from, is tagged with the two
    children on its host, and the sweep's table flags both rows. No OMP_NUM_THREADS from the submitting host
    (sbatch passes the submitter's variables on)."""
    sweep = subprocess.Popen([*SWEEP, *CHILD, *SHORT, "--share-node", "--slurm-folder", str(tmp_path / "shared"),
                              "--experiment", "fleet"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={k: v for k, v in subprocess_env(uri, **slurm_cluster.env).items()
                                             if k != "OMP_NUM_THREADS"})
    try:
        out, err = sweep.communicate(timeout=600)
    finally:
        _end(sweep)
    assert sweep.returncode == 0, err[-3000:]
    children = _children(MlflowClient(uri))
    assert len({c.data.tags["slurm_node"] for c in children}) == 2, err[-3000:]  # the two nodes of one host
    for child in children:
        assert _grant(child) == ("1", "SLURM_CPUS_PER_TASK", "1", "1"), child.data.tags
        assert child.data.tags["sweep_children_on_host"] == "2", child.data.tags
    rows = [line for line in out.splitlines() if line.startswith("test_vit")]
    assert len(rows) == 2 and all(row.rstrip().endswith("shared host") or "shared host," in row for row in rows), out


@pytest.fixture(scope="module")
def pinning_cluster(tmp_path_factory):
    """A second cluster, whose slurmd binds each job to the CPUs it was granted (`TaskPlugin=task/affinity`)."""
    from _slurm_cluster import installed, start

    if not installed():
        pytest.skip("SLURM is not installed here")
    cluster = start(tmp_path_factory.mktemp("slurm-pinning"), task_plugin="task/affinity")
    try:
        yield cluster
    finally:
        cluster.stop()


def test_fleet_iv_1_on_a_cluster_that_pins_cpus_a_child_runs_on_its_grant(pinning_cluster, tmp_path):
    """Issue 48, point 1, on a cluster that pins CPUs: the job's affinity mask is its grant (one CPU of the
    host's two), and the child runs on it and records it as its scheduler's."""
    mask = "import os; print(len(os.sched_getaffinity(0)))"
    assert pinning_cluster.run("srun", "-n1", "--cpus-per-task=1", sys.executable, "-c", mask).strip() == "1"
    uri = migrated_store(tmp_path)
    sweep = _start(pinning_cluster, uri, tmp_path, *CHILD[2:], "--models", "test_vit", *SHORT, "--share-node")
    try:
        _, err = sweep.communicate(timeout=600)
    finally:
        _end(sweep)
    assert sweep.returncode == 0, err[-3000:]
    (child,) = _children(MlflowClient(uri))
    assert _grant(child) == ("1", "SLURM_CPUS_PER_TASK", "1", "1"), child.data.tags
    assert child.data.tags["sweep_children_on_host"] == "1"
    assert _queue_is_empty(pinning_cluster), pinning_cluster.queue()


def test_fleet_iv_5_a_child_stopped_by_sigterm_keeps_its_job_and_node_tags(slurm_cluster, uri, tmp_path):
    """Issue 48, point 5: a child stopped by SIGTERM to its sweep had no slurm_job_id / slurm_node tags (one
    stopped by scancel has them)."""
    client = MlflowClient(uri)
    sweep = _start(slurm_cluster, uri, tmp_path, "--gpu", "a100", *CHILD[2:], "--models", "test_vit", *LONG)
    try:
        (child,) = _wait(lambda: [c for c in _children(client) if c.info.status == "RUNNING"
                                  and _bench_processes({c.info.run_id})], 300, "a running child")
        (job_id,) = slurm_cluster.run("squeue", "-h", "-o", "%i").split()
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=180)
    finally:
        _end(sweep)
    run = client.get_run(child.info.run_id)
    assert sweep.returncode == 128 + signal.SIGTERM and run.info.status == "KILLED", err[-3000:]
    assert (run.data.tags.get("slurm_job_id"), run.data.tags.get("slurm_node")) == (job_id, "gpu-a100"), run.data.tags
