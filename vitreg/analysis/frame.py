"""The tidy runs frame that the analysis works on: one row per (run, task), plain column names.

:func:`vitreg.tracking.search.tidy` builds it from whatever the tracking store returned; nothing
in :mod:`vitreg.analysis` knows how the store names its columns.
"""

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


def config_columns(commands: tuple[str, ...] = RUN_COMMANDS) -> tuple[str, ...]:
    """The tidy frame's configuration columns, derived from the option table: every identity option
    (:func:`vitreg.config.options.identity_names`) of ``commands``, in table order, each under its own
    name unless :data:`FOLDED_INTO` shows it in another column. Two runs with equal columns (and GPU)
    measure the same work, so their spread is noise and their GPUs are comparable; an option added to
    the table with ``identity=True`` becomes a column here with no other change."""
    names = [name for command in commands for name in identity_names(command)]
    return tuple(dict.fromkeys(FOLDED_INTO.get(name, name) for name in names))


def options_shown_in(column: str, commands: tuple[str, ...] = RUN_COMMANDS) -> tuple[str, ...]:
    """The identity options whose values make up ``column`` (``compile``: compile, compile_backend, cuda_graph)."""
    names = [name for command in commands for name in identity_names(command)]
    return tuple(dict.fromkeys(n for n in names if FOLDED_INTO.get(n, n) == column))



# Metric names after the task prefix is stripped: every tidy frame has these columns (NaN where
# a run did not record them), so downstream code and reports have a stable schema.
TASK_METRICS = {task: compared_metrics(task) for task in TASKS}
# Metrics of the whole run that describe each of its tasks.
SHARED_METRICS = compared_job_metrics()
ALL_METRICS = tuple(dict.fromkeys(sum(TASK_METRICS.values(), ()) + SHARED_METRICS))

# Facts about where a run really ran: ``mismatch`` is true for a mislabelled run (tagged
# gpu_mismatch=true, or its detected hardware is not the GPU it is filed under), ``ran_on`` names that
# hardware (NaN where nothing says). A mislabelled run's numbers are not its label's.
HARDWARE_COLUMNS = ("mismatch", "ran_on")

# What a run chose for itself: ``batch_chosen`` is the batch batch_size=auto found (its
# ``<task>_batch_size_chosen`` tag; NaN for a fixed batch). Such runs share ``batch_size`` <NA>, so
# they are one configuration, and the table shows what each GPU chose.
CHOSEN_COLUMNS = ("batch_chosen",)

# What a run's timed windows met (its ``<task>_throttle``, ``<task>_busy_host`` and ``<task>_spread_over_target``
# tags, from vitreg.measure.energy; NaN for runs that predate them): the clock-event reasons seen
# (``sw_power_cap``, ``hw_thermal``, ... or ``none``), whether other processes loaded the host, and whether the
# window spread was over 5 % (the windows' CV); and ``eager_fp8`` (``<task>_eager_fp8``: fp8 without inductor, about
# half of bf16's speed); ``timing_stop``: why the windows stopped (the precision target met, or a cap short of it).
# Compare marks runs by them; check names them as causes.
CONDITION_COLUMNS = ("throttle", "busy_host", "spread_over_target", "eager_fp8", "timing_stop")

# What a run was granted (its ``cpus_granted`` and ``torch_threads`` environment tags, nullable integers; <NA> for
# runs that predate them): the CPUs it could run on and torch's intra-op threads. A CPU figure, or a host-bound
# step, moves with them by 20-90x (a SLURM child's one-CPU job beside a Ray child on the whole node), so runs that
# differ in either are never pooled: compare and check keep them apart like a configuration.
GRANT_COLUMNS = ("cpus_granted", "torch_threads")



def id_columns() -> tuple[str, ...]:
    """The columns of the tidy frame that are not measurements (read from the option table at each call, so
    an option added in-process is a column at once)."""
    return (("run_id", "start_time", "source", "gpu") + config_columns() + GRANT_COLUMNS + HARDWARE_COLUMNS
            + CHOSEN_COLUMNS)


def group_columns(by: str | None = None) -> list[str]:
    """What runs must share to be pooled in one row of a comparison: the configuration, the GPU and the grant
    (:data:`GRANT_COLUMNS`), less the axis ``by`` compared along."""
    return [k for k in (*config_columns(), "gpu", *GRANT_COLUMNS) if k != by]


# What a comparison is along (compare --by) unless asked otherwise.
DEFAULT_AXIS = "gpu"

MISSING = "?"  # shown for a configuration string nobody recorded

NO_RUNS = "no runs to compare; record some with `vitreg bench`, or check the experiment name and tracking URI"


def require_tidy(frame) -> None:
    """CompareError unless ``frame`` has the tidy frame's identifying columns."""
    if frame is None or len(frame) == 0:
        raise CompareError(NO_RUNS)
    missing = [c for c in id_columns() if c not in frame.columns]
    if missing:
        raise CompareError(f"not a tidy runs frame (no {', '.join(missing)} columns): build it with "
                           "vitreg.tracking.search.tidy()")
