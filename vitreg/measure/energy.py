"""Energy, throttling and contention over exactly the timed windows (read at their edges, never inside).

Energy is NVML's total-energy counter at each window's edges (power samples without one); between them a thread
samples the throttle reasons, SM clock, power and temperature; the edges also count other GPU processes and the
host's CPU time beside this process's. :class:`WindowMeter` reads through a :class:`ReadingSource`: NVML, the host
alone, or a trace recorded with ``VITREG_ENERGY_TRACE=path`` (tests replay a real H200's readings). On the CPU the
energy figures are absent, never zero.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Protocol

import psutil

from vitreg.environment import nvml_text
from vitreg.errors import VitregError
from vitreg.measure.timing import STOP_LAUNCH_BOUND, STOPS_MISSED

TRACE_ENV = "VITREG_ENERGY_TRACE"
SAMPLE_S = 0.05  # the sampler's period: a few samples in the shortest trusted window, light on the GIL
REFRESH_S = 0.1  # the energy counter's slowest refresh period (NVML: 20-100 ms)
MAX_ENERGY_ERROR = 0.1  # the largest error from the counter's refresh that an energy figure may carry
MIN_ENERGY_WINDOW_S = REFRESH_S / MAX_ENERGY_ERROR  # 1 s

#: NVML's clock-event (throttle) reason bits, named as the tags spell them
REASONS = {0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clock"}
POWER_CAP = "sw_power_cap"
# Heat and hardware brakes are never a GPU's normal state under load: always flagged. The software power cap
# is (an H200 running ViT-B sits at its 700 W cap in every sample), so it is flagged only where runs differ.
ALWAYS_FLAGGED = ("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
# Not slowdowns of work in flight: idle between windows, clocks the admin set, boost sync, display
NOT_THROTTLE = ("gpu_idle", "app_clocks", "sync_boost", "display_clock")
# CPUs' worth of work by other processes during a window that makes a host busy: half a core, or a tenth
# of the host's cores on a big one (a loaded 2-core box gave the same configuration 3.5, 400 and 32 img/s)
BUSY_CPUS, BUSY_SHARE = 0.5, 0.1
# The windows' throughput CV a run should stay within: an H200 run's is 0.1 %, a loaded 2-core host's 46-91 %.
# Over it, the tags (``spread_over_target``: a stored name), the log and the last line say so. Not called a target:
# beside ``precision_pct`` (the median's 95 % interval) the two read as a contradiction (issue 38).
SPREAD_LIMIT = 0.05


#: What makes a figure suspect (:func:`suspect_flags`), in the words a run's name, `vitreg runs` and compare use.
FLAGS = ("busy host", "throttled", "wide spread", "precision missed", "eager fp8", "launch-bound")


def slowed(throttle: str) -> bool:
    """Whether a ``throttle`` tag (reasons, comma-separated) holds one that slows work (:data:`ALWAYS_FLAGGED`)."""
    return bool(set(throttle.split(",")) & set(ALWAYS_FLAGGED))


def suspect_flags(tags: dict) -> list[str]:
    """What makes a task's figure suspect (:data:`FLAGS`), from its tags without the task prefix; the power cap is
    heavy work's normal state, not a flag."""
    found = (tags.get("busy_host") == "true", slowed(tags.get("throttle") or "none"),
             tags.get("spread_over_target") == "true", tags.get("timing_stop") in STOPS_MISSED,
             tags.get("eager_fp8") == "true", tags.get("timing_stop") == STOP_LAUNCH_BOUND)
    return [flag for flag, on in zip(FLAGS, found) if on]


@dataclass(frozen=True)
class Reading:
    """What one read of the source saw. ``None``: not available on this device (or not read)."""

    t: float  # seconds on a monotonic clock
    edge: bool  # a window's edge (energy, processes and host CPU read) or a sample from the thread
    energy_mj: float | None = None  # the total-energy counter
    power_w: float | None = None
    sm_mhz: float | None = None
    temp_c: float | None = None
    reasons: int | None = None  # clock-event reason bits (REASONS)
    other_procs: int | None = None  # processes on the GPU besides this one (edges only)
    host_busy_s: float | None = None  # all CPUs' busy seconds since boot (/proc/stat; edges only)
    own_cpu_s: float | None = None  # this process's CPU seconds, children included (edges only)
    host_cpus: int | None = None  # the host's CPUs (edges only: what "busy" is judged against)

    def reason_names(self) -> frozenset:
        bits = self.reasons or 0
        return frozenset(name for bit, name in REASONS.items() if bits & bit)


