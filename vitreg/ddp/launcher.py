"""Run a vitreg job under torchrun from a plain process (``--nproc N``), and the ranks' side of it.

The process the user started becomes the *launcher*: it holds the job's one MLflow run and goes through
:func:`check` -> :func:`launch` -> :func:`receive` (rank 0's hand-back, :mod:`vitreg.tracking.handoff`) ->
:func:`log` (a failure ends the run with the root cause, :mod:`vitreg.ddp.diagnose`, and that rank's status).
``python -m vitreg.ddp.launcher -- <python args>`` is the shim torchrun runs in every worker: it runs the
arguments as ``python`` would and writes a failure to torch elastic's error file. Several hosts use static
rendezvous, so node 0 holds global rank 0; a torchrun the user started has no launcher, and its rank 0 logs
into a run of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from vitreg.config.parse import options_to_args
from vitreg.ddp.diagnose import STOPPED_CODES, LaunchOutcome, diagnose, record_error
from vitreg.ddp.world import inside_torchrun, is_main_process
from vitreg.errors import VitregError

# In every worker's environment: the launch folder, where rank 0 hands its tracker calls back (its presence says
# a vitreg launcher holds the run), and the command the user typed, for report.md (a rank's own argv is the
# launcher's generated line with every option spelled out).
ENV_LAUNCH_DIR = "VITREG_LAUNCH_DIR"
ENV_COMMAND = "VITREG_LAUNCH_COMMAND"
_HANDOFF = "handoff"
_LOGS = "logs"
TORCHRUN_LOG = "torchrun.log"  # in the logs folder: torchrun's stderr, its own lines and the ranks' (tracebacks too)


class LaunchError(VitregError):
    """The workers failed: the message is the root cause, ``exit_code`` that worker's own status, ``run_status``
    KILLED for a stop signal's 128 + N (as for a stopped single-process job), else FAILED."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code if exit_code > 0 else 1
        self.run_status = "KILLED" if self.exit_code in STOPPED_CODES else "FAILED"


@dataclass(frozen=True)
class Placement:
    """``nnodes`` hosts, this one's ``node_rank``, node 0's ``rdzv_endpoint`` (HOST:PORT); default: this host."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    @property
    def run_node(self) -> int:
        """The node whose launcher holds the run: this one's rank when spread over hosts, else 0."""
        return self.node_rank if self.nnodes > 1 else 0


def needs_torchrun(nproc: int, nnodes: int = 1) -> bool:
    return nproc > 1 or nnodes != 1  # check_nodes() refuses nnodes < 1


