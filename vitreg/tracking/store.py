"""The tracking store as this process reaches it: made ready once (:func:`prepare_store`), asked within bounded
time (:func:`short_http_requests`), its failures told in one masked line naming it (:func:`store_fault`),
MLflow's own prints off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.abc
import os
import re
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from vitreg import errors
from vitreg.config.parse import parse_float
from vitreg.console import progress
from vitreg.errors import StoreError, VitregError
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.uris import absolute_uri, current_uri, redact, scrub, without_credentials

_BUSY = re.compile(r"database is locked|database is busy|SQLITE_BUSY", re.IGNORECASE)
_CORRUPT = re.compile(r"database disk image is malformed|malformed database schema|"
                      r"database or disk is full|unsupported file format", re.IGNORECASE)
_CANNOT_OPEN = re.compile(r"readonly database|read-only file system|unable to open database file", re.IGNORECASE)
_REFUSED = re.compile(r"connection refused|could not connect|Can't connect to|Name or service not known|"
                      r"could not translate host name", re.IGNORECASE)
_NOT_HTTP = re.compile(r"BadStatusLine|RemoteDisconnected|Connection aborted|InvalidChunkLength|"
                       r"ProtocolError", re.IGNORECASE)
#: MLflow's answers to a request it understood and refused (from a server or a local store alike); not
#: ENDPOINT_NOT_FOUND, also a 404, which a URI pointing at something that is no MLflow server gets
_REFUSED_REQUEST = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS"}
#: MLflow's SQL store tries to build its engine 10 times (~100 s against a database that is down) and reads no
#: setting for it: a CLI command tries twice (a sqlite file held locked costs sqlite's 5 s busy timeout each)
SQL_ENGINE_ATTEMPTS = 2
#: libpq's wait for a PostgreSQL that takes the TCP connection and then says nothing: psycopg's default is 130 s
#: for each engine attempt; the user's PGCONNECT_TIMEOUT or ``?connect_timeout=`` win.
SQL_CONNECT_TIMEOUT_S = 5
PROGRESS_BAR_VARIABLE = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
RUN_LINKS_VARIABLE = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"

_short_http_users = 0  # trackers and syncs inside short_http_requests(); the last one out restores
_short_http_lock = threading.Lock()
_saved_http_settings: dict[str, str | None] = {}


# --------------------------------------------------------------------------- a local sqlite store, made once


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


def artifact_root(uri: str) -> Path | None:
    """Where the experiments of the sqlite store at ``uri`` keep their artifacts: ``mlruns`` beside ``mlflow.db``,
    ``<name>-mlruns`` beside any other ``<name>.db`` (MLflow's ``./mlruns`` of the current folder let two stores
    share ``./mlruns/1/``). None for other stores."""
    path = sqlite_path(uri)
    if path is None:
        return None
    path = Path(os.path.abspath(path))  # abspath, not resolve(): the folder as named, "..", not links, resolved
    return path.with_name("mlruns" if path.name == "mlflow.db" else f"{path.stem}-mlruns")


def store_with_root(uri: str):
    """MLflow's sqlite store for ``uri`` with :func:`artifact_root` as its root (its client offers only ``./mlruns``);
    on a new file it makes the schema and the Default experiment."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    return SqlAlchemyStore(uri, str(artifact_root(uri)))


@functools.lru_cache(maxsize=32)
def _cached_store_with_root(absolute: str):
    return store_with_root(absolute)


def create_experiment(client, name: str) -> str:
    """Create experiment ``name`` and return its id; a sqlite store's under :func:`artifact_root`."""
    if artifact_root(client.tracking_uri) is None:
        return client.create_experiment(name)
    # by absolute URI: a relative path names another file once the process changes folder
    return _cached_store_with_root(absolute_uri(client.tracking_uri)).create_experiment(name)


