"""A typo costs about a second and leaves nothing behind: every option of a job is checked before torch, timm
or mlflow is imported and before any run exists (vitreg.cli.common.check_first); model names come from timm's
source, GPU labels from NVML. And ``mlflow run`` from a virtualenv that is not activated runs in vitreg's
Python (entry_points/interpreter.py), or says in one line what to do."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from conftest import REPO, migrated_store, subprocess_env
from vitreg.errors import VitregError

HEAVY = ("torch", "timm", "mlflow", "pandas")


def test_timm_s_source_lists_exactly_timm_s_models():
    """What a typo is checked against without importing timm is what timm itself would list."""
    import timm

    from vitreg.models import learned_facts

    assert learned_facts.source_names() == set(timm.list_models())


def test_a_model_typo_is_answered_without_importing_timm(tmp_path, monkeypatch):
    from vitreg.models import families

    def no_timm(*args):
        raise AssertionError("timm asked: a name check must not import it")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no list kept by an earlier process
    monkeypatch.setattr(families, "_timm_listed", no_timm)
    with pytest.raises(VitregError, match=r"unknown model 'deit_tiny': did you mean deit_tiny_patch16_224"):
        families.check_name("deit_tiny")
    with pytest.raises(VitregError, match="'resnet50' is not a vision transformer vitreg builds"):
        families.check_name("resnet50")
    assert families.check_name("deit_tiny_patch16_224") is families.family_of("deit_")


def test_a_name_missing_from_a_stale_list_is_read_from_timm_s_source(tmp_path, monkeypatch):
    """A list kept by an earlier process does not refuse a model it lacks (timm reinstalled in place)."""
    from vitreg.models import families, learned_facts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    learned_facts.keep(names=("vit_base_patch16_224",))
    monkeypatch.setattr(families, "_timm_listed", lambda: pytest.fail("timm imported"))
    assert families.check_name("deit_small_patch16_224") is families.family_of("deit_")


@pytest.mark.parametrize("gpus,device,label,allowed,needle", [
    (("NVIDIA H200",), "auto", "h200", True, None),
    (("NVIDIA H200",), "auto", "cpu", True, None),  # CUDA_VISIBLE_DEVICES="" falls back to the CPU
    (("NVIDIA H200",), "cuda", "cpu", False, "use gpu=h200 or gpu=auto"),
    (("NVIDIA H200",), "auto", "a100", False, "gpu=a100 is not this host's hardware (h200, cpu)"),
    (("NVIDIA H200",), "auto", "h2000", False, "'h2000' is not a known label; did you mean h200?"),
    (("NVIDIA A10",), "auto", "a10", True, None),  # an unlisted GPU: filed under its own name
    ((), "auto", "a1000", False, "did you mean a100?"),
    ((), "cpu", "h100", False, "use gpu=cpu or gpu=auto (or allow_gpu_mismatch=true"),
    (None, "auto", "a1000", True, None),  # NVML cannot say: the job's detection decides
])
def test_a_gpu_label_is_checked_against_the_host_without_torch(monkeypatch, gpus, device, label, allowed, needle):
    from vitreg.hardware import profiles

    monkeypatch.setattr(profiles, "_host_gpu_names", lambda: gpus)
    if allowed:
        profiles.check_label_here(label, device, allow_mismatch=False)
        return
    with pytest.raises(VitregError, match=re.escape(needle)):
        profiles.check_label_here(label, device, allow_mismatch=False)
    profiles.check_label_here(label, device, allow_mismatch=True)  # the user's override files it anyway


TYPOS = [
    (["bench", "--amp", "bf61"], "did you mean --amp bf16?"),
    (["bench", "--model", "deit_tiny"], "did you mean deit_tiny_patch16_224?"),
    (["bench", "--gpu", "a1000"], "did you mean a100?"),
    (["bench", "--allow-gpu-mismatch", "--gpu", "a100", "--amp", "bf61"], "did you mean --amp bf16?"),
    (["train", "--model", "deit_tiny"], "did you mean deit_tiny_patch16_224?"),
    (["train", "--node-rank", "3"], "node_rank=3 must be in 0..0"),
    (["sweep", "--models", "deit_tiny"], "did you mean deit_tiny_patch16_224?"),
    (["sweep", "--models", "test_vit", "--gpu", "a1000"], "did you mean a100?"),
    (["infer", "--model-uri", "models:/x@champion", "--amp", "bf61"], "did you mean --amp bf16?"),
]


@pytest.mark.parametrize("args,needle", TYPOS, ids=lambda a: "-".join(a) if isinstance(a, list) else "")
def test_a_typo_is_one_line_and_leaves_no_run(sqlite_store, monkeypatch, args, needle):
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main
    from vitreg.hardware import profiles

    monkeypatch.setattr(profiles, "_host_gpu_names", lambda: ())  # a host without NVIDIA GPUs, as here
    result = CliRunner().invoke(main, [*args, "--experiment", "typos"])
    assert result.exit_code == 2, result.output
    assert result.output.count("error: ") == 1 and needle in result.output, result.output
    client = MlflowClient()
    assert client.get_experiment_by_name("typos") is None  # not even the experiment was made
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


@pytest.mark.parametrize("typo,hint", [
    ("--modle", " (did you mean --model?)"),  # not "--model or --nnodes or --profile": those are not alike
    ("--nnode", " (did you mean --nnodes?)"),
    ("--batch_sise", " (did you mean --batch-size?)"),  # as --help spells it
    ("--batch", " (did you mean --batch-size?)"),  # an abbreviation
    ("--dry-run", ""),  # not "--node-rank": nothing is alike, and no guess beats a wrong one
])
def test_a_misspelt_option_suggests_only_options_alike_enough(typo, hint):
    from vitreg.cli.main import main

    result = CliRunner().invoke(main, ["bench", typo, "x"])
    assert result.exit_code == 2
    shown = typo.replace("_", "-")
    assert result.output == f"error: no such option {shown}{hint}; see `vitreg bench --help`\n"


def _seconds(argv: list[str], cwd, env) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - start, proc


@pytest.mark.slow
@pytest.mark.parametrize("args", [a for a, _ in TYPOS[:3] + TYPOS[4:5] + TYPOS[6:7]], ids="-".join)
def test_a_typo_from_the_shell_is_refused_within_3_s_of_the_interpreter_s_start(tmp_path, args):
    """The command as a user types it, in a fresh process: refused within 3 s of a bare interpreter start
    measured beside it, having imported none of torch, timm, mlflow or pandas, leaving no store behind."""
    env = {k: v for k, v in subprocess_env("").items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PYTHONPATH=str(REPO), PYTHONPROFILEIMPORTTIME="1")
    bare, _ = _seconds([sys.executable, "-c", "pass"], tmp_path, env)
    took, proc = _seconds([sys.executable, "-m", "vitreg.cli", *args], tmp_path, env)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: "), proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert took - bare < 3.0, (took, bare)
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no mlflow.db, no mlruns/


def _path_without_the_venv(tmp_path) -> str:
    """A PATH whose `python` is the system's, without vitreg's dependencies (a shell without the venv)."""
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is None or subprocess.run([system, "-c", "import click"], capture_output=True).returncode == 0:
        pytest.skip("needs a system python3 without vitreg's dependencies")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(system)
    return f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"


@pytest.mark.slow
def test_mlflow_run_from_a_venv_that_is_not_activated(tmp_path):
    """`.venv/bin/mlflow run . -e bench` with another `python` first on PATH: the entry point starts again in
    mlflow's Python; a typo is then vitreg's one line (the run FAILED with the reason), a good run FINISHED."""
    from mlflow.tracking import MlflowClient

    uri = migrated_store(tmp_path)
    env = {k: v for k, v in subprocess_env(uri).items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = _path_without_the_venv(tmp_path)
    mlflow = [sys.executable, "-m", "mlflow", "run", str(REPO), "-e", "bench", "--env-manager", "local",
              "--experiment-name", "unactivated", "-P", "model=test_vit", "-P", "img_size=32", "-P", "device=cpu"]
    typo = subprocess.run([*mlflow, "-P", "amp=bf61"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert typo.returncode != 0 and "Traceback" not in typo.stderr, typo.stderr[-3000:]
    assert [line for line in typo.stderr.splitlines() if line.startswith("error: ")] == [
        "error: amp='bf61' is not one of auto, off, tf32, bf16, fp16, bf16-weights, fp16-weights, fp8, "
        "fp8-tensorwise, fp8-rowwise (did you mean amp=bf16?)"], typo.stderr[-3000:]
    good = subprocess.run([*mlflow, "-P", "task=infer", "-P", "batch_size=2", "-P", "warmup=1", "-P", "steps=2",
                           "-P", "repeats=1", "-P", "amp=off"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert good.returncode == 0, good.stderr[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("unactivated").experiment_id], order_by=["start_time"])
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert "did you mean amp=bf16" in runs[0].data.tags["vitreg_error"]


@pytest.mark.slow
def test_an_entry_point_without_vitreg_s_python_is_one_line(tmp_path):
    """No mlflow among its parents and no .venv in the project: one line naming the fix, exit 2."""
    project = tmp_path / "project"
    (project / "entry_points").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", project)
    shutil.copy(REPO / "entry_points" / "interpreter.py", project / "entry_points")
    shutil.copy(REPO / "entry_points" / "bench.py", project / "entry_points")
    env = {"PATH": _path_without_the_venv(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "-c", "python entry_points/bench.py --amp bf61"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ") and "has no torch" in line and "source .venv/bin/activate" in line, line


def test_the_dependencies_an_entry_point_checks_are_pyproject_s_and_importable_here():
    sys.path.insert(0, str(REPO / "entry_points"))
    try:
        import interpreter
    finally:
        sys.path.remove(str(REPO / "entry_points"))
    names = interpreter.dependencies()
    assert {"torch", "mlflow", "pandas", "nvidia-ml-py", "click"} <= set(names)
    assert interpreter.missing_modules() == []  # each name maps to a module this (complete) venv finds


@pytest.mark.parametrize("prog,advice", [
    ("vitreg", "pass e.g. --batch-size 1"),  # as a CLI user types it next (issue 47)
    ("entry_points/bench.py", "pass e.g. batch_size=1"),  # `mlflow run -P batch_size=1`
])
def test_the_advice_is_spelt_as_the_command_was_typed(sqlite_store, prog, advice):
    from vitreg.cli.main import main

    result = CliRunner().invoke(main, ["bench", "--batch-size", "0"], prog_name=prog)
    assert result.exit_code == 2 and result.output.count("error: ") == 1, result.output
    assert result.output.rstrip().endswith(advice), result.output
