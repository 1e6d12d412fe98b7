"""Every option of ``bench``, ``infer``, ``sweep``, ``train``, ``compare`` and ``check``, declared once:
:data:`OPTIONS`. From it come the click options (:func:`vitreg.cli.common.command_options`), MLproject and
the README's parameter tables (:mod:`vitreg.config.generate`), the fields of BenchSpec and TrainSpec and how
each is parsed (:mod:`vitreg.config.spec`), and the argv that hands options to a child process.

**Adding an option** touches: its :class:`Option` entry below (``identity=True`` when it changes the work
measured, else ``same_work="why not"``); for a spec field, its line in the class body of ``BenchSpec`` /
``TrainSpec`` (in table order: tests/test_layout.py); its ``--help`` section in :data:`HELP_GROUPS`; then
``make mlproject``; and its behaviour where the spec's value is used (docs/ARCHITECTURE.md, "Where to add").
An option whose meaning or default differs between commands (``steps``) is two entries with disjoint commands.
"""

from __future__ import annotations

from dataclasses import dataclass

from vitreg.config.parse import (AUTO_BATCH, param_text, parse_batch, parse_bool, parse_choice, parse_float, parse_int,
                                 parse_runtime_env)
from vitreg.errors import VitregError
from vitreg.hardware.precision import INFERENCE_ONLY, PRECISION_CHOICES
from vitreg.hardware.profiles import label_list  # the GPU labels of the help and docs: one table, PROFILES
from vitreg.hardware.sdpa import SDPA_CHOICES
from vitreg.models.families import names_text

COMMANDS = ("bench", "infer", "sweep", "train", "compare", "check")
KINDS = ("str", "int", "float", "bool", "choice", "batch", "runtime_env")  # batch: an int >= 1 or "auto"

TASKS = ("infer", "train", "both")
AMP_CHOICES = ("auto", *PRECISION_CHOICES)  # bench and infer
TRAIN_AMP_CHOICES = tuple(c for c in AMP_CHOICES if c not in INFERENCE_ONLY)
COMPILE_CHOICES = ("off", "default", "reduce-overhead", "max-autotune")
COMPILE_BACKENDS = ("inductor", "eager", "aot_eager", "cudagraphs")
DEVICE_CHOICES = ("auto", "cuda", "cpu")
#: DDP communication hooks: none (fp32 gradients all-reduced), or torch's fp16/bf16 compress hooks
DDP_COMM_HOOKS = ("none", "fp16", "bf16")
DDP_BUCKET_MB = 25.0  # torch's DistributedDataParallel default bucket_cap_mb
DISTILLATION_CHOICES = ("none", "soft", "hard")
SEED_MAX = 2**63 - 1  # torch.manual_seed takes a 64-bit integer; larger ones were an overflow traceback
# The most iterations, updates or passes one count option may ask for: orders of magnitude past any real
# job (300 ImageNet epochs at batch 1024 are 375,000 updates). `--warmup 10**30` was accepted and ran until
# killed; what this bound lets through but cannot finish here, the estimate refuses (measure/estimate.py).
COUNT_MAX = 10**9


@dataclass(frozen=True)
class Option:
    """One option: what it is called, what it holds, who takes it, what it means."""

    name: str  # the MLproject param and spec field; the flags are --name-with-dashes and --name_as_is
    kind: str  # one of KINDS
    default: object  # typed (64, 25.0, False, "auto"); None: no default
    help: str  # the click help
    commands: tuple[str, ...]  # the vitreg commands (and MLproject entry points) that take it
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    below: float | None = None  # exclusive upper bound
    doc: str | None = None  # the README's meaning, when longer than the help
    spec_field: bool = True  # a BenchSpec/TrainSpec field; False: the command's own (launcher, run, sweep lists)
    mlproject: bool = True  # False: a click option only (the experiment and run name: `mlflow run` picks its own)
    required: bool = False  # the vitreg command refuses to run without it (its MLproject param may still default)
    unless: str | None = None  # with required: ... unless this other option is given (sweep --rerun-failed)
    envvar: str | None = None
    lowercase: bool = False
    aliases: tuple[str, ...] = ()  # more click flags for it (``--experiment-name``, as ``mlflow run`` spells it)
    repeatable: bool = False  # the click flag may be given several times (its value is then a tuple of texts)
    help_flag: str | None = None  # the spelling --help shows, when not the first flag (sweep's one-axis --axis)
    # Identity: True when the option changes the work measured, so two runs that differ in it are two
    # configurations and are never pooled (compare, check, scaling baselines, sweep labels, reports).
    # Otherwise ``same_work`` says why runs that differ in it measure the same work.
    identity: bool = False
    same_work: str = ""

    @property
    def flags(self) -> list[str]:
        """Both spellings (``mlflow run`` appends an undeclared ``-P k=v`` as ``--k v``), then the aliases."""
        dashed = f"--{self.name.replace('_', '-')}"
        return ([dashed] if "_" not in self.name else [dashed, f"--{self.name}"]) + list(self.aliases)

    @property
    def default_text(self) -> str:
        """The default as MLflow and click hold it (a string; booleans as true/false)."""
        return "" if self.default is None else param_text(self.default)

    @property
    def meaning(self) -> str:
        return self.doc or self.help

    def parse(self, value):
        """The typed value of ``value`` (a string or already typed); a bad one raises VitregError."""
        if self.kind == "bool":
            return parse_bool(value, self.name)
        if self.kind == "int":
            number = parse_int(value, self.name, self.minimum)
            if self.maximum is not None and number > self.maximum:
                raise VitregError(f"{self.name}={number} must be <= {int(self.maximum)}")
            return number
        if self.kind == "float":
            return parse_float(value, self.name, self.minimum, self.maximum, self.below)
        if self.kind == "choice":
            return parse_choice(value, self.name, self.choices)
        if self.kind == "batch":
            return parse_batch(value, self.name)
        if self.kind == "runtime_env":  # a dict: Ray's runtime_env, its env_vars values secrets
            return parse_runtime_env(value, self.name)
        text = str(value if value is not None else "").strip()
        if not text and str(value or ""):  # '   ': given, yet nothing (an empty one is the default)
            raise VitregError(f"{self.name}={value!r} is blank: pass a value, or leave {self.flags[0]} out")
        if self.maximum is not None and len(text) > self.maximum:  # a text's maximum is its length
            raise VitregError(f"{self.name} is {len(text):,} characters, over {self.maximum:,.0f}: pass a shorter one")
        return (text.lower() if self.lowercase else text) or self.default


