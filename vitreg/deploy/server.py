"""Start and stop the team's MLflow tracking server (``python -m vitreg.deploy.server``).

The server is MLflow's own ``mlflow server``, run as a child process of this interpreter: this
module never imports mlflow (only ``vitreg/tracking/`` may). The ``VITREG_*`` variables (tracking/README.md
lists them) make a :class:`~vitreg.deploy.config.ServerConfig`, the config a command line
(:func:`build_command`), started with its output in ``<data>/server.log`` (:func:`start`) until ``GET /health``
answers ``OK`` (:func:`wait_healthy`), and stopped (:func:`stop`). Artifacts are always proxied
(``--serve-artifacts``): GPU boxes need no S3 credentials.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from vitreg.console import mask_console
from vitreg.deploy.config import (ARTIFACT_CLIENTS, ServerConfig, ServerError, driver_requirement, importable,
                                  is_local, local_path, public_fields, uri_scheme)
from vitreg.tracking.uris import has_credentials, redact

_LOG_TAIL_LINES = 15  # server log lines shown when start-up fails


def build_command(cfg: ServerConfig) -> list[str]:
    """The ``mlflow server`` command line for ``cfg``; a backend URI with a password travels in the child's
    environment instead (:func:`child_env`), so it never shows in ``ps``."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", cfg.host, "--port", str(cfg.port),
           "--workers", str(cfg.workers)]
    if not has_credentials(cfg.backend_store_uri):
        cmd += ["--backend-store-uri", cfg.backend_store_uri]
    cmd += ["--serve-artifacts", "--artifacts-destination", cfg.artifacts_destination]
    if cfg.allowed_hosts:
        cmd += ["--allowed-hosts", cfg.allowed_hosts]
    if cfg.auth:
        cmd += ["--app-name", "basic-auth"]
    return cmd


