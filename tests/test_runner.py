"""The runner on the CPU with a tiny model: typed results with the metric names the registry relies on."""

import json

import pytest

from vitreg.hardware.profiles import PROFILES, DetectedHardware, resolve_hardware
from vitreg.bench.runner import run_benchmark
from vitreg.measure.metrics import ITERATION_TIME
from vitreg.hardware.runtime import resolve_runtime
from vitreg.config.spec import BenchSpec

CPU = DetectedHardware("cpu", "CPU (test)", 1, PROFILES["cpu"])


def _run(**kw):
    spec = BenchSpec(**{"model": "test_vit", "img_size": 32, "batch_size": 2, "warmup": 2, "steps": 3, "repeats": 2,
                        **kw})
    hw = resolve_hardware("auto", CPU)
    rt = resolve_runtime(spec.amp, spec.compile, spec.compile_backend, CPU)
    messages = []
    return run_benchmark(spec, hw, rt, progress=messages.append), messages


def test_both_tasks_metrics_and_schema():
    result, messages = _run()
    m = result.metrics()
    for key in ["infer_throughput_img_per_s", "infer_latency_ms_p50", "infer_latency_ms_p90", "infer_latency_ms_p99",
                "train_throughput_img_per_s", "train_step_ms_p50", "infer_throughput_cv", "train_throughput_cv",
                "fwd_gflops_per_img", "infer_achieved_tflops", "train_achieved_tflops", "infer_warmup_s"]:
        assert key in m and m[key] >= 0, key
    assert m["infer_throughput_img_per_s"] > 0
    # no MFU without a datasheet peak, no CUDA allocator figures on the CPU, no compile time when eager
    assert not any(k.endswith(("_mfu", "_peak_mem_allocated_mb", "_compile_time_s")) for k in m)
    # the training step (forward + backward) costs about 3x the forward
    assert 2.5 < m["train_gflops_per_img"] / m["fwd_gflops_per_img"] < 3.5
    # throughput is the median of the windows and lies within their range
    t = result.tasks[0]
    f = t.figures
    assert len(f["window_img_per_s"]) == 2
    assert f["throughput_img_per_s_min"] <= f["throughput_img_per_s"] <= f["throughput_img_per_s_max"]
    assert len(f["latency_ms"]) == 2 * 3  # every timed iteration of every window, warm-up excluded
    doc = json.loads(json.dumps(result.to_dict()))
    assert [x["task"] for x in doc["tasks"]] == ["infer", "train"]
    assert doc["tasks"][0]["metrics"]["infer_throughput_img_per_s"] == m["infer_throughput_img_per_s"]
    assert any("window 2/2" in msg for msg in messages)  # progress is reported
    # no NVML on the CPU: no energy, power or clock figure at all (absent, never 0); the host's load is tagged
    assert not any(k.endswith(("_energy_j_per_img", "_img_per_j", "_mean_power_w", "_sm_clock_mhz")) for k in m)
    assert result.tags()["infer_busy_host"] in ("true", "false") and "infer_host_load_beside_run" in result.tags()


def test_compile_time_is_reported_apart():
    result, messages = _run(task="infer", compile="default", compile_backend="eager")
    m = result.metrics()
    assert m["infer_compile_time_s"] > 0
    assert any("compiling" in msg for msg in messages)


