"""Issue 31, families 6 and 7: a tracking store that cannot be read is one `error:` line with the advice for its
cause (busy, damaged, not a store, read-only, not permitted, a lock file that is a folder, a server that is down
or does not speak HTTP), exit 2, within seconds of the same command against a refused port, nothing RUNNING.

The faults are real: a PostgreSQL URI on a port nobody listens on, a sqlite file held under ``BEGIN EXCLUSIVE``
by another connection, files truncated or overwritten, a tmpfs mounted read-only, a socket server that writes an
SSH banner and closes. Modes are met as root with ``setpriv --bounding-set -dac_override,-dac_read_search``
(root without the capabilities that bypass file modes).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vitreg.errors import StoreError, VitregError
from vitreg.tracking.store import prepare_store, sqlite_path

from conftest import free_port, migrated_store, subprocess_env

NO_MODE_BYPASS = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and dropping capabilities need root")


def _truncated(tmp_path: Path) -> str:
    uri = migrated_store(tmp_path / "store")
    db = sqlite_path(uri)
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 3])
    return uri


def _overwritten(tmp_path: Path) -> str:
    uri = migrated_store(tmp_path / "store")
    with open(sqlite_path(uri), "r+b") as fh:  # the header and the first pages: what a stray write does
        fh.write(os.urandom(64 * 1024))
    return uri


# --------------------------------------------------------------------------- the advice, per cause (fast)


def test_a_lock_path_that_is_a_folder_is_named_not_called_a_broken_store(tmp_path):
    """Issue 31 family 7: was "not a usable MLflow database ... move it away" (which would lose its runs)."""
    uri = migrated_store(tmp_path / "store")
    lock = sqlite_path(uri).with_name("mlflow.db.lock")
    lock.mkdir()
    with pytest.raises(StoreError) as caught:
        prepare_store(uri)
    message = str(caught.value)
    assert f"the lock file {lock} beside the tracking store" in message and "is a folder: remove" in message
    assert "move it away" not in message and "not a usable" not in message


def test_a_truncated_store_is_called_damaged_with_a_way_out(tmp_path):
    """A sqlite file cut short (a copy interrupted, a full disk): "damaged", restore from a backup."""
    uri = _truncated(tmp_path)
    with pytest.raises(StoreError) as caught:
        prepare_store(uri)
    message = str(caught.value)
    assert f"the tracking store {sqlite_path(uri)} is damaged" in message and "restore it from a backup" in message


def test_an_overwritten_store_is_one_line_naming_it(tmp_path):
    """Its header overwritten, sqlite cannot tell a damaged store from a file that never was one."""
    uri = _overwritten(tmp_path)
    with pytest.raises(StoreError) as caught:
        prepare_store(uri)
    message = str(caught.value)
    assert f"the tracking store {sqlite_path(uri)} " in message
    assert "is damaged" in message or "not a usable MLflow database" in message, message


@pytest.mark.parametrize("command,job", [("bench", "vitreg.bench.job"), ("train", "vitreg.train.job"),
                                         ("infer", "vitreg.bench.job")])
def test_a_dead_server_is_said_before_the_job_s_heavy_imports(monkeypatch, ports_tried, command, job):
    """A job against a server that does not answer says so before importing its module (torch, timm: seconds
    before a line that needs neither); offline, or in a torchrun rank, the server is not asked here and the job goes
    on to its import."""
    import mlflow
    from click.testing import CliRunner

    from vitreg.cli.main import main

    dead_port = free_port()
    monkeypatch.setattr(mlflow, "get_tracking_uri", lambda: f"http://bob:pw@127.0.0.1:{dead_port}")
    monkeypatch.setitem(sys.modules, job, None)  # importing the job's module now raises ImportError
    monkeypatch.delenv("VITREG_OFFLINE", raising=False)
    args = COMMANDS[command]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2, (done.exception, done.output)
    assert done.output.startswith("error: the MLflow tracking server at http://***@127.0.0.1:") and \
        "Connection refused" in done.output and done.output.count("\n") == 1, done.output
    assert [port for _, port in ports_tried].count(dead_port) == 1
    ports_tried.clear()
    offline = CliRunner().invoke(main, [*args, "--offline", "true"])
    assert isinstance(offline.exception, ImportError) and job in str(offline.exception), offline.output
    monkeypatch.setenv("LOCAL_RANK", "0")  # a torchrun rank: its launcher has asked
    rank = CliRunner().invoke(main, args)
    assert isinstance(rank.exception, ImportError) and job in str(rank.exception), rank.output
    assert dead_port not in [port for _, port in ports_tried]


def test_a_server_uri_is_checked_whatever_the_case_of_its_scheme(ports_tried):
    """``HTTP://`` names a server as ``http://`` does: it was not checked, and a dead one was found only as the
    run started (after the job's imports), in other words."""
    from vitreg.tracking.store import check_server

    dead_port = free_port()
    with pytest.raises(StoreError) as caught:
        check_server(uri=f"HTTP://127.0.0.1:{dead_port}/?X_API_KEY=UpperCas3Val")
    assert str(caught.value).startswith(f"the MLflow tracking server at http://127.0.0.1:{dead_port}/?X_API_KEY=*** "
                                        "does not answer"), str(caught.value)
    assert [port for _, port in ports_tried].count(dead_port) == 1


@pytest.mark.slow
@AS_ROOT
def test_a_store_on_a_read_only_file_system_is_called_read_only(tmp_path):
    """Issue 31 family 7: a valid store in a read-only place was "not a usable MLflow database ... move it away"."""
    source = sqlite_path(migrated_store(tmp_path / "store"))
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        shutil.copyfile(source, mount / "mlflow.db")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        with pytest.raises(StoreError) as caught:
            prepare_store(f"sqlite:///{mount / 'mlflow.db'}")
        message = str(caught.value)
        assert f"{mount / 'mlflow.db'} is on a read-only file system" in message, message
        assert "move it away" not in message and "not a usable" not in message
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# --------------------------------------------------------------------------- commands against each fault (slow)


@pytest.fixture
def ssh_banner():
    """A TCP server that answers every connection with an SSH banner and closes it: not HTTP."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    server.close()


class _Held(str):
    """A store's URI, and ``holder``: the connection holding it under BEGIN EXCLUSIVE."""

    holder: sqlite3.Connection


@pytest.fixture
def locked(tmp_path):
    """A migrated sqlite store held by another connection under BEGIN EXCLUSIVE until the test lets it go."""
    uri = _Held(migrated_store(tmp_path / "locked"))
    uri.holder = sqlite3.connect(sqlite_path(uri), isolation_level=None)
    uri.holder.execute("BEGIN EXCLUSIVE")
    yield uri
    uri.holder.close()


RUN_ID = "0123456789abcdef0123456789abcdef"
TINY = ["--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--device", "cpu", "--experiment", "f"]
COMMANDS = {
    "runs --stale": ["runs", "--stale"],
    "compare": ["compare", "--experiment", "f"],
    "pull": ["pull", f"runs:/{RUN_ID}/checkpoints/last"],
    "bench": ["bench", *TINY, "--task", "infer", "--warmup", "1", "--steps", "2", "--repeats", "2"],
    "infer": ["infer", "--model-uri", f"runs:/{RUN_ID}/checkpoints/last", "--device", "cpu", "--warmup", "1",
              "--steps", "2", "--repeats", "2"],
    "train": ["train", *TINY, "--steps", "2"],
}
# what each fault's line must say: the cause, in the words of its advice
SAYS = {"postgres-down": "does not answer", "locked": "is busy", "truncated": "is damaged",
        "overwritten": ("is damaged", "not a usable MLflow database"), "ssh-banner": "not as an MLflow server speaks"}


def _vitreg(args: list[str], uri: str, cwd: Path, prefix=()) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    done = subprocess.run([*prefix, sys.executable, "-m", "vitreg", *args], cwd=cwd, capture_output=True, text=True,
                          env=subprocess_env(uri, MLFLOW_DISABLE_TELEMETRY="true", VITREG_STORE_BUSY_S="1"),
                          timeout=400)
    return done, time.monotonic() - began


@functools.lru_cache(maxsize=None)
def _baseline_s(command: str, cwd: str) -> float:
    """The same command against a port nobody listens on (refused at once): imports, start-up, one line. A job
    (bench, infer, train) says a dead server before its imports (cli.common.server_first), so its baseline is a
    sqlite store whose folder is a file: refused at once as its run starts, after the imports, as a store's
    own fault is."""
    if command in ("bench", "infer", "train"):
        blocker = Path(cwd) / "baseline-store-folder-is-a-file"
        blocker.touch()
        return _vitreg(COMMANDS[command], f"sqlite:///{blocker / 'mlflow.db'}", Path(cwd))[1]
    return _vitreg(COMMANDS[command], f"http://127.0.0.1:{free_port()}", Path(cwd))[1]


def _fault_uri(fault: str, request, tmp_path: Path) -> str:
    if fault == "postgres-down":
        return f"postgresql://vitreg:s3cretpw@127.0.0.1:{free_port()}/vitreg"
    if fault == "ssh-banner":
        return request.getfixturevalue("ssh_banner")
    if fault == "locked":
        return request.getfixturevalue("locked")
    return {"truncated": _truncated, "overwritten": _overwritten}[fault](tmp_path)


def assert_one_line(done: subprocess.CompletedProcess, says) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    says = (says,) if isinstance(says, str) else says
    assert any(phrase in errors[0] for phrase in says), errors[0]
    assert "s3cretpw" not in done.stderr + done.stdout
    return errors[0]


def _nothing_running(uri: str) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    running = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
               if r.info.status == "RUNNING"]
    assert running == []


