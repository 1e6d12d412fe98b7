"""The MLflow side of vitreg: runs, params, tags, batched metrics, artifacts, search.

Only :mod:`vitreg.tracking` reaches mlflow, and only through :mod:`vitreg.tracking.mlflow_on_first_use` (imported on
first use: DDP ranks never pay for it). Runners and training loops return typed results; this layer logs
them, outside any timed region.

Conventions:
- ``mlflow run`` creates the run, logs every ``-P`` value as a param and passes ``MLFLOW_RUN_ID``;
  :func:`tracked_run` resumes that run. MLflow params are immutable, so a resolved value that differs
  from what the user typed (``gpu=auto`` -> ``h200``) cannot replace the param: resolved values are
  always set as tags of the same name (``gpu``, ``amp``, ``device``, ``img_size``), and as params
  wherever MLflow has not already logged the request. Group and compare by the tags.
- Under torchrun only rank 0 logs; under a vitreg launcher no rank talks to MLflow: rank 0 hands its
  calls to the launcher (:mod:`vitreg.tracking.handoff`), which logs them into the run it holds.
- A run that fails ends FAILED with the one-line reason in the ``vitreg_error`` tag; never RUNNING.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Protocol

from vitreg.ddp.world import is_main_process
from vitreg.errors import StoreError, VitregError
from vitreg import signals
from vitreg.signals import interrupted_reason
from vitreg.tracking.delivery import ERROR_KIND_TAG, ERROR_TAG, first_line, short_http_requests, store_errors
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.spool import flush_timeout_s, offline_mode
from vitreg.tracking.spooling import open_run, sync_hint
from vitreg.tracking.store import prepare_store
from vitreg.tracking.uris import redact, scrub, without_credentials


def tracking_uri() -> str:
    """MLflow's tracking URI as vitreg prints it (credentials masked, :func:`~vitreg.tracking.uris.redact`).
    Before mlflow is imported nothing can have called ``mlflow.set_tracking_uri``, so a set MLFLOW_TRACKING_URI
    is the answer MLflow would give: a DDP rank prints it without importing mlflow."""
    if "mlflow" not in sys.modules and os.environ.get("MLFLOW_TRACKING_URI"):
        return redact(os.environ["MLFLOW_TRACKING_URI"])
    return redact(mlflow.get_tracking_uri())


class Tracker(Protocol):
    """What a job logs through: the calls against one run, each a batch (never one call per value).

    Implementations: :class:`MlflowTracker` (a run in the MLflow store), :class:`NullTracker`
    (ranks that do not log) and :class:`vitreg.tracking.handoff.HandoffTracker` (rank 0 under a
    vitreg launcher: the calls are written down for the launcher to replay into its run).
    """

    run_id: str
    experiment_id: str
    #: True when any thread may make the calls (the train job then logs from a background thread).
    thread_safe: bool
    #: True when nothing goes to the server: the run waits in the local spool for ``vitreg sync``.
    offline: bool = False
    #: None while the run is open; after its end, whether the store holds all of it (False: in the spool).
    delivered: bool | None = None

    def log_params(self, params: dict) -> dict[str, str]: ...
    def set_name(self, name: str) -> None: ...
    def set_tags(self, tags: dict) -> None: ...
    def log_metrics(self, metrics: dict, step: int | None = None, synchronous: bool = True) -> None: ...
    def flush(self) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_dict(self, data: dict, artifact_file: str) -> None: ...
    def log_artifact(self, path, artifact_path: str | None = None) -> None: ...
    def log_artifacts(self, path, artifact_path: str | None = None) -> None: ...
    def set_note(self, text: str) -> None: ...

    def artifact_uri(self, path: str = "") -> str:
        return f"runs:/{self.run_id}/{path}" if path else f"runs:/{self.run_id}"


def clean_tags(tags: dict) -> dict[str, str]:
    """Tags as MLflow stores them: strings, no None, never MLflow's reserved ``mlflow.`` prefix."""
    return {k: str(v) for k, v in tags.items() if v is not None and not k.startswith("mlflow.")}


def clean_metrics(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if v is not None}


def dict_text(data: dict) -> str:
    """A dict artifact's text (``default=str``: paths and other values a result holds)."""
    return json.dumps(data, indent=2, sort_keys=True, default=str)


