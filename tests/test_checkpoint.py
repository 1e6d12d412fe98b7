"""vitreg.checkpoint.format: the on-disk format other modules rely on, round trips, and refusals."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import shutil

import pytest
import torch

from vitreg.checkpoint import format as ckpt
from vitreg.errors import VitregError
from vitreg.models.factory import create_model
from vitreg.config.spec import TrainSpec

IMG, CLASSES = 32, 10


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert text and "\n" not in text
    return text


class Evil:
    def __reduce__(self):  # unpickling this would run code
        return (print, ("unpickled!",))


def _trained_state(arch="test_vit"):
    """A model, AdamW with state, timm scheduler and scaler after two real updates."""
    from timm.scheduler import CosineLRScheduler

    torch.manual_seed(0)
    model, info = create_model(arch, IMG, CLASSES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = CosineLRScheduler(opt, t_initial=10, warmup_t=2, warmup_lr_init=1e-6, t_in_epochs=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in range(2):
        model(torch.randn(2, 3, IMG, IMG)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step_update(step + 1)
    return model, info, opt, sched, scaler


@pytest.fixture(scope="module")
def _saved_once(tmp_path_factory):
    model, info, opt, sched, scaler = _trained_state()
    spec = TrainSpec(model="test_vit", img_size=IMG, num_classes=CLASSES, steps=10).to_params()
    path = ckpt.save_checkpoint(tmp_path_factory.mktemp("ckpt") / "step-2", model,
                                state=ckpt.TrainingState(opt, sched, scaler), step=2, epoch=0, spec=spec,
                                model_info=info, extra={"classes": list("abcdefghij")})
    return path, model, info, opt, sched


@pytest.fixture
def saved(_saved_once, tmp_path):
    """A fresh copy of one saved checkpoint per test (tests damage it)."""
    path, *rest = _saved_once
    copy = shutil.copytree(path, tmp_path / path.name)
    return (copy, *rest)


def test_layout_spec_and_manifest(saved):
    path, model, info, _, _ = saved
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors", "spec.json",
                                                      "train_state.pt"]
    spec = json.loads((path / "spec.json").read_text())
    assert (spec["model"], spec["img_size"], spec["num_classes"], spec["distilled"], spec["step"]) == \
        ("test_vit", IMG, CLASSES, False, 2)
    assert spec["train_spec"]["steps"] == "10" and spec["vitreg_version"] and spec["classes"][0] == "a"
    manifest = ckpt.verify_checkpoint(path).manifest
    assert manifest["format"] == "vitreg-checkpoint-1"
    assert set(manifest["files"]) == {"model.safetensors", "train_state.pt", "spec.json"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in manifest["files"].values())
    assert not list(path.parent.glob(".*partial*"))  # written under a temporary name, renamed into place


def test_load_model_round_trip_never_unpickles(saved, monkeypatch):
    path, model, info, _, _ = saved

    def no_pickle(*args, **kwargs):
        raise AssertionError("load_model must not unpickle")

    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    loaded, loaded_info, spec = ckpt.load_model(path)
    assert loaded_info == info and not loaded.training
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_load_training_state_restores_everything(saved):
    path, model, info, opt, sched = saved
    torch.manual_seed(123)
    random.seed(7)
    expected_torch, expected_py = torch.rand(3), random.random()  # what the RNG gives right after restoring
    torch.manual_seed(123)
    random.seed(7)
    ckpt.save_checkpoint(path, model, state=ckpt.TrainingState(opt, sched), step=2, epoch=1, spec={}, model_info=info)

    model2, _ = create_model("test_vit", IMG, CLASSES)  # other random weights
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    from timm.scheduler import CosineLRScheduler

    sched2 = CosineLRScheduler(opt2, t_initial=99, t_in_epochs=False)
    torch.manual_seed(999)
    random.seed(999)
    step, epoch = ckpt.load_training_state(path, model2, opt2, sched2, torch.amp.GradScaler("cpu", enabled=False))
    assert (step, epoch) == (2, 1)
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert sched2.t_initial == 10 and sched2.warmup_t == 2  # the saved schedule, not the new one
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert set(s1) == set(s2) and all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)


def test_tampered_file_names_the_file(saved):
    path = saved[0]
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(data))
    with pytest.raises(VitregError) as err:
        ckpt.load_model(path)
    assert "model.safetensors sha256 mismatch" in one_line(err)


def test_truncated_file(saved):
    path = saved[0]
    state = path / "train_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(VitregError) as err:
        ckpt.verify_checkpoint(path)
    assert "train_state.pt is truncated (100 of" in one_line(err)


@pytest.mark.parametrize("damage,needle", [
    (lambda p: (p / "manifest.json").unlink(), "has no manifest.json"),
    (lambda p: (p / "spec.json").unlink(), "spec.json is missing"),
    (lambda p: (p / "manifest.json").write_text("{"), "not valid JSON"),
    # issue 39: a RecursionError and a UnicodeDecodeError traceback before the one reader (vitreg.files)
    (lambda p: (p / "manifest.json").write_bytes(b"[" * 200_000 + b"]" * 200_000), "nested more than 64 levels deep"),
    (lambda p: (p / "manifest.json").write_bytes(bytes(range(128, 256))), "not UTF-8 text"),
    (lambda p: (p / "manifest.json").write_bytes(b"{}" + b" " * (2 << 20)), "larger than the 1048576 bytes"),
])
def test_incomplete_checkpoints(saved, damage, needle):
    path = saved[0]
    damage(path)
    with pytest.raises(VitregError) as err:
        ckpt.verify_checkpoint(path)
    assert needle in one_line(err)


def test_missing_directory(tmp_path):
    with pytest.raises(VitregError) as err:
        ckpt.load_model(tmp_path / "nope")
    assert "does not exist" in one_line(err)


def test_train_state_is_loaded_weights_only(saved):
    """A train_state.pt holding an arbitrary object (with a correct manifest) is refused, not executed."""
    path, model, info, opt, sched = saved
    torch.save({"step": 1, "evil": Evil()}, path / "train_state.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["train_state.pt"] = {"sha256": ckpt._sha256(path / "train_state.pt"),
                                           "bytes": (path / "train_state.pt").stat().st_size}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(VitregError) as err:
        ckpt.load_training_state(path, model, opt, sched)
    assert "weights_only=True" in one_line(err)


def test_other_model_is_refused(saved):
    path, _, info = saved[:3]
    other = dataclasses.replace(info, name="deit_tiny_patch16_224")
    with pytest.raises(VitregError) as err:
        ckpt.check_compatible(path, other)
    assert "is for model=test_vit" in one_line(err) and "pass model=test_vit" in one_line(err)


def test_wrapped_model_saves_plain_keys_and_replaces(tmp_path):
    model, info = create_model("test_vit", IMG, CLASSES)

    class Compiled(torch.nn.Module):  # what torch.compile's OptimizedModule looks like to us
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    target = tmp_path / "last"
    ckpt.save_checkpoint(target, Compiled(model), step=1, spec={}, model_info=info)
    ckpt.save_checkpoint(target, Compiled(model), step=2, spec={}, model_info=info)  # over an existing one
    loaded, _, spec = ckpt.load_model(target)
    assert spec["step"] == 2
    assert not any(k.startswith("_orig_mod") for k in loaded.state_dict())
    with pytest.raises(ValueError):
        ckpt.save_checkpoint(tmp_path / "x", model, step=1, spec={}, model_info=info, extra={"model": "other"})


def test_a_verified_checkpoint_is_not_hashed_again(saved, monkeypatch):
    """verify_checkpoint hashes every file once; the loaders take its result as it is."""
    path, model, info, opt, sched = saved
    verified = ckpt.verify_checkpoint(path)
    assert verified.directory == path and verified.step == 2 and verified.spec["classes"][0] == "a"

    def no_hash(p):
        raise AssertionError(f"{p} hashed again")

    monkeypatch.setattr(ckpt, "_sha256", no_hash)
    loaded, _, spec = ckpt.load_model(verified)
    assert spec == verified.spec and ckpt.check_compatible(verified, info) == verified.spec
    assert ckpt.load_training_state(verified, loaded, torch.optim.AdamW(loaded.parameters(), lr=1e-3)) == (2, 0)
    with pytest.raises(AssertionError, match="hashed again"):
        ckpt.load_model(path)  # a plain directory is verified (hashed) where it is loaded


def test_export_is_all_or_nothing(saved, tmp_path):
    """`pull --out`: a failure while exporting (here a weights file changed after it was verified: the copy no
    longer matches its manifest) leaves no folder under the name given, nor a temporary one beside it; an
    earlier export is replaced whole; a folder holding the user's own files is refused untouched."""
    from vitreg.checkpoint.export import export_folder

    saved = saved[0]
    checkpoint = ckpt.verify_checkpoint(saved)
    out = tmp_path / "export"
    assert export_folder(checkpoint, out, "local") == out
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "manifest.json", "model.safetensors", "spec.json"]
    ckpt.verify_checkpoint(out)
    first = (out / "model.safetensors").stat().st_ino
    export_folder(checkpoint, out, "local")  # an earlier export: replaced
    assert (out / "model.safetensors").stat().st_ino != first and ckpt.verify_checkpoint(out)

    (saved / "model.safetensors").write_bytes(b"changed after verification")
    fresh = tmp_path / "fresh"
    with pytest.raises(VitregError, match="model.safetensors"):
        export_folder(checkpoint, fresh, "local")
    assert not fresh.exists() and not [p for p in out.parent.iterdir() if p.name.startswith((".", "fresh"))]
    with pytest.raises(VitregError, match="model.safetensors"):
        export_folder(checkpoint, out, "local")
    assert ckpt.verify_checkpoint(out)  # the earlier export is still whole

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(VitregError, match=r"--out .*mine holds files an export does not write \(notes.txt\)"):
        export_folder(checkpoint, mine, "local")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_run_still_in_the_spool_is_not_registered(saved, tmp_path):
    """Registration is off the Tracker protocol: the registry asks a spooling tracker whether its run is on the
    server; an offline one is not, and the refusal says how to register after `vitreg sync`."""
    from vitreg.tracking import model_registry
    from vitreg.tracking.delivery import SpoolingTracker

    tracker = SpoolingTracker.open("spooled", run_name="offline", root=tmp_path / "spool", offline=True)
    try:
        with pytest.raises(VitregError) as err:
            model_registry.register_checkpoint(tracker, saved[0], "tiny")
    finally:
        tracker.close()
    message = one_line(err)
    assert message.startswith("cannot register 'tiny' yet: the run is not on the tracking server (offline)")
    assert "vitreg sync --spool" in message and "vitreg register runs:/" in message
