"""Runs left RUNNING by a process that is gone (SIGKILL, OOM killer, a lost host): find them, end them.

A live vitreg process refreshes the tag ``vitreg_heartbeat`` (unix seconds) on its run every
``VITREG_HEARTBEAT_S`` seconds (default 30; the spool's delivery thread does it). A RUNNING run whose
heartbeat, or, for a run without one, whose start, is older than a threshold has no process behind it:
:func:`find_stale` lists such runs and :func:`mark_killed` ends them KILLED, with the reason in
``vitreg_error``. A process cut off from the server also stops refreshing its heartbeat: keep the
threshold well above the heartbeat period (the default, 600 s, is twenty periods). Should such a
process reconnect, its delivery sets the status it really ended with.
"""

from __future__ import annotations

import dataclasses
import os
import time

from vitreg.config.parse import parse_float
from vitreg.errors import VitregError
from vitreg.tracking.delivery import ERROR_TAG, HEARTBEAT_TAG, short_http_requests, store_errors
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.uris import scrub

DEFAULT_HEARTBEAT_S = 30.0
DEFAULT_STALE_AFTER_S = 600.0


def heartbeat_period_s() -> float:
    """``VITREG_HEARTBEAT_S`` (seconds between heartbeats), default 30."""
    return parse_float(os.environ.get("VITREG_HEARTBEAT_S") or DEFAULT_HEARTBEAT_S, "VITREG_HEARTBEAT_S",
                       minimum=0.1)


@dataclasses.dataclass(frozen=True)
class StaleRun:
    run_id: str
    experiment: str
    run_name: str
    last_seen: float  # unix seconds: the heartbeat, or the start for a run that never sent one
    heartbeat: bool  # whether last_seen is a heartbeat

    def reason(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.last_seen))
        what = "no heartbeat since" if self.heartbeat else "no heartbeat at all, started"
        return f"stale: {what} {since}; the process that ran it is gone"


def _experiments(client: mlflow.MlflowClient, experiment: str | None) -> list:
    if experiment is None:
        return client.search_experiments(view_type=mlflow.entities.ViewType.ACTIVE_ONLY)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise VitregError(f"experiment {experiment!r} does not exist: check the name "
                          f"(mlflow experiments search) or MLFLOW_TRACKING_URI")
    return [found]


def _running_runs(client: mlflow.MlflowClient, experiment_id: str):
    token = None
    while True:
        page = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def _last_seen(run) -> tuple[float, bool]:
    beat = run.data.tags.get(HEARTBEAT_TAG)
    try:
        return float(beat), True
    except (TypeError, ValueError):
        return run.info.start_time / 1000.0, False


def find_stale(older_than_s: float = DEFAULT_STALE_AFTER_S, experiment: str | None = None,
               client: mlflow.MlflowClient | None = None, now: float | None = None) -> list[StaleRun]:
    """RUNNING runs (of ``experiment``, or of every experiment) not seen alive for ``older_than_s`` seconds."""
    client = client or mlflow.MlflowClient()
    now = time.time() if now is None else now
    stale = []
    with short_http_requests(), store_errors(client.tracking_uri, "searching for RUNNING runs"):
        for exp in _experiments(client, experiment):
            for run in _running_runs(client, exp.experiment_id):
                last_seen, heartbeat = _last_seen(run)
                if now - last_seen > older_than_s:
                    stale.append(StaleRun(run.info.run_id, exp.name, run.info.run_name or "", last_seen, heartbeat))
    return sorted(stale, key=lambda r: r.last_seen)


def mark_killed(runs: list[StaleRun], client: mlflow.MlflowClient | None = None) -> int:
    """End each run KILLED with its reason in ``vitreg_error``; returns how many were still RUNNING."""
    client = client or mlflow.MlflowClient()
    ended = 0
    with short_http_requests(), store_errors(client.tracking_uri, "marking stale runs KILLED"):
        for stale in runs:
            if client.get_run(stale.run_id).info.status != "RUNNING":
                continue  # ended meanwhile (its process was alive after all, or another --fix)
            client.set_tag(stale.run_id, ERROR_TAG, scrub(stale.reason()))
            client.set_terminated(stale.run_id, "KILLED")
            ended += 1
    return ended
