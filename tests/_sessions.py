"""What a test run starts once and shares, and the order in which `make test` hands the suite to its workers.

A pytest plugin (named in tests/conftest.py's ``pytest_plugins``). Two things cost minutes of CPU each time
they start, so the whole test run starts each once (pytest's session scope):

- ``ray_cluster``: a real two-node Ray cluster on this machine, nodes on 127.0.0.1 (tests/test_fleet.py);
- ``readme_run`` and ``readme_model_run``: the README's examples run once, as printed, in two halves that the two
  workers run at once (tests/test_readme.py, tests/test_readme_model.py), each in the README's order in a fresh
  copy of the repository on a fresh default store; the tests that check what the examples printed or left read
  these results.

Under pytest-xdist a session fixture lives in one worker process. ``make test`` runs ``--dist loadfile`` (a
file's tests go to one worker, so a module's servers stay in one worker), so each such fixture is used by one
file only: collection fails if a second file asks for it (it would start again in the other worker).
xdist's ``xdist_group`` marks cannot bind tests of two files together here: pytest 9 keeps a test's id where
xdist 3.8 no longer renames it, so ``--dist loadgroup`` sends every test apart.

The files go out longest first (``--no-loadscope-reorder`` keeps the order set here; xdist's own order is by
number of tests), so neither worker is left alone with a long file at the end while the other idles.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

SHARED = {"readme_run": "test_readme", "readme_model_run": "test_readme_model",  # session fixture -> the one file
          "ray_cluster": "test_fleet"}  # using it

# The files whose CPU time is longest, longest first (each file's slow tests with `-n 0`, 2026-12-02,
# docs/benchmarks.md); the rest, under half a minute each, follow in collection order. xdist hands a worker
# its next file when it asks, so a long file handed out last would run alone at the end.
LONGEST_FIRST = ("test_readme", "test_readme_model", "test_fleet", "test_signals_ddp", "test_ddp", "test_train_ddp", "test_outage",
                 "test_server", "test_signals_train", "test_fleet_local", "test_slurm", "test_train_e2e", "test_check_e2e",
                 "test_signals", "test_bench_e2e", "test_compile_cache", "test_ui", "test_spool", "test_registry")


def _file(item: pytest.Item) -> str:
    return Path(item.nodeid.split("::")[0]).stem


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, owner in SHARED.items():
            if fixture in getattr(item, "fixturenames", ()) and _file(item) != owner:
                raise pytest.UsageError(f"{item.nodeid} uses the session fixture {fixture}, which only {owner}.py "
                                        f"may use: under --dist loadfile it would start again in another worker; "
                                        f"move the test to {owner}.py")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_file(item), len(rank)))  # stable: a file keeps its order


# ------------------------------------------------------------------------------------------ one Ray cluster

@dataclass(frozen=True)
class RayFleet:
    """The shared cluster: its address, the node id of each stand-in GPU type, and the second node."""

    cluster: object  # ray.cluster_utils.Cluster
    address: str
    node_of: dict  # stand-in GPU label -> Ray node id
    worker: object  # the second node (ray._private.node.Node), which a test may take away


def _node_processes(node) -> list:
    """The processes of a Ray node (GCS, raylet, agents...) and what they started (Ray's task workers), as
    psutil processes: one whose PID the OS has since given to another process is never signalled."""
    import psutil

    found = []
    for pid in {info.process.pid for infos in node.all_processes.values() for info in infos}:
        try:
            proc = psutil.Process(pid)
            found += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return found


def _end_by_pid(processes: list) -> None:
    """SIGKILL what is still alive of ``processes`` (after the cluster's own shutdown) and reap it."""
    import psutil

    alive = []
    for proc in processes:
        try:
            proc.kill()  # psutil checks the PID still names the process it found
            alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=30)


class _Running:
    """The shared cluster while it runs (None once stopped), and the processes that end it."""

    cluster = None  # ray.cluster_utils.Cluster
    processes: list = []


def _stop_cluster() -> None:
    """Ray's own shutdown of each node, then SIGKILL by PID to whatever of them outlived it."""
    cluster, _Running.cluster = _Running.cluster, None
    if cluster is None:
        return
    for node in [cluster.head_node, *cluster.worker_nodes]:
        if node is not None:
            _Running.processes += _node_processes(node)
    try:
        cluster.shutdown()
    finally:
        _end_by_pid(_Running.processes)
        _Running.processes = []


@pytest.fixture(scope="session")
def ray_cluster():
    """A head (stand-in H100) and a second node (stand-in A100), two CPUs each, small object stores, both on
    127.0.0.1; one per test run, for tests/test_fleet.py. Stopped after the last test that uses it (an idle
    cluster's half-dozen processes still take CPU) or at the end of the run, whichever comes
    first, by the PIDs of its nodes' processes and their children, whatever the tests did to it."""
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    # two CPUs a node: room for two one-CPU tasks, so that a CPU child that reserved one CPU (before issue 40's
    # share_node) would time beside another on its node (tests/test_fleet.py checks none does)
    small = {"num_cpus": 2, "object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1"}
    with pytest.MonkeyPatch.context() as mp:
        # Ray's switch for a cluster of one host (its default on macOS): every Ray process takes 127.0.0.1 as its
        # node's address, the nodes and every driver that joins them (a sweep, a test), this process included;
        # a driver that took the host's own address would wait forever for a node of that address
        mp.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        mp.setenv("PIP_NO_INDEX", "1")  # a cluster without a package index: a runtime_env's pip never reaches one
        _Running.cluster = cluster = Cluster()  # its reaper process ends the nodes if this worker is killed
        try:  # the first node added is the head
            head = cluster.add_node(**small, include_dashboard=False, resources={"accelerator_type:H100": 1})
            _Running.processes += _node_processes(head)
            worker = cluster.add_node(**small, resources={"accelerator_type:A100": 1})
            _Running.processes += _node_processes(worker)
            cluster.wait_for_nodes()
            yield RayFleet(cluster, cluster.address, {"h100": head.node_id, "a100": worker.node_id}, worker)
        finally:
            _stop_cluster()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses the cluster (its one file runs in one worker, in the file's order)."""
    if "ray_cluster" in getattr(item, "fixturenames", ()) and \
            "ray_cluster" not in getattr(nextitem, "fixturenames", ()):
        _stop_cluster()


# ------------------------------------------------------------------------------------------ one README run

README = (REPO / "README.md").read_text()
NOT_RUN = re.compile(r"^<!-- not-run: (?P<why>.+\S) -->$")
FENCE = re.compile(r"^```(?P<lang>[a-z]*)$")
RUNS = ("bash", "python")


@dataclass(frozen=True)
class Example:
    lang: str
    code: str
    line: int  # of its opening fence, 1-based
    not_run: str | None  # why it is not run here

    def argv(self) -> list[str]:
        # bash -e: a failing command fails the example (no pipefail: `curl ... | head -c 300` closes early)
        return ["bash", "-e", "-c", self.code] if self.lang == "bash" else [sys.executable, "-c", self.code]


def examples(text: str = README) -> list[Example]:
    """The README's fenced blocks, each with the not-run reason written on the line before it, if any."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
        mark = NOT_RUN.match(lines[i - 1]) if i else None
        found.append(Example(fence["lang"], "\n".join(lines[i + 1:end]) + "\n", i + 1, mark and mark["why"]))
        i = end + 1
    return found


#: The README's sections whose examples make the second half of the README run: a model's life (train, register,
#: pull, serve, benchmark it) and the CI gate; the first half is the rest (bench, Python, compare, sweep). No
#: example of one half reads what the other's left (the CI gate has its own store, ci.db); each half takes about
#: half the run's CPU (2026-12-06: 195 s and 182 s of the 377 s).
MODEL_HALF = ("## Train, register, pull", "## Gate a change on its benchmark")


def runnable(text: str = README, half: int | None = None) -> list[Example]:
    """The examples run as printed, in order: all, or those of ``half`` (1 or 2, :data:`MODEL_HALF`)."""
    found = [e for e in examples(text) if e.lang in RUNS and not e.not_run]
    if half is None:
        return found
    return [e for e in found if (_section(text, e.line) in MODEL_HALF) == (half == 2)]


def _section(text: str, line: int) -> str:
    """The ``## `` heading the README's 1-based ``line`` is under."""
    return next((x for x in reversed(text.splitlines()[:line]) if x.startswith("## ")), "")


def repository_copy(dst: Path) -> Path:
    """The repository's files as a fresh clone holds them (tracked and new, not ignored), in ``dst``."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            (dst / name).write_bytes(source.read_bytes())
    return dst


def user_env(clone: Path) -> dict:
    """A user's shell after `. .venv/bin/activate` in the clone: the venv first on PATH, MLflow's defaults
    (no tracking URI: ./mlflow.db), the clone's vitreg."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VIRTUAL_ENV", "PYTHONPATH"))}
    return {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": str(clone),
            "PYTHONUNBUFFERED": "1"}


def run_example(example: Example, clone: Path, env: dict) -> subprocess.CompletedProcess:
    """One example, in its own process group: what it leaves running (a server started with `&`) is ended."""
    proc = subprocess.Popen(example.argv(), cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(example.argv(), proc.returncode, out)


@dataclass(frozen=True)
class ReadmeRun:
    """The README's examples run in order in ``clone`` (a fresh copy of the repository, default store): each
    one that ran with what it did; the run stops at the first that fails (the next ones build on it)."""

    clone: Path
    ran: list  # [(Example, subprocess.CompletedProcess)], in the README's order

    def assert_ran_as_printed(self, half: int) -> None:
        """Every example of ``half`` ran, in the README's order, and passed."""
        for example, done in self.ran:
            assert done.returncode == 0, f"README line {example.line}:\n{example.code}\n{done.stdout[-4000:]}"
        assert [example for example, _ in self.ran] == runnable(half=half)

    def of(self, code: str) -> subprocess.CompletedProcess:
        """What the example whose code is ``code`` did; fails the asking test if the run never reached it."""
        for example, done in self.ran:
            if example.code == code:
                return done
        last = self.ran[-1][0].line if self.ran else None
        pytest.fail(f"the README run stopped (at the example of line {last}) before this example", pytrace=False)


def run_half(half: int, folder: Path) -> ReadmeRun:
    """The examples of ``half`` in order, in a fresh copy of the repository under ``folder``."""
    clone = repository_copy(folder / "vitreg")
    env = user_env(clone)
    ran = []
    for example in runnable(half=half):
        done = run_example(example, clone, env)
        ran.append((example, done))
        if done.returncode != 0:
            break
    return ReadmeRun(clone, ran)


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory) -> ReadmeRun:
    return run_half(1, tmp_path_factory.mktemp("readme"))


@pytest.fixture(scope="session")
def readme_model_run(tmp_path_factory) -> ReadmeRun:
    return run_half(2, tmp_path_factory.mktemp("readme-model"))
