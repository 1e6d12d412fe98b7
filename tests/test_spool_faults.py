"""Issue 31, families 1 and 8: a spool is data from outside (every journal record checked before `vitreg sync`
delivers anything of it; removed only once the store is counted to hold all of it), and a spool folder that
cannot be written is one line before any run is RUNNING on the server.

Permissions are real: the tests run as root, whom file modes do not stop, so the commands that must meet a
mode run under ``setpriv --bounding-set -dac_override,-dac_read_search`` (root without the two capabilities
that bypass modes: an ``open`` of a 0600 file owned by another user fails as it would for anybody).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from vitreg.cli.main import main
from vitreg.cli.main import sync as sync_command
from vitreg.tracking.delivery import SpoolingTracker, open_run
from vitreg.errors import VitregError
from vitreg.tracking.spool import JOURNAL, Spool

from conftest import REPO, migrated_store, subprocess_env

NO_MODE_BYPASS = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


pytestmark = pytest.mark.usefixtures("clean_vitreg_env")


@pytest.fixture
def store(tmp_path, monkeypatch):
    import mlflow

    uri = migrated_store(tmp_path / "store")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(uri)
    return uri


def offline_run(root: Path, tmp_path: Path, steps: int = 10) -> Spool:
    """An offline run of 1 + 1 + 1 + steps + 1 + 1 records: run, params, tags, one metrics record a step,
    a checkpoint file, the end."""
    tracker = SpoolingTracker.open("hostile", run_name="r", root=root, offline=True)
    tracker.log_params({"model": "test_vit"})
    tracker.set_tags({"gpu": "cpu"})
    for step in range(steps):
        tracker.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    ckpt = tmp_path / "last.safetensors"
    ckpt.write_bytes(b"weights")
    tracker.log_artifact(ckpt, "checkpoints")
    tracker.close("FINISHED", timeout_s=0)
    return tracker.spool


def insert_record(spool: Spool, record: dict) -> int:
    """Put ``record`` before the end record, numbered as vitreg numbers them; returns its line number."""
    journal = spool.path / JOURNAL
    lines = journal.read_text().splitlines()
    end = json.loads(lines[-1])
    seq = end["seq"]
    lines[-1:] = [json.dumps({"seq": seq, **record}), json.dumps({**end, "seq": seq + 1})]
    journal.write_text("\n".join(lines) + "\n")
    return seq + 1


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_refused_untouched(result, spool: Spool, before: dict, line: int) -> None:
    """exit 2, one line naming the journal and the line, no traceback; nothing sent; the spool as it was."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the spool journal "), result.output
    assert f"{spool.path / JOURNAL}:{line} " in lines[0], lines[0]
    assert MlflowClient().get_experiment_by_name("hostile") is None, "nothing of the spool was delivered"
    assert snapshot(spool.path) == before, "nothing deleted or changed"


# --------------------------------------------------------------------------- records naming files outside


@pytest.fixture
def outside(tmp_path) -> Path:
    secret = tmp_path / "x" / "outside_secret.txt"
    secret.parent.mkdir()
    secret.write_text("outside-secret-content")
    return secret


HOSTILE_ARTIFACTS = {
    "dot-dot": lambda spool, secret: {"path": os.path.relpath(secret, spool.path), "is_dir": False},
    "dot-dot-deep": lambda spool, secret: {"path": "../" * 8 + str(secret).lstrip("/"), "is_dir": False},
    "absolute": lambda spool, secret: {"path": "/etc/hostname", "is_dir": False},
    "symlink-file": lambda spool, secret: _linked(spool, secret, "artifacts/evil/link.txt", False),
    "symlink-folder": lambda spool, secret: _linked(spool, secret.parent, "artifacts/evil", True),
    "link-inside-a-folder": lambda spool, secret: _folder_holding_link(spool, secret),
    "artifact-path-escapes": lambda spool, secret: _with_artifact_path(spool, "../../../elsewhere"),
}


def _linked(spool: Spool, target: Path, relative: str, is_dir: bool) -> dict:
    link = spool.path / relative
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return {"path": relative, "is_dir": is_dir}


