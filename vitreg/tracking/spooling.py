"""A tracker that never makes its caller wait on the server: journal first, deliver from a thread.

Every call appends to the run's :class:`~vitreg.tracking.spool.Spool` (a local write) and returns. A
background thread delivers what is pending about once a second (sooner when much piles up), in
``log_batch`` calls, with a heartbeat tag; when the server fails it backs off (0.5 s doubling to 8 s) and
tries again, for as long as the work goes on. :meth:`SpoolingTracker.close` journals the final status
and waits at most ``timeout_s`` (``VITREG_FLUSH_TIMEOUT_S``, default 30) for the rest; what is still
undelivered then stays in the spool, and one line says how to deliver it (``vitreg sync``).
Offline (``offline=true`` / ``VITREG_OFFLINE=1``) nothing is sent at all.
"""

from __future__ import annotations

import json
import os
import threading
import time

from vitreg.console import progress
from vitreg.tracking.delivery import (ERROR_TAG, Delivery, experiment_id_for, first_line, http_timeout_s,
                                     short_http_requests, store_errors)
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.spool import Spool, SpoolLost, flush_timeout_s, offline_mode
from vitreg.tracking.uris import scrub
from vitreg.tracking.stale import heartbeat_period_s

MLFLOW_NOTE = "mlflow.note.content"  # MLflow's run description
_DELIVERY_INTERVAL_S = 1.0  # at most one round of requests a second while the work goes on
_WAKE_AT_RECORDS = 200  # ... or sooner, when this many records are pending
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.5, 8.0


def sync_hint(spool: Spool) -> str:
    """Where an undelivered run waits and the command that delivers it: the progress line of an
    undelivered close and the job's last line (``where_logged``) say the same thing; a lost spool says so."""
    if spool.lost:
        return spool.lost
    return f"the run is kept in {spool.path}: deliver it with `vitreg sync --spool {spool.path}`"


