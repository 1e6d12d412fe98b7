"""The training engine on the CPU with tiny models: spec, LR schedule, DeiT losses, data, loop, exact resume."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from vitreg.checkpoint import format as ckpt
from vitreg.train import loop as engine
from vitreg.train import losses
from vitreg.train.data import SyntheticData, build_data, resolve_num_classes
from vitreg.errors import OutOfMemory, VitregError
from vitreg.hardware.profiles import PROFILES, DetectedHardware
from vitreg.models.factory import create_model
from vitreg.hardware.runtime import resolve_runtime
from vitreg.config.spec import TrainSpec

CPU = DetectedHardware("cpu", "CPU (test)", 1, PROFILES["cpu"])
IMG, CLASSES = 32, 10
TINY = dict(model="test_vit", img_size=IMG, num_classes=CLASSES, batch_size=16, label_smoothing=0, min_lr=0)


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert text and "\n" not in text
    return text


def runtime_for(spec):
    return resolve_runtime(spec.amp, spec.compile, spec.compile_backend, CPU)


def fit(spec, checkpoint_dir=None, resume_from=None, **hooks):
    torch.manual_seed(spec.seed)
    model, info = create_model(spec.model, spec.img_size, resolve_num_classes(spec))
    logs = {}
    hooks = engine.Hooks(on_log=lambda s, m: logs.__setitem__(s, m), progress=lambda message: None, **hooks)
    result = engine.train(spec, runtime_for(spec), model, info,
                          checkpoints=engine.Checkpoints(checkpoint_dir, resume_from), hooks=hooks)
    return result, logs, model


# --------------------------------------------------------------------------- spec


def test_train_spec_parses_strings():
    spec = TrainSpec(steps="30", epochs="0", lr="1e-3", clip_grad="1.5", label_smoothing="0", amp="BF16",
                     allow_gpu_mismatch="false", distillation="Soft", teacher="test_vit", distill_alpha="0.25",
                     checkpoint_every="0", resume=" runs:/abc/checkpoints/last ", data=" Synthetic ")
    assert (spec.steps, spec.epochs, spec.lr, spec.clip_grad, spec.label_smoothing) == (30, 0, 1e-3, 1.5, 0.0)
    assert spec.amp == "bf16" and spec.allow_gpu_mismatch is False and spec.distillation == "soft"
    assert spec.resume == "runs:/abc/checkpoints/last" and spec.synthetic
    assert not hasattr(spec, "task")  # no bench field on a train spec (issue 11: no duck typing between specs)
    params = spec.to_params()
    assert params["lr"] == "0.001" and params["allow_gpu_mismatch"] == "false" and params["steps"] == "30"
    assert TrainSpec(**params) == spec  # params round-trip: what MLflow stores rebuilds the spec
    assert TrainSpec().model == "deit_tiny_patch16_224" and TrainSpec().alias == "latest"


@pytest.mark.parametrize("kwargs,needle", [
    ({"steps": "0", "epochs": "0"}, "train nothing"),
    ({"lr": "fast"}, "lr='fast' is not a number"),
    ({"lr": "1e-6"}, "min_lr=1e-05 is above lr=1e-06"),
    ({"label_smoothing": "1"}, "label_smoothing=1 must be < 1"),
    ({"distillation": "soft"}, "distillation=soft needs a teacher"),
    ({"teacher": "deit_small_patch16_224"}, "but distillation=none"),
    ({"distillation": "medium", "teacher": "x"}, "is not one of none, soft, hard"),
    ({"distill_alpha": "1.5", "distillation": "hard", "teacher": "x"}, "distill_alpha=1.5 must be <= 1"),
    ({"num_classes": "1"}, "num_classes=1 cannot be trained"),
    ({"amp": "fp17"}, "did you mean amp=fp16"),
])
def test_train_spec_errors_name_the_fix(kwargs, needle):
    with pytest.raises(VitregError) as err:
        TrainSpec(**kwargs)
    assert needle in one_line(err)


def test_unknown_option_suggests():
    with pytest.raises(VitregError) as err:
        TrainSpec.from_options({"warmup": "5"})
    assert "did you mean warmup_steps" in one_line(err)


# --------------------------------------------------------------------------- schedule and losses


def test_lr_schedule_warmup_then_cosine():
    spec = TrainSpec(lr=1e-3, min_lr=1e-5, warmup_steps=4)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=spec.lr)
    sched = engine.build_scheduler(opt, spec, total_steps=24)

    def lr_at(update):
        sched.step_update(update)
        return opt.param_groups[0]["lr"]

    lr, lo, init = 1e-3, 1e-5, 1e-6
    assert opt.param_groups[0]["lr"] == pytest.approx(init)  # the first update runs at the warm-up start
    assert lr_at(2) == pytest.approx(init + 2 * (lr - init) / 4)  # linear warm-up
    assert lr_at(4) == pytest.approx(lr)  # peak right after warm-up
    assert lr_at(9) == pytest.approx(lo + 0.5 * (lr - lo) * (1 + math.cos(math.pi * 5 / 20)))
    assert lr_at(14) == pytest.approx((lr + lo) / 2)  # cosine half-way over the 20 post-warm-up updates
    assert lr_at(24) == pytest.approx(lo)
    # a run shorter than its warm-up still ends at min_lr
    short = engine.build_scheduler(opt, TrainSpec(warmup_steps=100, lr=1e-3, min_lr=1e-5), total_steps=5)
    short.step_update(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)


class FixedTeacher(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits)
        self.grad_enabled = None

    def forward(self, x):
        self.grad_enabled = torch.is_grad_enabled()
        return self.logits


def _log_softmax(values):
    m = max(values)
    z = math.log(sum(math.exp(v - m) for v in values)) + m
    return [v - z for v in values]


def test_distillation_loss_against_hand_values():
    cls, dist, labels = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([0])
    teacher = FixedTeacher([[1.0, 3.0]])
    base = torch.nn.CrossEntropyLoss()
    alpha, tau = 0.5, 2.0
    base_loss = math.log(1 + math.exp(-2.0))  # CE of [2, 0] at class 0

    none = losses.DistillationLoss(base, teacher, "none", alpha, tau)
    assert none(None, (cls, dist), labels).item() == pytest.approx(base_loss)

    hard = losses.DistillationLoss(base, teacher, "hard", alpha, tau)
    hard_kd = math.log(1 + math.exp(-1.0))  # CE of the distillation head [0, 1] at the teacher's argmax (1)
    assert hard(None, (cls, dist), labels).item() == pytest.approx((1 - alpha) * base_loss + alpha * hard_kd)
    assert teacher.grad_enabled is False  # the teacher runs under no_grad

    soft = losses.DistillationLoss(base, teacher, "soft", alpha, tau)
    log_p = _log_softmax([0.0 / tau, 1.0 / tau])
    log_q = _log_softmax([1.0 / tau, 3.0 / tau])
    kl = sum(math.exp(q) * (q - p) for p, q in zip(log_p, log_q))  # KL(teacher || student), summed
    soft_kd = kl * tau * tau / 2  # divided by the number of logits (1 x 2)
    assert soft(None, (cls, dist), labels).item() == pytest.approx((1 - alpha) * base_loss + alpha * soft_kd)

    with pytest.raises(ValueError):
        soft(None, cls, labels)  # a plain (non-distilled) output cannot be distilled


def test_label_smoothing_matches_timm():
    from timm.loss import LabelSmoothingCrossEntropy

    logits, labels = torch.randn(4, CLASSES), torch.randint(0, CLASSES, (4,))
    crit = losses.build_criterion(TrainSpec(label_smoothing=0.1), None)
    assert crit(None, logits, labels).item() == pytest.approx(LabelSmoothingCrossEntropy(0.1)(logits, labels).item(),
                                                              rel=1e-5)


# --------------------------------------------------------------------------- data


def test_synthetic_batches_are_deterministic_and_class_conditional():
    a = SyntheticData(CLASSES, IMG, 8, "cpu", seed=3)
    b = SyntheticData(CLASSES, IMG, 8, "cpu", seed=3)
    x1, y1 = a.batch(5)
    x2, y2 = b.batch(5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (8, 3, IMG, IMG)
    assert not torch.equal(a.batch(6)[0], x1)
    assert not torch.equal(SyntheticData(CLASSES, IMG, 8, "cpu", seed=3, rank=1).batch(5)[0], x1)  # ranks differ
    assert a.steps_per_epoch == 10_000 // 8 and [len(y) for _, y in a.batches(0, a.steps_per_epoch - 2)] == [8, 8]


def make_folder(root, classes=("cat", "dog"), n_train=8, n_val=4):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        for c, colour in zip(classes, ((220, 30, 30), (30, 30, 220), (30, 220, 30))):
            folder = root / split / c
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(np.array(colour) + rng.normal(0, 25, (40, 40, 3)), 0, 255).astype("uint8")
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


@pytest.mark.parametrize("setup,needle", [
    (lambda r: r / "missing", "does not exist: pass data=synthetic"),
    (lambda r: (r / "file.txt").write_text("x") and r / "file.txt", "is a file, not a folder"),
    (lambda r: (r / "d").mkdir() or r / "d", "has no train/ sub-folder"),
    (lambda r: (r / "d" / "train").mkdir(parents=True) or r / "d", "train/ has no class folders"),
])
def test_bad_data_paths(tmp_path, setup, needle):
    path = setup(tmp_path)
    with pytest.raises(VitregError) as err:
        resolve_num_classes(TrainSpec(data=str(path)))
    assert needle in one_line(err)


def test_folder_data_errors(tmp_path):
    root = make_folder(tmp_path / "ds")
    _, info = create_model("test_vit", IMG, 2)
    spec = TrainSpec(model="test_vit", data=str(root), batch_size=4, num_workers=0)
    assert resolve_num_classes(spec) == 2
    with pytest.raises(VitregError) as err:
        build_data(spec.replace(batch_size=64), info, "cpu")
    assert "fewer than one batch" in one_line(err)
    with pytest.raises(VitregError) as err:
        build_data(spec.replace(num_classes=5), info, "cpu")
    assert "num_classes=5 but data=" in one_line(err)
    (root / "val" / "dog").rename(root / "val" / "wolf")
    with pytest.raises(VitregError) as err:
        build_data(spec, info, "cpu")
    assert "different class folders" in one_line(err)


# --------------------------------------------------------------------------- the loop


def test_the_live_rate_leaves_out_the_first_step_as_the_summary_does(monkeypatch):
    """A compiled run's first step holds the compilation: the live img/s must not count it (issue 14).

    The steps run on a clock of the test's own (``time.perf_counter``, which the loop's step clock reads):
    each forward pass takes exactly 10 ms on it and the first one 3 s more, so the slow first step is
    certain and the rates are exact whatever the machine's load (no sleep, no wall-clock band)."""
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])

    def forward_takes_10_ms(module, args):
        clock["now"] += 0.010 + (3.0 if clock["now"] == 0.0 else 0.0)

    spec = TrainSpec(**TINY, steps=24, log_every=24)
    torch.manual_seed(spec.seed)
    model, info = create_model(spec.model, spec.img_size, resolve_num_classes(spec))
    model.register_forward_pre_hook(forward_takes_10_ms)
    logs = {}
    result = engine.train(spec, runtime_for(spec), model, info,
                          hooks=engine.Hooks(on_log=lambda s, m: logs.__setitem__(s, m), progress=lambda message: None))
    monkeypatch.undo()
    live, summary = logs[24]["train_img_per_s"], result.figure("throughput_img_per_s")
    assert result.figure("first_step_s") == pytest.approx(3.010) and result.figure("step_ms_p50") == pytest.approx(10)
    # the 23 steps after the first, 10 ms each: the live rate and the summary are both 16 images per 10 ms;
    # a live rate that counted the first step would be 24 * 16 / 3.24 s = 119 img/s
    assert live == pytest.approx(1600) and summary == pytest.approx(1600), (live, summary)


