"""Malformed checkpoints whose manifest hashes match (re-hashed after the damage, as an editor or a
buggy tool would leave them), through every command that reads a checkpoint: `pull`, `infer`,
`train --resume` and `train --teacher`. Each must end in one `error:` line naming the damaged file,
exit 2, no traceback, and no run left RUNNING."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from conftest import migrated_store
from vitreg.cli.main import main
from vitreg.config.spec import TrainSpec
from vitreg.models.factory import create_model
from vitreg.checkpoint import format as ckpt

IMG, CLASSES = 32, 10
TINY = ["--img-size", "32", "--batch-size", "4", "--num-classes", "10", "--num-workers", "0", "--steps", "4",
        "--log-every", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A real test_vit checkpoint at step 2, with train's AdamW groups, schedule and the class names."""
    from types import SimpleNamespace

    from vitreg.train.loop import build_optimizer, build_scheduler

    torch.manual_seed(0)
    spec = TrainSpec(model="test_vit", img_size=IMG, num_classes=CLASSES, steps=4, warmup_steps=1)
    model, info = create_model("test_vit", IMG, CLASSES)
    opt = build_optimizer(model, spec, SimpleNamespace(device="cpu"))
    sched = build_scheduler(opt, spec, 4)
    for step in range(2):
        model(torch.randn(2, 3, IMG, IMG)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step_update(step + 1)
    return ckpt.save_checkpoint(tmp_path_factory.mktemp("good") / "step-2", model, state=ckpt.TrainingState(opt, sched),
                                step=2, spec=spec.to_params(), model_info=info,
                                extra={"classes": list("abcdefghij")})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (a fresh one per test costs seconds of migrations each)."""
    import mlflow

    uri = migrated_store(tmp_path_factory.mktemp('store'))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        for key in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
            patch.delenv(key, raising=False)
        patch.chdir(tmp_path_factory.mktemp("cwd"))
        mlflow.set_tracking_uri(uri)
        yield uri
        while mlflow.active_run():
            mlflow.end_run()


def _rehash(directory):
    """Make the manifest match whatever the files hold now (the damage is in the content, not the hashes)."""
    manifest = json.loads((directory / ckpt.MANIFEST).read_text())
    for name in manifest["files"]:
        data = (directory / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (directory / ckpt.MANIFEST).write_text(json.dumps(manifest))


def _edit_spec(**changes):
    def edit(directory):
        spec = json.loads((directory / ckpt.SPEC).read_text())
        for key, value in changes.items():
            if value is _DROP:
                spec.pop(key)
            elif key == "train_spec.seed":
                spec["train_spec"]["seed"] = value
            else:
                spec[key] = value
        (directory / ckpt.SPEC).write_text(json.dumps(spec))
    return edit


_DROP = object()


def _write(name, content):
    def edit(directory):
        (directory / name).write_bytes(content(directory) if callable(content) else content)
    return edit


def _weights_of(arch, classes):
    def content(directory):
        import safetensors.torch

        model, _ = create_model(arch, IMG, classes)
        path = directory / "other.safetensors"
        safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        data = path.read_bytes()
        path.unlink()
        return data
    return content


def _weights_without_head(directory):
    import safetensors.torch

    state = safetensors.torch.load_file(str(directory / ckpt.WEIGHTS))
    state.pop(sorted(k for k in state if k.startswith("head"))[0])
    path = directory / "cut.safetensors"
    safetensors.torch.save_file(state, str(path))
    data = path.read_bytes()
    path.unlink()
    return data


def _truncated_header(directory):
    data = (directory / ckpt.WEIGHTS).read_bytes()
    return data[: len(data) // 2]  # a safetensors header whose offsets run past the end


def _pickle(directory):
    import io

    buffer = io.BytesIO()
    torch.save({"weights": torch.zeros(3)}, buffer)
    return buffer.getvalue()


#: (id, damage, the file the error must name, or that per command); every command reads these files
VARIANTS = [
    ("img_size-string", _edit_spec(img_size="thirty-two"), "spec.json"),
    ("img_size-float", _edit_spec(img_size=32.5), "spec.json"),
    ("img_size-bool", _edit_spec(img_size=True), "spec.json"),
    ("img_size-not-a-patch-multiple", _edit_spec(img_size=33), "spec.json"),
    ("num_classes-negative", _edit_spec(num_classes=-3), "spec.json"),
    ("num_classes-list", _edit_spec(num_classes=[10]), "spec.json"),
    ("model-missing", _edit_spec(model=_DROP), "spec.json"),
    ("num_classes-missing", _edit_spec(num_classes=_DROP), "spec.json"),
    ("step-missing", _edit_spec(step=_DROP), "spec.json"),
    ("model-number", _edit_spec(model=42), "spec.json"),
    ("model-unknown", _edit_spec(model="vit_no_such_model"), "spec.json"),
    ("step-string", _edit_spec(step="ten"), "spec.json"),
    ("distilled-garbage", _edit_spec(distilled="maybe"), "spec.json"),
    ("train_spec-string", _edit_spec(train_spec="oops"), "spec.json"),
    ("train_spec-seed", _edit_spec(**{"train_spec.seed": "abc"}), "spec.json"),
    ("classes-count", _edit_spec(classes=["a", "b"]), "spec.json"),
    ("spec-a-list", _write("spec.json", b"[1, 2, 3]"), "spec.json"),
    ("spec-not-json", _write("spec.json", b"{model: test_vit"), "spec.json"),
    # issue 39: a RecursionError traceback before the one reader (vitreg.files)
    ("spec-nested-200000-deep", _write("spec.json", b"[" * 200_000 + b"]" * 200_000), "spec.json"),
    # resume compares spec.json with the run before reading the weights, and names spec.json
    ("num_classes-other-than-weights", _edit_spec(num_classes=7, classes=None),
     {"pull": "model.safetensors", "infer": "model.safetensors", "teacher": "model.safetensors",
      "resume": "spec.json"}),
    ("weights-jpeg", _write("model.safetensors", b"\xff\xd8\xff\xe0" + b"\x00JFIF" * 40), "model.safetensors"),
    ("weights-empty", _write("model.safetensors", b""), "model.safetensors"),
    ("weights-a-pickle", _write("model.safetensors", _pickle), "model.safetensors"),
    ("weights-truncated", _write("model.safetensors", _truncated_header), "model.safetensors"),
    ("weights-of-another-size", _write("model.safetensors", _weights_of("test_vit", 7)), "model.safetensors"),
    ("weights-a-key-missing", _write("model.safetensors", _weights_without_head), "model.safetensors"),
    ("weights-of-another-model", _write("model.safetensors", _weights_of("test_vit2", CLASSES)),
     "model.safetensors"),
]
#: damage only resuming reads
STATE_VARIANTS = [
    ("state-garbage", _write("train_state.pt", b"not a torch file"), "train_state.pt"),
    ("state-a-list", _write("train_state.pt", lambda d: _saved([1, 2])), "train_state.pt"),
    ("state-step-string", _write("train_state.pt", lambda d: _saved({"step": "2"})), "train_state.pt"),
    ("state-optimizer-of-another-model", _write("train_state.pt", lambda d: _other_optimizer()), "train_state.pt"),
    ("state-scheduler-garbage", _write("train_state.pt", lambda d: _saved({"step": 2, "scheduler": {"t_initial": "x"}})),
     "train_state.pt"),
]


def _saved(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _other_optimizer() -> bytes:
    """AdamW state of a model with another head size: the same parameter count, other shapes."""
    from types import SimpleNamespace

    from vitreg.train.loop import build_optimizer

    model, _ = create_model("test_vit", IMG, 7)
    opt = build_optimizer(model, TrainSpec(model="test_vit", num_classes=7), SimpleNamespace(device="cpu"))
    model(torch.randn(2, 3, IMG, IMG)).sum().backward()
    opt.step()
    return _saved({"step": 2, "epoch": 0, "optimizer": opt.state_dict()})


def _damaged(good, tmp_path, damage):
    directory = tmp_path / "ckpt"
    shutil.copytree(good, directory)
    damage(directory)
    _rehash(directory)
    return directory


def _commands(directory):
    return {
        "pull": ["pull", str(directory)],
        "infer": ["infer", "--model-uri", str(directory), "--device", "cpu", "--batch-size", "2", "--warmup", "1",
                  "--steps", "1", "--repeats", "1"],
        "resume": ["train", "--model", "test_vit", *TINY, "--resume", str(directory)],
        "teacher": ["train", "--model", "deit_tiny_distilled_patch16_224", *TINY, "--distillation", "soft",
                    "--teacher", str(directory)],
    }


def _assert_one_line_refusal(res, directory, filename):
    from mlflow.tracking import MlflowClient

    assert res.exit_code == 2, (res.exit_code, res.output[-3000:], res.exception)
    assert "Traceback" not in res.output, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    assert str(directory) in errors[0] and filename in errors[0], errors[0]
    client = MlflowClient()  # the store is the module's: ask for the RUNNING runs, not for every run's data
    running = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                 filter_string="attributes.status = 'RUNNING'")
    assert not running, [r.info.run_id for r in running]


@pytest.mark.slow  # the damage x command matrix: ~1 min of CLI runs, the slow tier's (the fast one keeps the rest)
@pytest.mark.parametrize("command", ["pull", "infer", "resume", "teacher"])
@pytest.mark.parametrize("variant, damage, filename", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_a_malformed_checkpoint_is_one_line_naming_the_file(good_checkpoint, tmp_path, store, command,
                                                            variant, damage, filename):
    directory = _damaged(good_checkpoint, tmp_path, damage)
    res = CliRunner().invoke(main, _commands(directory)[command])
    _assert_one_line_refusal(res, directory, filename[command] if isinstance(filename, dict) else filename)


@pytest.mark.slow
@pytest.mark.parametrize("variant, damage, filename", STATE_VARIANTS, ids=[v[0] for v in STATE_VARIANTS])
def test_a_malformed_training_state_is_one_line_naming_the_file(good_checkpoint, tmp_path, store, variant,
                                                                damage, filename):
    directory = _damaged(good_checkpoint, tmp_path, damage)
    res = CliRunner().invoke(main, _commands(directory)["resume"])
    _assert_one_line_refusal(res, directory, filename)


def test_the_undamaged_checkpoint_passes_every_command(good_checkpoint, tmp_path, store):
    """The same commands on the checkpoint before any damage: what the refusals above are not."""
    directory = _damaged(good_checkpoint, tmp_path, lambda d: None)
    for name, args in _commands(directory).items():
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, (name, res.output[-3000:], res.exception)


def test_a_teacher_that_cannot_load_is_refused_before_the_students_setup(good_checkpoint, tmp_path, store,
                                                                         monkeypatch):
    """The teacher is loaded right after the student is built: a damaged one is refused before the
    data, the run's environment and the FLOPs count are made (that work is not done for nothing)."""
    from vitreg.train import data, job

    def not_reached(*args, **kwargs):
        raise AssertionError("the student's setup ran before the teacher was loaded")

    monkeypatch.setattr(data, "build_data", not_reached)
    monkeypatch.setattr(job, "_log_setup", not_reached)
    monkeypatch.setattr(job, "_flops_metrics", not_reached)
    directory = _damaged(good_checkpoint, tmp_path, _write("model.safetensors", b"\xff\xd8\xff\xe0"))
    res = CliRunner().invoke(main, _commands(directory)["teacher"])
    _assert_one_line_refusal(res, directory, "model.safetensors")


def _lists_outside(kind):
    """A manifest entry for a file outside the checkpoint folder, its sha256 and size right (what a tampered
    manifest would hold to make vitreg read, hash or copy a file elsewhere)."""
    def damage(directory):
        outside = directory.parent / "outside.bin"
        outside.write_bytes(b"not the checkpoint's")
        name = {"dotdot": "../outside.bin", "absolute": str(outside), "nested": "sub/../../outside.bin"}.get(kind)
        if kind == "symlink":
            name = "linked.bin"
            (directory / name).symlink_to(outside)
        manifest = json.loads((directory / ckpt.MANIFEST).read_text())
        data = outside.read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        (directory / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return damage


@pytest.mark.parametrize("command", ["pull", "resume", "teacher", "infer"])
@pytest.mark.parametrize("kind", ["dotdot", "absolute", "nested", "symlink"])
def test_a_manifest_entry_outside_the_folder_is_refused(good_checkpoint, tmp_path, store, command, kind):
    directory = tmp_path / "ckpt"
    shutil.copytree(good_checkpoint, directory)
    _lists_outside(kind)(directory)
    args = _commands(directory)[command] + (["--out", str(tmp_path / "export")] if command == "pull" else [])
    res = CliRunner().invoke(main, args)
    _assert_one_line_refusal(res, directory, "is not a file of the checkpoint folder")
    assert not (tmp_path / "export").exists()  # pull --out: nothing written
