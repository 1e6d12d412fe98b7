"""A successful run's console is vitreg's lines only: no kineto trace markers or driver probe
(``USDT: ... profiler_start``, ``ERROR: ... gpuGetDeviceCount failed``), no MLflow system-metrics or
store-creation INFO lines, no timm short-cosine warning; and a failing run still says its one error line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env

TINY = ["--model", "test_vit", "--img-size", "32", "--batch-size", "4", "--device", "cpu"]


def vitreg_stderr(tmp_path, *args: str) -> subprocess.CompletedProcess:
    # a new sqlite file: MLflow's "Creating initial MLflow database tables" would show here
    env = subprocess_env(f"sqlite:///{tmp_path / 'fresh.db'}", PYTHONPATH=str(REPO))
    env.pop("KINETO_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "-m", "vitreg", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def foreign_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("[vitreg]", "error:"))]


@pytest.mark.slow
def test_a_cpu_bench_and_a_short_train_print_vitreg_s_lines_only(tmp_path):
    bench = vitreg_stderr(tmp_path, "bench", *TINY, "--task", "both", "--warmup", "1", "--steps", "2",
                          "--repeats", "2")
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert "[vitreg] infer: window" in bench.stderr and "[vitreg] train: window" in bench.stderr  # it profiled
    assert foreign_lines(bench.stderr) == [], bench.stderr
    # 4 updates, 2 of them warm-up: a cosine of one step, which timm warns about
    train = vitreg_stderr(tmp_path, "train", *TINY, "--steps", "3", "--warmup-steps", "2", "--log-every", "1",
                          "--num-classes", "10", "--num-workers", "0", "--checkpoint-every", "0")
    assert train.returncode == 0, train.stderr[-2000:]
    assert foreign_lines(train.stderr) == [], train.stderr


@pytest.mark.slow
def test_a_failing_run_still_says_its_error(tmp_path):
    failed = vitreg_stderr(tmp_path, "bench", *TINY[2:], "--model", "vit_nonexistent_patch16_224")
    assert failed.returncode == 2 and [line for line in failed.stderr.splitlines() if line.startswith("error:")]