def options_of(command: str) -> list[Option]:
    """The options ``command`` takes, in table order."""
    return [o for o in OPTIONS if command in o.commands]


def spec_options(command: str) -> list[Option]:
    """The options that are fields of ``command``'s spec (BenchSpec for bench, TrainSpec for train)."""
    return [o for o in options_of(command) if o.spec_field]


def identity_names(command: str) -> tuple[str, ...]:
    """The options of ``command`` that change the work measured: what makes two of its runs the same
    configuration (in table order). compare, check, scaling baselines, sweep labels and reports read this."""
    return tuple(dict.fromkeys(o.name for o in options_of(command) if o.identity))


def option(command: str, name: str) -> Option:
    """``command``'s option called ``name``."""
    (found,) = [o for o in options_of(command) if o.name == name]
    return found


_DDP = ("bench", "train")  # the commands that run one job on several processes (and hosts)
_RUNS = ("bench", "infer", "sweep", "train")  # the commands that log benchmark or training runs
_TIMED = ("bench", "infer", "sweep")  # the commands that time windows of iterations
_CHECKS = "a check option: it reads runs and measures nothing"
_COMPARES = "a compare option: it reads runs and measures nothing"
_WHERE = "where the children run, not what each measures"
_SWEEP_LIST = "a sweep list: each child run takes one of its values as its own option"

