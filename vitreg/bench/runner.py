"""The benchmark itself: per task the batch, synthetic inputs made outside any timing, the first call timed apart
(compilation), the warm-up, the timed windows (nothing logged, printed or synchronised inside one), then untimed
the SDPA backend and the ``profile=true`` trace; the result is a :class:`vitreg.bench.results.BenchResult`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vitreg.bench.results import INFER_EAGER_STEPS_BEFORE_CAPTURE, BenchResult, TaskResult
from vitreg.console import detail, progress, ticking
from vitreg.errors import out_of_memory_as_error
from vitreg.hardware.compile_cache import CacheProbe
from vitreg.hardware.precision import EAGER_FP8_NOTE, fp8_agreement, input_dtype, prepare_model, torch_dtype
from vitreg.hardware.sdpa import detect_backend
from vitreg.measure import batch_cache
from vitreg.measure.autobatch import forget_kept, is_out_of_memory, release_memory, search_batch
from vitreg.measure.figures import Figures, Work
from vitreg.measure.metrics import ITERATION_TIME
from vitreg.measure.estimate import BenchAhead, estimated_batch, measured_flops_per_s, step_seconds
from vitreg.measure.graphs import EAGER_STEPS_BEFORE_CAPTURE, capture, require_cuda, side_stream
from vitreg.hardware.profiles import ResolvedHardware
from vitreg.measure.anatomy import CHART_FILE, TABLE_FILE, Anatomy, ceilings
from vitreg.measure.traces import trace_steps
from vitreg.models.factory import ModelInfo, create_model
from vitreg.models.memory import check_batch_fits
from vitreg.models.flops import forward_flops_per_image, train_flops_per_image
from vitreg.hardware.runtime import Runtime, run_context
from vitreg.config.parse import AUTO_BATCH
from vitreg.config.spec import BenchSpec

from vitreg.measure.timing import (FEWEST_JUDGED, MAX_WINDOWS, MIN_WINDOWS, PHASES, STOP_LAUNCH_BOUND, STOP_MAX_TIME,
                                   STOP_MAX_WINDOWS, STOPS_MISSED, StopRule, median_halfwidth_pct, steps_for_window,
                                   synchronize, time_window, wall_seconds)
from vitreg.train.losses import loss_of

PROFILE_TRACE_STEPS = 5  # steady-state steps that profile=true traces per task (after one untraced step)


@dataclass(frozen=True)
class _Bench:
    """What every task of one benchmark runs with (one value instead of eight parameters)."""

    spec: BenchSpec
    runtime: Runtime
    hardware: ResolvedHardware
    info: ModelInfo
    progress: Callable = progress
    wrap: Callable | None = None  # DDP: wraps the training model
    reducer: object = None  # DDP: a vitreg.ddp.world.ResultReducer
    profile_dir: str | None = None  # profile=true: where the traces go
    attention_flops: dict = field(default_factory=dict)  # profile=true: per task, attention's FLOPs per image


def _measure(step, bench: _Bench, task: str, batch_size: int, graph_eager_steps: int = 0):
    """First call timed apart (``graph_eager_steps`` > 0: eager steps, a capture and a replay), warm-up, the timed
    windows; returns this rank's :class:`Figures`, the step the windows ran, the compile cache state and the
    windows' tags. A compile runs with a ticker (it must not look hung); under DDP a barrier starts the windows."""
    PHASES.mark("task_setup")  # the batch search, the optimizer and the step, since the last phase
    spec, runtime, say = bench.spec, bench.runtime, bench.progress
    dev = runtime.device
    compiling = runtime.compile != "off"
    what = f"compiling ({runtime.compile}, {runtime.compile_backend}) + first call" if compiling else "first call"
    if graph_eager_steps:
        what = what.replace("first call", f"{graph_eager_steps} eager steps + CUDA graph capture")
    say(f"{task}: {what} ...")
    cache, eager = CacheProbe().start() if compiling else None, step
    with ticking(f"{task}: {what}", say=say) if compiling else contextlib.nullcontext():
        if graph_eager_steps:
            replays = []
            first_s = wall_seconds(lambda: replays.append(capture(step, graph_eager_steps)), dev)
            step = replays[0]
        else:
            first_s = wall_seconds(step, dev)
    state = cache.state() if cache is not None else None
    if compiling and not graph_eager_steps:  # what the next estimate of this graph counts for its compile
        batch_cache.keep_compile_seconds(batch_cache.key_for(spec, runtime, task), state, first_s)
    say(f"{task}: first call took {first_s:.2f} s{f' (compile cache {state})' if state else ''}; "
        f"warm-up {spec.warmup - 1} more iteration(s)")
    PHASES.mark("first_call")
    warm_s = wall_seconds(lambda: [step() for _ in range(spec.warmup - 1)], dev)
    if bench.reducer is not None:
        bench.reducer.align()  # outside any timed region
    PHASES.mark("warmup")
    warm_iter_s = warm_s / (spec.warmup - 1) if spec.warmup > 1 else first_s  # the first call overstates it
    # every rank checks or none (a DDP train step is a collective): rank 0's step time decides
    bound = not graph_eager_steps and _rank0(bench, warm_iter_s <= LAUNCH_CHECKED_S) and \
        _rank0(bench, _launch_bound(step, dev))
    if bound:
        say(f"{task}: launch-bound: the GPU waits on the host's kernel launches, so the figure moves with the "
            f"host's speed; timed in {MIN_WINDOWS} windows, the target met or not (cuda_graph=true times the GPU "
            "alone)")
    windows, marks, stop = _timed_windows(step, bench, task, batch_size, warm_iter_s, bound)
    PHASES.mark("timed")
    figures = Figures(task, {
        "window_img_per_s": marks.rates,
        ITERATION_TIME[task]: tuple(ms for w in windows for ms in w.iter_ms),
        "first_call_s": first_s, "warmup_s": warm_s, "timed_windows": len(windows),
        "steps_per_window": windows[-1].iters, **marks.figures(), **_memory(eager, task, dev),
    })
    return figures, step, state, {**marks.tags(), "timing_stop": stop}


