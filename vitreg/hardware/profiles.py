"""GPU profiles: short labels, dense datasheet peaks, detection and the label check.

A run's ``gpu`` label is what people group by, so a wrong one poisons every comparison: :func:`resolve_hardware`
refuses a label the detected hardware does not match (unless ``allow_gpu_mismatch``). Peaks are *dense*
tensor-core TFLOP/s (no 2:4 sparsity) per dtype; a profile without one for the active dtype reports no MFU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vitreg.errors import VitregError


@dataclass(frozen=True)
class GpuProfile:
    label: str
    name: str  # human name, e.g. "NVIDIA A100 40GB (SXM)"
    peak_tflops: dict = field(default_factory=dict)  # dtype -> dense TFLOP/s
    compute_capability: str | None = None
    patterns: tuple = ()  # regexes over the NVML / torch device name, most specific first
    ray_type: str | None = None  # the accelerator type a Ray node with this GPU reports (None: LABEL.upper())

    @property
    def supports_bf16(self) -> bool:
        return "bf16" in self.peak_tflops

    @property
    def default_amp(self) -> str:
        if self.label == "cpu":
            return "off"
        return "bf16" if self.supports_bf16 else "fp16"


# Adding a GPU is one entry here (the help, README and MLproject list the labels from it). Peaks: NVIDIA's
# datasheets and the Ada whitepaper (fp16/bf16 with fp32 accumulate, as PyTorch uses). Ray's types are what its
# NVIDIA accelerator manager makes of the device name (tests/test_hardware.py holds each entry to Ray's function).
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
_H100_SXM = {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}  # and the H200's
PROFILES: dict[str, GpuProfile] = {
    p.label: p
    for p in [
        GpuProfile("v100", "NVIDIA V100 (SXM2)", {"fp16": 125.0, "fp32": 15.7}, "7.0", (r"v100",), ray_type="V100"),
        GpuProfile("t4", "NVIDIA T4", {"fp16": 65.0, "fp32": 8.1}, "7.5", (r"\bt4\b",), ray_type="T4"),
        GpuProfile("a100", "NVIDIA A100 40GB", _A100, "8.0", (r"a100(?!.*80)",), ray_type="A100"),
        GpuProfile("a100-80gb", "NVIDIA A100 80GB", _A100, "8.0", (r"a100.*80",), ray_type="A100"),
        GpuProfile("l4", "NVIDIA L4", {"fp8": 242.8, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
                   "8.9", (r"\bl4\b",), ray_type="L4"),
        GpuProfile("rtx4090", "NVIDIA GeForce RTX 4090", {
                       "fp8": 330.3, "bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
                   "8.9", (r"rtx\s*4090",), ray_type="GeForce-RTX-4090"),
        GpuProfile("h100-pcie", "NVIDIA H100 PCIe", {
                       "fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
                   "9.0", (r"h100.*pcie",), ray_type="H100"),
        GpuProfile("h100", "NVIDIA H100 SXM", _H100_SXM, "9.0", (r"h100",), ray_type="H100"),
        GpuProfile("h200", "NVIDIA H200 SXM", _H100_SXM, "9.0", (r"h200",), ray_type="H200"),
        GpuProfile("cpu", "CPU", {}, None, ()),
    ]
}


def label_list(code: bool = False) -> str:
    return ", ".join(f"`{label}`" if code else label for label in PROFILES)


#: A sweep's Ray task for gpu=LABEL asks for accelerator_type=TYPE. Two labels may share one (a100, a100-80gb:
#: A100): Ray places the task on any node of that type and the child's label check refuses a card it is not.
RAY_ACCELERATOR_TYPES = {p.label: p.ray_type for p in PROFILES.values() if p.ray_type}


def label_of_ray_type(accelerator_type: str) -> str:
    """The GPU label of a Ray accelerator type: its one label (``GeForce-RTX-4090`` -> ``rtx4090``), else the type
    lower-cased (``H100``, shared by two labels; ``L40S``, unknown)."""
    labels = [label for label, ray in RAY_ACCELERATOR_TYPES.items() if ray == accelerator_type]
    lowered = accelerator_type.lower()
    return lowered if lowered in labels or not labels else labels[0]


# SLURM's GPU types (gres.conf's common spellings) where they are not the label: a job asks for gpu:TYPE:N.
SLURM_GPU_TYPES = {"a100-80gb": "a100_80gb", "h100-pcie": "h100_pcie"}


# Labels people type that mean one of ours.
ALIASES = {"a100-40gb": "a100", "h100-sxm": "h100", "4090": "rtx4090", "v100-32gb": "v100", "v100-16gb": "v100"}


@dataclass(frozen=True)
class DetectedHardware:
    device: str  # "cuda" or "cpu"
    name: str
    count: int
    profile: GpuProfile


def match_profile(device_name: str) -> GpuProfile:
    """The profile of a CUDA device name; an unknown GPU gets one of its own with no peaks."""
    lowered = device_name.lower()
    for profile in PROFILES.values():
        if any(re.search(p, lowered) for p in profile.patterns):
            return profile
    slug = re.sub(r"[^a-z0-9]+", "-", lowered.replace("nvidia", "")).strip("-") or "unknown-gpu"
    return GpuProfile(slug, device_name, {}, None, ())


def detect_hardware(device: str = "auto") -> DetectedHardware:
    """CUDA device 0 where there is one, else the CPU; nothing allocated."""
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return DetectedHardware("cuda", name, torch.cuda.device_count(), match_profile(name))
    if device == "cuda":
        raise VitregError("device=cuda but no CUDA GPU is visible (torch.cuda.is_available() is False): "
                          "use device=auto or device=cpu, or check the driver / CUDA_VISIBLE_DEVICES")
    from vitreg.environment import cpu_model

    return DetectedHardware("cpu", f"CPU ({cpu_model()})", 1, PROFILES["cpu"])


def normalize_label(label: str) -> str:
    text = label.strip().lower()
    return ALIASES.get(text, text)


def check_label_here(requested: str, device: str, allow_mismatch: bool) -> None:
    """Refuse, before torch is imported, a ``gpu`` label of none of this host's GPUs as NVML names them (nor
    ``cpu`` where the device may be the CPU); where NVML cannot say, :func:`resolve_hardware` decides."""
    label = normalize_label(requested)
    if label == "auto" or allow_mismatch:
        return
    names = () if device == "cpu" else _host_gpu_names()
    if names is None or (device == "cuda" and not names):
        return  # NVML cannot say; or no GPU for device=cuda, which the job's detection says in its own words
    possible = [match_profile(name).label for name in names] + (["cpu"] if device != "cuda" else [])
    if label in possible:
        return
    import difflib

    close = difflib.get_close_matches(label, list(PROFILES), n=1, cutoff=0.6)
    what = "" if label in PROFILES else f" ({label!r} is not a known label{f'; did you mean {close[0]}?' if close else ''})"
    raise VitregError(f"gpu={requested} is not this host's hardware ({', '.join(dict.fromkeys(possible))}){what}: use "
                      f"gpu={possible[0]} or gpu=auto (or allow_gpu_mismatch=true to file it as {label} anyway)")


def _host_gpu_names() -> tuple[str, ...] | None:
    """Every NVIDIA GPU of this host, whatever CUDA_VISIBLE_DEVICES hides; () without a driver; None: NVML
    cannot say."""
    from vitreg.environment import nvml_ask, nvml_text

    return nvml_ask(lambda nvml: tuple(nvml_text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                                       for i in range(nvml.nvmlDeviceGetCount())), no_driver=())


@dataclass(frozen=True)
class ResolvedHardware:
    label: str
    profile: GpuProfile
    detected: DetectedHardware
    mismatch: bool


def resolve_hardware(requested: str, detected: DetectedHardware, allow_mismatch: bool = False) -> ResolvedHardware:
    """The requested label checked against the detected hardware; with ``allow_mismatch`` another label files
    the run (MFU against its peaks), tagged ``gpu_mismatch=true``."""
    label = normalize_label(requested)
    if label == "auto":
        return ResolvedHardware(detected.profile.label, detected.profile, detected, False)
    if label == detected.profile.label:
        return ResolvedHardware(label, detected.profile, detected, False)
    if not allow_mismatch:
        what = "" if label in PROFILES else f" ({label!r} is not a known label; known: {', '.join(PROFILES)})"
        raise VitregError(
            f"gpu={requested} does not match the detected hardware {detected.name!r}{what}: "
            f"use gpu={detected.profile.label} or gpu=auto (or allow_gpu_mismatch=true to file it as {label} anyway)"
        )
    profile = PROFILES.get(label, GpuProfile(label, label, {}, None, ()))
    return ResolvedHardware(label, profile, detected, True)
