"""The environment a number was measured in: GPU, driver, CUDA stack, library versions, host; and the
user's cache folder (:func:`user_cache_dir`) where models/, measure/ and hardware/ keep what a later process
may reuse. It imports no other vitreg module, so every layer may read it.

Nothing here runs at import time; :func:`capture_environment` reads it when asked. Versions of
packages are read from their installed metadata (no imports of mlflow here: only the tracking
layer talks to MLflow).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import socket
import subprocess
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


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


def git_sha(path: Path = PROJECT_ROOT) -> str:
    """The project's commit (with ``-dirty`` when the tree has changes), or ``unknown`` outside git."""
    try:
        sha = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _nvml_driver() -> str | None:
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no GPU, or NVML refuses: not our error to raise
        return None


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
    cpus_granted: int = 0  # the CPUs this process may run on (a SLURM job's or a container's grant), of cpu_count
    torch_threads: int = 0  # torch's intra-op threads: with cpus_granted, what a CPU figure or a host-bound step had

    def to_tags(self) -> dict[str, str]:
        return {k: ("" if v is None else str(v)) for k, v in asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def capture_environment() -> EnvInfo:
    import torch

    gpu_name, gpu_count, mem_gb, cc = "none", 0, None, None
    nccl = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu_name, gpu_count = props.name, torch.cuda.device_count()
        mem_gb = round(props.total_memory / 1024**3, 1)
        cc = f"{props.major}.{props.minor}"
    try:
        if torch.distributed.is_available() and torch.cuda.is_available():
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # NCCL missing from this build
        nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return EnvInfo(
        gpu_name=gpu_name,
        gpu_count=gpu_count,
        gpu_memory_gb=mem_gb,
        compute_capability=cc,
        driver_version=_nvml_driver(),
        cuda_version=torch.version.cuda,
        cudnn_version=str(cudnn) if cudnn else None,
        nccl_version=nccl,
        torch_version=torch.__version__,
        torchvision_version=_version("torchvision"),
        timm_version=_version("timm"),
        mlflow_version=_version("mlflow"),
        python_version=platform.python_version(),
        os=platform.platform(),
        cpu_model=cpu_model(),
        cpu_count=os.cpu_count() or 0,
        cpus_granted=len(os.sched_getaffinity(0)),
        torch_threads=torch.get_num_threads(),
        hostname=socket.gethostname(),
        vitreg_git_sha=git_sha(),
        nccl_env=nccl_env(),
    )


def user_cache_dir() -> Path:
    """vitreg's folder in the user's cache (``$XDG_CACHE_HOME/vitreg``, else ``~/.cache/vitreg``):
    what a later process may reuse, and what may be deleted at any time."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vitreg"


@contextlib.contextmanager
def environ_restored(*names: str):
    """The variables ``names`` put back as they were (their value, or no variable) when the block ends:
    a command run in-process (CliRunner, the Python API, a notebook) may set them for the processes it
    starts and still leave its caller's environment as it found it."""
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
    """The NCCL settings of this process as ``"K=V;K=V"``, sorted: NCCL_* and TORCH_NCCL_* variables
    (channel counts, NVLS, async error handling...), which move DDP throughput without any code change."""
    environ = os.environ if environ is None else environ
    return ";".join(f"{k}={environ[k]}" for k in sorted(environ) if k.startswith(("NCCL_", "TORCH_NCCL_")))


def _name_and_version(dist) -> tuple[str, str]:
    """A distribution's Name and Version from the header block of its METADATA (PKG-INFO for an egg).

    ``dist.metadata`` parses the whole file as an e-mail message, long description included: for the
    ~170 distributions of this project's environment that cost 0.5 s per pip_freeze, on every run.
    """
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():  # the headers end at the first blank line
        key, colon, value = line.partition(":")
        if colon and key in ("Name", "Version"):
            fields.setdefault(key, value.strip())
    return fields.get("Name", ""), fields.get("Version", "")


@functools.lru_cache(maxsize=1)
def pip_freeze() -> str:
    """``name==version`` of every installed distribution, sorted (what ``pip freeze`` shows, without pip).

    Read once per process: what is installed does not change under a running job."""
    seen = {}
    for dist in metadata.distributions():
        name, version = _name_and_version(dist)
        if name:
            seen.setdefault(name.lower(), f"{name}=={version}")  # the first on sys.path wins, as for imports
    return "\n".join(seen[k] for k in sorted(seen)) + "\n"
