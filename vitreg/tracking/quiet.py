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
