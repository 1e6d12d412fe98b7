"""A run's life: opened by :func:`tracked_run`, logged through a :class:`Tracker`, ended with a true status
(FAILED with the reason in ``vitreg_error``, never left RUNNING; KILLED once its process is gone: a stale
heartbeat, :func:`find_stale`, or a run resuming its checkpoint, :func:`close_resumed`); a sweep's child runs;
reading runs back.

``mlflow run`` creates the run, logs every ``-P`` value as a param and passes ``MLFLOW_RUN_ID``, which
:func:`tracked_run` resumes. Params are immutable, so a resolved value (``gpu=auto`` -> ``h200``) is always a
tag of the same name: group and compare by the tags. Under torchrun only rank 0 logs (the caller says which
rank it is: tracking sits below ddp; under a vitreg launcher rank 0 hands its calls over, :mod:`.handoff`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Protocol

from vitreg.errors import VitregError
from vitreg import signals
from vitreg.signals import interrupted_reason
from vitreg.tracking.delivery import (ERROR_KIND_TAG, ERROR_TAG, HEARTBEAT_TAG, SPOOL_ID_TAG, end_with_reason,
                                      heartbeat_period_s, open_run, requested_run_id, sync_hint)
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.spool import JOURNAL, flush_timeout_s, offline_mode
from vitreg.tracking.store import (busy_wait_s, check_server, first_line, http_timeout_s, prepare_store,
                                   short_http_requests, sqlite_path, store_errors, ui_command)
from vitreg.tracking.sync import SENT_CREDENTIALS, pending
from vitreg.tracking.uris import current_uri, scrub, tracking_uri, without_credentials

RESUMED_FROM_TAG = "vitreg_resumed_from"  # on the new run: the run id of the checkpoint it continues
RESUMED_BY_TAG = "vitreg_resumed_by"  # on the old run: the newest run that resumed it
SUPERSEDED_TAG = "sweep_superseded_by"  # on a sweep child a re-run replaced: the run id of its replacement
DEFAULT_STALE_AFTER_S = 600.0


class Tracker(Protocol):
    """What a job logs through: the calls against one run, each a batch (never one call per value): a
    :class:`~vitreg.tracking.delivery.SpoolingTracker` (every run :func:`tracked_run` opens), a
    :class:`NullTracker` or a :class:`~vitreg.tracking.handoff.HandoffTracker`."""

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
    #: remove what was logged at ``artifact_path`` (a checkpoint beyond ``keep_checkpoints``), in order
    def delete_artifacts(self, artifact_path: str) -> None: ...
    def set_note(self, text: str) -> None: ...

    def artifact_uri(self, path: str = "") -> str:
        return f"runs:/{self.run_id}/{path}" if path else f"runs:/{self.run_id}"


class NullTracker(Tracker):
    """What ranks that do not log get: the same calls, doing nothing."""

    thread_safe = False  # nothing to log: no thread for it

    def __init__(self, run_id: str = "", experiment_id: str = ""):
        self.run_id = run_id
        self.experiment_id = experiment_id

    def log_params(self, params): return {}
    def set_name(self, name): pass
    def set_tags(self, tags): pass
    def log_metrics(self, metrics, step=None, synchronous=True): pass
    def flush(self): pass
    def log_text(self, text, artifact_file): pass
    def log_dict(self, data, artifact_file): pass
    def log_artifact(self, path, artifact_path=None): pass
    def log_artifacts(self, path, artifact_path=None): pass
    def delete_artifacts(self, artifact_path): pass
    def set_note(self, text): pass


def note_skipped_params(skipped: dict, progress) -> None:
    if skipped:
        progress("kept the params mlflow run logged as typed (" +
                 ", ".join(f"{k}={v}" for k, v in skipped.items()) + "); the resolved values are tags")


def env_for_run(env: dict, run_id: str, experiment_id: str) -> dict:
    """``env`` for a child process that resumes run ``run_id`` (as ``mlflow run`` hands a process its run)."""
    return {**env, "MLFLOW_RUN_ID": run_id, "MLFLOW_EXPERIMENT_ID": str(experiment_id)}


def without_requested_run(env: dict) -> dict:
    """``env`` for a child process that must not log into (or end) this process's run."""
    return {k: v for k, v in env.items() if k not in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID")}


def _experiment_name(experiment: str | None) -> str:
    """The experiment a new run goes to: the one asked for, else MLflow's own environment choice, else Default."""
    name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name:
        return name
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        with short_http_requests(), store_errors(mlflow.get_tracking_uri(), "reading the experiment"):
            return mlflow.MlflowClient().get_experiment(os.environ["MLFLOW_EXPERIMENT_ID"]).name
    return "Default"


def check_settings() -> None:
    """Every ``VITREG_*`` setting tracking reads, parsed before the run opens: read first where it is used, a bad
    value ended a whole benchmark in an error and its run unended."""
    flush_timeout_s(), heartbeat_period_s(), http_timeout_s(), busy_wait_s(), signals.stop_grace_s()


@contextlib.contextmanager
def tracked_run(run_name: str | None = None, experiment: str | None = None, system_metrics: bool = True,
                tags: dict | None = None, offline: bool | None = None):
    """Start (or resume, under ``mlflow run``) a run and yield its
    :class:`~vitreg.tracking.delivery.SpoolingTracker`. It always ends with a true status: FINISHED; FAILED
    on an exception (the reason in ``vitreg_error``, a VitregError's class in ``vitreg_error_kind``); KILLED
    on Ctrl-C, SIGTERM or SIGHUP."""
    check_settings()
    uri = mlflow.get_tracking_uri()
    prepare_store(uri)  # a fresh sqlite file: created once, under a lock, even with several processes at once
    if not offline_mode(offline):
        check_server()
    tracker = open_run(_experiment_name(experiment), None if requested_run_id() else run_name, tags=tags,
                       offline=offline)
    monitor = None

    def last_words(reason: str) -> None:  # vitreg.signals' watchdog, when the main thread cannot stop in time
        tracker.set_tags({ERROR_TAG: reason})
        tracker.close("KILLED", timeout_s=min(5.0, flush_timeout_s()))

    signals.on_forced_exit(last_words)
    try:  # from here on the run always ends: its delivery thread never outlives the job
        monitor = _system_metrics(tracker) if system_metrics else None
        yield tracker
    except VitregError as exc:  # a DDP job whose ranks were stopped from outside says KILLED (ddp.launcher)
        _end(tracker, monitor, getattr(exc, "run_status", "FAILED"), str(exc), type(exc).__name__)
        raise
    except KeyboardInterrupt as exc:  # Ctrl-C, and SIGTERM/SIGHUP (vitreg.signals.Terminated)
        _end(tracker, monitor, "KILLED", interrupted_reason(exc))
        raise
    except BaseException as exc:
        _end(tracker, monitor, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    else:
        _end(tracker, monitor, "FINISHED")
    finally:
        signals.forget_forced_exit(last_words)


@contextlib.contextmanager
def reopened_run(run_id: str):
    """Ended run ``run_id`` RUNNING again under :func:`tracked_run` (a sweep's parent while its failed children
    are re-run). ``MLFLOW_RUN_ID`` names it only while it opens: the processes the body starts get their own."""
    handed = os.environ.get("MLFLOW_RUN_ID")

    def give_back():
        os.environ.pop("MLFLOW_RUN_ID", None)
        os.environ.update({"MLFLOW_RUN_ID": handed} if handed else {})

    os.environ["MLFLOW_RUN_ID"] = run_id
    try:
        reopen(run_id)
        with tracked_run(system_metrics=False) as tracker:
            give_back()
            yield tracker
    finally:
        give_back()


def reopen(run_id: str, tags: dict | None = None) -> None:
    """Run ``run_id`` RUNNING again with ``tags``: a sweep's parent re-running its failed children, a SLURM child
    whose job was requeued (the process that continues it drops the reason it ended with: ``open_run``)."""
    mlflow.MlflowClient().update_run(run_id, status="RUNNING")
    set_run_tags(run_id, tags or {})


def _system_metrics(tracker):
    """MLflow's GPU and host curves, sampled every 2 s by a thread that logs them itself; none offline."""
    if not tracker.run_id or tracker.offline:
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # a run handed over (a requeued SLURM child's) may hold an earlier process's samples: its steps go on after them
    monitor = SystemMetricsMonitor(tracker.run_id, sampling_interval=2, samples_before_logging=1,
                                   resume_logging=bool(requested_run_id()))
    monitor.start()
    return monitor


def _end(tracker, monitor, status: str, message: str | None = None, kind: str | None = None) -> None:
    """End the run with ``status``, the stop signals held meanwhile, and note where it ended (the CLI's last line)."""
    with signals.run_ending(lambda: _end_kept(tracker, status)):
        try:
            if monitor is not None:
                with short_http_requests():
                    monitor.finish()
            if message:
                tracker.set_tags({ERROR_TAG: " ".join(message.split())[:4000],
                                  **({ERROR_KIND_TAG: kind} if kind else {})})
        finally:  # a failing monitor or tag still ends the run (and stops its delivery thread)
            delivered = tracker.close(status)
        signals.run_ends.append(_where_ended(tracker, status, delivered))


def _where_ended(tracker, status: str, delivered: bool) -> str:
    if delivered:
        return f"run {tracker.run_id} is marked {status}"
    run = f"run {tracker.run_id or '(not on the server yet)'} ended {status}"
    lost = getattr(tracker.spool, "lost", None)
    return f"{run} but is not kept: {lost}" if lost else f"{run}; {sync_hint(tracker.spool)}"


def _end_kept(tracker, status: str) -> str | None:
    """Where the run's end is kept once its spool holds it (its journal's last record), else None."""
    try:
        with open(tracker.spool.path / JOURNAL, "rb") as journal:
            journal.seek(max(0, journal.seek(0, os.SEEK_END) - 4096))
            ended = json.loads(journal.read().splitlines()[-1]).get("kind") == "end"
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return _where_ended(tracker, status, False) if ended else None


def fail_requested_run(message: str) -> None:
    """Mark the run that ``mlflow run`` created FAILED when we fail before :func:`tracked_run` opened it.
    Under torchrun every rank sees that run's id: only rank 0 may call this."""
    run_id = requested_run_id()
    if not run_id:
        return
    try:
        with short_http_requests():  # a dead server costs seconds here, not MLflow's minutes of retries
            client = mlflow.MlflowClient()
            if client.get_run(run_id).info.status != "RUNNING":
                return  # tracked_run already ended it, with the reason
            end_with_reason(client, run_id, "FAILED", " ".join(message.split()))
    except Exception as exc:  # the server is the problem; say so and keep the user's error first
        print(f"[vitreg] could not mark run {run_id} FAILED: {scrub(first_line(exc))}", file=sys.stderr)


# --------------------------------------------------------------------------- runs no process will end
# A RUNNING run whose heartbeat (refreshed every VITREG_HEARTBEAT_S by its delivery thread), or, for a run
# without one, whose start, is older than a threshold has no process behind it. Keep the threshold well above
# the heartbeat period (600 s is twenty): a process cut off from the server stops refreshing it too, and
# should it reconnect, its delivery sets the status it really ended with. A resumed checkpoint proves its
# run is over (a heartbeat cannot: a run SIGKILLed a second ago has a fresh one): :func:`close_resumed`.


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


def _experiments(experiment: str | None) -> list:
    client = mlflow.MlflowClient()
    if experiment is None:
        return client.search_experiments(view_type=mlflow.entities.ViewType.ACTIVE_ONLY)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise _no_such(experiment)
    return [found]


def _no_such(experiment: str) -> VitregError:
    return VitregError(f"experiment {experiment!r} does not exist at {tracking_uri()}: check the name (mlflow "
                       f"experiments search) or MLFLOW_TRACKING_URI")


def _all_runs(experiment_id: str, filter_string: str) -> list:
    """Every run of the experiment that ``filter_string`` matches (MLflow reads page after page)."""
    return mlflow.search_runs([experiment_id], filter_string, output_format="list")


def _last_seen(run) -> tuple[float, bool]:
    beat = run.data.tags.get(HEARTBEAT_TAG)
    try:
        return float(beat), True
    except (TypeError, ValueError):
        return run.info.start_time / 1000.0, False


def find_stale(older_than_s: float = DEFAULT_STALE_AFTER_S, experiment: str | None = None,
               now: float | None = None) -> list[StaleRun]:
    """RUNNING runs (of ``experiment``, or of every experiment) not seen alive for ``older_than_s`` seconds."""
    check_server()  # a store URI that names no store is said, not searched and found empty
    now = time.time() if now is None else now
    stale = []
    with short_http_requests(), store_errors(mlflow.get_tracking_uri(), "searching for RUNNING runs"):
        for exp in _experiments(experiment):
            for run in _all_runs(exp.experiment_id, "attributes.status = 'RUNNING'"):
                last_seen, heartbeat = _last_seen(run)
                if now - last_seen > older_than_s:
                    stale.append(StaleRun(run.info.run_id, exp.name, run.info.run_name or "", last_seen, heartbeat))
    return sorted(stale, key=lambda r: r.last_seen)


def mark_killed(runs: list[StaleRun]) -> int:
    """End each run KILLED with its reason in ``vitreg_error``; returns how many were still RUNNING."""
    client = mlflow.MlflowClient()
    ended = 0
    in_a_spool = _ended_in_a_spool()
    with short_http_requests(), store_errors(client.tracking_uri, "marking stale runs KILLED"):
        for stale in runs:
            run = client.get_run(stale.run_id)
            if run.info.status != "RUNNING":
                continue  # ended meanwhile (its process was alive after all, or another --fix)
            kept = in_a_spool.get(run.data.tags.get(SPOOL_ID_TAG)) or in_a_spool.get(stale.run_id)
            if kept:  # its process ended it; the store has not been told yet
                print(f"[vitreg] run {stale.run_id} not marked KILLED: {kept}", file=sys.stderr)
                continue
            end_with_reason(client, stale.run_id, "KILLED", stale.reason())
            ended += 1
    return ended


def _ended_in_a_spool() -> dict[str, str]:
    """``{spool id or run id: where its end is}`` of the runs whose local spool holds their end: over, and
    `vitreg sync` gives them their status."""
    ended = {}
    for spool in pending():
        try:
            records = spool.records()
        except (OSError, ValueError):
            continue  # `vitreg sync` says what is wrong with it
        end = next((r for r in reversed(records) if r.get("kind") == "end"), None)
        if end:
            where = f"it ended {end.get('status')} and {sync_hint(spool).replace('the run ', '', 1)}"
            ended.update({key: where for key in (records[0].get("spool_id"), records[0].get("run_id")) if key})
    return ended


def close_resumed(old_run_id: str, new_run_id: str, progress=lambda message: None) -> bool:
    """Tag the old run with its successor and end it KILLED if it is still RUNNING; returns whether the old
    run was found. A store that does not hold it, or cannot be reached now, only costs a line."""
    if old_run_id == new_run_id:
        return True
    client = mlflow.MlflowClient()
    try:
        old = client.get_run(old_run_id)
        client.set_tag(old_run_id, RESUMED_BY_TAG, new_run_id)
        if old.info.status == "RUNNING":
            end_with_reason(client, old_run_id, "KILLED", f"ended without a final status (the process was "
                                                          f"killed); resumed by run {new_run_id}")
            progress(f"run {old_run_id} was still RUNNING (its process was killed): marked KILLED, resumed by "
                     f"this run")
    except mlflow.exceptions.MlflowException:
        progress(f"the checkpoint's run {old_run_id} is not in this store: only this run is tagged with it")
        return False
    except Exception as exc:  # the store is unreachable now: not a reason to stop a training
        progress(f"could not tag the checkpoint's run {old_run_id} ({type(exc).__name__}): it keeps its status")
        return False
    return True


def still_spooled(tracker) -> bool:
    """Whether the run is still only in the local spool (offline, or a store that did not take it)."""
    return bool(tracker.offline or tracker.delivered is False)


def where_logged(tracker) -> str:
    """Where a job's run is: its page on a server, locally the UI command that opens its store; for a run still
    in the local spool, how to deliver it."""
    if still_spooled(tracker):
        return sync_hint(tracker.spool)
    uri = tracking_uri()  # masked; from the environment in a rank, which never imports mlflow
    from vitreg.tracking.naming import runs_page  # here: naming reads pandas, which a rank never needs

    page = runs_page(tracker.experiment_id, tracker.run_id)
    if uri.startswith(("http://", "https://")):
        base = without_credentials(uri)[0].rstrip("/")
        return f"logged run {tracker.run_id} to {uri}: {base}/{page}"
    return f"logged run {tracker.run_id} to {uri}: open it with `{ui_command(uri)}`, then http://127.0.0.1:5000/{page}"


def artifacts_at(tracker, path: str) -> str:
    """Where the run's artifacts under ``path`` are: the folder on this disk for a store that keeps them here,
    else their URI (``s3://...``); for a run still in the local spool, its ``runs:/`` URI (valid once synced)."""
    if still_spooled(tracker):
        return tracker.artifact_uri(path)
    root = mlflow.MlflowClient().get_run(tracker.run_id).info.artifact_uri
    parsed = urllib.parse.urlparse(root)
    if parsed.scheme in ("", "file"):
        return str(Path(urllib.parse.unquote(parsed.path)) / path)
    return f"{root.rstrip('/')}/{path}"


def create_child_run(parent: Tracker, name: str, tags: dict | None = None) -> str:
    """A RUNNING child of ``parent`` for a subprocess to resume through MLFLOW_RUN_ID (as `mlflow run` does)."""
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    all_tags = {MLFLOW_PARENT_RUN_ID: parent.run_id, MLFLOW_RUN_NAME: name,
                **{k: str(v) for k, v in (tags or {}).items()}}
    return mlflow.MlflowClient().create_run(parent.experiment_id, tags=all_tags, run_name=name).info.run_id


#: a cluster child's stdout and stderr as its node saw them (a Ray task's output, a SLURM job's log files)
CHILD_LOG = "logs/child.log"


def finish_child_run(run_id: str, returncode: int, stderr: str, stopped: bool = False,
                     tags: dict | None = None, log: str = "") -> str:
    """After the child process: its error reason ('' on success); a child that died without ending its run is
    ended here, FAILED with the last line it printed, KILLED when ``stopped`` (by its parent). ``tags``: more
    tags for the child run; ``log``: its output, kept as the run's :data:`CHILD_LOG` (scrubbed)."""
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    set_run_tags(run_id, tags or {})
    if log:
        client.log_text(run_id, scrub(log), CHILD_LOG)
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
    """The variables a child on another host needs to log into run ``run_id``: the tracking URI, the
    credentials MLflow reads from the environment, and the run (as ``mlflow run`` hands it)."""
    keep = (*SENT_CREDENTIALS, "MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_SERVER_CERT_PATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    return env_for_run({**env, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}, run_id, experiment_id)


def is_local_store() -> bool:
    """The tracking URI is a file or sqlite store on this host (other hosts cannot reach it)."""
    return not mlflow.get_tracking_uri().startswith(("http://", "https://", "databricks"))


def child_runs(parent: Tracker):
    """The parent's child runs as a search_runs DataFrame."""
    return mlflow.search_runs(experiment_ids=[parent.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'")


def run_and_children(parent_run_id: str):
    """Run ``parent_run_id`` and all its child runs: what ``vitreg sweep --rerun-failed`` reads."""
    client = mlflow.MlflowClient()
    with store_errors(tracking_uri(), "reading the sweep's runs"):  # a store that is down: one line, never "no run"
        try:
            parent = client.get_run(parent_run_id)
        except mlflow.exceptions.MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise VitregError(f"no run {parent_run_id!r} at {tracking_uri()}: pass the run id of a sweep's parent "
                              f"run (its `sweep RUN_ID:` line), or set MLFLOW_TRACKING_URI to its store") from None
        return parent, _all_runs(parent.info.experiment_id, f"tags.mlflow.parentRunId = '{parent_run_id}'")


def newest_runs(limit: int | None, experiment: str | None = None, status: str | None = None):
    """The ``limit`` newest runs (None: all) of ``experiment`` (None: every active one) in ``status`` (None: any),
    newest first, as MLflow's ``search_runs`` frame plus ``experiment`` (its name). A sqlite store that does
    not exist yet has no runs, and a listing does not create it (MLflow would, in the cwd)."""
    uri = current_uri()
    store = sqlite_path(uri)
    if store is not None:
        with store_errors(uri, "listing runs"):
            return _sqlite_runs(store, limit, experiment, status)
    client = mlflow.MlflowClient()
    with store_errors(client.tracking_uri, "listing runs"):
        names = {exp.experiment_id: exp.name for exp in _experiments(experiment)}
        found = mlflow.search_runs(experiment_ids=list(names), output_format="pandas",
                                   filter_string=f"attributes.status = '{status}'" if status else "",
                                   order_by=["attributes.start_time DESC"],
                                   **({"max_results": limit} if limit else {}))
    if len(found):
        found.insert(1, "experiment", found["experiment_id"].map(names))
    return found


def _sqlite_runs(store: Path, limit: int | None, experiment: str | None, status: str | None):
    """:func:`newest_runs` from a sqlite store's tables, read-only: importing MLflow and opening its store cost 2.5 s
    of CPU (issue 47)."""
    import sqlite3

    import pandas as pd

    if not store.exists():
        return pd.DataFrame()
    where = "".join([" AND e.name = :experiment"] * bool(experiment) + [" AND r.status = :status"] * bool(status))
    runs = (f"SELECT r.run_uuid AS run_id, e.name AS experiment, r.experiment_id, r.status, r.start_time, r.end_time,"
            f" r.artifact_uri FROM runs r JOIN experiments e USING (experiment_id) WHERE r.lifecycle_stage = 'active'"
            f" AND e.lifecycle_stage = 'active'{where} ORDER BY r.start_time DESC, r.run_uuid LIMIT {int(limit or -1)}")
    asked = {"experiment": experiment, "status": status}
    with contextlib.closing(sqlite3.connect(f"{store.absolute().as_uri()}?mode=ro", uri=True,
                                            timeout=busy_wait_s())) as db:
        if experiment and not db.execute("SELECT 1 FROM experiments WHERE name = ?", [experiment]).fetchone():
            raise _no_such(experiment)
        found = pd.read_sql_query(runs, db, params=asked)
        for table, prefix, value in (("params", "params", "value"), ("tags", "tags", "value"),
                                     ("latest_metrics", "metrics", "CASE WHEN is_nan THEN NULL ELSE value END")):
            long = pd.read_sql_query(f"SELECT run_uuid AS run_id, key, {value} AS value FROM {table} WHERE run_uuid"
                                     f" IN (SELECT run_id FROM ({runs}))", db, params=asked)
            found = found.join(long.pivot(index="run_id", columns="key", values="value").add_prefix(f"{prefix}."),
                               on="run_id")
    return found.astype({"experiment_id": str}).assign(**{c: pd.to_datetime(found[c], unit="ms", utc=True)
                                                          for c in ("start_time", "end_time")})


def get_run(run_id: str):
    return mlflow.MlflowClient().get_run(run_id)


def set_run_tags(run_id: str, tags: dict) -> None:
    """Tags on a run that another process made or ended (a sweep's child it superseded), in one request."""
    mlflow.MlflowClient().log_batch(run_id, tags=[mlflow.entities.RunTag(k, str(v)) for k, v in tags.items()])


def load_run_dict(run_id: str, artifact_file: str) -> dict | None:
    """The JSON a run logged with ``log_dict``; None when it has no such file (a run of an older vitreg)."""
    try:
        return mlflow.artifacts.load_dict(f"runs:/{run_id}/{artifact_file}")
    except (mlflow.exceptions.MlflowException, OSError):
        return None


def download_artifacts(artifact_uri: str, dst: str | None = None) -> Path:
    dst = dst or tempfile.mkdtemp(prefix="vitreg-")
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=dst))
