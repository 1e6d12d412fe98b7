"""Shared test fixtures: a real sqlite MLflow store per test, and the repo's paths."""

import ast
import atexit
import contextlib
import fcntl
import functools
import gc
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

# what a test run starts once and shares (the Ray cluster, the README run, the workers' order) and the
# session's SLURM cluster (slurm_cluster, for tests/test_slurm.py)
pytest_plugins = ["_sessions", "_slurm_cluster"]

REPO = Path(__file__).resolve().parent.parent

# The suite runs two workers on this project's 2-core machines, and most tests start torch processes.
# With torch's default of one OpenMP thread per core, every process spins two threads and together
# they oversubscribe the cores: a test_vit training step took 108 ms instead of 42 ms under the
# suite's load. One thread per process (set before torch is imported; every child inherits it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Inductor probes which vector ISA g++ can build and load (nine test builds, ~15 s on these machines)
# once per cache folder, and the compile-cache and SDPA tests compile into fresh folders on purpose.
# Trusting the CPU's own flags (CPUID, which inductor reads first anyway) skips the probes: a cold
# compile of a small training graph went from 23 s to 7 s; the generated code is the same.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# Runs a test cannot deliver (dead servers, offline=true, fuzzed options) wait in a spool: keep them in a
# folder of this test process, not in the user's ~/.local/share/vitreg/spool. Child processes inherit it.
if "VITREG_SPOOL_DIR" not in os.environ:
    os.environ["VITREG_SPOOL_DIR"] = tempfile.mkdtemp(prefix="vitreg-test-spools-")
    atexit.register(shutil.rmtree, os.environ["VITREG_SPOOL_DIR"], True)
VENV_BIN = Path(sys.executable).parent


def pytest_collection_finish(session):
    """Every test module is imported now (torch, MLflow, pandas: half a million objects that live until the
    run ends). Python's cycle collector walks all of them on each full collection, its own ones included,
    and vitreg calls gc.collect() after every batch_size=auto probe and out-of-memory error: 0.36 s each
    here. Frozen, they are left out of those walks (0.1 ms); what the tests make after this point is
    collected as before. The modules the tests import later (torch's dynamo and export, timm's models,
    matplotlib) are frozen after the test that imported them (:func:`_freeze_new_imports`)."""
    gc.freeze()
    _FROZEN_AT[0] = len(sys.modules)


#: len(sys.modules) at the last gc.freeze(): a test that imported more than _NEW_MODULES modules since left
#: their objects (~250,000 after timm's and dynamo's) in every later full collection's walk, 0.2-0.3 s each
_FROZEN_AT = [0]
_NEW_MODULES = 20


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    result = yield
    _freeze_new_imports()
    return result


def _freeze_new_imports() -> None:
    """After a test that imported modules, collect once and freeze what is left: the modules' objects live
    until the run ends anyway; the collection first, so no garbage of the test is frozen with them."""
    if len(sys.modules) - _FROZEN_AT[0] >= _NEW_MODULES:
        gc.collect()
        gc.freeze()
        _FROZEN_AT[0] = len(sys.modules)


#: What may appear in the checkout while the suite runs: Python's and pytest's caches.
_CACHES = {"__pycache__", ".pytest_cache"}


def checkout_entries(root: Path = REPO) -> set[str]:
    """The checkout's top-level names, and every ``mlruns/<experiment>/<run>`` under it (a run logged into the
    checkout's artifact root while ``mlruns/`` already existed there), caches left out."""
    names = {name for name in os.listdir(root) if name not in _CACHES}
    mlruns = root / "mlruns"
    if mlruns.is_dir():
        names |= {f"mlruns/{exp.name}/{run}" for exp in mlruns.iterdir() if exp.is_dir() for run in os.listdir(exp)}
    return names


#: the files sqlite keeps beside a store while it is written: a user's own store in the checkout (`make bench`'s
#: ./mlflow.db) gets them from whoever writes it meanwhile (`make ui`, a benchmark beside the suite): not new
_SQLITE_SIDECARS = ("-journal", "-wal", "-shm")