class ReadingSource(Protocol):
    """The seam between the meter and the device: a live reader or a recorded trace."""

    name: str  # what it reads, for the progress line

    def read(self, edge: bool) -> Reading: ...

    def close(self) -> None: ...


def _host_cpu() -> dict:
    """All CPUs' busy seconds (all but idle and iowait) and this process's own CPU seconds, children included."""
    host = psutil.cpu_times()
    busy = sum(host) - host.idle - getattr(host, "iowait", 0.0)
    return {"host_busy_s": busy, "own_cpu_s": sum(os.times()[:4]), "host_cpus": os.cpu_count()}


class HostSource:
    """The CPU alone: host load at the edges, nothing from a GPU (energy figures stay absent)."""

    name = "host load only (no NVML)"

    def read(self, edge: bool) -> Reading:
        return Reading(time.monotonic(), edge, **(_host_cpu() if edge else {}))

    def close(self) -> None:
        pass


class NvmlSource:
    """One GPU through NVML, found by its UUID so CUDA_VISIBLE_DEVICES cannot make it read another (by index only
    where none renumbers them). Each call the device does not support reads None."""

    def __init__(self, uuid: str | None, index: int = 0):
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        try:
            self._handle = self._find(uuid, index)
        except Exception:
            pynvml.nvmlShutdown()
            raise
        self._pid = os.getpid()
        self.name = f"NVML {uuid or f'GPU {index}'}"
        # nvidia-ml-py renamed the throttle reasons the clock-event reasons; older ones have the old name only
        self._read_reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                              or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)

    def _find(self, uuid: str | None, index: int):
        nv = self._nvml
        if uuid:  # torch spells a UUID without NVML's "GPU-" and may differ in case: compare the hex digits
            want = uuid.lower().removeprefix("gpu-")
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                if nvml_text(nv.nvmlDeviceGetUUID(handle)).lower().removeprefix("gpu-") == want:
                    return handle
        if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
            return nv.nvmlDeviceGetHandleByIndex(index)
        raise LookupError(f"no NVML GPU has UUID {uuid}, and CUDA_VISIBLE_DEVICES renumbers them")

    def _try(self, call, *args):
        try:
            return call(self._handle, *args)
        except self._nvml.NVMLError:
            return None

    def _others(self):
        procs = self._try(self._nvml.nvmlDeviceGetComputeRunningProcesses)
        if procs is None:
            return None
        pids = [p.pid for p in procs]
        # In a container NVML may list host pids: then ours is not among them, and one of them is us.
        return len(pids) - 1 if self._pid not in pids and pids else sum(p != self._pid for p in pids)

    def read(self, edge: bool) -> Reading:
        nv = self._nvml
        power = self._try(nv.nvmlDeviceGetPowerUsage)
        reading = Reading(time.monotonic(), edge, power_w=power / 1e3 if power is not None else None,
                          sm_mhz=self._try(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
                          temp_c=self._try(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
                          reasons=self._try(self._read_reasons))
        if edge:
            reading = replace(reading, energy_mj=self._try(nv.nvmlDeviceGetTotalEnergyConsumption),
                              other_procs=self._others(), **_host_cpu())
        return reading

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def trace_lines(path) -> Iterator[dict]:
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not a trace line ({e.msg})") from None


class ReplaySource:
    """The readings of a recorded trace, in order, whatever was asked (tests drive the meter with it)."""

    def __init__(self, path):
        self.name = f"replay of {path}"
        self._readings = iter([Reading(**line["reading"]) for line in trace_lines(path) if "reading" in line])

    def read(self, edge: bool) -> Reading:
        try:
            return replace(next(self._readings), edge=edge)
        except StopIteration:
            raise ValueError("the trace has no more readings") from None

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class WindowMark:
    """One timed window's energy, throttle state and contention (None: not measurable here)."""

    seconds: float  # the window's GPU-timed length (CUDA events)
    images: int
    energy_j: float | None
    energy_source: str | None  # "counter", "power samples" or None
    reasons: frozenset  # every clock-event reason seen in the window (NOT_THROTTLE ones left out)
    power_capped: tuple  # per sample: was the software power cap holding the clocks
    sm_mhz: tuple  # per sample
    other_procs: int | None  # the most other processes seen on the GPU at either edge
    host_others_cpus: float | None  # CPUs' worth of work by other processes during the window
    host_cpus: int | None = None

    @property
    def power_w(self) -> float | None:
        return self.energy_j / self.seconds if self.energy_j is not None and self.seconds > 0 else None


def _energy(start: Reading, samples: list, end: Reading, seconds: float) -> tuple:
    if seconds < MIN_ENERGY_WINDOW_S:
        return None, None
    if start.energy_mj is not None and end.energy_mj is not None:
        return (end.energy_mj - start.energy_mj) / 1e3, "counter"
    powers = [r.power_w for r in samples if r.power_w is not None]
    return (statistics.fmean(powers) * seconds, "power samples") if powers else (None, None)


def _others_cpus(start: Reading, end: Reading):
    if None in (start.host_busy_s, end.host_busy_s, start.own_cpu_s, end.own_cpu_s) or end.t <= start.t:
        return None
    return max(0.0, (end.host_busy_s - start.host_busy_s) - (end.own_cpu_s - start.own_cpu_s)) / (end.t - start.t)


def mark_window(readings: list, seconds: float, images: int) -> WindowMark:
    """The mark of one window from its readings (start edge, samples, end edge). Throttle state and clocks are the
    samples' (else the end edge's): the start edge follows a synchronize, when the GPU may idle at lower clocks."""
    start, end = readings[0], readings[-1]
    samples = readings[1:-1] or [end]
    energy_j, source = _energy(start, readings[1:-1], end, seconds)
    reasons = frozenset().union(*(r.reason_names() for r in samples)) - frozenset(NOT_THROTTLE)
    procs = [r.other_procs for r in (start, end) if r.other_procs is not None]
    return WindowMark(seconds, images, energy_j, source, reasons,
                      tuple(POWER_CAP in r.reason_names() for r in samples if r.reasons is not None),
                      tuple(float(r.sm_mhz) for r in samples if r.sm_mhz is not None),
                      max(procs) if procs else None, _others_cpus(start, end), end.host_cpus)


class WindowMeter:
    """Reads the source at a window's edges (:meth:`start` before its first CUDA event, :meth:`stop` after its
    synchronize) and in between every ``sample_s`` from a thread (None: edges only; tests call :meth:`sample`)."""

    def __init__(self, source: ReadingSource, sample_s: float | None = SAMPLE_S, trace=None):
        self.source, self.sample_s, self._trace = source, sample_s, trace
        self._readings: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, record: dict) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps(record) + "\n")

    def sample(self, edge: bool = False) -> None:
        reading = self.source.read(edge)
        self._readings.append(reading)
        self._write({"reading": asdict(reading)})

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.sample_s):
            self.sample()

    def start(self) -> None:
        self._readings = []
        self.sample(edge=True)
        if self.sample_s:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample_until_stopped, name="vitreg-energy", daemon=True)
            self._thread.start()

    def stop(self, seconds: float, images: int, label: str = "") -> WindowMark:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.sample(edge=True)
        self._write({"window": {"label": label, "seconds": seconds, "images": images}})
        return mark_window(self._readings, seconds, images)

    def close(self) -> None:
        self.source.close()
        if self._trace is not None:
            self._trace.close()


