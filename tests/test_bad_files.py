"""Issue 39: every small file vitreg parses is read as hostile, every path it reads from a folder it was given
stays inside that folder once its links are followed, a bad input is not called a store fault, and nothing
is left silently "fine" or RUNNING.

Families: a checkpoint's ``last`` (undecodable, nested 200,000 deep, a NUL, a fifo, huge; local, ``file://``
and ``runs:/``), a spool journal line nested 200,000 deep or a tag named with ``\\u0000``, a ``--prices``
TOML nested as deep or a binary CSV, a price that makes the cost per image infinite, a price table over the
experiment tag's limit; a spool whose ``artifacts/`` is a link to another folder, a ``step-<N>`` folder
named by ``last`` that is a link out of the run; ``runs:/`` paths with ``..``, a bad run id, a sqlite URI
naming a folder or holding a fragment; a journal that is a folder, a spool root that is a file, a spool
without its end, a ``VITREG_*`` setting that is ``nan``. Each must end in one ``error:`` line naming the
file (or the value) and the fix, exit 2, no traceback, nothing read or delivered from outside.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from test_spool_faults import assert_refused_untouched, offline_run, snapshot
from vitreg.checkpoint.format import last_pointer, save_checkpoint
from vitreg.cli.main import main
from vitreg.models.factory import create_model
from vitreg.tracking.spool import JOURNAL

DEEP = 200_000
NAMED = '{"format": "vitreg-last-1", "checkpoint": "step-2"}'
BAD_LAST = {  # content of a `last` file (a callable makes the file itself)
    "random-bytes": random.Random(39).randbytes(300),
    "deep-json": b"[" * DEEP + b"]" * DEEP,
    "deep-but-small": b"[" * 2000 + b"]" * 2000,  # deeper than the interpreter's recursion, inside the size cap
    "nul": NAMED.encode() + b"\0",
    "huge": NAMED.encode() + b" " * (2 << 20),
    "fifo": os.mkfifo,
}


def one_error(result, *named: str) -> str:
    """The result is exit 2 with one ``error:`` line, no traceback, naming each of ``named``; that line."""
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:], result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    for name in named:
        assert name in errors[0], (name, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real tiny test_vit checkpoint (step 2), copied into each test's run folder."""
    model, info = create_model("test_vit", 32, 10)
    return save_checkpoint(tmp_path_factory.mktemp("good") / "step-2", model, step=2,
                           spec={"model": "test_vit"}, model_info=info)


def run_checkpoints(tmp_path: Path, checkpoint: Path, last) -> Path:
    """A run's ``checkpoints/`` as train leaves it (step-2 and ``last``), ``last`` replaced by ``last``."""
    folder = tmp_path / "run" / "checkpoints"
    shutil.copytree(checkpoint, folder / "step-2")
    if callable(last):
        last(folder / "last")
    else:
        (folder / "last").write_bytes(last)
    return folder


# --------------------------------------------------------------------------- a checkpoint's `last`


def test_a_good_last_is_followed_in_every_form(tmp_path, checkpoint, sqlite_store):
    """What the refusals below are not: the same folder with a `last` as train writes it pulls."""
    folder = run_checkpoints(tmp_path, checkpoint, last_pointer(2).encode())
    for source in (folder / "last", (folder / "last").as_uri()):
        result = CliRunner().invoke(main, ["pull", str(source)])
        assert result.exit_code == 0, result.output


# a fifo through file:// is not here: the download refuses to copy it before vitreg reads anything
@pytest.mark.parametrize("form, content", [("local", c) for c in BAD_LAST] +
                         [("file-uri", c) for c in BAD_LAST if c != "fifo"])
def test_a_hostile_last_is_one_line_naming_it(tmp_path, checkpoint, sqlite_store, form, content):
    """Issue 39 family 2: 300 random bytes through file:// were a UnicodeDecodeError, a 200,000-deep one a
    RecursionError (locally too); a fifo as `last` said the store should be moved away."""
    last = run_checkpoints(tmp_path, checkpoint, BAD_LAST[content]) / "last"
    source = str(last) if form == "local" else last.as_uri()
    line = one_error(CliRunner().invoke(main, ["pull", source]), source)
    assert "move it away" not in line


