"""Energy per image measured with no vitreg code: a plain NVML loop beside vitreg's figure.

The same model, batch, precision and compile mode as a vitreg bench run, built and stepped as
benchmarks/independent_check.py does (its helpers, no vitreg import). Around each of ``repeats`` windows of
``iters`` back-to-back steps it reads NVML's total-energy counter (mJ since driver load) after a synchronize
on both sides, so J/img = energy difference / images of the window; meanwhile a thread samples power, SM
clock, temperature and the clock-event (throttle) reasons every ``--sample-ms`` and writes them, one JSON
line each, to ``--samples`` (the power cap shown as it happens). Prints one JSON line: the windows' J/img
(median), mean power, img/s, and how many samples the software power cap held. vitreg's
``<task>_energy_j_per_img`` for the same configuration must agree within 5 %.

    python benchmarks/energy_check.py --task infer --batch-size 256 --compile default --iters 200
    python benchmarks/energy_check.py --task train --batch-size 1536 --compile default --iters 12 --samples s.jsonl

Run it on a GPU; ``--agree RUN_FIGURE`` (vitreg's J/img) adds the ratio and whether it is within 5 %.
"""

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import pynvml
import torch

sys.path.insert(0, str(Path(__file__).parent))
from independent_check import AUTOCAST, build, sdpa_backend, set_precision  # noqa: E402

SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap
AGREEMENT = 0.05


def make_step(model, net, task, amp, batch_size):
    x = torch.randn(batch_size, 3, 224, 224, device="cuda", dtype=set_precision(model, amp, task))
    dtype = AUTOCAST.get(amp)
    if task == "infer":
        model.eval()

        def step():
            with torch.inference_mode(), torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                net(x)
        return step
    model.train()
    y = torch.randint(0, 1000, (batch_size,), device="cuda")
    opt, ce = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = ce(net(x), y)
        loss.backward()
        opt.step()
    return step


class Sampler:
    """Power, SM clock, temperature and throttle reasons every ``period`` s, in a thread, to a JSONL file."""

    def __init__(self, handle, period, path):
        self.handle, self.period, self.rows, self.t0 = handle, period, [], time.monotonic()
        self.out = open(path, "w") if path else None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self.stop.wait(self.period):
            row = {"t": round(time.monotonic() - self.t0, 3),
                   "power_w": pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3,
                   "sm_mhz": pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM),
                   "temp_c": pynvml.nvmlDeviceGetTemperature(self.handle, pynvml.NVML_TEMPERATURE_GPU),
                   "reasons": reasons(self.handle)}
            self.rows.append(row)
            if self.out:
                self.out.write(json.dumps(row) + "\n")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        if self.out:
            self.out.close()


def window(step, handle, iters, batch_size):
    """(J/img, W, img/s) of one window: energy counter and host clock read after a synchronize on both sides."""
    torch.cuda.synchronize()
    e0, t0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    e1, t1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter()
    joules = (e1 - e0) / 1e3
    return joules / (batch_size * iters), joules / (t1 - t0), batch_size * iters / (t1 - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--task", choices=["infer", "train"], default="infer")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--amp", default="bf16")
    ap.add_argument("--compile", default="default")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sample-ms", type=float, default=100)
    ap.add_argument("--samples", default=None, help="JSONL file for the power/clock/throttle samples")
    ap.add_argument("--agree", type=float, default=None, help="vitreg's J/img for the same configuration")
    args = ap.parse_args()

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    model = build(args.model, 224).cuda()
    net = model if args.compile == "off" else torch.compile(model, **(
        {} if args.compile == "default" else {"mode": args.compile}))
    step = make_step(model, net, args.task, args.amp, args.batch_size)
    with sdpa_backend("auto"):
        for _ in range(args.warmup):
            step()
        with Sampler(handle, args.sample_ms / 1e3, args.samples) as sampler:
            windows = [window(step, handle, args.iters, args.batch_size) for _ in range(args.repeats)]
    capped = sum(bool(r["reasons"] & SW_POWER_CAP) for r in sampler.rows)
    clocks = [r["sm_mhz"] for r in sampler.rows]
    out = {"check": "energy-independent", "model": args.model, "task": args.task, "batch_size": args.batch_size,
           "amp": args.amp, "compile": args.compile, "iters": args.iters, "repeats": args.repeats,
           "j_per_img": statistics.median(w[0] for w in windows), "j_per_img_windows": [w[0] for w in windows],
           "power_w": statistics.median(w[1] for w in windows), "img_per_s": statistics.median(w[2] for w in windows),
           "samples": len(sampler.rows), "power_capped_samples": capped,
           "sm_mhz_median": statistics.median(clocks) if clocks else None,
           "sm_mhz_min": min(clocks, default=None), "sm_mhz_max": max(clocks, default=None),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.agree is not None:
        out["vitreg_j_per_img"] = args.agree
        out["ratio"] = args.agree / out["j_per_img"]
        out["within_5pct"] = abs(out["ratio"] - 1) <= AGREEMENT
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
