"""Energy per image, throttle and contention marks (vitreg.measure.energy), from readings replayed.

The reading source is a seam: the runner reads NVML (or the host alone), these tests replay a trace a real
H200 recorded through the same code (tests/data/h200_energy_trace.jsonl: ViT-B/16 bf16 compiled, two
inference windows at batch 256 and three training windows at batch 1536, from
benchmarks/results/h200-2026-12-02-energy/, where the same call's plain NVML loop agreed within 0.15 %).
"""

import json
import statistics
import sys
import types
from pathlib import Path

import pytest

from vitreg.measure import energy
from vitreg.measure.energy import (MIN_ENERGY_WINDOW_S, Reading, ReplaySource, TaskMarks, WindowMeter, mark_window,
                                   trace_windows)
from vitreg.measure.figures import Figures, Work

TRACE = Path(__file__).parent / "data" / "h200_energy_trace.jsonl"
# What the H200 run printed and logged for these windows (benchmarks/results/h200-2026-12-02-energy/log.txt)
LOGGED_INFER_J_PER_WINDOW = (0.06381, 0.06361)
LOGGED_TRAIN = {"energy_j_per_img": 0.18808539496527776, "mean_power_w": 695.9051353168608,
                "sm_clock_mhz": 1680.0, "power_capped_frac": 1.0}


def _task_figures(task: str, marks: list) -> Figures:
    """The runner's record of these windows: throughput from the windows' CUDA-timed length, then the marks'."""
    rates = tuple(m.images / m.seconds for m in marks)
    return Figures(task, {"window_img_per_s": rates, **TaskMarks(tuple(marks)).figures()}).summarized().completed(Work())


def test_the_h200_trace_replays_to_the_figures_that_run_logged():
    windows = trace_windows(TRACE)
    assert [label for label, _ in windows] == ["infer 1", "infer 2", "train 1", "train 2", "train 3"]
    infer = [m for label, m in windows if label.startswith("infer")]
    train = [m for label, m in windows if label.startswith("train")]
    assert [round(m.energy_j / m.images, 5) for m in infer] == list(LOGGED_INFER_J_PER_WINDOW)
    assert all(m.energy_source == "counter" for _, m in windows)
    figures = _task_figures("train", train)
    for name, logged in LOGGED_TRAIN.items():
        assert figures[name] == pytest.approx(logged, rel=1e-12), name
    assert figures["img_per_j"] == pytest.approx(1 / LOGGED_TRAIN["energy_j_per_img"])
    # the training run sat at the 700 W software power cap in every sample, clocks well under the 1,980 MHz max
    assert all(m.reasons == {"sw_power_cap"} for m in train) and max(c for m in train for c in m.sm_mhz) < 1980
    tags = TaskMarks(tuple(train)).tags()
    assert tags == {"throttle": "sw_power_cap", "throttled_windows": "3/3",
                    "energy_source": "NVML energy counter at window edges", "gpu_other_processes": "0",
                    "host_load_beside_run": tags["host_load_beside_run"], "busy_host": "false"}
    assert float(tags["host_load_beside_run"]) < 0.5  # a quiet 16-core host


def test_the_meter_marks_what_it_reads_and_its_trace_replays_the_same(tmp_path):
    """The meter driven through the seam (a replay of the first inference window: edge, samples, edge) marks
    the window as trace_windows does, and the trace it writes replays to the same mark."""
    lines = TRACE.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if '"window"' in line)
    recorded = json.loads(lines[end])["window"]
    source = ReplaySource(TRACE)
    written = tmp_path / "trace.jsonl"
    meter = WindowMeter(source, sample_s=None, trace=open(written, "w"))
    meter.start()
    for _ in range(end - 2):  # the readings between the two edges
        meter.sample()
    mark = meter.stop(recorded["seconds"], recorded["images"], "infer 1")
    meter.close()
    assert mark == trace_windows(TRACE)[0][1]
    assert trace_windows(written) == [("infer 1", mark)]
    assert mark.energy_j / mark.images == pytest.approx(LOGGED_INFER_J_PER_WINDOW[0], abs=5e-6)
    assert len(mark.sm_mhz) == end - 2  # the clock of every sample between the edges, none of the edges'


