"""Where a training step's time goes under DDP, from torch.profiler: run after the timed windows.

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
    with profile(activities=activities) as prof:
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
