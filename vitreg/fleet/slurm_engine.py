"""``engine=slurm``: each child of a sweep a SLURM job, submitted through submitit, asking for its GPU type.

A child filed under a GPU label asks for that type: ``--gres=gpu:TYPE:N`` (``slurm_gpu_by=gres``, N = ``nproc``,
one on CPU so the node's GPU is held) or ``--constraint=TYPE`` (``slurm_gpu_by=constraint``), TYPE from
:data:`vitreg.hardware.profiles.SLURM_GPU_TYPES`; what else a job asks: :meth:`SlurmEngine.job_parameters`. What
the job runs and how the parent follows it: :mod:`vitreg.fleet.slurm_jobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vitreg.config.options import option
from vitreg.errors import VitregError
from vitreg.fleet.children import SHARING_SAID, ClusterChecks
from vitreg.fleet.slurm_jobs import Follower, slurm
from vitreg.hardware.profiles import SLURM_GPU_TYPES, normalize_label

_OUT_OF_SERVICE = ("down", "drain", "fail", "maint", "unknown", "not_responding", "inval", "future")


def _submitit():
    try:
        import submitit
    except ImportError:
        raise VitregError("engine=slurm needs submitit: pip install 'vitreg[slurm]' (or pip install submitit)") from None
    return submitit


@dataclass(frozen=True)
class Node:
    """One node as ``sinfo -N`` shows it: its state, the GPU types of its gres, its features, its machine."""

    name: str
    state: str
    gpus: dict  # gres type -> count ("" for untyped GPUs)
    features: frozenset
    host: str = ""  # its NodeHostname: several nodes may be one machine

    @property
    def in_service(self) -> bool:
        return not any(word in self.state.lower() for word in _OUT_OF_SERVICE)


def _gres_gpus(gres: str) -> dict:
    """``gpu:h100:2(S:0),gpu:a100:1`` -> {"h100": 2, "a100": 1}; ``gpu:4`` -> {"": 4}."""
    found: dict = {}
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] != "gpu":
            continue
        kind, count = (parts[1], parts[2]) if len(parts) > 2 else ("", parts[1] if len(parts) > 1 else "1")
        found[kind] = found.get(kind, 0) + int(count) if count.isdigit() else found.get(kind, 0) + 1
    return found


def cluster_nodes(partition: str = "") -> list[Node]:
    """The partition's nodes (every node when none is named)."""
    args = ["sinfo", "-h", "-N", "-o", "%N|%T|%G|%f|%n"] + (["-p", partition] if partition else [])
    nodes = {}
    for line in slurm(*args).splitlines():
        name, state, gres, features, host = (line.split("|") + ["", "", "", ""])[:5]
        feature_set = frozenset(f for f in features.split(",") if f and f != "(null)")
        nodes[name] = Node(name, state, _gres_gpus(gres), feature_set, host)
    return list(nodes.values())


@dataclass(frozen=True)
class SlurmOptions:
    """The sweep's ``slurm_*`` and ``offline`` options, parsed."""

    partition: str
    account: str
    qos: str
    time_min: int
    sbatch: dict
    gpu_by: str
    folder: Path
    offline: str

    @classmethod
    def parse(cls, own: dict) -> "SlurmOptions":
        def value(name):
            return option("sweep", name).parse(own.get(name, option("sweep", name).default))

        return cls(str(value("slurm_partition") or ""), str(value("slurm_account") or ""),
                   str(value("slurm_qos") or ""), value("slurm_time_min"), _sbatch_options(value("slurm_sbatch")),
                   value("slurm_gpu_by"), Path(str(value("slurm_folder"))).expanduser().absolute(),
                   value("offline"))


def _sbatch_options(text) -> dict:
    """``mem=16G;exclude=node3;exclusive`` -> {"mem": "16G", "exclude": "node3", "exclusive": True}."""
    found = {}
    for item in str(text or "").split(";"):
        name, has_value, value = item.strip().partition("=")
        if name:
            found[name.strip().lstrip("-").replace("-", "_")] = value.strip() if has_value else True
    return found


