"""A successful run's console is vitreg's lines only: no kineto trace markers or driver probe
(``USDT: ... profiler_start``, ``ERROR: ... gpuGetDeviceCount failed``), no MLflow system-metrics or
store-creation INFO lines, no timm short-cosine warning; and a failing run still says its one error line."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from _warm import WarmVitreg
from conftest import REPO, subprocess_env

TINY = ["--model", "test_vit", "--img-size", "32", "--batch-size", "4", "--device", "cpu"]


def fresh_store_env(tmp_path) -> dict:
    # a new sqlite file: MLflow's "Creating initial MLflow database tables" would show here
    env = subprocess_env(f"sqlite:///{tmp_path / 'fresh.db'}", PYTHONPATH=str(REPO))
    env.pop("KINETO_LOG_LEVEL", None)
    return env


def foreign_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("[vitreg]", "error:"))]


@pytest.mark.slow
def test_a_cpu_bench_and_a_short_train_print_vitreg_s_lines_only(tmp_path):
    """Both in one warm vitreg worker (tests/_warm.py): each command's fds 1 and 2 as a process of its own would
    print them, what the worker prints as it starts counted as the bench's and as it ends checked too."""
    warm = WarmVitreg(tmp_path, fresh_store_env(tmp_path), tmp_path / "warm-stdout")
    try:
        bench = warm.run("bench", *TINY, "--task", "both", "--warmup", "1", "--steps", "2", "--repeats", "2")
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert "[vitreg] infer: window" in bench.stderr and "[vitreg] train: window" in bench.stderr  # it profiled
        assert foreign_lines(bench.stderr) == [], bench.stderr
        # 4 updates, 2 of them warm-up: a cosine of one step, which timm warns about
        train = warm.run("train", *TINY, "--steps", "3", "--warmup-steps", "2", "--log-every", "1",
                         "--num-classes", "10", "--num-workers", "0", "--checkpoint-every", "0")
        assert train.returncode == 0, train.stderr[-2000:]
        assert foreign_lines(train.stderr) == [], train.stderr
    finally:
        ended = warm.close()
    assert ended.returncode == 0 and foreign_lines(ended.stderr) == [], ended.stderr[-2000:]


def test_a_failing_run_still_says_its_error(tmp_path):
    from click.testing import CliRunner

    from vitreg.cli.main import main

    failed = CliRunner().invoke(main, ["bench", *TINY[2:], "--model", "vit_nonexistent_patch16_224"])
    assert failed.exit_code == 2 and [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert not (tmp_path / "store").exists()  # refused before any store was made


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


# ---------------------------------------------------------------- what the console says by default (issue 38)
CONSOLE_MAX_LINES = 25  # what runs, progress, the table, one line of warnings, where the run is


def readme_cpu_example() -> list[str]:
    """The README's CPU-sized bench, as printed there (the words after ``vitreg``)."""
    (line,) = [line for line in (REPO / "README.md").read_text().splitlines()
               if line.startswith("vitreg bench --model deit_tiny_patch16_224") and "--experiment laptop" in line]
    return shlex.split(line.partition("#")[0])[1:]


def cli(*args: str):
    from click.testing import CliRunner

    from vitreg.cli.main import main

    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output[-3000:]
    return result


def console_log(run_id: str) -> str:
    import mlflow

    from vitreg.console import CONSOLE_LOG

    return mlflow.artifacts.load_text(f"runs:/{run_id}/{CONSOLE_LOG}")


def run_id_of(output: str) -> str:
    return re.search(r"logged run ([0-9a-f]{32})", output).group(1)


def test_the_readme_s_cpu_example_prints_at_most_25_lines(sqlite_store, monkeypatch):
    """The overhead by phase, the energy source and each task's spread go to the run's console.log, not to
    the console; what stays fits a screen. The example's options as printed, at 32 px: which lines a run
    prints does not depend on the image's size, and at 224 px it cost 30 s of CPU here (the README run,
    tests/test_readme.py, runs it as printed)."""
    monkeypatch.delenv("VITREG_VERBOSE", raising=False)
    output = cli(*readme_cpu_example(), "--img-size", "32").output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) <= CONSOLE_MAX_LINES, output
    assert "overhead outside the timed windows" not in output and "at the window edges" not in output
    log = console_log(run_id_of(output))
    assert "overhead outside the timed windows" in log and "infer: energy and throttle state" in log