class MlflowTracker(Tracker):
    """One run of the MLflow store. Every call names the run's id, so any thread may make it (MLflow's
    active run is thread-local: a fluent call without run_id from another thread would start a new run)."""

    thread_safe = True

    def __init__(self, run):
        self.run = run
        self.run_id = run.info.run_id
        self.experiment_id = run.info.experiment_id
        self._client = mlflow.MlflowClient()

    def log_params(self, params: dict) -> dict[str, str]:
        """Log params, skipping keys MLflow already holds with another value (the ``-P`` request).

        Returns the skipped ``{key: already_logged_value}`` so callers can say so.
        """
        from mlflow.entities import Param

        existing = dict(self._client.get_run(self.run_id).data.params)
        fresh, skipped = {}, {}
        for key, value in params.items():
            value = str(value)
            if key in existing and existing[key] != value:
                skipped[key] = existing[key]
            elif key not in existing:
                fresh[key] = value
        if fresh:
            self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in fresh.items()])
        return skipped

    def set_name(self, name: str) -> None:
        self._client.update_run(self.run_id, name=name)

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        clean = clean_tags(tags)
        if clean:
            self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in clean.items()])

    def log_metrics(self, metrics: dict, step: int | None = None, synchronous: bool = True) -> None:
        clean = clean_metrics(metrics)
        if clean:
            mlflow.log_metrics(clean, step=step, run_id=self.run_id, synchronous=synchronous)

    def flush(self) -> None:
        """Wait for metrics logged with synchronous=False."""
        mlflow.flush_async_logging()

    def log_text(self, text: str, artifact_file: str) -> None:
        mlflow.log_text(text, artifact_file, run_id=self.run_id)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        mlflow.log_text(dict_text(data), artifact_file, run_id=self.run_id)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        mlflow.log_artifact(str(path), artifact_path, run_id=self.run_id)

    def log_artifacts(self, path, artifact_path: str | None = None) -> None:
        mlflow.log_artifacts(str(path), artifact_path, run_id=self.run_id)

    def set_note(self, text: str) -> None:
        """The run's description in the MLflow UI (MLflow's own ``mlflow.note.content`` tag)."""
        self._client.set_tag(self.run_id, "mlflow.note.content", text)


class NullTracker(Tracker):
    """What ranks that do not log get: the same calls, doing nothing."""

    thread_safe = False  # nothing to log: no thread for it

    def __init__(self, run_id: str = "", experiment_id: str = ""):
        self.run_id = run_id
        self.experiment_id = experiment_id

    def log_params(self, params):
        return {}

    def set_name(self, name):
        pass

    def set_tags(self, tags):
        pass

    def log_metrics(self, metrics, step=None, synchronous=True):
        pass

    def flush(self):
        pass

    def log_text(self, text, artifact_file):
        pass

    def log_dict(self, data, artifact_file):
        pass

    def log_artifact(self, path, artifact_path=None):
        pass

    def log_artifacts(self, path, artifact_path=None):
        pass

    def set_note(self, text):
        pass


def note_skipped_params(skipped: dict, progress) -> None:
    """Say which params ``mlflow run`` had already logged as typed (the resolved values are tags)."""
    if skipped:
        progress("kept the params mlflow run logged as typed (" +
                 ", ".join(f"{k}={v}" for k, v in skipped.items()) + "); the resolved values are tags")


def requested_run_id() -> str | None:
    """The run ``mlflow run`` asked this process to log into (``MLFLOW_RUN_ID``), if any."""
    return os.environ.get("MLFLOW_RUN_ID") or None


def env_for_run(env: dict, run_id: str, experiment_id: str) -> dict:
    """``env`` for a child process that resumes run ``run_id`` (as ``mlflow run`` hands a process its run)."""
    return {**env, "MLFLOW_RUN_ID": run_id, "MLFLOW_EXPERIMENT_ID": str(experiment_id)}


