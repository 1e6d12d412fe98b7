"""MLflow's own prints off: artifact progress bars, and the "View run / View experiment at" links.

MLflow draws tqdm bars on stderr for each artifact download (three for one ``pull`` or ``infer``), in
between vitreg's own progress lines, which already say what is downloaded where. It reads
MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR each time it starts one, so setting it once in the process (before the
first download) is enough.

When a run ends against a server MLflow writes ``🏃 View run ... at: <host>/#/...`` to stdout
(``TrackingServiceClient._log_url``), with the host as MLflow holds it: a tracking URI's credentials
included. vitreg's last line (:func:`vitreg.tracking.runs.where_logged`) gives the same link, masked, so
MLflow's is turned off with MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT, which it reads at each end of a run.
"""

from __future__ import annotations

import os

PROGRESS_BAR_VARIABLE = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
RUN_LINKS_VARIABLE = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def quiet_artifact_downloads() -> None:
    """No artifact progress bars in this process and its children, unless the user asked for them
    (an MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR already set is kept); and never MLflow's run links."""
    os.environ.setdefault(PROGRESS_BAR_VARIABLE, "false")
    quiet_run_links()


def quiet_run_links() -> None:
    """No "View run ... at" line from MLflow (it would print the tracking URI's credentials): forced, not a
    default, since vitreg prints the link itself."""
    os.environ[RUN_LINKS_VARIABLE] = "true"


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
