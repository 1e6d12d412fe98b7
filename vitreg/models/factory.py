"""Model creation and FLOP counting.

Every model is built with random weights (``pretrained=False``): benchmarks do not need trained
weights, and vitreg never reaches a model hub. Trained weights come back through our own
safetensors checkpoints (:mod:`vitreg.tracking.registry`).

Names: any timm ViT/DeiT (``vit_*``, ``deit_*``, ``deit3_*``, ``test_vit*``) or a torchvision ViT
as ``torchvision:vit_b_16`` (the model the seeds benchmark).
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass

from vitreg.errors import VitregError
from vitreg.models import known

TIMM_PREFIXES = ("vit_", "deit_", "deit3_", "test_vit")
TORCHVISION_VITS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")
TORCHVISION_PREFIX = "torchvision:"


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a model that the runner and the report need."""

    name: str
    source: str  # "timm" or "torchvision"
    img_size: int
    patch_size: int
    num_classes: int
    params_m: float
    distilled: bool  # DeiT distilled models return (cls, dist) heads in training


@functools.lru_cache(maxsize=1)
def _timm_names() -> tuple[str, ...]:
    """timm's ViT/DeiT names (30 ms to list once timm is imported: a job checks its model, teacher and
    resume names), kept in the user's cache for processes that only check a name."""
    import timm

    names = tuple(n for n in timm.list_models() if n.startswith(TIMM_PREFIXES))
    if known.names() != frozenset(names):
        known.keep(names=names)
    return names


def check_model_name(name: str, listed_before_ok: bool = True) -> None:
    """Refuse a name we cannot build, suggesting the closest real ones.

    ``listed_before_ok``: a name that an earlier process listed for this timm install passes without
    importing timm (:mod:`vitreg.models.known`); the process that builds the model passes False.
    """
    if listed_before_ok and name.startswith(TIMM_PREFIXES) and name in known.names():
        return
    if name.startswith(TORCHVISION_PREFIX):
        arch = name[len(TORCHVISION_PREFIX):]
        if arch not in TORCHVISION_VITS:
            close = difflib.get_close_matches(arch, TORCHVISION_VITS, n=3)
            raise VitregError(f"unknown torchvision model {name!r}: use one of "
                              f"{', '.join(TORCHVISION_PREFIX + c for c in (close or TORCHVISION_VITS))}")
        return
    names = _timm_names()
    if name in names:
        return
    import timm

    if timm.is_model(name):
        raise VitregError(f"model {name!r} is not a ViT/DeiT: vitreg benchmarks timm vit_*/deit_*/deit3_* models "
                          f"and torchvision:vit_b_16; e.g. model=vit_base_patch16_224")
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else "see timm.list_models('vit_*')"
    raise VitregError(f"unknown model {name!r}: {hint}")


def create_model(name: str, img_size: int = 0, num_classes: int = 1000):
    """Build the model on the CPU with random weights; returns ``(model, ModelInfo)``.

    ``img_size=0`` keeps the model's default resolution. Any other size must be a multiple of the
    patch size: ViT position embeddings are built for the size given here, and a size the patch
    grid does not divide fails only at the first forward pass, deep inside the model. A size whose
    weights alone would not fit in this host's memory is refused before they are allocated
    (:mod:`vitreg.models.memory` measures them on PyTorch's meta device first).
    """
    from vitreg.models.memory import check_host_fits, footprint

    check_host_fits(footprint(name, img_size, num_classes), f"model={name} with img_size={img_size or 'default'}")
    model, source, size, patch = build(name, img_size, num_classes)
    distilled = bool(getattr(model, "dist_token", None) is not None)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    return model, ModelInfo(name, source, size, patch, num_classes, params_m, distilled)


def build(name: str, img_size: int, num_classes: int):
    """``(model, source, img_size, patch_size)`` on the current default device (the CPU, or ``meta``)."""
    check_model_name(name, listed_before_ok=False)  # timm is imported here anyway
    if name.startswith(TORCHVISION_PREFIX):
        import torchvision

        arch = name[len(TORCHVISION_PREFIX):]
        patch = int(arch.rsplit("_", 1)[1])
        size = img_size or 224
        _check_img_size(name, size, patch)
        return getattr(torchvision.models, arch)(weights=None, image_size=size, num_classes=num_classes), \
            "torchvision", size, patch
    import timm

    default_cfg = timm.models.get_pretrained_cfg(name)
    size = img_size or (int(default_cfg.input_size[-1]) if default_cfg is not None else 224)
    patch = _timm_patch_size(name)
    _check_img_size(name, size, patch)  # before building: the position embeddings are sized by it
    model = _timm_create(name, num_classes=num_classes, **({"img_size": size} if img_size else {}))
    return model, "timm", size, patch


def _timm_create(name: str, **kwargs):
    """``timm.create_model`` with random weights; on the meta device without initialising them.

    Initialising meta tensors computes nothing, but timm's truncated-normal init runs through
    torch's Python reference ops there: it made a meta build of deit_tiny cost more than a real one,
    and every command builds its model on the meta device first (:func:`vitreg.models.memory.footprint`).
    """
    import timm
    import torch

    if torch.get_default_device().type == "meta":
        try:
            return timm.create_model(name, pretrained=False, weight_init="skip", **kwargs)
        except TypeError:  # a timm ViT class without the switch
            pass
    return timm.create_model(name, pretrained=False, **kwargs)


@functools.lru_cache(maxsize=None)
def _timm_patch_size(name: str) -> int:
    """The patch size of a timm ViT, read from a weightless (meta-device) instance at its default size."""
    import torch

    with torch.device("meta"):
        probe = _timm_create(name)
    return int(_pair(probe.patch_embed.patch_size)[0])


def _pair(value):
    return value if isinstance(value, (tuple, list)) else (value, value)


def _check_img_size(name: str, size: int, patch: int) -> None:
    if size % patch:
        lower, upper = size // patch * patch, (size // patch + 1) * patch
        options = " or ".join(str(s) for s in (lower, upper) if s >= patch)
        raise VitregError(f"img_size={size} is not a multiple of {name}'s patch size {patch}: use img_size={options}")
