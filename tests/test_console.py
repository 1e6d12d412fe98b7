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


@pytest.mark.slow
def test_the_python_api_prints_vitreg_s_lines_only(tmp_path):
    """``vitreg.api.bench`` from a script, no tracking URI set (MLflow's default store, made here): no MLflow INFO
    lines, no kineto markers or driver probe; vitreg's lines (the new store said once), the table, the link."""
    env = {k: v for k, v in subprocess_env("", PYTHONPATH=str(REPO)).items() if k != "MLFLOW_TRACKING_URI"}
    env.pop("KINETO_LOG_LEVEL", None)
    code = ("import vitreg\n"
            "vitreg.api.bench(model='test_vit', img_size=32, batch_size=2, warmup=1, steps=2, repeats=1, task='both')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[vitreg] infer: window" in done.stderr and "sdpa=auto (ran: " in done.stdout  # the profiler ran
    assert foreign_lines(done.stderr) == [], done.stderr
    assert done.stderr.count("[vitreg] created a new tracking store") == 1


def test_the_profiler_s_cycle_warning_stays_off_the_console(monkeypatch, recwarn):
    """On a GPU torch.profiler prepares its trace twice as it starts and warns, mid-progress, that events are
    cleared at the end of each cycle: vitreg's profiles run one cycle and read it whole. Made to happen here
    as it does there (the start prepares again), each profiling call of vitreg stays silent."""
    import torch
    import torch.profiler.profiler as torch_profiler

    from vitreg.hardware.sdpa import detect_backend
    from vitreg.measure.traces import profile_comm

    real_start = torch_profiler.profile.start

    def start_as_on_a_gpu(self):
        real_start(self)
        self.prepare_trace()  # the second preparation, which warns

    monkeypatch.setattr(torch_profiler.profile, "start", start_as_on_a_gpu)
    monkeypatch.setattr(torch_profiler, "_WARNINGS_SHOWN", set())  # torch warns once per process
    step = lambda: torch.ones(4) @ torch.ones(4)  # noqa: E731
    profile_comm(step, 1, "cpu")
    detect_backend(step, "cpu")
    assert not [w for w in recwarn if "Profiler clears events" in str(w.message)]
    monkeypatch.setattr(torch_profiler, "_WARNINGS_SHOWN", set())  # what was silenced counts as shown
    with torch_profiler.profile(activities=[torch_profiler.ProfilerActivity.CPU]):  # the warning is real
        step()
    assert [w for w in recwarn if "Profiler clears events" in str(w.message)]