CASES = [(command, fault) for command in ("runs --stale", "compare", "pull") for fault in SAYS]
CASES += [(command, fault) for command in ("bench", "infer", "train") for fault in ("postgres-down", "ssh-banner")]
CASES += [("bench", "locked"), ("bench", "truncated")]


@pytest.mark.slow
@pytest.mark.parametrize("command,fault", CASES, ids=[f"{c}-{f}" for c, f in CASES])
def test_a_store_that_cannot_be_read_is_one_line_within_seconds(tmp_path, request, command, fault):
    """Issue 31 family 6: a PostgreSQL store that is down cost ~120 s of MLflow's retries and a 211-line
    traceback; a locked sqlite store gave `database is locked` tracebacks (runs --stale, compare); a damaged
    one, tracebacks; an SSH banner at the URI, `http.client.BadStatusLine` from tracking/runs.py."""
    baseline_s = _baseline_s(command, str(tmp_path.parent))
    uri = _fault_uri(fault, request, tmp_path)
    done, took = _vitreg(COMMANDS[command], uri, tmp_path)
    assert_one_line(done, SAYS[fault])
    # twice the baseline: it is measured once per command, and the load beside it moves (CI's other worker; a
    # bench took 45 s here against a baseline of 26 s); MLflow's own retries, what this guards against, take ~120 s
    assert took < 2 * baseline_s + 15, (took, baseline_s)
    if fault == "locked":  # the one fault whose store can be read after: let go, then look
        uri.holder.rollback()
        _nothing_running(uri)