#: A step this short may be launch-bound (ViT-B's eager forward launches ~200 kernels: ~5 ms of host time); a longer
#: one is not checked, which would cost its steps.
LAUNCH_CHECKED_S = 0.05
#: Launch-bound: the host still launching when this share of the step's time has passed (an idle GPU first).
LAUNCH_BOUND_SHARE = 0.8


def _launch_bound(step, device: str) -> bool:
    """Whether the GPU waits on the host: three steps each launched on an idle GPU, the median share of the step's
    time the launches took (a launch returns once queued; a GPU-bound step's queue then runs on without the host).
    Asked of steps under :data:`LAUNCH_CHECKED_S` alone."""
    if device != "cuda":
        return False
    shares = []
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        step()
        queued = time.perf_counter() - start
        synchronize(device)
        shares.append(queued / max(time.perf_counter() - start, 1e-9))
    return statistics.median(shares) >= LAUNCH_BOUND_SHARE


def _memory(step, task: str, device: str) -> dict:
    """CUDA's allocator statistics (a CPU has none comparable): the task's peak allocated and reserved MiB; for train
    then one more step, untimed and launched eagerly, with the peak allocated within each of its phases."""
    if device != "cuda":
        return {}
    import torch

    peaks = {"peak_mem_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
             "peak_mem_reserved_mb": torch.cuda.max_memory_reserved() / 2**20}

    def mark(phase):  # a phase's peak counts from what is allocated at its start
        peaks[f"peak_mem_{phase}_mb"] = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()

    if task == "train":
        torch.cuda.reset_peak_memory_stats()
        step(mark)
    return peaks


def _rank0(bench: _Bench, value):
    """Rank 0's ``value`` under DDP (a collective, between windows), so every rank times the same windows."""
    if bench.reducer is None:
        return value
    from vitreg.ddp.world import gather_objects

    return gather_objects(value, bench.reducer.world)[0]


#: Short windows re-measured at most this often per task before a short one is kept as a sample.
_RECALIBRATIONS = 3


