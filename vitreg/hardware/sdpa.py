"""Which scaled-dot-product-attention kernel runs: chosen by ``sdpa=``, checked by a real call, read back.

``sdpa=auto`` leaves the choice to torch; another value allows that backend alone (``sdpa_kernel``, held around
every step: inductor resolves it when it traces). :func:`check_backend` runs one tiny call of the run's shape and
refuses with torch's own reason (a table of GPU generations would go stale); :func:`detect_backend` names the
backend that ran, from the profiler.
"""

from __future__ import annotations

import contextlib
import warnings

from vitreg.console import profiled
from vitreg.errors import VitregError

SDPA_CHOICES = ("auto", "flash", "cudnn", "efficient", "math")

# Substrings of profiler event names per backend: the aten op, and the CUDA kernels for a launch with no op recorded.
BACKEND_MARKERS = {
    "flash": ("_scaled_dot_product_flash_attention", "flash_fwd", "flash_bwd", "pytorch_flash"),
    "efficient": ("_scaled_dot_product_efficient_attention", "_efficient_attention", "fmha_cutlass"),
    "cudnn": ("_scaled_dot_product_cudnn_attention", "_cudnn_attention", "cudnn_generated_fort_native_sdpa"),
    "math": ("_scaled_dot_product_attention_math",),
}
NO_SDPA = "unfused"  # no fused SDPA op ran: attention as separate matmuls and softmax (model code, or
# inductor decomposing the math backend)


def sdpa_context(choice: str):
    if choice not in SDPA_CHOICES:
        raise VitregError(f"sdpa={choice} is not a backend: use one of {', '.join(SDPA_CHOICES)}")
    if choice == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([backends[choice]])


def attention_shape(model) -> tuple[int, int, int]:
    from vitreg.models.families import architecture_of

    try:
        arch = architecture_of(model)
    except VitregError as exc:
        raise VitregError(f"sdpa= needs a model whose attention vitreg can read ({exc}): use sdpa=auto for "
                          f"this model") from None
    return arch.heads, arch.head_dim, arch.tokens


def check_backend(choice: str, device: str, dtype, num_heads: int, head_dim: int, seq_len: int,
                  backward: bool = False) -> None:
    """One SDPA call of this shape under ``choice`` (and its backward, for training); one line if torch cannot."""
    if choice == "auto":
        return
    import torch
    import torch.nn.functional as F

    shape = (1, num_heads, seq_len, head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=backward)
    with warnings.catch_warnings(record=True) as caught, sdpa_context(choice):
        warnings.simplefilter("always")
        try:
            out = F.scaled_dot_product_attention(q, q, q)
            if backward:
                out.sum().backward()
        except RuntimeError:
            raise VitregError(f"sdpa={choice} cannot run on {device} for {str(dtype).replace('torch.', '')} "
                              f"attention of {num_heads} heads x {head_dim} dims ({_reasons(caught)}): "
                              f"use sdpa=auto (or another backend)") from None


def _reasons(caught) -> str:
    reasons = []
    for warning in caught:
        text = " ".join(str(warning.message).split("(Triggered internally")[0].split())
        if text and text not in reasons:
            reasons.append(text)
    joined = " ".join(reasons) or "torch has no such kernel for this device"
    return joined if len(joined) <= 240 else joined[:237] + "..."


def backends_in(event_names) -> str:
    """The backend(s) the profiler event names show: ``flash``, ``math+flash`` or ``unfused``."""
    names = [n.lower() for n in event_names]
    found = sorted(b for b, markers in BACKEND_MARKERS.items()
                   if any(m.lower() in n for n in names for m in markers))
    return "+".join(found) or NO_SDPA


UNKNOWN = "unknown"  # the step replays inductor's CUDA graphs: no op is recorded, so nothing can be told


def detect_backend(step, device: str, replays_graphs: bool = False) -> str:
    """:func:`backends_in` of one ``step()`` under torch.profiler, outside the timed windows. ``replays_graphs``:
    inductor's CUDA graphs hide the ops, so finding none means :data:`UNKNOWN`."""
    found = backends_in(e.name for e in profiled(step, 1, device == "cuda").events())
    return UNKNOWN if found == NO_SDPA and replays_graphs else found
