"""What the training loop (:func:`vitreg.train.loop.train`) is given besides the spec, runtime and model,
in four values: what it trains on (:class:`Sources`), where its checkpoints go and come from
(:class:`Checkpoints`), its callbacks (:class:`Hooks`) and its place in a DDP job (:class:`Ranks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vitreg.console import progress


@dataclass(frozen=True)
class Hooks:
    """The loop's callbacks (see the module docstring) and where its messages go."""

    on_step: Callable | None = None
    on_log: Callable | None = None
    on_checkpoint: Callable | None = None
    on_epoch_end: Callable | None = None
    progress: Callable = progress


@dataclass(frozen=True)
class Sources:
    """What the loop trains on and learns from: ``data`` (default: :func:`vitreg.train.data.build_data`),
    the distillation ``teacher`` (default: :func:`vitreg.train.losses.create_teacher`, which loads a
    ``teacher=`` URI through ``teacher_loader``)."""

    data: object = None
    teacher: object = None
    teacher_loader: Callable | None = None


@dataclass(frozen=True)
class Checkpoints:
    """``directory``: where ``step-<N>/`` checkpoints are written (None: none); ``resume_from``: a
    checkpoint (a VerifiedCheckpoint or a directory) to continue from; ``extra``: saved in each one."""

    directory: Path | None = None
    resume_from: object = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a DDP job, for the loop: data sharding (``rank`` of ``world_size``,
    ``sampler_factory``), the DDP ``wrap``, the ``reducer`` (a :class:`vitreg.ddp.world.TrainReducer`),
    and ``is_main`` (False on ranks that must not write checkpoints or validate)."""

    world_size: int = 1
    rank: int = 0
    is_main: bool = True
    wrap: Callable | None = None
    reducer: object = None
    sampler_factory: Callable | None = None
