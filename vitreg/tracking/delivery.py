"""A spooled run reaches the tracking store exactly once, in order: live, from a background thread while the
work goes on (:class:`SpoolingTracker`, what every run logs through), or later with ``vitreg sync``.

Live: each call appends to the run's spool and returns; a thread sends what is pending about once a second in
``log_batch`` calls, with a heartbeat tag (what tells a live run from a stale one), backing off 0.5 s doubling
to 8 s while the server fails. :meth:`SpoolingTracker.close` waits ``VITREG_FLUSH_TIMEOUT_S`` for the rest.

Exactly once: every batch carries the tag ``vitreg_spool_seq.<spool id>`` = the last journal record it covers,
so a delivery that starts again skips what the run holds. MLflow's SQL store writes a batch's tags last: a
batch cut short is sent again whole, which MLflow absorbs (an identical metric point is stored once, an
identical param accepted). A new run is tagged ``vitreg_spool_id`` and looked up by it first: a crash right
after creating it makes no second run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

from vitreg.config.parse import parse_float
from vitreg.console import progress
from vitreg.errors import VitregError
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.spool import (MAX_METRICS, MAX_PARAMS, MAX_TAGS, Contents, Spool, SpoolLost, SpoolUnusable,
                                   check_spool_root, clean_tags, dict_text, flush_timeout_s, offline_mode, spool_root)
from vitreg.tracking.store import (create_experiment, first_line, http_timeout_s, quiet_run_links, short_http_requests,
                                   store_errors)
from vitreg.tracking.uris import scrub

SPOOL_ID_TAG = "vitreg_spool_id"
HEARTBEAT_TAG = "vitreg_heartbeat"  # unix seconds, refreshed while the process that logs the run is alive
ERROR_TAG = "vitreg_error"  # the one-line reason a run ended FAILED or KILLED
ERROR_KIND_TAG = "vitreg_error_kind"  # the VitregError subclass, e.g. OutOfMemory: what a parent branches on
DEFAULT_HEARTBEAT_S = 30.0
_MAX_ENTITIES = 1000  # log_batch: metrics + params + tags together
_DELIVERY_INTERVAL_S = 1.0  # at most one round of requests a second while the work goes on
_WAKE_AT_RECORDS = 200  # ... or sooner, when this many records are pending
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.5, 8.0


def heartbeat_period_s() -> float:
    """``VITREG_HEARTBEAT_S`` (seconds between heartbeats), default 30."""
    return parse_float(os.environ.get("VITREG_HEARTBEAT_S") or DEFAULT_HEARTBEAT_S, "VITREG_HEARTBEAT_S",
                       minimum=0.1)


def requested_run_id() -> str | None:
    """The run ``mlflow run`` asked this process to log into (``MLFLOW_RUN_ID``), if any."""
    return os.environ.get("MLFLOW_RUN_ID") or None


def end_with_reason(client: mlflow.MlflowClient, run_id: str, status: str, reason: str) -> None:
    """End run ``run_id`` with ``status`` and the reason in ``vitreg_error``: a run no tracker here holds."""
    client.set_tag(run_id, ERROR_TAG, scrub(reason)[:4000])
    client.set_terminated(run_id, status)


def delete_run_artifacts(client: mlflow.MlflowClient, run_id: str, artifact_path: str) -> None:
    """Remove ``artifact_path`` from the run's artifacts (MLflow's client has no such call). A store that cannot
    or may not delete (a 4xx answer) keeps the files: the run is larger, not wrong. Anything else is retried."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(client.get_run(run_id).info.artifact_uri, tracking_uri=client.tracking_uri)
    try:
        repo.delete_artifacts(artifact_path)
    except NotImplementedError:
        pass
    except Exception as exc:  # MlflowException, or requests' HTTPError from the server's artifact proxy
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, mlflow.exceptions.MlflowException):
            status = exc.get_http_status_code()
        if "not implemented" not in str(exc).lower() and not (status and 400 <= int(status) < 500):
            raise


def seq_tag(spool_id: str) -> str:
    """How far one spool got on its run: per spool, as two processes may log to one run (a launcher and its
    rank 0 under ``mlflow run``), each with its own journal."""
    return f"vitreg_spool_seq.{spool_id}"


def heartbeat_value() -> str:
    return f"{time.time():.0f}"