def _folder_holding_link(spool: Spool, secret: Path) -> dict:
    folder = spool.path / "artifacts" / "plain"
    folder.mkdir()
    (folder / "ok.txt").write_text("fine")
    (folder / "secret.txt").symlink_to(secret)
    return {"path": "artifacts/plain", "is_dir": True}


def _with_artifact_path(spool: Spool, artifact_path: str) -> dict:
    (spool.path / "artifacts" / "ok").mkdir()
    (spool.path / "artifacts" / "ok" / "a.txt").write_text("fine")
    return {"path": "artifacts/ok/a.txt", "is_dir": False, "artifact_path": artifact_path}


@pytest.mark.parametrize("attack", list(HOSTILE_ARTIFACTS))
def test_sync_refuses_an_artifact_record_naming_a_file_outside_its_spool(store, tmp_path, outside, attack):
    """Issue 31 family 1: a journal whose artifact record names ``../../../../tmp/x/outside_secret.txt`` or
    ``/etc/hostname`` made `vitreg sync` upload that file, exit 0. Refused now before anything is sent."""
    spool = offline_run(tmp_path / "spool", tmp_path)
    record = HOSTILE_ARTIFACTS[attack](spool, outside)
    line = insert_record(spool, {"kind": "artifact", "artifact_path": None, **record})
    before = snapshot(spool.path)
    result = CliRunner().invoke(sync_command, ["--spool", str(tmp_path / "spool")])
    assert_refused_untouched(result, spool, before, line)


def test_sync_refuses_a_record_that_forges_delivery_s_own_tags(store, tmp_path):
    """A tag record setting ``vitreg_spool_seq.<id>`` would tell the store it holds records it never got."""
    spool = offline_run(tmp_path / "spool", tmp_path)
    line = insert_record(spool, {"kind": "tags", "tags": {f"vitreg_spool_seq.{spool.run_record['spool_id']}": "99"}})
    before = snapshot(spool.path)
    result = CliRunner().invoke(sync_command, ["--spool", str(spool.path)])
    assert_refused_untouched(result, spool, before, line)


# --------------------------------------------------------------------------- records that do not parse