def _timed_windows(step, bench: _Bench, task: str, batch_size: int, warm_iter_s: float, launch_bound: bool = False):
    """The timed windows, each between two reads of the energy meter (outside the CUDA-event timing), until the
    :class:`StopRule` says stop (a ``launch_bound`` step at :data:`MIN_WINDOWS`); returns ``(windows, task_marks,
    stop reason)``. ``steps=0``: the steps come from the warm-up's step time, and a window shorter than
    ``window_min_s`` is not a sample: it recalibrates the steps."""
    from vitreg.measure.energy import TaskMarks, open_meter, steps_for_energy

    spec, dev, say = bench.spec, bench.runtime.device, bench.progress
    rule = spec.stop_rule()
    steps = spec.steps or _rank0(bench, steps_for_window(spec.window_min_s, warm_iter_s))
    windows, marks, stop, recalibrated = [], [], None, 0
    meter = open_meter(dev, bench.runtime.device_index)
    detail(f"{task}: energy and throttle state at the window edges: {meter.source.name}", say)
    started = time.perf_counter()
    try:
        while stop is None:
            meter.start()
            win = time_window(step, steps, dev)
            mark = meter.stop(win.total_ms / 1e3, batch_size * win.iters, f"{task} {len(windows) + 1}")
            if not spec.steps and recalibrated < _RECALIBRATIONS and \
                    _rank0(bench, win.total_ms / 1e3 < spec.window_min_s):
                recalibrated += 1
                steps = _rank0(bench, steps_for_window(spec.window_min_s, win.total_ms / 1e3 / win.iters))
                say(f"{task}: a window of {win.total_ms / 1e3:.3f} s is shorter than window_min_s="
                    f"{spec.window_min_s:g}: not a sample; {steps} steps per window from here")
                continue
            windows.append(win)
            marks.append(mark)
            rates = [w.img_per_s(batch_size) for w in windows]
            stop = rule.reason(rates, time.perf_counter() - started, win.total_ms / 1e3)
            if stop is None and launch_bound and not rule.repeats and len(rates) >= MIN_WINDOWS:
                stop = STOP_LAUNCH_BOUND
            if not rule.repeats:  # fixed counts stop alike on every rank without a word between them
                stop = _rank0(bench, stop)
            _say_window(say, task, rates, win, mark, rule)
    finally:
        meter.close()
    task_marks = TaskMarks(tuple(marks), tuple(w.img_per_s(batch_size) for w in windows))
    if task_marks.spread_note():  # the run's warning line and the table's flag say it: the log keeps the causes
        detail(f"{task}: {task_marks.spread_note()}", say)
    if task_marks.short_windows():
        say(f"{task}: no energy figure: windows of {windows[0].total_ms / 1e3:.2f} s are too short for the energy "
            f"counter (it refreshes every 20-100 ms); steps={steps_for_energy(windows[0].total_ms / 1e3, steps)} "
            "would give one")
    if stop in STOPS_MISSED:
        say(f"{task}: {missed_target_text(task_marks.rates, rule, stop)}")
    return windows, task_marks, stop


def _say_window(say, task: str, rates: list, win, mark, rule: StopRule) -> None:
    """One progress line per window: rate, step time, power where read, the median's half-width so far."""
    power = f", {mark.power_w:,.0f} W, {mark.energy_j / mark.images:.4g} J/img" if mark.power_w else ""
    count = f"{len(rates)}/{rule.repeats}" if rule.repeats else f"{len(rates)}"
    halfwidth = median_halfwidth_pct(rates) if not rule.repeats else None
    sure = f", median +-{halfwidth:.2f} % (target {rule.precision_pct:g} %)" if halfwidth is not None else ""
    say(f"{task}: window {count}: {rates[-1]:,.1f} img/s, {win.total_ms / win.iters:.2f} ms/iter{power}{sure}")


def missed_target_text(rates, rule: StopRule, stop: str) -> str:
    """Why a task's median is less sure than asked: the half-width reached, the limit that stopped it."""
    halfwidth = median_halfwidth_pct(rates)
    reached = f"+-{halfwidth:.2f} %" if halfwidth is not None else f"no 95 % interval (under {FEWEST_JUDGED} windows)"
    limit = {STOP_MAX_TIME: f"max_time_s={rule.max_time_s:g} s of timing", STOP_MAX_WINDOWS: f"the most windows a "
             f"task times ({MAX_WINDOWS})", STOP_LAUNCH_BOUND: "a launch-bound step's windows"}[stop]
    fix = ("the host's speed moves it: cuda_graph=true times the GPU alone" if stop == STOP_LAUNCH_BOUND else
           "the windows scatter (a busy host, throttling): rerun on a quiet machine or raise max_time_s")
    return (f"precision target {rule.precision_pct:g} % not reached: {reached} after {len(rates)} window(s), "
            f"stopped by {limit}; {fix}")