def visible_gpu_count() -> int:
    """CUDA GPUs this process can see (honours CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_nproc(nproc: int, device: str, gpu_count: int) -> None:
    """Refuse more processes than GPUs; on the CPU any ``nproc`` is allowed (gloo processes, for tests and CI)."""
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
    if nnodes < 1:
        raise VitregError(f"nnodes={nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise VitregError(f"node_rank={node_rank} must be in 0..{nnodes - 1} (nnodes={nnodes})")
    if nnodes > 1 and not rdzv_endpoint:
        raise VitregError(f"nnodes={nnodes} needs rdzv_endpoint=HOST:PORT, the address of node 0 (node_rank=0) "
                          f"that every node can reach, e.g. rdzv_endpoint=10.0.0.1:29500")
    if rdzv_endpoint and not re.fullmatch(r"\[?[\w.\-:]+\]?:\d+", rdzv_endpoint):
        raise VitregError(f"rdzv_endpoint={rdzv_endpoint!r} is not HOST:PORT: pass e.g. rdzv_endpoint=10.0.0.1:29500")


# torchrun prefixes every console line of a worker with this: the ranks' output tells which rank said what
LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
LINE_PREFIX = "[rank${rank}]: "


def torchrun_command(argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, log_dir: str | None = None) -> list[str]:
    check_nodes(nnodes, node_rank, rdzv_endpoint)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")  # a private c10d store on a free port: no port clashes between jobs
    else:
        # static rendezvous: node_rank 0 hosts the store and global rank 0 (the rank that hands back the results)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--rdzv-endpoint={rdzv_endpoint}"]
    cmd.append("--max-restarts=0")  # a benchmark that failed once is not retried into a different number
    if log_dir:
        # every rank's output to the console and to log_dir (with its error file), for the root cause and the
        # artifacts; the "[rank<N>]: " prefix comes from LINE_PREFIX_ENV (launch), which torchrun reads since 2.2,
        # not --log-line-prefix-template (torch 2.11's torchrun hands that flag to the workers' python: exit 2)
        cmd += [f"--log-dir={log_dir}", "--tee=3"]
    # "--": torchrun's argparse would otherwise read the workers' options as its own abbreviations
    # (`--nproc` is ambiguous with its --nproc-per-node); the shim drops it.
    return cmd + ["-m", "vitreg.ddp.launcher", "--", *argv]


@contextlib.contextmanager
def launcher_run(run_name: str | None = None, experiment: str | None = None, node_rank: int = 0):
    """The launcher's MLflow run: node 0's, or the one ``mlflow run`` made for another node; else None."""
    from vitreg.tracking import runs as tracking

    if node_rank == 0 or tracking.requested_run_id():
        with tracking.tracked_run(run_name=run_name, experiment=experiment) as run:
            yield run
    else:
        yield None


@dataclass(frozen=True)
class JobLaunch:
    job: str  # the vitreg command the ranks run: "bench" or "train"
    options: dict  # the spec's fields, forwarded to every rank as they came
    run_name: str | None = None
    placement: Placement = Placement()
    command: str = ""  # what the user typed, for the ranks' report.md
    task: str = "train"
    cuda_graph: bool | None = None

    @property
    def argv(self) -> list[str]:
        argv = ["-m", "vitreg.cli", self.job, *options_to_args(self.options)]
        return argv + ["--run-name", self.run_name] if self.run_name else argv


def check(spec, placement: Placement) -> int:
    """The hosts, and ``nproc`` against the GPUs visible here (no GPU work); returns that count."""
    check_nodes(placement.nnodes, placement.node_rank, placement.rdzv_endpoint)
    gpus = visible_gpu_count()
    check_nproc(spec.nproc, spec.device, gpus)
    return gpus


@contextlib.contextmanager
def launch_job(run, spec, job: JobLaunch, progress):
    """:func:`launch`, :func:`receive`, :func:`log`; then yield rank 0's hand-off (its files last until the block
    ends). A failure raises :class:`LaunchError`; a node other than 0 then keeps its ranks' logs (no run does)."""
    from vitreg.tracking.handoff import HandoffReader

    folder = Path(tempfile.mkdtemp(prefix="vitreg-launch-"))
    reader = HandoffReader(folder / _HANDOFF)
    outcome = None
    try:
        started = time.monotonic()
        torchrun = launch(run, spec, job, folder, progress)
        try:
            returncode = receive(torchrun, reader, run, progress)
        except BaseException:  # the launcher was stopped (torchrun is, by now): the ranks' output still goes in
            if run is not None:
                with contextlib.suppress(Exception):  # never in the way of the stop itself
                    _log_rank_logs(run, diagnose(1, folder / _LOGS, spec.nproc, job.placement.node_rank, ""))
            raise
        outcome = diagnose(returncode, folder / _LOGS, spec.nproc, job.placement.node_rank,
                           _read(folder / _LOGS / TORCHRUN_LOG))
        log(run, reader, outcome, time.monotonic() - started, progress)
        yield reader.handoff
    finally:
        if outcome is None or outcome.ok or run is not None:
            shutil.rmtree(folder, ignore_errors=True)


def launch(run, spec, job: JobLaunch, folder: Path, progress) -> subprocess.Popen:
    """Label the run (a job whose ranks never log is still found), tell rank 0 its run, start torchrun."""
    from vitreg.tracking import handoff as handback
    from vitreg.tracking import runs as tracking
    from vitreg.tracking.tags import label_launcher_run

    label_launcher_run(run, spec, job.job, task=job.task, cuda_graph=job.cuda_graph)
    nnodes = job.placement.nnodes
    if run is not None:
        images = spec.nproc * nnodes * spec.batch_size if isinstance(spec.batch_size, int) else None
        progress(f"run {run.run_id} at {tracking.tracking_uri()}: {spec.nproc} process(es) per node x "
                 f"{nnodes} node(s) (DDP), batch_size={spec.batch_size} per process"
                 + (f" ({images} images per step)" if images else ""))
    handback.announce_run(folder / _HANDOFF, run.run_id if run else "", str(run.experiment_id) if run else "")
    env = {**tracking.without_requested_run(os.environ), ENV_LAUNCH_DIR: str(folder), ENV_COMMAND: job.command,
           LINE_PREFIX_ENV: LINE_PREFIX}
    cmd = torchrun_command(job.argv, spec.nproc, nnodes, job.placement.node_rank, job.placement.rdzv_endpoint,
                           str(folder / _LOGS))
    progress("launching: " + " ".join(shlex.quote(c) for c in cmd))
    (folder / _LOGS).mkdir(exist_ok=True)
    return _start_torchrun(cmd, env, folder / _LOGS / TORCHRUN_LOG)


