"""Where a step's time goes, from torch.profiler: run after the timed windows, never inside them.

:func:`trace_steps` (``profile=true``) records a few steady-state steps and writes a Chrome trace
(open it in Perfetto or chrome://tracing) and a table of the 20 ops with the most self time, for
the job to log as artifacts, and the same steps' time per kernel class (:mod:`vitreg.measure.anatomy`)
for the runner to make the step's anatomy of.

:func:`profile_comm` runs ``steps`` more training steps under the profiler and returns, per step,
the time spent in gradient all-reduce and, on a GPU, the time the GPU spent in kernels at all.
On CUDA both are kernel times on the device (NCCL kernels are those whose name holds ``nccl``;
the CPU ops that launched the kernels are not counted again). An NCCL kernel runs from the moment
both ranks' kernels start until the data is through, so a long all-reduce next to a small
gradient means the ranks wait for each other (a straggler or a host-bound step), not a slow link.
On CPU (gloo) the all-reduce figure is the CPU time of gloo's all_reduce operations, and there is
no device figure. Never part of the timed windows: the profiler slows the steps it records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vitreg.console import quiet_profiler
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
    """Run ``step()`` ``steps`` times under torch.profiler; see the module docstring."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with quiet_profiler(), profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
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
    """Run ``warmup`` untraced steps, then ``steps`` under torch.profiler; write both files to ``out_dir``.

    The warm-up step keeps one-off work (allocator growth, lazy initialisation, a recompile) out of
    the trace, so it shows the steady state that the timed windows measured.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with quiet_profiler(), profile(activities=activities, record_shapes=False) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    files = TraceFiles(out / TRACE_FILE, out / OPS_TABLE_FILE, steps, _class_us(prof.events(), cuda), not cuda)
    prof.export_chrome_trace(str(files.trace))
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    files.ops_table.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS) + "\n")
    return files


def _class_us(events, cuda: bool) -> dict:
    """The profiled steps' µs per kernel class: the device's kernels, memcpys and memsets on a GPU (not the
    ranges record_function draws on the device's timeline over them, e.g. inductor's ``CompiledFunction``: torch's
    own tables leave them out too); on a CPU each op's self time, and the span from the first op's start to the last
    op's end."""
    from torch.autograd import DeviceType

    if cuda:
        return device_times([(e.name, e.time_range.start, e.time_range.end) for e in events
                             if e.device_type == DeviceType.CUDA and not e.is_user_annotation])
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    tops = [e for e in ops if e.cpu_parent is None]
    span = max(e.time_range.end for e in tops) - min(e.time_range.start for e in tops) if tops else 0.0
    return host_times([(e.name, e.self_cpu_time_total) for e in ops], span)