def new_in_checkout(before: set[str], root: Path = REPO) -> list[str]:
    """What ``root`` holds now and did not hold in ``before``, less the sqlite files of a store it held then."""
    return sorted(name for name in checkout_entries(root) - before
                  if not (name.endswith(_SQLITE_SIDECARS) and name.rsplit("-", 1)[0] in before))


@pytest.fixture(autouse=True)
def _nothing_into_the_checkout(tmp_path, monkeypatch):
    """A test that names no store logs to one of its own in tmp_path: MLflow's default is ./mlflow.db of the
    folder the suite runs from, the checkout, with artifacts in its ./mlruns. And a test after which the
    checkout holds something new (a store, a run's artifacts, a pulled model) fails, naming it."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    before = checkout_entries()
    yield
    gained = new_in_checkout(before)
    if gained:
        pytest.fail(f"the test wrote into the checkout: {', '.join(gained[:5])}; write under tmp_path instead",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _no_delivery_left_running():
    """A test after which a run's delivery thread still runs fails, naming itself. That thread holds
    short_http_requests (process-wide, counted): left running, it kept MLflow's minutes of retries on for every
    later test of the worker, and four tests of tests/test_spool.py failed far from the cause (CI, stop 41). A
    thread finishing its last request (a close that timed out) is waited for; one whose tracker was never
    closed is stopped, so the tests after it run as they would alone."""
    yield
    left = [thread for thread in threading.enumerate() if thread.name == "vitreg-spool"]
    for thread in left:
        thread.join(15)  # the last request: VITREG_HTTP_TIMEOUT_S (10 s) and a margin
    running = [thread for thread in left if thread.is_alive()]
    for thread in running:
        tracker = thread._target.__self__  # SpoolingTracker._deliver_loop: no public handle on a run never closed
        tracker._stopped.set()
        tracker._wake.set()
        thread.join(15)
    if running:
        pytest.fail(f"the test left {len(running)} run(s) delivering (a SpoolingTracker never closed): close it, "
                    f"or end the run through tracked_run", pytrace=False)


@pytest.fixture(autouse=True)
def _own_batch_cache(tmp_path, monkeypatch):
    """batch_size=auto keeps its choices (vitreg.measure.batch_cache): each test, and the processes it starts,
    gets a file of its own, so no test reuses another's choice or the user's."""
    monkeypatch.setenv("VITREG_BATCH_CACHE", str(tmp_path / "autobatch.json"))


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """The syntax tree of the Python file at ``path``, parsed once per test process: the layout tests walk
    every module of the package several times (a tree is shared: read it, never change it)."""
    return ast.parse(Path(path).read_text(), filename=str(path))


@pytest.fixture
def clean_vitreg_env(monkeypatch):
    """No VITREG_* / MLflow settings from the developer's shell leak into a test (the spool's tests: a
    VITREG_SPOOL_DIR or an MLflow run id there would change where a run goes)."""
    for name in list(os.environ):
        if name.startswith(("VITREG_", "MLFLOW_HTTP", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a server a test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- built once per test run
# What costs seconds to make (a migrated store, a store holding registered models) is made once per test
# run, in a folder every xdist worker sees, by whichever worker asks first; the others wait on its lock
# and reuse it. Tests never write there: they get a copy (copy_store) or read it as it is.
_RUN_FOLDER: list[Path] = []


def pytest_configure(config):
    handed = getattr(config, "workerinput", {}).get("vitreg_run_folder")
    if handed:  # an xdist worker: the controller's folder
        _RUN_FOLDER.append(Path(handed))
    else:  # the controller (or a run without xdist) makes it, and removes it when the run ends
        _RUN_FOLDER.append(Path(tempfile.mkdtemp(prefix="vitreg-test-run-")))
        atexit.register(shutil.rmtree, _RUN_FOLDER[0], True)
        atexit.register(_stop_shared_server)  # first (last in, first out): before its folder goes


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # pytest-xdist's hook: what each worker is handed at its start
    node.workerinput["vitreg_run_folder"] = str(_RUN_FOLDER[0])


def built_once(name: str, build) -> Path:
    """The folder ``name`` of this test run, made by ``build(folder)`` the first time any worker asks."""
    folder = _RUN_FOLDER[0] / name
    with open(_RUN_FOLDER[0] / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait here while one builds
        if not (folder / ".built").exists():  # a build that raised left no mark: the next asker tries again
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def _migrate(folder: Path) -> None:
    from vitreg.tracking.store import prepare_store

    # MLflow files the Default experiment's artifacts under ./mlruns of the directory it is made in
    # (an absolute path): made here, never in the checkout the tests run from
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        prepare_store(f"sqlite:///{folder / 'mlflow.db'}")


def copy_store(source: Path, directory) -> str:
    """The URI of a copy, ``directory/mlflow.db``, of the store in folder ``source`` and of every artifact it
    holds there: the copy's runs, experiments and model versions point at the copied artifacts, so a test
    may change anything in it without touching the original or another test's copy."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.is_dir():
            shutil.copytree(entry, directory / entry.name, dirs_exist_ok=True)
        elif entry.name not in (".built", "mlflow.db.lock"):
            shutil.copyfile(entry, directory / entry.name)
    _repoint(directory / "mlflow.db", str(source), str(directory))
    return f"sqlite:///{directory / 'mlflow.db'}"


