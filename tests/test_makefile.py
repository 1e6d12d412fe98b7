"""`make bench ARGS=...` as the README types it: a param in ARGS replaces the Makefile's default of the same
name (mlflow run refuses a repeated -P), the other defaults stay. Run against a fake venv whose `mlflow`
prints its arguments, so no benchmark runs."""

import os
import stat
import subprocess

import pytest

from conftest import REPO


def _make_bench(tmp_path, args: str) -> list[str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "mlflow"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$FAKE_OUT"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    stamp = venv / ".vitreg-installed"
    stamp.touch()  # newer than pyproject.toml: make installs nothing
    out = tmp_path / "argv.txt"
    env = {**os.environ, "FAKE_OUT": str(out)}
    subprocess.run(["make", "-s", "-C", str(REPO), "bench", f"VENV={venv}", f"ARGS={args}"], env=env, check=True,
                   capture_output=True, text=True, timeout=60)
    return out.read_text().split()


def _params(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-P"]


@pytest.mark.slow
def test_user_params_replace_the_defaults(tmp_path):
    argv = _make_bench(tmp_path, "-P model=deit_small_patch16_224 -P compile=default -P batch_size=256")
    params = _params(argv)
    names = [p.split("=", 1)[0] for p in params]
    assert len(names) == len(set(names)), params  # no repeated -P: mlflow run would refuse it
    assert "model=deit_small_patch16_224" in params and "batch_size=256" in params and "compile=default" in params
    assert "gpu=auto" in params  # the defaults the user did not name stay
    assert argv[:4] == ["run", ".", "-e", "bench"]


@pytest.mark.slow
def test_gpu_given_by_the_user_wins(tmp_path):
    params = _params(_make_bench(tmp_path, "-P gpu=cpu"))
    assert [p for p in params if p.startswith("gpu=")] == ["gpu=cpu"]
