"""SIGTERM / SIGHUP / SIGQUIT end a benchmark like Ctrl-C: the run KILLED with the signal named, exit 128+N,
no traceback."""

import signal
import subprocess
import sys
import time

import pytest

from conftest import migrated_store, subprocess_env

LONG_BENCH = ["-m", "vitreg.cli", "bench", "--model", "test_vit", "--img-size", "32", "--device", "cpu",
              "--amp", "off", "--batch-size", "2", "--warmup", "2", "--steps", "20", "--repeats", "1000",
              "--task", "infer", "--experiment", "signals"]


def _wait_for(proc, needle: str, timeout: float = 120, stream=None) -> None:
    """Read the child's ``stream`` (its stderr) until a line holds ``needle``."""
    stream = stream or proc.stderr
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        seen.append(line)
        if needle in line:
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{needle!r} never printed: {''.join(seen)[-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_a_stop_signal_ends_the_run_killed(tmp_path, sig):
    uri = migrated_store(tmp_path)
    proc = subprocess.Popen([sys.executable, *LONG_BENCH], env=subprocess_env(uri), cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(proc, "window 1/")
    proc.send_signal(sig)
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, rest[-2000:]
    assert "Traceback" not in rest, rest[-2000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run, = client.search_runs([client.get_experiment_by_name("signals").experiment_id])
    assert run.info.status == "KILLED"
    assert signal.Signals(sig).name in run.data.tags["vitreg_error"]