def child_env(cfg: ServerConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the ``mlflow server`` process."""
    env = dict(os.environ if base is None else base)
    # MLflow's job runner (GenAI scorers, trace rollups) is not used here and makes start-up
    # slower (~6 s with 1 worker without it); an explicit setting in the environment still wins.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    if has_credentials(cfg.backend_store_uri):
        env["MLFLOW_BACKEND_STORE_URI"] = cfg.backend_store_uri
    if cfg.auth:
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = cfg.secret_key
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(cfg.auth_config_path)
        env["MLFLOW_AUTH_ADMIN_USERNAME"] = cfg.admin_username
        # Only read when the admin user does not exist yet; kept out of the ini on disk.
        env["MLFLOW_AUTH_ADMIN_PASSWORD"] = cfg.admin_password
    return env


def _auth_ini(cfg: ServerConfig) -> str:
    return (
        "# Written by vitreg.deploy.server; MLflow reads it through MLFLOW_AUTH_CONFIG_PATH.\n"
        "# The admin password is not stored here: vitreg passes VITREG_ADMIN_PASSWORD to the\n"
        "# server as MLFLOW_AUTH_ADMIN_PASSWORD, used only the first time (to create the admin).\n"
        "[mlflow]\n"
        f"default_permission = {cfg.auth_default_permission}\n"
        f"database_uri = {cfg.auth_database_uri}\n"
        f"admin_username = {cfg.admin_username}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )


def _check_port_free(cfg: ServerConfig) -> None:
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    host = cfg.host.strip("[]")
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Same option uvicorn sets, so sockets in TIME_WAIT do not count as "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, cfg.port))
        except socket.gaierror:
            raise ServerError(f"VITREG_SERVER_HOST={cfg.host!r} does not resolve; use 127.0.0.1 or 0.0.0.0") from None
        except PermissionError:
            raise ServerError(f"port {cfg.port} needs root privileges; set VITREG_SERVER_PORT above 1023") from None
        except OSError as exc:
            raise ServerError(f"port {cfg.port} on {cfg.host} is already in use ({exc.strerror}); stop the other "
                              "server or set VITREG_SERVER_PORT to a free port") from None


def _check_requirements(cfg: ServerConfig) -> None:
    """Fail before launching when a Python package the configuration needs is missing."""
    needs: list[tuple[str, str, str]] = []
    for name, uri in (("VITREG_BACKEND_URI", cfg.backend_store_uri),
                      ("VITREG_AUTH_DATABASE_URI", cfg.auth_database_uri if cfg.auth else None)):
        req = driver_requirement(uri) if uri else None
        if req:
            needs.append((name, *req))
    client = ARTIFACT_CLIENTS.get(uri_scheme(cfg.artifacts_destination))
    if client:
        needs.append(("VITREG_ARTIFACTS_DESTINATION", *client))
    if cfg.auth:
        needs.append(("VITREG_AUTH", "flask_wtf", "mlflow[auth]"))
    for name, module, requirement in needs:
        if not importable(module):
            raise ServerError(f"{name} needs the Python package {requirement!r}; run "
                              f"{Path(sys.executable).name} -m pip install '{requirement}'")


def _prepare(cfg: ServerConfig) -> None:
    try:
        _make_folders(cfg)
    except OSError as exc:
        raise ServerError(f"cannot write {exc.filename or cfg.data_dir} ({exc.strerror or exc}); set "
                          "VITREG_SERVER_DATA (or VITREG_BACKEND_URI / VITREG_ARTIFACTS_DESTINATION) to a "
                          "writable place") from None


def _make_folders(cfg: ServerConfig) -> None:
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    for uri in (cfg.backend_store_uri, cfg.auth_database_uri if cfg.auth else None):
        if uri and uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
            Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    if is_local(cfg.artifacts_destination):
        local_path(cfg.artifacts_destination).mkdir(parents=True, exist_ok=True)
    if cfg.auth and "MLFLOW_AUTH_CONFIG_PATH" not in os.environ:
        path = cfg.auth_config_path
        # 0600 from the start: the auth database URI may hold a password.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(_auth_ini(cfg))
        path.chmod(0o600)


def _log_tail(path: Path, offset: int, lines: int = _LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.splitlines() if line.strip()][-lines:]


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:")


def _last_error(lines: list[str]) -> str:
    """The most telling log line: the last exception line, else an error line, else the last."""
    for pattern in (_EXCEPTION_LINE, re.compile(r"\b(ERROR|error:)")):
        for line in reversed(lines):
            if pattern.search(line.strip()):
                return line.strip()
    return lines[-1].strip() if lines else "no output"


def wait_healthy(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None,
                 interval: float = 0.25) -> None:
    """Poll ``GET url`` until it answers 200 ``OK``; :class:`ServerError` after ``timeout`` seconds, or once
    ``proc`` (the server, when given) has exited."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"the server exited with status {proc.returncode} before {url} answered")
        try:
            wait = max(0.5, min(5.0, deadline - time.monotonic()))
            with urllib.request.urlopen(url, timeout=wait) as resp:
                body = resp.read(64).decode("utf-8", "replace").strip()
                if resp.status == 200 and body == "OK":
                    return
                last = f"HTTP {resp.status} {body!r}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(getattr(exc, "reason", exc))
        if time.monotonic() >= deadline:
            raise ServerError(f"{url} did not answer OK within {timeout:g} s (last: {last}); "
                              "raise the timeout or check the server log")
        time.sleep(interval)


def start(cfg: ServerConfig, wait: bool = True, timeout: float = 60.0,
          quiet: bool = False) -> subprocess.Popen:
    """Start ``mlflow server`` for ``cfg`` in its own process group (:func:`stop` ends its workers too), its output
    appended to ``cfg.log_path``; with ``wait``, return once it is healthy (printing the URI unless ``quiet``)."""
    _check_requirements(cfg)
    _check_port_free(cfg)
    _prepare(cfg)
    cmd = build_command(cfg)
    with open(cfg.log_path, "ab") as log:
        offset = log.tell()
        shown = " ".join(redact(part) for part in cmd)
        log.write(f"=== vitreg.deploy.server {time.strftime('%Y-%m-%d %H:%M:%S')}: {shown}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(cfg), cwd=cfg.data_dir, start_new_session=True)
    if not wait:
        return proc
    try:
        wait_healthy(cfg.health_url, timeout, proc=proc)
    except ServerError as exc:
        died = proc.poll() is not None
        stop(proc)
        tail = _log_tail(cfg.log_path, offset)
        if died:
            raise ServerError(f"mlflow server exited with status {proc.returncode} during start-up: "
                              f"{_last_error(tail)} (fix that; full log: {cfg.log_path})",
                              details="\n".join(tail)) from None
        raise ServerError(f"{exc} ({cfg.log_path})", details="\n".join(tail)) from None
    except BaseException:  # Ctrl-C or SIGTERM while waiting: the server is in its own group
        stop(proc)
        raise
    if not quiet:
        print(f"export MLFLOW_TRACKING_URI={cfg.url}", flush=True)
    return proc


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """Stop a server from :func:`start`: SIGTERM to its process group, SIGKILL after ``timeout``."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(5)
    # The uvicorn workers share the group; make sure none outlives the supervisor.
    _signal_group(proc, signal.SIGKILL, quiet_only=True)
    return proc.returncode


def _signal_group(proc: subprocess.Popen, sig: int, quiet_only: bool = False) -> None:
    try:
        os.killpg(proc.pid, sig)  # start() made the server the leader of its own group
    except (ProcessLookupError, PermissionError):
        if not quiet_only:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)


def _describe(cfg: ServerConfig) -> str:
    lines = [f"{k} = {v}" for k, v in public_fields(cfg).items()]
    lines.append(" ".join(redact(part) for part in build_command(cfg)))
    if has_credentials(cfg.backend_store_uri):
        lines.append("(the backend store URI holds a password: it reaches the server as "
                     "MLFLOW_BACKEND_STORE_URI, not on the command line)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m vitreg.deploy.server``: run the server in the foreground until Ctrl-C / SIGTERM."""
    mask_console()  # the server's log tail and errors may quote the store's URI
    parser = argparse.ArgumentParser(prog="python -m vitreg.deploy.server", description="Run the vitreg MLflow "
                                     "tracking server, configured by VITREG_* variables (see tracking/README.md).")
    parser.add_argument("--dry-run", action="store_true", help="print the configuration and the mlflow command, "
                        "start nothing")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for /health (default 60)")
    args = parser.parse_args(argv)

    def _terminate(signum, _frame):
        raise KeyboardInterrupt

    try:
        cfg = ServerConfig.from_env()
        if args.dry_run:
            print(_describe(cfg))
            return 0
        if cfg._wildcard and not cfg.auth:
            print(f"warning: listening on {cfg.host} without authentication; anyone who can reach "
                  "this machine can read and write runs (set VITREG_AUTH=true)", file=sys.stderr)
        print(f"mlflow server on {cfg.host}:{cfg.port}, store {redact(cfg.backend_store_uri)}, "
              f"artifacts {cfg.artifacts_destination}, log {cfg.log_path}",
              file=sys.stderr, flush=True)
        # The server gets its own process group, so Ctrl-C reaches only this process: turn
        # SIGINT/SIGTERM/SIGHUP into a clean stop (set explicitly: a shell may start us with
        # SIGINT ignored). start() stops the server itself when interrupted while waiting.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _terminate)
        proc = start(cfg, wait=True, timeout=args.timeout)
    except ServerError as exc:
        if exc.details:
            print(exc.details, file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted; server stopped", file=sys.stderr)
        return 130

    print("Serving; Ctrl-C stops it.", file=sys.stderr, flush=True)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        stop(proc)
        print("server stopped", file=sys.stderr)
        return 0
    print("\n".join(_log_tail(cfg.log_path, 0, 5)), file=sys.stderr)
    print(f"error: mlflow server exited with status {code}; see {cfg.log_path}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
