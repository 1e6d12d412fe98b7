"""The local spool, its delivery and ``vitreg sync``: nothing lost, nothing delivered twice.

Fast tests use a real sqlite store and fake servers (a dead port, an HTTP server answering 503); the
slow ones kill a real ``mlflow server`` by PID in the middle of a run, and a real ``vitreg sync``
process in the middle of its delivery.
"""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from vitreg.cli.main import sync as sync_command
from vitreg.errors import StoreError, VitregError

from vitreg.tracking.delivery import SPOOL_ID_TAG, SpoolingTracker, experiment_id_for, open_run, seq_tag
from vitreg.tracking.sync import SyncError, sync
from vitreg.tracking.spool import Spool, flush_timeout_s, offline_mode, spool_root

from conftest import REPO, free_port, migrated_store, premigrated, subprocess_env


pytestmark = pytest.mark.usefixtures("clean_vitreg_env")


@pytest.fixture(scope="module")
def _module_store(tmp_path_factory):
    """One sqlite store for the module (creating one costs seconds); each test has its own experiment."""
    uri = migrated_store(tmp_path_factory.mktemp('store'))  # migrated before the delivery thread opens it
    return uri


@pytest.fixture
def store(_module_store, monkeypatch, tmp_path):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", _module_store)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(_module_store)
    return _module_store


@pytest.fixture
def experiment(request):
    return request.node.name[:60]


@pytest.fixture
def server_503():
    """An HTTP server that is up (``/health`` answers OK) but answers 503 to every API call."""

    hit, calls = threading.Event(), []

    class Busy(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            ok = self.path == "/health"
            if not ok:
                calls.append(f"{self.command} {self.path}")
                hit.set()
            body = b"OK" if ok else b'{"error_code": "TEMPORARILY_UNAVAILABLE", "message": "busy"}'
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = _Url(f"http://127.0.0.1:{httpd.server_address[1]}")
    url.hit, url.calls = hit, calls
    yield url
    httpd.shutdown()


class _Url(str):
    """A server's URL, with ``hit``: an Event set when it first answered an API call (not /health), and
    ``calls``: every API call it answered ("POST /api/..."), in order."""

    hit: threading.Event
    calls: list


@pytest.fixture
def clients_made(monkeypatch) -> list:
    """Every MlflowClient this process makes while the test runs (its tracking URI): what a step asked of
    a store, counted rather than timed."""
    made = []
    real_init = MlflowClient.__init__

    def recording_init(self, tracking_uri=None, *args, **kwargs):
        made.append(tracking_uri)
        real_init(self, tracking_uri, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "__init__", recording_init)
    return made


def log_training(tracker, steps: int, start: int = 0) -> float:
    """What a training loop logs; returns the slowest single call in seconds."""
    slowest = 0.0
    for step in range(start, start + steps):
        began = time.perf_counter()
        tracker.log_metrics({"loss": 1.0 / (step + 1), "lr": 0.001}, step=step)
        slowest = max(slowest, time.perf_counter() - began)
    return slowest


def write_offline_run(root: Path, tmp_path: Path, experiment: str, steps: int = 2500) -> Spool:
    """An offline run with everything a run logs; the artifact's original is deleted at once."""
    tracker = SpoolingTracker.open(experiment, run_name="offline-run", root=root, offline=True)
    tracker.log_params({"model": "test_vit", "batch_size": 8})
    tracker.set_tags({"gpu": "cpu", "amp": "off"})
    log_training(tracker, steps)
    ckpt = tmp_path / "last.safetensors"
    ckpt.write_bytes(b"weights" * 100)
    tracker.log_artifact(ckpt, "checkpoints")
    ckpt.unlink()  # the spool holds its own copy
    tracker.log_dict({"top1": 0.5}, "results.json")
    tracker.close("FINISHED", timeout_s=0)
    return tracker.spool


def assert_delivered_once(client: MlflowClient, run_id: str, steps: int) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"model": "test_vit", "batch_size": "8"}
    assert run.data.tags["gpu"] == "cpu" and run.data.tags["amp"] == "off"
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(steps)), "every step exactly once"
    assert {m.step: m.value for m in history}[steps - 1] == pytest.approx(1.0 / steps)
    assert len(client.get_metric_history(run_id, "lr")) == steps
    paths = {a.path for folder in (None, "checkpoints") for a in client.list_artifacts(run_id, folder)}
    assert {"results.json", "checkpoints/last.safetensors"} <= paths
    local = client.download_artifacts(run_id, "checkpoints/last.safetensors")
    assert Path(local).read_bytes() == b"weights" * 100


