"""How a model runs: device, autocast dtype, GradScaler, torch.compile.

Shared by the benchmark runner and the training loop, so both measure the same thing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from vitreg.errors import VitregError
from vitreg.hardware.profiles import DetectedHardware


@dataclass(frozen=True)
class Runtime:
    """The resolved execution settings of a run (no ``auto`` left in them)."""

    device: str  # "cuda" or "cpu" (the device type; DDP picks the index)
    amp: str  # "off", "bf16" or "fp16"
    compile: str  # "off", "default", "reduce-overhead", "max-autotune"
    compile_backend: str = "inductor"
    device_index: int = 0

    @property
    def torch_device(self):
        import torch

        return torch.device(self.device, self.device_index) if self.device == "cuda" else torch.device("cpu")

    @property
    def autocast_dtype(self):
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.amp)

    def autocast(self, cache: bool = True):
        """Autocast context for the active precision (a no-op context when amp is off).

        ``cache=False`` turns off autocast's cache of casted weights, which a CUDA graph capture
        needs (a cast cached at capture would never be redone on replay).
        """
        import torch

        if self.amp == "off":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=self.autocast_dtype, cache_enabled=cache)

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

    def mark_step(self) -> None:
        if self.uses_cudagraphs:
            import torch

            torch.compiler.cudagraph_mark_step_begin()

    def compile_model(self, model):
        """Wrap with torch.compile (lazy: compilation happens at the first call, which the runner times apart)."""
        if self.compile == "off":
            return model
        import torch

        kwargs = {"backend": self.compile_backend}
        if self.compile_backend == "inductor" and self.compile != "default":
            kwargs["mode"] = self.compile  # modes are inductor options; other backends take none
        return torch.compile(model, **kwargs)


def resolve_runtime(amp: str, compile: str, compile_backend: str, detected: DetectedHardware,
                    device_index: int = 0) -> Runtime:
    """Turn ``amp=auto`` into a dtype the hardware has, and refuse one it lacks."""
    profile = detected.profile
    if amp == "auto":
        amp = profile.default_amp if detected.device == "cuda" else "off"
    if detected.device == "cuda" and amp == "bf16":
        import torch

        if not (profile.supports_bf16 or (not profile.peak_tflops and torch.cuda.is_bf16_supported())):
            raise VitregError(f"amp=bf16 but {detected.name} has no bf16 tensor cores: use amp=fp16 (or amp=auto)")
    return Runtime(detected.device, amp, compile, compile_backend, device_index)