GARBLE = {
    "garbled-json": lambda line: line[: len(line) // 2] + b"#garbage#" + line[len(line) // 2:],
    "random-bytes": lambda line: bytes(range(128, 256)) * 3,
    "wrong-type": lambda line: json.dumps({**json.loads(line), "metrics": [["loss", "NaNa", 1, 2]]}).encode(),
    "a-seq-skipped": lambda line: json.dumps({**json.loads(line), "seq": 40}).encode(),
}


@pytest.mark.parametrize("garble", list(GARBLE))
def test_a_record_that_does_not_parse_stops_the_sync_of_that_spool_naming_its_line(store, tmp_path, garble):
    """Issue 31 family 1: one garbled line at record 3 of a 13-record journal made sync say "delivered (2 new
    records)", delete the spool and leave a RUNNING run with 0 metrics; random bytes: a UnicodeDecodeError
    traceback. Now: one line naming the file and line 4 (record 3), nothing sent, nothing deleted."""
    spool = offline_run(tmp_path / "spool", tmp_path, steps=9)
    journal = spool.path / JOURNAL
    lines = journal.read_bytes().split(b"\n")
    assert len(lines) - 1 == 14 and json.loads(lines[3])["kind"] == "metrics"
    lines[3] = GARBLE[garble](lines[3])
    journal.write_bytes(b"\n".join(lines))
    before = snapshot(spool.path)
    result = CliRunner().invoke(sync_command, ["--spool", str(spool.path)])
    assert_refused_untouched(result, spool, before, 4)


def test_a_damaged_spool_does_not_hold_back_the_others(store, tmp_path):
    """Sync of a folder of spools: the good one is delivered and removed, the damaged one named and kept."""
    good = offline_run(tmp_path / "spools", tmp_path)
    bad = offline_run(tmp_path / "spools", tmp_path)
    journal = bad.path / JOURNAL
    journal.write_bytes(journal.read_bytes().replace(b'"kind":"params"', b'"kind":"par\xffams"'))
    result = CliRunner().invoke(sync_command, ["--spool", str(tmp_path / "spools")])
    assert result.exit_code == 2 and f"{journal}:2 " in result.output, result.output
    assert "delivered 1 other spool(s)" in result.output
    assert not good.path.exists() and journal.exists()


def test_a_torn_last_line_is_still_dropped_not_refused(store, tmp_path):
    spool = offline_run(tmp_path / "spool", tmp_path)
    with open(spool.path / JOURNAL, "ab") as fh:
        fh.write(b'{"seq": 15, "kind": "ta')  # a crash in the middle of a write: the last line, no line end
    assert CliRunner().invoke(sync_command, ["--spool", str(spool.path)]).exit_code == 0
    assert not spool.path.exists()


# --------------------------------------------------------------------------- removed only when counted


def losing_store(monkeypatch, times: int) -> list:
    """The store answers every log_batch but keeps none of the metrics of the batch holding step 0, the
    first ``times`` times it is sent (a store that loses acknowledged writes); returns how many it lost."""
    real_log_batch = MlflowClient.log_batch
    lost = []

    def losing(self, run_id, metrics=(), params=(), tags=(), **kwargs):
        if len(lost) < times and any(m.step == 0 for m in metrics):
            lost.append(len(metrics))
            metrics = []
        return real_log_batch(self, run_id, metrics=metrics, params=params, tags=tags, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", losing)
    return lost


def test_a_spool_is_kept_while_the_store_holds_less_than_it(store, tmp_path, monkeypatch):
    """A store that keeps fewer points than it acknowledged: counted after delivery (and after one more whole
    delivery), the spool stays, exit 2 naming what is lacking; the next sync, the store behaving, sends it all
    again and removes the spool. Before: the spool was removed, the points lost."""
    spool = offline_run(tmp_path / "spool", tmp_path, steps=1500)  # two log_batch calls of points
    real_log_batch = MlflowClient.log_batch
    lost = losing_store(monkeypatch, times=2)
    result = CliRunner().invoke(sync_command, ["--spool", str(spool.path)])
    assert result.exit_code == 2 and len(lost) == 2, result.output
    assert f"lacks metric loss: {1500 - lost[0]} of 1500 points" in result.output, result.output
    assert spool.path.exists(), "kept: the store does not hold all of it"
    monkeypatch.setattr(MlflowClient, "log_batch", real_log_batch)
    assert CliRunner().invoke(sync_command, ["--spool", str(spool.path)]).exit_code == 0
    (run,) = MlflowClient(store).search_runs([MlflowClient(store).get_experiment_by_name("hostile").experiment_id])
    assert len(MlflowClient(store).get_metric_history(run.info.run_id, "loss")) == 1500 and not spool.path.exists()


def test_a_store_that_lost_points_once_is_sent_the_spool_again_in_the_same_sync(store, tmp_path, monkeypatch):
    spool = offline_run(tmp_path / "spool", tmp_path, steps=1500)
    lost = losing_store(monkeypatch, times=1)
    result = CliRunner().invoke(sync_command, ["--spool", str(spool.path)])
    assert result.exit_code == 0 and lost, result.output
    (run,) = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("hostile").experiment_id])
    assert len(MlflowClient().get_metric_history(run.info.run_id, "loss")) == 1500 and not spool.path.exists()


# --------------------------------------------------------------------------- spool folders that cannot be written


def _a_file(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("not a folder")
    return tmp_path / "a-file"


def _a_symlink_loop(tmp_path: Path) -> Path:
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    return tmp_path / "loop-a" / "spool"


def _under_a_file(tmp_path: Path) -> Path:
    return _a_file(tmp_path) / "spool"


BAD_SPOOL_DIRS = {"a-file": _a_file, "a-symlink-loop": _a_symlink_loop, "under-a-file": _under_a_file}
BENCH_TINY = ["bench", "--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--task", "infer",
              "--warmup", "1", "--steps", "2", "--repeats", "2", "--device", "cpu"]


def assert_one_spool_line_and_nothing_running(result, uri: str, root: Path) -> None:
    assert result.exit_code == 2, result.output[-3000:]
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output[-3000:]
    assert f"the spool folder {root} cannot be written" in errors[0] and "VITREG_SPOOL_DIR" in errors[0], errors[0]
    client = MlflowClient(uri)
    running = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
               if r.info.status == "RUNNING"]
    assert running == [], "no run left RUNNING on the server"


