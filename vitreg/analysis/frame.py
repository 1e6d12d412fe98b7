"""The tidy runs frame the analysis works on: one row per (run, task), plain column names
(:func:`vitreg.tracking.search.tidy` builds it; nothing here knows how the store names its columns)."""

from __future__ import annotations

from vitreg.config.options import identity_names
from vitreg.errors import VitregError
from vitreg.measure.metrics import TASKS, compared_job_metrics, compared_metrics


class CompareError(VitregError):
    """The runs cannot be compared as asked; the one-line message names the fix."""


#: the commands whose runs the tidy frame holds (a sweep's children are bench runs)
RUN_COMMANDS = ("bench", "infer", "train")

#: identity options shown inside another configuration column instead of one of their own. ``model_uri``:
#: an infer run is compared as the architecture its checkpoint holds (its ``model``: the same kernels);
#: ``compile_backend``: ``default@eager`` (the default backend and ``compile=off`` add nothing);
#: ``cuda_graph``: ``+cudagraph``; ``nnodes``: ``nproc`` counts the processes of the whole job; the DDP
#: settings: the ``ddp`` string (``-`` for one process, where they do nothing).
FOLDED_INTO = {"model_uri": "model", "compile_backend": "compile", "cuda_graph": "compile", "nnodes": "nproc",
               "ddp_bucket_mb": "ddp", "ddp_static_graph": "ddp", "ddp_comm_hook": "ddp"}

#: what multi-process scaling goes along (scaling_efficiency, scaling baselines): the rest must agree
SCALED_COLUMNS = ("nproc", "ddp")

NOT_APPLICABLE = "-"  # a configuration column of an option the run's command does not take (bench: clip_grad)


def identity_options(commands: tuple[str, ...] = RUN_COMMANDS) -> tuple[str, ...]:
    """What makes two runs one configuration: the identity options of ``commands``, in table order."""
    return tuple(dict.fromkeys(name for command in commands for name in identity_names(command)))


def config_columns(commands: tuple[str, ...] = RUN_COMMANDS) -> tuple[str, ...]:
    """The tidy frame's configuration columns: every identity option, under its own name unless
    :data:`FOLDED_INTO` shows it in another column. Two runs with equal columns (and GPU) measure the same work,
    so their spread is noise and their GPUs are comparable."""
    return tuple(dict.fromkeys(FOLDED_INTO.get(name, name) for name in identity_options(commands)))


def options_shown_in(column: str, commands: tuple[str, ...] = RUN_COMMANDS) -> tuple[str, ...]:
    """The identity options whose values make up ``column`` (``compile``: compile, compile_backend, cuda_graph)."""
    return tuple(n for n in identity_options(commands) if FOLDED_INTO.get(n, n) == column)

# Metric names without the task prefix: every tidy frame has these columns (NaN where a run did not record
# them), a stable schema.
TASK_METRICS = {task: compared_metrics(task) for task in TASKS}
SHARED_METRICS = compared_job_metrics()
ALL_METRICS = tuple(dict.fromkeys(sum(TASK_METRICS.values(), ()) + SHARED_METRICS))

# Facts about where a run really ran: ``mismatch`` is true for a mislabelled run (tagged
# gpu_mismatch=true, or its detected hardware is not the GPU it is filed under), ``ran_on`` names that
# hardware (NaN where nothing says). A mislabelled run's numbers are not its label's.
HARDWARE_COLUMNS = ("mismatch", "ran_on")

# ``batch_chosen``: the batch batch_size=auto found (NaN for a fixed batch). Such runs share ``batch_size`` <NA>,
# so they are one configuration, and the table shows what each GPU chose.
CHOSEN_COLUMNS = ("batch_chosen",)

# What a run's timed windows met (its ``<task>_<column>`` tags, from vitreg.measure.energy; NaN for runs that
# predate them): throttle reasons, a loaded host, a window spread over 5 %, fp8 without inductor (about half of
# bf16's speed), why timing stopped. Compare marks runs by them; check names them as causes.
CONDITION_COLUMNS = ("throttle", "busy_host", "spread_over_target", "eager_fp8", "timing_stop")

# The CPUs a run could use and torch's intra-op threads (<NA> for runs that predate those tags). A CPU figure, or
# a host-bound step, moves with them by 20-90x (a SLURM child's one-CPU job beside a Ray child on the whole node),
# so runs that differ in either are never pooled: compare and check keep them apart like a configuration.
GRANT_COLUMNS = ("cpus_granted", "torch_threads")


def id_columns() -> tuple[str, ...]:
    """The tidy frame's columns that are not measurements (from the option table at each call)."""
    return (("run_id", "start_time", "source", "gpu") + config_columns() + GRANT_COLUMNS + HARDWARE_COLUMNS
            + CHOSEN_COLUMNS)


def group_columns(by: str | None = None) -> list[str]:
    """What runs must share to be pooled in one row of a comparison, less the axis ``by`` compared along."""
    return [k for k in (*config_columns(), "gpu", *GRANT_COLUMNS) if k != by]


DEFAULT_AXIS = "gpu"  # what compare --by goes along unless asked

MISSING = "?"  # shown for a configuration string nobody recorded

NO_RUNS = "no runs to compare; record some with `vitreg bench`, or check the experiment name and tracking URI"


def require_tidy(frame) -> None:
    if frame is None or len(frame) == 0:
        raise CompareError(NO_RUNS)
    missing = [c for c in id_columns() if c not in frame.columns]
    if missing:
        raise CompareError(f"not a tidy runs frame (no {', '.join(missing)} columns): build it with "
                           "vitreg.tracking.search.tidy()")