def experiment_id_for(client: mlflow.MlflowClient, name: str) -> str:
    """The id of the experiment called ``name``, created if the store has none."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return create_experiment(client, name)  # a sqlite store's artifacts beside its file
    except mlflow.exceptions.MlflowException as exc:  # created meanwhile by another process
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


# --------------------------------------------------------------------------- one spool to one store


class _Batch:
    """Up to one log_batch call of records, and the last sequence number it covers."""

    def __init__(self, last_seq: int | None = None):
        self.metrics, self.params, self.tags, self.last_seq = [], {}, {}, last_seq

    def fits(self, record: dict) -> bool:
        metrics = len(self.metrics) + len(record.get("metrics", ()))
        params = len(self.params) + len(record.get("params", {}))
        tags = len(self.tags) + len(record.get("tags", {}))
        return (metrics <= MAX_METRICS and params <= MAX_PARAMS and tags <= MAX_TAGS
                and metrics + params + tags + 2 <= _MAX_ENTITIES)

    def add(self, record: dict) -> None:
        self.metrics += record.get("metrics", [])
        self.params.update(record.get("params", {}))
        self.tags.update(record.get("tags", {}))
        self.last_seq = record["seq"]


class Delivery:
    """Sends one spool's records to one tracking store; keeps where the server's run stands."""

    def __init__(self, spool: Spool, client: mlflow.MlflowClient | None = None, heartbeat: bool = False):
        quiet_run_links()  # set_terminated would print MLflow's link, credentials and all
        self.spool = spool
        self.client = client or mlflow.MlflowClient()
        self.heartbeat = heartbeat  # a live process: every batch also says "still alive"
        self.run_id: str | None = None
        self.delivered_seq = -1
        self._server_params: dict[str, str] = {}
        self._run_record = spool.run_record
        self._seq_tag = seq_tag(self._run_record["spool_id"])

    def connect(self) -> str:
        """Find (or create) this spool's run on the server and read how far it got. Idempotent."""
        if self.run_id is None:
            run = self._known_run() or self._tagged_or_new_run()
            self.run_id = run.info.run_id
            self.delivered_seq = int(run.data.tags.get(self._seq_tag, -1))
            self._server_params = dict(run.data.params)
        return self.run_id

    def _known_run(self):
        """The run whose id the spool recorded (created online, or by ``mlflow run``), if this store has it."""
        run_id = self._run_record.get("run_id")
        if not run_id:
            return None
        try:
            return self.client.get_run(run_id)
        except mlflow.exceptions.MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None  # another store than the one it was made in: find or create it by spool id
            raise

    def _tagged_or_new_run(self):
        """The run tagged with this spool's id (made before a crash), else a new one (the store names it)."""
        record = self._run_record
        experiment_id = experiment_id_for(self.client, record.get("experiment_name") or "Default")
        found = self.client.search_runs([experiment_id], f"tags.{SPOOL_ID_TAG} = '{record['spool_id']}'",
                                        max_results=1)
        return found[0] if found else self.client.create_run(
            experiment_id, start_time=record["start_time"], tags={SPOOL_ID_TAG: record["spool_id"]},
            run_name=record.get("run_name"))

    def push(self, records: list[dict]) -> int:
        """Deliver those of ``records`` the server does not hold yet, in order; returns the last seq delivered.
        A failure is raised; a later call resumes after what the server holds."""
        self.connect()
        batch = _Batch()
        for record in records:
            if record["seq"] <= self.delivered_seq or record["kind"] == "run":
                continue
            if record["kind"] in ("params", "tags", "metrics"):
                if not batch.fits(record):
                    self._send(batch)
                    batch = _Batch()
                batch.add(record)
            else:  # sent alone, then its own sequence tag
                self._send(batch)
                self._apply(record)
                self._send(_Batch(last_seq=record["seq"]))
                self._release(record)
                batch = _Batch()
        self._send(batch)
        return self.delivered_seq

    def shortfall(self, records: list[dict]) -> str | None:
        """What the server's run lacks of ``records``, counted (:class:`~vitreg.tracking.spool.Contents`); None
        when it holds them all: only then may the spool go."""
        expected = Contents(records, Path(self.spool.path))
        run = self.client.get_run(self.connect())
        lacking = [f"param {k}" for k in sorted(expected.params - run.data.params.keys())]
        lacking += [f"tag {k}" for k in sorted(expected.tags - run.data.tags.keys())]
        for key, points in sorted(expected.points.items()):
            held_points = len(self.client.get_metric_history(self.run_id, key))
            if held_points < points:
                lacking.append(f"metric {key}: {held_points} of {points} points")
        lacking += [f"artifact {path}" for path in self._missing_files(expected.files)]
        if expected.status and run.info.status != expected.status:
            lacking.append(f"status {expected.status} (it is {run.info.status})")
        if not lacking:
            return None
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        return f"{', '.join(lacking[:3])}{more}"

    def _missing_files(self, paths: set[str]) -> list[str]:
        listed: dict[str, set[str]] = {}
        missing = []
        for path in sorted(paths):
            folder = path.rpartition("/")[0]
            if folder not in listed:
                listed[folder] = {f.path for f in self.client.list_artifacts(self.run_id, folder or None)}
            if path not in listed[folder]:
                missing.append(path)
        return missing

    def beat(self) -> None:
        self.connect()
        self.client.set_tag(self.run_id, HEARTBEAT_TAG, heartbeat_value())

    def _release(self, record: dict) -> None:
        """Free the spool's copy of an artifact the server's sequence tag covers: else the spool kept every
        checkpoint a training logged until the run ended."""
        if record["kind"] == "artifact":
            copy = Path(self.spool.path) / record["path"]
            shutil.rmtree(copy if record["is_dir"] else copy.parent, ignore_errors=True)

    def _apply(self, record: dict) -> None:
        if record["kind"] == "artifact":
            local = str(Path(self.spool.path) / record["path"])
            if not os.path.exists(local):
                return  # its copy was freed once the store held it (_release): a second send finds nothing to send
            if record["is_dir"]:
                self.client.log_artifacts(self.run_id, local, record.get("artifact_path"))
            else:
                self.client.log_artifact(self.run_id, local, record.get("artifact_path"))
        elif record["kind"] == "delete":
            delete_run_artifacts(self.client, self.run_id, record["artifact_path"])
        elif record["kind"] == "end":
            self.client.set_terminated(self.run_id, record["status"], end_time=record["end_time"])

    def tidy_up(self) -> None:
        """Take the heartbeat off an ended, delivered run (only ``find_stale`` reads it, on RUNNING runs; the UI
        lists it beside the tags people filter by). Best effort."""
        if self.run_id is None:
            return
        try:
            run = self.client.get_run(self.run_id)
            if run.info.status != "RUNNING" and HEARTBEAT_TAG in run.data.tags:
                self.client.delete_tag(self.run_id, HEARTBEAT_TAG)
        except (mlflow.exceptions.MlflowException, OSError):
            pass

    def _send(self, batch: _Batch) -> None:
        if batch.last_seq is None:
            return
        # A param MLflow already holds with another value is the `mlflow run -P` request: params are
        # immutable and the resolved value is a tag of the same name, so it is not sent again.
        params = {k: v for k, v in batch.params.items() if self._server_params.get(k, v) == v}
        tags = {**batch.tags, self._seq_tag: str(batch.last_seq)}
        if self.heartbeat:
            tags[HEARTBEAT_TAG] = heartbeat_value()
        self.client.log_batch(
            self.run_id,
            metrics=[mlflow.entities.Metric(key, value, ts, step) for key, value, ts, step in batch.metrics],
            params=[mlflow.entities.Param(k, v) for k, v in params.items()],
            tags=[mlflow.entities.RunTag(k, v) for k, v in tags.items()],
            synchronous=True,
        )
        self._server_params.update(params)
        self.delivered_seq = batch.last_seq