@pytest.mark.parametrize("command", [["train", "--model", "test_vit", "--img-size", "32", "--num-classes", "10",
                                      "--steps", "2", "--device", "cpu", "--num-workers", "0", "--resume"],
                                     ["infer", "--device", "cpu", "--model-uri"]], ids=["resume", "infer"])
def test_an_undecodable_last_through_file_uri_is_one_line_for_every_command(tmp_path, checkpoint, sqlite_store,
                                                                             command):
    uri = (run_checkpoints(tmp_path, checkpoint, BAD_LAST["random-bytes"]) / "last").as_uri()
    one_error(CliRunner().invoke(main, [*command, uri]), uri, "not UTF-8")
    running = MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()],
                                         filter_string="attributes.status = 'RUNNING'")
    assert not running


def test_a_deep_last_through_runs_uri_is_one_line(tmp_path, checkpoint, sqlite_store):
    import mlflow

    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(checkpoint), "checkpoints/step-2")
        mlflow.log_text(BAD_LAST["deep-but-small"].decode(), "checkpoints/last")
    uri = f"runs:/{run.info.run_id}/checkpoints/last"
    line = one_error(CliRunner().invoke(main, ["pull", uri]), uri, "not a vitreg 'last' file")
    assert "move it away" not in line


@pytest.mark.parametrize("form", ["local", "file-uri", "runs-uri"])
def test_a_step_folder_linked_out_of_the_run_is_refused(tmp_path, checkpoint, sqlite_store, form):
    """Issue 39 family 1: `last` naming step-9, a link to a checkpoint folder outside the run, loaded the
    weights from there (exit 0)."""
    if form == "runs-uri":
        run_id, artifacts = _run_with_checkpoint(checkpoint)
        folder = artifacts / "checkpoints"
        (folder / "last").write_text(last_pointer(9))
    else:
        folder = run_checkpoints(tmp_path, checkpoint, last_pointer(9).encode())
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(checkpoint, elsewhere)
    (folder / "step-9").symlink_to(elsewhere, target_is_directory=True)
    source = {"local": str(folder / "last"), "file-uri": (folder / "last").as_uri(),
              "runs-uri": f"runs:/{run_id if form == 'runs-uri' else ''}/checkpoints/last"}[form]
    line = one_error(CliRunner().invoke(main, ["pull", source, "--out", str(tmp_path / "out")]), source)
    assert "outside" in line and "move it away" not in line, line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- spools


@pytest.fixture
def spool_store(sqlite_store, clean_vitreg_env):
    return sqlite_store


def test_a_deep_journal_line_is_one_line_naming_it(tmp_path, spool_store):
    """Issue 39 family 2: a 200,000-deep line in journal.jsonl was a RecursionError traceback."""
    spool = offline_run(tmp_path / "spool", tmp_path, steps=2)
    journal = spool.path / JOURNAL
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[:2] + [b"[" * DEEP + b"]" * DEEP + b"\n"] + lines[2:]))
    before = snapshot(spool.path)
    result = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool")])
    assert_refused_untouched(result, spool, before, 3)
    assert "nested" in result.output


def test_a_spool_whose_artifacts_folder_is_a_link_is_refused(tmp_path, spool_store):
    """Issue 39 family 1: the check resolved artifacts/ itself, so a linked artifacts/ passed and sync
    delivered a file of the folder it pointed to (exit 0, "14 new records")."""
    spool = offline_run(tmp_path / "spool", tmp_path, steps=2)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(spool.path / "artifacts", elsewhere)
    (spool.path / "artifacts").symlink_to(elsewhere, target_is_directory=True)
    before = snapshot(spool.path)
    result = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool")])
    assert "is outside the spool" in result.output
    assert_refused_untouched(result, spool, before, len(before[JOURNAL].splitlines()) - 1)


# --------------------------------------------------------------------------- --prices


def _file(tmp_path, name, data: bytes) -> str:
    (tmp_path / name).write_bytes(data)
    return str(tmp_path / name)


