"""No credential of the tracking URI is ever printed or stored: every byte a run writes is searched for it.

A real ``mlflow server`` (no auth: it ignores the basic-auth header MLflow makes of the URI's userinfo)
and real ``vitreg`` processes with ``MLFLOW_TRACKING_URI=http://user:SECRET@127.0.0.1:PORT``. Each command
runs once, successful and failing: bench, train (a finished run and a failed resume, whose error names the
server and is stored in its ``vitreg_error`` tag), infer, pull, register, compare, an offline bench and the
``vitreg sync`` that delivers it (MLflow prints its "View run at" link when a run ends). Then the secret is
searched in every stdout and stderr, every file under the server's store (params, tags, artifacts: its
sqlite file and artifact folder), every spool file and every file the commands wrote in their folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _warm import WarmVitreg
from conftest import free_port, premigrated, wait_until

SECRET = "Sup3rS3cretPw"
TOKEN = "tok3nOnlyXyz"
TINY = ["--img-size", "32", "--batch-size", "2", "--device", "cpu"]
TRAIN = ["train", "--model", "test_vit", *TINY, "--num-classes", "10", "--num-workers", "0", "--steps", "4",
         "--log-every", "2", "--checkpoint-every", "4", "--warmup-steps", "1"]
INFER = ["--batch-size", "2", "--device", "cpu", "--warmup", "1", "--steps", "1", "--repeats", "1"]
BENCH = ["bench", "--model", "test_vit", *TINY, "--task", "infer", "--warmup", "1", "--steps", "2", "--repeats", "2"]


class Box:
    """Where a user's commands run: one folder, one spool folder, one secret URI; every output kept."""

    def __init__(self, root: Path, port: int, userinfo: str):
        self.cwd, self.spool = root / "box", root / "spool"
        self.cwd.mkdir()
        self.uri = f"http://{userinfo}@127.0.0.1:{port}"
        self.outputs: list[str] = []

        self.warm: WarmVitreg | None = None

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VITREG_"))}
        env.update(MLFLOW_TRACKING_URI=self.uri, MLFLOW_EXPERIMENT_NAME="secrets", MLFLOW_DISABLE_TELEMETRY="true",
                   VITREG_SPOOL_DIR=str(self.spool), PYTHONUNBUFFERED="1", VITREG_FLUSH_TIMEOUT_S="20")
        return env

    def start_warm(self, out_file: Path) -> None:
        """The next commands run in one warm vitreg worker (tests/_warm.py) instead of a process each."""
        self.warm = WarmVitreg(self.cwd, self.env(), out_file)

    def close_warm(self) -> None:
        """End the warm worker; what it printed as it ended is searched too."""
        ended = self.warm.close()
        self.outputs.append(f"$ (the warm worker ends)\n{ended.stdout}\n{ended.stderr}")
        assert ended.returncode == 0, self.outputs[-1][-3000:]

    def run(self, *args: str, offline: bool = False, expect: int = 0) -> subprocess.CompletedProcess:
        extra = {"VITREG_OFFLINE": "1"} if offline else {}
        if self.warm:
            proc = self.warm.run(*args, env=extra)
        else:
            proc = subprocess.run([sys.executable, "-m", "vitreg", *args], cwd=self.cwd, env={**self.env(), **extra},
                                  capture_output=True, text=True, timeout=300)
        self.outputs.append(f"$ vitreg {' '.join(args)}\n{proc.stdout}\n{proc.stderr}")
        assert proc.returncode == expect, self.outputs[-1][-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return proc


def run_id_of(proc) -> str:
    return (proc.stdout + proc.stderr).split("logged run ")[1].split()[0]


def files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in Path(root).rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.slow
def test_no_command_prints_or_stores_the_tracking_uris_password(tmp_path, mlflow_server):
    """Thirteen commands in one warm vitreg worker (a real process: what they print, exit with and store is
    each command's; how a process starts with a secret URI is the token and dead-server tests' own)."""
    box = Box(tmp_path, mlflow_server.port, f"alice:{SECRET}")
    box.start_warm(tmp_path / "warm-stdout")
    bench = box.run(*BENCH)
    assert "logged run" in bench.stdout + bench.stderr and "http://***@127.0.0.1" in bench.stderr
    train = run_id_of(box.run(*TRAIN))
    last = f"runs:/{train}/checkpoints/last"
    box.run("infer", "--model-uri", last, *INFER)
    box.run("pull", last, "--out", str(tmp_path / "pulled"))
    box.run("register", last, "--name", "secret-tiny")
    box.run("compare", "--experiment", "secrets")
    missing = "runs:/0123456789abcdef0123456789abcdef/checkpoints/last"
    failed = box.run(*TRAIN, "--resume", missing, expect=2)  # a run that ends FAILED, its error stored
    assert failed.stderr.strip().splitlines()[-1].startswith("error: ") and "http://***@127.0.0.1" in failed.stderr
    for command in (["pull", missing], ["register", missing, "--name", "x"],
                    ["infer", "--model-uri", missing, *INFER]):
        assert "127.0.0.1" in box.run(*command, expect=2).stderr  # the error names the server, masked
    box.run(*BENCH, offline=True)
    spooled = tmp_path / "spool-copy"
    shutil.copytree(box.spool, spooled)
    box.run("sync")
    box.close_warm()

    printed = "\n".join(box.outputs)
    assert SECRET not in printed, [line for line in printed.splitlines() if SECRET in line]
    assert "View run" not in printed  # MLflow's own link (it holds the credentials) is vitreg's, masked
    for root in (mlflow_server.data_dir, spooled, box.cwd, tmp_path / "pulled"):
        assert files_holding(root, SECRET.encode()) == [], root
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.url)
    runs = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
    assert {r.info.status for r in runs} == {"FINISHED", "FAILED"} and len(runs) >= 6
    errors = [r.data.tags["vitreg_error"] for r in runs if r.info.status == "FAILED"]
    assert any("http://***@127.0.0.1" in error for error in errors), errors  # the stored error names the server


