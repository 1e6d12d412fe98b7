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

from conftest import free_port, premigrated

SECRET = "Sup3rS3cretPw"
TOKEN = "tok3nOnlyXyz"
TINY = ["--img-size", "32", "--batch-size", "2", "--device", "cpu"]
TRAIN = ["train", "--model", "test_vit", *TINY, "--num-classes", "10", "--num-workers", "0", "--steps", "4",
         "--log-every", "2", "--checkpoint-every", "4", "--warmup-steps", "1"]
INFER = ["--batch-size", "2", "--device", "cpu", "--warmup", "1", "--steps", "1", "--repeats", "1"]
BENCH = ["bench", "--model", "test_vit", *TINY, "--task", "infer", "--warmup", "1", "--steps", "2", "--repeats", "2"]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    from vitreg.deploy import server
    from vitreg.deploy.server import ServerConfig

    root = tmp_path_factory.mktemp("secret-server")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(("VITREG_", "MLFLOW_")) and name != "VITREG_SPOOL_DIR":
                mp.delenv(name)
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        cfg = ServerConfig(port=free_port(), data_dir=premigrated(root / "data"))
        proc = server.start(cfg, timeout=120)
    try:
        yield cfg
    finally:
        server.stop(proc)


class Box:
    """Where a user's commands run: one folder, one spool folder, one secret URI; every output kept."""

    def __init__(self, root: Path, port: int, userinfo: str):
        self.cwd, self.spool = root / "box", root / "spool"
        self.cwd.mkdir()
        self.uri = f"http://{userinfo}@127.0.0.1:{port}"
        self.outputs: list[str] = []

    def run(self, *args: str, offline: bool = False, expect: int = 0) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VITREG_"))}
        env.update(MLFLOW_TRACKING_URI=self.uri, MLFLOW_EXPERIMENT_NAME="secrets", MLFLOW_DISABLE_TELEMETRY="true",
                   VITREG_SPOOL_DIR=str(self.spool), PYTHONUNBUFFERED="1", VITREG_FLUSH_TIMEOUT_S="20")
        if offline:
            env["VITREG_OFFLINE"] = "1"
        proc = subprocess.run([sys.executable, "-m", "vitreg", *args], cwd=self.cwd, env=env, capture_output=True,
                              text=True, timeout=300)
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
    box = Box(tmp_path, mlflow_server.port, f"alice:{SECRET}")
    bench = box.run(*BENCH)
    assert "logged run" in bench.stdout + bench.stderr and "alice:***@127.0.0.1" in bench.stderr
    train = run_id_of(box.run(*TRAIN))
    last = f"runs:/{train}/checkpoints/last"
    box.run("infer", "--model-uri", last, *INFER)
    box.run("pull", last, "--out", str(tmp_path / "pulled"))
    box.run("register", last, "--name", "secret-tiny")
    box.run("compare", "--experiment", "secrets")
    missing = "runs:/0123456789abcdef0123456789abcdef/checkpoints/last"
    failed = box.run(*TRAIN, "--resume", missing, expect=2)  # a run that ends FAILED, its error stored
    assert failed.stderr.strip().splitlines()[-1].startswith("error: ") and "alice:***@" in failed.stderr
    for command in (["pull", missing], ["register", missing, "--name", "x"],
                    ["infer", "--model-uri", missing, *INFER]):
        assert "127.0.0.1" in box.run(*command, expect=2).stderr  # the error names the server, masked
    box.run(*BENCH, offline=True)
    spooled = tmp_path / "spool-copy"
    shutil.copytree(box.spool, spooled)
    box.run("sync")

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
    assert any("alice:***@127.0.0.1" in error for error in errors), errors  # the stored error names the server


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
