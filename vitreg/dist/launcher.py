"""Start a vitreg job under torchrun from a plain process (``-P nproc=N`` / ``--nproc N``).

The process the user started (``vitreg bench``, ``mlflow run -e bench``) becomes the *launcher*: it
re-executes the same command as ``python -m torch.distributed.run ... -m vitreg.dist.launcher -- -m
vitreg.cli bench <the same options>``, with its environment preserved (``MLFLOW_*``,
``NCCL_NVLS_ENABLE=0``, ``CUDA_VISIBLE_DEVICES``...), waits, and returns the exit status. It owns
the MLflow run (see :func:`launch_tracked`): the workers resume it through ``MLFLOW_RUN_ID``, and
if they die without ending it, the launcher marks it FAILED with the root cause.

``python -m vitreg.dist.launcher -- <python args>`` is the thin shim torchrun runs in every worker: it
runs ``<python args>`` (``-m module args...`` or ``script.py args...``) as ``python`` would and
records the worker's exit status in the launch directory. torchrun itself exits 1 whatever its
workers returned, so the launcher recovers the root cause's own status (2 for a VitregError) from
torchrun's failure summary, or failing that from these records.

Single host: ``torchrun --standalone --nproc-per-node N``. Several hosts: the same command on
every host with ``nnodes``, that host's ``node_rank`` and one ``rdzv_endpoint`` (``HOST:PORT`` of
node 0); static rendezvous, so node 0 holds global rank 0, the only rank that logs.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from vitreg.config.options import options_to_args  # noqa: F401 - the jobs build the ranks' argv with it
from vitreg.dist.world import inside_torchrun
from vitreg.errors import VitregError

# Set by the launcher in every worker's environment: where the workers write their exit status.
# Its presence also tells a worker that a vitreg launcher owns the run (and samples system metrics).
ENV_LAUNCH_DIR = "VITREG_LAUNCH_DIR"
_EXIT_DIR = "exit"


class LaunchError(VitregError):
    """The workers failed. The message is the root cause; ``exit_code`` is that worker's own status."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code if exit_code > 0 else 1


def launched_by_vitreg() -> bool:
    """True in a worker of :func:`launch_torchrun` (the launcher owns the run and its system metrics)."""
    return inside_torchrun() and bool(os.environ.get(ENV_LAUNCH_DIR))


def wants_torchrun(options: dict, nnodes: int = 1) -> bool:
    """True when this process must launch the ranks: ``nproc > 1`` (or several hosts), not yet under torchrun.

    An ``nproc`` that does not parse gives False: the single-process path reports it, inside its
    run, as for any bad option.
    """
    if inside_torchrun():
        return False
    if nnodes != 1:
        return True  # check_nodes() in the launcher refuses nnodes < 1
    from vitreg.config.spec import parse_int

    try:
        return parse_int(1 if options.get("nproc") is None else options["nproc"], "nproc", 1) > 1
    except VitregError:
        return False


def visible_gpu_count() -> int:
    """CUDA GPUs this process can see (honours CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_nproc(nproc: int, device: str, gpu_count: int) -> None:
    """Refuse more processes than GPUs, before launching anything.

    ``device`` is the requested one (auto/cuda/cpu). On the CPU (``device=cpu``, or ``auto`` on a
    host without GPUs) any ``nproc`` is allowed: gloo processes, for tests and CI.
    """
    if nproc <= 1 or device == "cpu":
        return
    if gpu_count == 0:
        if device == "cuda":
            raise VitregError(f"nproc={nproc} with device=cuda but no CUDA GPU is visible: use device=cpu "
                              f"(gloo processes) or check the driver / CUDA_VISIBLE_DEVICES")
        return  # auto on a CPU-only host: the workers will run on the CPU with gloo
    if nproc > gpu_count:
        gpus = "1 CUDA GPU is" if gpu_count == 1 else f"{gpu_count} CUDA GPUs are"
        raise VitregError(f"nproc={nproc} but only {gpus} visible: use nproc<={gpu_count}")


def check_nodes(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    """Check the multi-host options: ``nnodes>1`` needs the rendezvous endpoint and a valid node rank."""
    if nnodes < 1:
        raise VitregError(f"nnodes={nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise VitregError(f"node_rank={node_rank} must be in 0..{nnodes - 1} (nnodes={nnodes})")
    if nnodes > 1 and not rdzv_endpoint:
        raise VitregError(f"nnodes={nnodes} needs rdzv_endpoint=HOST:PORT, the address of node 0 (node_rank=0) "
                          f"that every node can reach, e.g. rdzv_endpoint=10.0.0.1:29500")
    if rdzv_endpoint and not re.fullmatch(r"\[?[\w.\-:]+\]?:\d+", rdzv_endpoint):
        raise VitregError(f"rdzv_endpoint={rdzv_endpoint!r} is not HOST:PORT: pass e.g. rdzv_endpoint=10.0.0.1:29500")


# torchrun prefixes every console line of a worker with this (the launcher's diagnosis reads it)
LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
LINE_PREFIX = "[rank${rank}]: "


def torchrun_command(argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, log_dir: str | None = None) -> list[str]:
    """The torchrun command line that runs ``argv`` (python arguments) through the worker shim."""
    check_nodes(nnodes, node_rank, rdzv_endpoint)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")  # a private c10d store on a free port: no port clashes between jobs
    else:
        # static rendezvous: node_rank 0 hosts the store and global rank 0 (the rank that logs)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--rdzv-endpoint={rdzv_endpoint}"]
    cmd.append("--max-restarts=0")  # a benchmark that failed once is not retried into a different number
    if log_dir:
        # every rank's output goes to the console and to log_dir, where the launcher finds the root
        # cause of a failure and from where it logs them as artifacts. The "[rank<N>]: " prefix of
        # each console line is set by LINE_PREFIX_ENV in launch_torchrun's environment: torchrun
        # reads that variable in every version since 2.2, while its --log-line-prefix-template flag
        # is recent (torch 2.11's torchrun hands the unknown flag to the workers' python, which exits 2).
        cmd += [f"--log-dir={log_dir}", "--tee=3"]
    # "--": torchrun's argparse would otherwise read the workers' options as its own abbreviations
    # (`--nproc` is ambiguous with its --nproc-per-node); the shim drops it.
    return cmd + ["-m", "vitreg.dist.launcher", "--", *argv]


# --------------------------------------------------------------------------------------------
# the outcome of a launch


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


@dataclass(frozen=True)
class LaunchOutcome:
    """What became of a torchrun job, as seen from this host's launcher."""

    returncode: int  # torchrun's own status (1 whenever a worker failed)
    exit_code: int  # the status to exit with: the root-cause worker's own one where it recorded it
    rank: int | None  # the root-cause rank (global), if one could be named
    error: str | None  # its last error line
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
            return (f"torchrun exited with status {self.returncode} and no rank reported an error (a rendezvous "
                    f"or launch failure, or ranks killed by a signal such as the OOM killer's): see the output above")
        if self.error:
            return f"rank {self.rank}: {self.error}"
        return f"rank {self.rank} exited with status {self.exit_code} without an error message (killed?)"

    def rank_logs(self) -> dict[int, dict[str, Path]]:
        """``{global_rank: {"stdout": path, "stderr": path}}`` of the files torchrun wrote."""
        out: dict[int, dict[str, Path]] = {}
        for path in sorted(self.log_dir.glob("*/attempt_*/*/std*.log")):
            rank = self.node_rank * self.nproc + int(path.parent.name)  # static rendezvous: node-major ranks
            out.setdefault(rank, {})[path.stem] = path
        return out


def _read_exits(log_dir: Path) -> dict[int, dict]:
    exits = {}
    for path in (log_dir / _EXIT_DIR).glob("rank*.json"):
        try:
            rec = json.loads(path.read_text())
            exits[int(rec["rank"])] = rec
        except (ValueError, KeyError, OSError):
            continue
    return exits


def _stderr_of(log_dir: Path, local_rank: int) -> str:
    texts = [p.read_text(errors="replace") for p in sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"))]
    return "\n".join(texts)


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)"
                         r".*?exitcode\s*:\s*(-?\d+)", re.S)


def parse_root_cause(torchrun_stderr: str) -> tuple[int, int, int] | None:
    """``(rank, local_rank, exitcode)`` of the "Root Cause (first observed failure)" block that torchrun
    prints when a worker fails (exitcode < 0: killed by that signal); None if there is none."""
    found = _ROOT_CAUSE.findall(torchrun_stderr or "")
    if not found:
        return None
    rank, local_rank, code = found[-1]
    return int(rank), int(local_rank), int(code)


def _signal_name(code: int) -> str:
    import signal

    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def diagnose(returncode: int, log_dir: Path, nproc: int, node_rank: int = 0, torchrun_stderr: str = "") -> LaunchOutcome:
    """Name the root cause of a failed job and its last error line.

    The root cause is, in order of trust: (1) the worker torchrun itself names as the first
    observed failure (it sees workers killed by a signal too: the OOM killer, a segfault);
    (2) the worker whose own exit record (written by the shim) says it failed first; (3) rank 0,
    or the first rank, whose stderr ends with an error. The error line comes from that worker's
    stderr log: vitreg's ``error: ...`` or a traceback's last line.
    """
    log_dir = Path(log_dir)
    if returncode == 0:
        return LaunchOutcome(0, 0, None, None, log_dir, nproc, node_rank)
    root = parse_root_cause(torchrun_stderr)
    if root is not None:
        rank, local, code = root
        error = last_error_line(_stderr_of(log_dir, local))
        if error is None and code < 0:
            error = f"killed by {_signal_name(code)}"
        return LaunchOutcome(returncode, code if code > 0 else returncode, rank, error, log_dir, nproc, node_rank)
    exits = _read_exits(log_dir)
    failed = sorted((rec["time"], rank, rec) for rank, rec in exits.items() if rec.get("exit_code"))
    if failed:
        _, rank, rec = failed[0]
        error = last_error_line(_stderr_of(log_dir, int(rec["local_rank"])))
        return LaunchOutcome(returncode, int(rec["exit_code"]), rank, error, log_dir, nproc, node_rank)
    finished = {rec["local_rank"] for rec in exits.values() if rec.get("exit_code") == 0}
    for local in range(nproc):  # rank 0 first
        error = None if local in finished else last_error_line(_stderr_of(log_dir, local))
        if error:
            return LaunchOutcome(returncode, returncode, node_rank * nproc + local, error, log_dir, nproc, node_rank)
    return LaunchOutcome(returncode, returncode, None, None, log_dir, nproc, node_rank)


# --------------------------------------------------------------------------------------------
# launching


def launch_torchrun(argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                    rdzv_endpoint: str | None = None, env: dict | None = None, log_dir: str | None = None,
                    progress=None) -> LaunchOutcome:
    """Run ``argv`` (python arguments: ``["-m", "vitreg.cli", "bench", ...]`` or ``["script.py", ...]``)
    in ``nproc`` workers per node under torchrun; wait; return the :class:`LaunchOutcome`.

    The workers inherit this process's environment plus ``env``. Ctrl-C (or any exception here)
    stops torchrun, which stops its workers, before it propagates.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vitreg-torchrun-"))
    (log_dir / _EXIT_DIR).mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(argv, nproc, nnodes, node_rank, rdzv_endpoint, str(log_dir))
    child_env = {**os.environ, **(env or {}), ENV_LAUNCH_DIR: str(log_dir), LINE_PREFIX_ENV: LINE_PREFIX}
    if progress:
        progress("launching: " + " ".join(shlex.quote(c) for c in cmd))
    # torchrun's stderr (its own messages and the workers' tee'd stderr) passes through this
    # process to ours, line by line; the tail is kept for torchrun's failure summary.
    proc = subprocess.Popen(cmd, env=child_env, stderr=subprocess.PIPE)
    tail: collections.deque = collections.deque(maxlen=400)
    relay = threading.Thread(target=_relay, args=(proc.stderr, tail), daemon=True)
    relay.start()
    try:
        returncode = proc.wait()
        relay.join(timeout=10)
    except BaseException:
        proc.terminate()  # torchrun turns SIGTERM into stopping its workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    return diagnose(returncode, log_dir, nproc, node_rank, "".join(tail))


def _relay(stream, tail) -> None:
    out = getattr(sys.stderr, "buffer", None)
    for raw in iter(stream.readline, b""):
        tail.append(raw.decode(errors="replace"))
        try:
            if out is not None:
                out.write(raw)
                out.flush()
            else:  # a replaced sys.stderr (pytest, click's runner): text only
                sys.stderr.write(raw.decode(errors="replace"))
                sys.stderr.flush()
        except (OSError, ValueError):
            pass  # our stderr is gone; keep draining so torchrun never blocks on a full pipe
    stream.close()


def relaunch_under_torchrun(argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                            rdzv_endpoint: str | None = None) -> int:
    """Re-execute ``argv`` under torchrun with this environment; return the exit status to use.

    The status is the root-cause worker's own (2 for a VitregError), not torchrun's blanket 1.
    Tracking-free; :func:`launch_tracked` is the variant that owns an MLflow run.
    """
    outcome = launch_torchrun(argv, nproc, nnodes, node_rank, rdzv_endpoint)
    try:
        if not outcome.ok:
            print(f"error: {outcome.message}", file=sys.stderr)
        return outcome.exit_code
    finally:
        shutil.rmtree(outcome.log_dir, ignore_errors=True)


@contextlib.contextmanager
def launcher_run(run_name: str | None = None, experiment: str | None = None, node_rank: int = 0):
    """The launcher's MLflow run: yields a Tracker, or None on a node other than 0.

    The ranks log into one run, node 0's (global rank 0 lives there), which this opens (or resumes,
    under ``mlflow run``) with system metrics: the launcher lives as long as the job, so its
    sampler covers it all. Another node's launcher opens no run, unless ``mlflow run`` already made
    one for it, which must then end too. Errors inside end the run FAILED (``vitreg_error``).
    """
    from vitreg.tracking import runs as tracking

    if node_rank == 0 or os.environ.get("MLFLOW_RUN_ID"):
        with tracking.tracked_run(run_name=run_name, experiment=experiment) as run:
            yield run
    else:
        yield None


def launch_tracked(argv: list[str], nproc: int, run=None, nnodes: int = 1, node_rank: int = 0,
                   rdzv_endpoint: str | None = None, progress=None) -> LaunchOutcome:
    """Launch ``argv`` under torchrun as part of ``run`` (a :class:`vitreg.tracking.runs.Tracker`), or of
    no run (``None``: a node other than 0 of a multi-host job).

    The workers get ``MLFLOW_RUN_ID`` (and the tracking URI and experiment) so they resume this one
    run; rank 0 logs into it, the others do not. Every rank's output is logged to the run as
    ``torchrun/rank<N>/stdout.log|stderr.log``. On failure raises :class:`LaunchError` (the
    surrounding ``tracked_run`` then ends the run FAILED with the root cause in ``vitreg_error``).
    """
    from vitreg.tracking import runs as tracking

    env = {}
    if run is not None and run.run_id:
        env = {"MLFLOW_RUN_ID": run.run_id, "MLFLOW_EXPERIMENT_ID": str(run.experiment_id),
               "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI") or tracking.tracking_uri()}
    started = time.monotonic()
    outcome = launch_torchrun(argv, nproc, nnodes, node_rank, rdzv_endpoint, env=env, progress=progress)
    try:
        if run is not None:
            _log_rank_logs(run, outcome)
    finally:
        if run is not None or outcome.ok:
            shutil.rmtree(outcome.log_dir, ignore_errors=True)
        elif progress:
            progress(f"the ranks' logs are in {outcome.log_dir}")
    if progress:
        progress(f"torchrun {'finished' if outcome.ok else 'failed'} after {time.monotonic() - started:.1f} s")
    if not outcome.ok:
        raise LaunchError(outcome.message, outcome.exit_code)
    return outcome


def _log_rank_logs(run, outcome: LaunchOutcome) -> None:
    with tempfile.TemporaryDirectory(prefix="vitreg-ranklogs-") as tmp:
        for rank, files in outcome.rank_logs().items():
            dst = Path(tmp) / f"rank{rank}"
            dst.mkdir(parents=True, exist_ok=True)
            for name, path in files.items():
                shutil.copyfile(path, dst / f"{name}.log")
        if any(Path(tmp).iterdir()):
            run.log_artifacts(tmp, "torchrun")


# --------------------------------------------------------------------------------------------
# the worker shim: python -m vitreg.dist.launcher <python args>


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1


def worker_main(argv: list[str]) -> int:
    """Run ``argv`` as ``python <argv>`` would, in this process; record the exit status; return it."""
    import runpy
    import traceback

    status = 1
    if argv[:1] == ["--"]:
        argv = argv[1:]
    try:
        if argv[:1] == ["-m"] and len(argv) >= 2:
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            raise SystemExit("usage: python -m vitreg.dist.launcher (-m module | script.py) [args...]")
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        status = 130
    except BaseException:  # noqa: BLE001 - print it as Python would, and record the status
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _record_exit(status)
    return status


def _record_exit(status: int) -> None:
    launch_dir = os.environ.get(ENV_LAUNCH_DIR)
    if not launch_dir:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "exit_code": status,
              "time": time.time()}
    path = Path(launch_dir) / _EXIT_DIR / f"rank{rank}.json"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError:
        pass  # the launcher then falls back to the logs


if __name__ == "__main__":
    from vitreg import freeze_at_exit

    freeze_at_exit()  # before the worker's own imports (torch, mlflow): their exit handlers run first
    sys.exit(worker_main(sys.argv[1:]))
