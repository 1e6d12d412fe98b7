"""Training losses: label-smoothed cross-entropy on one or two heads, DeiT's distillation loss, its teacher.

The loop calls ``criterion(inputs, outputs, labels)``: the teacher sees the student's inputs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from vitreg.checkpoint import format as ckpt
from vitreg.console import progress
from vitreg.errors import VitregError


def loss_of(output, target, criterion):
    """Cross-entropy; DeiT distilled models train two heads (class and distillation token) on it."""
    if isinstance(output, (tuple, list)):
        return sum(criterion(o, target) for o in output) / len(output)
    return criterion(output, target)


class DistillationLoss(torch.nn.Module):
    """DeiT's distillation loss (facebookresearch/deit ``losses.py``): the class head learns the labels, the
    distillation head the teacher (``soft``: KL at temperature tau; ``hard``: its argmax), mixed by ``alpha``.
    The teacher runs without gradients, under the caller's autocast."""

    def __init__(self, base_criterion, teacher_model, distillation_type: str, alpha: float, tau: float):
        super().__init__()
        if distillation_type not in ("none", "soft", "hard"):
            raise ValueError(f"distillation_type {distillation_type!r}")
        self.base_criterion = base_criterion
        self.teacher_model = teacher_model
        self.distillation_type = distillation_type
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            outputs, outputs_kd = outputs  # (class head, distillation head)
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == "none":
            return base_loss
        if outputs_kd is None:
            raise ValueError("distillation needs a model that returns (class, distillation) outputs in training: "
                             "a deit_*_distilled_* model with set_distilled_training(True)")
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)
        if self.distillation_type == "soft":
            T = self.tau
            # log_target=True: both sides are log-probabilities, which is stabler than probabilities
            distillation_loss = F.kl_div(
                F.log_softmax(outputs_kd / T, dim=1),
                F.log_softmax(teacher_outputs / T, dim=1),
                reduction="sum",
                log_target=True,
            ) * (T * T) / outputs_kd.numel()
        else:
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
        return base_loss * (1 - self.alpha) + distillation_loss * self.alpha


class TwoHeadLoss(torch.nn.Module):
    """``distillation=none``: both heads of a distilled DeiT on the labels, averaged (bench's train loss); DeiT
    would train the class head alone, leaving the other random while the eval output averages the two."""

    def __init__(self, base_criterion):
        super().__init__()
        self.base_criterion = base_criterion

    def forward(self, inputs, outputs, labels):
        return loss_of(outputs, labels, self.base_criterion)


def check_distillable(spec, info) -> None:
    if spec.distillation != "none" and not info.distilled:
        raise VitregError(f"distillation={spec.distillation} needs a distillation token, which {info.name} lacks: "
                          f"use a deit_*_distilled_* model (e.g. deit_tiny_distilled_patch16_224) or distillation=none")


def build_criterion(spec, info, teacher=None):
    # torch's label_smoothing is the same loss as timm's LabelSmoothingCrossEntropy
    # ((1 - s) * NLL + s * mean(-log p)) and compiles without a custom op
    base = torch.nn.CrossEntropyLoss(label_smoothing=spec.label_smoothing)
    if spec.distillation == "none":
        return TwoHeadLoss(base)
    check_distillable(spec, info)
    if teacher is None:
        raise VitregError(f"distillation={spec.distillation} needs teacher=...: a timm name, models:/<name>@<alias> "
                          f"or a checkpoint directory")
    return DistillationLoss(base, teacher, spec.distillation, spec.distill_alpha, spec.distill_tau)


def create_teacher(spec, info, device, progress=progress):
    """The teacher for ``spec.teacher``, in eval mode on ``device``, without gradients: a ``models:/`` or
    ``runs:/`` URI, a checkpoint directory, or a timm name with random weights (vitreg never reaches a hub)."""
    from vitreg.models.factory import create_model

    name = spec.teacher
    if "://" in name or name.startswith(("models:/", "runs:/")):
        from vitreg.tracking.checkpoint_sources import load_model  # downloaded into a folder that goes once loaded

        teacher, _, _ = load_model(name)
    elif Path(name).expanduser().is_dir():
        teacher, _, _ = ckpt.load_model(Path(name).expanduser())
    else:
        teacher, _ = create_model(name, info.img_size, info.num_classes)
        progress(f"teacher {name} has random weights (vitreg builds timm models with pretrained=False): "
                 f"distillation from it only exercises the code path; pass teacher=models:/<name>@<alias> "
                 f"for a trained teacher")
    classes = getattr(teacher, "num_classes", None)
    if isinstance(classes, int) and classes != info.num_classes:
        raise VitregError(f"teacher {name} has {classes} classes, the student {info.num_classes}: "
                          f"use a teacher trained on the same classes (or num_classes={classes})")
    teacher = teacher.to(device).eval()
    teacher.requires_grad_(False)
    return teacher
