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


@pytest.mark.slow
def test_install_says_each_step_and_a_failed_one_in_one_line(tmp_path):
    """`make install` prints a line per step with its usual time (pip -q is silent for minutes); when pip fails,
    its log's tail and one `error:` line naming the whole log, exit 2. A fake python: `-m venv` makes a venv
    whose python records its arguments and fails the editable install of vitreg."""
    venv, calls = tmp_path / "venv", tmp_path / "calls.txt"
    fake_pip = f'#!/bin/sh\necho "$@" >> {calls}\ncase "$*" in *" -e "*) echo "no matching distribution"; exit 1;; esac\n'
    maker = tmp_path / "python3"
    maker.write_text(f'#!/bin/sh\nmkdir -p "$3/bin"\nprintf \'%s\' \'{fake_pip}\' > "$3/bin/python"\n'
                     f'chmod +x "$3/bin/python"\n')
    maker.chmod(0o755)
    done = subprocess.run(["make", "-s", "-C", str(REPO), "install", f"VENV={venv}", f"PYTHON={maker}"],
                          capture_output=True, text=True, timeout=60)
    steps = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert [step[:5] for step in steps] == ["[1/3]", "[2/3]", "[3/3]"], done.stdout
    assert all(" s)" in step or " min" in step for step in steps), steps  # each says how long it usually takes
    assert "no matching distribution" in done.stdout and "error: installing vitreg failed" in done.stdout
    assert str(venv / "pip-install.log") in done.stdout
    assert done.returncode == 2 and not (venv / ".vitreg-installed").exists()
    assert len(calls.read_text().splitlines()) == 3  # pip upgraded, torch, then vitreg