PRICES = {  # --prices value (a callable: a file it writes) -> what the one line must name
    "deep-toml": (lambda tmp: _file(tmp, "p.toml", b"h200 = " + b"[" * DEEP + b"]" * DEEP), "nested"),
    "binary-csv": (lambda tmp: _file(tmp, "p.csv", random.Random(39).randbytes(300)), "not UTF-8"),
    "nul-csv": (lambda tmp: _file(tmp, "p.csv", b"gpu,usd_per_hour\nh200,3.5\0\n"), "NUL"),
    "near-float-max": (lambda tmp: "cpu=1e308", "cpu=1e308"),
    "near-float-max-in-csv": (lambda tmp: _file(tmp, "p.csv", b"gpu,usd_per_hour\ncpu,1e308\n"), "cpu"),
    "over-the-tag-limit": (lambda tmp: ",".join(f"gpu{i}=1.5" for i in range(3000)), "20000"),
}


@pytest.mark.parametrize("case", list(PRICES))
def test_a_bad_price_table_is_one_line(tmp_path, sqlite_store, case):
    """Issue 39 families 2-4: a deep TOML (RecursionError), a binary CSV (UnicodeDecodeError), cpu=1e308
    ("$ inf per 1M images", exit 0), a table over MLflow's 20,000-character tag value ("move it away")."""
    make, named = PRICES[case]
    prices = make(tmp_path)
    client = MlflowClient()
    experiment = client.create_experiment("gpus")
    for gpu, throughput in (("cpu", 0.5), ("h200", 900.0)):  # a slow run: what 1e308 USD/h overflowed on
        run = client.create_run(experiment, tags={"vitreg_job": "bench", "gpu": gpu, "amp": "bf16"})
        for key, value in {"model": "test_vit", "task": "infer", "compile": "default", "batch_size": "8",
                           "img_size": "32", "nproc": "1"}.items():
            client.log_param(run.info.run_id, key, value)
        client.log_metric(run.info.run_id, "infer_throughput_img_per_s", throughput)
        client.set_terminated(run.info.run_id)
    line = one_error(CliRunner().invoke(main, ["compare", "--experiment", "gpus", "--prices", prices]), named)
    assert "move it away" not in line


# --------------------------------------------------------------------------- input errors are not store errors


def _run_with_checkpoint(checkpoint: Path) -> tuple[str, Path]:
    """A run of the current store with checkpoints/step-2 logged; its id and its local artifact folder."""
    import mlflow

    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(checkpoint), "checkpoints/step-2")
    return run.info.run_id, Path(run.info.artifact_uri.removeprefix("file://"))


def _last_in_the_store(make):
    """``checkpoints/last`` in the run's artifact folder made by ``make(path, tmp_path)``."""
    def damage(artifacts: Path, tmp: Path) -> str:
        make(artifacts / "checkpoints" / "last", tmp)
        return "runs:/{run}/checkpoints/last"
    return damage


