"""`train` end to end against real sqlite stores: the click command in-process, the background logger,
and a real `mlflow run -e train` process that is SIGKILLed after its first checkpoint and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from conftest import REPO, migrated_store, subprocess_env
from vitreg.tracking import checkpoint_sources
from vitreg.tracking import runs as tracking
from vitreg.tracking.checkpoint_sources import resolve_checkpoint
from vitreg.tracking.store import prepare_store
from vitreg.checkpoint.format import follow_last, verify_checkpoint
from vitreg.cli.main import train as train_command
from vitreg.errors import VitregError
from vitreg.config.spec import TrainSpec

TINY = ["--model", "test_vit", "--img-size", "32", "--batch-size", "8", "--num-classes", "10", "--num-workers", "0",
        "--lr", "2e-3", "--warmup-steps", "2", "--label-smoothing", "0"]

def cli():
    group = click.Group()  # `train` as vitreg's group registers it; a bare group runs it the same way
    group.add_command(train_command)
    return group


def client(uri=None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri) if uri else MlflowClient()


def losses(c, run_id) -> dict[int, float]:
    return {m.step: m.value for m in c.get_metric_history(run_id, "train_loss")}


def test_mlproject_entry_matches_train_spec():
    """Every TrainSpec field is a parameter with TrainSpec's default and reaches the command line; so do
    the launcher's multi-host options and offline, which are not TrainSpec fields."""
    entry = yaml.safe_load((REPO / "MLproject").read_text())["entry_points"]["train"]
    defaults = {**TrainSpec().to_params(), "nnodes": "1", "node_rank": "0", "rdzv_endpoint": "", "offline": "false"}
    assert set(entry["parameters"]) == set(defaults)
    for name, param in entry["parameters"].items():
        assert param["type"] == "string" and str(param["default"]) == defaults[name], name
        assert f"--{name.replace('_', '-')} {{{name}}}" in entry["command"], name


def test_cli_train_logs_run_checkpoints_and_registers(sqlite_store, tmp_path, monkeypatch):
    from vitreg.tracking import model_registry

    calls = []
    monkeypatch.setattr(model_registry, "register_checkpoint",
                        lambda tracker, directory, name, alias, tags: calls.append(
                            (tracker.run_id, verify_checkpoint(directory).manifest, name, alias, tags)))
    res = CliRunner().invoke(cli(), ["train", *TINY, "--steps", "6", "--log-every", "2", "--checkpoint-every", "3",
                                     "--register-as", "tiny", "--alias", "champion", "--experiment", "train-e2e"])
    assert res.exit_code == 0, res.output
    c = client()
    (run,) = c.search_runs([c.get_experiment_by_name("train-e2e").experiment_id])
    rid = run.info.run_id
    p, t, m = run.data.params, run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED" and f"logged run {rid}" in res.output
    assert p["model"] == "test_vit" and p["steps"] == "6" and p["lr"] == "0.002" and p["gpu"] == "cpu"
    assert t["vitreg_job"] == "train" and t["task"] == "train" and t["data"] == "synthetic" and t["amp"] == "off"
    for key in ["train_throughput_img_per_s", "train_step_ms_p50", "train_final_loss", "train_data_wait_frac",
                "train_gflops_per_img", "lr", "grad_norm", "train_img_per_s"]:
        assert key in m, key
    assert sorted(losses(c, rid)) == [2, 4, 6]
    # keep_checkpoints=1 (the default): step-3 was deleted once step-6 was logged; last is a file naming step-6
    arts = {a.path: a.is_dir for a in c.list_artifacts(rid, "checkpoints")}
    assert arts == {"checkpoints/step-6": True, "checkpoints/last": False}
    last = resolve_checkpoint(f"runs:/{rid}/checkpoints/last", tmp_path / "dl").checkpoint
    assert last.step == 6 and json.loads((last.directory / "spec.json").read_text())["step"] == 6
    results = json.loads(Path(c.download_artifacts(rid, "results.json")).read_text())
    assert results["checkpoint"] == f"runs:/{rid}/checkpoints/last" and results["result"]["step"] == 6
    # the registration hook got the final checkpoint, still on disk, with the run's figures
    ((tracker_run, manifest, name, alias, tags),) = calls
    assert (tracker_run, name, alias) == (rid, "tiny", "champion") and manifest["format"] == "vitreg-checkpoint-1"
    assert tags["model"] == "test_vit" and tags["steps"] == 6 and tags["source_run_id"] == rid

    # the checkpoint as a distillation teacher: downloaded, loaded, and its download folder gone
    import tempfile

    from types import SimpleNamespace

    from vitreg.train.losses import create_teacher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    student = SimpleNamespace(num_classes=tags["num_classes"])
    teacher = create_teacher(SimpleNamespace(teacher=f"runs:/{rid}/checkpoints/last"), student, "cpu")
    assert sum(p.numel() for p in teacher.parameters()) > 0
    assert list((tmp_path / "tmp").iterdir()) == []


