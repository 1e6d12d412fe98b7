"""How a model runs: device, precision, GradScaler, torch.compile, and what a run holds around its steps; shared
by the benchmark runner and the training loop, so both measure the same thing."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from vitreg.errors import VitregError
from vitreg.hardware import precision as precisions
from vitreg.hardware.compile_cache import compile_cache_folder
from vitreg.hardware.profiles import DetectedHardware
from vitreg.hardware.sdpa import attention_shape, check_backend, sdpa_context


@dataclass(frozen=True)
class Runtime:
    device: str  # "cuda" or "cpu" (the device type; DDP picks the index)
    amp: str  # a precision mode, one of vitreg.hardware.precision.PRECISION_CHOICES (auto resolved)
    compile: str  # "off", "default", "reduce-overhead", "max-autotune"
    compile_backend: str = "inductor"
    device_index: int = 0

    @property
    def torch_device(self):
        import torch

        return torch.device(self.device, self.device_index) if self.device == "cuda" else torch.device("cpu")

    @property
    def precision(self) -> precisions.Precision:
        return precisions.precision_of(self.amp)

    @property
    def autocast_dtype(self):
        return precisions.torch_dtype(self.precision.autocast_dtype)

    def autocast(self, cache: bool = True):
        """``cache=False`` for a CUDA graph capture: a cast cached at capture would never be redone on replay."""
        return precisions.autocast(self.precision, self.device, cache)

    def grad_scaler(self):
        """fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 and fp32 do not."""
        import torch

        return torch.amp.GradScaler(self.device, enabled=self.amp == "fp16")

    @property
    def uses_cudagraphs(self) -> bool:
        # inductor's reduce-overhead and max-autotune modes replay CUDA graphs, which need
        # cudagraph_mark_step_begin() between iterations whose outputs are not kept.
        return self.device == "cuda" and self.compile_backend == "inductor" and self.compile in (
            "reduce-overhead", "max-autotune")

    @property
    def eager_fp8(self) -> bool:
        """fp8 without inductor: nothing fuses torchao's quantize steps (:data:`precision.EAGER_FP8_NOTE`)."""
        return self.precision.fp8 and (self.compile == "off" or self.compile_backend != "inductor")

    def mark_step(self) -> None:
        if self.uses_cudagraphs:
            import torch

            torch.compiler.cudagraph_mark_step_begin()

    def compile_model(self, model):
        """torch.compile (lazy: it compiles at the first call, which the runner times apart)."""
        if self.compile == "off":
            return model
        import torch

        kwargs = {"backend": self.compile_backend}
        if self.compile_backend == "inductor" and self.compile != "default":
            kwargs["mode"] = self.compile  # modes are inductor options; other backends take none
        return torch.compile(model, **kwargs)


def resolve_runtime(amp: str, compile: str, compile_backend: str, detected: DetectedHardware,
                    device_index: int = 0) -> Runtime:
    profile = detected.profile
    if amp == "auto":
        amp = profile.default_amp if detected.device == "cuda" else "off"
    if detected.device == "cuda" and amp == "bf16":
        import torch

        if not (profile.supports_bf16 or (not profile.peak_tflops and torch.cuda.is_bf16_supported())):
            raise VitregError(f"amp=bf16 but {detected.name} has no bf16 tensor cores: use amp=fp16 (or amp=auto)")
    capability = _capability(detected, device_index) if detected.device == "cuda" else None
    precisions.resolve_precision(amp, detected.device, capability=capability)
    return Runtime(detected.device, amp, compile, compile_backend, device_index)


def _capability(detected: DetectedHardware, device_index: int) -> tuple[int, int]:
    if detected.profile.compute_capability:
        major, minor = detected.profile.compute_capability.split(".")
        return int(major), int(minor)
    import torch

    return torch.cuda.get_device_capability(device_index)


def compute_dtype(runtime: Runtime):
    import torch

    p = runtime.precision
    return precisions.torch_dtype(p.autocast_dtype or p.weights_dtype) or torch.float32


@contextlib.contextmanager
def run_context(runtime: Runtime, model, sdpa: str = "auto", compile_cache: str = "", train: bool = False):
    """What a run holds around all of its steps, restored on exit: the compile cache folder (yielded; None when not
    compiling), the math mode, the SDPA backend (checked by one real call first) and cuDNN's autotuner."""
    if sdpa != "auto":
        check_backend(sdpa, runtime.torch_device, compute_dtype(runtime), *attention_shape(model), backward=train)
    with contextlib.ExitStack() as stack:
        cache_dir = stack.enter_context(compile_cache_folder(compile_cache)) if runtime.compile != "off" else None
        stack.enter_context(precisions.math_mode(runtime.precision))
        stack.enter_context(sdpa_context(sdpa))
        stack.enter_context(cudnn_autotuner())
        yield cache_dir


@contextlib.contextmanager
def cudnn_autotuner():
    """cuDNN's autotuner on, as timm sets it: one input shape, timed once in the first call. Its heuristic alone
    picked a slow patch-embedding kernel: DeiT-S on an H200, 27,123 -> 29,248 img/s
    (benchmarks/results/h200-2026-12-02/)."""
    import torch

    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved
