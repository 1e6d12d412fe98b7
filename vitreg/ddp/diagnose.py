"""Why a torchrun job failed: the root-cause rank, its one-line error and its own exit status.

A failing worker writes torch elastic's error file (:func:`record_error`); the first one written names the root
cause. The survivors torchrun then stops record "stopped by SIGTERM": consequences, named only when no rank failed
on its own. A worker SIGKILLed (the OOM killer) writes nothing and its peers report a lost connection: torchrun's
failure summary (``torchrun.log``) then gives each rank's exit status, else a rank's stderr names the cause. A lost
peer follows another rank's end, so it is named only when nothing else is.
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
    """In a torchrun worker: this worker's failure into its error file; the first one recorded wins."""
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
    """The last line of a worker's stderr stating an error (vitreg's ``error: ...`` or a traceback's last)."""
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
    return {int(rank): int(code) for rank, code in _SUMMARY_FAILURE.findall(torchrun_text)}


def killed_ranks(torchrun_text: str) -> dict[int, int]:
    """The failed ranks killed by a signal no handler caught (SIGKILL, SIGSEGV...), not torchrun's SIGTERM."""
    return {rank: code for rank, code in summary_failures(torchrun_text).items()
            if code < 0 and code not in _NOT_TORCHRUN_S_STOP}


def _stop_signal(code: int) -> int | None:
    """The stop signal an exit status says a rank ended by (143 or -15: SIGTERM), else None."""
    if code in STOPPED_CODES:
        return code - 128
    return -code if code in _NOT_TORCHRUN_S_STOP else None


@dataclass(frozen=True)
class LaunchOutcome:
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
        out: dict[int, dict[str, Path]] = {}
        for path in sorted(self.log_dir.glob("*/attempt_*/*/std*.log")):
            out.setdefault(self._global(path.parent), {})[path.stem] = path
        return out

    def _global(self, rank_dir: Path) -> int:
        return self.node_rank * self.nproc + int(rank_dir.name)  # static rendezvous: node-major ranks


def _error_files(log_dir: Path) -> list[tuple[float, Path, dict]]:
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
    message = error.get("message") or last_error_line(_stderr_of(rank_dir))
    return replace(outcome, exit_code=_code(error, outcome.returncode), rank=outcome._global(rank_dir), error=message)


def diagnose(returncode: int, log_dir: Path, nproc: int, node_rank: int = 0, torchrun_text: str = "") -> LaunchOutcome:
    """The root cause of a failed job, first found of: torchrun stopped by a signal; the first error file of a
    rank that failed on its own (not stopped, not a lost peer); a rank killed by a signal no handler caught;
    then what :func:`_first_stop` finds."""
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
    """No rank failed on its own: a rank without an error file whose stderr ends with an error; the first rank
    recorded as stopped; a rank the summary shows ended by a stop signal before it wrote one (rank 0
    stopped while its peer's "closed by peer" was recorded first); last a rank that only lost its peer."""
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