def trace_windows(path) -> list[tuple[str, WindowMark]]:
    """``(label, mark)`` of each window of a recorded trace, marked as the run marked them."""
    out, readings = [], []
    for line in trace_lines(path):
        if "reading" in line:
            readings.append(Reading(**line["reading"]))
        elif "window" in line:
            w = line["window"]
            out.append((w.get("label", ""), mark_window(readings, float(w["seconds"]), int(w["images"]))))
            readings = []
    return out


def open_meter(device: str, index: int = 0) -> WindowMeter:
    """The meter of a run on ``device`` (on "cuda", torch's GPU ``index`` through NVML where it answers, else the
    host alone); with ``VITREG_ENERGY_TRACE`` set, every reading and window also goes to that file."""
    source: ReadingSource = HostSource()
    if device == "cuda":
        try:
            import torch

            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            source = NvmlSource(str(uuid) if uuid else None, index)
        except Exception as e:  # noqa: BLE001 - no pynvml, no driver library, an unknown UUID: no GPU readings
            source.name = f"host load only (NVML: {type(e).__name__}: {e})"
    path = os.environ.get(TRACE_ENV)
    try:
        trace = open(path, "a") if path else None
    except OSError as exc:
        raise VitregError(f"{TRACE_ENV}={path!r} cannot be written ({exc.strerror}): name a file in a folder "
                          f"that exists, or unset {TRACE_ENV}") from None
    return WindowMeter(source, SAMPLE_S if isinstance(source, NvmlSource) else None, trace)


