"""A fresh sqlite store opened by several processes at once: created once, under a lock, usable by all."""

import subprocess
import sys

import pytest

from vitreg.errors import StoreError
from vitreg.tracking.store import prepare_store, sqlite_path

CLIENT = """
import sys, time
from pathlib import Path
from vitreg.tracking.store import prepare_store
from mlflow.tracking import MlflowClient
uri, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()  # imported: waiting for the others
while not go.exists():  # every process opens the store at the same moment, once all four are ready
    time.sleep(0.002)
prepare_store(uri)
client = MlflowClient(tracking_uri=uri)
run = client.create_run("0")
client.log_metric(run.info.run_id, "x", 1.0)
client.set_terminated(run.info.run_id)
print(run.info.run_id)
"""


@pytest.mark.slow
def test_four_processes_on_a_fresh_store_all_get_runs(tmp_path):
    from conftest import wait_until

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, uri, str(tmp_path / f"ready-{i}"), str(go)],
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(4)]

    def all_imported() -> bool:  # the event: all four imported (no fixed head start)
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        return len(list(tmp_path.glob("ready-*"))) == 4

    wait_until(all_imported, 120, "four clients' imports")
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err[-600:] for _, err in outs]
    from mlflow.tracking import MlflowClient

    runs = MlflowClient(tracking_uri=uri).search_runs(["0"])
    assert sorted(r.info.run_id for r in runs) == sorted(out.strip() for out, _ in outs)
    assert all(r.info.status == "FINISHED" for r in runs)


def test_a_file_that_is_not_a_store_is_named(tmp_path):
    bad = tmp_path / "mlflow.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match=f"tracking store {bad} is not a usable MLflow database"):
        prepare_store(f"sqlite:///{bad}")


def test_only_sqlite_files_are_prepared():
    assert sqlite_path("sqlite:////a/b/mlflow.db") == __import__("pathlib").Path("/a/b/mlflow.db")
    assert sqlite_path("sqlite:///:memory:") is None
    assert sqlite_path("http://127.0.0.1:5000") is None
    prepare_store("http://127.0.0.1:1")  # nothing to do (and nothing contacted) for a server


@pytest.fixture
def locked_store(tmp_path, monkeypatch):
    """A migrated sqlite store another connection holds under an EXCLUSIVE lock (as a writer mid-transaction)."""
    import sqlite3

    from conftest import migrated_store

    uri = migrated_store(tmp_path)
    holder = sqlite3.connect(sqlite_path(uri), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    yield uri, holder
    holder.close()


# slow tier: each attempt on the locked file blocks for sqlite's own 5 s busy timeout (MLflow's engine
# setting) before vitreg sees "database is locked": real waiting that has no place in the fast tier
@pytest.mark.slow
def test_a_store_locked_for_longer_than_the_wait_is_busy_not_broken(locked_store, monkeypatch):
    uri, _ = locked_store
    monkeypatch.setenv("VITREG_STORE_BUSY_S", "0.5")
    with pytest.raises(StoreError, match="is busy") as caught:
        prepare_store(uri)
    assert "move it away" not in str(caught.value) and "not a usable" not in str(caught.value)


# slow tier: each attempt on the locked file blocks for sqlite's own 5 s busy timeout (MLflow's engine
# setting) before vitreg sees "database is locked": real waiting that has no place in the fast tier
@pytest.mark.slow
def test_a_store_locked_briefly_is_waited_for(locked_store, monkeypatch):
    """The lock is released when prepare_store says it waits (the event), and the store then opens."""
    import vitreg.tracking.store as store

    uri, holder = locked_store
    said = []
    monkeypatch.setattr(store, "progress", lambda message: (said.append(message), holder.rollback()))
    prepare_store(uri)
    assert len(said) == 1 and "locked by another process" in said[0]


# ---------------------------------------------------------------- one store rule, wherever the process stands

def test_a_new_store_keeps_its_artifacts_beside_its_file_wherever_the_process_stands(tmp_path, monkeypatch, capsys):
    """A store made from another folder: its Default experiment and every experiment vitreg creates file their
    artifacts beside the database (``ci-mlruns/<id>`` for ``ci.db``), nothing lands in the folder the process
    stands in, and vitreg says in one line that it created the store (MLflow filed them under ./mlruns of the
    current folder, where another store's experiment of the same id could already be)."""
    from mlflow.tracking import MlflowClient

    from vitreg.tracking.delivery import experiment_id_for

    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    monkeypatch.chdir(here)
    uri = f"sqlite:///{there / 'ci.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    prepare_store(uri)
    said = capsys.readouterr().err.splitlines()
    assert said == [f"[vitreg] created a new tracking store {there / 'ci.db'} (artifacts in {there / 'ci-mlruns'}/)"]
    client = MlflowClient(tracking_uri=uri)
    exp_id = experiment_id_for(client, "ci")
    locations = {e.name: e.artifact_location for e in client.search_experiments()}
    assert locations == {"Default": f"{there / 'ci-mlruns' / '0'}", "ci": f"{there / 'ci-mlruns' / exp_id}"}
    prepare_store(uri)  # the store exists now: nothing said
    assert capsys.readouterr().err == "" and list(here.iterdir()) == []


def test_the_artifact_root_and_the_ui_command_follow_the_store_not_the_folder(tmp_path, monkeypatch):
    """``mlflow.db`` keeps MLflow's own ``mlruns`` beside it, any other file its own ``<name>-mlruns``; the command
    a run's last line gives opens the store the run went to: ``make ui`` only for the checkout's own mlflow.db
    (the Makefile's default), the store named everywhere else (it once said `make ui` for a run in ci.db)."""
    import mlflow

    from vitreg.tracking.store import artifact_root, ui_command
    from vitreg.tracking.uris import tracking_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None)  # no earlier test's choice
    assert artifact_root("sqlite:///mlflow.db") == tmp_path / "mlruns"
    assert artifact_root("sqlite:////a/b/ci.db") == __import__("pathlib").Path("/a/b/ci-mlruns")
    assert artifact_root("http://127.0.0.1:5000") is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///ci.db")  # what messages show: the file, from anywhere
    assert tracking_uri() == f"sqlite:///{tmp_path / 'ci.db'}"
    assert ui_command("sqlite:///ci.db") == f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'ci.db'}"
    assert ui_command("sqlite:///mlflow.db") == f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "Makefile").write_text("x:\n\ttrue\nui: x\n\tmlflow ui\n")  # a checkout of vitreg
    assert ui_command("sqlite:///mlflow.db") == "make ui"
    assert ui_command(f"sqlite:///{tmp_path / 'mlflow.db'}") == "make ui"
    assert ui_command("sqlite:///ci.db") == f"make ui UI_STORE=sqlite:///{tmp_path / 'ci.db'}"


