"""Model families as adapters, each registered under the name prefixes it builds: which names exist, how to build
one with random weights, its patch size, the :class:`Architecture` of a built model. Nothing else in vitreg parses
a model name or reads a model's attributes: adding a family is one :func:`register_family` call at the end.
"""

from __future__ import annotations

import abc
import difflib
import functools
from dataclasses import dataclass

from vitreg.errors import VitregError
from vitreg.models import learned_facts


@dataclass(frozen=True)
class Architecture:
    tokens: int  # sequence length: patches + class/distillation/register tokens
    width: int  # embedding dimension
    depth: int  # transformer blocks
    hidden: int  # the MLP's first layer's width
    heads: int
    head_dim: int


class Family(abc.ABC):
    """A family adapter: ``names`` it can build (``listed_before_ok``, ``fresh``: see :func:`_timm_names`),
    ``build`` one with random weights on the current default device, ``owns`` a built model."""

    #: name prefixes this family owns (``vit_``, ``torchvision:``)
    prefixes: tuple[str, ...] = ()
    #: the library a user loads an exported checkpoint with, and the line that builds the model there
    library = ""
    loader_line = ""

    def shown_names(self) -> tuple[str, ...]:
        return tuple(f"{prefix}*" for prefix in self.prefixes)

    @abc.abstractmethod
    def names(self, listed_before_ok: bool = False, fresh: bool = False) -> frozenset[str]: ...
    @abc.abstractmethod
    def default_size(self, name: str) -> int: ...
    @abc.abstractmethod
    def patch_size(self, name: str) -> int: ...
    @abc.abstractmethod
    def build(self, name: str, img_size: int, num_classes: int): ...
    @abc.abstractmethod
    def owns(self, model) -> bool: ...
    @abc.abstractmethod
    def architecture(self, model) -> Architecture: ...


_FAMILIES: list[Family] = []


def register_family(family: Family) -> Family:
    taken = {p for f in _FAMILIES for p in f.prefixes} & set(family.prefixes)
    if taken:
        raise ValueError(f"model name prefixes {sorted(taken)} are registered already")
    _FAMILIES.append(family)
    return family


def family_of(name: str) -> Family:
    owners = [(len(p), f) for f in _FAMILIES for p in f.prefixes if name.startswith(p)]
    if owners:
        return max(owners, key=lambda owner: owner[0])[1]
    raise VitregError(f"model {name!r} is of no family vitreg builds: use a name starting with {_prefixes()} "
                      "(e.g. model=vit_base_patch16_224)")


def _prefixes() -> str:
    return ", ".join(p for f in _FAMILIES for p in f.prefixes)


def family_of_model(model) -> Family:
    for family in _FAMILIES:
        if family.owns(model):
            return family
    raise VitregError(f"{type(model).__name__} is of no model family vitreg knows the layout of: build it with "
                      f"model=<name> (vit_*, deit_*, eva02_*, torchvision:vit_b_16, ...)")


def architecture_of(model) -> Architecture:
    return family_of_model(model).architecture(model)


def names_text(markdown: bool = False) -> str:
    """For help and docs: ``vit_*, deit_*, ..., torchvision:vit_b_16, ...``."""
    quote = "`" if markdown else ""
    return ", ".join(f"{quote}{shown}{quote}" for f in _FAMILIES for shown in f.shown_names())


def all_names(listed_before_ok: bool = True) -> list[str]:
    return sorted(n for f in _FAMILIES for n in f.names(listed_before_ok))


def check_name(name: str, listed_before_ok: bool = True) -> Family:
    """The family of ``name`` if it can build it, else one line with the closest names. ``listed_before_ok``:
    answer without importing timm (:mod:`vitreg.models.learned_facts`); a process that builds passes False."""
    try:
        family = family_of(name)
    except VitregError:
        if _timm_has(name, listed_before_ok):
            raise VitregError(f"model {name!r} is not a vision transformer vitreg builds: use a name starting with "
                              f"{_prefixes()} (e.g. model=vit_base_patch16_224)") from None
        family = None
    if family is not None and (name in family.names(listed_before_ok)
                               or name in family.names(listed_before_ok, fresh=True)):
        return family
    pool = sorted(family.names(listed_before_ok, fresh=True) if family is not None else
                  (n for f in _FAMILIES for n in f.names(listed_before_ok, fresh=True)))
    close = difflib.get_close_matches(name, pool, n=3, cutoff=0.6)
    if len(pool) <= 8:  # a family of a few names: all of them
        hint = f"use one of {', '.join(pool)}"
    elif close:
        hint = f"did you mean {', '.join(close)}?"
    else:
        hint = f"use a name starting with {_prefixes()} (timm.list_models('vit_*'))"
    raise VitregError(f"unknown model {name!r}: {hint}")


def _timm_names(listed_before_ok: bool, fresh: bool = False) -> frozenset[str]:
    """timm's names: from timm itself, else an earlier process's list, else (``fresh``) timm's source."""
    if not listed_before_ok:
        return _timm_listed()
    kept = frozenset() if fresh else learned_facts.names()
    return kept or _timm_source() or _timm_listed()


def _timm_has(name: str, listed_before_ok: bool) -> bool:
    source = _timm_source() if listed_before_ok else frozenset()
    if source:
        return name in source
    import timm

    return bool(timm.is_model(name))


