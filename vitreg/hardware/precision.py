"""Precision modes: which number format the weights, the activations and the matrix units use.

:func:`resolve_precision` turns ``amp`` into a :class:`Precision`, refusing what the hardware or the task cannot
do; the runner applies it with :func:`prepare_model`, :func:`math_mode` and :func:`autocast`. The weight modes and
fp8 are inference only: without an fp32 master copy an optimizer step rounds updates away. ``fp8`` is the recipe
measured fastest (one scale per tensor: 12,160 img/s against 11,641 per row, ViT-B/16 on an H200, issue 23).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from vitreg.errors import VitregError

AUTOCAST_MODES = ("bf16", "fp16")
WEIGHT_MODES = ("bf16-weights", "fp16-weights")
#: amp=fp8 -> the recipe measured fastest (module docstring); the others by name
FP8_RECIPES = {"fp8": "tensorwise", "fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}
PRECISION_CHOICES = ("off", "tf32", *AUTOCAST_MODES, *WEIGHT_MODES, *FP8_RECIPES)
INFERENCE_ONLY = (*WEIGHT_MODES, *FP8_RECIPES)
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores; Ampere does not
#: What an fp8 run without inductor is told, in one line, before its work (issue 37: measured on an H200 from
#: main f219d67, bf16 eager beside it in the same call). torchao's per-Linear amax, scale and cast run as
#: separate eager kernels; inductor fuses them into the kernels around the matmul.
EAGER_FP8_NOTE = ("eager fp8 (amp=fp8 without compile) runs at about half of bf16's speed on an H200 (ViT-B/16 bs256: "
                  "4,866 vs 8,740 img/s): torchao's scale and cast steps run as separate kernels around every Linear; "
                  "--compile default fuses them (compiled fp8 is faster than bf16). Tagged infer_eager_fp8=true")


@dataclass(frozen=True)
class Precision:
    amp: str  # the option value, one of PRECISION_CHOICES
    label: str  # what ran, for the ``precision`` tag and report.md
    autocast_dtype: str | None  # "bf16"/"fp16" under autocast, else None
    weights_dtype: str | None  # "bf16"/"fp16" when the weights (and inputs) are cast, else None
    tf32: bool  # TF32 matmuls/convolutions switched on for the run
    fp8: bool
    peak_dtype: str  # the key of GpuProfile.peak_tflops that MFU is measured against

    @property
    def inference_only(self) -> bool:
        return self.amp in INFERENCE_ONLY

    def mfu(self, achieved_tflops: float, profile) -> float | None:
        """Achieved over the profile's dense peak for this mode; None where it has none."""
        peak = profile.peak_tflops.get(self.peak_dtype)
        return achieved_tflops / peak if peak else None


def precision_of(amp: str) -> Precision:
    """The mode ``amp`` names, unchecked (:func:`resolve_precision` checks it against the hardware)."""
    if amp in AUTOCAST_MODES:
        return Precision(amp, f"autocast-{amp}", amp, None, False, False, amp)
    if amp in WEIGHT_MODES:
        dtype = amp.split("-")[0]
        return Precision(amp, amp, None, dtype, False, False, dtype)
    if amp in FP8_RECIPES:
        return Precision(amp, f"fp8-torchao-{FP8_RECIPES[amp]}", None, "bf16", False, True, "fp8")
    if amp == "tf32":
        return Precision(amp, "tf32", None, None, True, False, "tf32")
    return Precision("off", "fp32", None, None, False, False, "fp32")


