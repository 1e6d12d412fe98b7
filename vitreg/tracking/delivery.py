"""Deliver a spool's records to an MLflow tracking store exactly once, in order, in batches.

The server says what it already has: every batch carries the tag ``vitreg_spool_seq.<spool id>`` = the
sequence number of the last journal record it covers, so a delivery that starts again (the next attempt of the
background thread, or ``vitreg sync`` after a crash) skips what the run already holds. MLflow's SQL store
writes a ``log_batch``'s params, then metrics, then tags: the sequence tag lands last, and a batch cut
short before it is sent again whole, which MLflow absorbs (a metric point identical in key, value,
timestamp and step is stored once; a param with the same value is accepted). Artifacts are uploaded to the
same path again (an overwrite), and the final status is set before the tag that covers it.

A run the server never saw is created with the tag ``vitreg_spool_id`` and looked up by that tag before
creating, so a crash right after creating it does not make a second run.

MLflow's HTTP client retries for minutes against a dead or failing server; :func:`short_http_requests`
makes each request fail within seconds (the caller owns the back-off).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from pathlib import Path

from vitreg import errors
from vitreg.config.parse import parse_float
from vitreg.errors import StoreError, VitregError
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.quiet import quiet_run_links
from vitreg.tracking.spool import MAX_METRICS, MAX_PARAMS, MAX_TAGS, Spool
from vitreg.tracking.uris import redact, scrub

SPOOL_ID_TAG = "vitreg_spool_id"
HEARTBEAT_TAG = "vitreg_heartbeat"  # unix seconds, refreshed while the process that logs the run is alive
ERROR_TAG = "vitreg_error"  # the one-line reason a run ended FAILED or KILLED
ERROR_KIND_TAG = "vitreg_error_kind"  # the VitregError subclass, e.g. OutOfMemory: what a parent branches on
_MAX_ENTITIES = 1000  # log_batch: metrics + params + tags together

_short_http_users = 0  # trackers and syncs inside short_http_requests(); the last one out restores
_short_http_lock = threading.Lock()
_saved_http_settings: dict[str, str | None] = {}


def http_timeout_s() -> int:
    """``VITREG_HTTP_TIMEOUT_S`` (default 10): the most one request to the server may take during delivery."""
    return int(parse_float(os.environ.get("VITREG_HTTP_TIMEOUT_S") or 10, "VITREG_HTTP_TIMEOUT_S", minimum=1))


@contextlib.contextmanager
def short_http_requests():
    """While inside, MLflow HTTP requests of this process make one attempt of at most ``http_timeout_s()``.

    The caller owns the back-off: a dead server then costs seconds, not MLflow's minutes of retries.
    MLflow reads these variables at every request and has no per-client setting, so they are set for
    the whole process while any delivery runs, and restored when the last one ends.
    """
    global _short_http_users
    with _short_http_lock:
        if _short_http_users == 0:
            settings = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(http_timeout_s())}
            _saved_http_settings.update({name: os.environ.get(name) for name in settings})
            os.environ.update(settings)
        _short_http_users += 1
    try:
        yield
    finally:
        with _short_http_lock:
            _short_http_users -= 1
            if _short_http_users == 0:
                for name, value in _saved_http_settings.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value


def bound_http_requests() -> None:
    """Every MLflow HTTP request of this process (a CLI command) ends within a bounded time: two retries
    a second apart, ``http_timeout_s()`` each, instead of MLflow's seven with doubling back-off (90-200 s
    against a server that answers 503). Settings the user made are kept."""
    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"), ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                        ("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0.5"),
                        ("MLFLOW_HTTP_REQUEST_TIMEOUT", str(http_timeout_s()))):
        os.environ.setdefault(name, value)


def store_error_for(exc: BaseException) -> StoreError | None:
    """The one line for a failure of the tracking store that reached the CLI unconverted (an MLflow,
    requests or urllib3 error): the store, masked, and the reason (``HTTP 503 from the server``); None for
    any other exception."""
    names = {cls.__module__.split(".")[0] for cls in type(exc).__mro__}
    if not names & {"mlflow", "requests", "urllib3"}:
        return None
    return StoreError(f"the tracking store at {redact(mlflow.get_tracking_uri())} failed ({first_line(exc)}): "
                      f"check that it is up and answers, or MLFLOW_TRACKING_URI")


def seq_tag(spool_id: str) -> str:
    """The tag holding how far one spool got on its run: per spool, as two processes may log to one run
    (a launcher and its rank 0 under ``mlflow run``'s run id), each with its own journal."""
    return f"vitreg_spool_seq.{spool_id}"


def heartbeat_value() -> str:
    return f"{time.time():.0f}"


@contextlib.contextmanager
def store_errors(uri: str, doing: str):
    """Any failure of the tracking store inside becomes one :class:`StoreError` line naming it."""
    try:
        yield
    except VitregError:
        raise  # already one line naming the fix
    except Exception as exc:  # noqa: BLE001 - MlflowException, requests/urllib3 errors, sqlalchemy errors
        raise StoreError(f"the tracking store at {redact(uri)} failed while {doing} ({first_line(exc)}): "
                         f"check that it is up, or MLFLOW_TRACKING_URI") from None


def first_line(exc: BaseException) -> str:
    """The reason in a few words: MLflow wraps urllib3's in a paragraph naming the URL and the pool.
    Any URI or credential in it is masked (:func:`~vitreg.tracking.uris.scrub`)."""
    return scrub(_reason(exc))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    errno = re.search(r"\[Errno -?\d+\] ([^\"')]+)", text)
    if errno:
        return errno.group(1).strip()
    status = re.search(r"too many (\d{3}) error responses|error code (\d{3}) != 200", text)
    if status:
        return f"HTTP {status.group(1) or status.group(2)} from the server"
    return errors.first_line(exc)


def experiment_id_for(client: mlflow.MlflowClient, name: str) -> str:
    """The id of the experiment called ``name``, created if the store has none."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except mlflow.exceptions.MlflowException as exc:  # created meanwhile by another process
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


class _Batch:
    """Up to one log_batch call of records, and the last sequence number it covers."""

    def __init__(self):
        self.metrics, self.params, self.tags, self.last_seq = [], {}, {}, None

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

    # ----------------------------------------------------------------- the server's run

    def connect(self) -> str:
        """Find (or create) this spool's run on the server and read how far it got. Idempotent."""
        if self.run_id is None:
            run = self._known_run() or self._tagged_run() or self._create_run()
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

    def _experiment_id(self) -> str:
        return experiment_id_for(self.client, self._run_record.get("experiment_name") or "Default")

    def _tagged_run(self):
        spool_id = self._run_record["spool_id"]
        experiment_id = self._experiment_id()
        found = self.client.search_runs([experiment_id], filter_string=f"tags.{SPOOL_ID_TAG} = '{spool_id}'",
                                        max_results=1)
        return found[0] if found else None

    def _create_run(self):
        record = self._run_record
        tags = {SPOOL_ID_TAG: record["spool_id"]}
        if record.get("run_name"):
            tags[mlflow.utils.mlflow_tags.MLFLOW_RUN_NAME] = record["run_name"]
        return self.client.create_run(self._experiment_id(), start_time=record["start_time"], tags=tags,
                                      run_name=record.get("run_name"))

    # ----------------------------------------------------------------- sending

    def push(self, records: list[dict]) -> int:
        """Deliver ``records`` (in order) that the server does not hold yet; returns the last seq delivered.

        Raises MlflowException / OSError / requests errors when the store fails; what was delivered before
        the failure is recorded on the server, so calling again later resumes.
        """
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
            else:
                self._send(batch)
                self._apply(record)
                batch = _Batch()
                batch.last_seq = record["seq"]
                self._send(batch)
                batch = _Batch()
        self._send(batch)
        return self.delivered_seq

    def beat(self) -> None:
        """A heartbeat alone (nothing else to send)."""
        self.connect()
        self.client.set_tag(self.run_id, HEARTBEAT_TAG, heartbeat_value())

    def _apply(self, record: dict) -> None:
        """The records that are not log_batch calls: an artifact upload, the final status."""
        if record["kind"] == "artifact":
            local = str(Path(self.spool.path) / record["path"])
            if record["is_dir"]:
                self.client.log_artifacts(self.run_id, local, record.get("artifact_path"))
            else:
                self.client.log_artifact(self.run_id, local, record.get("artifact_path"))
        elif record["kind"] == "end":
            self.client.set_terminated(self.run_id, record["status"], end_time=record["end_time"])

    def _send(self, batch: _Batch) -> None:
        """One log_batch with the batch's records and the sequence tag (nothing for an empty batch)."""
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
