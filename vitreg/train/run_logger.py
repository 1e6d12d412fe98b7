"""What the train job hangs on the loop's callbacks to log into MLflow without stalling a step:
:class:`RunLogger` (the run's calls, in order, off the training thread when that is safe) and
:class:`CheckpointUploader` (each checkpoint as ``checkpoints/step-<N>`` and ``checkpoints/last``)."""

from __future__ import annotations

import queue
import shutil
import threading
from pathlib import Path

from vitreg.errors import VitregError, first_line
from vitreg.tracking import runs as tracking

CHECKPOINT_ARTIFACTS = "checkpoints"


class RunLogger:
    """MLflow calls for one run, in submission order, off the training thread when that is safe.

    With a thread-safe tracker (bound to its run id) a single daemon thread runs the calls; the
    training loop only enqueues. Otherwise :meth:`submit` runs the call at once. An error in the
    thread is raised at the next :meth:`submit` or at :meth:`close`.
    """

    def __init__(self, tracker):
        self.tracker = tracker
        # a NullTracker (ranks other than 0) does nothing: no thread for it
        self.threaded = bool(getattr(tracker, "thread_safe", False)) and not isinstance(tracker, tracking.NullTracker)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = None
        if self.threaded:
            self._thread = threading.Thread(target=self._work, name="vitreg-mlflow-logger", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    fn, args = item
                    fn(*args)
            except BaseException as exc:  # keep the first; the training thread raises it
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, VitregError):
                raise error
            raise VitregError(f"logging to MLflow at {tracking.tracking_uri()} failed: {type(error).__name__}: "
                              f"{first_line(error)}") from error

    def submit(self, fn, *args) -> None:
        if not self.threaded:
            fn(*args)
            return
        self._raise()
        self._queue.put((fn, args))

    def metrics(self, metrics: dict, step: int | None = None) -> None:
        self.submit(self.tracker.log_metrics, dict(metrics), step)

    def flush(self) -> None:
        if self.threaded:
            self._queue.join()
            self._raise()

    def close(self, timeout: float | None = None) -> None:
        """Drain and stop the thread (``timeout`` seconds at most, on the error path)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None
        self._raise()


class CheckpointUploader:
    """Logs each checkpoint as ``checkpoints/step-<N>`` then ``checkpoints/last``, then deletes the local
    copies of older checkpoints (the newest stays, for registration)."""

    def __init__(self, logger: RunLogger):
        self.logger = logger
        self._uploaded: list[Path] = []

    def __call__(self, step: int, path: Path) -> None:
        self.logger.submit(self._upload, step, Path(path))

    def _upload(self, step: int, path: Path) -> None:
        tracker = self.logger.tracker
        tracker.log_artifacts(path, f"{CHECKPOINT_ARTIFACTS}/step-{step}")
        tracker.log_artifacts(path, f"{CHECKPOINT_ARTIFACTS}/last")
        for old in self._uploaded:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        self._uploaded = [path]
