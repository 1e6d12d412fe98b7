"""Training checkpoints: a directory of safetensors weights, a torch training state, the spec, a sha256 manifest.

    model.safetensors   the unwrapped module's state_dict (contiguous CPU tensors); no pickle
    train_state.pt      optimizer, LR scheduler, GradScaler, step, epoch, RNG states (torch.save)
    spec.json           {"model", "img_size", "num_classes", "distilled", "step", "epoch", "train_spec", ...}
    manifest.json       {"format": "vitreg-checkpoint-1", "files": {name: {"sha256", "bytes"}}}

Loading reads only JSON and safetensors (resuming also ``train_state.pt``, ``weights_only=True``), so a checkpoint
from anywhere runs no code. :func:`verify_checkpoint` checks every file against the manifest once, and, since a
manifest proves only that the files are the ones it lists, what they hold, as strictly as user input
(:func:`validate_spec`, :func:`check_weights`): a truncated or edited file is one line naming it. A checkpoint is
written under a temporary name and renamed into place. A run names its newest ``checkpoints/step-<N>/`` in a small
``checkpoints/last`` file (:func:`last_pointer`), written after that folder is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from vitreg.config.options import spec_options
from vitreg.config.parse import parse_bool, parse_int
from vitreg.errors import CheckpointError, VitregError, unreadable
from vitreg.files import inside, parse_json, read_json, read_text
from vitreg.models.factory import ModelInfo, check_model_name, create_model
from vitreg.version import __version__

FORMAT = "vitreg-checkpoint-1"
WEIGHTS = "model.safetensors"
STATE = "train_state.pt"
SPEC = "spec.json"
MANIFEST = "manifest.json"
LAST = "last"  # the file naming a run's newest checkpoint folder
LAST_FORMAT = "vitreg-last-1"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
LAST_FIX = "point at a checkpoints/step-<N> folder instead"
LAST_BYTES = 4096  # a last file is one short JSON object (:func:`last_pointer`)
_RESERVED = ("model", "img_size", "num_classes", "distilled", "step", "epoch", "train_spec", "vitreg_version",
             "source", "patch_size", "params_m", "format", "torch_version", "timm_version", "created_unix")
FIX = "re-save it, or point at another checkpoint (e.g. an earlier checkpoints/step-<N>)"


def _scalar(value, name: str):
    # JSON true/false must not pass for numbers (int(True) is 1), nor a list for anything
    if isinstance(value, (list, dict)) or value is None or (isinstance(value, bool) and name != "distilled"):
        raise CheckpointError(f"{name}={value!r} is a {type(value).__name__}, not a single value")
    return value


def _model_name(value, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise CheckpointError(f"{name}={value!r} is not a model name (a non-empty string)")
    check_model_name(value.strip())
    return value.strip()


def _int(least: int):
    return lambda v, name: parse_int(_scalar(v, name), name, least, error=CheckpointError)


#: spec.json keys the loaders read: name -> parser of the raw JSON value
_REQUIRED = {"model": _model_name, "img_size": _int(1), "num_classes": _int(1), "step": _int(0)}
_OPTIONAL = {"epoch": _int(0), "distilled": lambda v, name: parse_bool(_scalar(v, name), name, error=CheckpointError)}


def validate_spec(spec_json, path: Path) -> dict:
    """``spec.json`` with the keys the loaders read parsed to their types; unknown ``train_spec`` keys kept (a
    checkpoint of a vitreg with one more option still loads)."""
    if not isinstance(spec_json, dict):
        raise CheckpointError(f"{path} holds a JSON {type(spec_json).__name__}, not an object with model, img_size, "
                              f"num_classes and step: {FIX}")
    missing = [key for key in _REQUIRED if key not in spec_json]
    if missing:
        raise CheckpointError(f"{path} has no {', '.join(missing)}: {FIX}")
    typed = dict(spec_json)
    try:
        for key, parse in {**_REQUIRED, **_OPTIONAL}.items():
            if key in spec_json:
                typed[key] = parse(spec_json[key], key)
        typed["train_spec"] = _train_spec(spec_json.get("train_spec", {}))
        _check_classes(typed)
    except VitregError as exc:
        raise CheckpointError(f"{path}: {exc}; {FIX}") from None
    return typed


def _train_spec(train_spec) -> dict:
    if not isinstance(train_spec, dict):
        raise CheckpointError(f"train_spec is a JSON {type(train_spec).__name__}, not an object of options")
    options = {o.name: o for o in spec_options("train")}
    for key, value in train_spec.items():
        if key in options:
            if isinstance(value, (list, dict)):
                raise CheckpointError(f"train_spec.{key}={value!r} is a {type(value).__name__}, not a single value")
            options[key].parse(value)
    return train_spec


def _check_classes(spec_json: dict) -> None:
    classes = spec_json.get("classes")
    if classes is None:
        return
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise CheckpointError("classes is not a list of class names")
    if len(classes) != spec_json["num_classes"]:
        raise CheckpointError(f"classes lists {len(classes)} names but num_classes={spec_json['num_classes']}")


def check_weights(module, path: Path) -> None:
    """Refuse a weights file that is not safetensors or whose tensor names/shapes differ from ``module``'s."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as weights:
            shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    except Exception as exc:  # safetensors raises its own error types, and OSError/ValueError on odd headers
        detail = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise CheckpointError(f"{path} is not a safetensors file ({detail}): {FIX}") from None
    wanted = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    what = f"{path} does not fit {type(module).__name__}"
    missing = sorted(set(wanted) - set(shapes))
    unexpected = sorted(set(shapes) - set(wanted))
    if missing or unexpected:
        parts = ([f"{len(missing)} missing (e.g. {missing[0]})"] if missing else []) + \
                ([f"{len(unexpected)} unexpected (e.g. {unexpected[0]})"] if unexpected else [])
        raise CheckpointError(f"{what}: weights {', '.join(parts)}; it was saved for another model or timm version")
    wrong = [name for name in wanted if shapes[name] != wanted[name]]
    if wrong:
        name = wrong[0]
        raise CheckpointError(f"{what}: {len(wrong)} tensor(s) of another shape (e.g. {name}: {list(shapes[name])} in "
                              f"the file, {list(wanted[name])} in the model); its spec.json does not match its "
                              f"weights: {FIX}")