def receive(torchrun: subprocess.Popen, reader, run, progress) -> int:
    """Wait for torchrun, logging rank 0's calls into ``run`` as they come; returns torchrun's status. Stopped or
    failing here, it stops torchrun first (SIGTERM: rank 0 hands back its last calls, which a stop then logs)."""
    try:
        while True:
            try:
                returncode = torchrun.wait(timeout=2.0)
                break
            except subprocess.TimeoutExpired:
                _replay_new(reader, run, progress)
    except BaseException as exc:
        from vitreg.signals import interrupted_reason

        stopped = isinstance(exc, KeyboardInterrupt) and interrupted_reason(exc)  # taken up: torchrun's stop answers it
        _stop_torchrun(torchrun)
        if stopped:
            _replay_new(reader, run, progress)
        raise
    torchrun.forwarder.join(5)  # the last of its stderr
    return returncode


def log(run, reader, outcome: LaunchOutcome, seconds: float, progress) -> None:
    """Log rank 0's last calls and every rank's output, whatever the outcome; raise :class:`LaunchError` if the
    ranks failed."""
    progress(f"torchrun {'finished' if outcome.ok else 'failed'} after {seconds:.1f} s")
    _replay_new(reader, run, progress)
    if run is not None:
        _log_rank_logs(run, outcome)
    if not outcome.ok:
        kept = f"artifacts torchrun/ of run {run.run_id}" if run is not None else str(outcome.log_dir)
        raise LaunchError(f"{outcome.message} (tracebacks and torchrun's output: {kept})", outcome.exit_code)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _replay_new(reader, run, progress) -> None:
    from vitreg.tracking import handoff as handback

    calls = reader.read_new()
    if run is not None:
        handback.replay(reader.directory, calls, run, progress)


def _log_rank_logs(run, outcome: LaunchOutcome) -> None:
    """``torchrun/rank<N>/stdout.log|stderr.log`` and ``torchrun/torchrun.log``."""
    for rank, files in outcome.rank_logs().items():
        for path in files.values():
            run.log_artifact(path, f"torchrun/rank{rank}")
    if (outcome.log_dir / TORCHRUN_LOG).is_file():
        run.log_artifact(outcome.log_dir / TORCHRUN_LOG, "torchrun")


# torchrun never outlives its launcher: a SIGKILLed launcher runs no clean-up, so the OS does it (parent-death
# signal SIGKILL for torchrun, SIGTERM for each worker shim; SIGTERM for torchrun sometimes hung with its ranks
# exited and never reaped, test_signals_ddp.py). Its stderr goes whole into ``torchrun.log``, and only the ranks'
# own lines, no tracebacks, to the console (:class:`_Forwarder`): the launcher's one line names the root cause.

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the OS send ``sig`` to this process when its parent dies (Linux); at once if it has died already."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


# "[rank1]: [rank1]: ...": torch 2.11's torchrun prefixes the lines it copies from a rank's log file again
_RANK_LINE = re.compile(rb"\[rank(\d+)\]: ?(?:\[rank\d+\]: ?)*(.*)", re.DOTALL)
#: the lines that open, or chain, a Python traceback
_TRACEBACK_OPENS = (b"Traceback (most recent call last):", b"During handling of the above exception",
                    b"The above exception was the direct cause")


