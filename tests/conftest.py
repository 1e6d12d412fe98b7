"""Shared test fixtures: a real sqlite MLflow store per test, and the repo's paths."""

import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The suite runs two workers on this project's 2-core machines, and most tests start torch processes.
# With torch's default of one OpenMP thread per core, every process spins two threads and together
# they oversubscribe the cores: a test_vit training step took 108 ms instead of 42 ms under the
# suite's load. One thread per process (set before torch is imported; every child inherits it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a server a test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    """A fresh sqlite tracking store in tmp_path, set for this process; yields its URI."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
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
