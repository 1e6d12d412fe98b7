"""The benchmark itself: inference and training-step throughput, timed honestly.

For each task: with ``batch_size=auto``, search the batch first (:mod:`vitreg.measure.autobatch`);
build synthetic inputs on the device (outside any timed region), call once and time that call apart
(it carries torch.compile's compilation and CUDA's lazy initialisation), run the remaining warm-up,
then ``repeats`` windows of ``steps`` iterations each, timed per iteration with CUDA events
(:mod:`vitreg.measure.timing`). Nothing is logged, printed per iteration, or synchronised inside a
window. After the windows, outside any timing: the SDPA backend that ran is read from the profiler,
and with ``profile=true`` a trace is written. The whole run holds the precision's math mode and the
SDPA backend (:func:`vitreg.hardware.runtime.run_context`). Results are typed values, and say what
ran (:meth:`BenchResult.tags`); :mod:`vitreg.tracking.runs` logs them.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from vitreg.bench.results import BenchResult, TaskResult
from vitreg.console import progress
from vitreg.errors import out_of_memory_as_error
from vitreg.hardware.compile_cache import CacheProbe
from vitreg.hardware.precision import input_dtype, prepare_model
from vitreg.hardware.sdpa import detect_backend
from vitreg.measure.autobatch import search_batch
from vitreg.measure.estimate import bench_work, say_if_long
from vitreg.measure.graphs import EAGER_STEPS_BEFORE_CAPTURE, capture, require_cuda, side_stream
from vitreg.hardware.profiles import ResolvedHardware
from vitreg.measure.profiling import trace_steps
from vitreg.measure.ticker import ticking
from vitreg.models.factory import ModelInfo, create_model
from vitreg.models.memory import check_batch_fits
from vitreg.models.flops import forward_flops_per_image, train_flops_per_image
from vitreg.hardware.runtime import Runtime, run_context
from vitreg.config.options import AUTO_BATCH
from vitreg.config.spec import BenchSpec

from vitreg.measure.timing import summarize, synchronize, time_window, wall_seconds
from vitreg.train.losses import loss_of

PROFILE_TRACE_STEPS = 5  # steady-state steps that profile=true traces per task (after one untraced step)


#: eager forward passes before an inference capture (no DDP there: a few to settle the allocator)
INFER_EAGER_STEPS_BEFORE_CAPTURE = 3


def _memory_mb(device_type: str):
    if device_type != "cuda":
        return None, None  # the CPU has no allocator statistics comparable to CUDA's
    import torch

    mib = 1024 * 1024
    return torch.cuda.max_memory_allocated() / mib, torch.cuda.max_memory_reserved() / mib


def _reset_memory(device_type: str) -> None:
    if device_type == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@dataclass(frozen=True)
class _Timed:
    """What :func:`_measure` timed, and the step its windows ran (a graph replay under cuda_graph=true)."""
    first_s: float
    warm_s: float
    windows: list
    step: object
    compile_cache: str | None  # the first call's cache state when compiling, else None


def _measure(step, spec: BenchSpec, runtime: Runtime, task: str, batch_size: int, progress, align=None,
             graph_eager_steps: int = 0) -> _Timed:
    """First call timed apart, warm-up, then the timed windows.

    ``align`` (DDP only) is a barrier run after the warm-up, so every rank's windows start together.
    ``graph_eager_steps`` > 0 (``cuda_graph=true``): the "first call" is that many eager steps, the
    capture of one more into a CUDA graph and one replay (:func:`vitreg.measure.graphs.capture`); every
    later call, timed or not, is a replay, and the returned ``step`` is the replay. When compiling,
    the first call runs with a ticker (a long compile must not look hung) and the compile cache's
    hits and misses are counted around it.
    """
    dev = runtime.device
    compiling = runtime.compile != "off"
    what = f"compiling ({runtime.compile}, {runtime.compile_backend}) + first call" if compiling else "first call"
    if graph_eager_steps:
        what = what.replace("first call", f"{graph_eager_steps} eager steps + CUDA graph capture")
    progress(f"{task}: {what} ...")
    cache = CacheProbe().start() if compiling else None
    with ticking(f"{task}: {what}", say=progress) if compiling else contextlib.nullcontext():
        if graph_eager_steps:
            replays = []
            first_s = wall_seconds(lambda: replays.append(capture(step, graph_eager_steps)), dev)
            step = replays[0]
        else:
            first_s = wall_seconds(step, dev)
    state = cache.state() if cache is not None else None
    progress(f"{task}: first call took {first_s:.2f} s{f' (compile cache {state})' if state else ''}; "
             f"warm-up {spec.warmup - 1} more iteration(s)")
    warm_s = wall_seconds(lambda: [step() for _ in range(spec.warmup - 1)], dev)
    if align is not None:
        align()  # outside any timed region
    windows = []
    for r in range(spec.repeats):
        win = time_window(step, spec.steps, dev)
        windows.append(win)
        progress(f"{task}: window {r + 1}/{spec.repeats}: {batch_size * win.iters / win.total_ms * 1e3:,.1f} img/s, "
                 f"{win.total_ms / win.iters:.2f} ms/iter")
    return _Timed(first_s, warm_s, windows, step, state)


def _oom_guard(fn, batch_size: int, task: str):
    with out_of_memory_as_error(task, batch_size):
        return fn()


def _choose_batch(make_step, task: str, spec: BenchSpec, runtime: Runtime, progress, distributed: bool):
    """``(batch, BatchChoice or None)``: the spec's batch, or under ``batch_size=auto`` the searched one
    (:func:`vitreg.measure.autobatch.search_batch`: eager probes; under DDP the ranks' smallest)."""
    if not spec.auto_batch:
        return spec.batch_size, None
    choice = search_batch(make_step, task, runtime.device, runtime.torch_device, distributed, progress)
    _reset_memory(runtime.device)  # the peak memory figures are the timed batch's, not a probe's
    return choice.batch, choice


def _after_windows(task: str, timed, eager_step, spec: BenchSpec, runtime: Runtime, profile_dir, progress):
    """Untimed work after the windows: the profile=true trace, then the SDPA backend that ran.

    The backend is read from an eager-launched step: a whole-step CUDA graph replay hides every op
    (the eager step before capture stands in for it), and a replay of inductor's own CUDA graphs
    shows no SDPA op either (then ``unknown`` rather than a wrong ``unfused``).
    """
    if profile_dir is not None:
        progress(f"{task}: profile=true: {PROFILE_TRACE_STEPS} step(s) under torch.profiler (not timed)")
        trace_steps(timed.step, PROFILE_TRACE_STEPS, runtime.device, Path(profile_dir) / task)
    return detect_backend(eager_step if spec.cuda_graph else timed.step, runtime.device, runtime.uses_cudagraphs)


def _infer_steps(net, info: ModelInfo, runtime: Runtime, cache: bool):
    """``make_step(batch)``: a forward pass in eval mode under inference_mode, on a batch made once."""
    import torch

    def make_step(batch: int):
        x = torch.randn(batch, 3, info.img_size, info.img_size, device=runtime.torch_device,
                        dtype=input_dtype(runtime.precision))

        def step():
            runtime.mark_step()
            with torch.inference_mode(), runtime.autocast(cache=cache):
                net(x)

        return step

    return make_step


def run_inference(model, info: ModelInfo, spec: BenchSpec, runtime: Runtime, hardware: ResolvedHardware,
                  fwd_flops: int, progress=progress, reducer=None, profile_dir=None) -> TaskResult:
    """Forward passes in eval mode under inference_mode and the precision, synthetic batch on the device.

    Under DDP (``reducer``, a :class:`vitreg.ddp.world.ResultReducer`) every rank runs its own
    unwrapped copy independently, on its own GPU; the global throughput is the sum of the ranks'.
    """
    _reset_memory(runtime.device)
    model.eval()
    cache = not spec.cuda_graph
    bs, choice = _choose_batch(_infer_steps(model, info, runtime, cache), "infer", spec, runtime, progress,
                               reducer is not None)
    compiled = runtime.compile_model(model)
    step = _infer_steps(compiled, info, runtime, cache)(bs)  # the batch is made once, before any timing
    align = reducer.align if reducer is not None else None
    eager = INFER_EAGER_STEPS_BEFORE_CAPTURE if spec.cuda_graph else 0
    timed = _oom_guard(lambda: _measure(step, spec, runtime, "infer", bs, progress, align, eager), bs, "infer")
    backend = _after_windows("infer", timed, step, spec, runtime, profile_dir, progress)
    result = _task_result("infer", timed.windows, timed.first_s, timed.warm_s, spec, info, runtime, hardware,
                          fwd_flops, reducer, bs)
    return replace(result, sdpa_backend=backend, compile_cache=timed.compile_cache, batch_choice=choice)


def _train_steps(net, opt, scaler, info: ModelInfo, runtime: Runtime, cache: bool):
    """``make_step(batch)``: forward, loss, backward, (scaled) optimizer step on a batch made once."""
    import torch

    criterion = torch.nn.CrossEntropyLoss()

    def make_step(batch: int):
        x = torch.randn(batch, 3, info.img_size, info.img_size, device=runtime.torch_device)
        y = torch.randint(0, info.num_classes, (batch,), device=runtime.torch_device)

        def step():
            runtime.mark_step()
            opt.zero_grad(set_to_none=True)  # under a capture: the backward writes fresh grads on every replay
            with runtime.autocast(cache=cache):
                loss = loss_of(net(x), y, criterion)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        return step

    return make_step


def run_train_step(model, info: ModelInfo, spec: BenchSpec, runtime: Runtime, hardware: ResolvedHardware,
                   train_flops: int, progress=progress, wrap=None, reducer=None, profile_dir=None) -> TaskResult:
    """Full training steps: forward, loss, backward, (scaled) AdamW step, on a fixed synthetic batch.

    ``wrap`` lets DDP wrap the model (before compile, after a batch_size=auto search: the probes run
    the unwrapped model); ``reducer`` (:class:`vitreg.ddp.world.ResultReducer`) combines the ranks'
    own timings into the job's: each rank processes ``batch_size`` images per step, rates add up.
    """
    import torch

    _reset_memory(runtime.device)
    model.train()
    if info.distilled and hasattr(model, "set_distilled_training"):
        model.set_distilled_training(True)  # DeiT recipe: train both heads
    graphed = spec.cuda_graph
    # fused AdamW is one kernel for all parameters on CUDA; it also takes GradScaler's scale and
    # inf flags on the device, so fp16 steps need no host sync for the inf check. capturable:
    # its step count lives on the GPU, so a CUDA graph replay advances it.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=runtime.device == "cuda", capturable=graphed)
    scaler = runtime.grad_scaler()
    try:
        bs, choice = _choose_batch(_train_steps(model, opt, scaler, info, runtime, not graphed), "train", spec,
                                   runtime, progress, reducer is not None)
        with side_stream(graphed and wrap is not None):  # DDP is built on a side stream before a capture
            net = wrap(model) if wrap else model
        step = _train_steps(runtime.compile_model(net), opt, scaler, info, runtime, not graphed)(bs)
        align = reducer.align if reducer is not None else None
        eager = EAGER_STEPS_BEFORE_CAPTURE if graphed else 0
        timed = _oom_guard(lambda: _measure(step, spec, runtime, "train", bs, progress, align, eager), bs, "train")
        comm = None
        if spec.profile_steps:
            from vitreg.measure.profiling import profile_comm

            progress(f"train: {spec.profile_steps} more step(s) under torch.profiler (not timed)")
            comm = profile_comm(timed.step, spec.profile_steps, runtime.device)  # the replay, when graphed
            if reducer is not None:
                comm = reducer.slowest_profile(comm)
        backend = _after_windows("train", timed, step, spec, runtime, profile_dir, progress)
    finally:
        if info.distilled and hasattr(model, "set_distilled_training"):
            model.set_distilled_training(False)
    result = _task_result("train", timed.windows, timed.first_s, timed.warm_s, spec, info, runtime, hardware,
                          train_flops, reducer, bs)
    result = replace(result, sdpa_backend=backend, compile_cache=timed.compile_cache, batch_choice=choice)
    if comm is not None:
        result = replace(result, allreduce_ms_per_step=comm.allreduce_ms_per_step,
                         device_busy_ms_per_step=comm.device_busy_ms_per_step)
    return result


def _task_result(task, windows, first_s, warm_s, spec, info, runtime, hardware, flops_per_img,
                 reducer=None, batch_size: int | None = None) -> TaskResult:
    """The task's figures from its windows; ``batch_size`` is the batch that ran (default: the spec's)."""
    bs = batch_size or spec.batch_size
    throughputs = [bs * w.iters / w.total_ms * 1e3 for w in windows]  # this process's img/s, per window
    iter_ms = [ms for w in windows for ms in w.iter_ms]
    peak_alloc, peak_res = _memory_mb(runtime.device)
    world_size = 1
    if reducer is not None:
        # DDP: a collective (every rank gets here once per task, after its windows). Global
        # throughput per window = sum of the ranks' rates; step time per iteration = slowest rank.
        from vitreg.ddp.world import RankFigures

        total = reducer(task, RankFigures(tuple(throughputs), tuple(iter_ms), first_s, warm_s, peak_alloc, peak_res))
        throughputs, iter_ms, first_s, warm_s = list(total.throughputs), list(total.iter_ms), \
            total.first_call_s, total.warmup_s
        peak_alloc, peak_res = total.peak_mem_allocated_mb, total.peak_mem_reserved_mb
        world_size = reducer.world_size
    tput = summarize(throughputs)
    achieved = flops_per_img * tput.median / 1e12  # the whole job's TFLOP/s; MFU below is per GPU
    return TaskResult(
        task=task, batch_size=bs, img_size=info.img_size, steps=spec.steps, repeats=spec.repeats,
        throughput=tput, iter_ms=summarize(iter_ms), first_call_s=first_s, warmup_s=warm_s,
        compiled=runtime.compile != "off", gflops_per_img=flops_per_img / 1e9, achieved_tflops=achieved,
        mfu=runtime.precision.mfu(achieved / world_size, hardware.profile),  # the peak of the units that ran
        peak_mem_allocated_mb=peak_alloc, peak_mem_reserved_mb=peak_res, world_size=world_size,
    )


def _train_flops(model, info: ModelInfo, runtime: Runtime) -> int:
    import torch

    criterion = torch.nn.CrossEntropyLoss()
    return train_flops_per_image(model, info.img_size, runtime.torch_device, lambda out, y: loss_of(out, y, criterion))


def run_benchmark(spec: BenchSpec, hardware: ResolvedHardware, runtime: Runtime, progress=progress,
                  model_factory=None, wrap=None, reducer=None) -> BenchResult:
    """Build the model, count its FLOPs, run each task of the spec; returns a :class:`BenchResult`.

    ``model_factory`` (optional) returns ``(model, ModelInfo)`` instead of :func:`create_model`, for
    benchmarking a registered model's rebuilt weights. Under DDP, ``wrap`` wraps the training model
    and ``reducer`` (:class:`vitreg.ddp.world.ResultReducer`) turns each rank's figures into the
    job's; every rank must call this with the same spec. The precision's weight cast (or FP8
    quantization) comes after the FLOPs are counted and before any compile.
    """
    import torch

    require_cuda(spec.cuda_graph, runtime.device, runtime.amp)
    torch.manual_seed(spec.seed)
    model, info = model_factory() if model_factory else create_model(spec.model, spec.img_size)
    precision = runtime.precision
    progress(f"model {info.name}: {info.params_m:.1f} M params, {info.img_size}px, on {runtime.device} "
             f"({hardware.detected.name}), precision={precision.label}, sdpa={spec.sdpa}, compile={runtime.compile}")
    if spec.batch_size != AUTO_BATCH:  # a batch nobody can run is refused before anything is allocated
        check_batch_fits(info, spec.batch_size, spec.tasks, runtime.device, runtime.device_index)
    model = model.to(runtime.torch_device)
    # Counted in fp32 before the run's SDPA restriction: sdpa=flash has no fp32 kernel on a GPU, so a
    # count inside it failed with "No available kernel" (the count is the same whichever backend runs).
    fwd_flops = forward_flops_per_image(model, info.img_size, runtime.torch_device)
    train_flops = _train_flops(model, info, runtime) if "train" in spec.tasks else 0
    say_if_long(bench_work(spec, fwd_flops, train_flops, runtime.device), runtime.device, progress,
                compiling=runtime.compile != "off")  # a GPU-sized run on a CPU says so before it starts
    model = prepare_model(model, precision)
    profile_dir = tempfile.mkdtemp(prefix="vitreg-profile-") if spec.profile else None
    tasks = []
    with run_context(runtime, model, spec.sdpa, spec.compile_cache, train="train" in spec.tasks) as cache_dir:
        for task in spec.tasks:
            if task == "infer":
                tasks.append(run_inference(model, info, spec, runtime, hardware, fwd_flops, progress, reducer,
                                           profile_dir))
            else:
                tasks.append(run_train_step(model, info, spec, runtime, hardware, train_flops, progress,
                                            wrap, reducer, profile_dir))
        synchronize(runtime.device)
    return BenchResult(spec=spec, gpu=hardware.label, amp=runtime.amp, device=runtime.device, model=info,
                       fwd_gflops_per_img=fwd_flops / 1e9, tasks=tuple(tasks), precision=precision.label,
                       sdpa=spec.sdpa, compile_cache_dir=str(cache_dir) if cache_dir else None,
                       profile_dir=profile_dir)
