"""SIGTERM and SIGHUP during `train`, for real: a `vitreg train` child process is signalled mid-training.
It must stop between updates, write and log a checkpoint of the step it reached and the results so far,
end its run KILLED, remove its temp folders, and exit 128 + the signal number. And the hold that keeps an update whole: unit-tested with real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import migrated_store, subprocess_env
from vitreg.tracking.store import prepare_store

TRAIN = ["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "8", "--num-classes", "10",
         "--num-workers", "0", "--steps", "100000", "--log-every", "5", "--checkpoint-every", "1000",
         "--warmup-steps", "2", "--device", "cpu", "--experiment", "sig"]


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _wait_for_steps(c, proc, at_least: int, deadline_s: float = 240):
    """The run, once it has logged train_loss at a step >= ``at_least`` (found once, then only its loss asked)."""
    deadline = time.monotonic() + deadline_s
    run = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"train exited ({proc.returncode}) early:\n{proc.stdout.read()[-3000:]}")
        try:
            if run is None:
                exp = c.get_experiment_by_name("sig")
                runs = c.search_runs([exp.experiment_id]) if exp else []
                run = runs[0] if runs else None
            if run and any(m.step >= at_least for m in c.get_metric_history(run.info.run_id, "train_loss")):
                return run
        except Exception:  # the store being created by the child
            pass
        time.sleep(0.2)
    raise AssertionError("no logged steps within the deadline")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT], ids=["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_a_stop_signal_ends_train_killed_with_a_final_checkpoint_and_no_temp_folder(tmp_path, sig):
    uri = migrated_store(tmp_path)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    prepare_store(uri)  # created here, once: this process polls it while the child logs into it
    proc = subprocess.Popen([sys.executable, "-m", "vitreg.cli", *TRAIN], env=subprocess_env(uri, TMPDIR=tmpdir),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    c = _client(uri)
    try:
        run = _wait_for_steps(c, proc, 10)
        assert any(p.name.startswith("vitreg-") for p in tmpdir.iterdir())  # the folder the stop must remove
        proc.send_signal(sig)
        output = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    run = c.get_run(run.info.run_id)
    assert run.info.status == "KILLED"
    steps = sorted(m.step for m in c.get_metric_history(run.info.run_id, "train_loss"))
    reached = steps[-1]
    assert 10 <= reached < 100000
    from vitreg.checkpoint.format import follow_last, verify_checkpoint

    folder = Path(c.download_artifacts(run.info.run_id, "checkpoints", str(tmp_path / "checkpoints")))
    last = verify_checkpoint(follow_last(folder / "last"))  # the step folder the file checkpoints/last names
    assert json.loads((last.directory / "spec.json").read_text())["step"] == reached  # the open interval was logged too
    results = json.loads(Path(c.download_artifacts(run.info.run_id, "results.json", str(tmp_path))).read_text())
    assert results["result"]["step"] == reached and signal.Signals(sig).name in results["result"]["stopped_by"]
    assert run.data.metrics["train_steps"] == reached
    assert f"stopped at step {reached}" in output
    assert not [p.name for p in tmpdir.iterdir() if p.name.startswith("vitreg-")]


HOLD = textwrap.dedent("""
    import os, signal, sys
    from vitreg.signals import update_is_atomic
    done = []
    try:
        with update_is_atomic():
            os.kill(os.getpid(), signal.SIG{first})
            {second}
            done.append("update")
    except KeyboardInterrupt:
        print("interrupted after", done)
        sys.exit(3)
""")


def _as_from_a_shell() -> None:
    """In the child before it starts Python: SIGINT and SIGTERM at their defaults, as a shell starts a process.
    A child inherits an ignored signal, and the test process may be ignoring SIGINT (a pytest-xdist worker, or
    a library it imported): Python then installs no Ctrl-C handler and the signal is lost."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _hold(first: str, second: str = "pass"):
    code = HOLD.replace("{first}", first).replace("{second}", second)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
                          preexec_fn=_as_from_a_shell)


@pytest.mark.slow
def test_a_signal_inside_an_update_is_delivered_after_it():
    done = _hold("INT")  # Python's Ctrl-C handler: KeyboardInterrupt, once the block is complete
    assert done.returncode == 3 and "interrupted after ['update']" in done.stdout, done.stderr


@pytest.mark.slow
def test_sigterm_without_a_handler_still_ends_the_process_after_the_update():
    done = _hold("TERM")  # no vitreg.signals installed: the default action, deferred, not lost
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [("TERM", "TERM"), ("INT", "INT"), ("TERM", "HUP")])
def test_a_second_signal_inside_an_update_exits_at_once(first, second):
    done = _hold(first, f"os.kill(os.getpid(), signal.SIG{second})")
    code = 128 + getattr(signal, f"SIG{second}")
    assert done.returncode == code and "interrupted" not in done.stdout, (done.returncode, done.stdout)


@pytest.mark.slow
def test_a_sigterm_relayed_after_ctrl_c_is_the_same_stop():
    """Ctrl-C reaches the whole process group; `mlflow run` and torchrun then send their child SIGTERM on top:
    one stop, not a second that would cut the update and the clean-up short."""
    done = _hold("INT", "os.kill(os.getpid(), signal.SIGTERM)")
    assert done.returncode == 3 and "interrupted after ['update']" in done.stdout, (done.returncode, done.stderr)


NEVER_ENDS = textwrap.dedent("""
    import sys
    from vitreg import signals
    from vitreg.tracking.runs import tracked_run
    from vitreg.signals import update_is_atomic
    signals.install()
    with tracked_run(run_name="never-ends", experiment="sig", system_metrics=False) as run:
        print("run", run.run_id, flush=True)
        with update_is_atomic():  # an update that never ends (a step at 16000 px, a dead peer's all-reduce)
            print("inside the update", flush=True)
            while True:
                pass
""")


@pytest.mark.slow
def test_a_stop_signal_held_by_an_update_that_never_ends_acts_after_the_grace(tmp_path):
    """SIGTERM held by an update that never finishes: after VITREG_STOP_GRACE_S the watchdog ends the run
    KILLED with the reason and exits 143, within the grace plus the child's own start time (the baseline)."""
    uri, grace_s = migrated_store(tmp_path), 1.0
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", NEVER_ENDS], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=subprocess_env(uri, VITREG_STOP_GRACE_S=grace_s))
    try:
        run_id = None
        for line in proc.stdout:  # events: the run exists, then the update has begun
            run_id = line.split()[1] if line.startswith("run ") else run_id
            if line.startswith("inside the update"):
                break
        baseline_s = time.monotonic() - started
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=baseline_s + grace_s + 60)[0]
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output
    assert grace_s <= took < grace_s + baseline_s, (took, baseline_s)
    assert "did not end within 1 s" in output and "Traceback" not in output, output
    run = _client(uri).get_run(run_id)
    assert run.info.status == "KILLED" and "did not end within" in run.data.tags["vitreg_error"]