def test_synthetic_loss_falls_and_metrics():
    spec = TrainSpec(**TINY, steps=30, lr=2e-3, warmup_steps=3, log_every=5)
    result, logs, _ = fit(spec)
    assert sorted(logs) == [5, 10, 15, 20, 25, 30]
    first, last = logs[5]["train_loss"], logs[30]["train_loss"]
    assert first > 1.8  # ~ln(10) at the start
    assert last < 0.75 * first, (first, last)
    assert set(logs[5]) == {"train_loss", "lr", "train_img_per_s", "grad_norm", "data_wait_frac", "epoch"}
    assert all(m["train_img_per_s"] > 0 and 0 <= m["data_wait_frac"] <= 1 and m["grad_norm"] > 0
               for m in logs.values())
    assert logs[30]["lr"] < logs[10]["lr"]  # cosine decay
    assert result.step == 30 and result.steps_run == 30 and result.figure("images") == 30 * 16
    assert result.figure("final_loss") == logs[30]["train_loss"]
    assert result.figure("measured_steps") == 30 - 1 - 10  # first step and warm-up excluded, as bench does
    assert result.figure("throughput_img_per_s") > 0 and result.figure("step_ms_p50") > 0
    assert result.figure("compile_time_s") is None
    m = result.metrics()
    for key in ("train_throughput_img_per_s", "train_step_ms_p50", "train_final_loss", "train_data_wait_frac"):
        assert key in m
    assert "val_top1" not in m  # synthetic data has no val split


