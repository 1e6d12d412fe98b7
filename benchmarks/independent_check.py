"""An independent measurement of the same configuration, with no vitreg code.

The simplest honest CUDA-event loop: build the timm (or torchvision) model, make one synthetic batch
on the GPU, warm up, then time ``iters`` back-to-back iterations between two CUDA events, ``repeats``
times, and report the median images per second. vitreg's figure for the same model, batch, precision
and compile mode must agree with this one within 2 %.

Precisions (``--amp``): ``off`` strict fp32; ``tf32`` fp32 with TF32 matmuls/convolutions; ``bf16`` /
``fp16`` autocast; ``bf16-weights`` / ``fp16-weights`` the weights and the batch cast, no autocast
(inference); ``fp8`` torchao float8 dynamic activation + weight, row-wise scales, on bf16 weights
(inference, needs torchao and compute capability >= 8.9); with ``--task train``, ``fp8`` is torchao's
float8 *training* (``convert_to_float8_training``, recipe ``--fp8-recipe``, under bf16 autocast; every
Linear whose dimensions are multiples of 16, so not a 1000-class head). ``--sdpa`` restricts attention to one
backend. ``--device cpu`` runs the same loop on the CPU with a host clock (for tests, not figures).

    python benchmarks/independent_check.py --model vit_base_patch16_224 --batch-size 256 --task infer --amp bf16
    python benchmarks/independent_check.py --model deit_small_patch16_224 --batch-size 256 --task train --compile default
    python benchmarks/independent_check.py --amp bf16-weights --sdpa flash --compile default

Prints one JSON line per measurement.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

CAST = {"bf16-weights": torch.bfloat16, "fp16-weights": torch.float16, "fp8": torch.bfloat16}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def build(name, img_size):
    if name.startswith("torchvision:"):
        import torchvision

        return getattr(torchvision.models, name.split(":", 1)[1])(weights=None)
    import timm

    kwargs = {"img_size": img_size} if img_size else {}
    return timm.create_model(name, pretrained=False, **kwargs)


def fp8_training(model, recipe):
    """torchao float8 training: Linear layers swapped for Float8Linear (dims multiple of 16 only)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        sys.exit("--amp fp8 needs torchao: pip install torchao")
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda m, _: m.in_features % 16 == 0 and m.out_features % 16 == 0)


def set_precision(model, amp, task, fp8_recipe="tensorwise"):
    """Apply --amp to the model and the global matmul mode; returns the dtype of the input batch."""
    if amp == "fp8" and task == "train":
        fp8_training(model, fp8_recipe)
        return torch.float32
    if amp in CAST and task == "train":
        sys.exit(f"--amp {amp} is inference only: use --task infer")
    torch.set_float32_matmul_precision("high" if amp == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = True  # torch's default; tf32 relies on it, the others leave it
    if amp in CAST:
        model.to(CAST[amp])
    if amp == "fp8":
        try:
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
        except ImportError:
            sys.exit("--amp fp8 needs torchao: pip install torchao")
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return CAST.get(amp, torch.float32)


def sdpa_backend(name):
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]])


def rate(step, batch_size, iters, cuda):
    """Images per second over ``iters`` back-to-back steps: CUDA events on a GPU, a host clock on a CPU."""
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        return batch_size * iters / (time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return batch_size * iters / (start.elapsed_time(end) / 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--task", choices=["infer", "train"], default="infer")
    ap.add_argument("--amp", choices=["off", "tf32", "bf16", "fp16", "bf16-weights", "fp16-weights", "fp8"],
                    default="bf16")
    ap.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="tensorwise", help="--amp fp8 --task train only")
    ap.add_argument("--sdpa", choices=["auto", "flash", "cudnn", "efficient", "math"], default="auto")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--activation-budget", type=float, default=1.0,
                    help="torch._functorch.config.activation_memory_budget for a compiled train step: below 1, "
                         "AOTAutograd's partitioner recomputes activations in the backward to save memory")
    args = ap.parse_args()
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = args.activation_budget

    dev = torch.device(args.device)
    cuda = args.device == "cuda"
    # cuDNN's autotuner, as vitreg (since 2026-12-02) and timm's benchmark.py run: one input shape, so the
    # fastest algorithm is picked once (the ViT patch convolution: 7.0 -> 4.0 ms per step, DeiT-S bs1024)
    torch.backends.cudnn.benchmark = cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    model = build(args.model, args.img_size).to(dev)
    x_dtype = set_precision(model, args.amp, args.task, args.fp8_recipe)
    dtype = torch.bfloat16 if args.amp == "fp8" and args.task == "train" else AUTOCAST.get(args.amp)
    net = model if args.compile == "off" else torch.compile(
        model, **({} if args.compile == "default" else {"mode": args.compile}))
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=dev, dtype=x_dtype)
    y = torch.randint(0, 1000, (args.batch_size,), device=dev)

    if args.task == "infer":
        model.eval()

        def step():
            with torch.inference_mode(), torch.autocast(args.device, dtype=dtype, enabled=dtype is not None):
                net(x)
    else:
        model.train()
        if hasattr(model, "set_distilled_training") and getattr(model, "dist_token", None) is not None:
            model.set_distilled_training(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        scaler = torch.amp.GradScaler(args.device, enabled=args.amp == "fp16")
        ce = torch.nn.CrossEntropyLoss()

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(args.device, dtype=dtype, enabled=dtype is not None):
                out = net(x)
                loss = sum(ce(o, y) for o in out) / len(out) if isinstance(out, tuple) else ce(out, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    with sdpa_backend(args.sdpa):  # held from the first (compiling) call: inductor fixes the backend then
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        first_s = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            step()
        sync()
        rates = [rate(step, args.batch_size, args.iters, cuda) for _ in range(args.repeats)]
    print(json.dumps({"check": "independent", "model": args.model, "task": args.task, "batch_size": args.batch_size,
                      "amp": args.amp, "compile": args.compile, "img_per_s_median": statistics.median(rates),
                      "img_per_s_min": min(rates), "img_per_s_max": max(rates), "first_call_s": first_s,
                      "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                      "sdpa": args.sdpa, "activation_budget": args.activation_budget,
                      "peak_mem_allocated_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                      **({"fp8_recipe": args.fp8_recipe} if args.amp == "fp8" and args.task == "train" else {})}),
          flush=True)


if __name__ == "__main__":
    main()