def _choose_batch(make_step, task: str, bench: _Bench):
    """``(batch, BatchChoice or None)``: the spec's, or batch_size=auto's (searched, or kept by an earlier run)."""
    spec, runtime = bench.spec, bench.runtime
    if not spec.auto_batch:
        return spec.batch_size, None
    choice = search_batch(make_step, task, runtime.device, runtime.torch_device, bench.reducer is not None,
                          bench.progress, key=batch_cache.key_for(spec, runtime, task))
    release_memory(runtime.device, reset_peak=True)  # the timed batch's peak, not a probe's
    return choice.batch, choice


def _after_windows(task: str, timed_step, eager_step, bench: _Bench, batch: int, flops_per_img: int):
    """Untimed, after the windows: the profile=true trace and anatomy, the SDPA backend; ``(backend, figures)``.
    The backend is read from an eager-launched step: a CUDA graph replay hides every op (inductor's: ``unknown``)."""
    runtime, anatomy = bench.runtime, {}
    if bench.profile_dir is not None:
        bench.progress(f"{task}: profile=true: {PROFILE_TRACE_STEPS} step(s) under torch.profiler (not timed)")
        files = trace_steps(timed_step, PROFILE_TRACE_STEPS, runtime.device, Path(bench.profile_dir) / task)
        anatomy = _anatomy(task, files, bench, batch, flops_per_img)
    backend = detect_backend(eager_step if bench.spec.cuda_graph else timed_step, runtime.device,
                             runtime.uses_cudagraphs)
    return backend, anatomy


def _anatomy(task: str, files, bench: _Bench, batch: int, flops_per_img: int) -> dict:
    """The traced steps per kernel class: table and chart beside the trace, one console line, the figures. The
    matmuls' FLOPs are the task's count less attention's."""
    from vitreg.analysis.plots import plot_anatomy

    attention = bench.attention_flops.get(task, 0)
    anatomy = Anatomy(files.class_us, files.steps, batch, files.host,
                      {"matmul": flops_per_img - attention, "attention": attention},
                      ceilings(bench.runtime.precision, bench.hardware))
    (files.trace.parent / TABLE_FILE).write_text(anatomy.table(task))
    plot_anatomy(anatomy, task, files.trace.parent / CHART_FILE)
    bench.progress(anatomy.line(task))
    return anatomy.figures()


def _infer_steps(net, info: ModelInfo, runtime: Runtime, cache: bool):
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


def run_inference(model, bench: _Bench, fwd_flops: int) -> TaskResult:
    """Forward passes on a synthetic batch; under DDP each rank runs its own unwrapped copy (throughputs add)."""
    runtime, info = bench.runtime, bench.info
    release_memory(runtime.device, reset_peak=True)  # the task's peak memory figures are its own
    model.eval()
    cache = not bench.spec.cuda_graph
    compiled = runtime.compile_model(model)
    return _at_chosen_batch("infer", _infer_steps(model, info, runtime, cache),
                            lambda bs: _infer_steps(compiled, info, runtime, cache)(bs), bench, fwd_flops)


def _at_chosen_batch(task: str, probe_steps, timed_step, bench: _Bench, flops_per_img: int) -> TaskResult:
    """``task`` timed at its batch (``timed_step(batch)``: the batch is made once, before any timing). A kept batch
    is checked by its own warm-up: one that runs out of memory is forgotten and the batch searched again."""
    bs, choice = _choose_batch(probe_steps, task, bench)
    try:
        return _timed_task(task, timed_step(bs), bench, bs, choice, flops_per_img)
    except Exception as exc:
        if choice is None or choice.source == "probe" or not is_out_of_memory(exc):
            raise
    forget_kept(batch_cache.key_for(bench.spec, bench.runtime, task), task, bs, bench.progress)
    release_memory(bench.runtime.device)
    bs, choice = _choose_batch(probe_steps, task, bench)
    return _timed_task(task, timed_step(bs), bench, bs, choice, flops_per_img)


