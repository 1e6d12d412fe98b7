"""The README's CI recipe ("Gate a change on its benchmark") run as typed, on CPU, in a subprocess: real
`vitreg bench` runs of a tiny timm model, a history of earlier runs, and `vitreg check` failing the job."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from conftest import REPO, migrated_store, subprocess_env

README = (REPO / "README.md").read_text()


def recipe() -> str:
    """The bash block of the README's section "Gate a change on its benchmark"."""
    section = README.split("## Gate a change on its benchmark", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _bash(script: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in subprocess_env("").items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's vitreg, also for the venv's `vitreg` script
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _earlier_copies(uri: str, n: int, speedup: float) -> list[str]:
    """``n`` copies of the store's one run (its params and tags: the same configuration and GPU), started
    before it, each ``speedup`` times as fast: a history the next real run falls short of."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (real,) = client.search_runs([client.get_experiment_by_name("ci").experiment_id])
    tags = {k: v for k, v in real.data.tags.items() if not k.startswith("mlflow.")}
    ids = []
    for i in range(n):
        start = real.info.start_time - (n - i) * 60_000
        run = client.create_run(real.info.experiment_id, start_time=start, tags=tags)
        metrics = [Metric(k, v * (speedup if k.endswith("_img_per_s") else 1), start, 0)
                   for k, v in real.data.metrics.items() if k.startswith("infer_")]
        client.log_batch(run.info.run_id, metrics=metrics,
                         params=[Param(k, v) for k, v in real.data.params.items()], tags=[RunTag("copy", "yes")])
        client.set_terminated(run.info.run_id, end_time=start + 1000)
        ids.append(run.info.run_id)
    return ids


@pytest.mark.slow
def test_the_readme_ci_recipe_fails_the_job_on_a_regressed_run(tmp_path):
    script = recipe()
    assert "vitreg bench" in script and "vitreg check" in script
    uri_line, bench_line = (line for line in script.splitlines() if line.startswith(("export", "vitreg bench")))
    db = re.search(r"sqlite:///(\S+)", uri_line).group(1)
    shutil.move(migrated_store(tmp_path)[len("sqlite:///"):], tmp_path / db)  # a migrated store at that path
    first = _bash(f"{uri_line}\n{bench_line}", tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    # 10x: a loaded 2-core machine moved one CPU run's median by 3x between two runs of the same work
    history = _earlier_copies(f"sqlite:///{tmp_path / db}", 10, speedup=10.0)

    job = _bash(script, tmp_path)  # the recipe as typed: a second real bench, then the check
    assert job.returncode == 1, job.stdout + job.stderr[-2000:]
    (line,) = [x for x in job.stdout.splitlines() if x.startswith("REGRESSED: deit_tiny_patch16_224")]
    assert re.search(r"on cpu: 0\.[0-3]\d*x \[", line), line  # a tenth of the history's speed, give or take load
    assert f"vs 10 runs ({history[1]}.." in line  # the 9 newest copies and the first real run

    again = _bash(f"{uri_line}\nvitreg check --experiment ci --window 0", tmp_path)
    assert again.returncode == 2 and again.stderr.count("error: ") == 1 and "window=0" in again.stderr


@pytest.mark.slow
def test_the_mlproject_entry_point_check_fails_on_a_regression(tmp_path):
    """`mlflow run . -e check`: the run `mlflow run` opens is the check run, and a regression fails the command."""
    import sys

    from mlflow.tracking import MlflowClient

    sys.path.insert(0, str(REPO / "benchmarks"))
    from check_runs import log_run

    uri = migrated_store(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("ci")
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
