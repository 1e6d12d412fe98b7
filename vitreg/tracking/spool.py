"""A durable local journal of one run: everything it logs, written before any of it goes to a server.

A spool is a folder ``<root>/<spool id>/``: ``journal.jsonl``, one JSON record a line numbered by ``seq``
(``run`` first, then ``params``, ``tags``, ``metrics``, ``artifact``: a copy under ``artifacts/``, ``delete``: an
artifact path to remove, ``end``), and ``lock``, held (``flock``) by the one process that writes or delivers it.
Appending is a write and flush (no fsync: :meth:`Spool.fsync` at batch boundaries); a last line torn by a crash
is ignored. A spool is data from outside (`vitreg sync` may be given one somebody else wrote): every record is
checked (:func:`record_problem`) before any of it is delivered.

Settings: ``VITREG_SPOOL_DIR`` (default ``~/.local/share/vitreg/spool``), ``VITREG_OFFLINE`` (write the spool
only, deliver later), ``VITREG_FLUSH_TIMEOUT_S`` (how long a finished run waits for delivery; default 30).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

from vitreg.config.parse import parse_bool, parse_float
from vitreg.errors import VitregError
from vitreg.files import FileFault, bounded_lines, inside, parse_json
from vitreg.tracking.uris import has_credentials, scrub

JOURNAL = "journal.jsonl"
DEFAULT_FLUSH_TIMEOUT_S = 30.0

# MLflow's log_batch limits are 1000 metrics, 100 params and 100 tags a call; a record never holds more
# than one call may take, leaving two tags for delivery's own (sequence number, heartbeat).
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 98
MAX_LINE = 4 << 20  # bytes of one journal line: a record of 98 tags of 8,000 characters, escaped, fits


def spool_root(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("VITREG_SPOOL_DIR"):
        return Path(env["VITREG_SPOOL_DIR"]).expanduser()
    data_home = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "vitreg" / "spool"


def offline_mode(value=None) -> bool:
    """``offline=true`` or ``VITREG_OFFLINE=1``, either one (``mlflow run`` passes every param's default,
    ``false``, which must not undo the variable)."""
    option = parse_bool(value, "offline") if value is not None else False
    return option or parse_bool(os.environ.get("VITREG_OFFLINE") or "false", "VITREG_OFFLINE")


def flush_timeout_s(value=None) -> float:
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
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class SpoolBusy(VitregError):
    """Another process holds this spool (it is still running, or delivering it)."""


class SpoolLost(VitregError):
    """The spool cannot keep what the run logs any more: its folder was removed, or its disk is full."""


class SpoolUnusable(VitregError):
    """The spool folder cannot be made or written."""


class SpoolDamaged(VitregError):
    """A journal that does not read as vitreg writes one: nothing of that spool is delivered, nor removed."""


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding ``path`` (its nearest existing ancestor): the disk to name."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    device = path.stat().st_dev
    while path != path.parent and path.parent.stat().st_dev == device:
        path = path.parent
    return path


def os_reason(exc: OSError) -> tuple[int | None, str]:
    """An OSError's errno and its words; for a tree copy's ``shutil.Error`` (thousands of characters, a reason
    per file) the first reason, or one that says the disk is full."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        reasons = [str(entry[-1]) for entry in exc.args[0] if isinstance(entry, (tuple, list)) and entry]
        full = next((r for r in reasons if f"[Errno {errno.ENOSPC}]" in r or f"[Errno {errno.EDQUOT}]" in r), None)
        reason = full or (reasons[0] if reasons else "a copy failed")
        match = re.search(r"\[Errno (\d+)\] ([^:']+)", reason)
        return (int(match.group(1)), match.group(2).strip()) if match else (None, reason[:200])
    return exc.errno, exc.strerror or str(exc)


def disk_full_reason(path: Path, consequence: str = "") -> str:
    return (f"the local disk at {mount_point(path)} holding the spool {path} is full: {consequence}free space "
            f"there or set VITREG_SPOOL_DIR to another disk")


def lost_reason(spool_path: Path, exc: OSError) -> str:
    number, words = os_reason(exc)
    lost = "what the run measures from now on cannot be kept"
    if number in (errno.ENOSPC, errno.EDQUOT):
        return disk_full_reason(spool_path, f"{lost}; ")
    return f"the spool {spool_path} cannot be written ({words}): {lost}; do not remove a spool while its run is logging"