def _timed_task(task: str, step, bench: _Bench, batch_size: int, choice, flops_per_img: int) -> TaskResult:
    """``step`` timed (an out-of-memory error names the batch), the untimed work after it, the job's figures."""
    eager = 0
    if bench.spec.cuda_graph:
        eager = INFER_EAGER_STEPS_BEFORE_CAPTURE if task == "infer" else EAGER_STEPS_BEFORE_CAPTURE
    with out_of_memory_as_error(task, batch_size):
        figures, timed_step, cache_state, tags = _measure(step, bench, task, batch_size, eager)
    if task == "train":
        figures = figures.with_values(**_comm_figures(timed_step, bench))
    backend, anatomy = _after_windows(task, timed_step, step, bench, batch_size, flops_per_img)
    if bench.runtime.eager_fp8:  # a known slow path: the run's name, `vitreg runs` and compare say so
        tags = {**tags, "eager_fp8": "true"}
    PHASES.mark("after_windows")
    return TaskResult(task, batch_size, bench.info.img_size, figures["steps_per_window"], figures["timed_windows"],
                      _job_figures(figures.with_values(**anatomy), bench, flops_per_img), backend, cache_state,
                      choice, tags)


def _train_steps(net, opt, scaler, info: ModelInfo, runtime: Runtime, cache: bool):
    import torch

    criterion = torch.nn.CrossEntropyLoss()

    def make_step(batch: int):
        x = torch.randn(batch, 3, info.img_size, info.img_size, device=runtime.torch_device)
        y = torch.randint(0, info.num_classes, (batch,), device=runtime.torch_device)

        def step(mark=lambda phase: None):  # mark: _memory reads the allocator after each phase
            runtime.mark_step()
            opt.zero_grad(set_to_none=True)  # under a capture: the backward writes fresh grads on every replay
            with runtime.autocast(cache=cache):
                loss = loss_of(net(x), y, criterion)
            mark("forward")
            scaler.scale(loss).backward()
            mark("backward")
            scaler.step(opt)
            scaler.update()
            mark("optimizer")

        return step

    return make_step


def run_train_step(model, bench: _Bench, train_flops: int) -> TaskResult:
    """Full training steps on a fixed synthetic batch; under DDP ``bench.wrap`` wraps the model after the batch
    search (the probes run it unwrapped), before compile."""
    import torch

    runtime, info, spec = bench.runtime, bench.info, bench.spec
    release_memory(runtime.device, reset_peak=True)  # the task's peak memory figures are its own
    model.train()
    if info.distilled and hasattr(model, "set_distilled_training"):
        model.set_distilled_training(True)  # DeiT recipe: train both heads
    graphed = spec.cuda_graph
    # fused AdamW is one kernel for all parameters on CUDA; it also takes GradScaler's scale and
    # inf flags on the device, so fp16 steps need no host sync for the inf check. capturable:
    # its step count lives on the GPU, so a CUDA graph replay advances it.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=runtime.device == "cuda", capturable=graphed)
    scaler = runtime.grad_scaler()
    make_step = functools.partial(_train_steps, opt=opt, scaler=scaler, info=info, runtime=runtime, cache=not graphed)

    def timed_step(batch: int):
        with side_stream(graphed and bench.wrap is not None):  # DDP is built on a side stream before a capture
            net = bench.wrap(model) if bench.wrap else model
        return make_step(runtime.compile_model(net))(batch)

    try:
        return _at_chosen_batch("train", make_step(model), timed_step, bench, train_flops)
    finally:
        if info.distilled and hasattr(model, "set_distilled_training"):
            model.set_distilled_training(False)


def _comm_figures(timed_step, bench: _Bench) -> dict:
    """profile_steps > 0: all-reduce and busy time per step from torch.profiler (the slowest rank's under DDP)."""
    if not bench.spec.profile_steps:
        return {}
    from vitreg.measure.traces import profile_comm

    bench.progress(f"train: {bench.spec.profile_steps} more step(s) under torch.profiler (not timed)")
    comm = profile_comm(timed_step, bench.spec.profile_steps, bench.runtime.device)  # the replay, when graphed
    if bench.reducer is not None:
        comm = bench.reducer.slowest_profile(comm)
    return {"allreduce_ms_per_step": comm.allreduce_ms_per_step,
            "device_busy_ms_per_step": comm.device_busy_ms_per_step}


