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
    import time

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, uri, str(tmp_path / f"ready-{i}"), str(go)],
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(4)]
    while len(list(tmp_path.glob("ready-*"))) < 4:  # the event: all four imported (no fixed head start)
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
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
