"""Why does timm's benchmark.py lead on small models? Bisect its workload against a plain loop, in one process.

Builds the model through timm's own ``InferenceBenchmarkRunner`` (benchmarks/timm_benchmark.py, a copy of
timm's benchmark.py kept beside this file on the GPU machine only, never committed), runs its ``run()`` for
timm's own figure, then times with one CUDA-event loop (the same for every variant):

  timm        timm's compiled model and timm's input (made by run() inside inference_mode)
  plain       timm.create_model(name) -> cuda -> eval -> torch.compile; input made outside inference_mode
  plain+imx   the plain model, the input made inside inference_mode
  timm+px     timm's model, the plain input

and, for ``timm`` and ``plain``, a torch.profiler table of the top kernels (CUDA time and count) and the
state that differs between the two models (repr, fused attention, dtypes). Importing timm's script sets
TF32 matmuls and the cuDNN autotuner globally, so every variant here runs with them (non-causes per issue 23).
Each variant's GPU clock and power are sampled (NVML) while its windows run.

    python benchmarks/timm_gap.py --model deit_small_patch16_224 --batch-size 1024 --out $OUT
Prints one JSON line per variant; writes <out>/profile-<model>-<variant>.txt.
"""

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


class ClockSampler:
    """Mean SM clock (MHz) and power (W) of GPU 0 while the block runs, sampled every 20 ms by NVML."""

    def __enter__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.samples, self.stop = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), [], False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def _loop(self):
        n = self.nvml
        while not self.stop:
            self.samples.append((n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM),
                                 n.nvmlDeviceGetPowerUsage(self.handle) / 1000))
            time.sleep(0.02)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()

    def means(self):
        if not self.samples:
            return None, None
        return statistics.mean(s[0] for s in self.samples), statistics.mean(s[1] for s in self.samples)


def rates(net, x, iters, repeats, warmup=10):
    """Median img/s over ``repeats`` windows of ``iters`` back-to-back forward passes between CUDA events."""
    def step():
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            net(x)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        end.synchronize()
        out.append(x.shape[0] * iters / (start.elapsed_time(end) / 1e3))
    return out


def profiled(net, x, steps=5):
    """torch.profiler's key averages of ``steps`` bf16 forward passes, after one unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        net(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                net(x)
            torch.cuda.synchronize()
    return prof.key_averages()


def cuda_kernels(averages) -> list:
    return [e for e in averages if e.device_type.name == "CUDA"]


def kernel_table(net, x, path, steps=5):
    """Top CUDA kernels of ``steps`` forward passes, written to ``path``; returns (kernel count, CUDA ms/step)."""
    averages = profiled(net, x, steps)
    events = cuda_kernels(averages)
    total_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
    count = sum(e.count for e in events) / steps
    path.write_text(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=90))
    return count, total_ms


def model_facts(model):
    attn = model.blocks[0].attn if hasattr(model, "blocks") else None
    return {"fused_attn": getattr(attn, "fused_attn", None), "dtype": str(next(model.parameters()).dtype),
            "global_pool": getattr(model, "global_pool", None), "training": model.training,
            "requires_grad": next(model.parameters()).requires_grad, "repr_len": len(repr(model))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deit_small_patch16_224")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    out = Path(args.out)
    import timm
    import timm_benchmark as tb  # sets TF32 + cudnn.benchmark, as timm's benchmark does

    runner = tb.InferenceBenchmarkRunner(model_name=args.model, precision="amp_bfloat16", torchcompile="inductor",
                                         batch_size=args.batch_size, num_warm_iter=10, num_bench_iter=40,
                                         gp=None)  # the CLI passes gp=None (timm drops None kwargs)
    timm_fig = runner.run()["samples_per_sec"]
    print(json.dumps({"variant": "timm.run()", "model": args.model, "img_per_s": timm_fig}), flush=True)
    plain = timm.create_model(args.model, pretrained=False).cuda().eval()
    plain_c = torch.compile(plain)
    px = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
    with torch.inference_mode():
        imx = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
    print(json.dumps({"facts_timm": model_facts(runner.model._orig_mod), "facts_plain": model_facts(plain),
                      "same_repr": repr(runner.model._orig_mod) == repr(plain),
                      "tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_benchmark": torch.backends.cudnn.benchmark,
                      "timm_input_inference": runner.example_inputs.is_inference()}), flush=True)
    if repr(runner.model._orig_mod) != repr(plain):
        (out / f"repr-{args.model}.txt").write_text(repr(runner.model._orig_mod) + "\n----\n" + repr(plain))
    variants = {"timm": (runner.model, runner.example_inputs), "plain": (plain_c, px),
                "plain+imx": (plain_c, imx), "timm+px": (runner.model, px)}
    for order in (1, 2):  # twice, interleaved: a drift in clocks shows as a difference between the rounds
        for name, (net, x) in variants.items():
            with ClockSampler() as clocks:
                r = rates(net, x, args.iters, args.repeats)
            mhz, watts = clocks.means()
            row = {"variant": name, "round": order, "model": args.model, "img_per_s_median": statistics.median(r),
                   "min": min(r), "max": max(r), "sm_mhz": mhz, "power_w": watts}
            if order == 1 and name in ("timm", "plain"):
                row["kernels_per_step"], row["cuda_ms_per_step"] = kernel_table(
                    net, x, out / f"profile-{args.model}-{name}.txt")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
