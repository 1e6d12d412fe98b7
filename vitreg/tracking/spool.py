"""A durable local journal of one run: everything it logs, written before any of it goes to a server.

A spool is a folder ``<root>/<spool id>/`` holding

- ``journal.jsonl``: one JSON record a line, each with a sequence number ``seq`` (0, 1, 2, ...):
  ``run`` (seq 0: experiment, run name, start time, the server's run id when known), ``params``,
  ``tags``, ``metrics`` (``[key, value, timestamp_ms, step]`` points), ``artifact`` (a file or folder
  copied into ``artifacts/<seq>/``), ``delete`` (an artifact path of the run to remove: a checkpoint
  beyond ``keep_checkpoints``) and ``end`` (final status and end time);
- ``lock``: held (``flock``) by the one process that writes or delivers this spool.

Appending is a local write and flush (no network, no fsync); :meth:`Spool.fsync` makes the journal
durable and is called at batch boundaries (before each delivery attempt and at the end). A line torn by
a crash is the last one and is ignored on reading. Delivery (live, or later with ``vitreg sync``) sends
records in order; the server run's ``vitreg_spool_seq.<spool id>`` tag says how far it got (see
:mod:`vitreg.tracking.delivery`). A fully delivered spool is removed. What a tag, metric or dict artifact
may hold on its way to MLflow (:func:`clean_tags`, :func:`clean_metrics`, :func:`dict_text`) is said here
once, for every tracker.

Settings (environment): ``VITREG_SPOOL_DIR`` (the root; default ``$XDG_DATA_HOME/vitreg/spool``, i.e.
``~/.local/share/vitreg/spool``), ``VITREG_OFFLINE`` (true: write the spool only, deliver later),
``VITREG_FLUSH_TIMEOUT_S`` (how long a finished run waits for delivery; default 30).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

from vitreg.config.parse import parse_bool, parse_float
from vitreg.errors import VitregError
from vitreg.tracking.uris import has_credentials, scrub

JOURNAL = "journal.jsonl"
DEFAULT_FLUSH_TIMEOUT_S = 30.0

# MLflow's log_batch limits are 1000 metrics, 100 params and 100 tags a call; a record never holds more
# than one call may take, leaving two tags for delivery's own (sequence number, heartbeat).
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 98


def spool_root(env: dict | None = None) -> Path:
    """Where spools live: ``$VITREG_SPOOL_DIR``, else the user's data dir (``~/.local/share/vitreg/spool``)."""
    env = os.environ if env is None else env
    if env.get("VITREG_SPOOL_DIR"):
        return Path(env["VITREG_SPOOL_DIR"]).expanduser()
    data_home = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "vitreg" / "spool"


def offline_mode(value=None) -> bool:
    """``offline=true`` (the option) or ``VITREG_OFFLINE=1`` (either one): log to the spool only.

    Either, not the option over the variable: ``mlflow run`` passes every param's default (``false``),
    which must not undo a ``VITREG_OFFLINE=1`` set for a whole session without a network.
    """
    option = parse_bool(value, "offline") if value is not None else False
    return option or parse_bool(os.environ.get("VITREG_OFFLINE") or "false", "VITREG_OFFLINE")


def flush_timeout_s(value=None) -> float:
    """Seconds a finished run waits for its delivery: the argument, ``VITREG_FLUSH_TIMEOUT_S``, or 30."""
    if value is None:
        value = os.environ.get("VITREG_FLUSH_TIMEOUT_S") or DEFAULT_FLUSH_TIMEOUT_S
    return parse_float(value, "VITREG_FLUSH_TIMEOUT_S", minimum=0)


def now_ms() -> int:
    return int(time.time() * 1000)


def clean_tags(tags: dict) -> dict[str, str]:
    """Tags as MLflow stores them: strings, no None, never MLflow's reserved ``mlflow.`` prefix."""
    return {k: str(v) for k, v in tags.items() if v is not None and not k.startswith("mlflow.")}


def clean_metrics(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if v is not None}


