"""What the user asked for, validated once: :class:`BenchSpec`.

Values arrive as strings from ``mlflow run -P k=v`` and from click; :func:`parse_bool`,
:func:`parse_int` and the ``*_CHOICES`` tuples turn them into typed, checked values, so nothing
below this module ever sees an unparsed option. Values that depend on the hardware (``gpu=auto``,
``amp=auto``, ``device=auto``, ``img_size=0``) stay symbolic here and are resolved by
:mod:`vitreg.hardware.profiles` and :mod:`vitreg.models.factory`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields

from vitreg.errors import VitregError

TASKS = ("infer", "train", "both")
AMP_CHOICES = ("auto", "off", "bf16", "fp16")
COMPILE_CHOICES = ("off", "default", "reduce-overhead", "max-autotune")
COMPILE_BACKENDS = ("inductor", "eager", "aot_eager", "cudagraphs")
DEVICE_CHOICES = ("auto", "cuda", "cpu")
#: DDP communication hooks: none (fp32 gradients all-reduced), or torch's fp16/bf16 compress hooks
DDP_COMM_HOOKS = ("none", "fp16", "bf16")
DDP_BUCKET_MB = 25.0  # torch's DistributedDataParallel default bucket_cap_mb

_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f", "")


def parse_bool(value, name: str) -> bool:
    """``"true"``/``"false"`` (and 1/0, yes/no, on/off) -> bool. MLflow passes every -P as a string,
    so ``bool("false")`` would be True: parse the value, never its truthiness."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise VitregError(f"{name}={value!r} is not a boolean: use {name}=true or {name}=false")


def parse_int(value, name: str, minimum: int | None = None) -> int:
    """An integer option, with a lower bound, from a string or an int."""
    try:
        number = int(str(value).strip())
    except ValueError:
        raise VitregError(f"{name}={value!r} is not an integer: pass e.g. {name}=64") from None
    if minimum is not None and number < minimum:
        raise VitregError(f"{name}={number} must be >= {minimum}: pass e.g. {name}={max(minimum, 1)}")
    return number


def parse_choice(value, name: str, choices: tuple[str, ...]) -> str:
    """A value from a fixed set; a near miss gets a suggestion."""
    text = str(value).strip().lower()
    if text in choices:
        return text
    close = difflib.get_close_matches(text, choices, n=1)
    hint = f" (did you mean {name}={close[0]}?)" if close else ""
    raise VitregError(f"{name}={value!r} is not one of {', '.join(choices)}{hint}")