class SpoolingTracker:
    """The Tracker calls (params, tags, metrics, artifacts) against a spool, delivered in the background.

    ``existing_params``: what the server run already holds (``mlflow run``'s ``-P`` values), so that
    :meth:`log_params` can say which requested values it keeps, as the direct tracker does, without
    asking the server.
    """

    thread_safe = True

    def __init__(self, spool: Spool, offline: bool | None = None, client: mlflow.MlflowClient | None = None,
                 existing_params: dict | None = None, experiment_id: str | None = None,
                 heartbeat_s: float | None = None):
        self.spool = spool
        self.offline = offline_mode(offline)
        self.experiment_id = experiment_id
        self.run = None
        self._uri = spool.run_record.get("tracking_uri")
        self._params = {str(k): str(v) for k, v in (existing_params or {}).items()}
        self._recorded_run_id = spool.run_record.get("run_id")
        self.experiment_name = spool.run_record.get("experiment_name")  # under `mlflow run`: the one it chose
        self._pending: list[dict] = []
        self._pending_lock = threading.Lock()
        self._wake, self._stopped, self._done = threading.Event(), threading.Event(), threading.Event()
        self._last_error = ""
        self._closed: bool | None = None
        self._delivery = None
        self._thread = None
        if not self.offline:
            self._client = client
            self._heartbeat_s = heartbeat_s or heartbeat_period_s()
            self._thread = threading.Thread(target=self._deliver_loop, name="vitreg-spool", daemon=True)
            self._wake.set()  # create the run on the server (and its first heartbeat) right away
            self._thread.start()

    @classmethod
    def open(cls, experiment_name: str, run_name: str | None = None, run_id: str | None = None,
             tracking_uri: str | None = None, root=None, **kwargs) -> "SpoolingTracker":
        """A new spool for one run and its tracker.

        ``run_id``: the server run it continues, when one exists (``mlflow run``'s); ``tracking_uri``:
        where to deliver (default: MLflow's current one, when the thread starts).
        """
        spool = Spool.create(experiment_name, run_name=run_name, run_id=run_id, tracking_uri=tracking_uri,
                             root=root)
        return cls(spool, **kwargs)

    @property
    def run_id(self) -> str | None:
        """The server's run id: known once the run exists there (None for a new run not delivered yet)."""
        delivered = self._delivery.run_id if self._delivery else None
        return delivered or self._recorded_run_id

    # ----------------------------------------------------------------- the Tracker calls

    def _journal(self, records: list[dict]) -> None:
        if self.offline or self.spool.lost:
            return
        with self._pending_lock:
            self._pending.extend(records)
            many = len(self._pending) >= _WAKE_AT_RECORDS
        if many:
            self._wake.set()

    def existing_params(self) -> dict[str, str]:
        return dict(self._params)

    def log_params(self, params: dict) -> dict[str, str]:
        """Journal params the run does not hold yet; returns ``{key: held_value}`` of those it holds otherwise."""
        fresh, skipped = {}, {}
        for key, value in params.items():
            key, value = str(key), str(value)
            if key in self._params and self._params[key] != value:
                skipped[key] = self._params[key]
            elif key not in self._params:
                fresh[key] = value
        self._params.update(fresh)
        if fresh:
            self._journal(self.spool.append_params(fresh))
        return skipped

    def set_name(self, name: str) -> None:
        self._journal(self.spool.append_tags({mlflow.utils.mlflow_tags.MLFLOW_RUN_NAME: name}))

    def set_tags(self, tags: dict) -> None:
        clean = {k: str(v) for k, v in tags.items() if v is not None and not k.startswith("mlflow.")}
        if clean:
            self._journal(self.spool.append_tags(clean))

    def log_metrics(self, metrics: dict, step: int | None = None, synchronous: bool = True) -> None:
        """Journal the points (stamped now, with ``step``); never waits, whatever ``synchronous`` says."""
        self._journal(self.spool.append_metrics(metrics, step=step))

    def flush(self) -> None:
        """Make what was logged durable on local disk (delivery itself never blocks the caller)."""
        self.spool.fsync()

    def log_text(self, text: str, artifact_file: str) -> None:
        self._journal([self.spool.append_text(text, artifact_file)])

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.log_text(json.dumps(data, indent=2, sort_keys=True, default=str), artifact_file)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self._journal([self.spool.append_artifact(path, artifact_path)])

    def log_artifacts(self, path, artifact_path: str | None = None) -> None:
        self._journal([self.spool.append_artifact(path, artifact_path)])

    def artifact_uri(self, path: str = "") -> str:
        base = f"runs:/{self.run_id}"
        return f"{base}/{path}" if path else base

    def set_note(self, text: str) -> None:
        """The run's description in the MLflow UI (MLflow's own ``mlflow.note.content`` tag)."""
        self._journal(self.spool.append_tags({MLFLOW_NOTE: text}))

    def wait_delivered(self, timeout_s: float) -> bool:
        """Wake the delivery thread; True once everything journaled so far is on the server (False offline,
        or when ``timeout_s`` passes first)."""
        if self.offline:
            return False
        deadline = time.monotonic() + timeout_s
        while True:
            with self._pending_lock:
                if not self._pending:
                    return True
            if time.monotonic() >= deadline:
                return False
            self._wake.set()
            time.sleep(0.05)

    def check_on_server(self, name: str) -> None:
        """Before registering ``name`` from this run: wait until the run's files are on the server (the
        version points at them); a run still in the spool cannot be registered yet, one line says how to
        do it after ``vitreg sync``."""
        from vitreg.errors import VitregError

        if not self.wait_delivered(flush_timeout_s(None)):
            raise VitregError(f"cannot register {name!r} yet: the run is not on the tracking server "
                              f"({self._last_error or 'offline'}); deliver it with `vitreg sync --spool "
                              f"{self.spool.path}`, then `vitreg register {self.artifact_uri('checkpoints/last')} "
                              f"--name {name}`")

    # ----------------------------------------------------------------- the end

    @property
    def delivered(self) -> bool | None:
        """None while the run is open; after :meth:`close`, whether the store has all of it."""
        return self._closed

    def close(self, status: str = "FINISHED", timeout_s: float | None = None) -> bool:
        """Journal the final status; wait up to ``timeout_s`` for delivery. True when the server has it all.

        Otherwise the spool stays (locked until this process ends or delivery stops) and one line says
        where it is and how to deliver it.
        """
        if self._closed is not None:
            return self._closed  # one end per run: a second close (an error path after the first) is a no-op
        self._closed = self._close(status, flush_timeout_s(timeout_s))
        return self._closed

    def _close(self, status: str, timeout: float) -> bool:
        if not self.spool.lost:
            try:
                self._journal([self.spool.append_end(status)])
                self.spool.fsync()
            except SpoolLost:
                pass  # the spool went at the very end: said below, like any other loss
        if self.spool.lost:
            return self._close_lost()
        if self.offline:
            self.spool.release()
            progress(sync_hint(self.spool))
            return False
        self._wake.set()
        delivered = self._done.wait(timeout)
        self._stopped.set()
        self._wake.set()
        if delivered:
            self._thread.join()
            self.spool.remove()
            return True
        reason = f"the tracking store did not take it in {timeout:g} s ({self._last_error or 'still sending'}): "
        progress(reason + sync_hint(self.spool))
        return False

    def _close_lost(self) -> bool:
        """The spool can no longer keep the run: stop delivering, end the server run FAILED with the reason
        (when the server answers), and say so in one line. Never claims the run is kept anywhere."""
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(http_timeout_s() + 1)
        ended = False
        if not self.offline and self.run_id:
            try:
                with short_http_requests():
                    client = self._client or mlflow.MlflowClient(tracking_uri=self._uri)
                    client.set_tag(self.run_id, ERROR_TAG, scrub(self.spool.lost)[:4000])
                    client.set_terminated(self.run_id, "FAILED")
                ended = True
            except Exception as exc:  # noqa: BLE001 - the server is down too: the run is left to `runs --stale`
                self._last_error = first_line(exc)
        if ended:
            where = f"run {self.run_id} is marked FAILED on the tracking server"
        elif self.offline or not self.run_id:
            where = "nothing of it reached the tracking server"
        else:
            where = (f"run {self.run_id} could not be ended on the tracking server ({self._last_error}): "
                     f"`vitreg runs --stale --fix` ends it later")
        progress(f"{self.spool.lost}; {where}")
        self.spool.release()
        return False

    # ----------------------------------------------------------------- the delivery thread

    def _deliver_loop(self) -> None:
        retry_at, backoff, next_beat = 0.0, _BACKOFF_FIRST_S, 0.0
        with short_http_requests():
            try:
                # Built here: for a sqlite store the client creates (or migrates) the database, seconds of work
                client = self._client or mlflow.MlflowClient(tracking_uri=self._uri)
                self._delivery = Delivery(self.spool, client, heartbeat=True)
                while not self._stopped.is_set() and not self._done.is_set():
                    now = time.monotonic()
                    self._wake.wait(retry_at - now if retry_at > now else _DELIVERY_INTERVAL_S)
                    self._wake.clear()
                    if self._stopped.is_set() or time.monotonic() < retry_at:
                        continue
                    try:
                        next_beat = self._deliver_pending(next_beat)
                        retry_at, backoff = 0.0, _BACKOFF_FIRST_S
                    except Exception as exc:  # noqa: BLE001 - any server or network failure: retry later
                        self._last_error = first_line(exc)
                        retry_at, backoff = time.monotonic() + backoff, min(backoff * 2, _BACKOFF_MAX_S)
            finally:
                if not self._done.is_set():
                    self.spool.release()  # undelivered: `vitreg sync` may take it once this ends

    def _deliver_pending(self, next_beat: float) -> float:
        """One round: send what is pending (or a heartbeat when due); returns when the next beat is due."""
        with self._pending_lock:
            records = list(self._pending)
        beat_due = time.monotonic() >= next_beat
        if not records and not beat_due:
            return next_beat
        self.spool.fsync()
        try:
            if records:
                self._delivery.heartbeat = beat_due
                self._delivery.push(records)
            else:
                self._delivery.beat()
        finally:
            delivered = self._delivery.delivered_seq
            with self._pending_lock:
                self._pending = [r for r in self._pending if r["seq"] > delivered]
        if any(r["kind"] == "end" and r["seq"] <= delivered for r in records):
            self._done.set()
        return time.monotonic() + self._heartbeat_s if beat_due else next_beat


