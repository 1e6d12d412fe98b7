"""A real SLURM cluster on 127.0.0.1 for the slow tier: munged, slurmctld and two slurmd nodes, each node
standing for one GPU type (``gpu-h100``: gres ``gpu:h100:1`` and feature ``h100``; ``gpu-a100`` likewise).

Debian's slurm 22.05 runs two ``slurmd -N NAME`` on one host (each node its own ``Port=``, spool and PID
file). The GPUs are gres entries whose device file is ``/dev/null`` (a ``Count`` without a file gives no GPU),
so a child asking for ``gpu:h100:1`` is placed on the h100 node and holds its one "GPU" (one child at a time
per node). Every daemon runs in the foreground as a child of the test process, listens on 127.0.0.1 only
(``NoInAddrAny,NoCtldInAddrAny``: without them slurmctld listens on every address) and is stopped by its PID.
The scheduler runs every second (``sched_interval=1``), a silent node is DOWN after 5 s (``SlurmdTimeout``) and a
requeued job starts again after 5 s (``cred_expire``; SLURM's default is 120 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

NODES = {"gpu-h100": "h100", "gpu-a100": "a100"}  # node name -> the GPU type it offers
START_TIMEOUT_S = 60.0


# A task on a node listed in no_route gets an HTTP proxy that refuses every connection: a compute node without
# a route to the tracking server (its sqlite stores are files, so only server tests notice)
TASK_PROLOG = """#!/bin/sh
if grep -qx "$SLURMD_NODENAME" {root}/no_route; then
  for name in http_proxy HTTP_PROXY https_proxy HTTPS_PROXY; do echo "export $name=http://127.0.0.1:9"; done
  echo "export no_proxy="; echo "export NO_PROXY="
fi
"""


def installed() -> bool:
    return all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "sbatch", "sinfo"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Cluster:
    """The running daemons, their folder, and the environment SLURM's commands need (``SLURM_CONF``)."""

    root: Path
    env: dict
    daemons: dict = field(default_factory=dict)  # name -> Popen

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        return done.stdout

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").strip().split("\n")[0]

    def start_node(self, node: str) -> None:
        log = open(self.root / f"slurmd.{node}.log", "ab")
        self.daemons[node] = subprocess.Popen(["slurmd", "-D", "-N", node, "-f", self.env["SLURM_CONF"]],
                                              env={**os.environ, **self.env}, stdout=log, stderr=log)

    def kill_node(self, node: str) -> None:
        """The node dies: its slurmd, its slurmstepds and every process of its jobs, all frozen first (SIGSTOP) so
        that none of them tells slurmctld anything, then killed (SIGKILL), as a power cut would."""
        job_ids = set(self.run("squeue", "-h", "-w", node, "-o", "%i").split())
        slurmd = self.daemons.pop(node)
        procs = [psutil.Process(slurmd.pid), *_node_processes(node, job_ids)]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
        slurmd.wait()

    def resume_node(self, node: str) -> None:
        """After :meth:`kill_node`: the slurmd back and the node back in service (IDLE) for the next test."""
        self.start_node(node)

        def idle() -> bool:
            state = self.node_state(node)
            if "down" in state or "drain" in state:
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
            return state == "idle"

        _wait(idle, f"node {node} back in service", self)

    def cut_off(self, node: str | None) -> None:
        """Jobs on ``node`` (none: on no node) get no route to HTTP servers (an http_proxy that refuses them)."""
        (self.root / "no_route").write_text(f"{node}\n" if node else "")

    def queue(self) -> list[str]:
        return [line for line in self.run("squeue", "-h", "-o", "%i %T").splitlines() if line.strip()]

    def stop(self) -> None:
        for proc in reversed(list(self.daemons.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.daemons.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.root.glob("*.log"))


def _node_processes(node: str, job_ids: set[str]) -> list:
    """The slurmstepds of ``node``'s jobs (``slurmstepd: [JOB.STEP]``: their environment is overwritten by
    their process title) and its jobs' processes (``SLURMD_NODENAME``)."""
    found = []
    for proc in psutil.process_iter():
        try:
            title = " ".join(proc.cmdline())
            if title.startswith("slurmstepd") and any(f"[{job}." in title for job in job_ids):
                found.append(proc)
            elif proc.environ().get("SLURMD_NODENAME") == node:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _wait(ready, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the test SLURM cluster: {what} did not happen in {START_TIMEOUT_S:.0f} s\n{cluster.logs()}")


def _slurm_conf(root: Path, ports: dict, task_plugin: str) -> str:
    host = socket.gethostname()
    nodes = "\n".join(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[node]} CPUs=1 "
                      f"Gres=gpu:{gpu}:1 Features={gpu} State=UNKNOWN" for node, gpu in NODES.items())
    return f"""ClusterName=vitregtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket,cred_expire=5
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin={task_plugin}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MessageTimeout=5
SlurmdTimeout=5
SlurmctldTimeout=5
KillWait=5
MinJobAge=600
JobRequeue=0
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
TaskProlog={root}/task_prolog.sh
{nodes}
PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def start(root: Path, task_plugin: str = "task/none") -> Cluster:
    """munged, slurmctld and the two slurmd nodes, waited for until both nodes are IDLE. ``task_plugin``:
    ``task/none`` binds a job's processes to no CPU (their affinity mask is the host's), ``task/affinity`` to the
    CPUs the job was granted."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    for sub in ("ctld", *(f"spool/{node}" for node in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    ports = {"ctld": _free_port(), **{node: _free_port() for node in NODES}}
    (root / "slurm.conf").write_text(_slurm_conf(root, ports, task_plugin))
    (root / "no_route").write_text("")
    (root / "task_prolog.sh").write_text(TASK_PROLOG.format(root=root))
    os.chmod(root / "task_prolog.sh", 0o755)
    (root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
        f"NodeName={node} Name=gpu Type={gpu} File=/dev/null\n" for node, gpu in NODES.items()))
    cluster = Cluster(root, {"SLURM_CONF": str(root / "slurm.conf")})
    try:
        subprocess.run(["mungekey", "--create", f"--keyfile={root}/munge.key"], check=True, capture_output=True)
        cluster.daemons["munged"] = subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={root}/munge.socket", f"--key-file={root}/munge.key",
             f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
            stdout=subprocess.DEVNULL, stderr=open(root / "munged.err.log", "ab"))
        _wait(lambda: (root / "munge.socket").exists(), "munged's socket", cluster)
        ctld_log = open(root / "slurmctld.out.log", "ab")
        cluster.daemons["slurmctld"] = subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(root / "slurm.conf")],
                                                        env={**os.environ, **cluster.env}, stdout=ctld_log,
                                                        stderr=ctld_log)
        _wait(lambda: cluster.run("scontrol", "ping").count("UP") >= 1, "slurmctld answering", cluster)
        for node in NODES:
            cluster.start_node(node)
        _wait(lambda: all("idle" in cluster.node_state(node) for node in NODES), "both nodes IDLE", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The test SLURM cluster, started once for the session (skipped where SLURM is not installed)."""
    if not installed():
        pytest.skip("SLURM is not installed here (apt-get install slurmd slurmctld munge slurm-client; .ci/run "
                    "does it)")
    cluster = start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