def ui_command(uri: str) -> str:
    """The command that opens the MLflow UI on the store at ``uri``: ``make ui`` in the checkout, else ``mlflow ui``."""
    store = absolute_uri(uri)
    makefile = Path("Makefile")
    in_checkout = makefile.is_file() and re.search(r"^ui:", makefile.read_text(errors="replace"), re.M) is not None
    if not in_checkout:
        return f"mlflow ui --backend-store-uri {store}"
    if sqlite_path(store) == Path(os.path.abspath("mlflow.db")):
        return "make ui"
    return f"make ui UI_STORE={store}"


def prepare_store(uri: str) -> None:
    """Create (or open) the sqlite store at ``uri`` under a file lock beside it; nothing for other stores.
    MLflow migrates a fresh schema in every process that opens it, unlocked: processes starting together on a
    new file raced (``_alembic_tmp_tags already exists``) and could break it. A store another process holds
    locked is waited for, then called busy."""
    quiet_mlflow_info()  # every run opens its store here, the CLI's and the Python API's alike
    path = sqlite_path(uri)
    if path is None:
        return
    check_sqlite_uri(uri)
    deadline, pause, said = time.monotonic() + busy_wait_s(), 0.2, False
    while True:
        try:
            _build(uri, path)
            return
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - sqlalchemy/alembic errors: name the file, not a server
            if not _BUSY.search(str(exc)):
                raise store_fault(exc, uri) from None
            if time.monotonic() + pause > deadline:
                raise StoreError(f"the tracking store {path} is busy: another process held it locked for "
                                 f"{busy_wait_s():g} s (VITREG_STORE_BUSY_S); try again once it is done") from None
        if not said:
            progress(f"the tracking store {path} is locked by another process: waiting up to {busy_wait_s():g} s")
            said = True
        time.sleep(pause)  # a back-off between attempts on a lock another process holds
        pause = min(pause * 2, 2.0)


def check_sqlite_uri(uri: str) -> None:
    """Refuse a sqlite URI that names a folder (``sqlite:///``: a typo, not a store), or a fragment, which sqlite
    keeps in the name of the file it creates (``#token=...``: a secret left on disk)."""
    path = sqlite_path(uri)
    if path is None:
        return
    if "#" in uri:
        raise VitregError(f"MLFLOW_TRACKING_URI={redact(uri)} has a fragment (#...), which sqlite would make part "
                          f"of the database file's name: remove it (a sqlite store takes no credentials)")
    if path.name in ("", "..") or path.is_dir():
        raise VitregError(f"MLFLOW_TRACKING_URI={redact(uri)} names the folder {os.path.abspath(path)}, not a "
                          f"database file: use sqlite:///PATH/mlflow.db")