#: what a store's refusal must not wait for: the tracking and SQL stack, the driver, the job's model stack
HEAVY = {"mlflow", "sqlalchemy", "alembic", "psycopg", "psycopg2", "torch", "timm"}


def _imported_and_took(args: list[str], uri: str, cwd: Path) -> tuple[subprocess.CompletedProcess, set, float]:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "vitreg", *args], cwd=cwd, capture_output=True, text=True,
                          env=subprocess_env(uri, MLFLOW_DISABLE_TELEMETRY="true", PYTHONPROFILEIMPORTTIME="1"),
                          timeout=400)
    took = time.monotonic() - began
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    done.stderr = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("import time:"))
    return done, imported, took


@pytest.mark.slow
def test_a_down_postgresql_is_said_before_the_heavy_imports_as_fast_as_a_dead_http_server(tmp_path):
    """Issue 39 point 5: a PostgreSQL refusing connections was found by MLflow's SQL engine, after mlflow,
    SQLAlchemy, the driver and (for a job) torch were imported: `runs --stale` 4.9 s and a bench 12 s on this
    2-core machine beside one other test, 19 s under CI's load. A TCP probe now says it first, as a dead HTTP
    server is said: each command's answer is bounded by the CLI's quickest refusal, `runs --stale` against a
    dead HTTP server, measured here beside it (the best of three: under the same load, not a fixed figure)."""
    dead = free_port()
    baseline_s = min(_imported_and_took(["runs", "--stale"], f"http://127.0.0.1:{dead}", tmp_path)[2]
                     for _ in range(3))
    uri = f"postgresql://vitreg:s3cretpw@127.0.0.1:{dead}/vitreg"
    commands = {**COMMANDS, "register": ["register", f"runs:/{RUN_ID}/checkpoints/last", "--name", "tiny"]}
    for command, args in commands.items():
        done, imported, took = _imported_and_took(args, uri, tmp_path)
        line = assert_one_line(done, "does not answer (Connection refused)")
        assert line.startswith(f"error: the tracking store at postgresql://***@127.0.0.1:{dead}/vitreg "), line
        assert imported and not imported & HEAVY, (command, sorted(imported & HEAVY))
        assert took < 2 * baseline_s + 3, (command, took, baseline_s)