def test_distilled_deit_trains_both_heads():
    """Each training step gives the two heads their own outputs (DeiT's distilled training) and the loss
    reaches both: the class head and the distillation head are updated, and left in inference mode."""
    import torch

    from vitreg.models.factory import create_model

    spec = BenchSpec(model="deit_tiny_distilled_patch16_224", img_size=32, batch_size=2, warmup=1, steps=2,
                     repeats=1, task="train")
    hw = resolve_hardware("auto", CPU)
    rt = resolve_runtime("off", "off", "inductor", CPU)
    model, info = create_model(spec.model, spec.img_size)
    before = {name: getattr(model, name).weight.detach().clone() for name in ("head", "head_dist")}
    outputs = []
    model.register_forward_hook(lambda module, args, out: outputs.append(out))
    result = run_benchmark(spec, hw, rt, progress=lambda _: None, model_factory=lambda: (model, info))
    assert result.model.distilled and result.metrics()["train_throughput_img_per_s"] > 0
    trained = [out for out in outputs if isinstance(out, tuple)]
    assert trained and all(len(out) == 2 for out in trained)  # (class head, distillation head) per step
    for name, weight in before.items():
        assert getattr(model, name).weight.grad is not None, f"{name} got no gradient"
        assert not torch.equal(getattr(model, name).weight, weight), f"{name} was not updated"
    assert not model.distilled_training  # restored after the task


def test_a_mislabelled_run_has_no_mfu():
    """A CPU run filed as a100 (allow_gpu_mismatch): an MFU against the A100's peak would be a made-up figure."""
    spec = BenchSpec(model="test_vit", img_size=32, batch_size=2, warmup=1, steps=2, repeats=1, task="infer")
    rt = resolve_runtime("off", "off", "inductor", CPU)
    m = run_benchmark(spec, resolve_hardware("a100", CPU, allow_mismatch=True), rt, progress=lambda _: None).metrics()
    assert m["infer_achieved_tflops"] > 0 and m.get("infer_mfu") is None


def test_batch_size_auto_on_cpu_searches_a_small_range_and_says_what_it_chose():
    result, messages = _run(task="infer", batch_size="auto")
    (infer,) = result.tasks
    choice = infer.batch_choice
    assert choice is not None and infer.batch_size == choice.batch
    assert [p.batch for p in choice.probes][0] == 8 and all(p.batch <= 64 for p in choice.probes)
    tags = result.tags()
    assert tags["infer_batch_size_chosen"] == str(choice.batch) and tags["infer_batch_probes"] == choice.summary()
    assert [step for step, _ in result.series()] == [p.batch for p in choice.probes if p.fits]
    assert any("batch_size=auto chose" in m for m in messages)
    assert result.to_dict()["tasks"][0]["batch_choice"]["batch"] == choice.batch


def test_what_ran_is_in_the_tags_precision_and_the_sdpa_backend_read_from_the_kernels():
    result, _ = _run(sdpa="math")
    tags = result.tags()
    assert tags["precision"] == "fp32" and tags["sdpa"] == "math"
    # timm's test_vit calls F.scaled_dot_product_attention; restricted to math, that op is what ran
    assert tags["infer_sdpa_backend"] == tags["train_sdpa_backend"] == tags["sdpa_backend"] == "math"
    assert "compile_cache_dir" not in tags and "infer_compile_cache" not in tags  # not compiling
    assert "precision fp32; sdpa=math (ran: infer math, train math)" in report_table(result)


def test_flops_are_counted_outside_the_sdpa_restriction(monkeypatch):
    """The FLOP count runs the fp32 model: under sdpa=flash a GPU has no fp32 kernel, and a count inside
    the restriction failed with "No available kernel" (an H200, 2026-12-01)."""
    import torch

    from vitreg.bench import runner

    unrestricted = []

    def counting(fn, *args, **kw):
        unrestricted.append(torch.backends.cuda.flash_sdp_enabled())  # sdpa=math switches flash off
        return count_flops(fn, *args, **kw)

    count_flops = runner.forward_flops_per_image.__globals__["count_flops"]
    monkeypatch.setitem(runner.forward_flops_per_image.__globals__, "count_flops", counting)
    result, _ = _run(sdpa="math")
    assert unrestricted == [True, True]  # the forward count and the training count
    assert result.tags()["train_sdpa_backend"] == "math"  # the run itself is restricted


def report_table(result):
    from vitreg.bench.results import results_table

    return results_table(result)


