"""``engine=ray``: each child of a sweep a Ray task on the cluster, asking for the GPUs it needs.

A task asks for ``nproc`` GPUs (none with ``device=cpu``: then every CPU of its node, so that it runs there alone,
unless ``share_node``) and the accelerator type Ray reports for its GPU label
(``vitreg.hardware.profiles.RAY_ACCELERATOR_TYPES``), and runs ``vitreg bench`` on its node, logging straight
into the child run the parent made, with the sweep's own vitreg shipped along (:func:`shipped_env`). Tasks are
never retried by Ray: a child whose node died ends FAILED with Ray's reason. SIGINT/SIGTERM cancels every task
(its child ends KILLED). Ray's own log lines go to a file the sweep names (:class:`RayLogAside`), not to the
sweep's console.
"""

from __future__ import annotations

import io
import logging
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

from vitreg import signals
from vitreg.environment import GIT_SHA_VAR, git_sha
from vitreg.errors import VitregError, first_line
from vitreg.fleet.children import SHARING_SAID, ClusterChecks
from vitreg.hardware.profiles import RAY_ACCELERATOR_TYPES, label_of_ray_type, normalize_label
from vitreg.tracking import runs as tracking

CONNECT_TIMEOUT_S = 10.0  # a Ray address that does not answer is one line within this
_TYPE_PREFIX = "accelerator_type:"


def _ray():
    try:
        import ray
    except ImportError:
        raise VitregError("engine=ray needs Ray: pip install 'vitreg[ray]' (or pip install 'ray[default]')") from None
    return ray


def _check_answers(address: str) -> None:
    """``HOST:PORT`` and ``ray://HOST:PORT``: a TCP connect, so a dead address is one line in seconds (ray.init
    waits a minute and more for a GCS that does not answer). ``auto`` is RAY_ADDRESS when that is set, as
    ``ray.init`` reads it."""
    from_env = address == "auto" and os.environ.get("RAY_ADDRESS")
    address = from_env or address
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        where, fix = (" (RAY_ADDRESS)", "unset RAY_ADDRESS") if from_env else ("", "pass ray_address=auto")
        raise VitregError(f"the Ray cluster at {address}{where} does not answer ({exc}): start its head with `ray "
                          f"start --head` there, or {fix} (this host's cluster) or ray_address=local") from None


class RayLogAside:
    """While the sweep uses Ray, file descriptor 2 (where Ray's C++ core writes, below Python, and what a
    ``local`` cluster's processes inherit) is the file :attr:`path`; vitreg's own lines still reach the console
    through a ``sys.stderr`` on a copy of the console's descriptor."""

    def __init__(self):
        self.path = Path(tempfile.gettempdir()) / f"vitreg-ray-{os.getpid()}.log"
        self._console_fd: int | None = None
        self._stderr = None

    def open(self) -> None:
        sys.stderr.flush()
        self._console_fd = os.dup(2)
        log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        self._stderr = sys.stderr
        if _writes_to_fd2(sys.stderr):  # else (a test's CliRunner) sys.stderr is not the console: leave it
            console = io.FileIO(self._console_fd, "w", closefd=False)
            sys.stderr = io.TextIOWrapper(console, encoding=sys.stderr.encoding, errors="backslashreplace",
                                          line_buffering=True)

    def close(self) -> None:
        """The console back on fd 2; the file kept only when Ray wrote to it."""
        if self._console_fd is None:
            return
        sys.stderr.flush()
        sys.stderr = self._stderr
        os.dup2(self._console_fd, 2)
        os.close(self._console_fd)
        self._console_fd = None
        if self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()


def _writes_to_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return False


def shipped_env(env: dict | None = None) -> dict:
    """The sweep's Ray job's ``runtime_env``: this vitreg package itself (``py_modules``: Ray zips the folder,
    uploads it once by its content's hash and puts it first on every task's PYTHONPATH, so a child's own
    process imports it too), so that a node whose Python has torch, timm and mlflow but not vitreg runs the
    children, and one with another vitreg installed runs the submitter's code, not its own; and this
    vitreg's commit (``VITREG_GIT_SHA``: the shipped copy is in no git tree), which a child's run records.
    ``env`` (the ``ray_runtime_env`` option, parsed) adds to it: ``pip`` for nodes without timm, ``env_vars``..."""
    from ray.runtime_env import RuntimeEnv

    env = dict(env or {})
    try:
        RuntimeEnv(**env)  # Ray's own check of each field (the lists below are lists)
    except (TypeError, ValueError) as exc:
        raise VitregError(f"ray_runtime_env is not a runtime_env Ray takes ({first_line(exc, 200)}): pass a JSON "
                          f"object of its fields, e.g. '{{\"pip\": [\"timm\"]}}'") from None
    package = str(Path(__file__).resolve().parents[1])
    return {**env, "py_modules": [*env.get("py_modules", []), package],
            "excludes": [*env.get("excludes", []), "__pycache__"],
            "env_vars": {**env.get("env_vars", {}), GIT_SHA_VAR: git_sha()}}