@functools.lru_cache(maxsize=1)
def _timm_source() -> frozenset[str]:
    return learned_facts.source_names()


def _pair(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


@functools.lru_cache(maxsize=1)
def _timm_listed() -> frozenset[str]:
    """timm's names of every timm family, kept for processes that only check a name."""
    import timm

    prefixes = tuple(p for f in _FAMILIES if isinstance(f, TimmFamily) for p in f.prefixes)
    listed = frozenset(n for n in timm.list_models() if n.startswith(prefixes))
    if learned_facts.names() != listed:
        learned_facts.keep(names=tuple(sorted(listed)))
    return listed


class TimmFamily(Family):
    """timm models of the ViT layout (``patch_embed``, ``blocks`` of ``attn`` and ``mlp``): ViT, DeiT, EVA..."""

    library = "timm"
    loader_line = ('model = timm.create_model(spec["model"], pretrained=False, img_size=spec["img_size"], '
                   'num_classes=spec["num_classes"])')

    def __init__(self, *prefixes: str):
        self.prefixes = prefixes

    def names(self, listed_before_ok: bool = False, fresh: bool = False) -> frozenset[str]:
        return frozenset(n for n in _timm_names(listed_before_ok, fresh) if n.startswith(self.prefixes))

    def default_size(self, name: str) -> int:
        import timm

        cfg = timm.models.get_pretrained_cfg(name)
        return int(cfg.input_size[-1]) if cfg is not None else 224

    def patch_size(self, name: str) -> int:
        return _timm_stride(name, self.default_size(name))

    def build(self, name: str, img_size: int, num_classes: int):
        return _timm_create(name, num_classes=num_classes, img_size=img_size)

    def owns(self, model) -> bool:
        return type(model).__module__.startswith("timm.") and hasattr(model, "patch_embed") and hasattr(model, "blocks")

    def architecture(self, model) -> Architecture:
        grid = _pair(model.patch_embed.grid_size)
        attn = model.blocks[0].attn
        heads = int(attn.num_heads)
        width = int(model.embed_dim)
        return Architecture(tokens=int(grid[0]) * int(grid[1]) + int(getattr(model, "num_prefix_tokens", 1)),
                            width=width, depth=len(model.blocks),
                            hidden=_first_linear_width(model.blocks[0].mlp, width),
                            heads=heads, head_dim=int(getattr(attn, "head_dim", width // heads)))


def _first_linear_width(module, default: int) -> int:
    import torch

    widths = [m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear)]
    return int(widths[0]) if widths else default


def _timm_create(name: str, **kwargs):
    """``timm.create_model`` with random weights; uninitialised on the meta device (timm's init runs through
    torch's Python reference ops there: a meta build of deit_tiny cost more than a real one)."""
    import timm
    import torch

    if torch.get_default_device().type == "meta":
        try:
            return timm.create_model(name, pretrained=False, weight_init="skip", **kwargs)
        except TypeError:  # a timm class without the switch
            pass
    return timm.create_model(name, pretrained=False, **kwargs)


@functools.lru_cache(maxsize=None)
def _timm_stride(name: str, default_size: int) -> int:
    """Pixels per token side from a meta-device instance: a ViT's patch size, a hybrid's stride."""
    import torch

    with torch.device("meta"):
        probe = _timm_create(name)
    return max(1, default_size // int(_pair(probe.patch_embed.grid_size)[0]))


class TorchvisionFamily(Family):
    prefixes = ("torchvision:",)
    library = "torchvision"
    loader_line = ('model = getattr(torchvision.models, spec["model"].split(":", 1)[1])(weights=None, '
                   'image_size=spec["img_size"], num_classes=spec["num_classes"])')
    #: architecture -> patch size (torchvision's builders take it as a number, not from the name)
    PATCH_SIZES = {"vit_b_16": 16, "vit_b_32": 32, "vit_l_16": 16, "vit_l_32": 32, "vit_h_14": 14}

    def names(self, listed_before_ok: bool = False, fresh: bool = False) -> frozenset[str]:
        return frozenset(self.shown_names())

    def shown_names(self) -> tuple[str, ...]:
        return tuple(self.prefixes[0] + arch for arch in self.PATCH_SIZES)

    def default_size(self, name: str) -> int:
        return 224

    def patch_size(self, name: str) -> int:
        return self.PATCH_SIZES[name.split(":", 1)[1]]

    def build(self, name: str, img_size: int, num_classes: int):
        import torchvision

        return getattr(torchvision.models, name.split(":", 1)[1])(weights=None, image_size=img_size,
                                                                  num_classes=num_classes)

    def owns(self, model) -> bool:
        return type(model).__module__.startswith("torchvision.") and hasattr(model, "seq_length")

    def architecture(self, model) -> Architecture:
        layers = model.encoder.layers
        heads = int(layers[0].self_attention.num_heads)
        width = int(model.hidden_dim)
        return Architecture(tokens=int(model.seq_length), width=width, depth=len(layers),
                            hidden=_first_linear_width(layers[0].mlp, width), heads=heads, head_dim=width // heads)


register_family(TimmFamily("vit_", "deit_", "deit3_", "test_vit"))
register_family(TimmFamily("eva02_"))
register_family(TorchvisionFamily())