# --------------------------------------------------------------------------- live: the tracker every run logs through


def sync_hint(spool: Spool) -> str:
    """Where an undelivered run waits and the command that delivers it (or why its spool was lost)."""
    if spool.lost:
        return spool.lost
    return f"the run is kept in {spool.path}: deliver it with `vitreg sync --spool {spool.path}`"


class SpoolingTracker:
    """The :class:`~vitreg.tracking.runs.Tracker` of every run: its calls are journaled and delivered in the
    background; it ends with :meth:`close`. ``existing_params``: ``mlflow run``'s ``-P`` values."""

    thread_safe = True

    def __init__(self, spool: Spool, offline: bool | None = None, existing_params: dict | None = None,
                 experiment_id: str | None = None, heartbeat_s: float | None = None):
        self.spool = spool
        self.offline = offline_mode(offline)
        self.experiment_id = experiment_id
        self._uri = spool.run_record.get("tracking_uri")
        self._params = {str(k): str(v) for k, v in (existing_params or {}).items()}
        self._recorded_run_id = spool.run_record.get("run_id")
        self.experiment_name = spool.run_record.get("experiment_name")  # under `mlflow run`: the one it chose
        self._pending: list[dict] = []
        self._pending_lock = threading.Lock()
        self._wake, self._stopped, self._done = threading.Event(), threading.Event(), threading.Event()
        self._last_error = ""
        self.delivered: bool | None = None  # after close: whether the store has all of the run
        self._delivery = None
        self._thread = None
        if not self.offline:
            self._heartbeat_s = heartbeat_s or heartbeat_period_s()
            self._thread = threading.Thread(target=self._deliver_loop, name="vitreg-spool", daemon=True)
            self._wake.set()  # create the run on the server (and its first heartbeat) right away
            self._thread.start()

    @classmethod
    def open(cls, experiment_name: str, run_name: str | None = None, run_id: str | None = None,
             tracking_uri: str | None = None, root=None, **kwargs) -> "SpoolingTracker":
        spool = Spool.create(experiment_name, run_name=run_name, run_id=run_id, tracking_uri=tracking_uri,
                             root=root)
        return cls(spool, **kwargs)

    @property
    def run_id(self) -> str | None:
        """None for a new run not delivered yet."""
        delivered = self._delivery.run_id if self._delivery else None
        return delivered or self._recorded_run_id

    def _journal(self, records: list[dict]) -> None:
        if self.offline or self.spool.lost:
            return
        with self._pending_lock:
            self._pending.extend(records)
            many = len(self._pending) >= _WAKE_AT_RECORDS
        if many:
            self._wake.set()

    def log_params(self, params: dict) -> dict[str, str]:
        """Journal params the run does not hold yet; returns ``{key: held_value}`` of those it holds otherwise."""
        params = {str(k): str(v) for k, v in params.items()}
        skipped = {k: self._params[k] for k, v in params.items() if self._params.get(k, v) != v}
        fresh = {k: v for k, v in params.items() if k not in self._params}
        self._params.update(fresh)
        if fresh:
            self._journal(self.spool.append_params(fresh))
        return skipped

    def set_name(self, name: str) -> None:
        self._journal(self.spool.append_tags({mlflow.utils.mlflow_tags.MLFLOW_RUN_NAME: name}))

    def set_tags(self, tags: dict) -> None:
        clean = clean_tags(tags)
        if clean:
            self._journal(self.spool.append_tags(clean))

    def log_metrics(self, metrics: dict, step: int | None = None, synchronous: bool = True) -> None:
        """Never waits, whatever ``synchronous`` says."""
        self._journal(self.spool.append_metrics(metrics, step=step))

    def flush(self) -> None:
        self.spool.fsync()

    def log_text(self, text: str, artifact_file: str) -> None:
        self._journal([self.spool.append_text(text, artifact_file)])

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.log_text(dict_text(data), artifact_file)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self._journal([self.spool.append_artifact(path, artifact_path)])

    log_artifacts = log_artifact  # a file or a folder alike: the spool copies either

    def delete_artifacts(self, artifact_path: str) -> None:
        self._journal([self.spool.append_delete(artifact_path)])

    def artifact_uri(self, path: str = "") -> str:
        base = f"runs:/{self.run_id}"
        return f"{base}/{path}" if path else base

    def set_note(self, text: str) -> None:
        self._journal(self.spool.append_tags({mlflow.utils.mlflow_tags.MLFLOW_RUN_NOTE: text}))

    def wait_delivered(self, timeout_s: float) -> bool:
        """True once everything journaled so far is on the server (False offline, or after ``timeout_s``)."""
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
        """Before registering ``name`` from this run: wait until the run is on the server, else say how."""
        if not self.wait_delivered(flush_timeout_s(None)):
            raise VitregError(f"cannot register {name!r} yet: the run is not on the tracking server "
                              f"({self._last_error or 'offline'}); deliver it with `vitreg sync --spool "
                              f"{self.spool.path}`, then `vitreg register {self.artifact_uri('checkpoints/last')} "
                              f"--name {name}`")

    def close(self, status: str = "FINISHED", timeout_s: float | None = None) -> bool:
        """Journal the final status; wait up to ``timeout_s`` for delivery. True when the server has it all;
        otherwise the spool stays and one line says how to deliver it."""
        if self.delivered is None:  # one end per run: a second close (an error path after the first) is a no-op
            self.delivered = self._close(status, flush_timeout_s(timeout_s))
        return self.delivered

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
            lacking = self._lacking()
            if lacking is None:
                self.spool.remove()
                if self._delivery is not None:
                    self._delivery.tidy_up()  # after the spool went: a crash between leaves tags, never a re-send
                return True
            progress(f"the tracking store's run {self.run_id} lacks {lacking}: " + sync_hint(self.spool))
            self.spool.release()  # the thread is done: `vitreg sync` may take it now
            return False
        reason = f"the tracking store did not take it in {timeout:g} s ({self._last_error or 'still sending'}): "
        progress(reason + sync_hint(self.spool))
        return False

    def _lacking(self) -> str | None:
        """What the server's run lacks of this spool, or the failure that kept it from saying."""
        try:
            with short_http_requests():
                return self._delivery.shortfall(self.spool.records())
        except Exception as exc:  # noqa: BLE001 - the store failed while counting: keep the spool
            return f"a count of what it holds ({first_line(exc)})"

    def _close_lost(self) -> bool:
        """The spool can no longer keep the run: stop delivering, end the server run FAILED, say so."""
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(http_timeout_s() + 1)
        where = "nothing of it reached the tracking server"
        if not self.offline and self.run_id:
            try:
                with short_http_requests():
                    end_with_reason(mlflow.MlflowClient(tracking_uri=self._uri), self.run_id, "FAILED", self.spool.lost)
                where = f"run {self.run_id} is marked FAILED on the tracking server"
            except Exception as exc:  # noqa: BLE001 - the server is down too: the run is left to `runs --stale`
                self._last_error = first_line(exc)
                where = (f"run {self.run_id} could not be ended on the tracking server ({self._last_error}): "
                         f"`vitreg runs --stale --fix` ends it later")
        progress(f"{self.spool.lost}; {where}")
        self.spool.release()
        return False

    def _deliver_loop(self) -> None:
        # short_http_requests around each round, not the whole loop: its settings are asserted afresh each time,
        # and an idle or forgotten delivery holds no process-wide state between rounds
        retry_at, backoff, next_beat = 0.0, _BACKOFF_FIRST_S, 0.0
        try:
            with short_http_requests():  # for a sqlite store the client creates (or migrates) the database here
                self._delivery = Delivery(self.spool, mlflow.MlflowClient(tracking_uri=self._uri), heartbeat=True)
            while not self._stopped.is_set() and not self._done.is_set():
                now = time.monotonic()
                self._wake.wait(retry_at - now if retry_at > now else _DELIVERY_INTERVAL_S)
                self._wake.clear()
                if self._stopped.is_set() or time.monotonic() < retry_at:
                    continue
                try:
                    with short_http_requests():
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
    """Start (or, under ``mlflow run``, continue) a run the spooled way and return its tracker. Online one short
    request creates (or reads) the run, so its id is known from the start; offline ``vitreg sync`` creates it."""
    offline = offline_mode(offline)
    uri = mlflow.get_tracking_uri()
    root = Path(root or spool_root())
    check_spool_root(root)  # before the server has a run: one that cannot be spooled is never RUNNING there
    run_id, existing, experiment_id, created = requested_run_id(), {}, None, False
    if not offline:
        with short_http_requests(), store_errors(uri, "starting the run"):
            client = mlflow.MlflowClient(tracking_uri=uri)
            if run_id:
                run = client.get_run(run_id)
                experiment_name = client.get_experiment(run.info.experiment_id).name
                for stale in {ERROR_TAG, ERROR_KIND_TAG} & set(run.data.tags):  # an earlier attempt's, untrue now
                    client.delete_tag(run_id, stale)
            else:
                run = client.create_run(experiment_id_for(client, experiment_name), run_name=run_name)
                created = True
            run_id, existing, experiment_id = run.info.run_id, dict(run.data.params), run.info.experiment_id
    try:
        tracker = SpoolingTracker.open(experiment_name, run_name=run_name, run_id=run_id, tracking_uri=uri,
                                       root=root, offline=offline, existing_params=existing,
                                       experiment_id=experiment_id)
    except SpoolUnusable as exc:  # the folder changed since the check (a disk filled): end the run we made
        if created:
            with short_http_requests(), contextlib.suppress(Exception):
                end_with_reason(client, run_id, "FAILED", str(exc))
        raise
    try:
        tracker.set_tags(tags or {})
    except BaseException as exc:  # a tag refused (a NUL in its name): the run ends, its delivery thread with it
        with contextlib.suppress(Exception):
            tracker.set_tags({ERROR_TAG: first_line(exc)})
        tracker.close("FAILED")
        raise
    return tracker
