"""A GPU smoke check of issue 13's speed levers as vitreg implements them (not a benchmark of record).

One JSON line per check: the SDPA check and the backend each ``sdpa=`` choice actually ran (eager
and compiled), short eager throughput per precision mode, the ``batch_size=auto`` search, a
profiler trace, and (``--part cache``, run twice in fresh processes on one folder) the compile
cache state and the first-call time.

    python benchmarks/levers_smoke.py --part levers --out /tmp/levers
    python benchmarks/levers_smoke.py --part cache --cache-dir /tmp/vitreg-cc   # twice: cold, then warm
"""

import argparse
import json
import time

import torch


def say(**fields):
    print(json.dumps(fields), flush=True)


def vit_b(dtype=None):
    import timm

    model = timm.create_model("vit_base_patch16_224", pretrained=False).cuda().eval()
    return model.to(dtype) if dtype else model


def infer_step(net, batch, dtype, precision):
    from vitreg.hardware.precision import autocast

    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)

    def step():
        with torch.inference_mode(), autocast(precision, "cuda"):
            net(x)
    return step


def sdpa_checks():
    from vitreg.errors import VitregError
    from vitreg.hardware.precision import resolve_precision
    from vitreg.hardware.sdpa import SDPA_CHOICES, check_backend, detect_backend, sdpa_context

    precision = resolve_precision("bf16-weights", "cuda")
    model = vit_b(torch.bfloat16)
    for choice in SDPA_CHOICES:
        for dtype in (torch.bfloat16, torch.float32):
            try:
                check_backend(choice, "cuda", dtype, 12, 64, 197, backward=True)
                verdict = "ok"
            except VitregError as err:
                verdict = str(err)
            say(check="sdpa_check", sdpa=choice, dtype=str(dtype), verdict=verdict)
        with sdpa_context(choice):
            say(check="sdpa_ran_eager", sdpa=choice, ran=detect_backend(infer_step(model, 8, torch.bfloat16,
                                                                                  precision), "cuda"))
    from vitreg.console import ticking

    for choice in ("auto", "math"):
        torch._dynamo.reset()
        with sdpa_context(choice):
            step = infer_step(torch.compile(model), 8, torch.bfloat16, precision)
            with ticking(f"compiling (default, sdpa={choice})", every_s=10):
                step()
            say(check="sdpa_ran_compiled", sdpa=choice, ran=detect_backend(step, "cuda"))


def precision_rates():
    from vitreg.errors import VitregError
    from vitreg.hardware.precision import math_mode, prepare_model, resolve_precision

    for amp in ("off", "tf32", "bf16", "bf16-weights", "fp16-weights", "fp8"):
        try:
            precision = resolve_precision(amp, "cuda", capability=torch.cuda.get_device_capability())
        except VitregError as err:
            say(check="precision", amp=amp, refused=str(err))
            continue
        with math_mode(precision):
            rate = eager_rate(prepare_model(vit_b(), precision), precision, 256)
        say(check="precision", amp=amp, label=precision.label, eager_infer_img_per_s_bs256=round(rate))


def eager_rate(model, precision, batch):
    from vitreg.hardware.precision import input_dtype
    from vitreg.measure.autobatch import timed_probe

    return timed_probe(lambda b: infer_step(model, b, input_dtype(precision), precision), "cuda",
                       steps=10, warmup=3)(batch)


def autobatch(out):
    from vitreg.hardware.precision import resolve_precision
    from vitreg.measure.autobatch import SEARCH_LIMITS, find_batch, timed_probe
    from vitreg.measure.traces import trace_steps

    precision = resolve_precision("bf16", "cuda")
    model = vit_b()
    t0 = time.perf_counter()
    choice = find_batch(timed_probe(lambda b: infer_step(model, b, torch.float32, precision), "cuda"),
                        SEARCH_LIMITS["cuda"])
    say(check="batch_auto", chosen=choice.batch, probes=choice.summary(), stopped=choice.stopped,
        seconds=round(time.perf_counter() - t0, 1))
    files = trace_steps(infer_step(model, 64, torch.float32, precision), 3, "cuda", out)
    say(check="trace", trace_bytes=files.trace.stat().st_size, top=files.ops_table.read_text().splitlines()[3][:120])


def cache_part(folder):
    from vitreg.hardware.compile_cache import CacheProbe, use_compile_cache
    from vitreg.hardware.precision import resolve_precision

    use_compile_cache(folder)
    precision = resolve_precision("bf16", "cuda")
    step = infer_step(torch.compile(vit_b()), 64, torch.float32, precision)
    probe, t0 = CacheProbe().start(), time.perf_counter()
    step()
    torch.cuda.synchronize()
    say(check="compile_cache", state=probe.state(), hits_misses=probe.hits_and_misses(),
        first_call_s=round(time.perf_counter() - t0, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["levers", "cache"], default="levers")
    ap.add_argument("--cache-dir", default="/tmp/vitreg-compile-cache")
    ap.add_argument("--out", default="levers-profile")
    args = ap.parse_args()
    say(check="env", gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
    if args.part == "cache":
        return cache_part(args.cache_dir)
    sdpa_checks()
    precision_rates()
    autobatch(args.out)


if __name__ == "__main__":
    main()