@pytest.mark.parametrize("switch", [["-v"], ["--verbose"], []])
def test_verbose_prints_what_the_log_keeps(sqlite_store, monkeypatch, switch):
    if not switch:
        monkeypatch.setenv("VITREG_VERBOSE", "1")
    output = cli("bench", *TINY, "--task", "infer", "--warmup", "1", "--steps", "1", "--repeats", "2",
                 *switch).output
    assert "[vitreg] overhead outside the timed windows" in output
    assert "infer: energy and throttle state at the window edges" in output


def test_a_library_warning_goes_to_the_run_s_log_and_to_verbose_only(capsys, monkeypatch):
    """Issue 38: a library's warning (torchao's SyntaxWarning in a sweep child, a deprecation) is the log's,
    not the console's; ``-v`` prints it."""
    import warnings

    from vitreg.console import VERBOSE_ENV, quiet_libraries, take_console

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    take_console()
    with warnings.catch_warnings():  # puts the process's warning display back after
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("an old API", UserWarning)
        assert capsys.readouterr().err == "" and "UserWarning: an old API" in take_console()
        monkeypatch.setenv(VERBOSE_ENV, "1")
        warnings.warn("an old API", UserWarning)
        assert "[vitreg] UserWarning: an old API" in capsys.readouterr().err


# ------------------------------------------------------------ issue 39 point 5: masked during an API call only
PASSWORD = "Pa55wordXyz"


def test_masked_output_scrubs_streams_and_records_for_the_call_and_gives_them_back(monkeypatch, capsys):
    """What vitreg.api's calls run inside: print, stderr and every log record (the message, its arguments and its
    traceback, whatever handler gets it) masked while inside; after it, the caller's objects, unmasked again."""
    import logging

    from vitreg.console import MaskedStream, masked_output

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{PASSWORD}@127.0.0.1:1")
    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(self.format(record))

    logger = logging.getLogger("test_console.masked")
    monkeypatch.setattr(logger, "handlers", [Keep()])
    monkeypatch.setattr(logger, "propagate", False)
    before = (sys.stdout, sys.stderr, logging.getLogRecordFactory())
    with masked_output():
        with masked_output():  # nested (an API call inside another): the inner one changes nothing
            print(f"out {PASSWORD}")
            print("err http://bob:Tok3nValue@h:2/", file=sys.stderr)
        assert isinstance(sys.stdout, MaskedStream) and isinstance(sys.stderr, MaskedStream)
        logger.warning("asked %s", f"http://alice:{PASSWORD}@127.0.0.1:1/api")
        try:
            raise RuntimeError(f"refused at {PASSWORD}")
        except RuntimeError:
            logger.exception("failed")
    assert (sys.stdout, sys.stderr, logging.getLogRecordFactory()) == before
    logger.warning(f"the caller's own {PASSWORD}")  # after the call: the caller's business, as it was
    out, err = capsys.readouterr()
    assert out == "out ***\n" and err == "err http://***@h:2/\n"
    assert kept[0] == "asked http://***@127.0.0.1:1/api", kept
    assert kept[1].startswith("failed\nTraceback") and "RuntimeError: refused at ***" in kept[1], kept[1]
    assert PASSWORD not in kept[1] and kept[2] == f"the caller's own {PASSWORD}"


def test_masked_output_keeps_what_the_caller_set_meanwhile_and_overlapping_calls_end_with_the_last(monkeypatch):
    import io
    import threading

    from vitreg.console import MaskedStream, masked_output

    monkeypatch.setattr(sys, "stderr", sys.stderr)  # put back at teardown whatever happens here
    mine = io.StringIO()
    with masked_output():
        sys.stderr = mine  # the caller's own, set during the call (a callback): not taken back
    assert sys.stderr is mine
    bare = sys.stdout
    inside, release = threading.Event(), threading.Event()

    def other_call():
        with masked_output():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=other_call)
    thread.start()
    assert inside.wait(30)
    with masked_output():
        pass
    assert isinstance(sys.stdout, MaskedStream)  # the other thread's call still runs: still masked
    release.set()
    thread.join()
    assert sys.stdout is bare
