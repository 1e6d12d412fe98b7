"""What the user asked for, validated once: :class:`BenchSpec` and :class:`TrainSpec`.

Their fields are the spec options of :data:`vitreg.config.options.OPTIONS`, each parsed by its option's kind,
choices and bounds (values arrive as strings from ``-P k=v`` and click), so nothing below sees an unparsed
option. What one value alone cannot say (``min_lr`` above ``lr``) is checked here. Values that depend on the
hardware (``gpu=auto``, ``amp=auto``, ``img_size=0``) stay symbolic until :mod:`vitreg.hardware.profiles` and
:mod:`vitreg.models.factory` resolve them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Literal  # noqa: F401 - named in the batch annotation below

from vitreg.config.options import DDP_BUCKET_MB, spec_options
from vitreg.config.parse import AUTO_BATCH, close_names, param_text
from vitreg.config.parse import TRUE as _TRUE, parse_bool, parse_int  # noqa: F401 - other modules import them from here
from vitreg.errors import VitregError
from vitreg.hardware.precision import check_tasks
from vitreg.measure.graphs import check_cuda_graph
from vitreg.measure.timing import StopRule
from vitreg.measure.traces import check_profile_request


class _Spec:
    """What BenchSpec and TrainSpec share: parsing by the table, params for MLflow, construction from dicts. A
    spec class names its command in its bases and declares that command's spec options as its fields, in table
    order (tests/test_layout.py compares the class bodies with the table)."""

    _kind = "spec"  # the command whose options are the fields; named in the unknown-option message
    _options: tuple = ()

    def __init_subclass__(cls, command: str = "spec", **kwargs):
        super().__init_subclass__(**kwargs)
        cls._kind = command
        cls._options = tuple(spec_options(command))

    def __post_init__(self):
        # Parse in place so Spec(**strings) works for -P values.
        if not str(self.model).strip():
            raise VitregError(f"model is empty: pass e.g. model={type(self).model}")
        for option in self._options:
            self._put(option.name, option.parse(getattr(self, option.name)))
        if 0 < self.img_size < 16:
            raise VitregError(f"img_size={self.img_size} is too small: pass img_size=0 for the model default or e.g. 224")
        if self.ddp_bucket_mb <= 0:
            raise VitregError(f"ddp_bucket_mb={self.ddp_bucket_mb:g} must be > 0: pass e.g. "
                              f"ddp_bucket_mb={DDP_BUCKET_MB:g} (torch's default)")
        self._check()

    def _check(self) -> None:
        """The checks of this kind of spec that span several fields."""

    def _put(self, name, value):
        object.__setattr__(self, name, value)  # frozen dataclass: parse in place in __post_init__

    def ddp_options(self) -> dict:
        """Keyword arguments for :func:`vitreg.ddp.world.ddp_wrap`."""
        return {"bucket_cap_mb": self.ddp_bucket_mb, "static_graph": self.ddp_static_graph,
                "comm_hook": self.ddp_comm_hook}

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_params(self) -> dict[str, str]:
        """Every field as an MLflow param (strings, as MLflow stores them)."""
        return {f.name: param_text(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_options(cls, options: dict):
        """Build from a dict of option values, refusing unknown keys with a suggestion."""
        known = {f.name for f in fields(cls)}
        for key in options:
            if key not in known:
                close = close_names(key, sorted(known))
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise VitregError(f"unknown {cls._kind} option {key!r}{hint}; options: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in options.items() if v is not None})


@dataclass(frozen=True)
class BenchSpec(_Spec, command="bench"):
    """One benchmark: a model, a batch, a precision, a compile mode, and how long to time it (each option's
    meaning: its entry in the option table)."""

    gpu: str = "auto"
    model: str = "vit_base_patch16_224"
    task: str = "both"
    batch_size: int | Literal["auto"] = "auto"
    img_size: int = 0
    amp: str = "auto"
    sdpa: str = "auto"
    compile_cache: str = ""
    compile: str = "off"
    compile_backend: str = "inductor"
    warmup: int = 10
    steps: int = 0
    repeats: int = 0
    precision_pct: float = 1.0
    window_min_s: float = 1.0
    max_time_s: float = 60.0
    device: str = "auto"
    allow_gpu_mismatch: bool = False
    nproc: int = 1
    ddp_bucket_mb: float = 25.0
    ddp_static_graph: bool = False
    ddp_comm_hook: str = "none"
    profile_steps: int = 0
    cuda_graph: bool = False
    profile: bool = False
    seed: int = 0

    def _check(self) -> None:
        check_tasks(self.amp, self.tasks)
        check_profile_request(self.profile, self.cuda_graph)
        if self.cuda_graph:
            check_cuda_graph(self.amp, self.compile, self.compile_backend)

    def stop_rule(self):
        """When each task's timed windows stop (:class:`vitreg.measure.timing.StopRule`)."""
        return StopRule(self.precision_pct, self.max_time_s, self.repeats)

    @property
    def auto_batch(self) -> bool:
        """``batch_size=auto``: each task's batch is searched before it is timed."""
        return self.batch_size == AUTO_BATCH

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks to run, in order: inference first (it is cheaper and fails faster)."""
        return ("infer", "train") if self.task == "both" else (self.task,)


@dataclass(frozen=True)
class TrainSpec(_Spec, command="train"):
    """One training run: model, data, optimisation, precision, checkpoints, distillation, registration (each
    option's meaning: its entry in the option table)."""

    gpu: str = "auto"
    model: str = "deit_tiny_patch16_224"
    batch_size: int = 64
    img_size: int = 0
    amp: str = "auto"
    sdpa: str = "auto"
    compile_cache: str = ""
    compile: str = "off"
    compile_backend: str = "inductor"
    steps: int = 0
    epochs: int = 1
    lr: float = 0.0005
    weight_decay: float = 0.05
    warmup_steps: int = 10
    min_lr: float = 1e-05
    clip_grad: float = 0.0
    label_smoothing: float = 0.1
    data: str = "synthetic"
    num_workers: int = 4
    num_classes: int = 0
    log_every: int = 10
    checkpoint_every: int = 1000
    keep_checkpoints: int = 1
    resume: str = ""
    distillation: str = "none"
    teacher: str = ""
    distill_alpha: float = 0.5
    distill_tau: float = 1.0
    register_as: str = ""
    alias: str = "latest"
    device: str = "auto"
    allow_gpu_mismatch: bool = False
    nproc: int = 1
    ddp_bucket_mb: float = 25.0
    ddp_static_graph: bool = False
    ddp_comm_hook: str = "none"
    seed: int = 0

    def _check(self) -> None:
        if self.steps == 0 and self.epochs == 0:
            raise VitregError("steps=0 and epochs=0 train nothing: pass steps=N (optimizer updates) or epochs=N")
        if self.lr == 0:
            raise VitregError("lr=0 trains nothing: pass e.g. lr=5e-4")
        if self.min_lr > self.lr:
            raise VitregError(f"min_lr={self.min_lr:g} is above lr={self.lr:g}: pass a smaller min_lr (e.g. {self.lr / 50:g})")
        if self.data.lower() == "synthetic":
            self._put("data", "synthetic")  # a keyword, not a folder: any case
        if self.num_classes == 1:
            raise VitregError("num_classes=1 cannot be trained with cross-entropy: pass num_classes=0 (from the data) or >= 2")
        self._check_distillation()

    def _check_distillation(self) -> None:
        if self.distillation != "none" and not self.teacher:
            raise VitregError(f"distillation={self.distillation} needs a teacher: pass teacher=<timm name>, "
                              f"teacher=models:/<name>@<alias> or a checkpoint directory")
        if self.distillation == "none" and self.teacher:
            raise VitregError(f"teacher={self.teacher} is set but distillation=none: pass distillation=soft or "
                              f"distillation=hard (or drop teacher)")
        if self.distill_tau == 0:
            raise VitregError("distill_tau=0 divides by zero: pass distill_tau=1.0 (DeiT's) or another positive value")

    @property
    def synthetic(self) -> bool:
        return self.data == "synthetic"