def _build(uri: str, path: Path) -> None:
    lock = path.with_name(path.name + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if not path.exists() or path.stat().st_size == 0:
                store_with_root(uri)  # creates the schema and the Default experiment, its artifacts in the root
                progress(new_store_line(uri))
            mlflow.MlflowClient(tracking_uri=uri)  # builds MLflow's cached store: migrates an older schema
    except IsADirectoryError:
        raise StoreError(f"the lock file {lock} beside the tracking store {path} is a folder: remove that folder "
                         f"(vitreg makes a file there to let one process at a time prepare the store)") from None
    except OSError as exc:
        raise StoreError(_local_reason(path, exc.strerror or str(exc)) or
                         f"the tracking store {path} cannot be created ({exc.strerror or exc}): "
                         f"set MLFLOW_TRACKING_URI to a writable place") from None


def new_store_line(uri: str) -> str:
    line = f"created a new tracking store {os.path.abspath(sqlite_path(uri))} (artifacts in {artifact_root(uri)}/)"
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        line += ": MLflow's default in the current folder, as MLFLOW_TRACKING_URI is not set"
    return line


def _local_reason(path: Path, reason: str) -> str | None:
    """Why the sqlite file ``path`` cannot be opened, from what is on disk; None when the disk shows nothing wrong."""
    folder = path.parent
    if not folder.is_dir():
        return (f"the folder {folder} of the tracking store {path} does not exist or is not a folder ({reason}): "
                f"fix the path in MLFLOW_TRACKING_URI")
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return (f"the tracking store {path} is on a read-only file system ({reason}): sqlite writes beside the "
                f"store even to read it; copy the store to a writable place and point MLFLOW_TRACKING_URI at "
                f"the copy, or mount that file system read-write")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return (f"the tracking store {path} cannot be read and written by this user ({reason}): fix its "
                f"permissions (chown/chmod), or run as its owner")
    if not os.access(folder, os.W_OK | os.X_OK):
        return (f"the folder {folder} of the tracking store {path} is read-only for this user ({reason}): "
                f"sqlite writes its journal beside the store; make that folder writable, or copy the store to "
                f"one that is and point MLFLOW_TRACKING_URI at the copy")
    return None


def store_fault(exc: BaseException, uri: str, doing: str = "") -> VitregError:
    """The one line for a failure of the tracking store at ``uri``, with the advice for its cause; a request the
    store refused is no store failure: a plain :class:`VitregError`."""
    text, reason = str(exc), first_line(exc)
    path = sqlite_path(uri)
    where = f"the tracking store {path}" if path else f"the tracking store at {redact(uri)}"
    while_doing = f" while {doing}" if doing else ""
    # the store answered a bad request (an invalid value, no such run or path): the value is wrong, not the store
    if isinstance(exc, mlflow.exceptions.MlflowException) and exc.error_code in _REFUSED_REQUEST:
        return VitregError(f"{where} refused the request{while_doing} ({reason}): the store is fine, the value "
                           f"given is not; check it (a run id, an artifact path, a name)")
    if _BUSY.search(text):
        return StoreError(f"{where} is busy{while_doing}: another process holds it locked; try again once it "
                          f"is done (a sqlite store takes one writer at a time)")
    if path and _CORRUPT.search(text):
        return StoreError(f"{where} is damaged ({reason}): restore it from a backup, or move it away (a new "
                          f"one is created; the runs in it are lost) or point MLFLOW_TRACKING_URI elsewhere")
    if path and _CANNOT_OPEN.search(text):
        return StoreError(_local_reason(path, reason) or f"{where} cannot be opened ({reason}): check its file "
                                                         f"and folder, or MLFLOW_TRACKING_URI")
    if path and _opens(path):  # "move it away" only for a store that does not open, never from a failed call
        return StoreError(f"{where} opens as an MLflow store, but failed{while_doing} ({reason}): check what "
                          f"was asked of it, or MLFLOW_TRACKING_URI")
    if path:
        return StoreError(f"{where} is not a usable MLflow database ({reason}): move it away (a new one is "
                          f"created) or point MLFLOW_TRACKING_URI elsewhere")
    if _NOT_HTTP.search(f"{type(exc).__name__} {text}"):
        # what was said instead of HTTP (an SSH banner), not urllib3's paragraph around it
        said = re.search(r"(BadStatusLine|RemoteDisconnected)\(['\"]?([^'\")\\]*)", text)
        reason = f"{said.group(1)}: {said.group(2).strip()}" if said else reason
        return StoreError(f"{where} answers{while_doing}, but not as an MLflow server speaks ({reason}): is "
                          f"MLFLOW_TRACKING_URI the server's address and port?")
    if _REFUSED.search(text):
        return StoreError(f"{where} does not answer{while_doing} ({reason}): start it, or fix "
                          f"MLFLOW_TRACKING_URI")
    return StoreError(f"{where} failed{while_doing} ({reason}): check that it is up and answers, or "
                      f"MLFLOW_TRACKING_URI")


def _opens(path: Path) -> bool:
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)) as db:
            names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except (sqlite3.Error, OSError, ValueError):
        return False
    return {"runs", "experiments", "alembic_version"} <= names


def busy_wait_s() -> float:
    return parse_float(os.environ.get("VITREG_STORE_BUSY_S") or 30, "VITREG_STORE_BUSY_S", minimum=0)


# --------------------------------------------------------------------------- requests within bounded time


DEFAULT_HTTP_TIMEOUT_S = 10


