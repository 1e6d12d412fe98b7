"""Files this user may not read: an unreadable class folder, image or train/ folder of ``data=PATH``, an
unreadable ``model.safetensors`` or ``manifest.json`` of a checkpoint. Each is one ``error:`` line naming the
path and the fix (``chmod ...``), exit 2, no traceback, no run left RUNNING (issue 31: tracebacks from
``train/data.py`` and ``checkpoint/format.py``).

The suite runs as root here, and root reads any file whatever its mode (capability CAP_DAC_OVERRIDE). So the
vitreg process each test starts runs without the two capabilities that let root pass file modes
(CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, dropped from its bounding set before exec, which leaves them out
of the new program's permitted set): the kernel then refuses it a mode-000 file with EACCES, the same
``PermissionError`` any other user gets. Run as another user, the drop is not needed and not made.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from _warm import WarmVitreg
from conftest import REPO, migrated_store, subprocess_env

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2
IMG = 32


def _without_root_file_access() -> None:  # runs in the child, between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _drop_if_root() -> None:
    if os.geteuid() == 0:
        _without_root_file_access()


@pytest.fixture(scope="module")
def warm_unprivileged(tmp_path_factory):
    """One warm vitreg worker (tests/_warm.py) that file modes apply to: the capabilities are dropped before it
    starts, as before each command's own process; what the tests check is each command's refusal, not its
    process's start (seven processes before, each importing torch). None where they cannot be dropped."""
    root = tmp_path_factory.mktemp("unprivileged")
    locked = root / "probe"
    locked.write_text("x")
    locked.chmod(0)
    try:
        probe = subprocess.run([sys.executable, "-c", f"open({str(locked)!r}).read()"], capture_output=True,
                               preexec_fn=_drop_if_root)
    except subprocess.SubprocessError as exc:  # prctl refused (no CAP_SETPCAP in this container)
        yield f"cannot drop root's file access here: {exc}"
        return
    if probe.returncode == 0:
        yield "file modes do not apply to processes here (root with its capabilities kept)"
        return
    env = subprocess_env(migrated_store(root / "store"), PYTHONPATH=str(REPO))
    warm = WarmVitreg(root, env, root / "stdout", preexec_fn=_drop_if_root)
    yield warm
    assert warm.close().returncode == 0


@pytest.fixture
def unprivileged(tmp_path, warm_unprivileged):
    """Run ``vitreg ARGS`` where file modes apply (the module's warm worker), against a store of its own in
    tmp_path."""
    if isinstance(warm_unprivileged, str):
        pytest.skip(warm_unprivileged)
    env = {"MLFLOW_TRACKING_URI": migrated_store(tmp_path), "VITREG_SPOOL_DIR": str(tmp_path / "spool"),
           "MLFLOW_EXPERIMENT_NAME": "unreadable"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return warm_unprivileged.run(*args, env=env)

    def run_here(*args: str):
        """``vitreg ARGS`` in this process (click's CliRunner), with the same store and settings: a check that
        the same files work once readable again, which needs no process without root's file access."""
        import mlflow
        from click.testing import CliRunner

        from vitreg.cli.main import main

        with pytest.MonkeyPatch.context() as mp:
            for name in ("MLFLOW_TRACKING_URI", "VITREG_SPOOL_DIR", "MLFLOW_EXPERIMENT_NAME"):
                mp.setenv(name, env[name])
            mp.chdir(tmp_path)
            mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
            try:
                return CliRunner().invoke(main, list(args))
            finally:
                mlflow.set_tracking_uri(None)

    run.store = env["MLFLOW_TRACKING_URI"]
    run.here = run_here
    return run


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    return errors[0]


def _no_run_running(store: str) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs if r.info.status == "RUNNING"] == [], [r.info.run_id for r in runs]


def _image_folder(root):
    from PIL import Image

    for i in range(8):
        folder = root / "train" / "ab"[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 40), (30 * i, 20, 200 - 20 * i)).save(folder / f"{i}.png")
    return root


TRAIN = ["train", "--model", "test_vit", "--img-size", str(IMG), "--batch-size", "2", "--steps", "2",
         "--num-workers", "0", "--device", "cpu"]


@pytest.mark.slow
@pytest.mark.parametrize("locked, mode", [("train/b", 0), ("train/a/2.png", 0), ("train", 0o311)],
                         ids=["class-folder", "image", "train-folder-not-listable"])
def test_data_this_user_cannot_read_is_one_line_naming_it(tmp_path, unprivileged, locked, mode):
    root = _image_folder(tmp_path / "data")
    path = root / locked
    path.chmod(mode)
    try:
        line = _one_error_line(unprivileged(*TRAIN, "--data", str(root)))
    finally:
        path.chmod(0o755)
    assert f"data={root}" in line and str(path) in line and "Permission denied" in line, line
    assert "chmod" in line and "readable by this user" in line, line
    _no_run_running(unprivileged.store)
    if locked == "train/b":  # readable again, the same folder trains
        again = unprivileged.here(*TRAIN, "--data", str(root))
        assert again.exit_code == 0, (again.exception, again.output[-3000:])


@pytest.fixture
def checkpoint(tmp_path):
    import torch

    from vitreg.checkpoint.format import save_checkpoint
    from vitreg.config.spec import TrainSpec
    from vitreg.models.factory import create_model

    torch.manual_seed(0)
    spec = TrainSpec(model="test_vit", img_size=IMG, num_classes=10, steps=2, warmup_steps=1)
    model, info = create_model("test_vit", IMG, 10)
    return save_checkpoint(tmp_path / "ckpt", model, step=2, spec=spec.to_params(), model_info=info)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.safetensors", "manifest.json"])
def test_a_checkpoint_file_this_user_cannot_read_is_one_line_naming_it(tmp_path, unprivileged, checkpoint, name):
    locked = checkpoint / name
    locked.chmod(0)
    pulled = unprivileged("pull", str(checkpoint), "--out", str(tmp_path / "out"))
    inferred = unprivileged("infer", "--model-uri", str(checkpoint), "--device", "cpu", "--batch-size", "2",
                            "--warmup", "1", "--steps", "1", "--repeats", "1")
    locked.chmod(0o644)
    for done in (pulled, inferred):
        line = _one_error_line(done)
        assert f"checkpoint {checkpoint}" in line and str(locked) in line and "Permission denied" in line, line
        assert f"chmod a+r {locked}" in line, line
    assert not (tmp_path / "out").exists()
    _no_run_running(unprivileged.store)
    again = unprivileged.here("pull", str(checkpoint), "--out", str(tmp_path / "out"))
    assert again.exit_code == 0 and (tmp_path / "out").is_dir(), (again.exception, again.output[-3000:])
