"""What a sweep child is, for every engine (vitreg.bench.sweep's local one, vitreg.fleet's Ray and SLURM ones):
its command line, how a child on another host starts, and the smaller batch it is retried with after running
out of memory; and what the two cluster engines do alike: the checks of the GPU types and counts a sweep asks
for (:class:`ClusterChecks`), and the parent's loop over the children (:class:`Follower`).

Held in the sweep, this would close an import circle (sweep -> fleet.ray_engine -> fleet.ray_tasks -> sweep);
held in ray_tasks, the local engine and SLURM's would import Ray."""

from __future__ import annotations

from dataclasses import dataclass

from vitreg import signals
from vitreg.config.parse import AUTO_BATCH, options_to_args
from vitreg.errors import OutOfMemory, VitregError
from vitreg.fleet.axes import GPU_ALL, Combination
from vitreg.fleet.board import Clock
from vitreg.fleet.worker import python_command
from vitreg.tracking import runs as tracking

#: on a CPU child run of a cluster sweep given share_node=true: other children may have run beside it on its node
SHARED_NODE_TAG = "sweep_shared_node"
#: on every engine's child run: the most children that ran at once on its host (the machine) while it ran
HOST_SHARE_TAG = "sweep_children_on_host"
#: what a cluster engine's ``where`` (the console's "N at once on ...") adds when children may share a node
SHARING_SAID = ", CPU children sharing a node (share_node=true)"


def smaller_batch(bs, child_id: str) -> int:
    """The batch to retry with after a failure: smaller after an out-of-memory one, else 0 (no retry);
    batch_size=auto backs off inside the child already."""
    # the child is another process: its error's class reaches us as the tag its tracked_run set
    if bs == AUTO_BATCH or tracking.get_run(child_id).data.tags.get(tracking.ERROR_KIND_TAG) != OutOfMemory.__name__:
        return 0
    return decay_batch(bs)


def decay_batch(batch_size: int) -> int:
    """The next smaller batch after an OOM, timm's way (256 -> 192 -> 128 -> 96 -> 64 ...); 0 below 2."""
    from timm.utils import decay_batch_step

    return decay_batch_step(batch_size)


def child_command(combo: Combination, batch_size, common: dict) -> list[str]:
    """``python -m vitreg.cli bench`` (:func:`vitreg.fleet.worker.python_command`) with the combination's options
    (at ``batch_size``) over the common ones."""
    options = {**common, **dict(combo.options), "batch_size": batch_size}
    return python_command("vitreg.cli", "bench", *options_to_args(options))


def start_remote(ctx, child, engine: str, type_tag: str, wanted: str | None,
                 shared: bool = False) -> tuple[list[str], dict]:
    """A child that runs on another host (a Ray task, a SLURM job): its run under the sweep's parent (``ctx``),
    tagged with the engine, the GPU type asked for (``type_tag``, when one is) and, when it may share its node
    with other children (``shared``), :data:`SHARED_NODE_TAG`; SCHEDULED until its node starts it. Returns the python
    arguments the node's own python runs and the variables it needs to log into that run."""
    tags = {"sweep_engine": engine, "requested_batch_size": child.requested, type_tag: wanted,
            SHARED_NODE_TAG: "true" if shared else None}
    child.run_id = ctx.child_run(child.combo, child.index, child.attempt,
                                 {k: v for k, v in tags.items() if v is not None})
    tracking.set_child_status(child.run_id, "SCHEDULED")
    argv = child_command(child.combo, child.combo.batch_size, ctx.common)[1:]
    return argv, tracking.remote_child_env(child.run_id, ctx.parent.experiment_id)


class ClusterChecks:
    """The checks a cluster engine makes before any child starts: the GPU types the sweep names against those its
    nodes offer, and each child's GPUs against the most one node of its type has. The engine says what its nodes
    are (``_nodes()``), the types they offer (``types_of(nodes)``) and the GPUs of each node of a type
    (``gpus_per_node(nodes, wanted)``), the type a label asks for and back (``type_of``, ``label_of``), and its
    refusal of ``gpu=all`` when no node offers a type (``none_offered``)."""

    cluster = ""  # "the Ray cluster", in messages
    type_word = ""  # what a type is there: "accelerator type", "GPU gres type"
    no_gpus_fix = ""  # what to do when no node has a GPU
    share_node = False  # share_node=true: CPU children may run side by side on one node

    def cpu_gpus(self, wanted: str | None) -> int:
        """The GPUs a CPU child of type ``wanted`` holds."""
        return 0

    def expand_gpus(self, axes: dict) -> None:
        """``gpu=all``: one child per GPU type of the cluster; named labels must be types a node has."""
        types = self.types_of(self._nodes())
        if axes.get("gpu") and GPU_ALL in axes["gpu"]:
            if not types:
                raise VitregError(self.none_offered)
            axes["gpu"] = [self.label_of(t) for t in types]
        for label in axes.get("gpu", []):
            self._check_type(label, types)

    def _check_type(self, label: str, types: list[str]) -> None:
        wanted = self.type_of(label)
        if wanted and wanted not in types:
            raise VitregError(f"gpu={label}: no node of {self.cluster} has {self.type_word} {wanted} (it has: "
                              f"{', '.join(types) or 'none'}): pass gpu=all or the labels of the types it has")

    def check(self, combos: list, common: dict) -> None:
        """Every child's type is on a node (a CPU child's too: it runs on a node of its type), and its GPUs fit
        on one node of that type (a child that can never start is refused now)."""
        nodes = self._nodes()
        types = self.types_of(nodes)
        for combo in combos:
            self._check_type(str(combo.get("gpu", common.get("gpu") or "auto")), types)
            need, wanted = self.request(combo, common)
            most = max(self.gpus_per_node(nodes, wanted), default=0)
            if need and most < need:
                fix = f"pass nproc={most} or less" if most else self.no_gpus_fix
                raise VitregError(f"{combo.label} asks for {need} GPUs{f' of type {wanted}' if wanted else ''} and "
                                  f"no node of {self.cluster} has them (the most a node has: {most}): {fix}")

    def request(self, combo, common: dict) -> tuple[int, str | None]:
        """(GPUs, type) a child asks for: ``nproc`` GPUs, or :meth:`cpu_gpus` for a CPU child."""
        def given(name: str, default):
            return combo.get(name, common.get(name) or default)

        wanted = self.type_of(str(given("gpu", "auto")))
        if self.on_cpu(combo, common):
            return self.cpu_gpus(wanted), wanted
        return int(given("nproc", 1)), wanted

    @staticmethod
    def on_cpu(combo, common: dict) -> bool:
        """Whether the child times on its node's CPU (``device=cpu``)."""
        return str(combo.get("device", common.get("device") or "auto")) == "cpu"