def _job_figures(figures: Figures, bench: _Bench, flops_per_img: int) -> Figures:
    """This rank's figures -> the job's: reduced over the ranks (a collective), summarized, the job-level rows."""
    figures = figures.with_values(gflops_per_img=flops_per_img / 1e9)
    world_size = 1
    if bench.reducer is not None:
        figures = bench.reducer(figures.task, figures)
        world_size = bench.reducer.world_size
    return figures.summarized().completed(Work.of(bench.runtime, bench.hardware, world_size))


def _flops(model, info: ModelInfo, runtime: Runtime, task: str, attention: bool = False) -> int:
    """FLOPs per image of ``task``'s step (``attention``: its attention's alone, for the anatomy), counted once and
    kept under what the count depends on: the model's build and the libraries that define and count it."""
    import torch
    from importlib import metadata

    def count():
        if task == "infer":
            return forward_flops_per_image(model, info.img_size, runtime.torch_device, attention=attention)
        criterion = torch.nn.CrossEntropyLoss()
        return train_flops_per_image(model, info.img_size, runtime.torch_device,
                                     lambda out, y: loss_of(out, y, criterion), attention=attention)

    what = f"{task} attention" if attention else {"infer": "forward", "train": "train"}[task]
    key = {"model": info.name, "source": info.source, "img_size": info.img_size, "num_classes": info.num_classes,
           "distilled": info.distilled, "params_m": round(info.params_m, 6), "torch": torch.__version__,
           "library": metadata.version(info.source), "count": what}
    return batch_cache.counted_flops(key, count)


def run_benchmark(spec: BenchSpec, hardware: ResolvedHardware, runtime: Runtime, progress=progress,
                  model_factory=None, wrap=None, reducer=None, command: str = "") -> BenchResult:
    """Build the model (or ``model_factory()``), count its FLOPs, run each task of the spec. Under DDP ``wrap`` wraps
    the training model and ``reducer`` makes the ranks' figures the job's. The weight cast comes after the FLOP
    count and before any compile."""
    import torch

    require_cuda(spec.cuda_graph, runtime.device, runtime.amp)
    torch.manual_seed(spec.seed)
    model, info = model_factory() if model_factory else create_model(spec.model, spec.img_size)
    precision = runtime.precision
    progress(f"model {info.name}: {info.params_m:.1f} M params, {info.img_size}px, on {runtime.device} "
             f"({hardware.detected.name}), precision={precision.label}, sdpa={spec.sdpa}, compile={runtime.compile}")
    if spec.batch_size != AUTO_BATCH:  # a batch nobody can run is refused before anything is allocated
        check_batch_fits(info, spec.batch_size, spec.tasks, runtime.device, runtime.device_index, sdpa=spec.sdpa)
    model = model.to(runtime.torch_device)
    # Counted in fp32 before the run's SDPA restriction: sdpa=flash has no fp32 kernel on a GPU, so a
    # count inside it failed with "No available kernel" (the count is the same whichever backend runs).
    fwd_flops = _flops(model, info, runtime, "infer")
    train_flops = _flops(model, info, runtime, "train") if "train" in spec.tasks else 0
    attention_flops = {task: _flops(model, info, runtime, task, attention=True) for task in spec.tasks} \
        if spec.profile else {}
    # amp=fp8*: a bf16 copy first, to say how far the quantized model's logits land from it
    reference = copy.deepcopy(model).to(torch.bfloat16) if precision.fp8 else None
    model = prepare_model(model, precision)
    agreement = fp8_agreement(reference, model, info.img_size, runtime.torch_device) if precision.fp8 else None
    if agreement is not None:
        del reference
        progress(f"fp8 against bf16 weights on a fixed batch: top-1 agreement {agreement.top1_agreement:.1%}, "
                 f"max |logit difference| {agreement.max_abs_logit_diff:.3g}")
    if runtime.eager_fp8:
        progress(EAGER_FP8_NOTE)
    profile_dir = tempfile.mkdtemp(prefix="vitreg-profile-") if spec.profile else None
    bench = _Bench(spec, runtime, hardware, info, progress, wrap, reducer, profile_dir, attention_flops)
    tasks = []
    with run_context(runtime, model, spec.sdpa, spec.compile_cache, train="train" in spec.tasks) as cache_dir:
        ahead = _estimate(model, bench, fwd_flops, train_flops, cache_dir, command)  # a GPU-sized run on a CPU says so
        PHASES.mark("model")
        work_started = time.perf_counter()
        for task in spec.tasks:
            if task == "infer":
                tasks.append(run_inference(model, bench, fwd_flops))
            else:
                tasks.append(run_train_step(model, bench, train_flops))
        synchronize(runtime.device)
        work_s = time.perf_counter() - work_started
    return BenchResult(spec=spec, gpu=hardware.label, amp=runtime.amp, device=runtime.device, model=info,
                       fwd_gflops_per_img=fwd_flops / 1e9, tasks=tuple(tasks), precision=precision.label,
                       sdpa=spec.sdpa, compile_cache_dir=str(cache_dir) if cache_dir else None,
                       profile_dir=profile_dir, fp8_agreement=agreement, estimated_work_s=ahead.seconds(),
                       work_s=work_s)