def _reading(t, edge=False, **kw):
    return Reading(t, edge, **kw)


def test_a_window_too_short_for_the_counter_has_no_energy_and_the_runner_is_told_which_steps_would():
    readings = [_reading(0, True, energy_mj=1000, sm_mhz=1800, reasons=4), _reading(0.05, sm_mhz=1800, reasons=4),
                _reading(0.5, True, energy_mj=1350, sm_mhz=1800, reasons=4)]
    mark = mark_window(readings, 0.5, 100)
    assert mark.energy_j is None and mark.power_w is None  # 0.5 s < 1 s: the refresh could be off by 20 %
    assert TaskMarks((mark,)).figures() == {"sm_clock_mhz": 1800.0, "power_capped_frac": 1.0}
    assert TaskMarks((mark,)).short_windows()
    assert energy.steps_for_energy(0.5, 30) * 0.5 / 30 >= MIN_ENERGY_WINDOW_S  # the steps it suggests suffice
    long = mark_window([*readings[:2], _reading(2.0, True, energy_mj=2400)], 2.0, 100)
    assert long.energy_j == pytest.approx(1.4) and long.power_w == pytest.approx(0.7)


def test_without_the_counter_power_samples_stand_in_and_say_so():
    readings = [_reading(0, True, power_w=100), _reading(0.5, power_w=300), _reading(1.0, power_w=500),
                _reading(2.0, True, power_w=100)]
    mark = mark_window(readings, 2.0, 1000)
    assert mark.energy_source == "power samples" and mark.energy_j == pytest.approx(800.0)  # mean 400 W x 2 s
    assert TaskMarks((mark,)).tags()["energy_source"] == "NVML power sampled every 50 ms"


def test_a_cpu_run_has_no_energy_figures_never_zero_and_says_how_busy_the_host_was():
    host = [_reading(0, True, host_busy_s=100.0, own_cpu_s=10.0, host_cpus=2),
            _reading(2.0, True, host_busy_s=104.0, own_cpu_s=12.0, host_cpus=2)]
    mark = mark_window(host, 2.0, 64)
    assert mark.energy_j is None and mark.host_others_cpus == pytest.approx(1.0)  # (4 - 2) CPU-s over 2 s
    marks = TaskMarks((mark,))
    assert marks.figures() == {}  # no power, clock or cap figure at all
    assert marks.tags() == {"host_load_beside_run": "1.00", "busy_host": "true"}
    figures = Figures("infer", {"window_img_per_s": (32.0,), **marks.figures()}).summarized().completed(Work())
    assert "energy_j_per_img" not in figures.metrics() and "infer_energy_j_per_img" not in figures.metrics()
    quiet = mark_window([host[0], _reading(2.0, True, host_busy_s=102.2, own_cpu_s=12.0, host_cpus=64)], 2.0, 64)
    assert TaskMarks((quiet,)).tags()["busy_host"] == "false"


def test_heat_and_brakes_are_marked_idle_is_not_and_the_cap_share_counts_samples():
    readings = [_reading(0, True, reasons=0x1, sm_mhz=345),  # the edge after a synchronize: idle, left out
                _reading(0.3, reasons=0x4, sm_mhz=1700), _reading(0.6, reasons=0x4 | 0x40, sm_mhz=1500),
                _reading(0.9, reasons=0x0, sm_mhz=1980), _reading(1.2, reasons=0x4, sm_mhz=1650),
                _reading(1.5, True, reasons=0x1, sm_mhz=1980)]
    mark = mark_window(readings, 1.5, 10)
    assert mark.reasons == {"sw_power_cap", "hw_thermal"}
    assert mark.power_capped == (True, True, False, True)
    figures = TaskMarks((mark, mark_window(readings[:1] + readings[3:], 1.5, 10))).figures()
    assert figures["power_capped_frac"] == pytest.approx(4 / 6)
    assert figures["sm_clock_mhz"] == statistics.median([1700, 1500, 1980, 1650, 1980, 1650])
    tags = TaskMarks((mark, mark_window(readings[:1] + readings[3:4] + readings[5:], 1.5, 10))).tags()
    assert tags["throttle"] == "hw_thermal,sw_power_cap" and tags["throttled_windows"] == "1/2"
    assert set(energy.ALWAYS_FLAGGED) & mark.reasons == {"hw_thermal"}