@pytest.mark.slow
def test_a_token_only_uri_is_never_printed_nor_put_in_the_spool(tmp_path, mlflow_server):
    box = Box(tmp_path, mlflow_server.port, TOKEN)
    box.run(*BENCH)
    box.run(*BENCH, offline=True)
    assert files_holding(box.spool, TOKEN.encode()) == []
    box.run("sync")
    printed = "\n".join(box.outputs)
    assert TOKEN not in printed and "http://***@127.0.0.1" in printed
    assert files_holding(mlflow_server.data_dir, TOKEN.encode()) == []


# ------------------------------------------------------------ issue 31: any name, any form, any printer
# Each URI holds its secret where no list of names would look; the secret is at least 4 characters.
DEAD_SERVER_SECRETS = {
    "http://127.0.0.1:{port}/?passwd=Pa55wdValue": "Pa55wdValue",
    "http://127.0.0.1:{port}/?accessToken=AcTok3nValue": "AcTok3nValue",
    "http://T0kenAsUser:@127.0.0.1:{port}": "T0kenAsUser",  # an empty password
    "http://0nlyTheUser@127.0.0.1:{port}/": "0nlyTheUser",
    "HTTP://127.0.0.1:{port}/?X_API_KEY=UpperCas3Val": "UpperCas3Val",
    "http://127.0.0.1:{port}/#access_token=Fr4gmentVal": "Fr4gmentVal",
    "http://127.0.0.1:{port}/?pass%77ord=Perc%2Bnt3ncoded": "Perc+nt3ncoded",
}


