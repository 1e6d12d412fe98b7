"""An independent DDP training loop, with no vitreg code: the reference for vitreg's DDP figures.

Run under torchrun, one process per GPU; the same synthetic-batch training step as
benchmarks/independent_check.py (timm model, bf16 autocast, fused AdamW), wrapped in plain
DistributedDataParallel. Every rank times ``repeats`` windows of ``iters`` steps between two CUDA
events after ``warmup`` steps; rank 0 prints one JSON line (and a readable ``ddp_check:`` line on stderr) with the job's throughput (the sum of
the ranks' median rates) and the slowest rank's median step time. vitreg's `bench --task train
--nproc N` for the same model, batch and DDP settings must land near it.

    torchrun --standalone --nproc-per-node=2 benchmarks/ddp_check.py --model deit_small_patch16_224 --batch-size 128
    torchrun --standalone --nproc-per-node=2 benchmarks/ddp_check.py --model deit_small_patch16_224 --static-graph --profile
    torchrun --standalone --nproc-per-node=2 benchmarks/ddp_check.py --model deit_small_patch16_224 --cuda-graph

``--cuda-graph`` (CUDA only) captures the whole step (forward, backward with DDP's all-reduce, AdamW)
in one CUDA graph and replays it, following PyTorch's recipe for DDP (docs, "CUDA Graphs", "Usage with
DistributedDataParallel"): NCCL's async error handling off before the process group exists, DDP built
on a side stream, 11 eager DDP steps before the capture, autocast without its cast cache, a
capturable optimizer.

``--profile`` then runs ``profile_steps`` more steps under torch.profiler and reports, per step, the
time the GPU spent in NCCL kernels (all-reduce) and in all kernels, from rank 0's trace: how much
of the step the gradient all-reduce takes, whatever the overlap. On CPU (``--device cpu``, gloo)
everything runs the same way with perf_counter, for rehearsal; the profile then counts the
all_reduce operations' CPU time.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deit_small_patch16_224")
    ap.add_argument("--batch-size", type=int, default=128, help="per process")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--amp", choices=["off", "bf16"], default="bf16")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--static-graph", action="store_true")
    ap.add_argument("--no-bucket-view", action="store_true", help="gradient_as_bucket_view=False (torch's default)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--cuda-graph", action="store_true", help="capture the whole step in one CUDA graph, replay it")
    ap.add_argument("--comm-hook", choices=["none", "fp16", "bf16"], default="none",
                    help="DDP compress hook: all-reduce the gradients in this precision")
    args = ap.parse_args()
    if args.cuda_graph and args.device != "cuda":
        ap.error("--cuda-graph needs --device cuda")
    if args.cuda_graph:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # before the process group: PyTorch's DDP + graphs recipe

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}" if cuda else "cpu")

    import timm

    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False, img_size=args.img_size).to(dev)
    model.train()
    side = torch.cuda.Stream() if args.cuda_graph else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():  # graphs: DDP built on a side stream
        ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None, bucket_cap_mb=args.bucket_mb,
                                      gradient_as_bucket_view=not args.no_bucket_view, static_graph=args.static_graph)
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    if args.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))
    net = ddp if args.compile == "off" else torch.compile(
        ddp, **({} if args.compile == "default" else {"mode": args.compile}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda, capturable=args.cuda_graph)
    dtype = torch.bfloat16 if args.amp == "bf16" else None
    torch.manual_seed(1 + rank)  # each rank its own batch, as DDP training has
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=dev)
    y = torch.randint(0, 1000, (args.batch_size,), device=dev)
    ce = torch.nn.CrossEntropyLoss()

    def eager_step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None, cache_enabled=not args.cuda_graph):
            loss = ce(net(x), y)
        loss.backward()
        opt.step()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def capture():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(11):  # DDP needs 11 eager iterations before a capture
                eager_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager_step()  # grads set to None first: the captured backward writes them in the graph's pool
        graph.replay()
        return graph.replay

    sync()
    t0 = time.perf_counter()
    if args.cuda_graph:
        step = capture()  # first "step": 11 eager steps, the capture, one replay
    else:
        step = eager_step
        step()
    sync()
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        step()
    sync()
    dist.barrier()

    rates = []
    for _ in range(args.repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                step()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            for _ in range(args.iters):
                step()
            seconds = time.perf_counter() - t
        rates.append(args.batch_size * args.iters / seconds)

    # NCCL gathers device tensors only: input and outputs on this rank's device
    mine = torch.tensor([statistics.median(rates), min(rates), max(rates)], dtype=torch.float64, device=dev)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    every = [t.cpu().tolist() for t in every]

    prof = {}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        with profile(activities=activities) as p:
            for _ in range(args.profile_steps):
                step()
            sync()
        events = p.key_averages()
        if cuda:
            def device_us(e):
                return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            from torch.autograd import DeviceType

            # the kernels themselves (the CPU ops that launched them carry the same time again)
            kernels = [e for e in events if e.device_type == DeviceType.CUDA and device_us(e) > 0]
            nccl = sum(device_us(e) for e in kernels if "nccl" in e.key.lower())
            busy = sum(device_us(e) for e in kernels)
        else:
            nccl = sum(e.cpu_time_total for e in events if "all_reduce" in e.key.lower() and "gloo" in e.key.lower())
            busy = None  # no device
        prof = {"allreduce_ms_per_step": nccl / 1e3 / args.profile_steps,
                "device_busy_ms_per_step": None if busy is None else busy / 1e3 / args.profile_steps}

    if rank == 0:
        medians = [r[0] for r in every]
        slowest = max(1e3 * args.batch_size / m for m in medians)
        line = (f"ddp_check: N={world}{' cuda-graph' if args.cuda_graph else ''}"
                f"{'' if args.comm_hook == 'none' else ' comm-hook ' + args.comm_hook} {sum(medians):,.0f} img/s, "
                f"slowest rank's step {slowest:.2f} ms")
        if prof:
            busy = prof["device_busy_ms_per_step"]
            line += f"; all-reduce {prof['allreduce_ms_per_step']:.2f} ms/step" + (
                f", device busy {busy:.2f} ms/step" if busy is not None else "")
        print(line, file=sys.stderr, flush=True)
        print(json.dumps({
            "check": "ddp", "model": args.model, "world_size": world, "batch_size_per_rank": args.batch_size,
            "amp": args.amp, "compile": args.compile, "bucket_mb": args.bucket_mb, "static_graph": args.static_graph,
            "gradient_as_bucket_view": not args.no_bucket_view, "cuda_graph": args.cuda_graph,
            "comm_hook": args.comm_hook,
            "img_per_s": sum(medians), "img_per_s_per_rank": medians,
            "step_ms_p50_slowest": slowest,
            "first_step_s": first_s, **prof,
            "device": torch.cuda.get_device_name(local_rank) if cuda else "cpu", "torch": torch.__version__,
        }), flush=True)
    if args.cuda_graph:
        # The N=2 --cuda-graph runs on the H200s hung after this point (destroying the process group
        # under the live graph, or at exit) until torchrun's timeout. Everything is printed: leave now.
        sync()
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
