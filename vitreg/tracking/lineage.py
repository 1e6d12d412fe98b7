"""A resumed run and the run it resumed from, pointing at each other; the old one never left RUNNING.

A run whose process was SIGKILLed (the OOM killer, ``kill -9``, a lost node) stays RUNNING in MLflow,
since nothing was left to end it. Resuming its checkpoint is the proof that it is over: the new run
closes it KILLED, and tags both ends so either run leads to the other. A heartbeat cannot tell here: a
run SIGKILLed a second ago still has a fresh one. Should the old run's process be alive after all (a
checkpoint of a run still training, resumed elsewhere), its own end sets the status it really ended with.
"""

from __future__ import annotations

from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.runs import ERROR_TAG

RESUMED_FROM_TAG = "vitreg_resumed_from"  # on the new run: the run id of the checkpoint it continues
RESUMED_BY_TAG = "vitreg_resumed_by"  # on the old run: the newest run that resumed it


def close_resumed(old_run_id: str, new_run_id: str, progress=lambda message: None) -> bool:
    """Tag the old run with its successor and end it KILLED if it is still RUNNING.

    The new run's own tag (:data:`RESUMED_FROM_TAG`) goes through its tracker like its other tags. The
    old run is another run, edited directly; a store that does not hold it (a checkpoint copied from
    elsewhere) or cannot be reached now only costs a line: the training goes on. Returns whether the
    old run was found.
    """
    if old_run_id == new_run_id:
        return True
    client = mlflow.MlflowClient()
    try:
        old = client.get_run(old_run_id)
        client.set_tag(old_run_id, RESUMED_BY_TAG, new_run_id)
        if old.info.status == "RUNNING":
            client.set_tag(old_run_id, ERROR_TAG, f"ended without a final status (the process was killed); "
                                                  f"resumed by run {new_run_id}")
            client.set_terminated(old_run_id, "KILLED")
            progress(f"run {old_run_id} was still RUNNING (its process was killed): marked KILLED, resumed by "
                     f"this run")
    except mlflow.exceptions.MlflowException:
        progress(f"the checkpoint's run {old_run_id} is not in this store: only this run is tagged with it")
        return False
    except Exception as exc:  # the store is unreachable now: not a reason to stop a training
        progress(f"could not tag the checkpoint's run {old_run_id} ({type(exc).__name__}): it keeps its status")
        return False
    return True