def http_timeout_s() -> int:
    return int(parse_float(os.environ.get("VITREG_HTTP_TIMEOUT_S") or DEFAULT_HTTP_TIMEOUT_S, "VITREG_HTTP_TIMEOUT_S",
                           minimum=1))


@contextlib.contextmanager
def short_http_requests():
    """While inside, MLflow HTTP requests of this process make one attempt of at most ``http_timeout_s()``: the
    caller owns the back-off. MLflow reads these variables at every request and has no per-client setting, so
    they are set for the whole process while any user is inside, and restored when the last one leaves."""
    global _short_http_users
    with _short_http_lock:
        settings = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(http_timeout_s())}
        if _short_http_users == 0:
            _saved_http_settings.update({name: os.environ.get(name) for name in settings})
        # set at every entry: a change while another user was inside must not give this one MLflow's retries
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
    """Every MLflow HTTP request of this CLI command ends within bounded time: two retries a second apart, not
    MLflow's seven with doubling back-off (90-200 s against a 503). The user's own settings win."""
    try:
        timeout = http_timeout_s()
    except VitregError:  # the CLI's group calls this before any one-line handler: the command says it
        timeout = DEFAULT_HTTP_TIMEOUT_S  # (check_settings, short_http_requests) as the option it is
    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"), ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                        ("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0.5"),
                        ("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout))):
        os.environ.setdefault(name, value)
    bound_sql_engine_attempts()


class _SqlEngineAttempts(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Bounds ``mlflow.store.db.utils`` when MLflow imports it: a module that costs seconds to import
    (sqlalchemy), which only a process that opens a SQL store needs."""

    name = "mlflow.store.db.utils"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(fullname, path, target)
            if spec is not None:
                self._loader, spec.loader = spec.loader, self
                return spec
        return None

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _bound(module)


def _bound(module) -> None:
    import logging

    module.MAX_RETRY_COUNT = min(module.MAX_RETRY_COUNT, SQL_ENGINE_ATTEMPTS)
    # each failed attempt is a multi-line WARNING; the command's one error line says what failed
    logging.getLogger(module.__name__).addFilter(
        lambda record: not record.getMessage().startswith("SQLAlchemy engine could not be created"))


def bound_sql_engine_attempts() -> None:
    """A SQL store that is down, or takes the connection and never answers, costs a CLI command seconds."""
    os.environ.setdefault("PGCONNECT_TIMEOUT", str(SQL_CONNECT_TIMEOUT_S))
    module = sys.modules.get(_SqlEngineAttempts.name)
    if module is not None:
        _bound(module)
    elif not any(isinstance(finder, _SqlEngineAttempts) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SqlEngineAttempts())


# --------------------------------------------------------------------------- failures in one line


@contextlib.contextmanager
def store_errors(uri: str, doing: str):
    try:
        yield
    except VitregError:
        raise  # already one line naming the fix
    except Exception as exc:  # noqa: BLE001 - MlflowException, requests/urllib3 errors, sqlalchemy errors
        raise store_fault(exc, uri, doing) from None


#: where the exceptions a tracking store raises come from: MLflow, its HTTP stack, its SQL stack and drivers
STORE_LIBRARIES = {"mlflow", "requests", "urllib3", "http", "sqlalchemy", "sqlite3", "alembic", "psycopg",
                   "psycopg2", "pymysql", "MySQLdb"}


def store_error_for(exc: BaseException) -> VitregError | None:
    """The one line for an MLflow, HTTP or SQL error that reached the CLI unconverted; None for another."""
    names = {cls.__module__.split(".")[0] for cls in type(exc).__mro__}
    if not names & STORE_LIBRARIES:
        return None
    return store_fault(exc, mlflow.get_tracking_uri())


def first_line(exc: BaseException) -> str:
    """The reason in a few words (MLflow wraps urllib3's in a paragraph naming the URL and the pool), masked."""
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


# --------------------------------------------------------------------------- MLflow's own prints


def quiet_artifact_downloads() -> None:
    """No MLflow tqdm bars between vitreg's progress lines unless asked for; never MLflow's run links."""
    os.environ.setdefault(PROGRESS_BAR_VARIABLE, "false")
    quiet_run_links()


def quiet_run_links() -> None:
    """No "View run ... at" line from MLflow (it would print the URI's credentials): vitreg prints the link."""
    os.environ[RUN_LINKS_VARIABLE] = "true"


#: the loggers of MLflow's INFO lines a successful run does not need (the system-metrics monitor's start and
#: stop, "Creating initial MLflow database tables")
QUIET_MLFLOW_LOGGERS = ("mlflow.system_metrics", "mlflow.store.db.utils")


def quiet_mlflow_info() -> None:
    import logging

    if os.environ.get("MLFLOW_LOGGING_LEVEL", "").upper() in ("DEBUG", "INFO"):
        return
    for name in QUIET_MLFLOW_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def check_server(timeout: float = 5.0, uri: str | None = None) -> None:
    """Fail fast, in one line, when the tracking URI (``uri``, else MLflow's) is a server that does not answer
    (MLflow's client retries for minutes), or a sqlite URI that names no database file."""
    uri = current_uri() if uri is None else uri  # mlflow is not imported for it: a dead server is said sooner
    check_sqlite_uri(uri)
    check_sql_server(uri, timeout)
    if not uri.lower().startswith(("http://", "https://")):  # a scheme is any case: HTTP:// is a server too
        return
    import http.client
    import urllib.error
    import urllib.request

    base, headers = without_credentials(uri)
    try:
        with urllib.request.urlopen(urllib.request.Request(base.rstrip("/") + "/health", headers=headers),
                                    timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError:
        return  # it answers (an auth wall answers 401): the server is there
    except http.client.HTTPException as exc:  # something answers there, not in HTTP (an SSH banner)
        raise StoreError(f"the tracking URI {redact(uri)} answers, but not as an MLflow server speaks "
                         f"({type(exc).__name__}: {first_line(exc)}): is MLFLOW_TRACKING_URI the server's address "
                         f"and port?") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StoreError(f"the MLflow tracking server at {redact(uri)} does not answer ({reason}): start it with "
                         f"`make server`, or log offline (--offline true, -P offline=true or VITREG_OFFLINE=1: the "
                         f"run waits in the local spool for `vitreg sync`), or fix/unset MLFLOW_TRACKING_URI") \
            from None


#: the SQL stores whose URI's host is reached over TCP (``dialect+driver://``), each with its default port; not
#: SQL Server (``mssql+pyodbc://user:pw@DSN`` names an ODBC data source, not a host)
SQL_SERVER_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mariadb": 3306}


def check_sql_server(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, in one line, when the tracking URI is a SQL server (PostgreSQL, MySQL) whose host does not take
    a TCP connection: before mlflow, SQLAlchemy and the driver are imported (~3 s of CPU) and MLflow's engine
    attempts. A URI with no TCP host (a local socket: no host, ``?host=``, ``?unix_socket=``, MySQL's
    ``localhost``) is left to the driver; a port that is no number (``host1:5432,host2:5432``) is refused."""
    parts = urllib.parse.urlsplit(uri)
    dialect = parts.scheme.partition("+")[0].lower()
    default = SQL_SERVER_PORTS.get(dialect)
    query = {key.lower() for key in urllib.parse.parse_qs(parts.query, keep_blank_values=True)}
    if default is None or not parts.hostname or query & {"host", "unix_socket"}:
        return
    if default == 3306 and parts.hostname == "localhost":  # MySQL's client takes "localhost" for its local socket
        return
    try:
        port = parts.port or default
    except ValueError:  # MLflow's URI parsing raised it as a traceback
        raise VitregError(f"the tracking URI {redact(uri)} has a port that is not a number: write "
                          f"{dialect}://user:password@host:{default}/db (several hosts go in the query: "
                          f"?host=host1:{default}&host=host2:{default})") from None
    import socket

    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as exc:
        reason = "no answer in %g s" % timeout if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise StoreError(f"the tracking store at {redact(uri)} does not answer ({reason}): start it, or fix "
                         f"MLFLOW_TRACKING_URI") from None
