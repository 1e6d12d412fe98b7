"""Why a torchrun job failed: the root-cause rank, its one-line error and its own exit status.

Failures come back the way torch elastic passes them: a worker that fails writes its error file
(``TORCHELASTIC_ERROR_FILE``; :func:`record_error`, in torch's format) and the first file written names the
root cause. When one worker dies, torchrun stops the others with SIGTERM, and each records "stopped by
SIGTERM": consequences, which name the root cause only when no other rank failed. A worker killed by a signal
it cannot catch (SIGKILL: the OOM killer's) writes nothing and its peers report only the lost connection:
torchrun's failure summary (in ``torchrun.log``) then gives each failed rank's exit status, and says when
torchrun itself was stopped; else the last error line of a rank's stderr names the cause. A lost peer
follows another rank's end, even a stop's whose record came later: it is named only when nothing else is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: the statuses of a worker stopped from outside (128 + signal number), as torchrun stops the survivors
STOPPED_CODES = frozenset(128 + s for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT))
#: a rank's error that only says a peer went away (gloo, NCCL): after a rank was stopped, a consequence of it
_PEER_LOST = re.compile(r"closed by peer|reset by peer|remote worker crash|remote process exited", re.IGNORECASE)


def record_error(message: str, exit_code: int, callstack: str = "") -> None:
    """In a torchrun worker: write this worker's failure to its error file (a no-op elsewhere).

    The first failure recorded wins (vitreg's own ``error: ...`` before the worker shim's exit)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return
    data = {"message": {"message": message, "errorCode": exit_code,
                        "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))}}}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass  # the launcher then falls back to the stderr logs


_ERROR_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)(?::.*)?")


def last_error_line(text: str) -> str | None:
    """The last line of a worker's stderr that states an error: vitreg's ``error: ...`` or the last
    line of a Python traceback (``RuntimeError: ...``). None if there is none."""
    for line in reversed(text.splitlines()):
        if not line or line[0].isspace():
            continue  # traceback frames and their source lines are indented
        line = line.rstrip()
        if line.startswith("error: "):
            return line[len("error: "):]
        if _ERROR_LINE.fullmatch(line):
            return line
    return None


#: torchrun's failure summary (torch.distributed.elastic's ChildFailedError): each failed rank's exit status
_SUMMARY_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
#: torchrun stopped by a signal: torch.distributed.elastic's SignalException
_TORCHRUN_SIGNALLED = re.compile(r"SignalException: Process \d+ got signal: (\d+)")
#: exit statuses of a rank that was not stopped by torchrun: killed by a signal that no handler caught
_NOT_TORCHRUN_S_STOP = frozenset(-s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def summary_failures(torchrun_text: str) -> dict[int, int]:
    """``{global rank: exit status}`` of every failed rank in torchrun's summary."""
    return {int(rank): int(code) for rank, code in _SUMMARY_FAILURE.findall(torchrun_text)}


def killed_ranks(torchrun_text: str) -> dict[int, int]:
    """``{global rank: exit status}`` of the ranks torchrun's summary shows killed by a signal no handler
    caught (SIGKILL, SIGSEGV, SIGABRT...), not the SIGTERM with which torchrun stops the survivors."""
    return {rank: code for rank, code in summary_failures(torchrun_text).items()
            if code < 0 and code not in _NOT_TORCHRUN_S_STOP}


def _stop_signal(code: int) -> int | None:
    """The stop signal an exit status says a rank ended by (143 or -15: SIGTERM), else None."""
    if code in STOPPED_CODES:
        return code - 128
    return -code if code in _NOT_TORCHRUN_S_STOP else None


@dataclass(frozen=True)
class LaunchOutcome:
    """What became of a torchrun job, as seen from this host's launcher."""

    returncode: int  # torchrun's own status (1 whenever a worker failed)
    exit_code: int  # the status to exit with: the root-cause worker's own one where it recorded it
    rank: int | None  # the root-cause rank (global), if one could be named
    error: str | None  # its one-line error
    log_dir: Path
    nproc: int = 1
    node_rank: int = 0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def message(self) -> str:
        if self.ok:
            return "all ranks finished"
        if self.rank is None:
            return self.error or (f"torchrun exited with status {self.returncode} and no rank reported an error "
                                  f"(a rendezvous or launch failure): see torchrun.log")
        if self.error:
            return f"rank {self.rank}: {self.error}"
        return f"rank {self.rank} exited with status {self.exit_code} without an error message (killed?)"

    def rank_logs(self) -> dict[int, dict[str, Path]]:
        """``{global_rank: {"stdout": path, "stderr": path}}`` of the files torchrun wrote."""
        out: dict[int, dict[str, Path]] = {}
        for path in sorted(self.log_dir.glob("*/attempt_*/*/std*.log")):
            out.setdefault(self._global(path.parent), {})[path.stem] = path
        return out

    def _global(self, rank_dir: Path) -> int:
        return self.node_rank * self.nproc + int(rank_dir.name)  # static rendezvous: node-major ranks


def _error_files(log_dir: Path) -> list[tuple[float, Path, dict]]:
    """Every worker's error file, first written first: ``(time, rank folder, the error)``."""
    found = []
    for path in log_dir.glob("*/attempt_*/*/error.json"):
        try:
            error = json.loads(path.read_text())["message"]
            found.append((path.stat().st_mtime, path.parent, error))
        except (ValueError, KeyError, TypeError, OSError):
            continue
    return sorted(found, key=lambda f: f[0])


def _stderr_of(rank_dir: Path) -> str:
    path = rank_dir / "stderr.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _killed_outcome(outcome: LaunchOutcome, killed: dict[int, int]) -> LaunchOutcome:
    """The lowest rank killed by a signal: the signal, and its stderr's last error line if it had one."""
    rank = min(killed)
    rank_dir = next((d for d in outcome.log_dir.glob("*/attempt_*/*") if d.name.isdigit() and outcome._global(d) == rank),
                    None)
    last_words = last_error_line(_stderr_of(rank_dir)) if rank_dir is not None else None
    signum = -killed[rank]
    why = f"killed by {_signal_name(signum)}" + (" (as the OOM killer does when the host runs out of memory)"
                                                 if signum == signal.SIGKILL else "")
    why += f"; its last error line: {last_words}" if last_words else ""
    return replace(outcome, rank=rank, error=why)


def _code(error: dict, returncode: int) -> int:
    return int(error.get("errorCode") or returncode)


def _recorded(outcome: LaunchOutcome, rank_dir: Path, error: dict) -> LaunchOutcome:
    """The outcome a rank's error file tells: its message (else its stderr's last error line), its exit status."""
    message = error.get("message") or last_error_line(_stderr_of(rank_dir))
    return replace(outcome, exit_code=_code(error, outcome.returncode), rank=outcome._global(rank_dir), error=message)


def diagnose(returncode: int, log_dir: Path, nproc: int, node_rank: int = 0, torchrun_text: str = "") -> LaunchOutcome:
    """Name the root cause of a failed job, in this order: torchrun itself stopped by a signal; the first
    error file written by a rank that failed on its own (not stopped, not one that only lost its peer); a rank
    killed by a signal no handler caught (torchrun's summary in ``torchrun_text``); then what
    :func:`_first_stop` finds. Its message, and its exit status where it recorded one."""
    log_dir = Path(log_dir)
    outcome = LaunchOutcome(returncode, returncode, None, None, log_dir, nproc, node_rank)
    if returncode == 0:
        return outcome
    signalled = _TORCHRUN_SIGNALLED.search(torchrun_text)
    if signalled:  # the ranks' "stopped by SIGTERM" follow from it
        signum = int(signalled.group(1))
        return replace(outcome, exit_code=128 + signum,
                       error=f"torchrun was stopped by {_signal_name(signum)}, and its ranks with it")
    errors = [(d, e) for _, d, e in _error_files(log_dir)]
    first_hand = [(d, e) for d, e in errors
                  if _code(e, returncode) not in STOPPED_CODES and not _PEER_LOST.search(str(e.get("message") or ""))]
    if first_hand:
        return _recorded(outcome, *first_hand[0])
    killed = killed_ranks(torchrun_text)
    if killed:
        return _killed_outcome(outcome, killed)
    return _first_stop(outcome, errors, torchrun_text)


def _first_stop(outcome: LaunchOutcome, errors: list, torchrun_text: str) -> LaunchOutcome:
    """No rank failed on its own: a rank (rank 0 first) that wrote no error file and whose stderr ends with an
    error line; the first rank whose error file says it was stopped (SIGTERM/SIGHUP/SIGINT); a rank torchrun's
    summary shows ended by a stop signal before it wrote one (CI once: rank 0 stopped, its peer's "Connection
    closed by peer" recorded first); and last a rank that only lost its peer, which always follows another's end."""
    with_file = {d for d, _ in errors}
    rank_dirs = sorted({p.parent for p in outcome.log_dir.glob("*/attempt_*/*/stderr.log")}, key=lambda d: int(d.name))
    for rank_dir in rank_dirs:
        error = None if rank_dir in with_file else last_error_line(_stderr_of(rank_dir))
        if error and not _PEER_LOST.search(error):
            return replace(outcome, rank=outcome._global(rank_dir), error=error)
    stopped = [(d, e) for d, e in errors if _code(e, outcome.returncode) in STOPPED_CODES]
    if stopped:
        return _recorded(outcome, *stopped[0])
    stops = {rank: signum for rank, code in summary_failures(torchrun_text).items() if (signum := _stop_signal(code))}
    if stops:
        rank = min(stops)
        signum = stops[rank]
        return replace(outcome, rank=rank, exit_code=128 + signum, error=f"stopped by {_signal_name(signum)}")
    return _recorded(outcome, *errors[0]) if errors else outcome
