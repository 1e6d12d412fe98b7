"""A step's anatomy (``profile=true``): the profiled steps' time per kernel class, named from the kernel's (on a
CPU, the aten op's) name alone, with ``idle`` the span's time in no kernel (launch gaps, host syncs); as ms per
image, share of the step and, for matmul and attention, TFLOP/s against the GPU's dense datasheet peak.

Names only: ``direct_copy_kernel`` is a cast or a layout copy (counted as cast); an eager fp8 scale's amax is a
generic max reduction (counted as pointwise), its ``|x|`` and clamp kernels as quantize. The trace has the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: the classes, in the table's order; ``idle`` last: no kernel, no op
CLASSES = ("matmul", "attention", "norm_pointwise", "quantize_cast", "memcpy", "other", "idle")
#: how the table and the chart name them
CLASS_TEXT = {"matmul": "matmul", "attention": "attention", "norm_pointwise": "norm / pointwise",
              "quantize_cast": "quantize / cast", "memcpy": "memory copy", "other": "other", "idle": "idle gaps"}
#: the classes whose FLOPs the model's count holds (the rest move bytes, which nothing here counts)
FLOP_CLASSES = ("matmul", "attention")
TABLE_FILE, CHART_FILE = "anatomy.txt", "anatomy.png"  # beside the trace, under profile/<task>/

# Substrings of lower-cased names, tried in this order (the first class that matches wins). Attention before
# matmul: xformers' kernels are ``fmha_cutlass*``; memory copy first: cuDNN's layout transposes say ``cudnn``.
# Norm words before quantize: a layer norm kernel may hold a cast. ``aten::`` words match a whole op name.
_RULES = (
    ("memcpy", ("memcpy", "memset", "nchwtonhwc", "nhwctonchw", "aten::copy_", "aten::clone", "aten::contiguous",
                "aten::fill_", "aten::zero_")),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "scudnn", "matmul", "triton_tem_", "f8f8", "convolve",
                "conv2d", "fprop", "dgrad", "wgrad", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                "aten::_scaled_mm", "aten::linear", "aten::convolution", "aten::mkldnn_convolution",
                "aten::convolution_backward")),
    ("norm_pointwise", ("norm", "var_mean")),
    ("quantize_cast", ("float8", "fp8", "e4m3", "e5m2", "quant", "amax", "abs_kernel", "absfunctor", "clamp",
                       "_to_copy", "copy_kernel", "aten::to", "aten::abs")),
    ("norm_pointwise", ("elementwise", "reduce_kernel", "softmax", "gelu", "adam", "multi_tensor", "foreach",
                        "dropout", "nll_loss", "aten::add", "aten::mul", "aten::div", "aten::sub", "aten::sum",
                        "aten::mean", "aten::relu", "aten::silu", "aten::tanh", "aten::exp", "aten::where", "aten::sqrt",
                        "aten::rsqrt", "aten::pow", "aten::neg", "aten::lerp", "aten::addcdiv", "aten::addcmul",
                        "aten::erf", "aten::sigmoid", "aten::maximum", "aten::minimum")),
)
_ATEN = re.compile(r"aten::\w+")
#: inductor's generated pointwise / reduction kernels, named after the aten ops they fuse
#: (``triton_per_fused__to_copy_add_native_layer_norm_2``): never a matmul or attention, whatever ops it names
_TRITON_FUSED = re.compile(r"triton_(?:poi|red|per)_fused_?(.*?)(?:_\d+)*$")
_LAYOUT_OPS = ("_to_copy", "_unsafe_view", "clone", "view", "permute", "transpose", "expand", "copy")
_FP8_OPS = ("amax", "abs", "clamp", "reciprocal", "float8", "fp8")


def _matches(name: str, word: str) -> bool:
    if word.startswith("aten::"):  # aten::to is not aten::topk; aten::add_ is aten::add
        return any(op in (word, word + "_") for op in _ATEN.findall(name))
    return word in name


def _fused_class(ops: str) -> str:
    """The class of an inductor kernel fusing ``ops``: a norm, fp8 scaling, a cast or copy alone, else pointwise."""
    if "norm" in ops or "var_mean" in ops:
        return "norm_pointwise"
    if any(w in ops for w in _FP8_OPS):
        return "quantize_cast"
    rest = ops
    for layout in _LAYOUT_OPS:
        rest = rest.replace(layout, "")
    if rest.strip("_0123456789t"):  # t: aten.t, the transpose inductor names so
        return "norm_pointwise"
    return "quantize_cast" if "_to_copy" in ops else "memcpy"


def kernel_class(name: str) -> str:
    """The class (:data:`CLASSES`, never ``idle``) of a CUDA kernel or CPU op named ``name``."""
    lowered = name.lower()
    fused = _TRITON_FUSED.match(lowered)
    if fused:
        return _fused_class(fused.group(1))
    for cls, words in _RULES:
        if any(_matches(lowered, w) for w in words):
            return cls
    return "other"


def device_times(kernels) -> dict[str, float]:
    """``(name, start_us, end_us)`` of every kernel -> µs per class, ``idle`` the span's µs covered by no kernel
    (kernels on several streams may overlap: counted once there)."""
    out = dict.fromkeys(CLASSES, 0.0)
    spans = sorted((start, end) for _, start, end in kernels)
    for name, start, end in kernels:
        out[kernel_class(name)] += end - start
    covered, reach = 0.0, None
    for start, end in spans:  # the union of the intervals, left to right
        if reach is None or start > reach:
            covered, reach = covered + end - start, end
        elif end > reach:
            covered, reach = covered + end - reach, end
    out["idle"] = (reach - spans[0][0] - covered) if spans else 0.0  # reach: the last kernel's end
    return out


def host_times(ops, span_us: float) -> dict[str, float]:
    """``(name, self_us)`` of every CPU op and their span -> µs per class, ``idle`` the span's time in no op
    (Python, dispatch; never below 0: intra-op threads may add up past the span)."""
    out = dict.fromkeys(CLASSES, 0.0)
    for name, self_us in ops:
        out[kernel_class(name)] += self_us
    out["idle"] = max(0.0, span_us - sum(out.values()))
    return out


def ceilings(precision, hardware) -> dict:
    """The dense datasheet peak (TFLOP/s) each FLOP class runs against: the precision's, but bf16 for attention
    under fp8 (torchao leaves SDPA in bf16); none for a mislabelled run (its label's peak is not its hardware's)."""
    if hardware.mismatch:
        return {}
    peaks = hardware.profile.peak_tflops
    return {"matmul": peaks.get(precision.peak_dtype),
            "attention": peaks.get("bf16" if precision.fp8 else precision.peak_dtype)}


@dataclass(frozen=True)
class Anatomy:
    """Per class µs over ``steps`` profiled steps of ``batch`` images; ``host``: CPU op time, not GPU kernels."""

    times_us: dict
    steps: int
    batch: int
    host: bool
    flops_per_img: dict
    ceiling_tflops: dict

    def ms_per_img(self, cls: str) -> float:
        return self.times_us[cls] / 1e3 / self.steps / self.batch

    def pct(self, cls: str) -> float:
        """Share of the summed time (the step, when no kernels overlap), in %."""
        total = sum(self.times_us.values())
        return 100 * self.times_us[cls] / total if total else 0.0

    def tflops(self, cls: str) -> float | None:
        flops, ms = self.flops_per_img.get(cls), self.ms_per_img(cls)
        return flops / (ms / 1e3) / 1e12 if flops and ms > 0 else None

    def figures(self) -> dict[str, float]:
        """The ``anatomy_<class>_...`` metric rows."""
        out = {}
        for cls in CLASSES:
            out[f"anatomy_{cls}_ms_per_img"] = self.ms_per_img(cls)
            out[f"anatomy_{cls}_pct"] = self.pct(cls)
        for cls in FLOP_CLASSES:
            out[f"anatomy_{cls}_tflops"] = self.tflops(cls)
        return out

    def largest(self, n: int = 2) -> list[str]:
        return sorted(CLASSES, key=lambda c: -self.times_us[c])[:n]

    def table(self, task: str) -> str:
        """anatomy.txt: one row per class; ``unknown`` where no FLOPs or peak are known."""
        what = "host (CPU op self time; no device kernels)" if self.host else "GPU kernel time"
        heads = ["class", "ms/img", "share %", "TFLOP/s", "ceiling TFLOP/s", "of ceiling %"]
        rows = [heads] + [self._row(cls) for cls in CLASSES]
        widths = [max(len(r[i]) for r in rows) for i in range(len(heads))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return (f"{task}: {what} over {self.steps} profiled steps of {self.batch} images; share of the step; "
                f"ceiling: the GPU's dense datasheet peak for the precision\n" + "\n".join(lines) + "\n")

    def _row(self, cls: str) -> list[str]:
        achieved = self.tflops(cls)
        ceiling = self.ceiling_tflops.get(cls)
        if cls not in FLOP_CLASSES:
            flop_cells = ["unknown"] * 3  # bytes moved are not counted, so no bandwidth figure either
        else:
            flop_cells = [format(achieved, ",.4g") if achieved else "unknown",
                          format(ceiling, ",.4g") if ceiling else "unknown",
                          f"{100 * achieved / ceiling:.0f}" if achieved and ceiling else "unknown"]
        return [CLASS_TEXT[cls], f"{self.ms_per_img(cls):.4f}", f"{self.pct(cls):.1f}", *flop_cells]

    def line(self, task: str) -> str:
        """The console's one line: the two largest classes."""
        where = "host time" if self.host else "GPU time"
        top = ", ".join(f"{CLASS_TEXT[c]} {self.pct(c):.0f} % ({self.ms_per_img(c):.4f} ms/img)"
                        for c in self.largest())
        return (f"{task}: step anatomy ({where}): {top}; the table and chart: profile/{task}/{TABLE_FILE}, "
                f"{CHART_FILE}")