def test_resume_continues_exactly(tmp_path):
    """6 steps, checkpoint, new model + optimizer resumed from it: the same losses, LRs and weights as 12 straight."""
    spec = TrainSpec(**{**TINY, "batch_size": 8}, steps=12, lr=2e-3, warmup_steps=3, log_every=1,
                     checkpoint_every=6)
    _, straight_logs, straight = fit(spec)

    class Stop(Exception):
        pass

    def stop_at_6(step, path):
        if step == 6:
            raise Stop

    with pytest.raises(Stop):
        fit(spec, checkpoint_dir=tmp_path / "a", on_checkpoint=stop_at_6)
    # verified once, then handed on; another seed is replaced by the checkpoint's (it defines the data)
    checkpoint = ckpt.verify_checkpoint(tmp_path / "a" / "step-6")
    messages = []
    _, info = create_model(spec.model, spec.img_size, CLASSES)
    resumed_spec = engine.resume_spec(spec.replace(seed=99), checkpoint, info, progress=messages.append)
    assert resumed_spec == spec and "the checkpoint's seed=0" in messages[0]
    result, logs, resumed = fit(resumed_spec, checkpoint_dir=tmp_path / "b", resume_from=checkpoint)
    assert result.start_step == 6 and result.steps_run == 6 and sorted(logs) == list(range(7, 13))
    for step in range(7, 13):
        assert logs[step]["train_loss"] == pytest.approx(straight_logs[step]["train_loss"], rel=1e-5)
        assert logs[step]["lr"] == pytest.approx(straight_logs[step]["lr"])
    for key, value in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value)
    assert result.last_checkpoint == str(tmp_path / "b" / "step-12")

    with pytest.raises(VitregError) as err:  # already at the end
        fit(spec.replace(steps=6), resume_from=tmp_path / "a" / "step-6")
    assert "pass steps > 6" in one_line(err)