class SlurmEngine(ClusterChecks):
    """The sweep's children as SLURM jobs; :meth:`run` submits them and follows them to their end."""

    cluster = "the SLURM cluster"
    no_gpus_fix = "pass device=cpu, or a partition with GPUs"

    def __init__(self, own: dict, max_parallel: int, progress, share_node: bool = False):
        self.options = SlurmOptions.parse(own)
        self.share_node = share_node
        self.submitit = _submitit()
        self.max_parallel = max_parallel
        self.progress = progress
        nodes = cluster_nodes(self.options.partition)
        if not nodes:
            raise VitregError(f"the SLURM partition {self.options.partition or '(default)'} has no node: pass "
                              f"slurm_partition= one that `sinfo` lists")
        self.slots = max(1, min(max_parallel, len(nodes)))
        part = f"partition {self.options.partition}" if self.options.partition else "its default partition"
        self.where = f"SLURM ({len(nodes)} node{'s' if len(nodes) > 1 else ''}, {part})"
        self.where += SHARING_SAID if share_node else ""

    def _nodes(self) -> list[Node]:
        return cluster_nodes(self.options.partition)

    def types_of(self, nodes: list[Node]) -> list[str]:
        """The GPU types the nodes offer, as SLURM names them (gres types, or node features)."""
        if self.options.gpu_by == "gres":
            return sorted({kind for n in nodes for kind in n.gpus if kind})
        return sorted({f for n in nodes for f in n.features})

    def gpus_per_node(self, nodes: list[Node], wanted: str | None) -> list[int]:
        if self.options.gpu_by == "gres" and wanted:
            return [n.gpus.get(wanted, 0) for n in nodes]
        return [sum(n.gpus.values()) for n in nodes if not wanted or wanted in n.features]

    @property
    def type_word(self) -> str:
        return "GPU gres type" if self.options.gpu_by == "gres" else "GPU feature"

    @property
    def none_offered(self) -> str:
        other = "constraint" if self.options.gpu_by == "gres" else "gres"
        return f"gpu=all: no node of the SLURM cluster has a {self.type_word}: pass gpu=auto, or slurm_gpu_by={other}"

    def type_of(self, label: str) -> str | None:
        return slurm_type(label)

    def label_of(self, kind: str) -> str:
        return {slurm: label for label, slurm in SLURM_GPU_TYPES.items()}.get(kind, normalize_label(kind))

    def cpu_gpus(self, wanted: str | None) -> int:
        """A CPU child of a type holds one GPU of it (gres), so that it runs on that node alone."""
        return 1 if wanted and self.options.gpu_by == "gres" else 0

    def job_parameters(self, combo, common: dict, name: str, folder: Path) -> dict:
        """submitit's SlurmExecutor parameters of one child's job, started in ``folder`` (vitreg's own): submitit
        runs ``python -m`` in the job's working directory, which comes first on the import path, and the
        submitting folder may hold a clone named ``vitreg/`` that would shadow the package. A CPU child asks
        ``--exclusive`` (its node alone, every CPU of it granted) unless ``share_node``; a GPU child its GPUs and
        ``nproc`` CPUs (the node's other GPUs take other children)."""
        need, wanted = self.request(combo, common)
        nproc = int(combo.get("nproc", common.get("nproc") or 1))
        opts = self.options
        alone = self.on_cpu(combo, common) and not self.share_node
        params = {"job_name": name[:100], "time": opts.time_min, "nodes": 1, "ntasks_per_node": 1,
                  "cpus_per_task": None if alone else nproc, "exclusive": True if alone else None,
                  "partition": opts.partition or None, "account": opts.account or None,
                  "qos": opts.qos or None, "stderr_to_stdout": False,
                  "additional_parameters": {"chdir": str(folder), **opts.sbatch}}
        if need and opts.gpu_by == "gres":
            params["gres"] = f"gpu:{wanted}:{need}" if wanted else f"gpu:{need}"
        elif need:
            params["gpus_per_node"] = need
        if wanted and opts.gpu_by == "constraint":
            params["constraint"] = wanted
        return {k: v for k, v in params.items() if v is not None}

    def run(self, ctx, combos: list) -> None:
        Follower(self, ctx, combos).run()

    def close(self) -> None:
        pass


def slurm_type(label: str) -> str | None:
    """The SLURM GPU type a child filed under ``label`` asks for; None for auto and cpu."""
    label = normalize_label(label)
    if label in ("auto", "cpu"):
        return None
    return SLURM_GPU_TYPES.get(label, label)