OPTIONS: tuple[Option, ...] = (
    Option("model_uri", "str", None, "models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID/checkpoints/last.",
           ("infer",), required=True, spec_field=False, identity=True),
    Option("models", "str", "vit_base_patch16_224", "Comma-separated model names.", ("sweep",),
           required=True, unless="rerun_failed", spec_field=False,  # --rerun-failed reads them from the runs
           same_work=_SWEEP_LIST),
    Option("amp", "str", "auto", "Comma-separated, e.g. off,bf16.", ("sweep",), spec_field=False,
           same_work=_SWEEP_LIST),
    Option("compile", "str", "off", "Comma-separated, e.g. off,default.", ("sweep",), spec_field=False,
           same_work=_SWEEP_LIST),
    Option("batch_size", "str", AUTO_BATCH, "Comma-separated, e.g. 32,256, or auto (as in bench: the fastest batch "
           "that fits, searched by each child).", ("sweep",), spec_field=False, same_work=_SWEEP_LIST),
    Option("axes", "str", "", "one more axis over any bench option, e.g. sdpa=auto,cudnn; repeatable (--axes "
           "\"NAME=V1,V2;NAME=V1,V2\" takes several at once).", ("sweep",), spec_field=False, aliases=("--axis",),
           repeatable=True, help_flag="--axis",
           doc="more axes, `NAME=V1,V2;NAME=V1,V2`, over any bench option (`sdpa=auto,cudnn;nproc=1,2`); on the CLI "
               "also `--axis NAME=V1,V2`, repeatable. Every combination is checked against the option table before "
               "any child starts", same_work=_SWEEP_LIST),
    Option("engine", "choice", "local", "local (this host: one child per GPU at once), ray (a Ray cluster) or slurm "
           "(a SLURM cluster, through submitit).",
           ("sweep",), choices=("local", "ray", "slurm"), spec_field=False,
           doc="`local`: children on this host, one per GPU at once (one at a time on CPU); `ray`: each child a Ray "
               "task on the cluster at `ray_address`, asking for `nproc` GPUs of the GPU type it is filed under; "
               "`slurm`: each child a SLURM job (submitit) asking for its GPU type by gres or constraint",
           same_work=_WHERE),
    Option("ray_address", "str", "auto", "engine=ray: auto (the running cluster), ray://HOST:PORT, HOST:PORT, or "
           "local (start one here).", ("sweep",), spec_field=False,
           doc="`engine=ray`: `auto` (the cluster this host belongs to), `ray://HOST:PORT` (Ray Client), "
               "`HOST:PORT` (the head's GCS) or `local` (start a one-node cluster here for the sweep)",
           same_work=_WHERE),
    Option("ray_runtime_env", "runtime_env", "", "engine=ray: more of Ray's runtime_env for the tasks, JSON (e.g. "
           "'{\"pip\": [\"timm\"]}' for nodes without timm); vitreg itself is always shipped.", ("sweep",),
           spec_field=False, same_work="what the nodes' Python has; each run records its libraries' versions"),
    Option("slurm_partition", "str", "", "engine=slurm: the partition (empty: the cluster's default).", ("sweep",),
           spec_field=False, same_work=_WHERE),
    Option("slurm_account", "str", "", "engine=slurm: the account the jobs are charged to (empty: yours).",
           ("sweep",), spec_field=False, same_work=_WHERE),
    Option("slurm_qos", "str", "", "engine=slurm: the quality of service (empty: the default).", ("sweep",),
           spec_field=False, same_work=_WHERE),
    Option("slurm_time_min", "int", 60, "engine=slurm: each job's time limit in minutes.", ("sweep",), minimum=1,
           spec_field=False, same_work="a bound on each job's wall time; the work measured is the same"),
    Option("slurm_sbatch", "str", "", "engine=slurm: more sbatch options, NAME=VALUE;NAME (e.g. mem=16G;exclusive).",
           ("sweep",), spec_field=False, same_work=_WHERE),
    Option("slurm_gpu_by", "choice", "gres", "engine=slurm: ask for the GPU type by gres (gpu:TYPE:N) or constraint "
           "(a node feature).", ("sweep",), choices=("gres", "constraint"), spec_field=False, same_work=_WHERE),
    Option("slurm_folder", "str", "~/vitreg-slurm", "engine=slurm: a folder every node and this host share (job "
           "files, spools of children without the server).", ("sweep",), spec_field=False, same_work=_WHERE),
    Option("offline", "choice", "auto", "engine=slurm: auto (a child that cannot reach the tracking server spools to "
           "slurm_folder; the parent delivers it), true (always), false (never).", ("sweep",),
           choices=("auto", "true", "false"), spec_field=False,
           same_work="where a child's run is logged first, not what it measures"),
    Option("share_node", "bool", False, "engine=ray/slurm: let CPU children share a node (Ray: one CPU each; SLURM: "
           "no --exclusive); each child run is tagged sweep_shared_node=true.", ("sweep",),
           spec_field=False,
           doc="`engine=ray`/`slurm`: false (a CPU child has its node alone: Ray reserves every CPU of the node, "
               "SLURM asks `--exclusive`; a GPU child holds its own GPUs and its node's other GPUs take other "
               "children), true (CPU children are packed as the cluster allows: one Ray CPU, or SLURM's "
               "`cpus-per-task=nproc`, each; their runs are tagged `sweep_shared_node=true`)",
           same_work="how children are placed on nodes; a shared child's run says so (sweep_shared_node)"),
    Option("max_parallel", "int", 64, "children at once, at most (local: also one per nproc GPUs, one on CPU; "
           "ray: tasks in flight).", ("sweep",), minimum=1, spec_field=False,
           same_work="how many children run at once; each child's work is the same"),
    Option("isolate", "choice", "worker", "engine=local: worker (one warm process per GPU runs its children one "
           "after another: imports, store and compile caches paid once) or process (a process per child).",
           ("sweep",), choices=("worker", "process"), spec_field=False,
           same_work="which process runs a child; each child's work, seed and graph are its own"),
    Option("rerun_failed", "str", "", "a sweep's parent run id: re-run under it every combination with no "
           "FINISHED child (failed, killed, or never started), each with its options, on the parent's engine and "
           "engine options (those given now win; an axis or bench option given is refused; the FINISHED ones stay, a replaced child is tagged "
           "sweep_superseded_by).", ("sweep",), spec_field=False,
           mlproject=False, same_work="which children run again; each one's work is the one it was started with"),
    Option("max_combinations", "int", 256, "refuse a sweep of more combinations than this, before any child starts "
           "(raise it to mean it).", ("sweep",), minimum=1, spec_field=False,
           same_work="a bound on the sweep's size; each child's work is the same"),
    Option("gpu", "str", "auto", f"GPU label ({label_list()}) or auto; checked against the detected hardware.",
           _RUNS, lowercase=True,
           doc=f"GPU label: {label_list(code=True)}, or `auto` (detect). An explicit label must match the detected "
               "hardware, or the run is refused before any GPU work.",
           same_work="the hardware a run is filed under: the axis runs are compared along, never pooled over"),
    Option("model", "str", "vit_base_patch16_224", f"a name of a model family: {names_text()}.",
           ("bench",),
           doc=f"a name of a model family (vitreg/models/families.py): {names_text(markdown=True)}; distilled DeiTs "
               "train both heads. Always random weights (`pretrained=False`).", identity=True),
    Option("model", "str", "deit_tiny_patch16_224",
           f"a name of a model family ({names_text()}); deit_*_distilled_* for distillation.",
           ("train",), doc=f"a name of a model family: {names_text(markdown=True)}", identity=True),
    Option("task", "choice", "both", "what to time: inference, a training step, or both.", ("bench", "sweep"),
           choices=TASKS,
           doc="`infer`, `train` or `both`", identity=True),
    Option("task", "choice", "infer", "what to time: inference, a training step, or both.", ("infer",), choices=TASKS,
           identity=True),
    Option("batch_size", "batch", AUTO_BATCH, "images per step per process, or auto: the fastest batch that fits, "
           "searched per task before timing (GPU: from 256 up; CPU: 8 to 64).", ("bench", "infer"),
           doc="images per iteration (per GPU with `nproc` > 1), or `auto` (the default): before timing, each task "
               "probes batches (GPU: 256, doubling while throughput gains 1 % and more than the probes' own spread, "
               "backing off after an out-of-memory; CPU: 8 to 64) and takes the smallest not clearly slower than the "
               "fastest. A batch found once is kept in `~/.cache/vitreg/autobatch.json` and the mission's on the GPUs "
               "vitreg was measured on (H100, H200) ships with it: no probe, the task's warm-up checks it "
               "(`<task>_batch_size_source`: `probe`, `cache`, `measured`). Logged as the "
               "`<task>_batch_probe_img_per_s` series (step = batch) and the `<task>_batch_size_chosen` tag; the "
               "`batch_size` tag stays `auto`. With `nproc` > 1 every rank probes alone and all take the smallest "
               "choice", identity=True),
    Option("batch_size", "int", 64, "images per step per process.", ("train",), minimum=1,
           doc="images per iteration (per GPU with `nproc` > 1)", identity=True),
    Option("img_size", "int", 0, "0 = the model's default resolution.", ("bench", "sweep", "train"), minimum=0,
           doc="input resolution; `0` = the model's default. Must be a multiple of the patch size.", identity=True),
    Option("amp", "choice", "auto",
           "precision; auto = bf16 where the GPU has it, fp16 on V100/T4, off on CPU.",
           ("bench", "infer"), choices=AMP_CHOICES,
           doc="precision: `off` (strict fp32), `tf32` (fp32, TF32 matmuls; MFU against the TF32 peak), `bf16`, "
               "`fp16` (autocast), `bf16-weights` / `fp16-weights` (weights and input cast, no autocast; infer only), "
               "`fp8` (torchao float8 Linear layers, the fastest recipe measured: tensor-wise scales; `fp8-rowwise` / "
               "`fp8-tensorwise` by name; infer only, compute capability >= 8.9, `pip install torchao`; logs "
               "fp8_top1_agreement and fp8_max_abs_logit_diff against bf16; without `compile` it runs eager, at about "
               "half of bf16's speed on an H200: said in one line, tagged `infer_eager_fp8`, flagged `eager fp8`). "
               "`auto` = bf16 where the GPU has it, fp16 on V100/T4, off on CPU. Tagged `precision`",
           identity=True),
    Option("amp", "choice", "auto",
           "precision; auto = bf16 where the GPU has it, fp16 on V100/T4, off on CPU.",
           ("train",), choices=TRAIN_AMP_CHOICES,
           doc="`off` (strict fp32), `tf32` (fp32, TF32 matmuls), `bf16`, `fp16` (autocast; fp16 training uses "
               "GradScaler). `auto` = bf16 where the GPU has it, fp16 on V100/T4, off on CPU.", identity=True),
    Option("sdpa", "choice", "auto", "attention kernel (auto: torch picks per call).",
           ("bench", "infer", "train"), choices=SDPA_CHOICES,
           doc="scaled-dot-product-attention backend: `auto` (torch picks per call), `flash`, `cudnn`, "
               "`efficient`, `math`. A backend that cannot run here is refused before the run; the backend that "
               "ran, read from the profiler, is tagged `<task>_sdpa_backend`", identity=True),
    Option("compile_cache", "str", "", "folder of the persistent torch.compile cache (empty: $VITREG_COMPILE_CACHE "
           "or ~/.cache/vitreg/inductor).", ("bench", "infer", "train"),
           doc="folder of the persistent inductor / FX-graph cache, used when compiling (`\"\"`: "
               "`$VITREG_COMPILE_CACHE`, else `~/.cache/vitreg/inductor`). The first call's cache state (`cold`, "
               "`warm`, `partial`) is tagged `<task>_compile_cache`, next to `<task>_compile_time_s`",
           same_work="where compiled code is kept: it changes the compile time (tagged), not the timed steps"),
    Option("compile", "choice", "off", "torch.compile mode (off: eager).", ("bench", "infer", "train"),
           choices=COMPILE_CHOICES, doc="`off`, `default`, `reduce-overhead`, `max-autotune` (torch.compile modes)",
           identity=True),
    Option("compile_backend", "choice", "inductor", "torch.compile backend (modes apply to inductor only).", _RUNS,
           choices=COMPILE_BACKENDS,
           doc="torch.compile backend (`eager` / `aot_eager` for debugging; modes apply to inductor only)",
           identity=True),
    Option("warmup", "int", 10, "untimed iterations (the first one is timed apart as compile/first-call time).",
           _TIMED, minimum=1, maximum=COUNT_MAX,
           doc="untimed iterations; the first is timed apart (`*_first_call_s`, and `*_compile_time_s` when "
               "compiling)", same_work="untimed iterations before the timed windows"),
    Option("steps", "int", 0, "iterations per timed window; 0 = as many as last window_min_s.", _TIMED, minimum=0, maximum=COUNT_MAX,
           doc="iterations per timed window; `0`: as many as last `window_min_s` (a number reproduces a run's "
               "`<task>_steps_per_window`)", same_work="the length of a timed window: more samples of the same work"),
    Option("repeats", "int", 0, "timed windows; 0 = until the median is within precision_pct.", _TIMED, minimum=0, maximum=COUNT_MAX,
           doc="timed windows (median and spread over them); `0`: from 3 windows on, until the median's 95 % interval "
               "is within `precision_pct` (at most 60 windows and `max_time_s`; a launch-bound step, whose GPU waits on "
               "its kernel launches, stops at 6 and is flagged `launch-bound`; the reason is tagged "
               "`<task>_timing_stop`)", same_work="the number of timed windows: more samples of the same work"),
    Option("precision_pct", "float", 1.0, "repeats=0: the precision target: stop when the median's 95 % interval is within this % of it "
           "(the window spread, the windows' CV, is a check apart: over 5% is flagged).",
           _TIMED, minimum=0.01, doc="with `repeats=0`, the precision target: windows stop once the half-width of the median's 95 % "
           "interval (from six windows order statistics, distribution-free; from three to five Student's t, which one "
           "outlying window widens) is at most this % of the median; logged as "
           "`<task>_throughput_ci95_halfwidth_pct` (the window spread, their CV, is checked apart against 5 %)",
           same_work="how long the same work is timed: a bound on the median's uncertainty"),
    Option("window_min_s", "float", 1.0, "steps=0: each timed window lasts at least this many seconds (whole steps).",
           _TIMED, minimum=0.0, doc="with `steps=0`: each timed window lasts at least this long, in whole steps (1 s "
           "keeps the energy figure: the counter refreshes every 20-100 ms)",
           same_work="how long one window times the same work"),
    Option("max_time_s", "float", 60.0, "repeats=0: timed windows per task stop before this many seconds.", _TIMED,
           minimum=0.0, doc="with `repeats=0`: a task's timed windows end before this many seconds even "
           "when the target is not reached (tagged `<task>_timing_stop=max_time`, and said)",
           same_work="a bound on how long the same work is timed"),
    Option("steps", "int", 0, "optimizer updates in all (counted from step 0, also when resuming); 0 = use --epochs.",
           ("train",), minimum=0, maximum=COUNT_MAX,
           doc="optimizer updates in all (counted from 0, also on resume); `steps=0` uses `epochs`",
           same_work="how long training lasts; the figures are per step"),
    Option("epochs", "int", 1, "passes over the data when --steps is 0 (a synthetic epoch is 10,000 images).",
           ("train",), minimum=0, maximum=COUNT_MAX,
           doc="passes over the data when `steps=0` (a synthetic epoch is 10,000 images)",
           same_work="how long training lasts; the figures are per step"),
    Option("lr", "float", 5e-4, "peak learning rate (AdamW). DeiT: 5e-4 x batch/512.", ("train",), minimum=0.0,
           doc="peak learning rate (AdamW; DeiT: 5e-4 x batch/512): warm-up, then cosine to `min_lr` at the last "
               "step", same_work="an optimizer value: the same kernels on other numbers"),
    Option("weight_decay", "float", 0.05, "AdamW weight decay (not on biases, norms, position embeddings, tokens).",
           ("train",), minimum=0.0, same_work="an optimizer value: the same kernels on other numbers"),
    Option("warmup_steps", "int", 10, "linear LR warm-up steps (from 1e-6), then a cosine to --min-lr at the last step.",
           ("train",), minimum=0, doc="linear LR warm-up steps (from 1e-6), before the cosine",
           same_work="an LR-schedule value: the same kernels on other numbers"),
    Option("min_lr", "float", 1e-5, "LR at the end of the cosine.", ("train",), minimum=0.0,
           doc="LR at the end of the cosine (the last step)",
           same_work="an LR-schedule value: the same kernels on other numbers"),
    Option("clip_grad", "float", 0.0, "max global gradient norm; 0 = no clipping.", ("train",), minimum=0.0,
           identity=True),
    Option("label_smoothing", "float", 0.1, "label smoothing of the cross-entropy (DeiT: 0.1).", ("train",),
           minimum=0.0, below=1.0, same_work="a loss value: the same kernels on other numbers"),
    Option("data", "str", "synthetic", "synthetic (class-conditional tensors made on the device) or a folder with "
           "train/<class>/ and optionally val/<class>/ (torchvision ImageFolder).", ("train",),
           doc="`synthetic` (class-conditional tensors made on the device) or a folder with `train/<class>/` "
               "(and `val/<class>/`, for top-1 each epoch)", identity=True),
    Option("num_workers", "int", 4, "DataLoader processes for --data PATH.", ("train",), minimum=0,
           doc="DataLoader processes for `data=PATH`", identity=True),
    Option("num_classes", "int", 0, "classifier classes; 0 = the class folders of --data (1000 for synthetic).",
           ("train",), minimum=0, doc="classifier classes; `0` = the class folders of `data` (1000 for synthetic)",
           identity=True),
    Option("log_every", "int", 10, "steps between logged metrics (the only CPU-GPU sync of the loop).", ("train",),
           minimum=1, same_work="how often the loss is read back; the step's work is the same"),
    Option("checkpoint_every", "int", 1000,
           "steps between checkpoints (checkpoints/step-<N> and checkpoints/last); 0 = only at the end.",
           ("train",), minimum=0, same_work="how often a checkpoint is written; the step's work is the same"),
    Option("keep_checkpoints", "int", 1,
           "checkpoints a run keeps (the newest; older checkpoints/step-<N> are deleted as new ones are logged); "
           "0 = all.", ("train",), minimum=0,
           same_work="how many checkpoints stay on disk; the step's work is the same"),
    Option("resume", "str", "", "runs:/<run_id>/checkpoints/last or a checkpoint directory: continue at its step, "
           "same LR schedule.", ("train",), same_work="where training starts: the same steps from another point"),
    Option("distillation", "choice", "none", "DeiT's distillation loss, for deit_*_distilled_* models.",
           ("train",), choices=DISTILLATION_CHOICES, doc="DeiT's none/soft/hard", identity=True),
    Option("teacher", "str", "", "timm name (random weights: vitreg never downloads), models:/<name>@<alias>, "
           "runs:/... or a checkpoint directory.", ("train",), identity=True),
    Option("distill_alpha", "float", 0.5, "weight of the distillation loss.", ("train",), minimum=0.0, maximum=1.0,
           doc="weight of the distillation loss (0 to 1)",
           same_work="a loss weight: the same kernels on other numbers"),
    Option("distill_tau", "float", 1.0, "temperature of soft distillation.", ("train",), minimum=0.0,
            same_work="a loss temperature: the same kernels on other numbers"),
    Option("register_as", "str", "", "register the final checkpoint as this model name (empty: do not register).",
           ("train",), same_work="what happens to the checkpoint after the run"),
    Option("alias", "str", "latest", "alias of the registered version.", ("train",),
           doc="alias of the registered version; `latest` always means the newest version",
           same_work="what happens to the checkpoint after the run"),
    Option("device", "choice", "auto", "where to run (auto: CUDA when a GPU is visible).", _RUNS,
           choices=DEVICE_CHOICES,
           doc="`auto`, `cuda`, `cpu`", same_work="resolves to the hardware the run is filed under (its gpu label)"),
    Option("allow_gpu_mismatch", "bool", False,
           "true: file the run under --gpu even if the hardware differs (tagged gpu_mismatch=true).", _RUNS,
           doc="`true` files the run under `gpu` even when the hardware differs, tagged `gpu_mismatch=true`",
           same_work="how a run is filed: a mislabelled run is marked (gpu_mismatch) and kept apart by that mark"),
    Option("nproc", "int", 1, "processes (GPUs) on this host; >1 launches torchrun (DDP, one MLflow run, rank 0 logs); "
           "batch_size is per process. Refused if larger than the visible GPUs; any number with --device cpu (gloo).",
           _DDP, minimum=1,
           doc="processes per host, one per GPU. `>1` runs `torchrun --standalone` under the hood; `batch_size` is "
               "per process, so one step of the job is `nproc x batch_size` images. Refused if larger than the "
               "visible GPUs; with `device=cpu` any number of gloo processes runs. For `infer`, each process runs "
               "its own copy (no DDP) and the throughputs add up.", identity=True),
    Option("ddp_bucket_mb", "float", DDP_BUCKET_MB,
           "DDP gradient bucket size in MB (torch's bucket_cap_mb): gradient all-reduced per call, with nproc>1.",
           _DDP,
           doc="DDP gradient bucket size in MB (torch's `bucket_cap_mb`): how much gradient one all-reduce carries. "
               "Train with `nproc>1` only; tagged on the run", identity=True),
    Option("ddp_static_graph", "bool", False,
           "true: DDP static_graph (skips per-step graph bookkeeping; the graph must not change), with nproc>1.", _DDP,
           doc="`true` sets DDP's `static_graph` (no per-step graph bookkeeping; the model's graph must not change). "
               "`compare` keeps runs with different DDP settings apart (its `ddp` column) and scales each from the "
               "same `nproc=1` runs", identity=True),
    Option("ddp_comm_hook", "choice", "none",
           "none, or bf16/fp16: DDP all-reduces the gradients in that precision (torch's compress hook), with nproc>1.",
           _DDP, choices=DDP_COMM_HOOKS,
           doc="`bf16` / `fp16`: DDP all-reduces the gradients in that precision (torch's compress hooks: half the "
               "bytes, gradients rounded once per step). Tagged; `compare`'s `ddp` column shows it as `+bf16`",
           identity=True),
    Option("profile_steps", "int", 0, "train: after the timed windows, this many more steps under torch.profiler, "
           "logging train_allreduce_ms_per_step and (GPU) train_device_busy_ms_per_step; 0 = none.", ("bench",),
           minimum=0,
           doc="train: after the timed windows, this many more steps under `torch.profiler`; logs "
               "`train_allreduce_ms_per_step` (NCCL kernel time per step on GPU, gloo's all_reduce CPU time on CPU; "
               "the slowest rank's) and, on GPU, `train_device_busy_ms_per_step`. A long all-reduce next to a small "
               "gradient means the ranks wait for each other. Never inside the timed windows",
           same_work="steps under the profiler run after the timed windows, never inside them"),
    Option("cuda_graph", "bool", False, "true (CUDA, amp bf16/off): capture each step (train: forward, backward with "
           "DDP's all-reduce, AdamW) in one CUDA graph and time its replays.", ("bench", "infer"),
           doc="`true` (CUDA; `amp` bf16 or off; `compile` off or default): each task's step — for train the "
               "forward, loss, backward with DDP's all-reduce and AdamW — is captured in one CUDA graph after 11 "
               "eager steps and the timed iterations are replays, so Python's kernel launches and DDP's host-side "
               "work leave the step. `*_first_call_s` then holds the eager steps and the capture. `compare` shows "
               "these runs as `compile=<mode>+cudagraph` and scales them from graphed `nproc=1` runs. What it "
               "changes on real GPUs: docs/benchmarks.md, \"Whole-step CUDA graphs\"",
           identity=True),
    Option("profile", "bool", False, "true: after the timed windows, a torch.profiler Chrome trace of a few steps, "
           "a top-20 ops table and the step's anatomy per kernel class per task (artifacts under profile/).",
           ("bench", "infer"),
           doc="`true`: after the timed windows (never inside them), a few steady-state steps of each task under "
               "`torch.profiler`: a Chrome trace (`profile/<task>/trace.json.gz`, open it in Perfetto), the 20 "
               "ops with the most self time (`profile/<task>/top_ops.txt`) and the step's anatomy: the same steps' "
               "time per kernel class (matmul, attention, norm/pointwise, quantize/cast, memory copy, other, idle "
               "gaps with no kernel running) per image and as a share of the step, matmul's and attention's TFLOP/s "
               "against the precision's datasheet peak (`unknown` without one, e.g. on CPU, where the classes are "
               "host op time) in `profile/<task>/anatomy.txt` and `anatomy.png`, logged as "
               "`<task>_anatomy_<class>_ms_per_img`, `_pct` and `_tflops`; one console line names the two largest "
               "classes. Not with `cuda_graph=true`",
           same_work="the profiled steps run after the timed windows, never inside them"),
    Option("seed", "int", 0, "seed of the model init and the data.", ("bench", "infer", "train"), minimum=0,
           maximum=SEED_MAX,
           same_work="the values of the weights and synthetic data, not their shapes: the same kernels on "
                     "other numbers"),
    Option("nnodes", "int", 1, "hosts in a multi-host DDP job: the same command on each, with its --node-rank and one "
           "--rdzv-endpoint.", _DDP, minimum=1, spec_field=False,
           doc="hosts in a multi-host job: run the same command on every host with its own `node_rank` and the "
               "same `rdzv_endpoint`. Node 0 holds rank 0 and the MLflow run (start it there with `mlflow run` or "
               "`vitreg bench`); other hosts use `vitreg bench --node-rank k`, which opens no run.", identity=True),
    Option("node_rank", "int", 0, "this host's index, 0..nnodes-1; node 0 holds rank 0, which logs the MLflow run.",
           _DDP, minimum=0, spec_field=False, same_work="which host of the job this is; the job is the same"),
    Option("rdzv_endpoint", "str", "", "HOST:PORT on node 0 that every host can reach (nnodes>1).", _DDP,
           spec_field=False, doc="`HOST:PORT` on node 0 that every host can reach; required when `nnodes>1`",
           same_work="where the hosts meet; the job is the same"),
    Option("baseline_run", "str", "", "run id of a nproc=1 run of the same config: logs train_scaling_efficiency = "
           "img/s_N / (N x img/s_1).", ("bench",), spec_field=False,
           doc="run id of a finished `nproc=1` run of the same configuration: logs `train_scaling_efficiency` (and "
               "`infer_scaling_efficiency`) = throughput_N / (N x throughput_1)",
           same_work="names an earlier run to compute scaling against; measures nothing"),
    Option("offline", "bool", False, "true: log to the local spool only, nothing to the tracking server; "
           "`vitreg sync` delivers the run later (the same as VITREG_OFFLINE=1).", ("bench", "infer", "train"),
           spec_field=False,
           doc="`true` logs to the local spool only (no server needed; under `mlflow run`, MLflow itself still "
               "creates the run); `vitreg sync` delivers the run later. The same as `VITREG_OFFLINE=1`",
           same_work="where the run is logged, not what it measures"),
    Option("experiment", "str", None, "MLflow experiment (ignored under `mlflow run`, which picks its own).", _RUNS,
           spec_field=False, mlproject=False, envvar="MLFLOW_EXPERIMENT_NAME", aliases=("--experiment-name",),
           same_work="where the run is filed, not what it measures"),
    Option("run_name", "str", None, "MLflow run name (default: made of the model, GPU, amp, compile and batch size).",
           ("bench", "infer", "train"), spec_field=False, mlproject=False, maximum=1000,  # MLflow cut 10,000 at 8,000
           same_work="what the run is called, not what it measures"),
    # not an MLproject param: the README's tables stay the work's options; `mlflow run` takes VITREG_VERBOSE=1
    Option("verbose", "bool", False, "also print what only the run's console.log keeps (overhead by phase, energy "
           "source, params echo); the same as VITREG_VERBOSE=1.", ("bench", "infer", "train"), spec_field=False,
           mlproject=False, envvar="VITREG_VERBOSE", aliases=("-v",),
           same_work="what the console prints, not what the run measures"),
    Option("experiment", "str", None, "The experiment whose runs to compare.", ("compare", "check"), required=True,
           spec_field=False, aliases=("--experiment-name",), same_work=_COMPARES),
    Option("baseline", "str", "", "the --by value to compute speedups against (a GPU label such as a100; 2.8.0 "
           "with --by torch_version); empty: none.", ("compare",), spec_field=False, same_work=_COMPARES),
    Option("metric", "str", "throughput_img_per_s",
           "Metric (task prefix stripped) to compare, e.g. latency_ms_p50, step_ms_p50.", ("compare", "check"),
           spec_field=False, same_work=_COMPARES),
    Option("log_experiment", "str", None, "Experiment for the compare/check run itself (ignored under `mlflow run`).",
           ("compare", "check"), spec_field=False, mlproject=False, envvar="MLFLOW_EXPERIMENT_NAME",
           same_work=_COMPARES),
    Option("by", "str", "gpu", "the axis to compare along: gpu, or any tag or param the runs carry (torch_version, "
           "compile, amp, timm_version, vitreg_git_sha, ...); runs are paired when they differ only in it.",
           ("compare",), spec_field=False, same_work=_COMPARES),
    Option("include_mismatch", "bool", False, "true: give mislabelled runs (gpu_mismatch=true, or hardware that is not "
           "their GPU label) speedups and verdicts too; they are marked either way.", ("compare",), spec_field=False,
           same_work=_COMPARES),
    Option("prices", "str", "", "USD per GPU-hour by GPU label (h200=3.50,l4=0.80), or a CSV (gpu,usd_per_hour) or "
           "TOML price file: adds $ per 1M images beside img/s and images per joule, with verdicts; kept in the "
           "experiment (tag vitreg_prices) for the team. Empty: the experiment's.", ("compare",), spec_field=False,
           same_work=_COMPARES),
    Option("window", "int", 10, "history: the candidate's N previous runs (of its configuration and GPU).", ("check",),
           minimum=1, spec_field=False, same_work=_CHECKS),
    Option("candidate", "str", "", "run id to check (empty: the newest run of each configuration x GPU).", ("check",),
           spec_field=False, same_work=_CHECKS),
    Option("candidate_tag", "str", "", "KEY=VALUE: the runs with this tag are the candidate (e.g. pr=123).",
           ("check",), spec_field=False, same_work=_CHECKS),
    Option("baseline_tag", "str", "", "KEY=VALUE: the history is the newest --window runs with this tag "
           "(e.g. release=2.4) instead of the runs before the candidate.", ("check",), spec_field=False,
           same_work=_CHECKS),
)


