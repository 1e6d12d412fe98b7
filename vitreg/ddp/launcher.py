"""Run a vitreg job under torchrun from a plain process (``-P nproc=N`` / ``--nproc N``), and the ranks' side of it.

The process the user started (``vitreg bench``, ``mlflow run -e bench``) becomes the *launcher*: it
holds the job's one MLflow run (:func:`launcher_run`), runs the same command under ``python -m
torch.distributed.run ... -m vitreg.ddp.launcher -- -m vitreg.cli bench <the same options>`` with
a launch folder of its own (:func:`launched`), waits, and logs what came back. No rank talks to
MLflow: rank 0 writes its tracker calls into the launch folder (:mod:`vitreg.tracking.handoff`), the
other ranks log nothing (:func:`rank_run`); the launcher replays rank 0's calls and the ranks' logs
into its run, and ends it FAILED with the root cause (:mod:`vitreg.ddp.diagnose`) if they failed.

``python -m vitreg.ddp.launcher -- <python args>`` is the thin shim torchrun runs in every worker: it
runs ``<python args>`` (``-m module args...`` or ``script.py args...``) as ``python`` would and
writes a failure to the worker's torch elastic error file. torchrun itself exits 1 whatever its
workers returned; the launcher passes on the root cause's own status (2 for a VitregError).

Single host: ``torchrun --standalone --nproc-per-node N``. Several hosts: the same command on
every host with ``nnodes``, that host's ``node_rank`` and one ``rdzv_endpoint`` (``HOST:PORT`` of
node 0); static rendezvous, so node 0 holds global rank 0, whose launcher holds the run. A torchrun
the user started themselves has no vitreg launcher: there rank 0 logs into a run of its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vitreg.config.parse import options_to_args
from vitreg.ddp import supervise
from vitreg.ddp.diagnose import LaunchOutcome, diagnose, record_error
from vitreg.ddp.world import inside_torchrun, is_main_process
from vitreg.errors import VitregError

# Set by the launcher in every worker's environment: the launch folder, where rank 0 hands its
# tracker calls back. Its presence tells a worker that a vitreg launcher holds the run.
ENV_LAUNCH_DIR = "VITREG_LAUNCH_DIR"
# ... and the command the user typed (``mlflow run . -e bench -P nproc=2``), which report.md shows:
# a rank's own argv is the launcher's generated ``vitreg bench`` line with every option spelled out.
ENV_COMMAND = "VITREG_LAUNCH_COMMAND"
_HANDOFF = "handoff"
_LOGS = "logs"


class LaunchError(VitregError):
    """The workers failed. The message is the root cause; ``exit_code`` is that worker's own status."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code if exit_code > 0 else 1


@dataclass(frozen=True)
class Placement:
    """Where a DDP job's processes run: ``nnodes`` hosts, this one ``node_rank``, and node 0's
    ``rdzv_endpoint`` (HOST:PORT). The default is this host alone."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    def check(self) -> None:
        check_nodes(self.nnodes, self.node_rank, self.rdzv_endpoint)

    @property
    def run_node(self) -> int:
        """The node whose launcher holds the run: this one's rank when spread over hosts, else 0."""
        return self.node_rank if self.nnodes > 1 else 0


def needs_torchrun(nproc: int, nnodes: int = 1) -> bool:
    """The plan of a parsed job: torchrun for ``nproc > 1`` or several hosts, else this one process."""
    return nproc > 1 or nnodes != 1  # check_nodes() refuses nnodes < 1


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


# torchrun prefixes every console line of a worker with this: the ranks' output tells which rank said what
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
        # static rendezvous: node_rank 0 hosts the store and global rank 0 (the rank that hands back the results)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--rdzv-endpoint={rdzv_endpoint}"]
    cmd.append("--max-restarts=0")  # a benchmark that failed once is not retried into a different number
    if log_dir:
        # every rank's output goes to the console and to log_dir (with each worker's error file),
        # where the launcher finds the root cause of a failure and from where it logs them as artifacts. The "[rank<N>]: " prefix of
        # each console line is set by LINE_PREFIX_ENV in launch_torchrun's environment: torchrun
        # reads that variable in every version since 2.2, while its --log-line-prefix-template flag
        # is recent (torch 2.11's torchrun hands the unknown flag to the workers' python, which exits 2).
        cmd += [f"--log-dir={log_dir}", "--tee=3"]
    # "--": torchrun's argparse would otherwise read the workers' options as its own abbreviations
    # (`--nproc` is ambiguous with its --nproc-per-node); the shim drops it.
    return cmd + ["-m", "vitreg.ddp.launcher", "--", *argv]


