"""The README's second half as typed (tests/_sessions.py: ``readme_model_run``, run beside the first half of
tests/test_readme.py in the other worker): a model's life, train -> register -> pull -> serve -> benchmark it,
and the CI gate, whose recipe then fails a job on a regressed run."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from _sessions import README
from conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow


def test_every_readme_example_of_the_second_half_runs_as_printed(readme_model_run):
    readme_model_run.assert_ran_as_printed(half=2)  # train, pull, serve, infer, the CI gate


def test_the_readme_s_scoring_server_answers_and_its_files_are_where_it_says(readme_model_run):
    served = [done.stdout for example, done in readme_model_run.ran if "/invocations" in example.code]
    assert served and '"predictions"' in served[0], served  # the scoring server answered the posted batch
    assert "curl:" not in served[0], served  # it waited for the server quietly (once ~169 "Failed to connect")
    clone = readme_model_run.clone
    assert (clone / "mlflow.db").is_file() and (clone / "deit-tiny" / "model.safetensors").is_file()


# ---------------------------------------------------------------- the CI recipe fails a job on a regression
# ("Gate a change on its benchmark", run as typed, on CPU: real `vitreg bench` runs of a tiny timm model, a
# history of earlier runs, and `vitreg check` failing the job)

def recipe() -> str:
    """The bash block of the README's section "Gate a change on its benchmark"."""
    section = README.split("## Gate a change on its benchmark", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _bash(script: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in subprocess_env("").items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's vitreg, also for the venv's `vitreg` script
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _earlier_copies(uri: str, n: int, speedup: float) -> list[str]:
    """``n`` copies of the store's one bench run (its params and tags: the same configuration and GPU), started
    before it, each ``speedup`` times as fast: a history the next real run falls short of."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    # the recipe's bench run (its `vitreg check` logged a check run apart, in ci/analysis)
    (real,) = client.search_runs([client.get_experiment_by_name("ci").experiment_id], "tags.vitreg_job = 'bench'")
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


def test_the_readme_ci_recipe_fails_the_job_on_a_regressed_run(readme_model_run, tmp_path):
    """The README run (tests/_sessions.py) ran the recipe once on a fresh store: its bench is the first real
    run. A copy of that store gets a history that run falls short of; the recipe as typed runs again on it."""
    script = recipe()
    assert "vitreg bench" in script and "vitreg check" in script
    uri_line = next(line for line in script.splitlines() if line.startswith("export"))
    db = re.search(r"sqlite:///(\S+)", uri_line).group(1)
    first = readme_model_run.of(script)
    assert first.returncode == 0, first.stdout[-2000:]
    shutil.copyfile(readme_model_run.clone / db, tmp_path / db)  # the README run's store stays as it left it
    # 10x: a loaded 2-core machine moved one CPU run's median by 3x between two runs of the same work
    history = _earlier_copies(f"sqlite:///{tmp_path / db}", 10, speedup=10.0)

    job = _bash(script, tmp_path)  # the recipe as typed: a second real bench, then the check
    assert job.returncode == 1, job.stdout + job.stderr[-2000:]
    (line,) = [x for x in job.stdout.splitlines() if x.startswith("REGRESSED: deit_tiny_patch16_224")]
    assert re.search(r"on cpu: 0\.[0-3]\d*x \[", line), line  # a tenth of the history's speed, give or take load
    assert f"vs 10 runs ({history[1]}.." in line  # the 9 newest copies and the first real run

    again = _bash(f"{uri_line}\nvitreg check --experiment ci --window 0", tmp_path)
    assert again.returncode == 2 and again.stderr.count("error: ") == 1 and "window=0" in again.stderr
