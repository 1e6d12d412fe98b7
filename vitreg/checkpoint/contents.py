"""What a checkpoint holds, checked as strictly as user input before anything is built from it.

A manifest proves only that the files are the ones it lists, not that a hand-edited ``spec.json`` or weights
saved for another model are right: :func:`validate_spec` parses every key the loaders read with the option
table's parsers, :func:`check_weights` compares the safetensors header's names and shapes with the model's.
"""

from __future__ import annotations

from pathlib import Path

from vitreg.config.options import spec_options
from vitreg.config.parse import parse_bool, parse_int
from vitreg.errors import CheckpointError, VitregError

FIX = "re-save it, or point at another checkpoint (e.g. an earlier checkpoints/step-<N>)"


def _scalar(value, name: str):
    # JSON true/false must not pass for numbers (int(True) is 1), nor a list for anything
    if isinstance(value, (list, dict)) or value is None or (isinstance(value, bool) and name != "distilled"):
        raise CheckpointError(f"{name}={value!r} is a {type(value).__name__}, not a single value")
    return value


def _model_name(value, name: str) -> str:
    from vitreg.models.factory import check_model_name

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