def test_folder_data_trains_with_val(tmp_path):
    root = make_folder(tmp_path / "ds")
    spec = TrainSpec(model="test_vit", img_size=IMG, data=str(root), batch_size=4, epochs=2, num_workers=0,
                     lr=1e-3, warmup_steps=1, log_every=2)
    epochs = []
    result, logs, _ = fit(spec, checkpoint_dir=tmp_path / "ck", on_epoch_end=lambda e, m: epochs.append((e, m)))
    assert result.steps_per_epoch == 4 and result.step == 8 and [e for e, _ in epochs] == [1, 2]
    assert all(0 <= m["val_top1"] <= 100 for _, m in epochs)
    assert result.figure("val_top1") == epochs[-1][1]["val_top1"]
    import json

    spec_json = json.loads((tmp_path / "ck" / "step-8" / "spec.json").read_text())
    assert spec_json["classes"] == ["cat", "dog"] and spec_json["data"] == "folder"


def test_distilled_deit_soft_and_hard():
    torch.manual_seed(0)
    student, info = create_model("deit_tiny_distilled_patch16_224", IMG, CLASSES)
    assert info.distilled
    for kind in ("soft", "hard"):
        spec = TrainSpec(model=info.name, img_size=IMG, num_classes=CLASSES, batch_size=4, steps=2, log_every=1,
                         distillation=kind, teacher="test_vit")
        messages = []
        result = engine.train(spec, runtime_for(spec), student, info, hooks=engine.Hooks(progress=messages.append))
        assert result.step == 2 and math.isfinite(result.figure("final_loss"))
        assert any("random weights" in m for m in messages)  # the random teacher is said out loud
    assert not student.distilled_training  # restored after training


def test_distillation_needs_a_distilled_student():
    spec = TrainSpec(**TINY, steps=1, distillation="hard", teacher="test_vit")
    with pytest.raises(VitregError) as err:
        fit(spec)
    assert "use a deit_*_distilled_* model" in one_line(err)


def test_out_of_memory_in_a_step_is_typed_and_names_a_smaller_batch(monkeypatch):
    import weakref

    spec = TrainSpec(**TINY, steps=2)
    model, info = create_model(spec.model, spec.img_size, CLASSES)
    held = []

    def out_of_memory(*args, **kwargs):
        activation = torch.ones(64, 64)  # what the failed step held, in its frame and in a reference cycle
        cycle = [activation]
        cycle.append(cycle)
        held.append(weakref.ref(activation))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(model, "forward", out_of_memory)
    with pytest.raises(OutOfMemory) as err:
        engine.train(spec, runtime_for(spec), model, info, hooks=engine.Hooks(progress=lambda message: None))
    assert one_line(err) == ("training with batch_size=16 ran out of GPU memory: use a smaller batch_size "
                             "(e.g. 8)")
    # the step's tensors are gone while the error is still held (its __context__ keeps torch's traceback)
    assert err.value.__context__ is not None and held and held[0]() is None