def without_requested_run(env: dict) -> dict:
    """``env`` without the variables through which ``mlflow run`` hands a process its run: for child
    processes that must not log into (or end) this process's run."""
    return {k: v for k, v in env.items() if k not in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID")}


def _experiment_name(experiment: str | None) -> str:
    """The experiment a new run goes to: the one asked for, else MLflow's own environment choice, else Default.
    (Under ``mlflow run`` the run exists already and names its experiment.)"""
    if experiment:
        return experiment
    if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return os.environ["MLFLOW_EXPERIMENT_NAME"]
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        with short_http_requests(), store_errors(mlflow.get_tracking_uri(), "reading the experiment"):
            return mlflow.MlflowClient().get_experiment(os.environ["MLFLOW_EXPERIMENT_ID"]).name
    return "Default"


@contextlib.contextmanager
def tracked_run(run_name: str | None = None, experiment: str | None = None, system_metrics: bool = True,
                tags: dict | None = None, offline: bool | None = None):
    """Start (or resume, under ``mlflow run``) a run and yield its tracker: a
    :class:`~vitreg.tracking.spooling.SpoolingTracker`, so the work never waits on the server and nothing
    measured is lost when the server goes away (it stays in the local spool; ``vitreg sync`` delivers it).

    The run always ends with a true status: FINISHED; FAILED on :class:`VitregError` (the message in the
    ``vitreg_error`` tag, its class in ``vitreg_error_kind``) or any other exception; KILLED on Ctrl-C,
    SIGTERM or SIGHUP. Ranks other than 0 get a :class:`NullTracker` and never touch the server.
    """
    if not is_main_process():
        yield NullTracker()
        return
    uri = mlflow.get_tracking_uri()
    prepare_store(uri)  # a fresh sqlite file: created once, under a lock, even with several processes at once
    if not offline_mode(offline):
        check_server()
    tracker = open_run(_experiment_name(experiment), None if requested_run_id() else run_name, tags=tags,
                       offline=offline)
    monitor = _system_metrics(tracker) if system_metrics else None

    def last_words(reason: str) -> None:  # vitreg.signals' watchdog, when the main thread cannot stop in time
        tracker.set_tags({ERROR_TAG: reason})
        tracker.close("KILLED", timeout_s=min(5.0, flush_timeout_s()))

    signals.on_forced_exit(last_words)
    try:
        yield tracker
    except VitregError as exc:
        _end(tracker, monitor, "FAILED", str(exc), type(exc).__name__)
        raise
    except KeyboardInterrupt as exc:  # Ctrl-C, and SIGTERM/SIGHUP (vitreg.signals.Terminated)
        _end(tracker, monitor, "KILLED", interrupted_reason(exc))
        signals.killed_runs.append(tracker.run_id or "(in the spool)")
        raise
    except BaseException as exc:
        _end(tracker, monitor, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    else:
        _end(tracker, monitor, "FINISHED")
    finally:
        signals.forget_forced_exit(last_words)


def _system_metrics(tracker):
    """GPU utilisation, memory and power curves (psutil + nvidia-ml-py), sampled every 2 s in a thread
    that logs them itself; none offline (nothing reaches the server then)."""
    if not tracker.run_id or tracker.offline:
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(tracker.run_id, sampling_interval=2, samples_before_logging=1)
    monitor.start()
    return monitor


def _end(tracker, monitor, status: str, message: str | None = None, kind: str | None = None) -> None:
    if monitor is not None:
        with short_http_requests():
            monitor.finish()
    if message:
        tracker.set_tags({ERROR_TAG: " ".join(message.split())[:4000], **({ERROR_KIND_TAG: kind} if kind else {})})
    tracker.close(status)


def fail_requested_run(message: str) -> None:
    """Mark the run that ``mlflow run`` created FAILED when we fail before :func:`tracked_run` opened it."""
    run_id = requested_run_id()
    if not run_id or not is_main_process():
        return
    try:
        with short_http_requests():  # a dead server costs seconds here, not MLflow's minutes of retries
            client = mlflow.MlflowClient()
            if client.get_run(run_id).info.status != "RUNNING":
                return  # tracked_run already ended it, with the reason
            client.set_tag(run_id, ERROR_TAG, scrub(" ".join(message.split()))[:4000])
            client.set_terminated(run_id, "FAILED")
    except Exception as exc:  # the server is the problem; say so and keep the user's error first
        print(f"[vitreg] could not mark run {run_id} FAILED: {scrub(first_line(exc))}", file=sys.stderr)


def check_server(timeout: float = 5.0) -> None:
    """Fail fast, in one line, when the tracking URI is a server that does not answer.

    MLflow's client retries for minutes against a dead server; a user deserves the answer now. A URI with
    credentials (``http://user:password@host``) is checked with them as a header, and shown masked.
    """
    uri = mlflow.get_tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    base, headers = without_credentials(uri)
    try:
        with urllib.request.urlopen(urllib.request.Request(base.rstrip("/") + "/health", headers=headers),
                                    timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError:
        return  # it answers (an auth wall answers 401): the server is there
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StoreError(f"the MLflow tracking server at {redact(uri)} does not answer ({reason}): start it with "
                         f"`make server`, or fix/unset MLFLOW_TRACKING_URI") from None


def where_logged(tracker) -> str:
    """The line a job ends with: the run and how to open it (its page on a server; ``make ui`` locally),
    or, for a run still in the local spool (offline, or a store that did not take it), how to deliver it."""
    if tracker.offline or tracker.delivered is False:  # a SpoolingTracker's run still in its spool
        return sync_hint(tracker.spool)
    uri = tracking_uri()  # masked; from the environment in a rank, which never imports mlflow
    page = f"#/experiments/{tracker.experiment_id}/runs/{tracker.run_id}"
    if uri.startswith(("http://", "https://")):
        base = without_credentials(uri)[0].rstrip("/")
        return f"logged run {tracker.run_id} to {uri}: {base}/{page}"
    return (f"logged run {tracker.run_id} to {uri}: open it with `make ui` (or `mlflow ui --backend-store-uri "
            f"{uri}`), then http://127.0.0.1:5000/{page}")


def create_child_run(parent: MlflowTracker, name: str, tags: dict | None = None) -> str:
    """A RUNNING child of ``parent`` for a subprocess to resume through MLFLOW_RUN_ID (as `mlflow run` does)."""
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    all_tags = {MLFLOW_PARENT_RUN_ID: parent.run_id, MLFLOW_RUN_NAME: name,
                **{k: str(v) for k, v in (tags or {}).items()}}
    return mlflow.MlflowClient().create_run(parent.experiment_id, tags=all_tags, run_name=name).info.run_id


def finish_child_run(run_id: str, returncode: int, stderr: str, stopped: bool = False,
                     tags: dict | None = None) -> str:
    """After the child process: its error reason ('' on success); a child that died without ending its
    run (killed, crashed) is ended FAILED here with the last line it printed, KILLED when ``stopped`` (its
    parent stopped it). ``tags``: more tags for the child run (where and beside whom it ran)."""
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    for key, value in (tags or {}).items():
        client.set_tag(run_id, key, str(value))
    reason = run.data.tags.get(ERROR_TAG, "")
    if returncode != 0 and not reason:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {returncode}"
        client.set_tag(run_id, ERROR_TAG, scrub(reason)[:4000])
    if run.info.status in ("RUNNING", "SCHEDULED"):
        client.set_terminated(run_id, "KILLED" if stopped else "FINISHED" if returncode == 0 else "FAILED")
    return reason


def set_child_status(run_id: str, status: str) -> None:
    """A child run's status before its process ends it: SCHEDULED (a queued Ray task), RUNNING (it started)."""
    mlflow.MlflowClient().update_run(run_id, status=status)


def remote_child_env(run_id: str, experiment_id: str) -> dict:
    """The variables a child on another host needs to log into run ``run_id``: the tracking URI (a server's,
    with any credentials MLflow reads from the environment) and the run (as ``mlflow run`` hands it)."""
    keep = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
            "MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_SERVER_CERT_PATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    return env_for_run({**env, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}, run_id, experiment_id)


def is_local_store() -> bool:
    """The tracking URI is a file or sqlite store on this host (other hosts cannot reach it)."""
    return not mlflow.get_tracking_uri().startswith(("http://", "https://", "databricks"))


def child_runs(parent: MlflowTracker):
    """The parent's child runs as a search_runs DataFrame."""
    return mlflow.search_runs(experiment_ids=[parent.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'")


def search_runs(experiment: str, filter_string: str = ""):
    """All runs of an experiment (by name) as a pandas DataFrame, MLflow's ``search_runs`` columns."""
    exp = mlflow.MlflowClient().get_experiment_by_name(experiment)
    if exp is None:
        raise VitregError(f"experiment {experiment!r} does not exist at {tracking_uri()}: "
                          f"check the name (mlflow experiments search) or MLFLOW_TRACKING_URI")
    return mlflow.search_runs(experiment_ids=[exp.experiment_id], filter_string=filter_string,
                              output_format="pandas")


def experiment_tag(experiment: str, key: str) -> str | None:
    """The experiment's tag ``key`` (None: no such experiment or tag), e.g. the team's price table."""
    exp = mlflow.MlflowClient().get_experiment_by_name(experiment)
    return None if exp is None else exp.tags.get(key)


def set_experiment_tag(experiment: str, key: str, value: str) -> None:
    """Keep ``value`` under ``key`` on the (existing) experiment, for everyone who reads it."""
    client = mlflow.MlflowClient()
    client.set_experiment_tag(client.get_experiment_by_name(experiment).experiment_id, key, value)


def get_run(run_id: str):
    return mlflow.MlflowClient().get_run(run_id)


def download_artifacts(artifact_uri: str, dst: str | None = None) -> Path:
    dst = dst or tempfile.mkdtemp(prefix="vitreg-")
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=dst))
