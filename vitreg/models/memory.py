"""The least memory a benchmark needs, known before anything is allocated (not an allocation traceback or the OOM
killer): sizes read from the model built on the ``meta`` device give lower bounds for the weights, one input batch
and the activations that must exist at once. A floor, never a guess from above: nothing that could run is refused.
"""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass, fields

from vitreg.errors import VitregError
from vitreg.models import learned_facts
from vitreg.models.families import check_name

GIB = 1024**3
FP32_BYTES = 4
HALF_BYTES = 2  # activations are at least bf16/fp16 wide


@dataclass(frozen=True)
class Footprint:
    params: int
    tokens: int  # sequence length: patches + class/distillation/register tokens
    width: int  # embedding dimension
    depth: int  # transformer blocks
    img_size: int
    hidden: int  # the MLP's width
    heads: int
    fused: int  # 1: attention runs through F.scaled_dot_product_attention (no tokens x tokens matrix needed)

    @property
    def weight_bytes(self) -> int:
        return self.params * FP32_BYTES


#: The largest tensor torch can index: element counts are int64.
TORCH_MAX_ELEMENTS = 2**63 - 1


def checked_size(name: str, img_size: int):
    """``(family, size, patch_size)`` for ``name`` at ``img_size`` (0: its default), refusing what cannot be built."""
    family = check_name(name, listed_before_ok=False)
    size = img_size or family.default_size(name)
    if 3 * size * size > TORCH_MAX_ELEMENTS:
        raise VitregError(f"img_size={size} is past torch's integer range (a 3 x {size} x {size} image has more "
                          f"than 2^63 elements): use a smaller img_size (0 = the model's default)")
    patch = family.patch_size(name)
    if size % patch:
        lower, upper = size // patch * patch, (size // patch + 1) * patch
        options = " or ".join(str(s) for s in (lower, upper) if s >= patch)
        raise VitregError(f"img_size={size} is not a multiple of {name}'s patch size {patch}: use img_size={options}")
    return family, size, patch


@functools.lru_cache(maxsize=64)  # a job asks several times (the model, the batch, the processes)
def footprint(name: str, img_size: int = 0, num_classes: int = 1000) -> Footprint:
    import torch

    family, size, _patch = checked_size(name, img_size)
    try:
        with torch.device("meta"):
            model = family.build(name, size, num_classes)
    except (RuntimeError, OverflowError, ValueError) as exc:  # even a weightless tensor's size must fit 64 bits
        raise VitregError(f"{name} at img_size={size} (num_classes={num_classes}) cannot be built "
                          f"({' '.join(str(exc).split())[:120]}): use a smaller img_size (0 = the model's "
                          f"default) or num_classes") from None
    arch = family.architecture(model)
    fused = all(getattr(m, "fused_attn", True) for m in model.modules())  # timm's switch; torchvision's MHA fuses
    params = sum(p.numel() for p in model.parameters())
    measured = Footprint(params, arch.tokens, arch.width, arch.depth, size, arch.hidden, arch.heads, int(fused))
    _remember(_cache_key(name, img_size, num_classes), measured)
    return measured


def _cache_key(name: str, img_size: int, num_classes: int) -> str:
    return f"footprint:{name}:{img_size}:{num_classes}"


def _remember(key: str, measured: Footprint) -> None:
    if learned_facts.sizes(key) != astuple(measured):
        learned_facts.keep(sizes={key: astuple(measured)})


def check_ranks_fit(nproc: int, name: str, img_size: int, num_classes: int, device_type: str) -> None:
    """:func:`check_nproc_fits` from the footprint an earlier process kept (no timm import), else from the model; a
    refusal is always made from the model itself (an edited cache file never refuses a job)."""
    key = _cache_key(name, img_size, num_classes)
    kept = learned_facts.sizes(key)
    if kept is not None and len(kept) == len(fields(Footprint)):
        try:
            return check_nproc_fits(nproc, Footprint(*kept), device_type)
        except VitregError:
            pass
    measured = footprint(name, img_size, num_classes)
    _remember(key, measured)  # footprint() may answer from memory
    check_nproc_fits(nproc, measured, device_type)


