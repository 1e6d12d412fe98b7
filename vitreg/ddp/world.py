"""DDP plumbing for processes torchrun started: the world, the process group, the wrap, and every rank's figures
reduced into the job's (:func:`reduce_figures`). Outside torchrun every function is a cheap no-op, so a
single-process run never initialises a process group. ``batch_size`` is per process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from vitreg.errors import VitregError
from vitreg.measure.figures import Figures
from vitreg.measure.metrics import ITERATION_TIME, combine


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"  # the torch device of this rank: "cuda:3" or "cpu"
    backend: str | None = None  # "nccl" / "gloo" once a process group exists, else None
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def inside_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise VitregError(f"{name}={os.environ[name]!r} is not an integer: unset it or launch with torchrun") from None


def init_from_env(device_type: str) -> World:
    """Join torchrun's process group (NCCL with GPU ``LOCAL_RANK`` bound, else gloo); none for a job of one."""
    device = "cuda:0" if device_type == "cuda" else "cpu"
    if not inside_torchrun():
        return World(device=device)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    world_size, local_world = _env_int("WORLD_SIZE", 1), _env_int("LOCAL_WORLD_SIZE", 1)
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise VitregError(f"local rank {local_rank} has no GPU: only {visible} CUDA GPU(s) are visible on this "
                              f"host; use nproc<={visible}")
        # Before anything touches CUDA: every later allocation, NCCL communicator and
        # torch.cuda.max_memory_allocated() then refers to this rank's own GPU.
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if world_size == 1:
        return World(rank, local_rank, 1, device, None, local_world)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        # device_id binds the communicator to this GPU eagerly (no guessing in barrier())
        kwargs = {"device_id": torch.device("cuda", local_rank)} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, **kwargs)  # env:// (MASTER_ADDR/PORT, RANK, WORLD_SIZE)
    return World(rank, local_rank, world_size, device, dist.get_backend(), local_world)


def join_job(spec, reducer_factory, cuda_graph: bool = False):
    """``(world, wrap, reducer)`` of this process, for bench and train alike; ``wrap`` (DDP with the spec's
    settings) and ``reducer_factory(world)`` only with more than one rank."""
    if not inside_torchrun():
        return World(), None, None
    if cuda_graph:  # captured steps need this before the process group
        from vitreg.measure.graphs import prepare_process_group

        prepare_process_group()
    world = join_world(spec.nproc, spec.device)
    if not world.distributed:
        return world, None, None
    import functools

    return world, functools.partial(ddp_wrap, world=world, **spec.ddp_options()), reducer_factory(world)


def is_main_process() -> bool:
    return _env_int("RANK", 0) == 0


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if _initialized():
        import torch.distributed as dist

        dist.barrier()


def destroy() -> None:
    if _initialized():
        import torch.distributed as dist

        dist.destroy_process_group()


def ddp_wrap(model, world: World, *, bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = True,
             static_graph: bool = False, find_unused_parameters: bool = False, comm_hook: str = "none", **kwargs):
    """``DistributedDataParallel(model)``; the model itself in a world of one. ``gradient_as_bucket_view=True``
    (not torch's default): one gradient-sized buffer less of peak memory. ``comm_hook``: torch's compress hook."""
    if not world.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    if world.device.startswith("cuda"):
        kwargs.setdefault("device_ids", [world.local_rank])
        kwargs.setdefault("output_device", world.local_rank)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=gradient_as_bucket_view,
                                  static_graph=static_graph, find_unused_parameters=find_unused_parameters, **kwargs)
    if comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        if comm_hook not in hooks:
            raise VitregError(f"ddp_comm_hook={comm_hook!r} is not one of none, {', '.join(hooks)}")
        ddp.register_comm_hook(None, hooks[comm_hook])  # None: the default (whole-world) group
    return ddp


def reduce_figures(per_rank: list[Figures]) -> Figures:
    """Every rank's record of one task combined name by name by the metric table's rank rules
    (:func:`vitreg.measure.metrics.combine`: rates summed per window, the slowest rank per iteration, ...).
    The ranks must hold the same names and samples of the same length."""
    if not per_rank:
        raise ValueError("reduce_figures() needs the figures of at least one rank")
    names = {tuple(sorted(f.values)) for f in per_rank}
    lengths = {tuple(len(v) for _, v in sorted(f.values.items()) if isinstance(v, tuple)) for f in per_rank}
    if len(names) != 1 or len(lengths) != 1:
        raise ValueError(f"ranks recorded different figures or numbers of windows/iterations: {sorted(lengths)}")
    task = per_rank[0].task
    return Figures(task, {name: combine(name, [f[name] for f in per_rank]) for name in per_rank[0].values})


