"""Sweeps over a real two-node Ray cluster on this machine, one per test run (``ray_cluster`` of
tests/_sessions.py: ray.cluster_utils.Cluster, a head and a second node, each with a custom ``accelerator_type:``
resource standing in for a GPU type: Ray's accelerator_type request is exactly such a resource), logging to a
real ``mlflow server``. Children are real ``vitreg bench`` processes of tiny timm models on the CPU, filed under
the stand-in GPU labels (allow_gpu_mismatch). Every test ends what it started. (Sweeps of this host alone:
tests/test_fleet_local.py, which uses the helpers below.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from conftest import free_port, migrated_store, subprocess_env
from vitreg.fleet import children as child_commands

pytestmark = pytest.mark.slow
SWEEP = [sys.executable, "-m", "vitreg.cli", "sweep"]
CHILD = ["--models", "test_vit,test_vit2", "--device", "cpu", "--allow-gpu-mismatch", "true", "--task", "infer",
         "--img-size", "32", "--warmup", "1", "--steps", "2", "--batch-size", "2", "--amp", "off"]
SHORT, LONG = ["--repeats", "2"], ["--repeats", "100000"]  # LONG: still timing when the test acts, even on idle cores
TYPES = {"h100": "H100", "a100": "A100"}  # the stand-in GPU types: head node, second node


def _start(uri: str, cwd, *args) -> subprocess.Popen:
    return subprocess.Popen([*SWEEP, *args, "--experiment", "fleet"], cwd=cwd, env=subprocess_env(uri),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(client: MlflowClient, experiment: str = "fleet") -> list:
    exp = client.get_experiment_by_name(experiment)
    runs = [] if exp is None else client.search_runs([exp.experiment_id])
    return [r for r in runs if r.data.tags.get("mlflow.parentRunId")]


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _bench_processes(run_ids: set[str]) -> list[psutil.Process]:
    """The live processes that log into one of ``run_ids`` (a child bench, wherever Ray started it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MLFLOW_RUN_ID") in run_ids and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _running_child(client, gpu: str | None = None):
    """A child whose bench process is alive (on the GPU type ``gpu``, if given)."""
    for run in _children(client):
        if run.info.status == "RUNNING" and (gpu is None or run.data.tags["sweep_label"].endswith(f"-{gpu}")):
            if _bench_processes({run.info.run_id}):
                return run
    return None


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _failing_children(tmp_path, monkeypatch, refuse: str) -> object:
    """Children through a script that refuses the models in ``refuse`` while the returned flag file exists (as a
    child refuses an option at run time: one `error:` line, exit 2, its run never opened) and runs the real
    `vitreg bench` otherwise."""
    import sys

    from vitreg.fleet import children as child_commands

    flag = tmp_path / "refuse"
    flag.write_text(refuse)
    script = tmp_path / "picky_child.py"
    script.write_text(
        "import os, sys\n"
        "args = sys.argv[1:]\n"
        f"flag = {str(flag)!r}\n"
        "if os.path.exists(flag) and args[args.index('--model') + 1] in open(flag).read().split(','):\n"
        "    print('error: this child refuses its model (the test says so)', file=sys.stderr); sys.exit(2)\n"
        "from vitreg.cli.main import main\n"
        "main(['bench', *args])\n")
    real = child_commands.child_command
    monkeypatch.setattr(child_commands, "child_command",
                        lambda combo, bs, common: [sys.executable, str(script), *real(combo, bs, common)[4:]])
    return flag


def _sweep_in_process(*args):
    from click.testing import CliRunner

    from vitreg.cli.main import main

    return CliRunner().invoke(main, ["sweep", *args])


def child_log(client: MlflowClient, child, tmp_path) -> str:
    """The child run's logs/child.log: its stdout and stderr as its node saw them, kept by the parent."""
    folder = tmp_path / "child-logs" / child.info.run_id
    folder.mkdir(parents=True)
    return (Path(client.download_artifacts(child.info.run_id, "logs/child.log", str(folder)))).read_text()


def assert_output_kept(log: str, child) -> None:
    """The child's stdout (its results table, where its run is) and stderr (vitreg's progress) are in ``log``,
    with no thread's traceback (issue 40: `'NoneType' object is not iterable` in every worker's log)."""
    assert f"logged run {child.info.run_id} to " in log and "img/s median" in log, log[-3000:]
    assert "[vitreg] " in log and "Traceback" not in log, log[-3000:]


def _assert_none_shared_a_node(client: MlflowClient, children: list) -> None:
    """No two of ``children`` ran at once on one node: on each node, each child's first system-metric sample (its
    process samples every 2 s from its run's start; a child with none counts from its run's end) came after the
    end of the child before it there."""
    by_node: dict = {}
    for child in children:
        by_node.setdefault(child.data.tags["ray_node_id"], []).append(child)
    for node, runs in by_node.items():
        spans = sorted((_first_sample(client, run), run.info.end_time) for run in runs)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start > end, f"two CPU children ran at once on node {node}: (first sample, end) {spans}"


def _first_sample(client: MlflowClient, run) -> int:
    history = client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
    return min((m.timestamp for m in history), default=run.info.end_time)


def _parent(client: MlflowClient, experiment: str = "fleet"):
    exp = client.get_experiment_by_name(experiment)
    (parent,) = [r for r in client.search_runs([exp.experiment_id]) if not r.data.tags.get("mlflow.parentRunId")]
    return parent


@pytest.fixture
def server(mlflow_server):
    """The run's shared ``mlflow server`` (tests/conftest.py), its URL: this file's experiments are fleet*."""
    return mlflow_server.url


def test_gpu_all_places_each_child_on_a_node_of_its_type_and_keeps_its_output(server, ray_cluster, tmp_path):
    sweep = _start(server, tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, "--gpu", "all",
                   *CHILD, *SHORT)
    try:
        out, err = sweep.communicate(timeout=480)
    finally:
        _end(sweep)
    assert sweep.returncode == 0, err[-3000:]
    assert "sweep: 4 combinations" in err and "a100 2 done, 0 running, 0 queued, 0 failed" in err, err[-3000:]
    children = _children(MlflowClient(server))
    assert len(children) == 4 and {c.info.status for c in children} == {"FINISHED"}
    assert "2 at once on a Ray cluster of 2 nodes:" in err, err[-3000:]  # one CPU child a node: it has it alone
    _assert_none_shared_a_node(MlflowClient(server), children)  # each reserved its node's two CPUs
    for child in children:
        assert "sweep_shared_node" not in child.data.tags
        gpu = child.data.params["gpu"]
        assert child.data.tags["sweep_label"].endswith(f"-{gpu}")
        assert child.data.tags["ray_node_id"] == ray_cluster.node_of[gpu], (child.info.run_name, gpu)
        assert_output_kept(child_log(MlflowClient(server), child, tmp_path), child)


def test_a_local_store_is_refused_on_a_cluster_of_two_nodes(ray_cluster, tmp_path):
    sweep = _start(migrated_store(tmp_path), tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, *CHILD)
    _, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 2
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "the Ray cluster has 2 nodes and the tracking store is local" in line and "vitreg server" in line


@pytest.mark.parametrize("args, needle", [
    (["--axis", "nproc=1,2"], "asks for 1 GPUs and no node of the Ray cluster has them"),  # CPU nodes only
    (["--gpu", "h100,v100", "--device", "cpu"], "gpu=v100: no node of the Ray cluster has accelerator type V100"),
])
def test_children_that_fit_no_node_are_refused_before_any_starts(server, ray_cluster, tmp_path, args, needle):
    client = MlflowClient(server)
    before = len(_children(client))
    sweep = _start(server, tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, "--models", "test_vit",
                   *args)
    _, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 2, err[-2000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert needle in line, line
    assert len(_children(client)) == before


def test_sigterm_to_a_ray_sweep_cancels_every_task_and_leaves_nothing_running(server, ray_cluster, tmp_path):
    import ray

    client = MlflowClient(server)
    before = {c.info.run_id for c in _children(client)}
    sweep = _start(server, tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, "--gpu", "all",
                   *CHILD, *LONG)
    try:
        _wait(lambda: _running_child(client), 240, "a running child")
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=120)
    finally:
        _end(sweep)
    assert sweep.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    mine = [c for c in _children(client) if c.info.run_id not in before]
    assert len(mine) == 4 and {c.info.status for c in mine} == {"KILLED"}, \
        [(c.info.status, c.data.tags.get("vitreg_error"), c.data.tags.get("vitreg_error_kind")) for c in mine]
    _wait(lambda: not _bench_processes({c.info.run_id for c in mine}), 30, "every child process to end")
    ray.init(address=ray_cluster.address, log_to_driver=False)
    try:  # every CPU free again: no task of the sweep is alive on any node
        _wait(lambda: ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"), 30,
              "the cluster's CPUs to be free")
    finally:
        ray.shutdown()


def test_a_ray_child_out_of_memory_is_retried_with_a_smaller_batch(sqlite_store, server, ray_cluster, monkeypatch,
                                                                   tmp_path):
    """As engine=local does (tests/test_jobs.py): the child at batch 3 runs out of memory (a child that says so
    the way bench does: its run FAILED with vitreg_error_kind=OutOfMemory) and is retried at 2, which fits. The
    sweep runs in this process, on the shared cluster, logging to its server (sqlite_store: this process's
    MLflow state is reset after the test)."""
    import mlflow
    from click.testing import CliRunner

    from vitreg.cli.main import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    mlflow.set_tracking_uri(server)

    script = tmp_path / "fake_child.py"
    script.write_text(
        "import sys\n"
        "args = sys.argv[1:]\n"
        "from vitreg.tracking import runs as tracking\n"
        "from vitreg.errors import OutOfMemory, VitregError\n"
        "from vitreg.cli.main import main\n"
        "if int(args[args.index('--batch-size') + 1]) > 2:\n"
        "    try:\n"
        "        with tracking.tracked_run(system_metrics=False):\n"
        "            raise OutOfMemory('infer ran out of GPU memory: use a smaller batch_size')\n"
        "    except VitregError as e:\n"
        "        print('error:', e, file=sys.stderr); sys.exit(2)\n"
        "main(['bench', *args])\n")
    real = child_commands.child_command
    monkeypatch.setattr(child_commands, "child_command", lambda combo, bs, common: [sys.executable, str(script),
                                                                           *real(combo, bs, common)[4:]])
    result = CliRunner().invoke(main, ["sweep", "--engine", "ray", "--ray-address", ray_cluster.address,
                                       *CHILD[2:], "--models", "test_vit", "--batch-size", "3", *SHORT,
                                       "--experiment", "fleet-oom"])
    assert result.exit_code == 0, result.output[-3000:]
    children = _children(MlflowClient(server), "fleet-oom")
    by_status = {c.info.status: c for c in children}
    assert len(children) == 2 and set(by_status) == {"FAILED", "FINISHED"}
    assert by_status["FAILED"].data.tags["vitreg_error_kind"] == "OutOfMemory"
    assert by_status["FINISHED"].data.params["batch_size"] == "2"
    assert by_status["FINISHED"].data.tags["requested_batch_size"] == "3"


def test_fleet_iv_4_rerun_failed_on_ray_refuses_new_options_then_completes_the_parent(sqlite_store, server,
                                                                                     ray_cluster, monkeypatch,
                                                                                     tmp_path):
    """engine=ray: a child refused at run time fails (the parent FAILED); `--rerun-failed` on the same cluster runs
    only it again, under the same parent, and the parent ends FINISHED. Issue 48, point 4: given `--repeats 2`, the
    re-run's children logged the parent's repeats and took minutes, no word: the option is refused by name. The first sweep lets its CPU children share
    a node (`--share-node`, as they did before issue 40): the console says so, every child run is tagged so, and
    the re-run keeps it (the parent's settings)."""
    import tempfile

    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    mlflow.set_tracking_uri(server)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # Ray's own log lines: this test's folder
    flag = _failing_children(tmp_path, monkeypatch, "test_vit2")
    ray = ["--engine", "ray", "--ray-address", ray_cluster.address]
    first = _sweep_in_process(*ray, *CHILD, *SHORT, "--share-node", "--experiment", "fleet-rerun")
    client = MlflowClient(server)
    assert first.exit_code == 2 and "1 finished, 1 failed" in first.output, first.output[-3000:]
    assert "4 at once on a Ray cluster of 2 nodes, CPU children sharing a node (share_node=true)" in first.output
    parent_id = _parent(client, "fleet-rerun").info.run_id
    flag.unlink()
    told = _sweep_in_process(*ray, "--rerun-failed", parent_id, "--repeats", "2")
    assert told.exit_code == 2 and "so --repeats would not apply" in told.output, told.output[-3000:]
    assert len(_children(client, "fleet-rerun")) == 2
    again = _sweep_in_process(*ray, "--rerun-failed", parent_id)
    assert again.exit_code == 0 and f"sweep {parent_id}: 2 finished, 0 failed" in again.output, again.output[-3000:]
    assert client.get_run(parent_id).info.status == "FINISHED"
    children = _children(client, "fleet-rerun")
    assert sorted((c.data.tags["sweep_label"], c.info.status) for c in children) == [
        ("test_vit", "FINISHED"), ("test_vit2", "FAILED"), ("test_vit2", "FINISHED")]
    assert all(c.data.tags["sweep_engine"] == "ray" and c.data.tags["sweep_shared_node"] == "true" for c in children)


def test_fleet_iv_1_2_shared_ray_children_run_on_their_grant_and_say_they_shared_the_host(server, ray_cluster,
                                                                                         tmp_path):
    """Issue 48, points 1 and 2, on a cluster that pins no CPU (Ray): a 1-CPU task recorded cpus_granted=2 (the
    affinity mask, the host's), and two children at once on one host were not said to. With `--share-node`, both
    children of the head node (two CPUs) run at once, each on its task's one CPU: torch and OpenMP take it, the run
    records it and where it came from, is tagged with the two children on its host, and the table flags both."""
    client = MlflowClient(server)
    before = {c.info.run_id for c in _children(client)}
    sweep = _start(server, tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, "--gpu", "h100",
                   "--share-node", *CHILD, *SHORT)
    try:
        out, err = sweep.communicate(timeout=480)
    finally:
        _end(sweep)
    assert sweep.returncode == 0, err[-3000:]
    mine = [c for c in _children(client) if c.info.run_id not in before]
    for child in mine:
        tags = child.data.tags
        assert tuple(tags.get(name) for name in ("cpus_granted", "cpus_granted_from", "torch_threads", "omp_threads",
                                                 "sweep_children_on_host")) == (
            "1", "VITREG_RAY_TASK_CPUS", "1", "1", "2"), tags
    rows = [line for line in out.splitlines() if line.startswith("test_vit")]
    assert len(mine) == len(rows) == 2 and all("shared host" in row.split("  ")[-1] for row in rows), out


def _bare_python(folder: Path) -> Path:
    """A Python with this venv's packages (torch, timm, mlflow, Ray) and no vitreg: a venv whose one .pth names
    this venv's site-packages, whose own .pth files (vitreg's editable-install finder among them) are therefore
    never read."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=60)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    Path(site, "host-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


# A node as the shared cluster adds its own (ray.cluster_utils.Cluster.add_node: `ray start` refuses to join a
# cluster kept to 127.0.0.1), until SIGTERM (Ray's handler then ends its processes)
BARE_NODE = """
import signal
from ray._private.node import Node
from ray._private.parameter import RayParams
params = RayParams(gcs_address="{address}", node_ip_address="127.0.0.1", num_cpus=2, num_gpus=0,
                   resources={{"accelerator_type:L4": 1}}, object_store_memory=80 * 2**20, min_worker_port=0,
                   max_worker_port=0, include_log_monitor=False, node_manager_port=0)
params.dashboard_agent_listen_port = None
node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
while True:
    signal.pause()
"""


@pytest.fixture
def bare_node(ray_cluster, tmp_path):
    """A third node of the shared cluster (two CPUs, stand-in type L4) whose Python cannot import vitreg (no
    PYTHONPATH, a folder of its own as its working directory); yields its node id. Ended by SIGTERM, then by the
    PIDs of its process and everything it started."""
    import psutil
    import ray

    from _sessions import _end_by_pid

    python = _bare_python(tmp_path / "bare")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run([str(python), "-c", "import ray, torch, timm, mlflow\nimport vitreg"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert "No module named 'vitreg'" in probe.stderr, probe.stderr[-2000:]  # and everything else imported
    log = (tmp_path / "bare-node.log").open("w")
    node = subprocess.Popen([str(python), "-c", BARE_NODE.format(address=ray_cluster.address)], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ray.init(address=ray_cluster.address, log_to_driver=False)
        try:
            found = _wait(lambda: node.poll() is not None or [n["NodeID"] for n in ray.nodes() if n["Alive"] and
                                   "accelerator_type:L4" in n["Resources"]], 120, "the bare node to join")
            assert node.poll() is None, (tmp_path / "bare-node.log").read_text()[-3000:]
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log: {(tmp_path / 'bare-node.log').read_text()[-3000:]}") from None
        finally:
            ray.shutdown()
        yield found[0]
    finally:
        try:
            started = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            started = []
        node.terminate()  # Ray's own shutdown of the node's processes
        try:
            node.wait(timeout=30)
        finally:
            _end_by_pid(started)
            log.close()


def test_a_node_without_vitreg_runs_its_child_with_the_vitreg_the_sweep_ships(server, ray_cluster, bare_node,
                                                                              tmp_path):
    """Issue 40: the sweep ships its own vitreg package with its tasks (Ray's py_modules), so a node whose Python
    has torch, timm and mlflow but not vitreg runs the child."""
    from vitreg.environment import git_sha

    client = MlflowClient(server)
    before = {c.info.run_id for c in _children(client)}
    sweep = _start(server, tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, "--gpu", "l4",
                   *CHILD[2:], "--models", "test_vit", *SHORT)
    try:
        _, err = sweep.communicate(timeout=300)
    finally:
        _end(sweep)
    (child,) = [c for c in _children(client) if c.info.run_id not in before]
    assert sweep.returncode == 0, (err[-3000:], child.data.tags.get("vitreg_error"))
    assert child.info.status == "FINISHED" and child.data.tags["ray_node_id"] == bare_node
    assert child.data.metrics["infer_throughput_img_per_s"] > 0, sorted(child.data.metrics)
    assert child.data.tags["vitreg_git_sha"] == git_sha()  # the shipped copy's commit: the submitter's
    assert_output_kept(child_log(client, child, tmp_path), child)

def test_a_node_killed_mid_sweep_fails_its_children_and_the_sweep_goes_on(server, ray_cluster, tmp_path):
    """Last of the tests on the shared cluster (the last in this file; tests/_sessions.py keeps a group's tests in
    their file's order): it takes the second node away."""
    client = MlflowClient(server)
    before = {c.info.run_id for c in _children(client)}
    sweep = _start(server, tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, "--axis", "gpu=h100,a100",
                   *CHILD, "--repeats", "40")
    try:
        _wait(lambda: _running_child(client, "a100"), 240, "a child running on the second node")
        ray_cluster.cluster.remove_node(ray_cluster.worker, allow_graceful=False)
        _, err = sweep.communicate(timeout=480)
    finally:
        _end(sweep)
    assert sweep.returncode == 2 and "Traceback" not in err, err[-3000:]  # the parent FAILED with its a100 children
    mine = [c for c in _children(client) if c.info.run_id not in before]
    (parent_id,) = {c.data.tags["mlflow.parentRunId"] for c in mine}
    assert client.get_run(parent_id).info.status == "FAILED"
    assert f"2 finished, 2 failed (see the vitreg_error tags of the child runs): re-run the failed ones under the " \
           f"same parent with `vitreg sweep --rerun-failed {parent_id}`" in err, err[-3000:]
    by_gpu = {g: [c for c in mine if c.data.tags["sweep_label"].endswith(f"-{g}")] for g in TYPES}
    assert {c.info.status for c in by_gpu["h100"]} == {"FINISHED"} and len(by_gpu["h100"]) == 2
    assert len(by_gpu["a100"]) == 2 and {c.info.status for c in by_gpu["a100"]} <= {"FAILED", "KILLED"}
    assert all(c.data.tags.get("vitreg_error") for c in by_gpu["a100"]), [c.data.tags for c in by_gpu["a100"]]


def test_bad_days_v_case6_a_runtime_env_that_cannot_be_built_says_why_and_sigterm_ends_the_sweep(server, ray_cluster,
                                                                                                 tmp_path):
    """A pip runtime_env that cannot be built on a cluster without a package index (the nodes' PIP_NO_INDEX) sat
    at "0 done, 0 running, 1 queued" for minutes with no word, and after SIGTERM did not exit in 5 s. Now the
    wait is said, the build's failure fails the children with Ray's reason as soon as pip gave up (Ray's own
    three attempts take minutes more), and SIGTERM ends the sweep promptly, its children KILLED."""
    client = MlflowClient(server)
    unbuildable = ["--ray-runtime-env", '{"pip": ["nonexistent-zzz-pkg==9.9.9"]}', "--gpu", "h100", *CHILD[2:],
                   "--models", "test_vit", *SHORT]
    before = {c.info.run_id for c in _children(client)}
    started = time.monotonic()
    sweep = _start(server, tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, *unbuildable)
    try:
        _, err = sweep.communicate(timeout=240)
    finally:
        _end(sweep)
    took = time.monotonic() - started
    assert sweep.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "Ray is building the runtime_env's pip" in err and "No matching distribution found for nonexistent-zzz" \
        in err, err[-3000:]
    (child,) = [c for c in _children(client) if c.info.run_id not in before]
    assert child.info.status == "FAILED" and "nonexistent-zzz-pkg" in child.data.tags["vitreg_error"], took
    before.add(child.info.run_id)
    sweep = _start(server, tmp_path, "--engine", "ray", "--ray-address", ray_cluster.address, *unbuildable)
    try:
        _wait(lambda: _children(client) and len(_children(client)) > len(before), 120, "the child run")
        time.sleep(3)  # the build under way
        sweep.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        _, err = sweep.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        _end(sweep)
    assert sweep.returncode == 128 + signal.SIGTERM and took < 10, (took, err[-3000:])
    assert {c.info.status for c in _children(client) if c.info.run_id not in before} == {"KILLED"}


def test_fleet_iv_3_a_ray_cluster_that_refuses_the_token_is_named_with_ray_s_reason_and_the_fix(tmp_path):
    """Issue 48, point 3: a head started with token authentication (`RAY_AUTH_MODE=token`, Ray 2.60) and a sweep
    without its token: exit 2 after ~21 s with "could not join ... start it (`ray start --head`)", the cause only
    in Ray's log file. The line names Ray's reason and its fix. A head of its own (`ray start --head --block`),
    ended by SIGTERM and then by the PIDs of what it started."""
    import shutil
    import socket
    import tempfile

    from _sessions import _end_by_pid

    port, temp = free_port(), tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    alone = {"HOME": str(tmp_path), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # no ~/.ray/auth_token; 127.0.0.1
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}",
                             "--num-cpus=1", "--include-dashboard=false", "--node-ip-address=127.0.0.1",
                             f"--temp-dir={temp}"], env={**os.environ, **alone, "RAY_AUTH_MODE": "token",
                                                         "RAY_AUTH_TOKEN": "f" * 32},
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "head.log").open("w"), start_new_session=True)
    try:
        def answers():
            with socket.socket() as sock:
                return head.poll() is None and sock.connect_ex(("127.0.0.1", port)) == 0

        _wait(answers, 120, f"the head to listen; its log: {(tmp_path / 'head.log').read_text()[-2000:]}")
        env = {k: v for k, v in subprocess_env(migrated_store(tmp_path), **alone).items() if not k.startswith("RAY_AUTH")}
        sweep = subprocess.run([*SWEEP, "--engine", "ray", "--ray-address", f"127.0.0.1:{port}", *CHILD, *SHORT],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    finally:
        started = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
        head.terminate()
        try:
            head.wait(timeout=30)
        finally:
            _end_by_pid(started)
            shutil.rmtree(temp, ignore_errors=True)
    (line,) = [x for x in sweep.stderr.splitlines() if x.startswith("error:")]
    assert sweep.returncode == 2 and "start it" not in line, sweep.stderr[-3000:]
    assert "refused this sweep (InvalidAuthToken: Authentication token is missing or incorrect)" in line, line
    assert "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token" in line, line
