"""report.md: the CUDA stack is the machine's only where a GPU ran (else torch's build, said so), cuDNN as a
version, and the command block holds the command the user typed (``mlflow run ...`` under mlflow run,
the ``vitreg`` command line otherwise), not ``entry_points/bench.py``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from vitreg.bench.results import _cuda_rows, _gpu_text, cudnn_text
from vitreg.config.options import options_of

TINY = {"model": "test_vit", "img_size": "32", "task": "infer", "batch_size": "2", "warmup": "1", "steps": "2",
        "repeats": "1"}


def report_of_only_run(experiment: str) -> str:
    """report.md of the experiment's one run, read where the README says it lands with the default
    store: ./mlruns/<experiment id>/<run id>/artifacts/ (sqlite_store runs in tmp_path)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    (run,) = client.search_runs([experiment_id])
    artifacts = Path("mlruns") / experiment_id / run.info.run_id / "artifacts"
    assert (artifacts / "results.json").is_file()
    return (artifacts / "report.md").read_text()


def test_vitreg_bench_report_shows_the_vitreg_command_and_no_machine_cuda_on_cpu(sqlite_store):
    from vitreg.cli.main import main
    from vitreg.environment import capture_environment

    args = ["bench", "--experiment", "rep"] + [w for k, v in TINY.items() for w in (f"--{k.replace('_', '-')}", v)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = report_of_only_run("rep")
    block = report.split("```\n", 1)[1].split("\n```", 1)[0]
    assert block == ("vitreg bench --model test_vit --task infer --batch-size 2 --img-size 32 --warmup 1 --steps 2 "
                     "--repeats 1 --experiment rep")
    env = capture_environment()
    assert "driver / CUDA" not in report  # nothing of the machine's CUDA: no GPU ran
    if env.cuda_version:  # a CUDA build of torch on this CPU host: shown, as the build's
        (row,) = [line for line in report.splitlines() if line.startswith("| torch build: CUDA / cuDNN / NCCL ")]
        assert f"| {env.cuda_version} / {cudnn_text(env.cudnn_version) or '-'} / " in row
        assert row.rstrip(" |").endswith("(not used: no GPU ran)")
    if env.cudnn_version:
        assert f" {env.cudnn_version} " not in report  # not the raw integer


def test_mlflow_run_report_shows_the_mlflow_run_command(sqlite_store, monkeypatch):
    """What `mlflow run . -e bench -P ...` makes the process see: entry_points/bench.py with every param
    on its command line (defaults included) and MLFLOW_RUN_ID of the run it created."""
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    client = MlflowClient()
    run = client.create_run(client.create_experiment("rep-mlflow"))
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    values = {o.name: TINY.get(o.name, o.default_text) for o in options_of("bench") if o.mlproject}
    argv = ["bench"] + [w for o in options_of("bench") if o.mlproject for w in (o.flags[0], values[o.name])]
    result = CliRunner().invoke(main, argv, prog_name="entry_points/bench.py")
    assert result.exit_code == 0, result.output
    block = report_of_only_run("rep-mlflow").split("```\n", 1)[1].split("\n```", 1)[0]
    # this process runs in no environment mlflow run made: it was typed with --env-manager local
    assert block == ("mlflow run . -e bench --env-manager local -P model=test_vit -P task=infer -P batch_size=2 "
                     "-P img_size=32 -P warmup=1 -P steps=2 -P repeats=1")
    assert "entry_points/" not in block


def test_under_mlflow_run_s_own_conda_env_the_command_has_no_env_manager(monkeypatch):
    from vitreg.cli.common import _mlflow_run

    monkeypatch.setenv("CONDA_DEFAULT_ENV", "mlflow-3f2a9c")  # the env mlflow run builds from conda.yaml
    assert _mlflow_run("bench", {"model": "test_vit"}) == "mlflow run . -e bench -P model=test_vit"
    monkeypatch.setenv("CONDA_DEFAULT_ENV", "base")
    assert _mlflow_run("bench", {"model": "test_vit"}) == "mlflow run . -e bench --env-manager local -P model=test_vit"


@pytest.mark.parametrize("raw,text", [("91002", "9.10.2"), ("90100", "9.1.0"), ("8907", "8.9.7"), (None, None)])
def test_cudnn_integer_as_a_version(raw, text):
    assert cudnn_text(raw) == text


def env(**kw):
    base = dict(gpu_name="NVIDIA H200", gpu_count=1, gpu_memory_gb=140.0, compute_capability="9.0",
                driver_version="570.1", cuda_version="12.8", cudnn_version="91002", nccl_version="2.27.3",
                cpu_model="Xeon", cpu_count=16)
    return SimpleNamespace(**{**base, **kw})


def test_cuda_stack_is_the_machine_s_only_where_a_gpu_ran():
    gpu_run, cpu_run = SimpleNamespace(device="cuda"), SimpleNamespace(device="cpu")
    assert _cuda_rows(gpu_run, env()) == [["driver / CUDA / cuDNN / NCCL", "570.1 / 12.8 / 9.10.2 / 2.27.3"]]
    assert _cuda_rows(cpu_run, env(gpu_count=0, driver_version=None)) == [
        ["torch build: CUDA / cuDNN / NCCL", "12.8 / 9.10.2 / 2.27.3 (not used: no GPU ran)"]]
    assert _cuda_rows(cpu_run, env(gpu_count=0, cuda_version=None, cudnn_version=None, nccl_version=None)) == []
    assert _gpu_text(cpu_run, env()) == "NVIDIA H200 x1 (140 GB, cc 9.0), not used: the run was on cpu"
    assert _gpu_text(cpu_run, env(gpu_count=0)) == "none (CPU: Xeon, 16 cores)"