def _bytes_under(path: Path) -> int:
    """What ``du -sb`` counts for the files under ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _weights_and_adamw_bytes() -> tuple[int, int]:
    """Bytes of the tiny model's weights, and of its AdamW state (exp_avg and exp_avg_sq per parameter)."""
    from vitreg.models.factory import create_model

    model, _ = create_model("test_vit", 32, 10)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return weights, 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
def test_a_run_keeps_one_copy_of_weights_and_optimizer_per_kept_step(sqlite_store, tmp_path):
    """keep_checkpoints=2 of three checkpoints: two step folders, each weights + optimizer state once, a
    `last` file of a few bytes (no second folder), a registered version whose extra_files share the
    run's weights; then a new run resumes from a kept step that is not the last, and one from last.
    Slow tier: end to end, three trainings, a registration (its pt2 export) and a pull are its cost (5-8 s
    of CPU, the fast tier's heaviest test); it starts no process."""
    from vitreg.train.job import train

    options = {"model": "test_vit", "img_size": "32", "num_classes": "10", "batch_size": "4", "steps": "6",
               "log_every": "2", "checkpoint_every": "2", "keep_checkpoints": "2", "num_workers": "0"}
    train({**options, "register_as": "tiny-disk"}, experiment="disk", progress=lambda message: None)
    c = client()
    (run,) = c.search_runs([c.get_experiment_by_name("disk").experiment_id])
    artifacts = Path(run.info.artifact_uri.replace("file://", "")) / "checkpoints"
    assert {p.name for p in artifacts.iterdir()} == {"step-4", "step-6", "last"}  # step-2 deleted: keep=2
    assert (artifacts / "last").is_file() and (artifacts / "last").stat().st_size < 200
    weights, moments = _weights_and_adamw_bytes()
    per_step = weights + moments  # the old layout held step-6 twice (step-6/ and last/): 3 * per_step here
    assert 2 * per_step <= _bytes_under(artifacts) <= 2.05 * per_step, (_bytes_under(artifacts), per_step)
    version = Path(c.get_model_version_download_uri("tiny-disk", "1").replace("file://", ""))
    assert not (version / "extra_files" / "model.safetensors").exists()
    assert _bytes_under(version / "extra_files") < 0.01 * weights  # spec, manifest, shared_weights.json
    # the pt2 serving copy (weights + graph) and the input examples; a second safetensors copy would pass 2x
    assert _bytes_under(version) < 2 * weights, (_bytes_under(version), weights)
    pulled = checkpoint_sources.pull("models:/tiny-disk/1", dst=tmp_path / "pulled")
    assert pulled.spec["step"] == 6 and (tmp_path / "pulled").exists()

    for source, start, steps in ((f"runs:/{run.info.run_id}/checkpoints/step-4", 4, 6),
                                 (f"runs:/{run.info.run_id}/checkpoints/last", 6, 8)):
        result = train({**options, "steps": str(steps), "resume": source}, experiment=f"resume-{start}",
                       progress=lambda message: None)
        assert (result.start_step, result.step, result.steps_run) == (start, steps, steps - start), source


class _Recorder:
    """A tracker that only records the checkpoint calls, in order (not thread-safe: RunLogger runs them inline)."""

    thread_safe = False

    def __init__(self):
        self.calls = []

    def log_artifacts(self, path, artifact_path=None):
        self.calls.append(("folder", artifact_path))

    def log_text(self, text, artifact_file):
        self.calls.append(("file", artifact_file, json.loads(text)["checkpoint"]))

    def delete_artifacts(self, artifact_path):
        self.calls.append(("delete", artifact_path))


