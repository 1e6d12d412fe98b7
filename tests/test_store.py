"""A fresh sqlite store opened by several processes at once: created once, under a lock, usable by all."""

import subprocess
import sys

import pytest

from vitreg.errors import StoreError
from vitreg.tracking.store import prepare_store, sqlite_path

CLIENT = """
import sys, time
from vitreg.tracking.store import prepare_store
from mlflow.tracking import MlflowClient
uri = sys.argv[1]
start = float(sys.argv[2])
while time.time() < start:  # every process opens the store at the same moment
    time.sleep(0.005)
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
    start = time.time() + 8  # after the imports of all four
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, uri, str(start)], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
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
