"""The tidy runs frame that the analysis works on: one row per (run, task), plain column names.

:func:`vitreg.tracking.search.tidy` builds it from whatever the tracking store returned; nothing
in :mod:`vitreg.analysis` knows how the store names its columns.
"""

from __future__ import annotations

from vitreg.errors import VitregError
from vitreg.measure.metrics import TASKS, compared_job_metrics, compared_metrics


class CompareError(VitregError):
    """The runs cannot be compared as asked; the one-line message names the fix."""


# A configuration is everything that changes the work done per image except the GPU. Two runs
# with equal keys measure the same thing, so their spread is noise and their GPUs are comparable.
CONFIG_KEYS = ("model", "task", "amp", "compile", "batch_size", "img_size", "nproc", "ddp")

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

# Columns of the tidy frame that are not measurements.
ID_COLUMNS = ("run_id", "start_time", "source", "gpu") + CONFIG_KEYS + HARDWARE_COLUMNS + CHOSEN_COLUMNS

# What a comparison is along (compare --by) unless asked otherwise.
DEFAULT_AXIS = "gpu"

MISSING = "?"  # shown for a configuration string nobody recorded

NO_RUNS = "no runs to compare; record some with `vitreg bench`, or check the experiment name and tracking URI"


def require_tidy(frame) -> None:
    """CompareError unless ``frame`` has the tidy frame's identifying columns."""
    if frame is None or len(frame) == 0:
        raise CompareError(NO_RUNS)
    missing = [c for c in ID_COLUMNS if c not in frame.columns]
    if missing:
        raise CompareError(f"not a tidy runs frame (no {', '.join(missing)} columns): build it with "
                           "vitreg.tracking.search.tidy()")