@dataclass
class RemoteChild:
    """One attempt at one combination on a cluster: its place in the sweep, the batch first asked for, its run
    once made, and (SLURM) its job and how it was last seen."""

    index: int
    combo: Combination
    attempt: int
    requested: object
    run_id: str = ""
    clock: Clock | None = None
    started: bool = False
    node: str = ""
    host: str = ""  # the machine it runs on (two nodes of one machine are one host)
    peers: int = 0  # the most children at once on its host while it ran (HOST_SHARE_TAG)
    job: object = None
    unseen_polls: int = 0  # polls in a row that squeue did not show the job

    @property
    def key(self) -> str:
        """Its row on the sweep's board."""
        return str(self.combo.get("gpu") or "any")


class Follower:
    """The parent's loop of a cluster engine: submits the children (at most ``max_parallel`` at once), follows
    them (:meth:`_poll`) and ends each child run with its outcome; SIGINT/SIGTERM cancels them all. An engine's
    follower says how a child is submitted (``_submit``, which returns its key in :attr:`pending`), followed
    (``_poll``, which calls :meth:`_started` and :meth:`_ended`) and cancelled (``_cancel_all(reason)``)."""

    engine_name = ""  # the child run's sweep_engine tag
    type_tag = ""  # the child run's tag of the GPU type it asks for

    def __init__(self, engine, ctx, combos: list):
        self.engine, self.ctx = engine, ctx
        self.queue = [RemoteChild(index, combo, 0, combo.batch_size) for index, combo in enumerate(combos, 1)]
        self.pending: dict = {}  # the Ray task or the SLURM job id -> child

    def run(self) -> None:
        for child in self.queue:
            self.ctx.board.queued(child.key)
        try:
            while self.queue or self.pending:
                while self.queue and len(self.pending) < self.engine.max_parallel:
                    child = self.queue.pop(0)
                    need, wanted = self.engine.request(child.combo, self.ctx.common)
                    shared = self.engine.share_node and self.engine.on_cpu(child.combo, self.ctx.common)
                    argv, env = start_remote(self.ctx, child, self.engine_name, self.type_tag, wanted, shared)
                    self.pending[self._submit(child, argv, env, need, wanted)] = child
                    child.clock = Clock()
                self._poll()
        except KeyboardInterrupt as exc:
            stop = _as_received(exc)
            self._cancel_all(signals.interrupted_reason(stop))
            raise stop from None

    def _started(self, child: RemoteChild, node: str = "", host: str = "") -> None:
        child.started, child.node, child.host = True, node or child.node, host or node
        on_host = [c for c in self.pending.values() if c.started and c.host == child.host]
        for c in on_host:
            c.peers = max(c.peers, len(on_host))
        tracking.set_child_status(child.run_id, "RUNNING")
        self.ctx.board.started(child.key)

    @staticmethod
    def _placed(child: RemoteChild) -> dict:
        """The child run's tag of the most children at once on its host (none for one that never started)."""
        return {HOST_SHARE_TAG: child.peers} if child.started else {}

    def _ended(self, child: RemoteChild, ok: bool, reason: str, retry: bool = True) -> None:
        """The sweep's count and board; a failure said, and an out-of-memory child queued again with a smaller
        batch (as engine=local does)."""
        self.ctx.record(child.run_id, ok)
        self.ctx.board.ended(child.key, ok, child.clock.seconds() if ok else None,
                             was="running" if child.started else "queued")
        if ok:
            return
        self.ctx.progress(f"sweep {child.index}/{self.ctx.total} {child.combo.label}: FAILED: {reason}")
        retries_left = retry and child.attempt < self.ctx.max_oom_retries
        smaller = smaller_batch(child.combo.batch_size, child.run_id) if retries_left else 0
        if smaller >= 1:
            self.ctx.progress(f"out of memory at batch {child.combo.batch_size}: retrying with batch {smaller}")
            self.queue.append(RemoteChild(child.index, child.combo.with_batch(smaller), child.attempt + 1,
                                          child.requested))
            self.ctx.board.requeued(child.key)


def _as_received(exc: KeyboardInterrupt) -> KeyboardInterrupt:
    """Ray's wait turns the Terminated that vitreg's SIGTERM handler raised into a plain KeyboardInterrupt:
    the signal that came is what the runs and the exit status say."""
    if not isinstance(exc, signals.Terminated) and signals._received:
        return signals.Terminated(signals._received[0])
    return exc