def gather_objects(obj, world: World) -> list:
    """Every rank's ``obj`` in rank order (a collective); ``[obj]`` without a process group. For the few values
    a rank reports once, after its timed work, where pickling costs nothing."""
    if not world.distributed or not _initialized():
        return [obj]
    import torch.distributed as dist

    gathered: list = [None] * world.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


@dataclass
class ResultReducer:
    """What the runner needs from DDP: :meth:`align` before each task's timed windows (so summed rates mean
    "together"); a call on a task's figures returns the job's; ``per_rank`` keeps each rank's, per task."""

    world: World
    per_rank: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.world.world_size

    def align(self) -> None:
        barrier()

    def __call__(self, task: str, figures: Figures) -> Figures:
        self.per_rank[task] = gathered = gather_objects(figures, self.world)
        return figures if len(gathered) == 1 else reduce_figures(gathered)

    def slowest_profile(self, profile):
        """The job's :class:`vitreg.measure.traces.CommProfile`: the largest of each figure (a collective)."""
        gathered = gather_objects(profile, self.world)
        if len(gathered) == 1:
            return profile
        import dataclasses

        fields = ("allreduce_ms_per_step", "device_busy_ms_per_step")
        return dataclasses.replace(profile, **{f: combine(f, [getattr(p, f) for p in gathered]) for f in fields})

    def per_rank_report(self) -> dict:
        """``{task: [{rank, throughput_img_per_s_median, throughput_img_per_s_windows, iter_ms_p50, ...}]}``."""
        return {task: [_rank_row(r, f.summarized()) for r, f in enumerate(ranks)] for task, ranks in self.per_rank.items()}


def _rank_row(rank: int, figures: Figures) -> dict:
    return {"rank": rank, "throughput_img_per_s_median": figures.get("throughput_img_per_s"),
            "throughput_img_per_s_windows": list(figures.get("window_img_per_s", ())),
            "iter_ms_p50": figures.get(f"{ITERATION_TIME[figures.task]}_p50"),
            "first_call_s": figures.get("first_call_s"), "peak_mem_allocated_mb": figures.get("peak_mem_allocated_mb")}


def join_world(nproc: int, device: str) -> World:
    """This rank's World; refuses a torchrun of another process count than ``nproc`` (the param must say what ran)."""
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    if nproc != local_world:
        raise VitregError(f"nproc={nproc} but torchrun started {local_world} process(es) on this node: pass "
                          f"nproc={local_world}, or run without torchrun and let vitreg launch it")
    import torch

    return init_from_env("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")


@dataclass
class TrainReducer:
    """What the training loop needs from DDP; each call is a collective, made by every rank at the same step."""

    world: World
    per_rank: list = field(default_factory=list)
    last_local_loss: float | None = None  # this rank's own loss of the last interval, for ranks.json
    intervals: int = 0  # log boundaries reduced so far (one all-reduce each)

    def interval(self, loss, img_per_s: float | None) -> tuple[float, float | None]:
        """``(mean loss over ranks, summed img/s)``; ``loss`` is this rank's interval mean, a 0-d tensor."""
        import torch

        local = torch.stack([loss.detach().float().reshape(()),
                             torch.tensor(float(img_per_s or 0.0), dtype=torch.float32, device=loss.device)])
        total = local.clone()
        if self.world.distributed and _initialized():
            import torch.distributed as dist

            dist.all_reduce(total)  # SUM: gloo has no AVG; divided below
        # one host copy of both: the sync this log boundary makes anyway
        (self.last_local_loss, _), (loss_sum, rate) = torch.stack([local, total]).tolist()
        self.intervals += 1
        return loss_sum / self.world.world_size, (rate if img_per_s is not None else None)

    def align(self) -> None:
        barrier()

    def figures(self, local: Figures) -> Figures:
        """The job's end-of-training figures; ``per_rank`` keeps each rank's, with its own last loss."""
        gathered = gather_objects((local, self.last_local_loss), self.world)
        self.per_rank = [{"rank": r, **f.to_dict(), "final_loss": loss} for r, (f, loss) in enumerate(gathered)]
        return reduce_figures([f for f, _ in gathered])