def check_spool_root(root: Path) -> None:
    """Spools can be written under ``root`` (made if missing), checked before a run exists anywhere: no run is
    left RUNNING on the server for a spool that cannot keep it."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root) as probe:
            probe.write(b"{}\n")  # a byte on disk, not only an inode: a full disk fails here
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise SpoolUnusable(unusable_reason(root, exc)) from None


def unusable_reason(root: Path, exc: OSError) -> str:
    number, words = os_reason(exc)
    if number in (errno.ENOSPC, errno.EDQUOT):
        return disk_full_reason(root)
    return (f"the spool folder {root} cannot be written ({words}): set VITREG_SPOOL_DIR to a writable folder "
            f"(runs are kept there until the tracking store has them), or fix that folder")


# --------------------------------------------------------------------------- what a journal may hold

RESERVED_TAG_PREFIX = "vitreg_spool_"  # delivery's own tags (the spool id, how far it got): never from a record
STATUSES = ("FINISHED", "FAILED", "KILLED")
_HEX_ID = re.compile(r"[0-9a-f]{32}")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _strings(value, limit: int, what: str) -> str | None:
    if not isinstance(value, dict) or len(value) > limit:
        return f"{what} is not a map of at most {limit} names"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return f"{what} holds a value that is not text"
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metrics_problem(points) -> str | None:
    if not isinstance(points, list) or len(points) > MAX_METRICS:
        return f"metrics is not a list of at most {MAX_METRICS} points"
    for point in points:
        if not (isinstance(point, list) and len(point) == 4 and isinstance(point[0], str) and _is_number(point[1])
                and all(isinstance(n, int) and not isinstance(n, bool) for n in point[2:])):
            return f"the metric point {str(point)[:80]} is not [name, value, timestamp_ms, step]"
    return None


def _artifact_path_problem(artifact_path) -> str | None:
    if artifact_path is None:
        return None
    if not isinstance(artifact_path, str) or artifact_path.startswith("/") or ".." in artifact_path.split("/"):
        return f"artifact_path {str(artifact_path)[:80]!r} leaves the run's artifact folder"
    return None


def _inside_problem(spool_dir: Path, record: dict) -> str | None:
    """An artifact record's file is inside ``spool_dir/artifacts`` once resolved, with no link in it."""
    relative = record.get("path")
    if not isinstance(relative, str) or not isinstance(record.get("is_dir"), bool):
        return "an artifact record without a path"
    local = inside(spool_dir, spool_dir / relative, "artifacts")  # an artifacts/ that is a link leads out
    if Path(relative).is_absolute() or local is None or local == spool_dir.resolve() / "artifacts":
        return f"the artifact {relative!r} is outside the spool"
    # a copy may be gone: delivery frees it once the store holds it (a checkpoint a step, so the spool does
    # not keep every one until the run ends); what is there must be what the record says
    if local.exists() and not (local.is_dir() if record["is_dir"] else local.is_file()):
        return f"the artifact {relative!r} is not the {'folder' if record['is_dir'] else 'file'} its record says"
    if record["is_dir"]:
        for folder, dirs, files in os.walk(local):
            if any(Path(folder, name).is_symlink() for name in dirs + files):
                return f"the artifact {relative!r} holds a link (vitreg copies files into a spool, never links)"
    return _artifact_path_problem(record.get("artifact_path"))


def record_problem(spool_dir: Path, record, seq: int) -> str | None:
    if not isinstance(record, dict):
        return "not a record"
    kind = record.get("kind")
    if record.get("seq") != seq or isinstance(record.get("seq"), bool):
        return f"sequence number {str(record.get('seq'))[:20]} where {seq} was due"
    if (seq == 0) != (kind == "run"):
        return "the run record must come first, and once"
    if kind == "run":
        if not isinstance(record.get("spool_id"), str) or not _HEX_ID.fullmatch(record["spool_id"]):
            return "the run record has no valid spool_id"
        if record.get("run_id") is not None and not (isinstance(record["run_id"], str)
                                                      and _RUN_ID.fullmatch(record["run_id"])):
            return "the run record's run_id is not a run id"
        if not all(isinstance(record.get(k), (str, type(None))) for k in ("experiment_name", "run_name",
                                                                           "tracking_uri")):
            return "the run record's names are not text"
        return None if _is_number(record.get("start_time")) else "the run record has no start time"
    if kind == "params":
        return _strings(record.get("params"), MAX_PARAMS, "params")
    if kind == "tags":
        problem = _strings(record.get("tags"), MAX_TAGS, "tags")
        if problem is None and any(k.startswith(RESERVED_TAG_PREFIX) for k in record["tags"]):
            return f"a tag named {RESERVED_TAG_PREFIX}* (delivery's own)"
        return problem
    if kind == "metrics":
        return _metrics_problem(record.get("metrics"))
    if kind == "artifact":
        return _inside_problem(spool_dir, record)
    if kind == "delete":  # keep_checkpoints: a step folder the run no longer keeps
        if not isinstance(record.get("artifact_path"), str) or not record["artifact_path"].strip("/"):
            return "a delete record without an artifact path"
        return _artifact_path_problem(record["artifact_path"])
    if kind == "end":
        if record.get("status") not in STATUSES or not _is_number(record.get("end_time")):
            return "an end record without a final status and time"
        return None
    return f"an unknown kind of record {str(kind)[:40]!r}"