@dataclass(frozen=True)
class TaskMarks:
    """A task's window marks, as figures (metric-table names) and tags (without the task prefix)."""

    marks: tuple = field(default_factory=tuple)
    rates: tuple = ()  # the windows' img/s, for the spread

    @property
    def spread(self) -> float | None:
        """The windows' throughput CV (std / mean), as the metric table's ``throughput_cv``."""
        if len(self.rates) < 2 or not statistics.fmean(self.rates):
            return None
        return statistics.pstdev(self.rates) / statistics.fmean(self.rates)

    def spread_note(self) -> str | None:
        """A line when the spread is over :data:`SPREAD_LIMIT`, naming what the windows met."""
        if self.spread is None or self.spread <= SPREAD_LIMIT:
            return None
        tags = self.tags()
        met = [f"busy host: {tags['host_load_beside_run']} CPUs beside the run"] if tags.get("busy_host") == "true" else []
        met += [f"{tags['gpu_other_processes']} other GPU process(es)"] if tags.get("gpu_other_processes", "0") != "0" else []
        met += [f"throttled: {tags['throttle']}"] if tags.get("throttle", "none") != "none" else []
        return (f"window spread {self.spread:.1%} over {SPREAD_LIMIT:.0%} (the windows' CV)"
                + (f" ({'; '.join(met)})" if met else ""))

    def figures(self) -> dict:
        """``window_power_w`` (none when a window has no energy), ``sm_clock_mhz`` (median of the samples) and
        ``power_capped_frac`` (share of the samples) where the device gave them."""
        out = {}
        powers = [m.power_w for m in self.marks]
        if self.marks and None not in powers:
            out["window_power_w"] = tuple(powers)
        clocks = [c for m in self.marks for c in m.sm_mhz]
        capped = [c for m in self.marks for c in m.power_capped]
        if clocks:
            out["sm_clock_mhz"] = statistics.median(clocks)
        if capped:
            out["power_capped_frac"] = sum(capped) / len(capped)
        return out

    def tags(self) -> dict[str, str]:
        """Throttle reasons and windows, energy source, other GPU processes, host load: what the device could read."""
        if not self.marks:
            return {}
        tags = {}
        if self.spread is not None:
            tags["spread_over_target"] = str(self.spread > SPREAD_LIMIT).lower()
        if any(m.power_capped or m.sm_mhz for m in self.marks):  # a GPU answered
            reasons = sorted(frozenset().union(*(m.reasons for m in self.marks)))
            tags["throttle"] = ",".join(reasons) or "none"
            tags["throttled_windows"] = f"{sum(bool(m.reasons) for m in self.marks)}/{len(self.marks)}"
        sources = {m.energy_source for m in self.marks if m.energy_source}
        if sources:
            tags["energy_source"] = ("NVML energy counter at window edges" if sources == {"counter"}
                                     else f"NVML power sampled every {SAMPLE_S * 1e3:.0f} ms")
        procs = [m.other_procs for m in self.marks if m.other_procs is not None]
        if procs:
            tags["gpu_other_processes"] = str(max(procs))
        loads = [m.host_others_cpus for m in self.marks if m.host_others_cpus is not None]
        if loads:
            tags["host_load_beside_run"] = f"{statistics.median(loads):.2f}"
            cpus = next((m.host_cpus for m in self.marks if m.host_cpus), None) or os.cpu_count() or 1
            tags["busy_host"] = str(busy(statistics.median(loads), cpus)).lower()
        return tags

    def short_windows(self) -> bool:
        """Windows too short for an energy figure on a device that reads energy or power."""
        return any(m.seconds < MIN_ENERGY_WINDOW_S for m in self.marks) and any(m.sm_mhz for m in self.marks)


def busy(others_cpus: float, cpus: int) -> bool:
    """Whether other processes' load beside a run makes the host busy (:data:`BUSY_CPUS`, :data:`BUSY_SHARE`)."""
    return others_cpus >= max(BUSY_CPUS, BUSY_SHARE * cpus)


def steps_for_energy(window_s: float, steps: int) -> int:
    """The steps that make a window of ``window_s`` s at ``steps`` last :data:`MIN_ENERGY_WINDOW_S` (and a quarter)."""
    return max(steps + 1, int(steps * MIN_ENERGY_WINDOW_S * 1.25 / max(window_s, 1e-9)) + 1)