def _env_for(uri: str, spool: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VITREG_"))}
    env.update(MLFLOW_TRACKING_URI=uri, MLFLOW_DISABLE_TELEMETRY="true", VITREG_SPOOL_DIR=str(spool),
               PYTHONUNBUFFERED="1")
    return env


@pytest.mark.slow
def test_bench_against_a_dead_server_never_prints_a_secret_whatever_its_name_or_form(tmp_path):
    """Each form of secret, one bench against a port nobody listens on: its one line names the server, masked,
    and comes before the job's heavy imports (the import-time lines Python prints show none of them)."""
    port = free_port()
    procs = {}
    for n, (uri, secret) in enumerate(DEAD_SERVER_SECRETS.items()):
        uri = uri.format(port=port)
        procs[uri, secret] = subprocess.Popen([sys.executable, "-m", "vitreg", *BENCH], cwd=tmp_path,
                                              env={**_env_for(uri, tmp_path / f"spool{n}"),
                                                   "PYTHONPROFILEIMPORTTIME": "1"}, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for (uri, secret), proc in procs.items():
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
        printed = out + err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in err, (uri, printed[-2000:])
        assert f"127.0.0.1:{port}" in errors[0] and "***" in errors[0], errors[0]  # the server named, masked
        for literal in {secret, uri.split("=")[-1]}:  # raw and decoded
            assert literal not in printed, (uri, printed)
        imported = {line.split("|")[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
        assert imported and not imported & {"torch", "timm", "mlflow"}, sorted(imported & {"torch", "timm", "mlflow"})


# A command added to vitreg's own click group: every kind of printer a library or vitreg has, each given the
# URI. The logging handler is made before vitreg starts, with the bare stderr, as a user's basicConfig would.
NOISY_COMMAND = """
import logging, os, sys, threading, warnings
import click
logging.getLogger("urllib3.connectionpool").addHandler(logging.StreamHandler())
from vitreg.cli.main import main
import mlflow  # MLflow's own handler on its loggers


def fail(message):
    raise RuntimeError(message)


@main.command()
def noisy():
    uri = os.environ["NOISY_URI"]
    logging.getLogger("urllib3.connectionpool").warning("Retrying after connection broken: %s", uri)
    logging.getLogger("mlflow.tracking.fluent").warning("could not reach %s", uri)
    warnings.warn(f"slow answer from {uri}")
    print(f"stdout line {uri}")
    click.echo(f"click line {uri}", err=True)
    sys.stderr.buffer.write(f"[rank1]: forwarded bytes {uri}\\n".encode())
    sys.stderr.buffer.flush()
    thread = threading.Thread(target=fail, args=(f"thread failed at {uri}",))
    thread.start()
    thread.join()
    raise RuntimeError(f"uncaught at {uri}")

main()
"""


@pytest.mark.slow
def test_no_printer_shows_a_secret_libraries_logging_warnings_and_tracebacks_included(tmp_path):
    uri = "http://L1brarySecret:@127.0.0.1:9/?refreshTok=Qu3rySecret"
    env = _env_for("sqlite:///" + str(tmp_path / "m.db"), tmp_path / "spool")
    env["NOISY_URI"] = uri
    env["VITREG_VERBOSE"] = "1"  # the libraries' warnings are printed too (by default only the run's log has them)
    done = subprocess.run([sys.executable, "-c", NOISY_COMMAND, "noisy"], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=300)
    printed = done.stdout + done.stderr
    shown = "http://***@127.0.0.1:9/?refreshTok=***"
    for what in ("Retrying after", "could not reach", "slow answer from", "stdout line", "click line",
                 "forwarded bytes", "thread failed at", "uncaught at"):
        assert any(what in line and shown in line for line in printed.splitlines()), (what, printed)  # masked
    assert "L1brarySecret" not in printed and "Qu3rySecret" not in printed, printed


# ------------------------------------------------------------ issue 39 point 5: the Python API's caller
# A user's script: mlflow imported, then its own logging (a handler with the bare stderr, one keeping records, on
# the root and on MLflow's logger), then vitreg.api.bench against a server with the password in the URI. What the script's
# streams, handlers and record factory are is printed before and after the call, and again once every thread
# the call started has ended (at most 60 s: its names are printed when one has not).
API_CALLER = """
import logging, os, sys, threading, time, warnings
import mlflow  # first: importing it sets MLflow's loggers' handlers anew
logging.basicConfig(level=logging.INFO, format="CALLER %(levelname)s %(name)s %(message)s")
kept = []


class Keep(logging.Handler):
    def emit(self, record):
        kept.append(self.format(record))


keep = Keep()
logging.getLogger().addHandler(keep)
logging.getLogger("mlflow").addHandler(keep)  # MLflow's loggers do not propagate to the root


def state():
    root = logging.getLogger()
    return (sys.stdout, sys.stderr, logging.getLogRecordFactory(), warnings.showwarning, root.level,
            [(h, getattr(h, "stream", None), list(h.filters), h.formatter) for h in root.handlers],
            logging.getLogger("mlflow").handlers[-1] is keep)


before = state()
threads_before = set(threading.enumerate())
import vitreg

result = vitreg.api.bench(model="test_vit", img_size=32, batch_size=2, device="cpu", task="infer", warmup=1,
                          steps=300, repeats=3, experiment="api-caller")
right_after = state()
deadline = time.monotonic() + 60  # anything a thread the call started still had to say: it says it before it ends
while time.monotonic() < deadline and any(t.is_alive() for t in set(threading.enumerate()) - threads_before):
    time.sleep(0.05)
print("threads of the call left:", sorted(t.name for t in set(threading.enumerate()) - threads_before))
print("result", type(result).__name__, "same" if before == right_after == state() else "changed")
print("kept", len(kept), "records;", sum("***@127.0.0.1" in line for line in kept), "name the server masked")
print("\\n".join(kept), file=open("kept.txt", "w"))
"""


@pytest.mark.slow
def test_the_python_api_masks_what_libraries_print_during_the_call_and_leaves_the_callers_streams(tmp_path):
    """MLflow's system-metrics monitor warns "Failed to get mlflow run: API request to http://alice:PASSWORD@..."
    on stderr when the server goes away during a run: the CLI masked it, a Python caller saw the password. The
    server here is stopped once the run is RUNNING on it; the run then goes on for seconds, the monitor asks."""
    from vitreg.deploy import server
    from vitreg.deploy.server import ServerConfig

    cfg = ServerConfig(port=free_port(), data_dir=premigrated(tmp_path / "data"))
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith(("VITREG_", "MLFLOW_"))]:
            mp.delenv(name)
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        proc = server.start(cfg, timeout=120, quiet=True)
    caller = None
    try:
        env = {**Box(tmp_path, cfg.port, f"alice:{SECRET}").env(), "VITREG_FLUSH_TIMEOUT_S": "5",
               "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}  # the caller's own choice: a failed request fails at once
        env.pop("MLFLOW_EXPERIMENT_NAME")
        caller = subprocess.Popen([sys.executable, "-c", API_CALLER], cwd=tmp_path / "box", env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"http://127.0.0.1:{cfg.port}")

        def running() -> bool:
            assert caller.poll() is None, caller.communicate()
            experiment = client.get_experiment_by_name("api-caller")
            return bool(experiment and client.search_runs([experiment.experiment_id], "attributes.status = 'RUNNING'"))

        wait_until(running, timeout_s=240, what="the API's run RUNNING on the server")
        server.stop(proc)
        out, err = caller.communicate(timeout=400)
    finally:
        server.stop(proc)
        if caller is not None and caller.poll() is None:
            caller.kill()
            caller.wait()
    printed = out + err
    assert caller.returncode == 0, printed[-3000:]
    assert SECRET not in printed, [line for line in printed.splitlines() if SECRET in line]
    kept = (tmp_path / "box" / "kept.txt").read_text()
    assert SECRET not in kept, kept
    # the library did speak (masked), through the caller's handler and on stderr: what would have leaked
    assert "Failed to get mlflow run" in kept and "API request to http://***@127.0.0.1" in err, err[-3000:]
    assert "result BenchResult same" in out, out  # the caller's streams, handlers and logging as they were
