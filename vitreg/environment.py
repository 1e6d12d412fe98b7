"""The environment a number was measured in (GPU, driver, CUDA stack, versions, host) and the user's cache folder.
It imports no other vitreg module, so every layer may read it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import re
import socket
import subprocess
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

#: the commit of a vitreg shipped to a Ray node (vitreg.fleet.ray_engine.shipped_env), whose copy is in no git tree
GIT_SHA_VAR = "VITREG_GIT_SHA"
#: where a cluster's child reads its CPU grant, first found wins: SLURM's CPUs for the job's task, for the job on
#: this node, and the CPUs its Ray task reserved (the task passes them: vitreg.fleet.ray_tasks)
RAY_CPUS_VAR = "VITREG_RAY_TASK_CPUS"
GRANT_VARIABLES = ("SLURM_CPUS_PER_TASK", "SLURM_JOB_CPUS_PER_NODE", RAY_CPUS_VAR)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_sha() -> str:
    """The project's commit (with ``-dirty`` when the tree has changes), or ``unknown`` outside git; a shipped
    copy's (:data:`GIT_SHA_VAR`) is its submitter's."""
    if os.environ.get(GIT_SHA_VAR):
        return os.environ[GIT_SHA_VAR]
    path = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def nvml_ask(question, no_driver=None):
    """``question(pynvml)`` between NVML's init and shutdown; ``no_driver`` without an NVIDIA driver, None where
    nvidia-ml-py is not installed or NVML cannot say (not our error to raise)."""
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        return no_driver
    except pynvml.NVMLError:
        return None
    try:
        return question(pynvml)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def nvml_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older nvidia-ml-py answers bytes


@dataclass(frozen=True)
class EnvInfo:
    """One record of the environment; :meth:`to_tags` gives the MLflow tags (names from DESIGN.md)."""

    gpu_name: str
    gpu_count: int
    gpu_memory_gb: float | None
    compute_capability: str | None
    driver_version: str | None
    cuda_version: str | None
    cudnn_version: str | None
    nccl_version: str | None
    torch_version: str
    torchvision_version: str
    timm_version: str
    mlflow_version: str
    python_version: str
    os: str
    cpu_model: str
    cpu_count: int
    hostname: str
    vitreg_git_sha: str
    #: NCCL_* and TORCH_NCCL_* variables set in the process (they change DDP figures), "K=V;K=V" sorted
    nccl_env: str = ""
    cpus_granted: int = 0  # the CPUs this process was granted (cpu_grant), of cpu_count
    cpus_granted_from: str = ""  # where cpus_granted was read: a GRANT_VARIABLES name, or "affinity"
    torch_threads: int = 0  # torch's intra-op threads: with cpus_granted, what a CPU figure or a host-bound step had
    omp_threads: str = ""  # OMP_NUM_THREADS as the process had it ("": unset)

    def to_tags(self) -> dict[str, str]:
        return {k: ("" if v is None else str(v)) for k, v in asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def capture_environment() -> EnvInfo:
    import torch

    gpu = {"gpu_name": "none", "gpu_count": 0, "gpu_memory_gb": None, "compute_capability": None}
    nccl = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"gpu_name": props.name, "gpu_count": torch.cuda.device_count(),
               "gpu_memory_gb": round(props.total_memory / 1024**3, 1),
               "compute_capability": f"{props.major}.{props.minor}"}
        with contextlib.suppress(Exception):  # NCCL missing from this build
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if torch.distributed.is_available() else None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    driver = nvml_ask(lambda nv: nvml_text(nv.nvmlSystemGetDriverVersion()))
    granted, source = cpu_grant(os.environ)
    # by name: a field out of place would label a run with another field's value, and nothing would fail
    return EnvInfo(**gpu, driver_version=driver, cuda_version=torch.version.cuda,
                   cudnn_version=str(cudnn) if cudnn else None, nccl_version=nccl, torch_version=torch.__version__,
                   torchvision_version=_version("torchvision"), timm_version=_version("timm"),
                   mlflow_version=_version("mlflow"), python_version=platform.python_version(), os=platform.platform(),
                   cpu_model=cpu_model(), cpu_count=os.cpu_count() or 0, hostname=socket.gethostname(),
                   vitreg_git_sha=git_sha(), nccl_env=nccl_env(), cpus_granted=granted,
                   cpus_granted_from=source, torch_threads=torch.get_num_threads(),
                   omp_threads=os.environ.get("OMP_NUM_THREADS", ""))


def cpu_grant(environ) -> tuple[int, str]:
    """(the CPUs a process was granted, where that was read): its scheduler's word (:data:`GRANT_VARIABLES`: a
    scheduler that does not pin CPUs leaves the affinity mask the host's), or the affinity mask where that is
    narrower (a pinning scheduler, a container, ``taskset``) or no scheduler said."""
    mask = len(os.sched_getaffinity(0))
    said = [(int(m[0]), name) for name in GRANT_VARIABLES if (m := re.match(r"\d+", environ.get(name, "")))]
    return said[0] if said and 0 < said[0][0] <= mask else (mask, "affinity")


def user_cache_dir() -> Path:
    """vitreg's folder in the user's cache: what a later process may reuse, and what may be deleted at any time."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vitreg"


@contextlib.contextmanager
def environ_restored(*names: str):
    """The variables ``names`` put back as they were (or unset) when the block ends: an in-process command (the
    Python API) leaves its caller's environment as it found it."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def nccl_env(environ=None) -> str:
    """The NCCL_* and TORCH_NCCL_* variables as ``"K=V;K=V"``, sorted: they move DDP throughput without a code change."""
    environ = os.environ if environ is None else environ
    return ";".join(f"{k}={environ[k]}" for k in sorted(environ) if k.startswith(("NCCL_", "TORCH_NCCL_")))


def _name_and_version(dist) -> tuple[str, str]:
    """A distribution's Name and Version from its METADATA's headers: ``dist.metadata`` parses the long
    description too, 0.5 s per pip_freeze for this environment."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():  # the headers end at the first blank line
        key, colon, value = line.partition(":")
        if colon and key in ("Name", "Version"):
            fields.setdefault(key, value.strip())
    return fields.get("Name", ""), fields.get("Version", "")


@functools.lru_cache(maxsize=1)
def pip_freeze() -> str:
    """``name==version`` of every installed distribution, sorted, as ``pip freeze`` shows; once per process."""
    seen = {}
    for dist in metadata.distributions():
        name, version = _name_and_version(dist)
        if name:
            seen.setdefault(name.lower(), f"{name}=={version}")  # the first on sys.path wins, as for imports
    return "\n".join(seen[k] for k in sorted(seen)) + "\n"