# --------------------------------------------------------------------------------------------
# launching


def launch_torchrun(argv: list[str], nproc: int, placement: Placement = Placement(), env: dict | None = None,
                    log_dir: str | None = None, progress=None, while_running=None,
                    poll_s: float = 2.0) -> LaunchOutcome:
    """Run ``argv`` (python arguments: ``["-m", "vitreg.cli", "bench", ...]`` or ``["script.py", ...]``)
    in ``nproc`` workers per node under torchrun; wait; return the :class:`LaunchOutcome`.

    The workers get ``env`` (this process's environment by default). ``while_running()`` is called
    every ``poll_s`` seconds until torchrun exits. Ctrl-C (or any exception here, one of
    ``while_running`` included) stops torchrun, which stops its workers, before it propagates.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vitreg-torchrun-"))
    cmd = torchrun_command(argv, nproc, placement.nnodes, placement.node_rank, placement.rdzv_endpoint, str(log_dir))
    if progress:
        progress("launching: " + " ".join(shlex.quote(c) for c in cmd))
    # dies with this process (SIGKILL too); its stderr forwarded, without its traceback once stopped
    proc = supervise.start(cmd, {**(os.environ if env is None else env), LINE_PREFIX_ENV: LINE_PREFIX})
    try:
        while True:
            try:
                returncode = proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                if while_running:
                    while_running()
    except BaseException:
        supervise.stop(proc)  # SIGTERM: the workers stop cleanly (rank 0 hands its last calls back)
        raise
    supervise.finish(proc)
    return diagnose(returncode, log_dir, nproc, placement.node_rank)


@contextlib.contextmanager
def launcher_run(run_name: str | None = None, experiment: str | None = None, node_rank: int = 0):
    """The launcher's MLflow run: yields its tracker, or None on a node other than 0.

    Node 0's launcher (global rank 0 lives there) opens the job's one run (or resumes ``mlflow
    run``'s) with system metrics: it lives as long as the job, so its sampler covers it all.
    Another node's launcher opens no run, unless ``mlflow run`` already made one for it, which
    must then end too. Errors inside end the run FAILED (``vitreg_error``).
    """
    from vitreg.tracking import runs as tracking

    if node_rank == 0 or tracking.requested_run_id():
        with tracking.tracked_run(run_name=run_name, experiment=experiment) as run:
            yield run
    else:
        yield None


@contextlib.contextmanager
def launched(argv: list[str], nproc: int, run=None, placement: Placement = Placement(), progress=None,
             command: str = ""):
    """Run ``argv`` under torchrun for ``run`` (the launcher's tracker; None on a node other than 0)
    and yield what rank 0 handed back (a :class:`vitreg.tracking.handoff.Handoff`, whose files last
    until the block ends).

    Rank 0's calls are logged to ``run`` as they come (every few seconds) and every rank's output
    (``torchrun/rank<N>/stdout.log|stderr.log``) at the end, whatever the outcome. On failure raises
    :class:`LaunchError` with the root cause (the surrounding ``tracked_run`` then ends the run
    FAILED with it in ``vitreg_error``). ``command``: what the user typed, for the ranks' report.md.
    """
    from vitreg.tracking import handoff as handback
    from vitreg.tracking import runs as tracking

    launch_dir = Path(tempfile.mkdtemp(prefix="vitreg-launch-"))
    handed = handback.HandoffReader(launch_dir / _HANDOFF)
    keep_logs = False

    def log_handed() -> None:  # rank 0's calls so far, into the run (none on a node other than 0)
        calls = handed.read_new()
        if run is not None:
            handback.replay(handed.directory, calls, run, progress or (lambda message: None))

    try:
        handback.announce_run(handed.directory, run.run_id if run else "", str(run.experiment_id) if run else "")
        env = {**tracking.without_requested_run(os.environ), ENV_LAUNCH_DIR: str(launch_dir), ENV_COMMAND: command}
        started = time.monotonic()
        try:
            outcome = launch_torchrun(argv, nproc, placement, env, str(launch_dir / _LOGS), progress,
                                      while_running=log_handed)
        except KeyboardInterrupt:  # stopped (Ctrl-C, SIGTERM...): rank 0's last calls still reach the run
            log_handed()  # its final checkpoint, points and results, before the run ends KILLED
            raise
        if progress:
            progress(f"torchrun {'finished' if outcome.ok else 'failed'} after {time.monotonic() - started:.1f} s")
        log_handed()
        if run is not None:
            _log_rank_logs(run, outcome)
        if not outcome.ok:
            keep_logs = run is None
            if keep_logs and progress:
                progress(f"the ranks' logs are in {outcome.log_dir}")
            raise LaunchError(outcome.message, outcome.exit_code)
        yield handed.handoff
    finally:
        if not keep_logs:
            shutil.rmtree(launch_dir, ignore_errors=True)


@dataclass(frozen=True)
class JobLaunch:
    """One DDP job's launcher, the same eight steps for bench and train (:func:`launch_job`); what
    differs is in the hooks. ``check(gpus)``: the job's own checks that need no GPU work (model name,
    host memory of every rank, data layout, ...), given the GPUs visible here; ``handed(handoff)``:
    what to do with what rank 0 handed back, inside the launch (scaling efficiency, registration)."""

    job: str  # the vitreg command the ranks run: "bench" or "train"
    options: dict  # the spec's fields, forwarded to every rank as they came
    run_name: str | None = None
    placement: Placement = Placement()
    command: str = ""  # what the user typed, for the ranks' report.md
    task: str = "train"
    cuda_graph: bool | None = None
    check: Callable[[int], None] = lambda gpus: None
    handed: Callable = lambda handoff: None


def launch_job(run, spec, job: JobLaunch, progress) -> None:
    """The launcher (``run`` is None on a node other than 0): checks that need no GPU, the run's labels,
    torchrun with the same command in every rank, then ``job.handed`` with what rank 0 handed back."""
    from vitreg.tracking import runs as tracking
    from vitreg.tracking.tags import label_launcher_run

    job.placement.check()
    gpus = visible_gpu_count()
    check_nproc(spec.nproc, spec.device, gpus)
    job.check(gpus)
    label_launcher_run(run, spec, job.job, task=job.task, cuda_graph=job.cuda_graph)
    argv = ["-m", "vitreg.cli", job.job, *options_to_args(job.options)]
    if job.run_name:
        argv += ["--run-name", job.run_name]
    if run is not None:
        images = spec.nproc * job.placement.nnodes * spec.batch_size if isinstance(spec.batch_size, int) else None
        progress(f"run {run.run_id} at {tracking.tracking_uri()}: {spec.nproc} process(es) per node x "
                 f"{job.placement.nnodes} node(s) (DDP), batch_size={spec.batch_size} per process"
                 + (f" ({images} images per step)" if images else ""))
    with launched(argv, spec.nproc, run, job.placement, progress, job.command) as handed:
        job.handed(handed)


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
# the ranks' side


def launched_by_vitreg() -> bool:
    """True in a worker of :func:`launched` (the launcher holds the run and its system metrics)."""
    return inside_torchrun() and bool(os.environ.get(ENV_LAUNCH_DIR))


def typed_command(given: str | None = None) -> str:
    """The command the user typed: the launcher's, in a rank it started; else ``given``; else this
    process's argv."""
    if launched_by_vitreg() and os.environ.get(ENV_COMMAND):
        return os.environ[ENV_COMMAND]
    return given or shlex.join(sys.argv)


@contextlib.contextmanager
def rank_run(run_name: str | None = None, experiment: str | None = None):
    """The tracker of one process of a job.

    Under a vitreg launcher: rank 0's calls go to the launcher (a HandoffTracker), the other ranks
    get a NullTracker; nothing here talks to MLflow. A plain process, or a torchrun the user
    started: a run of its own (``tracked_run``) on rank 0, a NullTracker on the other ranks.
    """
    from vitreg.tracking import runs as tracking

    if not is_main_process():
        yield tracking.NullTracker()
    elif launched_by_vitreg():
        from vitreg.tracking.handoff import HandoffTracker

        yield HandoffTracker(Path(os.environ[ENV_LAUNCH_DIR]) / _HANDOFF)
    else:
        with tracking.tracked_run(run_name=run_name, experiment=experiment) as run:
            yield run


# --------------------------------------------------------------------------------------------
# the worker shim: python -m vitreg.ddp.launcher <python args>


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1


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
    """Run ``argv`` as ``python <argv>`` would, in this process; return its exit status. A failure goes
    to the worker's error file too (vitreg's CLI has already written its own ``error: ...`` there)."""
    import traceback

    if argv[:1] == ["--"]:
        argv = argv[1:]
    supervise.die_with_parent()  # torchrun gone (SIGKILLed with its launcher): this rank stops too
    try:
        _run_python(argv)
        return 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
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