@pytest.mark.parametrize("call", ["runs", "compare", "check"])
def test_the_python_api_says_a_down_postgresql_at_once(call, monkeypatch, ports_tried):
    """vitreg.api.runs and .compare went straight to MLflow's SQL engine, whose ten attempts (the CLI bounds them
    to two; a Python caller's process is its own) took 108 s here: now the probe says it first, as the CLI does.
    One connection tried, the probe's."""
    import vitreg
    from vitreg.tracking.mlflow_on_first_use import mlflow

    dead = free_port()
    uri = f"postgresql://vitreg:s3cretpw@127.0.0.1:{dead}/vitreg"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(mlflow, "get_tracking_uri", lambda: uri)
    with pytest.raises(StoreError) as caught:
        getattr(vitreg.api, call)("f")
    assert str(caught.value) == (f"the tracking store at postgresql://***@127.0.0.1:{dead}/vitreg does not answer "
                                 "(Connection refused): start it, or fix MLFLOW_TRACKING_URI")
    assert [port for _, port in ports_tried] == [dead]


@pytest.fixture
def silent_server():
    """A TCP server that takes every connection and never says a word: a hung PostgreSQL, a port forwarded to
    nothing. Its port."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop, held = threading.Event(), []

    def serve():
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.slow
def test_a_postgresql_that_takes_the_connection_and_never_answers_is_one_line_within_seconds(tmp_path, silent_server,
                                                                                            monkeypatch):
    """The probe passes such a server on (it takes the connection); psycopg then waited 130 s for its first word
    at each of MLflow's two engine attempts: 260 s. The CLI sets libpq's PGCONNECT_TIMEOUT (the user's own
    wins): one wait of SQL_CONNECT_TIMEOUT_S an attempt (16 s in all here, 5.5 s of it start-up and imports, the
    silent server seeing the probe and two connections 5 s apart). The baseline is the same command
    refused at once after the same imports and engine attempts: the host in ``?host=``, which the probe leaves
    to the driver, on a port nobody listens on."""
    from vitreg.tracking.store import SQL_CONNECT_TIMEOUT_S, SQL_ENGINE_ATTEMPTS

    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    baseline, baseline_s = _vitreg(["runs", "--stale"], f"postgresql://vitreg:s3cretpw@/vitreg?host=127.0.0.1:"
                                                        f"{free_port()}", tmp_path)
    assert_one_line(baseline, "Connection refused")
    done, took = _vitreg(["runs", "--stale"], f"postgresql://vitreg:s3cretpw@127.0.0.1:{silent_server}/vitreg", tmp_path)
    assert_one_line(done, "connection timeout expired")
    waits_s = SQL_ENGINE_ATTEMPTS * SQL_CONNECT_TIMEOUT_S
    assert took < 2 * baseline_s + waits_s + 10, (took, baseline_s)


@pytest.mark.parametrize("uri", [
    "postgresql://u:pw@/vitreg",  # a local socket: no TCP host
    "postgresql://u:pw@/vitreg?host=/var/run/postgresql",
    "postgresql://u:pw@/vitreg?host=127.0.0.1:1&host=127.0.0.1:2",  # several hosts: the driver tries each
    "mysql+pymysql://u:pw@127.0.0.1/db?unix_socket=/run/mysqld/mysqld.sock",
    "mysql://u:pw@localhost/db",  # mysqlclient takes "localhost" for its local socket
    "mssql+pyodbc://u:pw@SomeDsn",  # an ODBC data source's name, not a host
    "file:///tmp/mlruns",
    "databricks",
])
def test_a_uri_with_no_single_tcp_host_is_left_to_the_driver(uri, ports_tried):
    from vitreg.tracking.store import check_sql_server

    check_sql_server(uri, timeout=1)
    assert ports_tried == []


@pytest.mark.parametrize("netloc", ["u:pw@127.0.0.1:5432,127.0.0.1:5433", "u:pw@db:port"])
def test_a_sql_uri_whose_port_is_no_number_is_one_line_naming_the_form(netloc, ports_tried):
    """Several hosts in the address (libpq's own form) were a ValueError traceback from MLflow's URI parsing."""
    from vitreg.tracking.store import check_sql_server

    with pytest.raises(VitregError) as caught:
        check_sql_server(f"postgresql://{netloc}/vitreg")
    assert str(caught.value).startswith("the tracking URI postgresql://***@") and "pw" not in str(caught.value)
    assert str(caught.value).endswith("has a port that is not a number: write postgresql://user:password@host:5432/db "
                                      "(several hosts go in the query: ?host=host1:5432&host=host2:5432)")
    assert ports_tried == []


def test_a_sql_server_that_takes_the_connection_goes_on_to_mlflow(ssh_banner, ports_tried):
    """The probe only says a host that refuses (or does not answer) the TCP connection: a server that takes it,
    however it then answers, is MLflow's and the driver's to judge."""
    from vitreg.tracking.store import check_sql_server

    port = int(ssh_banner.rsplit(":", 1)[1])
    check_sql_server(f"mysql+pymysql://u:pw@127.0.0.1:{port}/db", timeout=5)
    assert [p for _, p in ports_tried] == [port]
    with pytest.raises(StoreError, match=r"^the tracking store at mysql\+pymysql://\*\*\*@127.0.0.1:\d+/db does not "
                                         r"answer \(Connection refused\)"):
        check_sql_server(f"mysql+pymysql://u:pw@127.0.0.1:{free_port()}/db")


@pytest.mark.slow
@AS_ROOT
@pytest.mark.skipif(not shutil.which("setpriv"), reason="modes met as root need setpriv")
@pytest.mark.parametrize("command", ["runs --stale", "bench"])
def test_a_store_this_user_cannot_read_is_called_a_permission_problem(tmp_path, command):
    """Issue 31 family 7: a store the user cannot read was "not a usable MLflow database ... move it away"."""
    uri = migrated_store(tmp_path / "store")
    db = sqlite_path(uri)
    os.chown(db, 65534, 65534)
    os.chmod(db, 0o600)
    done, _ = _vitreg(COMMANDS[command], uri, tmp_path, prefix=NO_MODE_BYPASS)
    line = assert_one_line(done, f"the tracking store {db} cannot be read and written by this user")
    assert "move it away" not in line and "not a usable" not in line
    os.chown(db, 0, 0)
    _nothing_running(uri)
