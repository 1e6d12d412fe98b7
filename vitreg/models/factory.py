"""Model creation with random weights: benchmarks need no trained weights, and vitreg never reaches a model hub
(trained weights come back through its own checkpoints, :mod:`vitreg.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vitreg.errors import VitregError
from vitreg.models.families import check_name
from vitreg.models.memory import check_host_fits, checked_size, footprint


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str  # the family's library: "timm" or "torchvision"
    img_size: int
    patch_size: int
    num_classes: int
    params_m: float
    distilled: bool  # DeiT distilled models return (cls, dist) heads in training


def check_model_name(name: str) -> None:
    check_name(name)


def create_model(name: str, img_size: int = 0, num_classes: int = 1000):
    """``(model, ModelInfo)`` on the CPU with random weights; ``img_size=0``: the model's default."""
    check_host_fits(footprint(name, img_size, num_classes), f"model={name} with img_size={img_size or 'default'}")
    family, size, patch = checked_size(name, img_size)
    try:
        model = family.build(name, size, num_classes)
    except (RuntimeError, ValueError, TypeError, AssertionError) as exc:  # a size the model's own code refuses
        raise VitregError(f"model={name} cannot be built at img_size={size} ({' '.join(str(exc).split())[:160]}): "
                          f"use img_size=0 (the model's default)") from None
    distilled = bool(getattr(model, "dist_token", None) is not None)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    return model, ModelInfo(name, family.library, size, patch, num_classes, params_m, distilled)