class _Spec:
    """What BenchSpec and TrainSpec share: params for MLflow, construction from option dicts."""

    _kind = "spec"  # named in the unknown-option message

    def _put(self, name, value):
        object.__setattr__(self, name, value)  # frozen dataclass: parse in place in __post_init__

    def _parse_model_gpu_img(self) -> None:
        """The options every spec shares: model (non-empty), gpu label, img_size (0 or >= 16)."""
        self._put("model", str(self.model).strip())
        if not self.model:
            raise VitregError(f"model is empty: pass e.g. model={type(self).model}")
        self._put("gpu", str(self.gpu).strip().lower() or "auto")
        self._put("img_size", parse_int(self.img_size, "img_size", 0))
        if 0 < self.img_size < 16:
            raise VitregError(f"img_size={self.img_size} is too small: pass img_size=0 for the model default or e.g. 224")

    def _parse_ddp(self) -> None:
        """The DistributedDataParallel settings (used only when nproc/nnodes make a DDP job)."""
        self._put("ddp_bucket_mb", parse_float(self.ddp_bucket_mb, "ddp_bucket_mb"))
        if self.ddp_bucket_mb <= 0:
            raise VitregError(f"ddp_bucket_mb={self.ddp_bucket_mb:g} must be > 0: pass e.g. "
                              f"ddp_bucket_mb={DDP_BUCKET_MB:g} (torch's default)")
        self._put("ddp_static_graph", parse_bool(self.ddp_static_graph, "ddp_static_graph"))
        self._put("ddp_comm_hook", parse_choice(self.ddp_comm_hook, "ddp_comm_hook", DDP_COMM_HOOKS))

    def ddp_options(self) -> dict:
        """Keyword arguments for :func:`vitreg.dist.world.ddp_wrap`."""
        return {"bucket_cap_mb": self.ddp_bucket_mb, "static_graph": self.ddp_static_graph,
                "comm_hook": self.ddp_comm_hook}

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_params(self) -> dict[str, str]:
        """Every field as an MLflow param (strings, as MLflow stores them)."""
        return {f.name: _param_str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_options(cls, options: dict):
        """Build from a dict of option values, refusing unknown keys with a suggestion."""
        known = {f.name for f in fields(cls)}
        for key in options:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise VitregError(f"unknown {cls._kind} option {key!r}{hint}; options: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in options.items() if v is not None})


@dataclass(frozen=True)
class BenchSpec(_Spec):
    """One benchmark: a model, a batch, a precision, a compile mode, and how long to time it.

    ``steps`` iterations make one timed window; ``repeats`` windows give the median and the
    spread. ``warmup`` iterations run first and are never timed into the result (the first of them
    carries compilation when ``compile`` is on, and is reported apart as ``compile_time_s``).
    """

    _kind = "bench"  # a class attribute (no annotation), not a field

    model: str = "vit_base_patch16_224"
    gpu: str = "auto"
    task: str = "both"
    batch_size: int = 64
    img_size: int = 0  # 0: the model's own default resolution
    amp: str = "auto"  # auto: bf16 where the GPU has it, fp16 otherwise, off on CPU
    compile: str = "off"
    compile_backend: str = "inductor"
    warmup: int = 10
    steps: int = 30
    repeats: int = 5
    device: str = "auto"
    allow_gpu_mismatch: bool = False
    nproc: int = 1
    ddp_bucket_mb: float = DDP_BUCKET_MB
    ddp_static_graph: bool = False
    ddp_comm_hook: str = "none"  # none, or fp16/bf16: gradients all-reduced in that precision (DDP's compress hooks)
    profile_steps: int = 0  # train: N more steps under torch.profiler after the timed windows (0: none)
    cuda_graph: bool = False  # capture each task's step in one CUDA graph and time its replays (vitreg.measure.graphs)
    seed: int = 0

    def __post_init__(self):
        # Parse in place so BenchSpec(**strings) works for -P values.
        put = self._put
        self._parse_model_gpu_img()
        put("task", parse_choice(self.task, "task", TASKS))
        put("batch_size", parse_int(self.batch_size, "batch_size", 1))
        put("amp", parse_choice(self.amp, "amp", AMP_CHOICES))
        put("compile", parse_choice(self.compile, "compile", COMPILE_CHOICES))
        put("compile_backend", parse_choice(self.compile_backend, "compile_backend", COMPILE_BACKENDS))
        put("warmup", parse_int(self.warmup, "warmup", 1))
        put("steps", parse_int(self.steps, "steps", 1))
        put("repeats", parse_int(self.repeats, "repeats", 1))
        put("device", parse_choice(self.device, "device", DEVICE_CHOICES))
        put("allow_gpu_mismatch", parse_bool(self.allow_gpu_mismatch, "allow_gpu_mismatch"))
        put("nproc", parse_int(self.nproc, "nproc", 1))
        self._parse_ddp()
        put("profile_steps", parse_int(self.profile_steps, "profile_steps", 0))
        put("cuda_graph", parse_bool(self.cuda_graph, "cuda_graph"))
        self._check_cuda_graph()
        put("seed", parse_int(self.seed, "seed", 0))

    def _check_cuda_graph(self) -> None:
        if not self.cuda_graph:
            return
        if self.amp == "fp16":
            raise VitregError("cuda_graph=true cannot capture fp16's GradScaler (it checks for infs on the host): "
                              "use amp=bf16 or amp=off, or cuda_graph=false")
        if self.compile in ("reduce-overhead", "max-autotune") or self.compile_backend == "cudagraphs":
            what = f"compile={self.compile}" if self.compile_backend != "cudagraphs" else "compile_backend=cudagraphs"
            raise VitregError(f"cuda_graph=true and {what} both make CUDA graphs: use compile=off or compile=default "
                              f"with cuda_graph=true, or cuda_graph=false")

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks to run, in order: inference first (it is cheaper and fails faster)."""
        return ("infer", "train") if self.task == "both" else (self.task,)



def _param_str(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --------------------------------------------------------------------------- training

DISTILLATION_CHOICES = ("none", "soft", "hard")


def parse_float(value, name: str, minimum: float | None = None, maximum: float | None = None,
                below: float | None = None) -> float:
    """A float option from a string or a number, with bounds (``below`` is exclusive)."""
    try:
        number = float(str(value).strip())
    except ValueError:
        raise VitregError(f"{name}={value!r} is not a number: pass e.g. {name}=0.1") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise VitregError(f"{name}={value!r} must be a finite number")
    if minimum is not None and number < minimum:
        raise VitregError(f"{name}={number:g} must be >= {minimum:g}")
    if maximum is not None and number > maximum:
        raise VitregError(f"{name}={number:g} must be <= {maximum:g}")
    if below is not None and number >= below:
        raise VitregError(f"{name}={number:g} must be < {below:g}")
    return number


@dataclass(frozen=True)
class TrainSpec(_Spec):
    """One training run: model, data, optimisation, precision, checkpoints, distillation, registration.

    ``steps`` counts optimizer updates; ``steps=0`` trains ``epochs`` passes over the data instead (a
    synthetic epoch is :data:`vitreg.train.data.SYNTHETIC_IMAGES_PER_EPOCH` images). The LR follows
    ``warmup_steps`` of linear warm-up from 1e-6 then a cosine down to ``min_lr`` at the last step.
    ``num_classes=0`` takes the number of class folders of ``data`` (1000 for synthetic data).
    ``teacher`` (with ``distillation=soft|hard`` and a ``deit_*_distilled_*`` model) is a timm name
    (built with random weights: vitreg never downloads), a ``models:/`` URI of a registered model,
    or a local checkpoint directory.
    """

    _kind = "train"  # a class attribute (no annotation), not a field

    model: str = "deit_tiny_patch16_224"
    gpu: str = "auto"
    img_size: int = 0
    batch_size: int = 64
    steps: int = 0
    epochs: int = 1
    lr: float = 5e-4
    weight_decay: float = 0.05
    warmup_steps: int = 10
    min_lr: float = 1e-5
    clip_grad: float = 0.0  # max global grad norm; 0 = off
    label_smoothing: float = 0.1
    amp: str = "auto"
    compile: str = "off"
    compile_backend: str = "inductor"
    device: str = "auto"
    allow_gpu_mismatch: bool = False
    data: str = "synthetic"
    num_workers: int = 4
    num_classes: int = 0
    log_every: int = 10
    checkpoint_every: int = 1000  # 0 = only at the end
    resume: str = ""
    distillation: str = "none"
    teacher: str = ""
    distill_alpha: float = 0.5
    distill_tau: float = 1.0
    register_as: str = ""
    alias: str = "latest"
    nproc: int = 1
    ddp_bucket_mb: float = DDP_BUCKET_MB
    ddp_static_graph: bool = False
    ddp_comm_hook: str = "none"
    seed: int = 0

    def __post_init__(self):
        put = self._put
        self._parse_model_gpu_img()
        put("batch_size", parse_int(self.batch_size, "batch_size", 1))
        put("steps", parse_int(self.steps, "steps", 0))
        put("epochs", parse_int(self.epochs, "epochs", 0))
        if self.steps == 0 and self.epochs == 0:
            raise VitregError("steps=0 and epochs=0 train nothing: pass steps=N (optimizer updates) or epochs=N")
        put("lr", parse_float(self.lr, "lr", minimum=0.0))
        if self.lr == 0:
            raise VitregError("lr=0 trains nothing: pass e.g. lr=5e-4")
        put("weight_decay", parse_float(self.weight_decay, "weight_decay", minimum=0.0))
        put("warmup_steps", parse_int(self.warmup_steps, "warmup_steps", 0))
        put("min_lr", parse_float(self.min_lr, "min_lr", minimum=0.0))
        if self.min_lr > self.lr:
            raise VitregError(f"min_lr={self.min_lr:g} is above lr={self.lr:g}: pass a smaller min_lr (e.g. {self.lr / 50:g})")
        put("clip_grad", parse_float(self.clip_grad, "clip_grad", minimum=0.0))
        put("label_smoothing", parse_float(self.label_smoothing, "label_smoothing", minimum=0.0, below=1.0))
        put("amp", parse_choice(self.amp, "amp", AMP_CHOICES))
        put("compile", parse_choice(self.compile, "compile", COMPILE_CHOICES))
        put("compile_backend", parse_choice(self.compile_backend, "compile_backend", COMPILE_BACKENDS))
        put("device", parse_choice(self.device, "device", DEVICE_CHOICES))
        put("allow_gpu_mismatch", parse_bool(self.allow_gpu_mismatch, "allow_gpu_mismatch"))
        put("data", str(self.data).strip() or "synthetic")
        if self.data.lower() == "synthetic":
            put("data", "synthetic")
        put("num_workers", parse_int(self.num_workers, "num_workers", 0))
        put("num_classes", parse_int(self.num_classes, "num_classes", 0))
        if self.num_classes == 1:
            raise VitregError("num_classes=1 cannot be trained with cross-entropy: pass num_classes=0 (from the data) or >= 2")
        put("log_every", parse_int(self.log_every, "log_every", 1))
        put("checkpoint_every", parse_int(self.checkpoint_every, "checkpoint_every", 0))
        put("resume", str(self.resume or "").strip())
        put("distillation", parse_choice(self.distillation, "distillation", DISTILLATION_CHOICES))
        put("teacher", str(self.teacher or "").strip())
        if self.distillation != "none" and not self.teacher:
            raise VitregError(f"distillation={self.distillation} needs a teacher: pass teacher=<timm name>, "
                              f"teacher=models:/<name>@<alias> or a checkpoint directory")
        if self.distillation == "none" and self.teacher:
            raise VitregError(f"teacher={self.teacher} is set but distillation=none: pass distillation=soft or "
                              f"distillation=hard (or drop teacher)")
        put("distill_alpha", parse_float(self.distill_alpha, "distill_alpha", minimum=0.0, maximum=1.0))
        put("distill_tau", parse_float(self.distill_tau, "distill_tau", minimum=0.0))
        if self.distill_tau == 0:
            raise VitregError("distill_tau=0 divides by zero: pass distill_tau=1.0 (DeiT's) or another positive value")
        put("register_as", str(self.register_as or "").strip())
        put("alias", str(self.alias or "").strip() or "latest")
        put("nproc", parse_int(self.nproc, "nproc", 1))
        self._parse_ddp()
        put("seed", parse_int(self.seed, "seed", 0))

    @property
    def synthetic(self) -> bool:
        return self.data == "synthetic"

