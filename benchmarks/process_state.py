"""One fresh process per global setting: which of timm benchmark.py's process-wide switches moves the plain loop?

benchmarks/timm_gap.py showed (H200, 2026-12-02) that a plain compiled loop run in the same process as timm's
benchmark.py is as fast as timm's (29,071-29,215 vs 29,014-29,076 img/s, DeiT-S bs1024), while the same loop in
a process of its own is not (27,620). Importing benchmark.py sets two switches at module level:
``torch.backends.cuda.matmul.allow_tf32 = True`` and ``torch.backends.cudnn.benchmark = True``. This sets
one of them (``--state``), optionally swaps the patch embedding's convolution for the same arithmetic as one
matmul (``--patch linear``), times the plain loop and reports the profiler's convolution kernel time.

    python benchmarks/process_state.py --state cudnn --model deit_small_patch16_224 --batch-size 1024
Prints one JSON line.
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from timm_gap import cuda_kernels, profiled, rates


class PatchMatmul(torch.nn.Module):
    """A stride == kernel convolution as a reshape and one matmul (the same products, summed in another order)."""

    def __init__(self, conv):
        super().__init__()
        self.p, self.weight, self.bias = conv.kernel_size[0], conv.weight, conv.bias

    def forward(self, x):
        b, c, h, w = x.shape
        p = self.p
        cols = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), -1)
        out = F.linear(cols, self.weight.reshape(self.weight.shape[0], -1), self.bias)
        return out.transpose(1, 2).reshape(b, -1, h // p, w // p)  # NCHW, as the conv returned it


def conv_ms(net, x, steps=5):
    events = cuda_kernels(profiled(net, x, steps))
    conv = [e for e in events if "conv" in e.key.lower() and not e.key.startswith("triton")]
    return (sum(e.self_device_time_total for e in conv) / 1e3 / steps, [e.key[:60] for e in conv],
            sum(e.self_device_time_total for e in events) / 1e3 / steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--state", choices=["none", "cudnn", "tf32", "both"], default="none")
    ap.add_argument("--patch", choices=["conv", "linear"], default="conv")
    ap.add_argument("--model", default="deit_small_patch16_224")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--compile", default="default")
    args = ap.parse_args()
    import timm

    if args.state in ("cudnn", "both"):
        torch.backends.cudnn.benchmark = True
    if args.state in ("tf32", "both"):
        torch.backends.cuda.matmul.allow_tf32 = True
    model = timm.create_model(args.model, pretrained=False).cuda().eval()
    if args.patch == "linear":
        x0 = torch.randn(2, 3, 224, 224, device="cuda")
        ref = model.patch_embed.proj(x0)
        model.patch_embed.proj = PatchMatmul(model.patch_embed.proj)
        err = (model.patch_embed.proj(x0) - ref).norm() / ref.norm()
        assert err < 1e-3, f"patch matmul differs from the conv: {err}"
    net = model if args.compile == "off" else torch.compile(model)
    x = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
    r = rates(net, x, 40, 5)
    ms, names, total = conv_ms(net, x)
    print(json.dumps({"state": args.state, "patch": args.patch, "model": args.model, "batch": args.batch_size,
                      "compile": args.compile, "img_per_s_median": statistics.median(r), "min": min(r),
                      "max": max(r), "conv_ms_per_step": ms, "cuda_ms_per_step": total, "conv_kernels": names}),
          flush=True)


if __name__ == "__main__":
    main()