def test_a_run_s_last_line_opens_the_store_it_was_logged_to(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from vitreg.tracking.runs import where_logged

    monkeypatch.chdir(tmp_path)
    (tmp_path / "Makefile").write_text("ui:\n\tmlflow ui\n")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///ci.db")
    monkeypatch.setattr("vitreg.tracking.runs.tracking_uri", lambda: "sqlite:///ci.db")
    tracker = SimpleNamespace(offline=False, delivered=True, experiment_id="1", run_id="abc")
    assert where_logged(tracker) == (f"logged run abc to sqlite:///ci.db: open it with `make ui UI_STORE=sqlite:///"
                                     f"{tmp_path / 'ci.db'}`, then http://127.0.0.1:5000/#/experiments/1/runs/abc"
                                     "?workflowType=machine_learning")


def test_a_server_that_is_down_gets_the_offline_way_too(monkeypatch):
    """Besides starting the server: logging offline, in each spelling (CLI, mlflow run, environment)."""
    import mlflow

    from conftest import free_port
    from vitreg.tracking.store import check_server

    monkeypatch.setattr(mlflow, "get_tracking_uri", lambda: f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StoreError) as raised:
        check_server(timeout=5)
    message = str(raised.value)
    assert "does not answer" in message and "`make server`" in message
    assert "--offline true" in message and "-P offline=true" in message and "VITREG_OFFLINE=1" in message


def test_the_files_a_day_s_use_leaves_are_ignored(tmp_path):
    """A store and its lock beside it, the README's CI store and its artifacts, the serve example's batch and
    the pulled model folder: untracked files `git status` would list after following the README."""
    from conftest import REPO

    names = ["mlflow.db", "mlflow.db.lock", "ci.db", "ci.db.lock", "ci-mlruns/1/x", "mlruns/0/x", "batch.json",
             "deit-tiny/model.safetensors"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *names], cwd=REPO, capture_output=True, text=True)
    assert sorted(done.stdout.split()) == sorted(names), done.stderr


def test_the_checkout_guard_names_what_a_test_wrote_there(tmp_path):
    """tests/conftest.py fails a test after which the checkout holds something new: a top-level file, or a run
    under an mlruns/ that was already there (what `make test-fast` once left: seven runs, one of 127 MB)."""
    from conftest import checkout_entries

    (tmp_path / "mlruns" / "0").mkdir(parents=True)
    (tmp_path / "__pycache__").mkdir()
    before = checkout_entries(tmp_path)
    (tmp_path / "mlruns" / "0" / "0123abcd").mkdir()
    (tmp_path / "mlflow.db.lock").touch()
    assert checkout_entries(tmp_path) - before == {"mlruns/0/0123abcd", "mlflow.db.lock"}


def test_the_checkout_guard_leaves_the_user_s_own_store_alone(tmp_path):
    """A user's store in the checkout (`make bench`'s ./mlflow.db) written while a test runs (`make ui`, a
    benchmark beside `make test-fast`) gets its journal: not the test's doing (issue 47: 15 errors). A new store's
    journal still counts."""
    from conftest import checkout_entries, new_in_checkout

    (tmp_path / "mlflow.db").touch()
    before = checkout_entries(tmp_path)
    for name in ("mlflow.db-journal", "mlflow.db-wal", "ci.db-journal"):
        (tmp_path / name).touch()
    assert new_in_checkout(before, tmp_path) == ["ci.db-journal"]