class _FakeNvml(types.ModuleType):
    """pynvml's calls the live source makes, on a fake GPU: 2 processes (this one and another), no energy counter."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    def __init__(self, pid):
        super().__init__("pynvml")
        self.pid = pid
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-0000-{h}".encode()

    def nvmlDeviceGetPowerUsage(self, h):
        return 650_000 + h

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1700

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 60

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        raise self.NVMLError("not supported")

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=self.pid), types.SimpleNamespace(pid=4242)]


def test_the_live_source_finds_its_gpu_by_uuid_reads_none_where_unsupported_and_counts_other_processes(monkeypatch):
    fake = _FakeNvml(__import__("os").getpid())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    source = energy.NvmlSource("0000-1")  # torch's spelling, without NVML's "GPU-": the second GPU
    edge = source.read(edge=True)
    assert edge.power_w == 650.001 and edge.energy_mj is None and edge.other_procs == 1
    assert edge.reason_names() == {"sw_power_cap"} and edge.host_cpus
    assert source.read(edge=False).other_procs is None  # the thread's samples skip the process list
    source.close()
    assert fake.shut
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(LookupError, match="renumbers"):
        energy.NvmlSource("no-such-uuid")


def test_a_spread_over_the_precision_target_is_said_with_what_the_windows_met():
    host = [_reading(0, True, host_busy_s=100.0, own_cpu_s=10.0, host_cpus=2),
            _reading(2.0, True, host_busy_s=104.0, own_cpu_s=12.0, host_cpus=2)]
    busy = TaskMarks((mark_window(host, 2.0, 64),) * 3, rates=(3.47, 400.0, 31.9))  # the loaded 2-core host
    assert busy.spread_note() == ("window spread 124.4% over 5% (the windows' CV) "
                                  "(busy host: 1.00 CPUs beside the run)")
    assert busy.tags()["spread_over_target"] == "true"
    quiet = TaskMarks(tuple(m for label, m in trace_windows(TRACE) if label.startswith("train")),
                      rates=(3683.2, 3679.6, 3677.4))  # the H200 training windows: 0.07 %
    assert quiet.spread_note() is None and quiet.tags()["spread_over_target"] == "false"


def test_a_run_whose_window_spread_is_over_the_limit_says_so_in_its_last_line(sqlite_store, monkeypatch, capsys,
                                                                               tmp_path):
    """A real tiny bench, in-process, with the spread limit at 0 (any spread is over it): the tag is set and the warning
    is the run's last line, after the line that says where the run is; an offline run ends on its spool's `vitreg
    sync` instead (that line must stay last), the warning just before it. At an unreachable limit no warning."""
    from vitreg.bench.job import bench

    options = dict(model="test_vit", task="infer", batch_size=2, warmup=1, steps=2, repeats=3, device="cpu")
    monkeypatch.setattr(energy, "SPREAD_LIMIT", 0.0)
    result = bench(options, experiment="spread")
    assert result.tasks[0].window_tags["spread_over_target"] == "true"
    *_, where, warning = capsys.readouterr().out.strip().splitlines()
    assert warning.startswith("warning: infer: window spread over") and "infer_spread_over_target" in warning
    assert where.startswith("logged run ") and "/runs/" in where
    monkeypatch.setenv("VITREG_SPOOL_DIR", str(tmp_path / "spools"))
    monkeypatch.setenv("VITREG_OFFLINE", "1")
    bench(options, experiment="spread")
    monkeypatch.delenv("VITREG_OFFLINE")
    *_, warning, last = capsys.readouterr().out.strip().splitlines()
    assert warning.startswith("warning: infer: window spread over") and "vitreg sync" in last
    monkeypatch.setattr(energy, "SPREAD_LIMIT", float("inf"))
    bench(options, experiment="spread")
    assert not any(line.startswith("warning:") for line in capsys.readouterr().out.splitlines())
