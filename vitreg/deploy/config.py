"""The tracking server's configuration: ``VITREG_*`` variables -> a checked :class:`ServerConfig`.

Every check that needs no process runs here (URI schemes and drivers, ports, auth settings), so a bad
setting is one line before anything starts. :mod:`vitreg.deploy.server` runs the server from it.
The variables are listed in tracking/README.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from vitreg.config.parse import parse_bool, parse_int
from vitreg.errors import VitregError
from vitreg.tracking.uris import redact

# SQLAlchemy dialects MLflow's tracking store accepts (mlflow/store/db/db_types.py). For each
# driver: the module it imports and the pip requirement that provides it.
_DIALECTS = ("sqlite", "postgresql", "mysql", "mssql")
_DRIVERS = {
    "psycopg": ("psycopg", "psycopg[binary]"),
    "psycopg2": ("psycopg2", "psycopg2-binary"),
    "pymysql": ("pymysql", "PyMySQL"),
    "mysqldb": ("MySQLdb", "mysqlclient"),
    "pymssql": ("pymssql", "pymssql"),
    "pyodbc": ("pyodbc", "pyodbc"),
}
# A URI without "+driver" gets SQLAlchemy's default driver, which changed between releases
# (postgresql: psycopg2 up to SQLAlchemy 2.0, psycopg 3 from 2.1). vitreg names the driver
# that is installed instead, trying these in order.
_DEFAULT_DRIVERS = {
    "postgresql": ("psycopg", "psycopg2"),
    "mysql": ("pymysql", "mysqldb"),
    "mssql": ("pymssql", "pyodbc"),
}
ARTIFACT_CLIENTS = {
    "s3": ("boto3", "boto3"),
    "gs": ("google.cloud.storage", "google-cloud-storage"),
    "wasbs": ("azure.storage.blob", "azure-storage-blob azure-identity"),
}
_PERMISSIONS = ("READ", "USE", "EDIT", "MANAGE", "NO_PERMISSIONS")


class ServerError(VitregError):
    """The server cannot be configured or started; ``details``: more lines for a terminal (the log's tail)."""

    def __init__(self, message: str, details: str | None = None):
        super().__init__(message)
        self.details = details


def uri_scheme(uri: str) -> str:
    return uri.split(":", 1)[0].lower() if ":" in uri else ""


def _check_backend_uri(uri: str, name: str = "VITREG_BACKEND_URI") -> str:
    """Validate a database URI (from variable ``name``): a relative SQLite path made absolute (the server runs in
    the data folder), the installed driver spelt out where the URI names none (``postgresql+psycopg://``)."""
    scheme = uri_scheme(uri)
    dialect, _, driver = scheme.partition("+")
    if dialect == "postgres":
        raise ServerError(f"{name} scheme '{scheme}' is not understood by SQLAlchemy; "
                          "write postgresql://user:password@host:5432/db")
    if dialect not in _DIALECTS or "://" not in uri:
        raise ServerError(f"{name} scheme '{scheme or uri}' is not supported; use sqlite:////absolute/path/mlflow.db "
                          "or postgresql://user:password@host:5432/db (mysql:// and mssql:// also work)")
    if driver and driver not in _DRIVERS:
        raise ServerError(f"{name} driver '{driver}' is unknown; use one of {', '.join(sorted(_DRIVERS))} or leave it out")
    if dialect == "sqlite":
        if not uri.startswith("sqlite:///"):
            raise ServerError(f"{name} for SQLite needs three slashes: sqlite:///path/mlflow.db")
        path = uri[len("sqlite:///"):]
        if path and path != ":memory:" and not path.startswith("/"):
            uri = "sqlite:///" + str(Path(path).resolve())
        return uri
    if not driver:
        candidates = _DEFAULT_DRIVERS[dialect]
        installed = [d for d in candidates if importable(_DRIVERS[d][0])]
        if not installed:
            raise ServerError(f"{name} ({dialect}) needs a database driver; run "
                              f"{Path(sys.executable).name} -m pip install '{_DRIVERS[candidates[0]][1]}'")
        uri = f"{dialect}+{installed[0]}" + uri[len(scheme):]
    return uri


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def driver_requirement(uri: str) -> tuple[str, str] | None:
    driver = uri_scheme(uri).partition("+")[2]
    return _DRIVERS.get(driver)


def is_local(dest: str) -> bool:
    scheme = uri_scheme(dest)
    # A one-letter "scheme" is a Windows drive letter, not a URI.
    return scheme in ("", "file") or len(scheme) == 1


def local_path(dest: str) -> Path:
    if dest.startswith("file://"):
        return Path(urllib.parse.urlsplit(dest).path)
    return Path(dest)


#: The variable each field is read from (:meth:`ServerConfig.from_env`); unset or blank: the field's default
_VARIABLES = {"host": "VITREG_SERVER_HOST", "port": "VITREG_SERVER_PORT", "workers": "VITREG_SERVER_WORKERS",
              "data_dir": "VITREG_SERVER_DATA", "backend_store_uri": "VITREG_BACKEND_URI",
              "artifacts_destination": "VITREG_ARTIFACTS_DESTINATION", "allowed_hosts": "VITREG_ALLOWED_HOSTS",
              "auth": "VITREG_AUTH", "admin_username": "VITREG_ADMIN_USERNAME",
              "auth_default_permission": "VITREG_AUTH_DEFAULT_PERMISSION",
              "auth_database_uri": "VITREG_AUTH_DATABASE_URI"}
#: ... taken verbatim, not stripped: leading and trailing spaces are part of a password
_SECRETS = {"admin_password": "VITREG_ADMIN_PASSWORD", "secret_key": "MLFLOW_FLASK_SERVER_SECRET_KEY"}


@dataclass(frozen=True)
class ServerConfig:
    """Everything needed to run one tracking server (:meth:`from_env`); the store and artifacts default to a SQLite
    file and a folder in ``data_dir``, and the secrets stay out of ``repr``."""

    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 1
    data_dir: Path = Path("vitreg-data")
    backend_store_uri: str | None = None
    artifacts_destination: str | None = None
    allowed_hosts: str | None = None
    auth: bool = False
    admin_username: str = "admin"
    admin_password: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    auth_default_permission: str = "READ"
    auth_database_uri: str | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("port", parse_int(self.port, "VITREG_SERVER_PORT", 1, 65535, error=ServerError))
        set_("workers", parse_int(self.workers, "VITREG_SERVER_WORKERS", 1, 64, error=ServerError))
        set_("auth", parse_bool(self.auth, "VITREG_AUTH", error=ServerError))
        if not self.host or any(c.isspace() for c in self.host):
            raise ServerError(f"VITREG_SERVER_HOST={self.host!r} is not a host; use 127.0.0.1 or 0.0.0.0")
        data_dir = Path(self.data_dir).expanduser().resolve()
        set_("data_dir", data_dir)
        backend = self.backend_store_uri or f"sqlite:///{data_dir / 'mlflow.db'}"
        set_("backend_store_uri", _check_backend_uri(backend))
        dest = self.artifacts_destination or str(data_dir / "artifacts")
        if is_local(dest):
            dest = str(local_path(dest).expanduser().resolve())
        set_("artifacts_destination", dest)
        if self.allowed_hosts is not None and not self.allowed_hosts.strip():
            set_("allowed_hosts", None)
        if self.auth:
            self._check_auth()

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in public_fields(self).items())
        return f"ServerConfig({shown})"

    def _check_auth(self):
        if not self.secret_key:
            raise ServerError("VITREG_AUTH=true needs MLFLOW_FLASK_SERVER_SECRET_KEY; export it with a long random "
                              "value, e.g. $(python -c 'import secrets; print(secrets.token_hex(32))')")
        if not self.admin_password:
            raise ServerError("VITREG_AUTH=true needs VITREG_ADMIN_PASSWORD (12+ characters) for the admin user; "
                              "there is no default password")
        if len(self.admin_password) < 12 or self.admin_password == "password1234":
            raise ServerError("VITREG_ADMIN_PASSWORD must have 12+ characters and not be MLflow's old default "
                              "'password1234'; choose another")
        if not self.admin_username or not self.admin_username.strip():
            raise ServerError("VITREG_ADMIN_USERNAME is empty; leave it unset (admin) or name the admin user")
        permission = self.auth_default_permission.strip().upper()
        if permission not in _PERMISSIONS:
            raise ServerError(f"VITREG_AUTH_DEFAULT_PERMISSION={self.auth_default_permission!r} is unknown; "
                              f"use one of {', '.join(_PERMISSIONS)}")
        object.__setattr__(self, "auth_default_permission", permission)
        auth_db = self.auth_database_uri or f"sqlite:///{self.data_dir / 'basic_auth.db'}"
        object.__setattr__(self, "auth_database_uri", _check_backend_uri(auth_db, "VITREG_AUTH_DATABASE_URI"))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "ServerConfig":
        """Read the ``VITREG_*`` variables (:data:`_VARIABLES`, :data:`_SECRETS`); raise :class:`ServerError`."""
        env = os.environ if environ is None else environ
        given = {name: (env.get(variable) or "").strip() for name, variable in _VARIABLES.items()}
        given.update({name: env.get(variable) for name, variable in _SECRETS.items()})
        return cls(**{name: value for name, value in given.items() if value})

    @property
    def _wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::", "[::]")

    @property
    def url(self) -> str:
        """What clients put in ``MLFLOW_TRACKING_URI`` (this machine's name for a wildcard bind)."""
        host = socket.gethostname() if self._wildcard else self.host
        return f"http://{_bracket(host)}:{self.port}"

    @property
    def health_url(self) -> str:
        host = ("::1" if ":" in self.host else "127.0.0.1") if self._wildcard else self.host
        return f"http://{_bracket(host)}:{self.port}/health"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    @property
    def auth_config_path(self) -> Path:
        """The basic-auth ini; an ``MLFLOW_AUTH_CONFIG_PATH`` already in the environment wins."""
        given = os.environ.get("MLFLOW_AUTH_CONFIG_PATH")
        return Path(given) if given else self.data_dir / "basic_auth.ini"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def public_fields(cfg: ServerConfig) -> dict:
    """The config's fields without secrets, passwords in URIs masked."""
    rows = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.repr}
    rows["backend_store_uri"] = redact(cfg.backend_store_uri)
    if cfg.auth_database_uri:
        rows["auth_database_uri"] = redact(cfg.auth_database_uri)
    return rows