class _Forwarder(threading.Thread):
    def __init__(self, stream, log_path: Path):
        super().__init__(name="vitreg-torchrun-stderr", daemon=True)
        self.stream, self.log_path = stream, log_path
        self._in_traceback: set[bytes] = set()  # the ranks whose stderr is inside a traceback

    def console_line(self, line: bytes) -> bytes | None:
        """A rank's line (one ``[rank<N>]:`` prefix); None for torchrun's own, a traceback's and ``error:`` lines."""
        rank_line = _RANK_LINE.match(line)
        if rank_line is None:
            return None
        rank, text = rank_line.groups()
        if text.startswith(_TRACEBACK_OPENS):
            self._in_traceback.add(rank)
            return None
        if rank in self._in_traceback:
            if text.strip() and not text[:1].isspace():  # frames and their source lines are indented
                self._in_traceback.discard(rank)  # the exception's own line ends it
            return None
        if not text.strip() or text.startswith(b"error: "):
            return None
        return b"[rank" + rank + b"]: " + text

    def run(self) -> None:
        with open(self.log_path, "ab") as log:
            for line in iter(self.stream.readline, b""):
                log.write(line)
                log.flush()
                shown = self.console_line(line)
                if shown is not None:
                    sys.stderr.buffer.write(shown)
                    sys.stderr.buffer.flush()


def _start_torchrun(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """Start torchrun to die with this process, its stderr forwarded. A stop signal during the fork would be
    dropped in the at-fork hooks (the job then ran to its end): it is held until torchrun exists."""
    from vitreg.signals import starting_a_process

    proc = None
    try:
        with starting_a_process():
            proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE,
                                    preexec_fn=functools.partial(die_with_parent, signal.SIGKILL))
            proc.forwarder = _Forwarder(proc.stderr, log_path)
            proc.forwarder.start()
    except KeyboardInterrupt:
        if proc is not None and hasattr(proc, "forwarder"):
            _stop_torchrun(proc)
        raise
    return proc


def stop_child(proc: subprocess.Popen, grace_s: float, sig: int | None = signal.SIGTERM) -> None:
    """``sig`` to a child (None: it was asked to end otherwise), SIGKILL if it is still there after ``grace_s``."""
    if sig is not None and proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _stop_torchrun(proc: subprocess.Popen) -> None:
    """SIGTERM (each rank stops cleanly), SIGKILL after 60 s; then the last of its stderr forwarded."""
    stop_child(proc, 60.0)
    proc.forwarder.join(5)


def launched_by_vitreg() -> bool:
    return inside_torchrun() and bool(os.environ.get(ENV_LAUNCH_DIR))


def typed_command(given: str | None = None) -> str:
    """The command the user typed: the launcher's, in a rank it started; else ``given``; else this argv."""
    if launched_by_vitreg() and os.environ.get(ENV_COMMAND):
        return os.environ[ENV_COMMAND]
    return given or shlex.join(sys.argv)


@contextlib.contextmanager
def rank_run(run_name: str | None = None, experiment: str | None = None):
    """A NullTracker on ranks other than 0; on rank 0 a HandoffTracker under a vitreg launcher (no MLflow here),
    else a run of its own."""
    from vitreg.tracking import runs as tracking

    if not is_main_process():
        yield tracking.NullTracker()
    elif launched_by_vitreg():
        from vitreg.tracking.handoff import HandoffTracker

        yield HandoffTracker(Path(os.environ[ENV_LAUNCH_DIR]) / _HANDOFF)
    else:
        with tracking.tracked_run(run_name=run_name, experiment=experiment) as run:
            yield run


def _run_python(argv: list[str]) -> None:
    import runpy

    if argv[:1] == ["-m"] and len(argv) >= 2:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")
    else:
        raise SystemExit("usage: python -m vitreg.ddp.launcher (-m module | script.py) [args...]")


def worker_main(argv: list[str]) -> int:
    """The worker shim: run ``argv`` as ``python <argv>`` would; return its exit status. A failure goes to the
    worker's error file too (vitreg's CLI has already written its own ``error: ...`` there)."""
    import traceback

    if argv[:1] == ["--"]:
        argv = argv[1:]
    die_with_parent()  # torchrun gone (SIGKILLed with its launcher): this rank stops too
    try:
        _run_python(argv)
        return 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        if status:
            record_error("", status)  # the message is the last error line of its stderr
        return status
    except BaseException as exc:  # noqa: BLE001 - print it as Python would, and record it
        traceback.print_exc()
        status = 130 if isinstance(exc, KeyboardInterrupt) else 1
        record_error(f"{type(exc).__name__}: {exc}", status, traceback.format_exc())
        return status
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    from vitreg.signals import freeze_at_exit

    freeze_at_exit()  # before the worker's own imports (torch, mlflow): their exit handlers run first
    sys.exit(worker_main(sys.argv[1:]))