@pytest.mark.parametrize("bad", list(BAD_SPOOL_DIRS))
def test_a_spool_folder_that_cannot_be_made_is_one_line_and_no_run_is_left_running(store, tmp_path, monkeypatch,
                                                                                 bad):
    """Issue 31 family 8: VITREG_SPOOL_DIR a file or a symlink loop gave a NotADirectoryError/OSError
    traceback from spool.py and the run the server had created stayed RUNNING."""
    root = BAD_SPOOL_DIRS[bad](tmp_path)
    monkeypatch.setenv("VITREG_SPOOL_DIR", str(root))
    result = CliRunner().invoke(main, [*BENCH_TINY, "--experiment", "spool-faults"])
    assert_one_spool_line_and_nothing_running(result, store, root)


def test_open_run_checks_the_spool_before_the_server_has_a_run(store, tmp_path):
    with pytest.raises(VitregError, match="cannot be written"):
        open_run("spool-faults", root=_a_file(tmp_path))
    assert MlflowClient().get_experiment_by_name("spool-faults") is None, "no run was made on the server"


def test_a_spool_that_goes_bad_after_the_check_ends_the_server_run_failed(store, tmp_path, monkeypatch):
    """The folder passes the check, then cannot take the spool (here: the spool's own folder name is taken
    by a file, as a disk that fills between the two would): the run open_run made ends FAILED with the reason."""
    import uuid as uuid_module

    taken = uuid_module.uuid4()
    monkeypatch.setattr("vitreg.tracking.spool.uuid.uuid4", lambda: taken)
    root = tmp_path / "spools"
    root.mkdir()
    (root / taken.hex).write_text("in the way")
    monkeypatch.setattr("vitreg.tracking.delivery.check_spool_root", lambda root: None)
    with pytest.raises(VitregError, match="cannot be written"):
        open_run("spool-faults", root=root)
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("spool-faults").experiment_id])
    assert run.info.status == "FAILED" and "cannot be written" in run.data.tags["vitreg_error"]


def test_the_full_disk_reason_is_read_out_of_a_tree_copy_s_error_list(tmp_path):
    """A tree copy on a full disk raises ``shutil.Error`` with one ``(src, dst, reason)`` per file and no errno:
    its repr ran to 1,414 characters; the line says the disk is full."""
    from vitreg.tracking.spool import lost_reason

    error = shutil.Error([(f"/src/{i}", f"/dst/{i}", "[Errno 28] No space left on device: '/dst'") for i in range(30)])
    reason = lost_reason(tmp_path, error)
    assert f"the local disk at " in reason and "is full" in reason and len(reason) < 400, reason
    assert "/src/" not in reason


# --------------------------------------------------------------------------- real file systems and modes (slow)


def _vitreg_as(args: list[str], env: dict, cwd: Path, no_bypass: bool = False) -> subprocess.CompletedProcess:
    prefix = NO_MODE_BYPASS if no_bypass else []
    return subprocess.run([*prefix, sys.executable, "-m", "vitreg", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _running(uri: str) -> list:
    client = MlflowClient(uri)
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.info.status == "RUNNING"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="modes met as root need setpriv")
def test_an_unreadable_journal_is_one_line_and_kept(tmp_path):
    """Issue 31 family 1: an unreadable journal gave a PermissionError traceback from `vitreg sync`; so did a
    folder of spools that cannot be listed."""
    uri = migrated_store(tmp_path / "store")
    spool = offline_run(tmp_path / "spool", tmp_path)
    os.chown(spool.path / JOURNAL, 65534, 65534)  # another user's journal, 0600
    os.chmod(spool.path / JOURNAL, 0o600)
    done = _vitreg_as(["sync", "--spool", str(spool.path)], subprocess_env(uri), tmp_path, no_bypass=True)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{spool.path / JOURNAL} cannot be read (Permission denied)" in errors[0], errors[0]
    assert (spool.path / JOURNAL).exists()

    os.chown(spool.path.parent, 65534, 65534)  # the spool folder (VITREG_SPOOL_DIR) this user cannot list
    os.chmod(spool.path.parent, 0o700)
    env = subprocess_env(uri, VITREG_SPOOL_DIR=str(spool.path.parent))
    done = _vitreg_as(["sync"], env, tmp_path, no_bypass=True)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"the spools at {spool.path.parent} cannot be listed (Permission denied)" in errors[0], errors[0]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="modes met as root need setpriv")
