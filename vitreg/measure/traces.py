"""Where a step's time goes, from torch.profiler, after the timed windows (the profiler slows what it records):
``profile=true``'s Chrome trace, top-ops table and time per kernel class (:func:`trace_steps`), and
``profile_steps``' all-reduce and device-busy time per step (:func:`profile_comm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vitreg.console import profiled
from vitreg.measure.anatomy import device_times, host_times
from vitreg.errors import VitregError

TRACE_FILE = "trace.json.gz"  # torch gzips a Chrome trace whose name ends in .gz: ViT-B's is ~10x smaller
OPS_TABLE_FILE = "top_ops.txt"
TOP_OPS = 20


@dataclass(frozen=True)
class CommProfile:
    steps: int
    allreduce_ms_per_step: float
    device_busy_ms_per_step: float | None  # None on CPU


def profile_comm(step, steps: int, device: str) -> CommProfile:
    """Per step: all-reduce time and, on a GPU, kernel-busy time. On CUDA both are device kernel times (NCCL's
    kernels hold ``nccl``): an NCCL kernel runs from both ranks' start until the data is through, so a long
    all-reduce beside a small gradient means a straggler, not a slow link. On CPU, gloo's all_reduce CPU time."""
    from torch.autograd import DeviceType

    cuda = device == "cuda"
    events = profiled(step, steps, cuda).key_averages()
    if cuda:
        def device_us(e) -> float:
            return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)

        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        allreduce_us = sum(device_us(e) for e in kernels if "nccl" in e.key.lower())
        busy = sum(device_us(e) for e in kernels) / 1e3 / steps
    else:
        allreduce_us = sum(float(e.cpu_time_total) for e in events
                           if "all_reduce" in e.key.lower() and "gloo" in e.key.lower())
        busy = None
    return CommProfile(steps=steps, allreduce_ms_per_step=allreduce_us / 1e3 / steps, device_busy_ms_per_step=busy)


@dataclass(frozen=True)
class TraceFiles:
    trace: Path  # Chrome trace
    ops_table: Path  # key_averages().table, top ops by self time on the device (CPU time on a CPU)
    steps: int
    class_us: dict  # µs per kernel class over the steps (vitreg.measure.anatomy.CLASSES), idle gaps included
    host: bool  # True: no device kernels, the classes hold CPU op self time


def check_profile_request(profile: bool, cuda_graph: bool) -> None:
    """Refuse ``profile=true`` with ``cuda_graph=true``: a replayed graph is one opaque launch to the profiler."""
    if profile and cuda_graph:
        raise VitregError("profile=true cannot see inside a CUDA graph replay (one launch, no ops): "
                          "use cuda_graph=false to profile, or profile=false")


def trace_steps(step, steps: int, device: str, out_dir, warmup: int = 1) -> TraceFiles:
    """``warmup`` untraced steps (one-off work: allocator growth, a recompile), then ``steps`` under torch.profiler:
    the trace and the top-ops table in ``out_dir``, for Perfetto, and the time per kernel class."""
    cuda = device == "cuda"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(warmup):
        step()
    prof = profiled(step, steps, cuda)
    files = TraceFiles(out / TRACE_FILE, out / OPS_TABLE_FILE, steps, _class_us(prof.events(), cuda), not cuda)
    prof.export_chrome_trace(str(files.trace))
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    files.ops_table.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS) + "\n")
    return files


def _class_us(events, cuda: bool) -> dict:
    """The profiled steps' µs per kernel class: on a GPU its kernels, memcpys and memsets (not the ranges
    record_function draws over them, e.g. inductor's ``CompiledFunction``), on a CPU each op's self time."""
    from torch.autograd import DeviceType

    if cuda:
        return device_times([(e.name, e.time_range.start, e.time_range.end) for e in events
                             if e.device_type == DeviceType.CUDA and not e.is_user_annotation])
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    tops = [e for e in ops if e.cpu_parent is None]
    span = max(e.time_range.end for e in tops) - min(e.time_range.start for e in tops) if tops else 0.0
    return host_times([(e.name, e.self_cpu_time_total) for e in ops], span)