@pytest.mark.parametrize("keep,deleted", [(1, ["step-2", "step-4"]), (2, ["step-2"]), (0, [])])
def test_checkpoint_uploader_moves_last_after_the_folder_and_keeps_the_newest(tmp_path, keep, deleted):
    from vitreg.train.job import CheckpointUploader, RunLogger

    tracker = _Recorder()
    upload = CheckpointUploader(RunLogger(tracker), keep)
    for step in (2, 4, 6):
        (tmp_path / f"step-{step}").mkdir()
        upload(step, tmp_path / f"step-{step}")
    for step in (2, 4, 6):  # each folder once, then last naming it, then the deletions it allows
        i = tracker.calls.index(("folder", f"checkpoints/step-{step}"))
        assert tracker.calls[i + 1] == ("file", "checkpoints/last", f"step-{step}")
    assert [c[1] for c in tracker.calls if c[0] == "delete"] == [f"checkpoints/{name}" for name in deleted]
    for i, call in enumerate(tracker.calls):  # a folder is deleted only once last names a newer one
        if call[0] == "delete":
            named = [c[2] for c in tracker.calls[:i] if c[0] == "file"][-1]
            assert int(named.split("-")[1]) > int(call[1].split("-")[1]), tracker.calls
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6"]  # local copies: the newest, to register


def test_a_deleted_checkpoint_leaves_the_store_through_the_spool(sqlite_store, tmp_path):
    """delete_artifacts is journaled and delivered in order, after the folder it follows; what is delivered
    leaves the spool while the run goes on."""
    from vitreg.train.job import CheckpointUploader, RunLogger

    with tracking.tracked_run(run_name="keep", system_metrics=False) as run:
        logger = RunLogger(run)
        upload = CheckpointUploader(logger, keep=1)
        for step in (2, 4):
            (tmp_path / f"step-{step}").mkdir()
            (tmp_path / f"step-{step}" / "model.safetensors").write_bytes(b"w" * step)
            upload(step, tmp_path / f"step-{step}")
        logger.close()
        assert run.wait_delivered(60)
        # the spool keeps no copy of what the server holds: local disk does not grow by a checkpoint per save
        assert [p for p in (run.spool.path / "artifacts").rglob("*") if p.is_file()] == []
    listed = {a.path: a.is_dir for a in client().list_artifacts(run.run_id, "checkpoints")}
    assert listed == {"checkpoints/step-4": True, "checkpoints/last": False}


@pytest.mark.parametrize("status,kept_going", [(403, True), (404, True), (503, False)])
def test_a_store_that_refuses_a_deletion_keeps_the_files_and_delivery_goes_on(monkeypatch, status, kept_going):
    """A 4xx (no permission to delete) must not stall delivery for ever; a 5xx is retried like any record."""
    import requests
    from mlflow.store.artifact import artifact_repository_registry

    from vitreg.tracking.delivery import delete_run_artifacts

    class Refusing:
        def delete_artifacts(self, artifact_path):
            response = requests.Response()
            response.status_code = status
            raise requests.HTTPError(f"{status} for DELETE {artifact_path}", response=response)

    class Client:
        tracking_uri = "http://127.0.0.1:1"

        def get_run(self, run_id):
            return type("Run", (), {"info": type("Info", (), {"artifact_uri": "mlflow-artifacts:/1/r/artifacts"})})

    monkeypatch.setattr(artifact_repository_registry, "get_artifact_repository", lambda uri, tracking_uri=None: Refusing())
    if kept_going:
        delete_run_artifacts(Client(), "r", "checkpoints/step-2")
    else:
        with pytest.raises(requests.HTTPError):
            delete_run_artifacts(Client(), "r", "checkpoints/step-2")


def test_a_registration_that_fails_after_training_names_the_command_to_retry(sqlite_store, monkeypatch):
    from vitreg.tracking import model_registry
    from vitreg.errors import VitregError

    def refuse(*args, **kwargs):
        raise VitregError("could not register 'tiny' at the server: 503 Service Unavailable")

    monkeypatch.setattr(model_registry, "register_checkpoint", refuse)
    res = CliRunner().invoke(cli(), ["train", *TINY, "--steps", "2", "--register-as", "tiny", "--alias", "champion",
                                     "--experiment", "late-refusal"])
    assert res.exit_code == 2
    (run,) = client().search_runs([client().get_experiment_by_name("late-refusal").experiment_id])
    rid = run.info.run_id
    retry = f"`vitreg register runs:/{rid}/checkpoints/last --name tiny --alias champion`"
    assert f"503 Service Unavailable (the checkpoint is logged: once fixed, {retry})" in res.output
    assert run.info.status == "FAILED" and retry in run.data.tags["vitreg_error"]
    assert "checkpoints/last" in {a.path for a in client().list_artifacts(rid, "checkpoints")}


