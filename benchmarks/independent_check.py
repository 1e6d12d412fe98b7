"""An independent measurement of the same configuration, with no vitreg code.

The simplest honest CUDA-event loop: build the timm (or torchvision) model, make one synthetic batch
on the GPU, warm up, then time ``iters`` back-to-back iterations between two CUDA events, ``repeats``
times, and report the median images per second. vitreg's figure for the same model, batch, precision
and compile mode must agree with this one within 2 %.

    python benchmarks/independent_check.py --model vit_base_patch16_224 --batch-size 256 --task infer --amp bf16
    python benchmarks/independent_check.py --model deit_small_patch16_224 --batch-size 256 --task train --compile default

Prints one JSON line per measurement.
"""

import argparse
import json
import statistics
import time

import torch


def build(name, img_size):
    if name.startswith("torchvision:"):
        import torchvision

        return getattr(torchvision.models, name.split(":", 1)[1])(weights=None)
    import timm

    kwargs = {"img_size": img_size} if img_size else {}
    return timm.create_model(name, pretrained=False, **kwargs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--task", choices=["infer", "train"], default="infer")
    ap.add_argument("--amp", choices=["off", "bf16", "fp16"], default="bf16")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build(args.model, args.img_size).to(dev)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    net = model if args.compile == "off" else torch.compile(
        model, **({} if args.compile == "default" else {"mode": args.compile}))
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=dev)
    y = torch.randint(0, 1000, (args.batch_size,), device=dev)

    if args.task == "infer":
        model.eval()

        def step():
            with torch.inference_mode(), torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                net(x)
    else:
        model.train()
        if hasattr(model, "set_distilled_training") and getattr(model, "dist_token", None) is not None:
            model.set_distilled_training(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16")
        ce = torch.nn.CrossEntropyLoss()

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                out = net(x)
                loss = sum(ce(o, y) for o in out) / len(out) if isinstance(out, tuple) else ce(out, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        step()
    torch.cuda.synchronize()

    rates = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            step()
        end.record()
        end.synchronize()
        rates.append(args.batch_size * args.iters / (start.elapsed_time(end) / 1e3))
    print(json.dumps({"check": "independent", "model": args.model, "task": args.task, "batch_size": args.batch_size,
                      "amp": args.amp, "compile": args.compile, "img_per_s_median": statistics.median(rates),
                      "img_per_s_min": min(rates), "img_per_s_max": max(rates), "first_call_s": first_s,
                      "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