def connect(address: str, runtime_env: dict | None = None, ray_log: Path | None = None):
    """``ray.init`` against ``address`` (``local``: a cluster of this host alone). In the main thread (Ray sets
    its signal handlers there) with :func:`shipped_env`; an address that does not answer was refused by
    :func:`_check_answers` first, a cluster that refuses this driver's token is named with Ray's reason (which
    only Ray's own log lines, ``ray_log``, hold)."""
    ray = _ray()
    shipped = shipped_env(runtime_env)
    _check_answers(address)
    try:
        # "local" is Ray's own word for a new cluster of this host alone (never one already running here);
        # it listens on the loopback address only
        here = {"_node_ip_address": "127.0.0.1"} if address == "local" else {}
        ray.init(address=address, runtime_env=shipped, log_to_driver=False, include_dashboard=False,
                 logging_level=logging.WARNING, **here)
        signals.install()  # ray.init set its own SIGTERM handler (exit 1 at once): SIGTERM must cancel the tasks
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:  # not a Ray cluster...
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        said = ray_log.read_text(errors="replace") if ray_log and ray_log.exists() else ""
        token = re.search(r"InvalidAuthToken: [^\n]*|Token authentication is enabled[^.]*", f"{said}\n{exc}")
        if token:
            raise VitregError(f"the Ray cluster at {address} refused this sweep ({token[0].strip()}): set "
                              f"RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` "
                              f"on its head prints it; or RAY_AUTH_TOKEN_PATH, its file), or start the cluster with "
                              f"RAY_AUTH_MODE=disabled") from None
        raise VitregError(f"could not join the Ray cluster at {address} ({reason}): start it (`ray start --head`), "
                          f"or pass ray_address=local to start one here") from None
    return ray


class RayEngine(ClusterChecks):
    """The sweep's children as Ray tasks; :meth:`run` submits them and follows them to their end."""

    cluster = "the Ray cluster"
    type_word = "accelerator type"
    no_gpus_fix = "join nodes with GPUs, or pass device=cpu"

    def __init__(self, address: str, max_parallel: int, progress, share_node: bool = False, device: str = "auto",
                 runtime_env: dict | None = None):
        self.ray_log = RayLogAside()
        self.ray_log.open()
        progress(f"sweep: Ray's own log lines go to {self.ray_log.path}")
        self.share_node = share_node
        try:
            self._join(address, max_parallel, progress, device, runtime_env)
        except BaseException:
            self.close()
            raise

    def _join(self, address: str, max_parallel: int, progress, device: str, runtime_env: dict | None) -> None:
        self.ray = connect(address, runtime_env, self.ray_log.path)
        self.builds = sorted({"pip", "conda", "uv", "container", "image_uri"} & set(runtime_env or {}))
        self.address = address
        self.max_parallel = max_parallel
        self.progress = progress
        nodes = self._nodes()
        if len(nodes) > 1 and tracking.is_local_store():
            raise VitregError(f"the Ray cluster has {len(nodes)} nodes and the tracking store is local to this host "
                              f"({tracking.tracking_uri()}): the other nodes cannot reach it; set MLFLOW_TRACKING_URI "
                              f"to a tracking server (`vitreg server`)")
        alone = device == "cpu" and not self.share_node  # one CPU child a node
        at_once = len(nodes) if alone else sum(int(n["Resources"].get("CPU", 1)) for n in nodes)
        self.slots = max(1, min(max_parallel, at_once))
        self.where = f"a Ray cluster of {len(nodes)} node{'s' if len(nodes) > 1 else ''}"
        self.where += SHARING_SAID if self.share_node else ""

    def _nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def types_of(self, nodes: list[dict]) -> list[str]:
        return sorted({k.removeprefix(_TYPE_PREFIX) for n in nodes for k in n["Resources"] if k.startswith(_TYPE_PREFIX)})

    def gpus_per_node(self, nodes: list[dict], wanted: str | None) -> list[int]:
        return [int(n["Resources"].get("GPU", 0)) for n in nodes if not wanted or _TYPE_PREFIX + wanted in n["Resources"]]

    def type_of(self, label: str) -> str | None:
        return ray_type(label)

    def task_options(self, combo, common: dict) -> dict:
        """The Ray resources a child's task asks for: ``nproc`` GPUs of its type and one CPU (the node's other
        GPUs take other children at once; none shares a GPU); a CPU child the node's every CPU, so that no other
        child runs beside it (the most any node of its type has: every CPU child of the sweep times with one
        grant), or one CPU with ``share_node``. Ray sets ``OMP_NUM_THREADS`` to the CPUs a task asks for,
        unless the node sets it."""
        need, wanted = self.request(combo, common)
        cpus = 1
        if self.on_cpu(combo, common) and not self.share_node:
            of_type = [n for n in self._nodes() if not wanted or _TYPE_PREFIX + wanted in n["Resources"]]
            cpus = max([1, *(int(n["Resources"].get("CPU", 1)) for n in of_type)])
        return {"num_cpus": cpus, "num_gpus": need, **({"accelerator_type": wanted} if wanted else {})}

    label_of = staticmethod(label_of_ray_type)

    @property
    def none_offered(self) -> str:
        return (f"gpu=all: the Ray cluster at {self.address} has no GPU node (no node reports an accelerator type): "
                f"pass gpu=auto, or join nodes with GPUs")

    def run(self, ctx, combos: list) -> None:
        from vitreg.fleet.ray_tasks import Follower

        Follower(self, ctx, combos).run()

    def close(self) -> None:
        try:
            ray = sys.modules.get("ray")  # None: it never imported (the refusal said so)
            if ray is not None and ray.is_initialized():
                ray.shutdown()
        finally:
            self.ray_log.close()


def ray_type(label: str) -> str | None:
    """The Ray accelerator type a child filed under ``label`` asks for; None for auto and cpu."""
    label = normalize_label(label)
    if label in ("auto", "cpu"):
        return None
    return RAY_ACCELERATOR_TYPES.get(label, label.upper())
