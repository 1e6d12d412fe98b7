"""vitreg.deploy.server: configuration checks (fast) and real ``mlflow server`` processes (slow).

The slow tests start servers on free loopback ports, log a run through MLflow's client (in this
process, standing in the client's folder; a separate process where the process is the point: the bench
runs, and tests/test_server_s3.py's client without boto3) and look at where things land on disk.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, premigrated

from vitreg.deploy import server
from vitreg.deploy.server import ServerConfig, ServerError

PG_URI = "postgresql://vitreg:vitreg@127.0.0.1:5432/vitreg"
SECRET_KEY = "test-secret-key-0123456789abcdef"
ADMIN_PASSWORD = "test-admin-password-42"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No VITREG_* / MLflow settings from the developer's shell leak into a test."""
    for name in list(os.environ):
        if name.startswith(("VITREG_", "MLFLOW_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and text.strip() == text and text
    return text


# --------------------------------------------------------------------------- configuration


def test_defaults_from_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = ServerConfig.from_env()
    data = tmp_path / "vitreg-data"
    assert (cfg.host, cfg.port, cfg.workers, cfg.auth) == ("127.0.0.1", 5000, 1, False)
    assert cfg.data_dir == data
    assert cfg.backend_store_uri == f"sqlite:///{data}/mlflow.db"
    assert cfg.artifacts_destination == str(data / "artifacts")
    assert cfg.url == "http://127.0.0.1:5000"
    assert cfg.health_url == "http://127.0.0.1:5000/health"
    assert not data.exists(), "reading the config must not create anything"


def test_env_overrides(tmp_path):
    cfg = ServerConfig.from_env({
        "VITREG_SERVER_HOST": "0.0.0.0",
        "VITREG_SERVER_PORT": "6000",
        "VITREG_SERVER_WORKERS": "3",
        "VITREG_SERVER_DATA": str(tmp_path / "d"),
        "VITREG_BACKEND_URI": "sqlite:///rel/store.db",
        "VITREG_ARTIFACTS_DESTINATION": "s3://bucket/vitreg",
        "VITREG_ALLOWED_HOSTS": "mlflow.example.com,10.0.0.5:6000",
    })
    assert (cfg.port, cfg.workers) == (6000, 3)
    assert cfg.backend_store_uri == f"sqlite:///{Path('rel/store.db').resolve()}"
    assert cfg.artifacts_destination == "s3://bucket/vitreg"
    assert cfg.health_url == "http://127.0.0.1:6000/health"
    cmd = server.build_command(cfg)
    assert cmd[:4] == [sys.executable, "-m", "mlflow", "server"]
    assert "--serve-artifacts" in cmd
    for flag, value in [("--host", "0.0.0.0"), ("--port", "6000"), ("--workers", "3"),
                        ("--artifacts-destination", "s3://bucket/vitreg"),
                        ("--allowed-hosts", "mlflow.example.com,10.0.0.5:6000")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--app-name" not in cmd
    assert server.child_env(cfg, {})["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"


@pytest.mark.parametrize("env, names", [
    ({"VITREG_SERVER_PORT": "abc"}, "VITREG_SERVER_PORT"),
    ({"VITREG_SERVER_PORT": "70000"}, "VITREG_SERVER_PORT"),
    ({"VITREG_SERVER_PORT": "5000.5"}, "VITREG_SERVER_PORT"),
    ({"VITREG_SERVER_WORKERS": "0"}, "VITREG_SERVER_WORKERS"),
    ({"VITREG_BACKEND_URI": "mongodb://localhost/x"}, "VITREG_BACKEND_URI"),
    ({"VITREG_BACKEND_URI": "postgres://u:p@h/db"}, "postgresql://"),
    ({"VITREG_BACKEND_URI": "./mlruns"}, "VITREG_BACKEND_URI"),
    ({"VITREG_BACKEND_URI": "file:///tmp/mlruns"}, "sqlite:///"),
    ({"VITREG_BACKEND_URI": "postgresql+nodriver://h/db"}, "driver"),
    ({"VITREG_AUTH": "maybe"}, "VITREG_AUTH"),
    ({"VITREG_AUTH": "true"}, "MLFLOW_FLASK_SERVER_SECRET_KEY"),
    ({"VITREG_AUTH": "true", "MLFLOW_FLASK_SERVER_SECRET_KEY": "k"}, "VITREG_ADMIN_PASSWORD"),
    ({"VITREG_AUTH": "true", "MLFLOW_FLASK_SERVER_SECRET_KEY": "k",
      "VITREG_ADMIN_PASSWORD": "short"}, "12+ characters"),
    ({"VITREG_AUTH": "true", "MLFLOW_FLASK_SERVER_SECRET_KEY": "k",
      "VITREG_ADMIN_PASSWORD": "password1234"}, "VITREG_ADMIN_PASSWORD"),
    ({"VITREG_AUTH": "true", "MLFLOW_FLASK_SERVER_SECRET_KEY": "k",
      "VITREG_ADMIN_PASSWORD": ADMIN_PASSWORD, "VITREG_AUTH_DEFAULT_PERMISSION": "ALL"},
     "VITREG_AUTH_DEFAULT_PERMISSION"),
])
def test_bad_input_is_one_line_server_error(env, names, tmp_path):
    env = {"VITREG_SERVER_DATA": str(tmp_path), **env}
    with pytest.raises(ServerError) as info:
        ServerConfig.from_env(env)
    assert isinstance(info.value, ValueError)
    assert names in one_line(info.value)


@pytest.mark.slow
def test_main_exits_2_with_one_error_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITREG_")}
    env.update(VITREG_SERVER_PORT="not-a-port", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "vitreg.deploy.server"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: VITREG_SERVER_PORT='not-a-port' is not an integer; "
        "set it to a number from 1 to 65535"
    ]
    assert not (tmp_path / "vitreg-data").exists()


def test_dry_run_prints_command_without_secrets(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VITREG_SERVER_DATA", str(tmp_path))
    monkeypatch.setenv("VITREG_BACKEND_URI", "postgresql+psycopg2://bench:s3cret-pw@db:5432/mlflow")
    monkeypatch.setenv("VITREG_AUTH", "true")
    monkeypatch.setenv("MLFLOW_FLASK_SERVER_SECRET_KEY", SECRET_KEY)
    monkeypatch.setenv("VITREG_ADMIN_PASSWORD", ADMIN_PASSWORD)
    assert server.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mlflow server" in out and "--app-name basic-auth" in out
    for secret in ("s3cret-pw", SECRET_KEY, ADMIN_PASSWORD):
        assert secret not in out
    cfg = ServerConfig.from_env()
    assert "s3cret-pw" not in repr(cfg) and ADMIN_PASSWORD not in repr(cfg)
    # A password-bearing backend URI travels in the environment, not on the command line.
    assert not any("s3cret-pw" in part for part in server.build_command(cfg))
    env = server.child_env(cfg, {})
    assert env["MLFLOW_BACKEND_STORE_URI"].endswith("s3cret-pw@db:5432/mlflow")
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == ADMIN_PASSWORD
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] == SECRET_KEY


def test_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = ServerConfig(port=port, data_dir=tmp_path / "data")
        with pytest.raises(ServerError, match="already in use.*VITREG_SERVER_PORT"):
            server.start(cfg, timeout=5)
    assert not (tmp_path / "data").exists()


def test_missing_driver_names_the_pip_requirement(tmp_path, monkeypatch):
    from vitreg.deploy import config

    for module in (config, server):  # the config's checks and the start-up's both ask
        monkeypatch.setattr(module, "importable", lambda module: False)
    with pytest.raises(ServerError, match=r"pip install 'psycopg\[binary\]'"):
        ServerConfig(backend_store_uri="postgresql://u:p@127.0.0.1/db", data_dir=tmp_path)
    cfg = ServerConfig(artifacts_destination="s3://bucket/x", data_dir=tmp_path, port=free_port())
    with pytest.raises(ServerError, match="VITREG_ARTIFACTS_DESTINATION needs .*boto3"):
        server.start(cfg)


def test_wait_healthy_times_out_with_one_line():
    with pytest.raises(ServerError) as info:
        server.wait_healthy(f"http://127.0.0.1:{free_port()}/health", timeout=0.5)
    assert "did not answer OK within 0.5 s" in one_line(info.value)


# --------------------------------------------------------------------------- real servers

CLIENT = textwrap.dedent("""
    import json, os, sys, tempfile
    import mlflow
    experiment = mlflow.set_experiment(sys.argv[1])
    with mlflow.start_run(run_name="server-check") as run:
        mlflow.log_param("gpu", "cpu")
        mlflow.log_metric("infer_throughput_img_per_s", 123.0)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "hello.txt")
            with open(path, "w") as fh:
                fh.write("hello from the client")
            mlflow.log_artifact(path, artifact_path="check")
    print(json.dumps({"experiment_id": experiment.experiment_id, "run_id": run.info.run_id,
                      "artifact_uri": run.info.artifact_uri}))
""")


def log_run_via_client(url: str, cwd: Path, experiment: str, **extra_env: str) -> dict:
    """Log one run with an artifact from a fresh Python process, as a GPU box would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_URI=url, MLFLOW_DISABLE_TELEMETRY="true", **extra_env)
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", CLIENT, experiment], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def log_run_in_process(monkeypatch, url: str, cwd: Path, experiment: str, **extra_env: str) -> dict:
    """What :data:`CLIENT` does, in this process through MLflow's client: the server's URL (and credentials)
    in the environment, standing in ``cwd``, as a GPU box would (a process of its own would import MLflow
    again, ~3 s of CPU, to prove nothing more: the artifact goes through the server's proxy either way)."""
    import mlflow
    import mlflow.tracking._tracking_service.utils as tracking_utils
    from mlflow.tracking import MlflowClient

    for name, value in {"MLFLOW_TRACKING_URI": url, **extra_env}.items():
        monkeypatch.setenv(name, value)
    # this process's MLflow may hold an earlier test's store, which outranks the variable (and resolves the
    # run's mlflow-artifacts:/ URI): the server's for this test, the earlier one's again after
    monkeypatch.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)
    mlflow.set_tracking_uri(url)
    cwd.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    client = MlflowClient()
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    run = client.create_run(experiment_id, run_name="server-check")
    run_id = run.info.run_id
    client.log_param(run_id, "gpu", "cpu")
    client.log_metric(run_id, "infer_throughput_img_per_s", 123.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hello.txt")
        with open(path, "w") as fh:
            fh.write("hello from the client")
        client.log_artifact(run_id, path, artifact_path="check")
    client.set_terminated(run_id)
    return {"experiment_id": experiment_id, "run_id": run_id, "artifact_uri": run.info.artifact_uri}


def assert_artifact_on_server_disk(cfg: ServerConfig, info: dict, client_cwd: Path) -> None:
    assert info["artifact_uri"].startswith("mlflow-artifacts:/"), info
    stored = (Path(cfg.artifacts_destination) / info["experiment_id"] / info["run_id"]
              / "artifacts" / "check" / "hello.txt")
    assert stored.read_text() == "hello from the client"
    leftovers = sorted(p.name for p in client_cwd.iterdir())
    assert leftovers == [], f"the client wrote into its working directory: {leftovers}"


def get(url: str, **headers: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _postgres_unavailable() -> str | None:
    try:
        import psycopg as driver
    except ImportError:
        try:
            import psycopg2 as driver
        except ImportError:
            return "no driver (pip install 'psycopg[binary]'; tracking/ci_postgres.sh does it)"
    try:
        driver.connect(PG_URI, connect_timeout=3).close()
    except Exception as exc:  # noqa: BLE001 - any failure means "skip", with its reason
        return f"cannot connect to {PG_URI}: {' '.join(str(exc).split())[:200]}"
    return None


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's real servers (SQLite, basic auth, PostgreSQL when reachable), started at
    the same time: each needs ~8 s of mostly import time, so this saves ~15 s.

    Yields ``{name: (cfg, proc or the ServerError it raised, what the starts printed)}``; the
    servers are stopped after the module.
    """
    root = tmp_path_factory.mktemp("servers")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(("VITREG_", "MLFLOW_")):
                mp.delenv(name)
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        cfgs = {"sqlite": ServerConfig(port=free_port(), data_dir=premigrated(root / "sqlite"))}
        if importlib.util.find_spec("flask_wtf"):
            cfgs["auth"] = ServerConfig.from_env({
                "VITREG_SERVER_PORT": str(free_port()),
                "VITREG_SERVER_DATA": str(premigrated(root / "auth")),
                "VITREG_AUTH": "true",
                "MLFLOW_FLASK_SERVER_SECRET_KEY": SECRET_KEY,
                "VITREG_ADMIN_PASSWORD": ADMIN_PASSWORD,
            })
        if _postgres_unavailable() is None:
            cfgs["postgresql"] = ServerConfig(port=free_port(), data_dir=root / "postgresql",
                                              backend_store_uri=PG_URI)
        printed = io.StringIO()

        def _start(cfg):
            try:
                return server.start(cfg, timeout=120)
            except ServerError as exc:
                return exc

        with contextlib.redirect_stdout(printed):
            with concurrent.futures.ThreadPoolExecutor(len(cfgs)) as pool:
                results = dict(zip(cfgs, pool.map(_start, cfgs.values())))
        try:
            yield {name: (cfgs[name], results[name], printed.getvalue()) for name in cfgs}
        finally:
            for result in results.values():
                if not isinstance(result, ServerError):
                    server.stop(result)


def running_server(servers, name: str):
    if name not in servers:
        pytest.skip(f"{name} server not started")
    cfg, result, printed = servers[name]
    if isinstance(result, ServerError):
        raise result
    return cfg, result, printed


@pytest.mark.slow
def test_sqlite_server_stores_artifacts_under_destination(tmp_path, servers, monkeypatch):
    cfg, proc, printed = running_server(servers, "sqlite")
    assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{cfg.port}\n" in printed
    assert get(cfg.health_url) == (200, b"OK")

    client_cwd = tmp_path / "gpu-box"
    info = log_run_in_process(monkeypatch, cfg.url, client_cwd, "server-check")
    assert_artifact_on_server_disk(cfg, info, client_cwd)
    assert (cfg.data_dir / "mlflow.db").is_file()
    assert "Uvicorn running" in (cfg.data_dir / "server.log").read_text()

    assert server.stop(proc) is not None
    assert proc.poll() is not None
    with pytest.raises(ServerError):
        server.wait_healthy(cfg.health_url, timeout=0.3)


@pytest.mark.slow
def test_server_dying_at_start_shows_its_log(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "mlflow.db").write_bytes(b"this is not an SQLite database" * 100)
    cfg = ServerConfig(port=free_port(), data_dir=data)
    with pytest.raises(ServerError) as info:
        server.start(cfg, timeout=60)
    message = one_line(info.value)
    assert message.startswith("mlflow server exited with status")
    assert "not a database" in message and str(cfg.log_path) in message
    assert "not a database" in info.value.details
    assert "export MLFLOW_TRACKING_URI" not in capsys.readouterr().out


@pytest.mark.slow
def test_postgresql_backend(tmp_path, servers):
    reason = _postgres_unavailable()
    if reason:
        pytest.skip(f"PostgreSQL not available: {reason} (run tracking/ci_postgres.sh)")
    cfg, _, _ = running_server(servers, "postgresql")
    assert "--backend-store-uri" not in server.build_command(cfg)  # the URI holds a password
    client_cwd = tmp_path / "gpu-box"
    experiment = f"pg-check-{os.getpid()}-{tmp_path.name}"
    info = log_run_via_client(cfg.url, client_cwd, experiment)
    assert_artifact_on_server_disk(cfg, info, client_cwd)
    assert not (cfg.data_dir / "mlflow.db").exists()


@pytest.mark.slow
def test_basic_auth(tmp_path, servers, monkeypatch):
    pytest.importorskip("flask_wtf", reason="basic auth needs mlflow[auth] (Flask-WTF)")
    cfg, _, _ = running_server(servers, "auth")
    assert server.build_command(cfg)[-2:] == ["--app-name", "basic-auth"]
    ini = (cfg.data_dir / "basic_auth.ini").read_text()
    assert "admin_username = admin" in ini and "default_permission = READ" in ini
    assert ADMIN_PASSWORD not in ini
    assert oct((cfg.data_dir / "basic_auth.ini").stat().st_mode & 0o777) == "0o600"

    search = f"{cfg.url}/api/2.0/mlflow/experiments/search?max_results=5"
    assert get(cfg.health_url)[0] == 200  # /health stays open for probes
    assert get(search)[0] == 401

    def basic(user: str, password: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    assert get(search, Authorization=basic("admin", "wrong-password-123"))[0] == 401
    status, body = get(search, Authorization=basic("admin", ADMIN_PASSWORD))
    assert status == 200 and b"experiments" in body

    # What a GPU box does: the MLflow client with MLFLOW_TRACKING_USERNAME/PASSWORD.
    client_cwd = tmp_path / "gpu-box"
    info = log_run_in_process(monkeypatch, cfg.url, client_cwd, "auth-check", MLFLOW_TRACKING_USERNAME="admin",
                              MLFLOW_TRACKING_PASSWORD=ADMIN_PASSWORD)
    assert_artifact_on_server_disk(cfg, info, client_cwd)


def _vitreg_bench(url: str, cwd: Path, experiment: str, **extra_env: str) -> subprocess.CompletedProcess:
    """A real `vitreg bench` (tiny model, CPU) from a fresh process, as a GPU box would run it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_URI=url, MLFLOW_EXPERIMENT_NAME=experiment, MLFLOW_DISABLE_TELEMETRY="true",
               **extra_env)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "vitreg.cli", "bench", "--model", "test_vit", "--img-size", "32",
                           "--batch-size", "2", "--task", "infer", "--warmup", "1", "--steps", "2", "--repeats", "2"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_bench_run_with_credentials_lands_in_the_artifact_destination(tmp_path, servers):
    pytest.importorskip("flask_wtf", reason="basic auth needs mlflow[auth] (Flask-WTF)")
    cfg, _, _ = running_server(servers, "auth")
    refused = _vitreg_bench(cfg.url, tmp_path / "no-credentials", "auth-bench")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]  # one line naming the store, its password masked if any
    assert last.startswith("error: the tracking store at ") and "failed while starting the run" in last

    box = tmp_path / "gpu-box"
    proc = _vitreg_bench(cfg.url, box, "auth-bench", MLFLOW_TRACKING_USERNAME="admin",
                         MLFLOW_TRACKING_PASSWORD=ADMIN_PASSWORD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.split("logged run ")[1].split()[0]
    stored = list(Path(cfg.artifacts_destination).glob(f"*/{run_id}/artifacts/results.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["tasks"][0]["task"] == "infer"
    assert sorted(p.name for p in box.iterdir()) == [], "the bench wrote into the client's folder"