def minimum_bytes(fp: Footprint, batch_size: int, train: bool, sdpa: str = "auto") -> int:
    """The floor of one step: weights (+ gradients and AdamW's moments to train), the fp32 input batch, and the
    activations alive together: to infer one block's (the residual beside q, k, v or the MLP's hidden layer), to
    train every block's linear and attention inputs (6 widths and one hidden per token). Unfused attention (or
    ``sdpa=math``) adds heads x tokens x tokens scores per image."""
    weights = fp.weight_bytes * (4 if train else 1)
    inputs = batch_size * 3 * fp.img_size**2 * FP32_BYTES
    per_token = 6 * fp.width + fp.hidden if train else max(4 * fp.width, fp.width + fp.hidden)
    activation = batch_size * fp.tokens * per_token * HALF_BYTES
    if not fp.fused or sdpa == "math":
        activation += batch_size * fp.heads * fp.tokens**2 * HALF_BYTES
    return weights + inputs + activation * (fp.depth if train else 1)


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def check_host_fits(fp: Footprint, what: str) -> None:
    available = _host_available()
    if fp.weight_bytes > available:
        raise VitregError(f"{what} has {fp.params / 1e6:,.0f} M parameters ({_gib(fp.weight_bytes)} of weights), more "
                          f"than this host's {_gib(available)} of free memory: use a smaller img_size (0 = the "
                          f"model's default)")


def check_step_fits(fp: Footprint, batch_size: int, train: bool, available: int, where: str,
                    sdpa: str = "auto") -> None:
    need = minimum_bytes(fp, batch_size, train, sdpa)
    if need <= available:
        return
    fits = batch_size
    while fits > 1 and minimum_bytes(fp, fits, train, sdpa) > available:
        fits //= 2
    hint = f"batch_size={fits} or less" if minimum_bytes(fp, fits, train, sdpa) <= available else "a smaller img_size"
    raise VitregError(f"{'train' if train else 'infer'} at batch_size={batch_size}, img_size={fp.img_size} needs at "
                      f"least {_gib(need)} but {where} has {_gib(available)} free: use {hint}")


#: Host memory a process holds of its own once torch and timm are imported, before any model: the
#: unique set size (USS; shared libraries count once for all processes) of `python -c "import torch,
#: timm"` measured with psutil on the CI host was 399 MiB; the floor stays below it.
PROCESS_BASELINE_BYTES = 300 * 1024**2


def check_batch_fits(model, batch_size: int, tasks, device_type: str, device_index: int = 0,
                     available: int | None = None, sdpa: str = "auto") -> None:
    """Refuse a batch whose step cannot fit its device. ``model``: a Footprint, a ModelInfo or a name."""
    fp = _footprint_of(model)
    where = f"GPU {device_index}" if device_type == "cuda" else "this host"
    if available is None and device_type == "cuda":
        import torch

        available = torch.cuda.mem_get_info(device_index)[0]
    available = _host_available() if available is None else available
    for task in tasks:
        check_step_fits(fp, batch_size, task == "train", int(available), where, sdpa)


def check_nproc_fits(nproc: int, model, device_type: str, available: int | None = None) -> None:
    """Refuse ``nproc`` processes whose floor of host memory (a baseline, the weights, on the CPU a step) exceeds
    what is free: past it, the OOM killer takes the launcher and leaves orphans."""
    fp = _footprint_of(model)
    available = _host_available() if available is None else available
    per_process = PROCESS_BASELINE_BYTES + fp.weight_bytes
    if device_type == "cpu":
        per_process += minimum_bytes(fp, 1, train=True) - fp.weight_bytes  # a step of batch 1, at least
    if nproc * per_process <= available:
        return
    fits = available // per_process
    fix = f"use nproc={fits} or less" if fits else "use a smaller model or img_size"
    held = "torch, the model's weights" + (" and a step" if device_type == "cpu" else "")
    raise VitregError(f"nproc={nproc} processes need at least {_gib(nproc * per_process)} of host memory "
                      f"({_gib(per_process)} each: {held}) but this host has {_gib(available)} free: {fix}")


def _footprint_of(model) -> Footprint:
    if isinstance(model, Footprint):
        return model
    if isinstance(model, str):
        return footprint(model)
    return footprint(model.name, model.img_size, model.num_classes)


def _host_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)