def _repoint(db: Path, old: str, new: str) -> None:
    """Every text field of the sqlite file ``db`` that names a path under ``old`` names it under ``new``."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for column in conn.execute(f'PRAGMA table_info("{table}")'):
                if column[2].upper().startswith(("VARCHAR", "TEXT")):
                    conn.execute(f'UPDATE "{table}" SET "{column[1]}" = replace("{column[1]}", ?, ?) '
                                 f'WHERE instr("{column[1]}", ?) > 0', (old, new, old))


def migrated_store(directory) -> str:
    """The URI of a real sqlite MLflow store, ``directory/mlflow.db``, whose schema is already made.

    It is a copy of one store made once per test run (:func:`built_once`): making a store runs MLflow's
    schema migrations, 2-4 s each time on these machines. Its Default experiment files its artifacts under
    ``directory/mlruns/0``. The tests about fresh stores (concurrent creation, the mission's first run)
    make their own.
    """
    return copy_store(built_once("migrated-store", _migrate), directory)


def premigrated(data_dir: Path) -> Path:
    """``data_dir`` for a ``ServerConfig``, holding its ``mlflow.db`` already migrated (a copy of the
    template store): `mlflow server` migrates a new file before it serves, ~1 s of CPU each start."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    migrated_store(data_dir)
    return Path(data_dir)

# ---------------------------------------------------------------- one mlflow server per test run
# A real `mlflow server` costs seconds of CPU to start; the tests that only log to one and read back their own
# experiments share this one, whichever worker they run in.

@pytest.fixture(scope="session")
def mlflow_server():
    """One real ``mlflow server`` (no auth, a sqlite store) per test run: its ``ServerConfig``. Started by the first
    worker that asks (:func:`built_once`), in its own process group, with no VITREG_/MLFLOW_ setting of the
    developer's shell; every worker uses it; the run's controller stops it by PID as the run ends. A test using it
    logs under experiments and model names of its own: tests in the other worker log there at the same time."""
    from vitreg.deploy.server import ServerConfig

    started = json.loads((built_once("mlflow-server", _start_shared_server) / "server.json").read_text())
    return ServerConfig(port=started["port"], data_dir=started["data_dir"])


def _start_shared_server(folder: Path) -> None:
    import psutil

    from vitreg.deploy import server
    from vitreg.deploy.server import ServerConfig

    cfg = ServerConfig(port=free_port(), data_dir=premigrated(folder / "data"))
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith(("VITREG_", "MLFLOW_")) and n != "VITREG_SPOOL_DIR"]:
            mp.delenv(name)
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        proc = server.start(cfg, timeout=120, quiet=True)
    (folder / "server.json").write_text(json.dumps({"port": cfg.port, "data_dir": str(cfg.data_dir), "pid": proc.pid,
                                                    "created": psutil.Process(proc.pid).create_time()}))