def test_weights_cast_runs_inference_in_bf16_and_is_labelled():
    """bf16-weights: the forward passes that are timed run in bf16 (weights and inputs), and the run says so."""
    import torch

    from vitreg.models.factory import create_model

    spec = BenchSpec(model="test_vit", img_size=32, batch_size=2, warmup=2, steps=3, repeats=2, task="infer",
                     amp="bf16-weights")
    model, info = create_model(spec.model, spec.img_size)
    seen = []  # (weight dtype, input dtype, output dtype) of every forward pass
    model.register_forward_hook(lambda module, args, out: seen.append((module.head.weight.dtype, args[0].dtype,
                                                                       out.dtype)))
    result = run_benchmark(spec, resolve_hardware("auto", CPU),
                           resolve_runtime(spec.amp, spec.compile, spec.compile_backend, CPU),
                           progress=lambda _: None, model_factory=lambda: (model, info))
    assert result.precision == "bf16-weights" and result.tags()["precision"] == "bf16-weights"
    assert result.metrics()["infer_throughput_img_per_s"] > 0
    # after the FLOP count's passes (fp32, before the cast): the first call, the warm-up, the windows
    # and the SDPA check, every one in bf16
    ran = seen[-(spec.warmup + spec.steps * spec.repeats + 1):]
    assert len(seen) > len(ran) and set(ran) == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}, set(ran)