def dict_text(data: dict) -> str:
    """A dict artifact's text (``default=str``: paths and other values a result holds)."""
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class SpoolBusy(VitregError):
    """Another process holds this spool (it is still running, or delivering it)."""


class SpoolLost(VitregError):
    """The spool cannot keep what the run logs any more: its folder was removed, or its disk is full."""


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding ``path`` (its nearest existing ancestor): the disk to name."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    device = path.stat().st_dev
    while path != path.parent and path.parent.stat().st_dev == device:
        path = path.parent
    return path


def lost_reason(spool_path: Path, exc: OSError) -> str:
    """One line saying why the spool cannot keep the run: the local disk (named) or the removed folder."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the local disk at {mount_point(spool_path)} holding the spool {spool_path} is full: what the run "
                f"measures from now on cannot be kept; free space there or set VITREG_SPOOL_DIR to another disk")
    return (f"the spool {spool_path} cannot be written ({exc.strerror or exc}): what the run measures from now on "
            f"cannot be kept; do not remove a spool while its run is logging")


class Spool:
    """One run's journal folder. Appends are thread-safe; one process at a time holds it (:meth:`lock`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._write_lock = threading.Lock()
        self._fh = None
        self._lock_fh = None
        self._next_seq = None
        self.lost: str | None = None  # why this spool can no longer keep the run (set at the first failed write)

    # ----------------------------------------------------------------- creating and opening

    @classmethod
    def create(cls, experiment_name: str, run_name: str | None = None, run_id: str | None = None,
               tracking_uri: str | None = None, root: Path | None = None) -> "Spool":
        """A new spool (locked by this process) whose first record describes the run."""
        spool_id = uuid.uuid4().hex
        spool = cls(Path(root or spool_root()) / spool_id)
        (spool.path / "artifacts").mkdir(parents=True)
        spool.lock()
        if tracking_uri and has_credentials(tracking_uri):
            tracking_uri = None  # no secret on disk: sync takes the URI from its option or the environment
        spool._append({"kind": "run", "spool_id": spool_id, "experiment_name": experiment_name,
                       "run_name": run_name, "run_id": run_id, "tracking_uri": tracking_uri,
                       "start_time": now_ms(), "pid": os.getpid()})
        spool.fsync()
        return spool

    @staticmethod
    def find(path: Path) -> list["Spool"]:
        """The spools at ``path``: the folder itself if it is one, else the spools inside it (oldest first)."""
        path = Path(path)
        if (path / JOURNAL).is_file():
            return [Spool(path)]
        if not path.is_dir():
            return []
        # An empty journal is a crash inside create(), before the run was described: nothing to deliver
        found = [p for p in path.iterdir() if (p / JOURNAL).is_file() and (p / JOURNAL).stat().st_size]
        return [Spool(p) for p in sorted(found, key=lambda p: (p / JOURNAL).stat().st_mtime)]

    def lock(self) -> None:
        """Hold this spool for this process (released on :meth:`release` or when the process dies)."""
        fh = open(self.path / "lock", "a")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise SpoolBusy(f"the spool {self.path} is in use by a running process: "
                            f"sync it once that process has ended") from None
        self._lock_fh = fh

    def release(self) -> None:
        with self._write_lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None

    def remove(self) -> None:
        """Delete the spool (everything in it has been delivered)."""
        self.release()
        shutil.rmtree(self.path, ignore_errors=True)

    # ----------------------------------------------------------------- reading

    def records(self) -> list[dict]:
        """Every complete record, in order (a line torn by a crash ends the journal and is dropped)."""
        records = []
        with open(self.path / JOURNAL, encoding="utf-8") as fh:
            for line in fh:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        return records

    @property
    def run_record(self) -> dict:
        return self.records()[0]

    # ----------------------------------------------------------------- appending

    def _append(self, record: dict) -> dict:
        with self._write_lock:
            if self._fh is None:
                if self._next_seq is None:  # reopened (sync): continue after what is there
                    self._next_seq = len(self._records_or_empty())
                self._fh = open(self.path / JOURNAL, "a", encoding="utf-8")
            record = {"seq": self._next_seq, **record}
            with self._kept():
                if os.fstat(self._fh.fileno()).st_nlink == 0:  # removed under us: writes would go nowhere
                    raise FileNotFoundError(errno.ENOENT, "its journal was removed")
                self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
                self._fh.flush()  # in the OS now: survives this process being killed
            self._next_seq += 1
        return record

    @contextlib.contextmanager
    def _kept(self):
        """A write inside that fails (``OSError``; ``shutil.Error``, a tree copy's, is one too) means the spool
        can no longer keep the run: the first reason is kept in :attr:`lost` and raised as :class:`SpoolLost`."""
        try:
            yield
        except OSError as exc:
            self.lost = self.lost or lost_reason(self.path, exc)
            raise SpoolLost(self.lost) from None

    def _records_or_empty(self) -> list[dict]:
        return self.records() if (self.path / JOURNAL).exists() else []

    def fsync(self) -> None:
        """Make what was appended durable (survives a power cut); cheap enough per batch, not per call."""
        with self._write_lock:
            if self._fh is not None:
                with self._kept():
                    os.fsync(self._fh.fileno())

    def append_params(self, params: dict) -> list[dict]:
        items = sorted((str(k), scrub(str(v))) for k, v in params.items())  # no credential stored, ever
        return [self._append({"kind": "params", "params": dict(part)}) for part in _chunks(items, MAX_PARAMS)]

    def append_tags(self, tags: dict) -> list[dict]:
        items = sorted((str(k), scrub(str(v))) for k, v in tags.items() if v is not None)
        return [self._append({"kind": "tags", "tags": dict(part)}) for part in _chunks(items, MAX_TAGS)]

    def append_metrics(self, metrics: dict, step: int | None = None, timestamp_ms: int | None = None) -> list[dict]:
        stamp = now_ms() if timestamp_ms is None else timestamp_ms
        points = [[str(k), float(v), stamp, int(step or 0)] for k, v in metrics.items() if v is not None]
        return [self._append({"kind": "metrics", "metrics": part}) for part in _chunks(points, MAX_METRICS)]

    def append_artifact(self, local_path, artifact_path: str | None = None) -> dict:
        """Copy a file or folder into the spool (the original may be deleted at once) and journal it."""
        source = Path(local_path)
        if not source.exists():
            raise VitregError(f"artifact {source} does not exist: nothing to log")
        slot = f"artifacts/{uuid.uuid4().hex[:12]}"
        target = self.path / slot
        with self._kept():
            target.mkdir()  # no parents: a removed spool must fail here, not be made again
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
                return self._append({"kind": "artifact", "path": slot, "is_dir": True,
                                     "artifact_path": artifact_path})
            shutil.copy2(source, target / source.name)
        return self._append({"kind": "artifact", "path": f"{slot}/{source.name}", "is_dir": False,
                             "artifact_path": artifact_path})

    def append_text(self, text: str, artifact_file: str) -> dict:
        """``log_text``: the text as a file at ``artifact_file`` (``dir/name.ext``) of the run."""
        directory, _, name = artifact_file.rpartition("/")
        slot = self.path / "artifacts" / uuid.uuid4().hex[:12]
        with self._kept():
            slot.mkdir()  # no parents: a removed spool must fail here, not be made again
            (slot / name).write_text(scrub(text), encoding="utf-8")
        return self._append({"kind": "artifact", "path": str((slot / name).relative_to(self.path)),
                             "is_dir": False, "artifact_path": directory or None})

    def append_delete(self, artifact_path: str) -> dict:
        """``delete_artifacts``: remove what the run holds at ``artifact_path``, once what came before is delivered."""
        return self._append({"kind": "delete", "artifact_path": str(artifact_path)})

    def append_end(self, status: str, end_time_ms: int | None = None) -> dict:
        return self._append({"kind": "end", "status": status, "end_time": end_time_ms or now_ms()})


@contextlib.contextmanager
def held(spool: Spool):
    """Lock ``spool`` for the duration (for delivering a spool written by a process that has ended)."""
    spool.lock()
    try:
        yield spool
    finally:
        spool.release()