def _stop_shared_server() -> None:
    """SIGTERM, then SIGKILL, to the shared server's processes, if one was started: by its PID and start time (a PID
    the OS has since given to another process is left alone)."""
    import psutil

    info = _RUN_FOLDER[0] / "mlflow-server" / "server.json"
    if not info.exists():
        return
    started = json.loads(info.read_text())
    try:
        leader = psutil.Process(started["pid"])
        if leader.create_time() != started["created"]:
            return
        procs = [leader, *leader.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)
        procs = psutil.wait_procs(procs, timeout=15)[1]


def wait_until(condition, timeout_s: float = 30.0, what: str = "the condition") -> None:
    """Return as soon as ``condition()`` holds (checked every 20 ms); fail after ``timeout_s``. A test waits on
    what it needs to see, never for a fixed time that a loaded machine can outlast."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s:g} s", pytrace=False)
        time.sleep(0.02)


@pytest.fixture
def ports_tried(monkeypatch) -> list:
    """(thread name, port) of every TCP connection this process tries while the test runs: which thread asked
    a server and how often, counted rather than timed (a retry or a wait in the wrong thread shows here
    whatever the machine's load)."""
    tried = []
    real_connect = socket.socket.connect

    def recording_connect(sock, address):
        if isinstance(address, tuple):
            tried.append((threading.current_thread().name, address[1]))
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    return tried


def subprocess_env(tracking_uri: str, **extra) -> dict:
    """Environment for a child process: this interpreter's bin first on PATH (MLproject commands call
    `python`), the given store, no inherited MLflow run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def sqlite_store(tmp_path, monkeypatch):
    """A sqlite tracking store of its own in tmp_path (made from the template: :func:`migrated_store`),
    set for this process; yields its URI."""
    uri = migrated_store(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for key in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)  # artifacts of the default experiment land in ./mlruns here
    import mlflow
    import mlflow.tracking.fluent as fluent

    # set_experiment() (a `--experiment` test) leaves its id in the fluent module and in os.environ,
    # where the next test's fresh store has no such experiment: start each test without it
    fluent._active_experiment_id = None
    mlflow.set_tracking_uri(uri)
    yield uri
    while mlflow.active_run():
        mlflow.end_run()
    fluent._active_experiment_id = None
    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)


# ---------------------------------------------------------------- the fast tier starts no process
# A test that starts a process (a Python interpreter, `mlflow server`, torchrun, a shell) costs seconds
# of CPU on these 2-core machines: it belongs to the slow tier (`-m "not slow"` skips it). This hook
# makes that a rule the suite checks rather than a habit: a test without @pytest.mark.slow that starts
# one fails, naming the program. Quick probes vitreg makes on every run (git for the sha, nvidia-smi,
# the compilers inductor calls) are not counted, nor fc-list: matplotlib runs it once per machine to list
# the fonts for its cache (a fresh venv's first chart, whichever test draws it).
import subprocess  # noqa: E402

PROBES = {"git", "nvidia-smi", "g++", "gcc", "c++", "cc", "ldconfig", "uname", "lscpu", "which", "fc-list"}
_spawned: list[str] = []
_execute_child = subprocess.Popen._execute_child


def _recording_execute_child(self, args, *rest, **kwargs):
    program = args if isinstance(args, (str, bytes)) else args[0]
    name = os.path.basename(os.fsdecode(program).split()[0]) if program else ""
    if name not in PROBES:
        _spawned.append(name)
    return _execute_child(self, args, *rest, **kwargs)


subprocess.Popen._execute_child = _recording_execute_child


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _spawned.clear()
    result = yield
    if _spawned and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} starts a process ({', '.join(sorted(set(_spawned)))}) but is not marked "
                    "@pytest.mark.slow: mark it (the fast tier starts no process)", pytrace=False)
    return result
