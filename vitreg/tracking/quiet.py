"""MLflow's artifact progress bars off for vitreg's own downloads.

MLflow draws tqdm bars on stderr for each artifact download (three for one ``pull`` or ``infer``), in
between vitreg's own progress lines, which already say what is downloaded where. It reads MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR each time it
starts one, so setting it once in the process (before the first download) is enough.
"""

from __future__ import annotations

import os

PROGRESS_BAR_VARIABLE = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def quiet_artifact_downloads() -> None:
    """No artifact progress bars in this process and its children, unless the user asked for them
    (an MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR already set is kept)."""
    os.environ.setdefault(PROGRESS_BAR_VARIABLE, "false")


#: MLflow's INFO lines a successful run does not need: the system-metrics monitor's start, stop and "Skip
#: logging GPU metrics" (every run), and the store's "Creating initial MLflow database tables" (a new
#: sqlite file). They are logging records of these loggers (MLflow's handler writes them to stderr);
#: their WARNING and ERROR records still show.
QUIET_MLFLOW_LOGGERS = ("mlflow.system_metrics", "mlflow.store.db.utils")


def quiet_mlflow_info() -> None:
    """MLflow's routine INFO lines off (WARNING and above kept), unless MLFLOW_LOGGING_LEVEL asks for more."""
    import logging

    if os.environ.get("MLFLOW_LOGGING_LEVEL", "").upper() in ("DEBUG", "INFO"):
        return
    for name in QUIET_MLFLOW_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