def test_compiling_records_the_cache_folder_and_state_and_restores_the_process_settings(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    result, messages = _run(task="infer", compile="default", compile_backend="eager",
                            compile_cache=str(tmp_path / "cache"))
    assert result.compile_cache_dir == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    assert result.tags()["infer_compile_cache"] == "unused"  # the eager backend compiles no inductor graph
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # set for the run only
    assert any("compile cache unused" in m for m in messages)


@pytest.mark.slow  # the profiler over both tasks: ~5 s of CPU; the tracing itself is tested in test_trace.py
def test_profile_true_writes_a_trace_the_top_ops_and_the_steps_anatomy_per_task_outside_the_windows():
    from pathlib import Path

    import shutil

    from vitreg.measure.anatomy import CLASSES

    result, messages = _run(profile="true")
    folder, m = Path(result.profile_dir), result.metrics()
    try:
        for task in ("infer", "train"):
            assert (folder / task / "trace.json.gz").stat().st_size > 0
            assert "Self CPU" in (folder / task / "top_ops.txt").read_text()
            table = (folder / task / "anatomy.txt").read_text()
            assert "host (CPU op self time" in table and "unknown" in table  # a CPU has no peak to be against
            assert (folder / task / "anatomy.png").read_bytes().startswith(b"\x89PNG")
            assert sum(m[f"{task}_anatomy_{c}_pct"] for c in CLASSES) == pytest.approx(100)
            assert m[f"{task}_anatomy_matmul_ms_per_img"] > 0 and m[f"{task}_anatomy_matmul_tflops"] > 0
            said = [line for line in messages if line.startswith(f"{task}: step anatomy (host time): ")]
            assert len(said) == 1 and f"profile/{task}/anatomy.txt" in said[0], messages
        assert len(result.tasks[0].figures[ITERATION_TIME[result.tasks[0].task]]) == 2 * 3  # traced steps untimed
        assert any("profile=true" in m for m in messages)
    finally:
        shutil.rmtree(folder)  # the job logs and removes it; run_benchmark alone hands it to its caller


def _windows_of(iter_ms_by_window):
    """A stand-in for the runner's ``time_window``: window i's iterations take ``iter_ms_by_window(i)`` ms each
    (the step is not called: the stopping rule is what is tested, on timings the test chose)."""
    from vitreg.measure.timing import Window

    calls = []

    def fake(fn, iters, device_type):
        ms = iter_ms_by_window(len(calls))
        calls.append(iters)
        return Window((ms,) * iters, ms * iters)

    return fake, calls


def test_by_default_windows_last_window_min_s_and_stop_at_the_precision_target(monkeypatch):
    """warmup=1: the steps come from the first call, said to take 100 ms (6 steps), while a step takes 10 ms in
    the windows: the first window is short, is not a sample, and the steps are recomputed from it:
    0.5 s x 1.03 / 10 ms = 51.5 -> 52."""
    from vitreg.bench import runner

    jitter = (1.0, 1.002, 0.998, 1.001, 0.999, 1.0005, 1.0, 1.0)
    fake, calls = _windows_of(lambda i: 10.0 * jitter[i % len(jitter)])
    monkeypatch.setattr(runner, "time_window", fake)
    monkeypatch.setattr(runner, "wall_seconds", lambda fn, device_type: fn() or 0.1)
    result, messages = _run(task="infer", warmup=1, steps=0, repeats=0, window_min_s=0.5, precision_pct=1.0)
    task, m = result.tasks[0], result.metrics()
    assert calls == [6] + [52] * 3  # one short window, then three of 52 steps: their t interval is +-0.5 %
    assert any("not a sample; 52 steps per window" in msg for msg in messages)
    assert (m["infer_timed_windows"], m["infer_steps_per_window"]) == (3, 52) == (task.repeats, task.steps)
    assert result.tags()["infer_timing_stop"] == "precision_met"
    assert m["infer_throughput_ci95_halfwidth_pct"] <= 1.0
    assert len(task.figures["latency_ms"]) == 3 * 52  # the short window is no sample


def test_a_task_that_misses_its_target_stops_at_a_limit_says_so_and_tags_why(monkeypatch):
    from vitreg.bench import runner
    from vitreg.bench.results import precision_warning

    fake, calls = _windows_of(lambda i: (10.0, 13.0, 7.0, 11.5, 8.5)[i % 5])  # +-30 %: never sure to 1 %
    monkeypatch.setattr(runner, "time_window", fake)
    result, messages = _run(task="infer", steps=5, repeats=0, precision_pct=1.0)
    assert result.tags()["infer_timing_stop"] == "max_windows" and len(calls) == 60
    assert any("precision target 1 % not reached" in msg and "max_windows" not in msg for msg in messages)
    assert "infer_timing_stop=max_windows" in precision_warning(result)


def test_given_steps_and_repeats_keep_the_fixed_counts(monkeypatch):
    from vitreg.bench import runner

    fake, calls = _windows_of(lambda i: (10.0, 13.0, 7.0)[i % 3])
    monkeypatch.setattr(runner, "time_window", fake)
    result, _ = _run(task="infer", steps=3, repeats=2, window_min_s=5.0)
    assert calls == [3, 3] and result.tags()["infer_timing_stop"] == "fixed"
    assert (result.tasks[0].steps, result.tasks[0].repeats) == (3, 2)
    assert "infer_throughput_ci95_halfwidth_pct" not in result.metrics()  # two windows have no 95 % interval


def test_a_second_run_of_the_same_model_reads_its_flop_counts_back(monkeypatch):
    """Counting FLOPs runs the real model under FlopCounterMode (seconds of a CPU run of ViT-B, again in every
    sweep child); the count is kept in the user's cache beside the batch cache, keyed by what it depends on."""
    from vitreg.bench import runner

    counted = []
    real_forward, real_train = runner.forward_flops_per_image, runner.train_flops_per_image
    monkeypatch.setattr(runner, "forward_flops_per_image",
                        lambda *a, **kw: counted.append("forward") or real_forward(*a, **kw))
    monkeypatch.setattr(runner, "train_flops_per_image", lambda *a, **kw: counted.append("train") or real_train(*a, **kw))
    first, _ = _run(steps=1, repeats=1)
    second, _ = _run(steps=1, repeats=1)
    assert counted == ["forward", "train"]  # the first run counted; the second read both counts back
    for name in ("fwd_gflops_per_img", "train_gflops_per_img"):
        assert second.metrics()[name] == first.metrics()[name] > 0
    other, _ = _run(steps=1, repeats=1, task="infer", img_size=48)  # another size is other work: counted
    assert counted == ["forward", "train", "forward"] and other.metrics()["fwd_gflops_per_img"] > \
        first.metrics()["fwd_gflops_per_img"]


def test_the_table_shows_only_the_columns_this_device_fills():
    """On a CPU: no compile s, peak alloc, MFU, J/img or SM MHz column of ``-`` only (issue 38)."""
    result, _ = _run(task="infer")
    header, _, *rows = report_table(result).splitlines()[1:]
    assert not any(name in header for name in ("compile s", "peak alloc", "MFU", "J/img", "SM MHz"))
    assert "img/s median" in header and "TFLOP/s" in header
    assert all(" - " not in f" {row} " for row in rows)  # every column left has its value


def test_a_suspect_figure_is_flagged_on_its_row():
    """Busy host, throttled, a window spread over 5 % or the precision target missed: said on the table's row
    (issue 38: a 3.5x slower figure was printed without a word); a clean run has no flags column."""
    import dataclasses

    result, _ = _run()
    infer, train = result.tasks
    assert "flags" not in report_table(dataclasses.replace(result, tasks=(
        dataclasses.replace(infer, window_tags={"busy_host": "false"}), dataclasses.replace(train, window_tags={}))))
    suspect = {"busy_host": "true", "throttle": "hw_thermal,sw_power_cap", "spread_over_target": "true",
               "timing_stop": "max_time"}
    flagged = dataclasses.replace(result, tasks=(dataclasses.replace(infer, window_tags=suspect),
                                                 dataclasses.replace(train, window_tags={"throttle": "sw_power_cap"})))
    header, _, infer_row, train_row = report_table(flagged).splitlines()[1:]
    assert header.endswith("flags")
    assert infer_row.endswith("busy host, throttled, wide spread, precision missed") and train_row.endswith("-")
    assert flagged.flags == ["busy host", "throttled", "wide spread", "precision missed"]


def test_eager_fp8_is_said_in_one_line_with_its_fix_and_tagged(monkeypatch):
    """amp=fp8 with compile=off: one console line says it runs at about half of bf16's speed on an H200 and names
    --compile default; the infer task is tagged and flagged (issue 37). torchao's quantization is stood in for by
    the bf16 weights it starts from (fp8 needs a GPU with FP8 tensor cores and torchao, absent here)."""
    import torch

    from vitreg.bench import runner
    from vitreg.hardware.runtime import Runtime

    monkeypatch.setattr(runner, "prepare_model", lambda model, precision: model.to(torch.bfloat16))
    spec = BenchSpec(model="test_vit", img_size=32, batch_size=2, warmup=2, steps=2, repeats=2, task="infer",
                     amp="fp8")
    messages = []
    result = run_benchmark(spec, resolve_hardware("auto", CPU), Runtime("cpu", "fp8", "off"),
                           progress=messages.append)
    said = [m for m in messages if m.startswith("eager fp8")]
    assert len(said) == 1 and "\n" not in said[0] and "half of bf16's speed on an H200" in said[0]
    assert "4,866 vs 8,740 img/s" in said[0] and "--compile default" in said[0]
    assert result.tags()["infer_eager_fp8"] == "true" and result.flags[-1] == "eager fp8"  # (a loaded host: more)
    assert Runtime("cuda", "fp8-rowwise", "default", "aot_eager").eager_fp8  # nothing fuses without inductor
    assert not Runtime("cuda", "fp8", "default").eager_fp8 and not Runtime("cuda", "bf16", "off").eager_fp8


def test_the_run_s_warnings_are_one_line():
    """A window spread over 5 % and the precision target missed: one ``warning:`` line says both (issue 38)."""
    import dataclasses

    from vitreg.bench.results import run_warning

    result, _ = _run(task="infer")
    (task,) = result.tasks
    both = dataclasses.replace(task, window_tags={"spread_over_target": "true", "timing_stop": "max_time"})
    warning = run_warning(dataclasses.replace(result, tasks=(both,)))
    assert warning.count("warning:") == 1 and "\n" not in warning
    assert "window spread over 5%" in warning and "the precision target 1 % was not reached" in warning
    assert run_warning(dataclasses.replace(result, tasks=(dataclasses.replace(task, window_tags={}),))) is None


def test_a_kept_batch_is_checked_by_its_warm_up_and_one_that_runs_out_of_memory_is_searched_again(monkeypatch):
    """Issue 44: a kept batch (this machine's cache, or the package's measurement) costs no probe: the task's own
    first call and warm-up check it. One that runs out of memory there is forgotten, said, and searched again."""
    import torch

    from vitreg.bench import runner
    from vitreg.measure import batch_cache
    from vitreg.measure.autobatch import SearchLimits

    monkeypatch.setitem(runner.search_batch.__globals__["SEARCH_LIMITS"], "cpu",
                        SearchLimits(start=2, limit=4, max_probes=2, max_seconds=60.0, probe_steps=1, probe_warmup=1))
    spec = BenchSpec(model="test_vit", img_size=32, batch_size="auto", task="infer")
    rt = resolve_runtime("auto", "off", "inductor", CPU)
    batch_cache.keep(batch_cache.key_for(spec, rt, "infer"), 16, "8:100,16:120")
    timed = runner._timed_task

    def out_of_memory_at_16(task, step, bench, batch_size, choice, flops):
        if batch_size == 16:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return timed(task, step, bench, batch_size, choice, flops)

    monkeypatch.setattr(runner, "_timed_task", out_of_memory_at_16)
    result, messages = _run(batch_size="auto", task="infer")
    task = result.tasks[0]
    assert task.batch_size in (2, 4) and task.batch_choice.source == "probe"
    assert any("batch 16, kept in" in m and "the warm-up checks it" in m for m in messages)
    assert any("the kept batch 16 no longer fits" in m for m in messages)
    assert batch_cache.lookup(batch_cache.key_for(spec, rt, "infer"))[0].batch == task.batch_size  # kept anew


def _train_step(amp: str, batch: int = 2):
    """vitreg's training step as run_train_step builds it, on test_vit at 32 px, with what it trains."""
    import torch

    from vitreg.bench.runner import _train_steps
    from vitreg.hardware.runtime import Runtime
    from vitreg.models.factory import create_model

    torch.manual_seed(0)
    model, info = create_model("test_vit", 32)
    runtime = Runtime("cpu", amp, "off")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model.train(), opt, _train_steps(model, opt, runtime.grad_scaler(), info, runtime, True)(batch)


def test_the_train_step_marks_its_forward_backward_and_optimizer_phases_in_order():
    """Where a GPU run reads each phase's peak memory (train_peak_mem_<phase>_mb): after the forward no gradient is
    held (set to None at the step's start, as timm's benchmark.py), after the backward each weight has one, and only
    the optimizer phase moves the weights."""
    model, _, step = _train_step("off")
    step()  # gradients of a first step, which the next step drops before its forward
    weights = [p.detach().clone() for p in model.parameters()]
    seen = []

    def mark(phase):
        moved = any(not w.equal(p) for w, p in zip(weights, model.parameters()))
        seen.append((phase, sum(p.grad is not None for p in model.parameters()), moved))

    step(mark)
    n = len(weights)
    assert seen == [("forward", 0, False), ("backward", n, False), ("optimizer", n, True)]


def test_the_train_step_holds_what_a_plain_timm_loop_holds():
    """Memory parity on the CPU (issue 46): under bf16 autocast vitreg's step saves for its backward the same
    tensors, byte for byte, as timm benchmark.py's step (zero_grad, forward and loss under autocast, backward,
    AdamW), and keeps neither the model's output nor the loss once it returns."""
    import gc
    import weakref

    import torch

    def saved_bytes(run):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return sum(storages.values())

    model, opt, step = _train_step("bf16", batch=8)
    outputs = []
    model.register_forward_hook(lambda _m, _i, out: outputs.append(weakref.ref(out)))
    vitreg = saved_bytes(step)
    gc.collect()
    assert outputs and outputs[-1]() is None  # the output (and the loss made of it) went with the step

    x, target = torch.randn(8, 3, 32, 32), torch.randint(0, 1000, (8,))

    def timm_step():  # timm's TrainBenchmarkRunner._step, as written there
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(x)
            torch.nn.CrossEntropyLoss()(output, target).backward()
        opt.step()

    assert vitreg == saved_bytes(timm_step) > 0


class _FakeGpu:
    """A GPU that runs queued work on a thread: ``launch(host_s, gpu_s)`` spends ``host_s`` on the host and queues
    ``gpu_s`` of device time; ``synchronize`` waits for the queue, as torch.cuda.synchronize does."""

    def __init__(self):
        import queue
        import threading

        self.work, self.idle = queue.Queue(), threading.Event()
        self.idle.set()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        import time

        while True:
            gpu_s = self.work.get()
            time.sleep(gpu_s)
            if self.work.empty():
                self.idle.set()

    def launch(self, host_s, gpu_s):
        import time

        time.sleep(host_s)
        self.idle.clear()
        self.work.put(gpu_s)

    def synchronize(self, device="cuda"):
        self.idle.wait()


def test_a_step_whose_launches_take_its_time_is_launch_bound_and_one_the_gpu_carries_is_not(monkeypatch):
    """Issue 44: bs32 bf16 eager ViT-B on an H100 scattered +-26 % over 60 s of 1-4 s windows: the GPU waited on
    Python's kernel launches, and the host's speed moved the figure. The check times one step's launches from an
    idle GPU against the whole step."""
    from vitreg.bench import runner

    gpu = _FakeGpu()
    monkeypatch.setattr(runner, "synchronize", gpu.synchronize)
    # (the host's part long against a thread's wake-up on a loaded machine)
    assert runner._launch_bound(lambda: gpu.launch(0.04, 0.0005), "cuda")  # launches are the step
    assert not runner._launch_bound(lambda: gpu.launch(0.001, 0.04), "cuda")  # the GPU's work is
    assert not runner._launch_bound(lambda: None, "cpu")


def test_a_launch_bound_task_stops_at_six_windows_says_why_and_is_flagged(monkeypatch):
    from vitreg.bench import runner
    from vitreg.bench.results import precision_warning

    scatter = (1.0, 1.3, 0.8, 1.2, 0.7, 1.25, 0.9, 1.1)  # +-25 %: no window length averages the host away
    fake, calls = _windows_of(lambda i: 10.0 * scatter[i % len(scatter)])
    monkeypatch.setattr(runner, "time_window", fake)
    monkeypatch.setattr(runner, "_launch_bound", lambda step, device: True)
    monkeypatch.setattr(runner, "LAUNCH_CHECKED_S", 1e9)  # whatever the loaded CPU's step takes
    result, messages = _run(task="infer", warmup=2, steps=0, repeats=0, window_min_s=0.05)
    task = result.tasks[0]
    assert len(calls) - sum(1 for m in messages if "not a sample" in m) == 6  # no longer windows timed again
    assert task.window_tags["timing_stop"] == "launch_bound" and task.repeats == 6
    assert {"launch-bound", "precision missed"} <= set(task.flags)
    assert any(m.startswith("infer: launch-bound: the GPU waits on the host's kernel launches") for m in messages)
    assert "cuda_graph=true times the GPU alone" in precision_warning(result)
