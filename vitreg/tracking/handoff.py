"""Rank 0 -> launcher: under a vitreg launcher no rank talks to MLflow. Rank 0's :class:`HandoffTracker` writes
every call as a JSON line of ``calls.jsonl`` in a folder the launcher gave it (``run.json`` names the run), and
every file to log under ``files/`` (hard-linked where it can be); the launcher reads the new lines while torchrun
runs (:class:`HandoffReader`) and replays them into its run (:func:`replay`).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from vitreg.tracking.runs import Tracker, note_skipped_params
from vitreg.tracking.spool import clean_metrics, clean_tags, dict_text

CALLS = "calls.jsonl"
RUN = "run.json"
FILES = "files"


def announce_run(directory, run_id: str, experiment_id: str) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RUN).write_text(json.dumps({"run_id": run_id, "experiment_id": experiment_id}))


def _copy(src: Path, dst: Path) -> None:
    """Hard links where the file system allows (a checkpoint is not copied twice), else copies."""
    def link_or_copy(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link_or_copy)
    else:
        link_or_copy(src, dst)


class HandoffTracker(Tracker):
    thread_safe = True  # one lock orders the lines

    def __init__(self, directory):
        self.directory = Path(directory)
        run = json.loads((self.directory / RUN).read_text())
        self.run_id, self.experiment_id = run["run_id"], run["experiment_id"]
        self._lock = threading.Lock()
        self._files = 0

    def _write(self, call: str, **fields) -> None:
        with self._lock, open(self.directory / CALLS, "a") as out:
            out.write(json.dumps({"call": call, **fields}, default=str) + "\n")

    def _keep(self, path) -> str:
        """A copy of ``path`` under files/ that outlives the rank's temporary folders, its parent folder's name
        kept: the registry names ``checkpoints/<name>`` folders as run artifacts."""
        path = Path(path)
        with self._lock:
            self._files += 1
            rel = f"{FILES}/{self._files}/{path.parent.name or 'root'}/{path.name}"
        _copy(path, self.directory / rel)
        return rel

    def log_params(self, params):
        self._write("log_params", params={k: str(v) for k, v in params.items()})
        return {}  # the launcher's replay finds out what `mlflow run` already logged

    def set_name(self, name):
        self._write("set_name", name=name)

    def set_tags(self, tags):
        self._write("set_tags", tags=clean_tags(tags))

    def log_metrics(self, metrics, step=None, synchronous=True):
        self._write("log_metrics", metrics=clean_metrics(metrics), step=step)

    def flush(self):
        pass  # every line is written when the call returns

    def log_text(self, text, artifact_file):
        self._write("log_text", text=text, artifact_file=artifact_file)

    def log_dict(self, data, artifact_file):
        self._write("log_text", text=dict_text(data), artifact_file=artifact_file)

    def set_note(self, text):
        self._write("set_note", text=text)

    def log_artifact(self, path, artifact_path=None):
        self._write("log_artifact", path=self._keep(path), artifact_path=artifact_path)

    log_artifacts = log_artifact  # a file or a folder alike: the launcher's tracker copies either

    def delete_artifacts(self, artifact_path):
        self._write("delete_artifacts", artifact_path=artifact_path)

    def hand_back_registration(self, checkpoint_dir, name, alias, tags):
        """Registration is the launcher's, after the replay (the version reads the run's figures)."""
        self._write("register_checkpoint", path=self._keep(checkpoint_dir), name=name, alias=alias, tags=tags)


@dataclass(frozen=True)
class Handoff:
    directory: Path
    calls: tuple

    @property
    def metrics(self) -> dict[str, float]:
        """The summary metrics (logged without a step)."""
        return {k: v for c in self.calls if c["call"] == "log_metrics" and c["step"] is None
                for k, v in c["metrics"].items()}

    @property
    def tags(self) -> dict[str, str]:
        return {k: v for c in self.calls if c["call"] == "set_tags" for k, v in c["tags"].items()}

    @property
    def registration(self) -> dict | None:
        """The last ``register_checkpoint`` call (its ``path`` made absolute), or None."""
        found = [c for c in self.calls if c["call"] == "register_checkpoint"]
        return {**found[-1], "path": self.directory / found[-1]["path"]} if found else None


class HandoffReader:
    """Reads rank 0's calls as they are written: each :meth:`read_new` returns the complete lines added since the
    last (one cut short by a rank killed while writing it is never read). No file yet: no calls."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self._offset = 0
        self._calls: list[dict] = []

    def read_new(self) -> list[dict]:
        try:
            with open(self.directory / CALLS, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        new = [json.loads(line) for line in complete.decode().splitlines() if line]
        self._calls += new
        return new

    @property
    def handoff(self) -> Handoff:
        return Handoff(self.directory, tuple(self._calls))


#: the calls a hand-off replays into the launcher's tracker, each with the arguments it was written with
#: (``register_checkpoint`` is left to the caller: the version reads the run's figures, once they are logged)
REPLAYED = ("log_params", "set_name", "set_tags", "log_metrics", "log_text", "set_note", "log_artifact",
            "log_artifacts", "delete_artifacts")


def replay(directory, calls: list[dict], tracker: Tracker, progress) -> None:
    for c in calls:
        if c["call"] not in REPLAYED:
            continue
        args = {k: Path(directory) / v if k == "path" else v for k, v in c.items() if k != "call"}
        held = getattr(tracker, c["call"])(**args)
        if c["call"] == "log_params":
            note_skipped_params(held, progress)