def _probe_step(task: str, model, bench: _Bench, flops_per_img: int, batch: int, matmul_rate: float):
    """``(seconds a step of task takes at batch, whether it is launch-bound)``, timed at a probe batch; the random
    state put back, so the run's inputs are those it makes without the probe. The train probe's optimizer has a
    learning rate of 0: its steps leave the weights as they were."""
    import torch

    runtime, info, dev = bench.runtime, bench.info, bench.runtime.device
    model.train(task == "train")
    opt = torch.optim.AdamW(model.parameters(), lr=0.0) if task == "train" else None
    make = (_infer_steps(model, info, runtime, True) if opt is None else
            _train_steps(model, opt, runtime.grad_scaler(), info, runtime, True))
    try:
        seconds = step_seconds(make, batch, flops_per_img, dev, matmul_rate)
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if dev == "cuda" else []):
            return seconds, seconds <= LAUNCH_CHECKED_S and _launch_bound(make(batch), dev)
    finally:
        model.zero_grad(set_to_none=True)


def _estimate(model, bench: _Bench, fwd_flops: int, train_flops: int, cache_dir, command: str) -> BenchAhead:
    """The work ahead, said when it is long: each task's step from its kept batch's probe where batch_size=auto
    has one (nothing run), else timed at a probe batch in the run's context (:func:`_probe_step`)."""
    spec, runtime, dev = bench.spec, bench.runtime, bench.runtime.device
    step_s, searched = {}, []
    # a CPU's matmul rate in the run's dtype sizes the probe (bf16 on a CPU without bf16 units is slow)
    rate = measured_flops_per_s("cpu", dtype=torch_dtype(runtime.precision.autocast_dtype or
                                                         runtime.precision.weights_dtype)) if dev == "cpu" else 0.0
    launch_bound = []
    for task in spec.tasks:
        kept = batch_cache.lookup(batch_cache.key_for(spec, runtime, task))[0] \
            if spec.auto_batch and bench.reducer is None else None
        if kept is not None and kept.img_per_s:
            step_s[task] = kept.batch / kept.img_per_s
            continue
        batch = kept.batch if kept is not None else estimated_batch(spec, dev)
        searched += [task] if spec.auto_batch and kept is None else []
        step_s[task], bound = _probe_step(task, model, bench, fwd_flops if task == "infer" else train_flops, batch,
                                          rate)
        launch_bound += [task] if bound else []
    cached = cache_dir is not None and Path(cache_dir).is_dir() and any(Path(cache_dir).iterdir())
    learned = {task: batch_cache.compile_seconds(batch_cache.key_for(spec, runtime, task), warm=cached)
               for task in step_s if runtime.compile != "off"}
    ahead = BenchAhead(spec, step_s, dev, cached, command, compile_s={t: s for t, s in learned.items() if s is not None},
                       searched=tuple(searched), fp8=runtime.precision.fp8, launch_bound=tuple(launch_bound))
    ahead.refuse_if_endless()
    line = ahead.line()
    if line:
        bench.progress(line)
    return ahead