def resolve_precision(amp: str, device: str, tasks: tuple[str, ...] = ("infer",),
                      capability: tuple[int, int] | None = None) -> Precision:
    if amp not in PRECISION_CHOICES:
        raise VitregError(f"amp={amp} is not a precision mode: use one of {', '.join(PRECISION_CHOICES)}")
    check_tasks(amp, tasks)
    below_ampere = device == "cuda" and capability is not None and tuple(capability) < (8, 0)
    if amp == "tf32" and device != "cuda":
        raise VitregError("amp=tf32 needs an NVIDIA GPU (TF32 is a tensor-core format): use amp=off on CPU")
    if amp == "tf32" and below_ampere:
        raise VitregError(f"amp=tf32 needs compute capability >= 8.0 (Ampere), this GPU has "
                          f"{capability[0]}.{capability[1]}: use amp=fp16 or amp=off")
    if amp == "bf16-weights" and below_ampere:
        raise VitregError(f"amp=bf16-weights needs bf16 tensor cores (compute capability >= 8.0), this GPU has "
                          f"{capability[0]}.{capability[1]}: use amp=fp16-weights")
    if amp in FP8_RECIPES and (device != "cuda" or capability is None or tuple(capability) < FP8_MIN_CAPABILITY):
        have = "CPU" if device != "cuda" else f"compute capability {'.'.join(map(str, capability or ('?',)))}"
        raise VitregError(f"amp=fp8 needs FP8 tensor cores (compute capability >= 8.9: L4, RTX 4090, H100, H200), "
                          f"here {have}: use amp=bf16-weights or amp=bf16")
    if amp in FP8_RECIPES:
        try:
            import torchao.quantization  # noqa: F401  (the optional extra)
        except ImportError:
            raise VitregError("amp=fp8 needs torchao (the optional fp8 extra): pip install torchao, "
                              "or use amp=bf16-weights") from None
    return precision_of(amp)


def check_tasks(amp: str, tasks: tuple[str, ...]) -> None:
    if amp in INFERENCE_ONLY and "train" in tasks:
        raise VitregError(f"amp={amp} is inference only (no fp32 master weights to train): "
                          f"use task=infer, or amp=bf16 (autocast) to train")


def torch_dtype(name: str | None):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)


def prepare_model(model, precision: Precision):
    """Weights cast or quantized in place, after the FLOPs are counted and before torch.compile; inputs must then
    be made in :func:`input_dtype`."""
    if precision.weights_dtype:
        model = model.to(torch_dtype(precision.weights_dtype))
    if precision.fp8:
        quantize_fp8(model, FP8_RECIPES[precision.amp])
    return model


def quantize_fp8(model, recipe: str) -> None:
    """torchao float8 dynamic activation + weight quantization of the Linear layers, in place: the matmul quantizes
    its activation (one scale per tensor or row) at run time and calls the FP8 GEMM."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    granularity = PerTensor() if recipe == "tensorwise" else PerRow()
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=granularity))


@dataclass(frozen=True)
class Fp8Agreement:
    top1_agreement: float  # share of the images whose argmax class is the same
    max_abs_logit_diff: float


def fp8_agreement(model, quantized_model, img_size: int, device, batch: int = 64, seed: int = 0) -> Fp8Agreement:
    """FP8 against bf16 logits on one seeded random batch: what the speed costs in accuracy."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, 3, img_size, img_size, generator=gen).to(device, torch.bfloat16)
    with torch.inference_mode():
        ref, got = model.eval()(x).float(), quantized_model.eval()(x).float()
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    return Fp8Agreement(agree, (ref - got).abs().max().item())


def input_dtype(precision: Precision):
    import torch

    return torch_dtype(precision.weights_dtype) or torch.float32


@contextlib.contextmanager
def math_mode(precision: Precision):
    """TF32 on for a ``tf32`` run, strict fp32 matmuls otherwise (also where a caller set TF32 globally, as timm's
    benchmark.py does). A setting already right is not touched: inductor's CPU codegen sees an explicit ``highest``."""
    import torch

    wanted = "high" if precision.tf32 else "highest"
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    # Only these two switches are touched: torch 2.9+ refuses to report the matmul precision once
    # the legacy cuda.matmul.allow_tf32 flag and the global setting disagree.
    if saved[0] != wanted:
        torch.set_float32_matmul_precision(wanted)
    if precision.tf32:
        torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        if saved[0] != wanted:
            torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def autocast(precision: Precision, device: str, cache: bool = True):
    import torch

    if not precision.autocast_dtype:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=torch_dtype(precision.autocast_dtype), cache_enabled=cache)
