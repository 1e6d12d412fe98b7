"""What one process of a bench, infer or train job runs with, built once (:func:`job_context`): the DDP world,
the hardware with its label checked, the runtime for this rank's device, and rank 0 alone speaking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vitreg.console import quiet
from vitreg.ddp import world as distributed
from vitreg.hardware.profiles import detect_hardware, resolve_hardware
from vitreg.hardware.runtime import resolve_runtime


@dataclass(frozen=True)
class JobContext:
    spec: object  # BenchSpec or TrainSpec
    detected: object  # vitreg.hardware.profiles.DetectedHardware: what is there
    hardware: object  # ResolvedHardware: the label the run is filed under, the profile for MFU
    runtime: object  # vitreg.hardware.runtime.Runtime: device, amp, compile
    world: distributed.World
    run: object  # the tracker of this process (a HandoffTracker or NullTracker on a rank)
    progress: Callable
    wrap: Callable | None = None  # DDP with more than one rank: wraps a model in DistributedDataParallel
    reducer: object = None  # DDP with more than one rank: the job's reducer (ResultReducer / TrainReducer)


def job_context(run, spec, progress, reducer_factory=None, cuda_graph: bool = False) -> JobContext:
    """``reducer_factory(world)``: the DDP job's reducer (None: a job of one process, which joins no world)."""
    world, wrap, reducer = distributed.World(), None, None
    if reducer_factory is not None:
        world, wrap, reducer = distributed.join_job(spec, reducer_factory, cuda_graph=cuda_graph)
    if not world.is_main:
        progress = quiet  # rank 0 speaks for the job; errors still reach every rank's stderr
    detected = detect_hardware(spec.device)
    hardware = resolve_hardware(spec.gpu, detected, spec.allow_gpu_mismatch)
    runtime = resolve_runtime(spec.amp, spec.compile, spec.compile_backend, detected,
                              device_index=world.local_rank if detected.device == "cuda" else 0)
    return JobContext(spec, detected, hardware, runtime, world, run, progress, wrap, reducer)
