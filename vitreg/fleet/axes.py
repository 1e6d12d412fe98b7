"""A sweep's axes and their combinations, each checked against the option table before any child starts.

Axes come from the sweep's list params (``models``, ``amp``, ``compile``, ``batch_size``), a comma list in
``gpu``, ``axes="NAME=V1,V2;NAME=V1,V2"`` and ``--axis NAME=V1,V2``. An axis may be any option that is a field
of BenchSpec; the options that say where a run is filed or how the sweep runs cannot vary within one.
"""

from __future__ import annotations

import difflib
import itertools
import math
from dataclasses import dataclass

from vitreg.config.options import identity_names, option, options_of, spec_options
from vitreg.errors import VitregError

#: the sweep's list params and the bench option each one is an axis of
LIST_AXES = {"models": "model", "amp": "amp", "compile": "compile", "batch_size": "batch_size"}
_MODELS = "deit_tiny_patch16_224,vit_small_patch16_224"
_EXAMPLES = {"models": _MODELS, "model": _MODELS, "amp": "off,bf16", "compile": "off,default",
             "batch_size": "32,256", "gpu": "h100,a100"}
GPU_ALL = "all"  # gpu=all: every accelerator type of the Ray cluster (vitreg.fleet.ray_engine)
# how the sweep runs
SWEEP_OWN = ("axes", "engine", "ray_address", "max_parallel", "isolate", "max_combinations", "rerun_failed")


@dataclass(frozen=True)
class Combination:
    """One child of a sweep: its bench options that come from the axes, and its run name."""

    options: tuple[tuple[str, object], ...]
    label: str

    def get(self, name: str, default=None):
        return dict(self.options).get(name, default)

    @property
    def model(self) -> str:
        return self.get("model")

    @property
    def batch_size(self):
        return self.get("batch_size")

    def with_batch(self, batch_size) -> "Combination":
        """The same child at another batch (after an out-of-memory failure)."""
        return Combination(tuple((k, batch_size if k == "batch_size" else v) for k, v in self.options), self.label)


def split_values(value: str, name: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``; an empty list is one line naming the fix."""
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    if not items:
        example = _EXAMPLES.get(name, "V1,V2")
        raise VitregError(f"{name} is empty: pass a comma-separated list, e.g. {name}={example}")
    twice = [v for i, v in enumerate(items) if v in items[:i]]
    if twice:  # `test_vit,,test_vit` ran one child under a name counting two
        raise VitregError(f"{name} lists {twice[0]!r} twice: give each value once")
    return items


def parse_axis(text: str) -> tuple[str, list[str]]:
    """``"sdpa=auto,cudnn"`` -> ``("sdpa", ["auto", "cudnn"])``."""
    name, sep, values = str(text).partition("=")
    name = name.strip()
    if not sep or not name:
        raise VitregError(f"axis {text!r} is not NAME=V1,V2: pass e.g. --axis sdpa=auto,cudnn")
    check_axis_name(name)
    return name, split_values(values, name)


def check_axis_name(name: str) -> None:
    """An axis must be a bench option that can vary between the children of one sweep."""
    fields = [o.name for o in spec_options("bench")]
    if name in fields:
        return
    others = {o.name: o for o in options_of("bench") + options_of("sweep")}
    if name in LIST_AXES or name in SWEEP_OWN:
        raise VitregError(f"{name} is an option of the sweep itself and cannot be an axis: pass it once "
                          f"(--{name.replace('_', '-')} ...); for several models use --axis model=A,B")
    if name in others or name in ("tracking_uri", "experiment_id"):
        why = others[name].same_work if name in others else "where the runs are filed"
        raise VitregError(f"{name} cannot vary within one sweep ({why}): pass it once, or run one sweep per value")
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise VitregError(f"unknown axis {name!r}: {hint}an axis is a bench option ({', '.join(fields)})")


def collect_axes(lists: dict, axis_texts: list[str], common: dict) -> dict[str, list[str]]:
    """Every axis by bench option name, in the order given: the list params first, then ``gpu``, then the axes.
    ``common`` loses the options that became axes (``gpu`` when it holds a list)."""
    axes = {LIST_AXES[name]: split_values(value, name) for name, value in lists.items()}
    defaults = {LIST_AXES[name]: option("sweep", name).default_text for name in lists}
    gpu = str(common.get("gpu") or "auto")
    if "," in gpu or gpu.strip().lower() == GPU_ALL:
        axes["gpu"] = [g.lower() for g in split_values(gpu, "gpu")]
        common.pop("gpu")
    for text in axis_texts:
        name, values = parse_axis(text)
        if name in axes and not (name in defaults and axes[name] == split_values(defaults[name], name)):
            raise VitregError(f"{name} is given twice (as a list and as an axis): pass it once")
        if name in common and name != "gpu" and str(common[name]) != option("bench", name).default_text:
            raise VitregError(f"{name} is given twice (--{name.replace('_', '-')} and an axis): pass it once")
        common.pop(name, None)
        axes[name] = values
    return axes


def axis_texts_of(axes_param) -> list[str]:
    """``axes="a=1,2;b=x,y"`` (the MLproject param) or the repeated ``--axis`` flags (a tuple of such texts)
    as one list of ``NAME=V1,V2``."""
    texts = [axes_param] if isinstance(axes_param, str) else list(axes_param or ())
    return [t.strip() for text in texts for t in str(text).split(";") if t.strip()]


def count(axes: dict[str, list[str]]) -> int:
    return math.prod(len(v) for v in axes.values())


def check_size(n: int, cap: int) -> None:
    if n > cap:
        raise VitregError(f"the sweep has {n} combinations, more than max_combinations={cap}: narrow its axes, or "
                          f"pass max_combinations={n} to run them all")


def plan(axes: dict[str, list[str]], common: dict) -> list[Combination]:
    """Every combination, each value parsed by its option and each combination built as a BenchSpec,
    before anything runs (a bad value is one line: the spec's own message)."""
    from vitreg.config.spec import BenchSpec
    from vitreg.models.factory import check_model_name

    parsed = {name: list(dict.fromkeys(option("bench", name).parse(v) for v in values))
              for name, values in axes.items()}
    names = list(parsed)
    rows = [dict(zip(names, values)) for values in itertools.product(*parsed.values())]
    for row in rows:
        BenchSpec.from_options({**common, **row})
    for model in dict.fromkeys(row.get("model") for row in rows):
        if model:
            check_model_name(model)
    labels = _labels(rows, [n for n in names if len(parsed[n]) > 1], common)
    return [Combination(tuple(row.items()), label) for row, label in zip(rows, labels)]


def _labels(rows: list[dict], varying: list[str], common: dict) -> list[str]:
    """Run names from the identity options that vary (and the GPU type); the model always leads. Where two
    children would share a name (an axis over a same-work option such as ``seed``), every varying axis is named."""
    shown = [n for n in varying if n in identity_names("bench") or n == "gpu"]
    labels = [_label(row, shown, common) for row in rows]
    if len(set(labels)) < len(labels):
        labels = [_label(row, varying, common) for row in rows]
    return labels


def _label(row: dict, names: list[str], common: dict) -> str:
    parts = [str(row.get("model") or common.get("model") or "")]
    for name in names:
        if name == "model":
            continue
        value = row[name]
        parts.append(str(value) if name == "gpu" else f"bs{value}" if name == "batch_size" else f"{name}={value}")
    return "-".join(p for p in parts if p)