BAD = [
    (["--data", "/nonexistent/imagenet"], "data=/nonexistent/imagenet does not exist"),
    (["--resume", "/nonexistent/ckpt"], "resume=/nonexistent/ckpt does not exist"),
    # a name longer than the file system's 255 bytes: stat raises ENAMETOOLONG, not "no such file"
    (["--resume", "r" * 300], "cannot be read (File name too long)"),
    (["--data", "d" * 300], "cannot be read (File name too long)"),
    (["--distillation", "soft", "--teacher", "test_vit"], "use a deit_*_distilled_* model"),
    (["--lr", "-1"], "lr=-1 must be >= 0"),
    (["--amp", "bf16-weights"], "amp='bf16-weights' is not one of"),  # inference only: not a train choice
    (["--amp", "tf32"], "amp=tf32 needs an NVIDIA GPU"),
    (["--sdpa", "efficient"], "sdpa=efficient cannot run on cpu"),
]


def test_train_tags_the_precision_and_holds_the_sdpa_backend(sqlite_store):
    res = CliRunner().invoke(cli(), ["train", *TINY, "--steps", "2", "--sdpa", "math", "--experiment", "levers"])
    assert res.exit_code == 0, res.output
    (run,) = client().search_runs([client().get_experiment_by_name("levers").experiment_id])
    assert run.data.tags["precision"] == "fp32" and run.data.tags["sdpa"] == "math"


def test_cli_errors_are_one_line_and_fail_the_run(sqlite_store):
    c = client()
    for i, (args, needle) in enumerate(BAD):
        res = CliRunner().invoke(cli(), ["train", *TINY, "--steps", "2", "--experiment", f"bad{i}", *args])
        assert res.exit_code == 2 and "error: " in res.output and needle in res.output, res.output
        assert "Traceback" not in res.output
        # a value the option checks refuse leaves no run (cli.common.check_first); one only the job can judge
        # (a path, the hardware) ends its run FAILED with the reason
        experiment = c.get_experiment_by_name(f"bad{i}")
        if experiment is not None:
            (run,) = c.search_runs([experiment.experiment_id])
            assert run.info.status == "FAILED" and needle in run.data.tags["vitreg_error"]


def test_background_logger_with_a_run_bound_tracker(sqlite_store):
    """The threaded path: the run's tracker (thread-safe, every call bound to its run) logs curves and
    checkpoints from the logger thread into the same run, and nowhere else; keep_checkpoints=2 keeps both."""
    from vitreg.train.job import train

    result = train({"model": "test_vit", "img_size": "32", "num_classes": "10", "batch_size": "4", "steps": "4",
                    "log_every": "1", "checkpoint_every": "2", "keep_checkpoints": "2", "num_workers": "0"},
                   experiment="threaded", progress=lambda message: None)
    c = client()
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    assert len(runs) == 1  # a fluent call from the thread without run_id would have opened a second run
    rid = runs[0].info.run_id
    assert sorted(losses(c, rid)) == [1, 2, 3, 4] and result.step == 4
    assert {a.path for a in c.list_artifacts(rid, "checkpoints")} == {
        "checkpoints/step-2", "checkpoints/step-4", "checkpoints/last"}


def test_resume_source_errors(sqlite_store):
    from vitreg.train.job import resolve_checkpoint_source

    with pytest.raises(VitregError) as err:
        resolve_checkpoint_source("runs:/0123456789abcdef/checkpoints/last")
    assert "cannot be downloaded" in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------- kill and resume


