"""What a sweep child is, for every engine (vitreg.bench.sweep's local one, vitreg.fleet's Ray and SLURM ones):
its command line, how a child on another host starts, and the smaller batch it is retried with after running
out of memory.

A boundary module, short on purpose: both engines import it. Held in the sweep, it would close an import
circle (sweep -> fleet.ray_engine -> fleet.ray_tasks -> sweep); held in ray_tasks, the local engine would
import Ray."""

from __future__ import annotations

from vitreg.config.parse import AUTO_BATCH, options_to_args
from vitreg.errors import OutOfMemory
from vitreg.fleet.axes import Combination
from vitreg.fleet.worker import python_command
from vitreg.tracking import runs as tracking


def smaller_batch(bs, child_id: str) -> int:
    """The batch to retry with after a failure: smaller after an out-of-memory one, else 0 (no retry);
    batch_size=auto backs off inside the child already."""
    if bs == AUTO_BATCH or not ran_out_of_memory(child_id):
        return 0
    return decay_batch(bs)


def decay_batch(batch_size: int) -> int:
    """The next smaller batch after an OOM, timm's way (256 -> 192 -> 128 -> 96 -> 64 ...); 0 below 2."""
    from timm.utils import decay_batch_step

    return decay_batch_step(batch_size)


def child_command(combo: Combination, batch_size, common: dict) -> list[str]:
    """``python -m vitreg.cli bench`` (:func:`vitreg.fleet.worker.python_command`) with the combination's options
    (at ``batch_size``) over the common ones."""
    options = {**common, **dict(combo.options), "batch_size": batch_size}
    return python_command("vitreg.cli", "bench", *options_to_args(options))


def ran_out_of_memory(child_id: str) -> bool:
    # the child is another process: its error's class reaches us as the tag its tracked_run set
    return tracking.get_run(child_id).data.tags.get(tracking.ERROR_KIND_TAG) == OutOfMemory.__name__


def start_remote(ctx, child, engine: str, type_tag: str, wanted: str | None) -> tuple[list[str], dict]:
    """A child that runs on another host (a Ray task, a SLURM job): its run under the sweep's parent (``ctx``),
    tagged with the engine and the GPU type asked for (``type_tag``, when one is), SCHEDULED until its node
    starts it. Returns the python arguments the node's own python runs and the variables it needs to log into
    that run."""
    tags = {"sweep_engine": engine, "requested_batch_size": child.requested, type_tag: wanted}
    child.run_id = ctx.child_run(child.combo, child.index, child.attempt,
                                 {k: v for k, v in tags.items() if v is not None})
    tracking.set_child_status(child.run_id, "SCHEDULED")
    argv = child_command(child.combo, child.combo.batch_size, ctx.common)[1:]
    return argv, tracking.remote_child_env(child.run_id, ctx.parent.experiment_id)