def open_run(experiment_name: str = "Default", run_name: str | None = None, tags: dict | None = None,
             offline=None, root=None) -> SpoolingTracker:
    """Start (or, under ``mlflow run``, continue) a run the spooled way and return its tracker.

    Online this costs one short request (a dead store fails it in seconds, one line naming the store): it
    creates the run, or reads ``mlflow run``'s (``MLFLOW_RUN_ID``) for its experiment and its ``-P``
    params, so the run id is known from the start (for the registry, child runs, ``runs:/`` URIs). The
    run is not MLflow's fluent active run: nothing but the tracker ends it. Offline nothing is sent, and
    ``vitreg sync`` creates the run later.
    """
    offline = offline_mode(offline)
    uri = mlflow.get_tracking_uri()
    run_id, existing, experiment_id = os.environ.get("MLFLOW_RUN_ID") or None, {}, None
    if not offline:
        with short_http_requests(), store_errors(uri, "starting the run"):
            client = mlflow.MlflowClient(tracking_uri=uri)
            if run_id:
                run = client.get_run(run_id)
                experiment_name = client.get_experiment(run.info.experiment_id).name
            else:
                run = client.create_run(experiment_id_for(client, experiment_name), run_name=run_name)
            run_id, existing, experiment_id = run.info.run_id, dict(run.data.params), run.info.experiment_id
    tracker = SpoolingTracker.open(experiment_name, run_name=run_name, run_id=run_id, tracking_uri=uri,
                                   root=root, offline=offline, existing_params=existing,
                                   experiment_id=experiment_id)
    if tags:
        tracker.set_tags(tags)
    return tracker