# --------------------------------------------------------------------------- the journal and settings


def test_journal_numbers_records_and_drops_a_torn_last_line(tmp_path):
    spool = Spool.create("exp", run_name="r", root=tmp_path)
    spool.append_params({f"p{i}": i for i in range(150)})  # more than one log_batch takes: two records
    spool.append_metrics({"loss": 0.5}, step=3, timestamp_ms=1234)
    spool.append_end("FINISHED")
    spool.release()
    with open(spool.path / "journal.jsonl", "a") as fh:
        fh.write('{"seq": 5, "kind": "tags", "ta')  # a crash in the middle of a write
    records = Spool(spool.path).records()
    assert [r["seq"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["kind"] for r in records] == ["run", "params", "params", "metrics", "end"]
    assert len(records[1]["params"]) == 100 and len(records[2]["params"]) == 50
    assert records[3]["metrics"] == [["loss", 0.5, 1234, 3]]
    assert records[0]["experiment_name"] == "exp" and len(records[0]["spool_id"]) == 32


def test_a_spool_is_held_by_one_process(tmp_path):
    spool = Spool.create("exp", root=tmp_path)
    with pytest.raises(VitregError, match="in use by a running process"):
        Spool(spool.path).lock()
    spool.release()
    Spool(spool.path).lock()


def test_find_lists_spools_and_skips_one_left_empty_by_a_crash(tmp_path):
    first = Spool.create("exp", root=tmp_path)
    (tmp_path / "crashed-in-create").mkdir()
    (tmp_path / "crashed-in-create" / "journal.jsonl").touch()
    assert [s.path for s in Spool.find(tmp_path)] == [first.path]
    assert [s.path for s in Spool.find(first.path)] == [first.path]
    assert Spool.find(tmp_path / "nothing-here") == []


def test_settings(monkeypatch, tmp_path):
    assert flush_timeout_s() == 30.0
    monkeypatch.setenv("VITREG_FLUSH_TIMEOUT_S", "2.5")
    assert flush_timeout_s() == 2.5 and flush_timeout_s(7) == 7.0
    monkeypatch.setenv("VITREG_FLUSH_TIMEOUT_S", "soon")
    with pytest.raises(VitregError, match="VITREG_FLUSH_TIMEOUT_S"):
        flush_timeout_s()
    assert offline_mode() is False and offline_mode("true") is True and offline_mode(False) is False
    monkeypatch.setenv("VITREG_OFFLINE", "1")
    assert offline_mode() is True and offline_mode("false") is True, "the variable holds for the session"
    monkeypatch.setenv("VITREG_OFFLINE", "maybe")
    with pytest.raises(VitregError, match="VITREG_OFFLINE='maybe' is not a boolean"):
        offline_mode()
    assert spool_root({"HOME": "/h"}) == Path.home() / ".local/share/vitreg/spool"
    assert spool_root({"XDG_DATA_HOME": "/d"}) == Path("/d/vitreg/spool")
    assert spool_root({"VITREG_SPOOL_DIR": str(tmp_path)}) == tmp_path


def test_a_password_in_the_tracking_uri_is_not_written_to_the_spool(tmp_path):
    spool = Spool.create("exp", tracking_uri="http://alice:s3cret@127.0.0.1:5000", root=tmp_path)
    assert "s3cret" not in (spool.path / "journal.jsonl").read_text()


# --------------------------------------------------------------------------- offline, sync, exactly once


def test_offline_writes_only_the_spool_and_sync_delivers_it_once(store, experiment, tmp_path, monkeypatch, capsys,
                                                                 clients_made):
    monkeypatch.setenv("VITREG_OFFLINE", "1")
    root = tmp_path / "spool"
    threads_before = set(threading.enumerate())
    spool = write_offline_run(root, tmp_path, experiment)
    # offline is journal writes alone: no store client made, no delivery thread started
    assert clients_made == [] and not set(threading.enumerate()) - threads_before
    err = capsys.readouterr().err.strip()
    assert err == f"[vitreg] the run is kept in {spool.path}: deliver it with `vitreg sync --spool {spool.path}`"
    client = MlflowClient()
    assert client.get_experiment_by_name(experiment) is None, "offline: nothing reached the store"
    kept = shutil.copytree(spool.path, tmp_path / "kept-copy")
    spool_id = spool.run_record["spool_id"]

    result = CliRunner().invoke(sync_command, ["--spool", str(root)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"delivered {spool.path} -> run ")
    assert not spool.path.exists(), "a delivered spool is removed"
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.run_name == "offline-run" and run.data.tags[SPOOL_ID_TAG] == spool_id
    assert_delivered_once(client, run.info.run_id, 2500)

    again = sync(kept)  # the same journal once more: the server says it has it all
    assert [(r.run_id, r.records) for r in again] == [(run.info.run_id, 0)]
    assert_delivered_once(client, run.info.run_id, 2500)
    assert CliRunner().invoke(sync_command, ["--spool", str(root)]).output.startswith("nothing to deliver")


BENCH_TINY = ["bench", "--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--task", "infer",
              "--warmup", "1", "--steps", "2", "--repeats", "2", "--device", "cpu"]


def test_bench_offline_true_needs_no_server_and_sync_delivers_the_run(store, experiment, tmp_path, monkeypatch,
                                                                     ports_tried):
    from vitreg.cli.main import main

    monkeypatch.setenv("VITREG_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("VITREG_OFFLINE", "0")
    dead_port = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{dead_port}")  # nothing listens there
    res = CliRunner().invoke(main, [*BENCH_TINY, "--offline", "true", "--experiment", experiment])
    assert res.exit_code == 0, res.output[-3000:]
    assert dead_port not in [port for _, port in ports_tried], "offline: the server was never asked"
    (spool,) = Spool.find(tmp_path / "spool")
    assert res.output.strip().splitlines()[-1] == (
        f"the run is kept in {spool.path}: deliver it with `vitreg sync --spool {spool.path}`")
    assert os.environ["VITREG_OFFLINE"] == "0", "set for the command (and its ranks) only, then restored"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("VITREG_OFFLINE", "0")
    done = CliRunner().invoke(sync_command, ["--spool", str(spool.path)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["model"] == "test_vit"
    assert run.data.metrics["infer_throughput_img_per_s"] > 0


def test_offline_is_a_boolean_and_sweep_refuses_it(monkeypatch):
    from vitreg.cli.main import main

    monkeypatch.setenv("VITREG_OFFLINE", "0")
    res = CliRunner().invoke(main, [*BENCH_TINY, "--offline", "maybe"])
    assert (res.exit_code, res.output.strip()) == (2, "error: offline='maybe' is not a boolean: use offline=true "
                                                      "or offline=false")
    monkeypatch.setenv("VITREG_OFFLINE", "1")
    res = CliRunner().invoke(main, ["sweep", "--models", "test_vit", "--img-size", "32", "--device", "cpu"])
    assert res.exit_code == 2 and res.output.startswith("error: sweep needs the tracking store"), res.output


def test_an_interrupted_sync_resumes_without_duplicates(store, experiment, tmp_path, monkeypatch):
    root = tmp_path / "spool"
    write_offline_run(root, tmp_path, experiment)
    real_log_batch = MlflowClient.log_batch
    calls = {"n": 0}

    def failing_after_two(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise ConnectionError("[Errno 104] Connection reset by peer")
        return real_log_batch(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", failing_after_two)
    with pytest.raises(SyncError, match=r"\(Connection reset by peer\); still spooled: 1 run\(s\)") as err:
        sync(root)
    assert "\n" not in str(err.value)
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert 0 < int(run.data.tags[seq_tag(run.data.tags[SPOOL_ID_TAG])]) and run.info.status == "RUNNING"
    assert len(client.get_metric_history(run.info.run_id, "loss")) < 2500

    monkeypatch.setattr(MlflowClient, "log_batch", real_log_batch)
    (resumed,) = sync(root)
    assert resumed.run_id == run.info.run_id, "found again by its spool id: no second run"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert_delivered_once(client, run.info.run_id, 2500)


def test_a_crash_right_after_creating_the_run_makes_no_second_run(store, experiment, tmp_path, monkeypatch):
    root = tmp_path / "spool"
    write_offline_run(root, tmp_path, experiment, steps=10)

    def refused(self, *args, **kwargs):
        raise ConnectionError("[Errno 111] Connection refused")

    monkeypatch.setattr(MlflowClient, "log_batch", refused)
    with pytest.raises(SyncError):
        sync(root)
    monkeypatch.undo()
    sync(root)
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    assert_delivered_once(client, runs[0].info.run_id, 10)


def test_two_processes_logging_into_one_run_are_both_delivered(store, experiment, tmp_path):
    """A launcher and its rank 0 under `mlflow run`: one run id, two journals, each delivered in full."""
    client = MlflowClient()
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    client.log_param(run_id, "gpu", "auto")  # mlflow run's -P value
    root = tmp_path / "spool"
    for first in (0, 10):
        tracker = SpoolingTracker.open(experiment, run_id=run_id, root=root, offline=True,
                                       existing_params={"gpu": "auto"})
        assert tracker.log_params({"gpu": "cpu", "model": "test_vit"}) == {"gpu": "auto"}
        log_training(tracker, 10, start=first)
        tracker.close("FINISHED", timeout_s=0)
    assert [r.run_id for r in sync(root)] == [run_id, run_id]
    run = client.get_run(run_id)
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(20))
    assert run.data.params == {"gpu": "auto", "model": "test_vit"} and run.info.status == "FINISHED"


def test_open_run_creates_or_continues_the_run_with_one_request(store, experiment, tmp_path, monkeypatch):
    import mlflow

    client = MlflowClient()
    tracker = open_run(experiment, run_name="fresh", tags={"gpu": "cpu"}, root=tmp_path / "a")
    assert tracker.run_id and client.get_run(tracker.run_id).info.status == "RUNNING", "known from the start"
    assert mlflow.active_run() is None, "not MLflow's fluent run: its atexit hook must not end it"
    assert tracker.close(timeout_s=30) is True
    run = client.get_run(tracker.run_id)
    assert (run.info.status, run.info.run_name, run.data.tags["gpu"]) == ("FINISHED", "fresh", "cpu")

    requested = client.create_run(experiment_id_for(client, "mlproject"), run_name="from-mlflow-run")
    client.log_param(requested.info.run_id, "gpu", "auto")
    monkeypatch.setenv("MLFLOW_RUN_ID", requested.info.run_id)
    continued = open_run(experiment, run_name="ignored", root=tmp_path / "b")
    assert continued.run_id == requested.info.run_id
    assert continued.log_params({"gpu": "cpu", "model": "test_vit"}) == {"gpu": "auto"}
    assert continued.close(timeout_s=30) is True
    run = client.get_run(requested.info.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"gpu": "auto", "model": "test_vit"}


def test_open_run_against_a_dead_store_is_one_line_after_one_try(tmp_path, monkeypatch, ports_tried):
    import mlflow

    dead_port = free_port()
    monkeypatch.setattr(mlflow, "get_tracking_uri", lambda: f"http://bob:pw@127.0.0.1:{dead_port}")
    with pytest.raises(StoreError, match="Connection refused") as err:
        open_run("exp", root=tmp_path)
    assert [port for _, port in ports_tried].count(dead_port) == 1, "one attempt, no retries (MLflow's own take minutes)"
    assert "\n" not in str(err.value) and "http://***@127.0.0.1" in str(err.value)
    assert Spool.find(tmp_path) == []


def test_live_delivery_to_a_store_that_works(store, experiment, tmp_path, monkeypatch):
    sent_from, beats = [], []
    real_log_batch = MlflowClient.log_batch

    real_set_tag = MlflowClient.set_tag

    def recording_log_batch(self, *args, **kwargs):
        sent_from.append(threading.current_thread().name)
        beats.extend(float(t.value) for t in kwargs.get("tags") or () if t.key == "vitreg_heartbeat")
        return real_log_batch(self, *args, **kwargs)

    def recording_set_tag(self, run_id, key, value, *args, **kwargs):
        if key == "vitreg_heartbeat":  # a beat with nothing else to send (the first round's, when the loop is quick)
            beats.append(float(value))
        return real_set_tag(self, run_id, key, value, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", recording_log_batch)
    monkeypatch.setattr(MlflowClient, "set_tag", recording_set_tag)
    tracker = SpoolingTracker.open(experiment, run_name="ok", root=tmp_path / "spool", heartbeat_s=0.2)
    log_training(tracker, 300)
    # the loop never waits on the store: its thread never writes there (the delivery thread does)
    assert threading.current_thread().name not in sent_from
    tracker.log_params({"model": "test_vit", "batch_size": 8})
    tracker.set_tags({"gpu": "cpu", "amp": "off"})
    assert tracker.close(timeout_s=30) is True
    assert tracker.close("FAILED") is True, "a second close changes nothing"
    assert not tracker.spool.path.exists()
    client = MlflowClient()
    run = client.get_run(tracker.run_id)
    # the heartbeat went to the store while the run lived (with a batch, or alone in a round that had none: which
    # one depends on how quickly the loop logs, CI's loaded host once sent every batch between two beats); the
    # ended run no longer shows it (issue 32)
    assert run.info.status == "FINISHED" and beats and max(beats) > time.time() - 60
    assert "vitreg_heartbeat" not in run.data.tags
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "loss")) == list(range(300))
    assert sent_from, "delivered by log_batch"


@pytest.mark.slow
def test_a_live_store_costs_the_loop_no_time(store, experiment, tmp_path):
    """The time of the test above (timed, so slow tier), against a baseline measured here: the same
    logging offline (journal writes alone)."""
    offline = SpoolingTracker.open(experiment, root=tmp_path / "offline", offline=True)
    offline_slowest = log_training(offline, 300)
    offline.close()
    tracker = SpoolingTracker.open(experiment, run_name="ok", root=tmp_path / "spool", heartbeat_s=0.2)
    assert log_training(tracker, 300) < max(0.05, 10 * offline_slowest)
    assert tracker.close(timeout_s=30) is True


def test_log_params_keeps_what_the_run_already_holds(tmp_path):
    tracker = SpoolingTracker.open("exp", root=tmp_path, offline=True, existing_params={"gpu": "auto"})
    assert tracker.log_params({"gpu": "h200", "model": "test_vit"}) == {"gpu": "auto"}
    tracker.close(timeout_s=0)
    params = [r["params"] for r in tracker.spool.records() if r["kind"] == "params"]
    assert params == [{"model": "test_vit"}]


# --------------------------------------------------------------------------- servers that do not answer


def test_a_dead_server_never_blocks_the_loop_and_the_end_is_bounded(tmp_path, capsys, ports_tried):
    dead_port = free_port()
    tracker = SpoolingTracker.open("exp", run_name="r", root=tmp_path / "spool",
                                   tracking_uri=f"http://127.0.0.1:{dead_port}")
    log_training(tracker, 2000)
    # the loop never waits on the server: its thread never asks it (the delivery thread does)
    loop = threading.current_thread().name
    assert (loop, dead_port) not in ports_tried and any(port == dead_port for _, port in ports_tried)
    assert tracker.close(timeout_s=1.5) is False
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "Connection refused" in line and "did not take it in 1.5 s" in line
    assert line.endswith(f"the run is kept in {tracker.spool.path}: deliver it with `vitreg sync --spool "
                         f"{tracker.spool.path}`")
    records = Spool(tracker.spool.path).records()
    assert sum(len(r["metrics"]) for r in records if r["kind"] == "metrics") == 4000
    assert records[-1]["kind"] == "end"
    tracker._thread.join(30)  # stopped by close: no delivery left running into the next test (short_http_requests)
    assert not tracker._thread.is_alive()


@pytest.mark.slow
def test_a_dead_server_costs_the_loop_no_time_and_close_keeps_its_timeout(tmp_path, capsys):
    """The times of the test above (timed, so slow tier), each against a baseline measured here: the same
    logging offline (journal writes alone) and the same close offline (nothing to wait for)."""
    offline = SpoolingTracker.open("exp", root=tmp_path / "offline", offline=True)
    began = time.monotonic()
    offline_slowest = log_training(offline, 2000)
    baseline_s = time.monotonic() - began
    closing = time.monotonic()
    offline.close()
    close_baseline_s = time.monotonic() - closing
    tracker = SpoolingTracker.open("exp", run_name="r", root=tmp_path / "spool",
                                   tracking_uri=f"http://127.0.0.1:{free_port()}")
    began = time.monotonic()
    slowest = log_training(tracker, 2000)
    took = time.monotonic() - began
    # as fast as journal writes alone, give or take the thread's share
    assert slowest < max(0.05, 10 * offline_slowest) and took < 3 * baseline_s + 0.5, (took, baseline_s)
    closing = time.monotonic()
    assert tracker.close(timeout_s=1.5) is False
    assert time.monotonic() - closing < 1.5 + close_baseline_s + 1  # the flush timeout, and a second to say so
    capsys.readouterr()
    tracker._thread.join(30)


def test_a_server_answering_503_does_not_hold_the_process(tmp_path, server_503):
    tracker = SpoolingTracker.open("exp", root=tmp_path / "spool", tracking_uri=server_503)
    log_training(tracker, 100)
    assert server_503.hit.wait(30), "the delivery thread never reached the server"  # the event: it met a 503
    assert tracker.close(timeout_s=2) is False
    tracker._thread.join(30)  # the thread lets go of the spool once it stops
    assert not tracker._thread.is_alive()
    asked = len(server_503.calls)
    result = CliRunner().invoke(sync_command, ["--spool", str(tmp_path / "spool")])
    # one attempt: the first 503 ends the sync (MLflow's retries would ask again and again, for minutes)
    assert len(server_503.calls) - asked == 1, server_503.calls[asked:]
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("error: the tracking store at ")
    assert "HTTP 503" in result.output and "still spooled: 1 run(s)" in result.output
    assert tracker.spool.path.exists()


@pytest.mark.slow
def test_a_server_answering_503_is_left_within_the_flush_timeout(tmp_path, server_503):
    """The times of the test above (timed, so slow tier), against baselines measured here: a sync to a port
    nobody listens on (refused at once), and a close with nothing to wait for."""
    offline = SpoolingTracker.open("exp", root=tmp_path / "refused", offline=True)
    log_training(offline, 100)
    closing = time.monotonic()
    offline.close()
    close_baseline_s = time.monotonic() - closing
    began = time.monotonic()
    assert CliRunner().invoke(sync_command, ["--spool", str(tmp_path / "refused"), "--tracking-uri",
                                             f"http://127.0.0.1:{free_port()}"]).exit_code == 2
    baseline_s = time.monotonic() - began

    tracker = SpoolingTracker.open("exp", root=tmp_path / "spool", tracking_uri=server_503)
    log_training(tracker, 100)
    assert server_503.hit.wait(30), "the delivery thread never reached the server"
    closing = time.monotonic()
    assert tracker.close(timeout_s=2) is False
    assert time.monotonic() - closing < 2 + close_baseline_s + 1  # the flush timeout given, and a second to say so
    tracker._thread.join(30)
    began = time.monotonic()
    result = CliRunner().invoke(sync_command, ["--spool", str(tmp_path / "spool")])
    took = time.monotonic() - began
    assert took < 3 * baseline_s + 2, (took, baseline_s)  # one attempt per request: MLflow's retries take minutes
    assert result.exit_code == 2


READS = {"compare": ["compare", "--experiment", "e"], "pull": ["pull", "runs:/" + "a" * 32 + "/checkpoints/last"],
         "runs --csv": ["runs", "--csv", "--experiment", "e"]}


def _vitreg(args, uri, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "vitreg", *args], cwd=tmp_path, capture_output=True, text=True,
                          env=subprocess_env(uri, MLFLOW_DISABLE_TELEMETRY="true"), timeout=300)
    return done, time.monotonic() - began


@pytest.mark.slow
@pytest.mark.parametrize("command", list(READS))
def test_reads_against_a_server_answering_503_end_in_one_line_within_seconds(tmp_path, server_503, command):
    """compare, pull and runs --csv against a server whose /health is fine but every API call 503: one line
    naming the server (masked) and the status, exit 2, within the baseline (the same command against a port
    nobody listens on, measured here) plus the bounded retries (2 retries, ~1 + 2 s of back-off)."""
    _, baseline_s = _vitreg(READS[command], f"http://127.0.0.1:{free_port()}", tmp_path)
    uri = server_503.replace("http://", "http://bob:s3cretpw@")
    done, took = _vitreg(READS[command], uri, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert took < baseline_s + 15, (took, baseline_s)  # MLflow's own retries: 90-200 s
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert server_503.split("//")[1] in errors[0] and "503" in errors[0] and "//***@127.0.0.1" in errors[0], errors[0]
    assert "KILLED" not in errors[0] and "s3cretpw" not in done.stderr + done.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_under_the_spool_is_named_as_the_local_disk(tmp_path):
    """A 1 MiB tmpfs (a real file system, mounted here) fills up under a run's spool: SpoolLost names the
    disk's mount point and says it is full, not that logging to MLflow failed; later calls write nothing."""
    from vitreg.tracking.spool import SpoolLost

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        tracker = SpoolingTracker.open("exp", root=disk / "spool", offline=True)
        with pytest.raises(SpoolLost) as lost:
            for step in range(10**6):  # until the disk is full: ~1 MiB of journal
                tracker.log_metrics({"loss": 1.0 / (step + 1), "lr": 0.1}, step=step)
                tracker.log_text("x" * 4096, f"notes/{step}.txt")
        message = str(lost.value)
        assert f"the local disk at {disk} " in message and "is full" in message, message
        tracker.log_metrics({"loss": 0.0}, step=0)  # the loss is said once; the run's end reports it
        assert tracker.close() is False
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# --------------------------------------------------------------------------- real servers, killed


def _kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the server and its workers: no clean shutdown
    proc.wait(timeout=10)


@pytest.mark.slow
def test_server_killed_mid_run_then_sync_delivers_everything_once(tmp_path, monkeypatch, ports_tried):
    from vitreg.deploy import server
    from vitreg.deploy.server import ServerConfig

    cfg = ServerConfig(port=free_port(), data_dir=premigrated(tmp_path / "server"))
    proc = server.start(cfg, timeout=90)
    try:
        client = MlflowClient(cfg.url)
        tracker = SpoolingTracker.open("outage", run_name="train", root=tmp_path / "spool", tracking_uri=cfg.url,
                                       heartbeat_s=0.5)
        tracker.log_params({"model": "test_vit", "batch_size": 8})
        tracker.set_tags({"gpu": "cpu", "amp": "off"})
        log_training(tracker, 100)
        deadline = time.monotonic() + 30
        while not tracker.run_id or len(client.get_metric_history(tracker.run_id, "loss")) < 100:
            assert time.monotonic() < deadline, "the first 100 steps never reached the live server"
            time.sleep(0.2)
        _kill_group(proc)

        ports_tried.clear()
        log_training(tracker, 500, start=100)
        loop = threading.current_thread().name  # counted, not timed: the loop itself never asks the server
        assert (loop, cfg.port) not in ports_tried, "the loop waited on a dead server"
        ckpt = tmp_path / "last.safetensors"
        ckpt.write_bytes(b"weights" * 100)
        tracker.log_artifact(ckpt, "checkpoints")
        ckpt.unlink()
        tracker.log_dict({"top1": 0.5}, "results.json")
        closing = time.monotonic()
        assert tracker.close("FINISHED", timeout_s=3) is False
        assert time.monotonic() - closing < 4
        kept = shutil.copytree(tracker.spool.path, tmp_path / "kept-copy")

        proc = server.start(cfg, timeout=90)
        tracker._thread.join(30)  # the closed tracker's thread has let go of the spool
        assert not tracker._thread.is_alive()
        result = CliRunner().invoke(sync_command, ["--spool", str(tmp_path / "spool")], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert f"-> run {tracker.run_id} " in result.output
        assert_delivered_once(client, tracker.run_id, 600)
        assert len(client.search_runs([client.get_experiment_by_name("outage").experiment_id])) == 1
        assert [r.records for r in sync(kept)] == [0]
        assert_delivered_once(client, tracker.run_id, 600)
    finally:
        server.stop(proc)


SYNC_CHILD = "import sys; from vitreg.tracking.sync import sync; sync(sys.argv[1])"


@pytest.mark.slow
def test_a_sync_process_killed_midway_resumes(store, experiment, tmp_path):
    root = tmp_path / "spool"
    spool = write_offline_run(root, tmp_path, experiment, steps=15000)  # 30 log_batch calls of 1000 points
    child = subprocess.Popen([sys.executable, "-c", SYNC_CHILD, str(root)], cwd=tmp_path,
                             env=subprocess_env(store, PYTHONPATH=str(REPO)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = MlflowClient()
    deadline = time.monotonic() + 60
    seq = -1
    while seq < 0:
        assert child.poll() is None and time.monotonic() < deadline, "the sync ended before it could be killed"
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp else []
        seq = int(runs[0].data.tags.get(seq_tag(spool.run_record["spool_id"]), -1)) if runs else -1
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert spool.path.exists()
    (resumed,) = sync(root)
    assert 0 < resumed.records < 15005, "the killed sync had delivered a part, the resumed one the rest"
    assert_delivered_once(client, resumed.run_id, 15000)


def test_short_http_requests_is_process_wide_while_any_delivery_runs(monkeypatch):
    from vitreg.tracking.store import short_http_requests

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    monkeypatch.setenv("VITREG_HTTP_TIMEOUT_S", "4")
    with short_http_requests():
        with short_http_requests():  # a second tracker or a sync in the same process
            assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "4"
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0", "the first one still delivers"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "120"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ


SILENT_SERVER_CHILD = """
import sys, time
from vitreg.tracking.delivery import SpoolingTracker, open_run
tracker = SpoolingTracker.open("exp", root=sys.argv[1], tracking_uri=sys.argv[2])
for step in range(200):
    tracker.log_metrics({"loss": 1.0}, step=step)
print("closing", flush=True)
tracker.close("FINISHED")
"""


@pytest.mark.slow
def test_a_server_that_accepts_but_never_answers_costs_the_process_the_flush_timeout(tmp_path):
    with socket.socket() as silent:  # the kernel accepts connections; nobody ever answers them
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        child = subprocess.Popen([sys.executable, "-c", SILENT_SERVER_CHILD, str(tmp_path / "spool"), uri],
                                 env=subprocess_env(uri, PYTHONPATH=str(REPO), VITREG_FLUSH_TIMEOUT_S="2"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "closing"
        closing = time.monotonic()
        _, err = child.communicate(timeout=60)
        ended_after = time.monotonic() - closing
    assert child.returncode == 0, err
    # the 2 s flush timeout, plus the interpreter's shutdown, which takes seconds on a loaded 2-core machine;
    # without the bound, MLflow's own retries hold such a process for minutes
    assert ended_after < 2 + 5, f"the process took {ended_after:.1f} s to end after its work (flush timeout: 2 s)"
    assert "did not take it in 2 s" in err and "vitreg sync --spool" in err
    (spool,) = Spool.find(tmp_path / "spool")
    assert sum(r["kind"] == "metrics" for r in spool.records()) == 200