#: The sections of ``--help`` (:class:`vitreg.cli.common.VitregCommand`), by option name (``command:name`` where
#: one name means two things: train's ``steps`` are what is trained, bench's how long a window is timed). An
#: option of no section is listed under "Options" (tests/test_cli_help.py: every option of a job has one).
HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What to run", ("model_uri", "models", "model", "axes", "task", "batch_size", "img_size", "amp", "sdpa", "compile",
                     "compile_backend", "cuda_graph", "data", "num_classes", "train:steps", "epochs", "resume", "seed")),
    ("Training recipe", ("lr", "weight_decay", "warmup_steps", "min_lr", "clip_grad", "label_smoothing",
                         "distillation", "teacher", "distill_alpha", "distill_tau")),
    ("How to run it", ("gpu", "device", "allow_gpu_mismatch", "warmup", "steps", "repeats", "precision_pct",
                       "window_min_s", "max_time_s", "nproc", "ddp_bucket_mb",
                       "ddp_static_graph", "ddp_comm_hook", "nnodes", "node_rank", "rdzv_endpoint", "num_workers",
                       "compile_cache", "profile", "profile_steps", "engine", "ray_address", "ray_runtime_env",
                       "slurm_partition", "slurm_account", "slurm_qos", "slurm_time_min", "slurm_sbatch",
                       "slurm_gpu_by", "slurm_folder", "share_node", "max_parallel", "isolate", "max_combinations", "rerun_failed")),
    ("Where to log", ("experiment", "run_name", "offline", "verbose", "baseline_run", "log_every", "checkpoint_every",
                      "keep_checkpoints", "register_as", "alias")),
)


def help_group(command: str, name: str) -> str | None:
    """The ``--help`` section of ``command``'s option called ``name`` (None: none)."""
    for key in (f"{command}:{name}", name):
        found = next((title for title, names in HELP_GROUPS if key in names), None)
        if found:
            return found
    return None
