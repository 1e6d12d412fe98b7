"""`vitreg check` as CI runs it through MLflow projects: `mlflow run . -e check` on a store whose newest run
regressed fails the command. (The README's CI recipe, run as typed: tests/test_readme.py.)"""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO, migrated_store, subprocess_env


@pytest.mark.slow
def test_the_mlproject_entry_point_check_fails_on_a_regression(tmp_path):
    """`mlflow run . -e check`: the run `mlflow run` opens is the check run, and a regression fails the command."""
    import sys

    from mlflow.tracking import MlflowClient

    from vitreg.tracking.store import create_experiment

    sys.path.insert(0, str(REPO / "benchmarks"))
    from check_runs import log_run

    uri = migrated_store(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    exp = create_experiment(client, "ci")  # its artifacts beside the store (MLflow's: ./mlruns of the checkout)
    values = [1000, 1008, 995, 1003, 990, 1010, 1001, 997, 1005, 850]  # the newest 15 % slower
    ids = [log_run(client, exp, i, v) for i, v in enumerate(values)]
    env = subprocess_env(uri, PYTHONPATH=str(REPO))
    proc = subprocess.run(["mlflow", "run", str(REPO), "-e", "check", "--env-manager", "local",  # the venv's mlflow
                           "--experiment-name", "ci", "-P", "experiment=ci"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, proc.stdout + proc.stderr[-2000:]
    assert re.search(r"REGRESSED: deit_tiny_patch16_224 on h200: 0\.8[45]\d*x", proc.stdout), proc.stdout
    (run,) = client.search_runs([exp], "tags.vitreg_job = 'check'")
    assert run.data.tags["check_result"] == "regressed" and run.data.tags["check_regressed_runs"] == ids[-1]
    assert run.data.tags.get("mlflow.project.entryPoint") == "check"
