"""The runner on the CPU with a tiny model: typed results with the metric names the registry relies on."""

import json

import pytest

from vitreg.hardware.profiles import PROFILES, DetectedHardware, resolve_hardware
from vitreg.bench.runner import run_benchmark
from vitreg.hardware.runtime import resolve_runtime
from vitreg.config.spec import BenchSpec

CPU = DetectedHardware("cpu", "CPU (test)", 1, PROFILES["cpu"])


def _run(**kw):
    spec = BenchSpec(model="test_vit", img_size=32, batch_size=2, warmup=2, steps=3, repeats=2, **kw)
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
    assert t.throughput.n == 2 and t.throughput.min <= t.throughput.median <= t.throughput.max
    assert t.iter_ms.n == 2 * 3  # every timed iteration of every window, warm-up excluded
    doc = json.loads(json.dumps(result.to_dict()))
    assert [x["task"] for x in doc["tasks"]] == ["infer", "train"]
    assert doc["tasks"][0]["metrics"]["infer_throughput_img_per_s"] == m["infer_throughput_img_per_s"]
    assert any("window 2/2" in msg for msg in messages)  # progress is reported


def test_compile_time_is_reported_apart():
    result, messages = _run(task="infer", compile="default", compile_backend="eager")
    m = result.metrics()
    assert m["infer_compile_time_s"] > 0
    assert any("compiling" in msg for msg in messages)


def test_distilled_deit_trains_both_heads():
    spec = BenchSpec(model="deit_tiny_distilled_patch16_224", img_size=32, batch_size=2, warmup=1, steps=2,
                     repeats=1, task="train")
    hw = resolve_hardware("auto", CPU)
    rt = resolve_runtime("off", "off", "inductor", CPU)
    result = run_benchmark(spec, hw, rt, progress=lambda _: None)
    assert result.model.distilled and result.metrics()["train_throughput_img_per_s"] > 0


def test_mfu_against_a_mismatched_label_uses_that_peak():
    spec = BenchSpec(model="test_vit", img_size=32, batch_size=2, warmup=1, steps=2, repeats=1, task="infer")
    hw = resolve_hardware("a100", CPU, allow_mismatch=True)
    rt = resolve_runtime("off", "off", "inductor", CPU)
    m = run_benchmark(spec, hw, rt, progress=lambda _: None).metrics()
    assert m["infer_mfu"] == pytest.approx(m["infer_achieved_tflops"] / 19.5)