def test_a_spool_folder_not_writable_or_read_only_is_one_line_and_no_run_is_left_running(tmp_path):
    """Issue 31 family 8, with real modes and a real read-only file system: a folder of another user (0755)
    under root without its mode bypass, and a tmpfs mounted read-only."""
    uri = migrated_store(tmp_path / "store")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    readonly = tmp_path / "ro"
    readonly.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], check=True)
    try:
        for root, no_bypass in ((theirs / "spool", True), (readonly / "spool", False)):
            env = subprocess_env(uri, MLFLOW_DISABLE_TELEMETRY="true", VITREG_SPOOL_DIR=str(root))
            done = _vitreg_as([*BENCH_TINY, "--experiment", "spool-faults"], env, tmp_path, no_bypass)
            errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
            assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
            assert f"the spool folder {root} cannot be written" in errors[0], errors[0]
            assert _running(uri) == []
    finally:
        subprocess.run(["umount", str(readonly)], check=True)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_spool_disk_is_one_line_naming_the_disk_and_the_run_is_not_left_running(tmp_path):
    """Issue 31 family 8: a full spool disk gave the repr of a ``shutil.Error`` list (1,414 characters) and the
    run stayed RUNNING. A 1 MiB tmpfs, filled but for 64 KiB: the checkpoint folder of a train does not fit."""
    uri = migrated_store(tmp_path / "store")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        (disk / "filler").write_bytes(b"\0" * (1024 - 64) * 1024)  # room for a spool's journal, not a checkpoint
        env = subprocess_env(uri, MLFLOW_DISABLE_TELEMETRY="true", VITREG_SPOOL_DIR=str(disk / "spool"))
        done = _vitreg_as(["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--steps", "4",
                           "--device", "cpu", "--experiment", "spool-faults"], env, tmp_path)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert f"the local disk at {disk} " in errors[0] and "is full" in errors[0] and len(errors[0]) < 600, errors[0]
        assert _running(uri) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# --------------------------------------------------------------------------- a spool naming another server


def test_a_spool_naming_another_server_gets_no_credentials_of_this_environment(store, tmp_path, monkeypatch):
    """MLflow sends MLFLOW_TRACKING_TOKEN/PASSWORD to any http server it is pointed at: a planted spool whose
    run record names another host must not receive them. Refused in one line naming --tracking-uri; nothing
    contacted (the named port has a listener that records any connection), the spool kept as it was; with
    --tracking-uri it goes where the user says."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    contacted, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            contacted.append(conn.recv(4096))
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        spool = offline_run(tmp_path / "spools", tmp_path, steps=2)
        journal = spool.path / JOURNAL
        lines = journal.read_text().splitlines()
        first = json.loads(lines[0])
        first["tracking_uri"] = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        journal.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
        before = snapshot(spool.path)
        monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-3e1f9a")
        result = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spools")])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "credentials are not sent" in lines[0] and "--tracking-uri" in lines[0], lines
        assert "tok-3e1f9a" not in result.output
        assert contacted == [] and snapshot(spool.path) == before
        delivered = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spools"), "--tracking-uri", store])
        assert delivered.exit_code == 0, delivered.output
        assert contacted == [] and MlflowClient().get_experiment_by_name("hostile") is not None
    finally:
        stop.set()
        thread.join()
        listener.close()