def _wait_for_checkpoint(c, proc, experiment: str, deadline_s: float = 240):
    """Poll until the checkpoint the run's checkpoints/last names verifies; returns (run, that folder). The
    store is asked until the run exists (every 0.1 s); then only its artifact folder is looked at, every
    10 ms: a query each 10 ms kept this process busy for the whole start-up of the child."""
    deadline = time.monotonic() + deadline_s
    run = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"train exited ({proc.returncode}) before its first checkpoint:\n"
                                 + proc.stdout.read()[-3000:])
        if run is None:
            exp = c.get_experiment_by_name(experiment)
            runs = c.search_runs([exp.experiment_id]) if exp else []
            run = runs[0] if runs else None
            if run is None:
                time.sleep(0.1)
                continue
        last = Path(run.info.artifact_uri.replace("file://", "")) / "checkpoints" / "last"
        if last.is_file():
            try:
                return run, verify_checkpoint(follow_last(last)).directory
            except VitregError:
                pass  # an older step being deleted right now
        time.sleep(0.01)
    raise AssertionError("no checkpoint within the deadline")


@pytest.mark.slow
def test_sigkilled_training_resumes_from_its_last_checkpoint(tmp_path):
    uri = migrated_store(tmp_path)
    c = client(uri)
    params = {"model": "test_vit", "img_size": "32", "batch_size": "16", "num_classes": "10", "steps": "400",
              "lr": "2e-3", "warmup_steps": "3", "label_smoothing": "0", "log_every": "1", "checkpoint_every": "15",
              "num_workers": "0"}
    prepare_store(uri)  # created here, once: this process polls it while the child logs into it
    # 1. `mlflow run -e train` in its own process group, killed (the whole group, SIGKILL: no cleanup runs)
    #    as soon as its first checkpoint has landed in the artifact store
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "run", str(REPO), "-e", "train", "--env-manager",
                             "local", "--experiment-name", "kill", *[a for k, v in params.items()
                                                                      for a in ("-P", f"{k}={v}")]],
                            env=subprocess_env(uri), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        killed, _ = _wait_for_checkpoint(c, proc, "kill")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # what last names once the process is gone (it may have saved a newer step before the kill)
    last = follow_last(Path(killed.info.artifact_uri.replace("file://", "")) / "checkpoints" / "last")
    saved = verify_checkpoint(last).step
    assert saved % 15 == 0 and saved < 400
    assert c.get_run(killed.info.run_id).info.status == "RUNNING"  # SIGKILL: nothing ended it
    before = losses(c, killed.info.run_id)
    assert before[1] > 1.8 and saved in before  # the loss at the checkpoint was logged before it was saved

    # 2. a new run resumes from runs:/<killed>/checkpoints/last and trains 6 more steps
    resume = f"runs:/{killed.info.run_id}/checkpoints/last"
    args = [a for k, v in {**params, "steps": str(saved + 6), "resume": resume}.items()
            for a in (f"--{k.replace('_', '-')}", v)]
    done = subprocess.run([sys.executable, str(REPO / "entry_points" / "train.py"), *args, "--experiment", "resumed"],
                          env=subprocess_env(uri), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and f"at step {saved}" in done.stderr
    (run,) = c.search_runs([c.get_experiment_by_name("resumed").experiment_id])
    after = losses(c, run.info.run_id)
    assert sorted(after) == list(range(saved + 1, saved + 7))  # continues at the saved step
    first = after[saved + 1]
    # the loss continues from where it was, not from the initial loss
    assert abs(first - before[saved]) < 0.5 * (before[1] - before[saved]), (before[1], before[saved], first)
    if saved + 1 in before:  # the killed run got one step further: resuming reproduces it exactly
        assert first == pytest.approx(before[saved + 1], rel=1e-4)
    assert run.data.tags["resumed_from"] == resume and run.info.status == "FINISHED"
    # the SIGKILLed run, left RUNNING by its dead process, is closed KILLED by the run that resumed it
    old = c.get_run(killed.info.run_id)
    assert old.info.status == "KILLED" and old.data.tags["vitreg_resumed_by"] == run.info.run_id
    assert "resumed by run " + run.info.run_id in old.data.tags["vitreg_error"]
    assert run.data.tags["vitreg_resumed_from"] == killed.info.run_id
    lr_before = {m.step: m.value for m in c.get_metric_history(killed.info.run_id, "lr")}
    lr_after = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "lr")}
    if saved + 1 in lr_before:
        assert lr_after[saved + 1] == pytest.approx(lr_before[saved + 1])  # the same LR schedule
    folder = Path(c.download_artifacts(run.info.run_id, "checkpoints", str(tmp_path / "final")))
    final = verify_checkpoint(follow_last(folder / "last"))  # c: this test's store, not the process's default
    assert final.step == saved + 6 and json.loads((final.directory / "spec.json").read_text())["step"] == saved + 6
