"""A resumed run and the run it resumed from, pointing at each other; the old one never left RUNNING.

A run whose process was SIGKILLed (the OOM killer, ``kill -9``, a lost node) stays RUNNING in MLflow,
since nothing was left to end it. Resuming its checkpoint is the proof that it is over: the new run
closes it KILLED, and tags both ends so either run leads to the other. A RUNNING run whose heartbeat
is fresh (its process is alive: someone resumed a copy of a checkpoint of a run still training) is
only tagged.
"""

from __future__ import annotations

import time

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from vitreg.tracking.delivery import HEARTBEAT_TAG
from vitreg.tracking.runs import ERROR_TAG
from vitreg.tracking.stale import heartbeat_period_s

RESUMED_FROM_TAG = "vitreg_resumed_from"  # on the new run: the run id of the checkpoint it continues
RESUMED_BY_TAG = "vitreg_resumed_by"  # on the old run: the newest run that resumed it


def link_resumed(new_run_id: str, old_run_id: str, progress=lambda message: None) -> bool:
    """Tag both runs and end the old one KILLED if it is still RUNNING; False if the old run is not in
    this store (a checkpoint copied from elsewhere), where only the new run is tagged."""
    client = MlflowClient()
    client.set_tag(new_run_id, RESUMED_FROM_TAG, old_run_id)
    if old_run_id == new_run_id:
        return True
    try:
        old = client.get_run(old_run_id)
    except MlflowException:
        progress(f"the checkpoint's run {old_run_id} is not in this store: only this run is tagged with it")
        return False
    client.set_tag(old_run_id, RESUMED_BY_TAG, new_run_id)
    if old.info.status == "RUNNING" and not _alive(old):
        client.set_tag(old_run_id, ERROR_TAG, f"ended without a final status (the process was killed); resumed by "
                                              f"run {new_run_id}")
        client.set_terminated(old_run_id, "KILLED")
        progress(f"run {old_run_id} was still RUNNING (its process was killed): marked KILLED, resumed by this run")
    return True


def _alive(run) -> bool:
    """Its process refreshed the heartbeat within two periods."""
    try:
        return time.time() - float(run.data.tags[HEARTBEAT_TAG]) < 2 * heartbeat_period_s()
    except (KeyError, TypeError, ValueError):
        return False