def unwrap_model(model):
    for _ in range(8):
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module"):
            model = model.module
        else:
            break
    return model


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _rng_state() -> dict:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        # numpy's state holds an ndarray, which weights_only loading refuses: store it as a tensor
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
    if state.get("cuda") and torch.cuda.is_available():
        saved = state["cuda"]
        for index in range(min(len(saved), torch.cuda.device_count())):  # another box may have fewer GPUs
            torch.cuda.set_rng_state(saved[index], index)


def _weights_of(model) -> dict:
    # copy=True: separate CPU tensors even for a CPU model, so no two entries share storage (safetensors
    # refuses shared storage) and training can go on while the file is written.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in unwrap_model(model).state_dict().items()}


@dataclass(frozen=True)
class TrainingState:
    optimizer: object = None
    scheduler: object = None
    scaler: object = None  # torch.amp.GradScaler


def save_checkpoint(directory, model, *, step: int, spec: dict, model_info: ModelInfo, epoch: int = 0,
                    state: TrainingState = TrainingState(), extra: dict | None = None) -> Path:
    """Write (or replace) a checkpoint directory. ``extra``: more top-level keys of ``spec.json``, none of its own."""
    import safetensors.torch
    import torch

    directory = Path(directory)
    clash = sorted(set(extra or {}) & set(_RESERVED))
    if clash:
        raise ValueError(f"extra may not override checkpoint keys {clash}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.with_name(f".{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        safetensors.torch.save_file(_weights_of(model), str(partial / WEIGHTS),
                                    metadata={"format": "pt", "model": model_info.name, "step": str(step)})
        objects = {k: getattr(state, k) for k in ("optimizer", "scheduler", "scaler")}
        saved = {k: o.state_dict() if o is not None else None for k, o in objects.items()}
        torch.save({"step": int(step), "epoch": int(epoch), **saved, "rng": _rng_state()}, partial / STATE)
        import timm

        info = {k: getattr(model_info, k) for k in ("source", "img_size", "patch_size", "num_classes", "params_m",
                                                    "distilled")}
        spec_json = {"format": FORMAT, "model": model_info.name, **info, "step": int(step), "epoch": int(epoch),
                     "train_spec": dict(spec), "vitreg_version": __version__, "torch_version": torch.__version__,
                     "timm_version": timm.__version__, "created_unix": time.time(), **(extra or {})}
        (partial / SPEC).write_text(json.dumps(spec_json, indent=2, sort_keys=True, default=str))
        files = {name: {"sha256": _sha256(partial / name), "bytes": (partial / name).stat().st_size}
                 for name in (WEIGHTS, STATE, SPEC)}
        # the manifest goes last: its presence means every file it lists was complete when it was written
        (partial / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}, indent=2, sort_keys=True))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return directory


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint directory whose files matched their manifest, and its validated ``spec.json``: verify once,
    then hand this on (the loaders verify a plain directory themselves)."""

    directory: Path
    manifest: dict
    spec: dict  # spec.json, validated

    @property
    def step(self) -> int:
        return int(self.spec["step"])


def verify_checkpoint(directory) -> VerifiedCheckpoint:
    """Every file checked against the manifest, ``spec.json`` validated; one-line VitregError otherwise."""
    directory = Path(directory)
    fix = "point resume/pull at another checkpoint (e.g. an earlier checkpoints/step-<N>)"
    try:
        return _verified(directory, fix)
    except OSError as exc:  # permissions, an I/O error: the file named, with the fix
        cause = unreadable(exc.filename or directory, exc)
        raise VitregError(f"checkpoint {directory}: {cause}, or {fix}") from None


def _verified(directory: Path, fix: str) -> VerifiedCheckpoint:
    manifest = _read_manifest(directory, fix)
    for name, entry in manifest["files"].items():
        path = confined(directory, name)
        if not path.is_file():
            raise VitregError(f"checkpoint {directory}: {name} is missing: {fix}")
        size = path.stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "larger than recorded"
            raise VitregError(f"checkpoint {directory}: {name} is {what} ({size} of {entry['bytes']} bytes): {fix}")
    for name, entry in manifest["files"].items():  # sizes first: a truncated upload fails without hashing gigabytes
        if _sha256(confined(directory, name)) != entry["sha256"]:
            raise VitregError(f"checkpoint {directory}: {name} sha256 mismatch (modified or corrupted since it was "
                              f"saved): {fix}")
    spec_json = read_json(directory / SPEC, fix, CheckpointError, where=f"checkpoint {directory}: {SPEC}")
    return VerifiedCheckpoint(directory, manifest, validate_spec(spec_json, directory / SPEC))


def _read_manifest(directory: Path, fix: str) -> dict:
    if not directory.is_dir():
        raise VitregError(f"checkpoint {directory} does not exist or is not a directory: pass a checkpoint "
                          f"directory (with {MANIFEST}) or runs:/<run_id>/checkpoints/last")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise VitregError(f"checkpoint {directory} has no {MANIFEST} (incomplete or not a vitreg checkpoint): {fix}")
    manifest = read_json(manifest_path, fix, where=f"checkpoint {directory}: {MANIFEST}")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()):
        raise VitregError(f"checkpoint {directory}: {MANIFEST} is not valid JSON with a 'files' map of "
                          f"{{sha256, bytes}}: {fix}")
    if manifest.get("format") != FORMAT:
        raise VitregError(f"checkpoint {directory} has format {manifest.get('format')!r}, not {FORMAT!r}: "
                          f"it was written by another tool or vitreg version; {fix}")
    for required in (WEIGHTS, SPEC):
        if required not in files:
            raise VitregError(f"checkpoint {directory}: {MANIFEST} does not list {required}: {fix}")
    for name in files:
        confined(directory, name)
    return manifest


def confined(directory: Path, name: str) -> Path:
    """``directory / name`` for a manifest entry, refused unless a plain file name in ``directory`` (no ``..``, no
    sub-folder, no link out): a tampered manifest must not make vitreg read, hash or copy a file elsewhere."""
    plain = isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
    path = directory / name if plain else None
    if path is None or inside(directory, path) is None:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} lists {name!r}, which is not a file of the "
                              f"checkpoint folder (vitreg checkpoints are flat folders of plain names): {FIX}")
    return path


def step_folder(step: int) -> str:
    return f"step-{int(step)}"


def last_pointer(step: int) -> str:
    return json.dumps({"format": LAST_FORMAT, "checkpoint": step_folder(step), "step": int(step)}, indent=2)


def read_last_pointer(text: str, where: str) -> str:
    """The ``step-<N>`` folder a ``last`` file names; a tampered file must not lead outside ``checkpoints/``."""
    try:
        pointer = parse_json(text)
        name = pointer["checkpoint"] if isinstance(pointer, dict) and pointer.get("format") == LAST_FORMAT else None
    except (ValueError, KeyError, TypeError):
        name = None
    if not isinstance(name, str) or not _STEP_FOLDER.match(name):
        raise CheckpointError(f"{where} is not a vitreg '{LAST}' file ({{\"format\": \"{LAST_FORMAT}\", "
                              f"\"checkpoint\": \"step-<N>\"}}): {LAST_FIX}")
    return name


def follow_last(path) -> Path:
    """``path`` itself, or, when it is a ``last`` file, the ``step-<N>`` folder beside it that it names."""
    path = Path(path)
    if path.is_dir():
        return path
    text = read_text(path, LAST_FIX, CheckpointError, limit=LAST_BYTES)
    named = path.parent / read_last_pointer(text, str(path))
    if named.exists() and inside(path.parent, named) is None:
        raise CheckpointError(f"{path} names {named.name}, which is a link to {named.resolve()}, outside "
                              f"{path.parent}: a run's checkpoints stay in its folder; {LAST_FIX}")
    return named


def ensure_verified(checkpoint) -> VerifiedCheckpoint:
    return checkpoint if isinstance(checkpoint, VerifiedCheckpoint) else verify_checkpoint(checkpoint)


def _load_weights(model, directory: Path) -> None:
    import safetensors.torch

    module = unwrap_model(model)
    check_weights(module, directory / WEIGHTS)
    module.load_state_dict(safetensors.torch.load_file(str(directory / WEIGHTS)))


def load_model(checkpoint, device="cpu"):
    """``(model, ModelInfo, spec_json)`` rebuilt from a checkpoint, in eval mode on ``device``; no pickle, no hub."""
    checkpoint = ensure_verified(checkpoint)
    spec_json = checkpoint.spec
    try:
        model, info = create_model(spec_json["model"], spec_json["img_size"], spec_json["num_classes"])
    except VitregError as exc:  # a model name or size that cannot be built: the file is the culprit
        raise CheckpointError(f"{checkpoint.directory / SPEC}: {exc}; {FIX}") from None
    _load_weights(model, checkpoint.directory)
    model = model.to(device).eval()
    return model, info, spec_json


def check_compatible(checkpoint, info: ModelInfo) -> dict:
    """Refuse to resume ``checkpoint`` into a model other than ``info`` describes; returns spec.json."""
    checkpoint = ensure_verified(checkpoint)
    for key, want in (("model", info.name), ("img_size", info.img_size), ("num_classes", info.num_classes)):
        have = checkpoint.spec.get(key)
        if str(have) != str(want):
            raise VitregError(f"checkpoint {checkpoint.directory / SPEC} is for {key}={have}, this run has {key}={want}: "
                              f"pass {key}={have} to resume it, or another checkpoint")
    return checkpoint.spec


def load_training_state(checkpoint, model, optimizer=None, scheduler=None, scaler=None) -> tuple[int, int]:
    """Restore weights, optimizer, scheduler, scaler and RNG states; returns ``(step, epoch)``. The optimizer keeps
    its own implementation flags (``fused``...), so a checkpoint from a GPU resumes on a CPU."""
    checkpoint = ensure_verified(checkpoint)
    directory = checkpoint.directory
    if STATE not in checkpoint.manifest["files"]:
        raise VitregError(f"checkpoint {directory} has no {STATE} (weights only): it can be pulled but not resumed; "
                          f"start a new run from it instead")
    _load_weights(model, directory)
    state = _read_state(directory / STATE)
    if optimizer is not None and state.get("optimizer") is not None:
        _load_optimizer(optimizer, state["optimizer"], directory / STATE)
    try:  # the rest are plain containers a hand-made file can get wrong in any way: one line for all
        if scheduler is not None and state.get("scheduler") is not None:
            _check_like(state["scheduler"], scheduler.state_dict(), "scheduler")
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(state["scaler"])
        if state.get("rng"):
            _set_rng_state(state["rng"])
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"{directory / STATE}: the scheduler, scaler or RNG state cannot be restored "
                              f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]}); {FIX}") from None
    return state["step"], state["epoch"]


def _check_like(saved, fresh: dict, what: str) -> None:
    """``saved`` has no key of ``fresh`` with a value of another type (a schedule's length as a string would
    only fail steps later, inside the LR computation)."""
    if not isinstance(saved, dict):
        raise TypeError(f"{what} state is a {type(saved).__name__}, not a dict")
    number = (int, float)
    for key, value in fresh.items():
        if key in saved and value is not None and saved[key] is not None:
            same = isinstance(saved[key], number) if isinstance(value, number) else isinstance(saved[key], type(value))
            if not same or isinstance(saved[key], bool) != isinstance(value, bool):
                raise TypeError(f"{what} {key}={saved[key]!r} is not a {type(value).__name__}")


def _read_state(path: Path) -> dict:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be loaded with weights_only=True ({type(exc).__name__}); it was not "
                              f"written by vitreg") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or state["step"] < 0:
        raise CheckpointError(f"{path} holds no training state with a step (a dict with step, optimizer, scheduler, "
                              f"...); {FIX}")
    epoch = state.get("epoch", 0)
    return {**state, "epoch": epoch if isinstance(epoch, int) else 0}


def _load_optimizer(optimizer, saved, path: Path) -> None:
    impl = [{k: g[k] for k in ("fused", "foreach", "capturable", "differentiable") if k in g}
            for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: optimizer state does not fit this model "
                              f"({' '.join(str(exc).split())[:160]})") from None
    for group, flags in zip(optimizer.param_groups, impl):
        group.update(flags)
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if getattr(value, "ndim", 0) and tuple(value.shape) != tuple(param.shape):
                    raise CheckpointError(f"{path}: optimizer state {name} has shape {list(value.shape)} for a "
                                          f"parameter of shape {list(param.shape)}: it was saved for another model")
