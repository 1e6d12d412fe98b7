"""A local sqlite tracking store, made ready once even when several processes start on it together.

MLflow's tracking store creates and migrates a fresh sqlite schema in every process that opens it, with
no lock: processes that start together on a new ``mlflow.db`` race in the migration (``_alembic_tmp_tags
already exists``) and can leave the file broken for every later client. :func:`prepare_store` takes an
exclusive lock beside the database file while this process builds its store (migrating it if needed);
MLflow caches that store per URI, so later calls in the process reuse it without migrating again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from pathlib import Path

from vitreg.config.parse import parse_float
from vitreg.console import progress
from vitreg.errors import StoreError
from vitreg.tracking.delivery import first_line
from vitreg.tracking.mlflow_on_first_use import mlflow

_BUSY = re.compile(r"database is locked|database is busy|SQLITE_BUSY", re.IGNORECASE)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store, or an in-memory one)."""
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        yield


def prepare_store(uri: str) -> None:
    """Create (or open) the sqlite store at ``uri`` under a file lock; nothing for other stores.

    Raises :class:`StoreError`, naming the file, when it cannot be created or is not a usable store. A store
    another process holds locked (sqlite's "database is locked") is waited for, then called busy: it is
    not broken, and moving it away would lose its runs.
    """
    path = sqlite_path(uri)
    if path is None:
        return
    deadline, pause, said = time.monotonic() + busy_wait_s(), 0.2, False
    while True:
        try:
            _build(uri, path)
            return
        except Exception as exc:  # noqa: BLE001 - sqlalchemy/alembic errors: name the file, not a server
            if not _BUSY.search(str(exc)):
                raise StoreError(f"the tracking store {path} is not a usable MLflow database ({first_line(exc)}): "
                                 f"move it away (a new one is created) or point MLFLOW_TRACKING_URI "
                                 f"elsewhere") from None
            if time.monotonic() + pause > deadline:
                raise StoreError(f"the tracking store {path} is busy: another process held it locked for "
                                 f"{busy_wait_s():g} s (VITREG_STORE_BUSY_S); try again once it is done") from None
        if not said:
            progress(f"the tracking store {path} is locked by another process: waiting up to {busy_wait_s():g} s")
            said = True
        time.sleep(pause)  # a back-off between attempts on a lock another process holds
        pause = min(pause * 2, 2.0)


def _build(uri: str, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_name(path.name + ".lock")):
            mlflow.MlflowClient(tracking_uri=uri)  # builds the store: creates and migrates the schema if it is new
    except OSError as exc:
        raise StoreError(f"the tracking store {path} cannot be created ({exc.strerror or exc}): "
                         f"set MLFLOW_TRACKING_URI to a writable place") from None


def busy_wait_s() -> float:
    """``VITREG_STORE_BUSY_S`` (default 30): how long a locked sqlite store is waited for before "busy"."""
    return parse_float(os.environ.get("VITREG_STORE_BUSY_S") or 30, "VITREG_STORE_BUSY_S", minimum=0)