def damaged(journal: Path, line: int, why: str) -> SpoolDamaged:
    return SpoolDamaged(f"the spool journal {journal}:{line} is damaged ({why}): nothing of that spool was "
                        f"delivered and it is left as it is; look at that line, or remove the spool "
                        f"{journal.parent} if it is not yours")


class Spool:
    """One run's journal folder. Appends are thread-safe; one process at a time holds it (:meth:`lock`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._write_lock = threading.Lock()
        self._fh = None
        self._lock_fh = None
        self._next_seq = None
        self.lost: str | None = None  # why this spool can no longer keep the run (set at the first failed write)

    @classmethod
    def create(cls, experiment_name: str, run_name: str | None = None, run_id: str | None = None,
               tracking_uri: str | None = None, root: Path | None = None) -> "Spool":
        spool_id = uuid.uuid4().hex
        root = Path(root or spool_root())
        spool = cls(root / spool_id)
        if tracking_uri and has_credentials(tracking_uri):
            tracking_uri = None  # no secret on disk: sync takes the URI from its option or the environment
        try:
            (spool.path / "artifacts").mkdir(parents=True)
            spool.lock()
            spool._append({"kind": "run", "spool_id": spool_id, "experiment_name": experiment_name,
                           "run_name": run_name, "run_id": run_id, "tracking_uri": tracking_uri,
                           "start_time": now_ms(), "pid": os.getpid()})
            spool.fsync()
        except (OSError, SpoolLost, SpoolUnusable) as exc:  # no run may start that its spool cannot keep
            spool.release()
            shutil.rmtree(spool.path, ignore_errors=True)
            if isinstance(exc, SpoolUnusable):
                raise
            error = exc if isinstance(exc, OSError) else exc.__context__ or OSError(str(exc))
            raise SpoolUnusable(unusable_reason(root, error)) from None
        return spool

    @staticmethod
    def find(path: Path) -> list["Spool"]:
        """The spools at ``path``: the folder itself if it is one, else the spools inside it (oldest first)."""
        path = Path(path)
        try:
            if path.exists() and not path.is_dir():  # a file where the spools should be: said, not "nothing"
                raise SpoolUnusable(f"{path} is a file, not a folder of spools: point VITREG_SPOOL_DIR (or "
                                    f"--spool) at the folder that holds them")
            if not path.is_dir():
                return []
            folders = [path] if os.path.lexists(path / JOURNAL) else [p for p in path.iterdir()
                                                                     if os.path.lexists(p / JOURNAL)]
            # An empty journal is a crash inside create(), before the run was described: nothing to deliver. A
            # journal that is no file is kept: reading it says what it is (records), not skipped in silence.
            found = [p for p in folders if not (p / JOURNAL).is_file() or (p / JOURNAL).stat().st_size]
            return [Spool(p) for p in sorted(found, key=lambda p: (p / JOURNAL).lstat().st_mtime)]
        except OSError as exc:
            raise SpoolUnusable(f"the spools at {path} cannot be listed ({exc.strerror or exc}): run `vitreg sync` as "
                                f"the user who wrote them, or fix that folder's permissions") from None

    def lock(self) -> None:
        try:
            fh = open(self.path / "lock", "a")
        except OSError as exc:
            raise SpoolUnusable(f"the spool {self.path} cannot be locked ({exc.strerror or exc}): run `vitreg sync` "
                                f"as the user who wrote it, or make that folder writable") from None
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
        self.release()
        shutil.rmtree(self.path, ignore_errors=True)

    def records(self) -> list[dict]:
        """Every record, in order, each checked; :class:`SpoolDamaged` names the line of the first that is not
        as vitreg writes it. A last line torn by a crash is dropped."""
        journal = self.path / JOURNAL
        if not journal.is_file():
            raise SpoolDamaged(f"the spool journal {journal} is not a file (a folder, or a link to nothing): "
                               f"nothing of that spool was delivered; remove the spool {self.path} if it holds "
                               f"no run of yours")
        try:
            with open(journal, "rb") as fh:
                lines = list(bounded_lines(fh, MAX_LINE))
        except OSError as exc:
            raise SpoolDamaged(f"the spool journal {journal} cannot be read ({exc.strerror or exc}): nothing of "
                               f"that spool was delivered; run `vitreg sync` as the user who wrote it") from None
        records = []
        for number, (line, ended) in enumerate(lines, 1):
            if ended:
                records.append(self._parsed(journal, number, line))
            elif line:  # the last line, torn by a crash (or over MAX_LINE: None): dropped unless it parses
                with contextlib.suppress(FileFault):
                    records.append(parse_json(line))
        for seq, record in enumerate(records):
            problem = record_problem(self.path, record, seq)
            if problem:
                raise damaged(journal, seq + 1, problem)
        return records

    @staticmethod
    def _parsed(journal: Path, number: int, line: bytes | None):
        if line is None:
            raise damaged(journal, number, f"a line over {MAX_LINE:,} bytes, more than vitreg writes in a record")
        try:
            return parse_json(line)
        except FileFault as exc:  # not UTF-8, a NUL, nested too deep, not JSON: said as it is
            raise damaged(journal, number, str(exc)) from None

    @property
    def run_record(self) -> dict:
        return self.records()[0]

    def _append(self, record: dict) -> dict:
        if self.lost:
            return record  # said once, when it was lost (SpoolLost); the run's end says it again
        with self._write_lock:
            if self._fh is None:
                if self._next_seq is None:  # reopened (sync): continue after what is there
                    self._next_seq = len(self.records()) if (self.path / JOURNAL).exists() else 0
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
        """A write inside that fails means the spool can no longer keep the run: :attr:`lost`, :class:`SpoolLost`."""
        try:
            yield
        except OSError as exc:
            self.lost = self.lost or lost_reason(self.path, exc)
            raise SpoolLost(self.lost) from None

    def fsync(self) -> None:
        """Cheap enough per batch, not per call."""
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
        """A copy in the spool: the original may be deleted at once."""
        source = Path(local_path)
        if not source.exists():
            raise VitregError(f"artifact {source} does not exist: nothing to log")
        if source.is_dir():
            return self._append_copy("", lambda slot: shutil.copytree(source, slot, dirs_exist_ok=True),
                                     artifact_path)
        return self._append_copy(source.name, lambda slot: shutil.copy2(source, slot / source.name), artifact_path)

    def append_text(self, text: str, artifact_file: str) -> dict:
        directory, _, name = artifact_file.rpartition("/")
        return self._append_copy(name, lambda slot: (slot / name).write_text(scrub(text), encoding="utf-8"),
                                 directory or None)

    def _append_copy(self, name: str, write, artifact_path: str | None) -> dict:
        """Journal what ``write(slot)`` puts into a new slot folder: the file ``name``, or the folder for no name."""
        if self.lost:
            return {"kind": "artifact"}
        slot = f"artifacts/{uuid.uuid4().hex[:12]}"
        with self._kept():
            (self.path / slot).mkdir()  # no parents: a removed spool must fail here, not be made again
            write(self.path / slot)
        return self._append({"kind": "artifact", "path": f"{slot}/{name}" if name else slot, "is_dir": not name,
                             "artifact_path": artifact_path})

    def append_delete(self, artifact_path: str) -> dict:
        return self._append({"kind": "delete", "artifact_path": str(artifact_path)})

    def append_end(self, status: str) -> dict:
        return self._append({"kind": "end", "status": status, "end_time": now_ms()})


class Contents:
    """What a spool's records put on a run: param and tag names, distinct points per metric (MLflow stores a
    point sent twice once), artifact file paths, the final status."""

    def __init__(self, records: list[dict], spool_dir: Path):
        self.params: set[str] = set()
        self.tags: set[str] = set()
        distinct: dict[str, set] = {}
        self.files: set[str] = set()
        self.status = None
        for record in records:
            self.params.update(record.get("params", {}))
            self.tags.update(record.get("tags", {}))
            for key, value, stamp, step in record.get("metrics", ()):
                distinct.setdefault(key, set()).add((stamp, step, repr(float(value))))
            if record["kind"] == "artifact":
                self.files.update(artifact_files(spool_dir, record))
            elif record["kind"] == "delete":  # gone from the run on purpose: not lacking
                gone = record["artifact_path"].strip("/")
                self.files = {f for f in self.files if f != gone and not f.startswith(gone + "/")}
            elif record["kind"] == "end":
                self.status = record["status"]
        self.points = {key: len(points) for key, points in distinct.items()}


def artifact_files(spool_dir: Path, record: dict) -> list[str]:
    local = spool_dir / record["path"]
    prefix = f"{record['artifact_path'].strip('/')}/" if record.get("artifact_path") else ""
    if not record["is_dir"]:
        return [prefix + local.name]
    # a folder whose copy was freed after delivery (Delivery._release) is no longer countable here
    return [prefix + f.relative_to(local).as_posix() for f in local.rglob("*") if f.is_file()]