BAD_SOURCES = {  # a pull source for a healthy store: what the one line must name
    "dotdot": (lambda artifacts, tmp: "runs:/{run}/../../../../etc", "'..' in the path"),
    "dotdot-in-checkpoints": (lambda artifacts, tmp: "runs:/{run}/checkpoints/../../../../../../etc/passwd",
                              "'..' in the path"),
    "last-a-fifo": (_last_in_the_store(lambda path, tmp: os.mkfifo(path)), "cannot be read"),
    "last-a-link-outside": (_last_in_the_store(lambda path, tmp: path.symlink_to(
        _file(tmp, "passwd", b"root:x:0:0::/root:/bin/sh\n"))), "cannot be read"),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_a_bad_source_for_a_healthy_store_is_not_called_a_store_fault(tmp_path, checkpoint, sqlite_store, case):
    """Issue 39 family 3: these said "the tracking store ... is not a usable MLflow database: move it away
    (a new one is created)" of a healthy store. They are a bad input, and said as such."""
    run_id, artifacts = _run_with_checkpoint(checkpoint)
    damage, named = BAD_SOURCES[case]
    uri = damage(artifacts, tmp_path).format(run=run_id)
    line = one_error(CliRunner().invoke(main, ["pull", uri]), named)
    assert "move it away" not in line and "not a usable" not in line, line


def test_a_run_id_that_is_no_run_id_is_not_called_a_store_fault(sqlite_store):
    line = one_error(CliRunner().invoke(main, ["sweep", "--rerun-failed", "' OR 1=1 --"]), "' OR 1=1 --")
    assert "move it away" not in line and "refused the request" in line, line


def test_a_sqlite_uri_naming_a_folder_is_refused_as_such(tmp_path, monkeypatch, clean_vitreg_env):
    """`MLFLOW_TRACKING_URI=sqlite:///` names the current folder: a typo, not a store to move away."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///")
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri("sqlite:///")
    try:
        line = one_error(CliRunner().invoke(main, ["bench", "--model", "test_vit", "--device", "cpu"]),
                         "names the folder", "sqlite:///PATH/mlflow.db")
    finally:
        mlflow.set_tracking_uri(None)
    assert "move it away" not in line


def test_move_it_away_is_said_only_of_a_store_that_does_not_open(tmp_path, sqlite_store):
    """An error the advice cannot place (here a SQL error with no known cause) says "move it away" only
    once opening the file shows it is no MLflow store; of a store that opens, it says what failed."""
    from sqlalchemy.exc import OperationalError

    from vitreg.tracking.store import store_fault

    failure = OperationalError("SELECT 1", {}, Exception("no such column: runs.odd"))
    healthy = str(store_fault(failure, sqlite_store, "reading runs"))
    assert "opens as an MLflow store" in healthy and "move it away" not in healthy, healthy
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 100)
    assert "move it away" in str(store_fault(failure, f"sqlite:///{junk}"))


def test_a_deep_cache_file_is_rebuilt_not_a_traceback(tmp_path, monkeypatch):
    """The learned-facts cache is read with the same reader: nested 200,000 deep it was a RecursionError in
    every command that checks a model name; now it is ignored and rebuilt like any unreadable cache."""
    from vitreg.models import learned_facts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    learned_facts.keep(names=("vit_listed",))
    assert learned_facts.names() == {"vit_listed"}
    learned_facts.cache_file().write_bytes(b"[" * DEEP + b"]" * DEEP)
    assert learned_facts.names() == frozenset()


@pytest.mark.parametrize("uri, named", [("sqlite:///", "names the folder"),
                                        ("sqlite:///{tmp}/mlflow.db#token=SECRET", "has a fragment")])
def test_a_sqlite_uri_naming_no_database_file_is_refused_by_runs_stale(tmp_path, monkeypatch, clean_vitreg_env,
                                                                       uri, named):
    """Issue 39 family 4: `runs --stale` with `sqlite:///` said "no RUNNING run" (exit 0), and a URI with
    `#token=SECRET` made a store file whose name holds the secret."""
    import mlflow

    uri = uri.format(tmp=tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(uri)
    try:
        line = one_error(CliRunner().invoke(main, ["runs", "--stale"]), named)
    finally:
        mlflow.set_tracking_uri(None)
    assert "SECRET" not in line and not [p for p in tmp_path.rglob("*") if "SECRET" in p.name]


def test_a_spool_tag_named_with_a_nul_is_refused_before_anything_is_delivered(tmp_path, spool_store):
    """Issue 39 family 4: a tag whose name holds \\u0000 passed the journal check; the store created the run,
    refused the tag, and the run stayed RUNNING with part of its history (every later sync failed there)."""
    from test_spool_faults import insert_record

    spool = offline_run(tmp_path / "spool", tmp_path, steps=2)
    line = insert_record(spool, {"kind": "tags", "tags": {"gpu\0name": "cpu"}})
    before = snapshot(spool.path)
    result = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool")])
    assert_refused_untouched(result, spool, before, line)
    assert "NUL" in result.output


def test_a_journal_that_is_a_folder_is_said_not_skipped(tmp_path, spool_store):
    """Issue 39 family 4: `journal.jsonl` a folder: `vitreg sync` said "nothing to deliver" (exit 0)."""
    spool = offline_run(tmp_path / "spool", tmp_path, steps=2)
    (spool.path / JOURNAL).unlink()
    (spool.path / JOURNAL).mkdir()
    one_error(CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool")]), str(spool.path / JOURNAL),
              "not a file")
    assert spool.path.is_dir()


def test_a_spool_dir_that_is_a_file_is_said_not_skipped(tmp_path, spool_store, monkeypatch):
    """Issue 39 family 4: VITREG_SPOOL_DIR a file: `vitreg sync` said "nothing to deliver" (exit 0)."""
    (tmp_path / "spools").write_text("not a folder")
    monkeypatch.setenv("VITREG_SPOOL_DIR", str(tmp_path / "spools"))
    one_error(CliRunner().invoke(main, ["sync"]), str(tmp_path / "spools"), "VITREG_SPOOL_DIR")


def test_a_spool_without_its_end_is_kept_and_not_called_delivered(tmp_path, spool_store):
    """Issue 39 family 4: a spool whose process stopped before writing the run's end (VITREG_FLUSH_TIMEOUT_S=nan
    did that at the end of a whole benchmark) was reported "delivered" and removed; the run stayed RUNNING
    for good. Now it is kept, and said, until the run is ended (runs --stale --fix); then sync removes it."""
    spool = offline_run(tmp_path / "spool", tmp_path, steps=2)
    journal = spool.path / JOURNAL
    journal.write_bytes(b"".join(journal.read_bytes().splitlines(keepends=True)[:-1]))  # no end record
    first = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool")])
    assert first.exit_code == 0 and "but not its end" in first.output and spool.path.is_dir(), first.output
    (run,) = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("hostile").experiment_id])
    assert run.info.status == "RUNNING"
    fixed = CliRunner().invoke(main, ["runs", "--stale", "--fix", "--older-than", "0"])
    assert fixed.exit_code == 0 and MlflowClient().get_run(run.info.run_id).info.status == "KILLED", fixed.output
    again = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool")])
    assert again.exit_code == 0 and f"delivered {spool.path} -> run {run.info.run_id}" in again.output, again.output
    assert not spool.path.exists()


@pytest.mark.parametrize("setting", ["VITREG_FLUSH_TIMEOUT_S", "VITREG_HEARTBEAT_S", "VITREG_HTTP_TIMEOUT_S"])
def test_a_bad_tracking_setting_is_refused_before_the_run_opens(tmp_path, spool_store, monkeypatch, setting):
    """Issue 39 family 4: VITREG_FLUSH_TIMEOUT_S=nan (offline) let the whole benchmark run, then exited 2 at
    the end with a spool holding no end (which sync then removed, the run RUNNING for good)."""
    monkeypatch.setenv("VITREG_SPOOL_DIR", str(tmp_path / "spools"))
    monkeypatch.setenv(setting, "nan")
    result = CliRunner().invoke(main, ["bench", "--model", "test_vit", "--img-size", "32", "--batch-size", "2",
                                       "--device", "cpu", "--warmup", "1", "--steps", "2", "--repeats", "1",
                                       "--offline", "true"])
    one_error(result, setting)
    assert "img/s" not in result.output, "refused before the benchmark ran"
    assert not list((tmp_path / "spools").glob("*/" + JOURNAL)), "no run opened"


def test_brackets_inside_strings_and_comments_are_not_nesting(tmp_path, spool_store):
    """The depth cap counts nesting, not bracket characters: a price table whose comment and quoted label hold
    100 brackets, and a spool tag value holding 100, are taken as they are."""
    from test_spool_faults import insert_record

    from vitreg.analysis.cost import parse_prices

    table = tmp_path / "p.toml"
    deep = "[" * 100 + "]" * 100  # nested 100 deep, were it not inside a string or a comment
    table.write_text(f'# {deep}\n[usd_per_gpu_hour]\n"h200 {deep}" = 3.5\n')
    assert parse_prices(str(table)) == {f"h200 {deep}": 3.5}
    spool = offline_run(tmp_path / "spool", tmp_path, steps=2)
    insert_record(spool, {"kind": "tags", "tags": {"note": deep}})
    result = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool")])
    assert result.exit_code == 0 and "delivered" in result.output, result.output
    (run,) = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("hostile").experiment_id])
    assert run.data.tags["note"] == deep


# ------------------------------------------------------------------------------------------------- issue 45
TINY_BENCH = ["bench", "--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--device", "cpu", "--warmup",
              "1", "--steps", "2", "--repeats", "1", "--task", "infer"]


def test_bad_days_v_case10_a_bad_stop_grace_is_refused_before_the_run_opens(tmp_path, spool_store, monkeypatch):
    """`VITREG_STOP_GRACE_S=abc` ran (every other VITREG_* setting is refused up front), and on SIGTERM the
    watchdog thread died of it with a traceback."""
    from vitreg import signals

    test_a_bad_tracking_setting_is_refused_before_the_run_opens(tmp_path, spool_store, monkeypatch,
                                                                "VITREG_STOP_GRACE_S")
    monkeypatch.setenv("VITREG_STOP_GRACE_S", "abc")
    assert signals.watchdog_grace_s() == signals.DEFAULT_STOP_GRACE_S  # the watchdog's own read never raises


def test_bad_days_v_case11_a_run_continued_through_mlflow_run_id_drops_the_earlier_error(sqlite_store, monkeypatch):
    """`MLFLOW_RUN_ID=<a KILLED run> vitreg bench` ended FINISHED still carrying vitreg_error=interrupted (Ctrl-C)."""
    client = MlflowClient()
    run_id = client.create_run(client.create_experiment("again")).info.run_id
    client.set_tag(run_id, "vitreg_error", "interrupted (Ctrl-C)")
    client.set_terminated(run_id, "KILLED")
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    result = CliRunner().invoke(main, TINY_BENCH)
    assert result.exit_code == 0, result.output
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "vitreg_error" not in run.data.tags, run.data.tags.get("vitreg_error")


def test_bad_days_v_case12_an_energy_trace_in_no_folder_is_one_line_naming_it(tmp_path, sqlite_store, monkeypatch):
    """`VITREG_ENERGY_TRACE=/nonexistent/dir/trace.jsonl vitreg bench` was a FileNotFoundError traceback."""
    monkeypatch.setenv("VITREG_ENERGY_TRACE", str(tmp_path / "no" / "trace.jsonl"))
    one_error(CliRunner().invoke(main, [*TINY_BENCH, "--experiment", "trace"]), "VITREG_ENERGY_TRACE", "unset")
    (run,) = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("trace").experiment_id])
    assert run.info.status == "FAILED" and "VITREG_ENERGY_TRACE" in run.data.tags["vitreg_error"]


def test_bad_days_v_case13_a_huge_journal_line_is_skipped_or_refused_by_its_size_never_read_whole(tmp_path,
                                                                                                spool_store):
    """`vitreg sync` of a spool whose journal ends in a 300 MB torn line took 110 s and 1.4 GB. A torn line over
    the limit is dropped as a torn line is, a whole one refused by its size, neither held in memory (here 40 MB:
    the peak stays a few MiB)."""
    import tracemalloc

    MAX_LINE = 4 << 20  # vitreg.tracking.spool.MAX_LINE

    spool = offline_run(tmp_path / "spool", tmp_path, steps=2)
    journal = spool.path / JOURNAL
    whole = journal.read_bytes()
    with open(journal, "ab") as fh:
        fh.write(b'{"seq": 99, "kind": "tags", "tags": {"x": "' + b"y" * (40 << 20))  # torn: no line end
    tracemalloc.start()
    try:
        records = spool.records()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_LINE and len(records) == whole.count(b"\n"), peak
    result = CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool")])
    assert result.exit_code == 0 and "delivered" in result.output, result.output
    spool = offline_run(tmp_path / "spool2", tmp_path, steps=2)
    with open(spool.path / JOURNAL, "ab") as fh:
        fh.write(b'{"seq": 99, "kind": "tags", "tags": {"x": "' + b"y" * (MAX_LINE + 10) + b'"}}\n')
    one_error(CliRunner().invoke(main, ["sync", "--spool", str(tmp_path / "spool2")]), "journal.jsonl",
              "a line over 4,194,304 bytes")


def test_bad_days_v_trial_a_run_name_too_long_to_keep_is_refused(sqlite_store):
    """Issue 45's trial: `bench --run-name` of 10,000 characters ran, the name cut at 8,000 without a word."""
    one_error(CliRunner().invoke(main, [*TINY_BENCH, "--run-name", "n" * 10_000]), "run_name is 10,000 characters")
