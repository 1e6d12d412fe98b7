"""The house rules a newcomer relies on, checked on every test run: modules of one concern, layers that point
one way, and MLflow behind one door.

- no module in vitreg/ over 700 lines, no function over 80, none taking more than 8 parameters;
- no module under 100 lines with a single importer, unless its docstring says it is a table or a boundary
  (a line ``Kept apart: a table ...`` / ``Kept apart: a boundary ...``): what only one module uses lives in it;
- no circle in the import graph of vitreg, and no import from a higher layer of :data:`LAYERS` (imports
  inside functions counted);
- only vitreg/tracking/ imports mlflow (runners and loops return typed results, the tracking layer logs them);
- no MLFLOW_* environment handling outside vitreg/tracking/ (deploy/ sets the server's own variables);
- no module-level name that nothing uses; every tracker implements the Tracker protocol's calls itself;
- the spec classes declare exactly their command's options.
"""

import ast
import importlib.util
import inspect
import re
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest

from conftest import REPO, parsed

PACKAGE = REPO / "vitreg"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
MIN_LONE_MODULE_LINES = 100  # a module under this with a single importer belongs in its importer
KEPT_APART = re.compile(r"^Kept apart: a (table|boundary)\b", re.MULTILINE)


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def test_modules_and_functions_stay_small():
    too_long = []
    for path in _modules():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{_rel(path)}: {source.count(chr(10))} lines")
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{_rel(path)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "split these by what they do:\n" + "\n".join(too_long)


def _lone_fragments(graph: dict[str, set[str]], names: dict[str, Path]) -> list[str]:
    """Modules under :data:`MIN_LONE_MODULE_LINES` lines that exactly one other vitreg module imports and
    whose docstring does not say ``Kept apart: a table`` / ``Kept apart: a boundary``."""
    importers = {module: [m for m, targets in graph.items() if module in targets] for module in graph}
    found = []
    for module, path in names.items():
        if path.name == "__init__.py" or len(importers[module]) != 1:
            continue
        source = path.read_text()
        if source.count("\n") < MIN_LONE_MODULE_LINES and not KEPT_APART.search(ast.get_docstring(ast.parse(source)) or ""):
            found.append(f"{_rel(path)}: {source.count(chr(10))} lines, imported only by {importers[module][0]}")
    return found


def test_no_small_module_has_a_single_importer():
    """What only one module uses lives in that module: a fragment of a few dozen lines beside its one user is
    a file to open for nothing. A table (data others edit) or a boundary (a module a process must import
    alone, or a door kept narrow on purpose) may stay small and apart: its docstring says which."""
    names = _module_names()
    graph = {module: _imports_of(module, path, names) for module, path in names.items()}
    lone = _lone_fragments(graph, names)
    assert not lone, "fold these into their one importer (or say why they stand apart):\n" + "\n".join(lone)


def test_the_lone_fragment_check_finds_one(tmp_path):
    for name, text in (("user.py", "import lone\n" + "x = 1\n" * 120), ("lone.py", '"""A fragment."""\n'),
                       ("table.py", '"""Names.\n\nKept apart: a table that users edit.\n"""\n')):
        (tmp_path / name).write_text(text)
    names = {"user": tmp_path / "user.py", "lone": tmp_path / "lone.py", "table": tmp_path / "table.py"}
    graph = {"user": {"lone", "table"}, "lone": set(), "table": set()}
    assert [line.split(":")[0] for line in _lone_fragments(graph, names)] == [str(tmp_path / "lone.py")]


def _imports_mlflow(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mlflow" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlflow":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "vitreg.tracking.mlflow_on_first_use":
            return True
    return False


def test_only_the_tracking_layer_imports_mlflow():
    outside = [_rel(p) for p in _modules()
               if "tracking" != p.relative_to(PACKAGE).parts[0] and _imports_mlflow(parsed(p))]
    assert not outside, f"mlflow imported outside vitreg/tracking/: {outside}"


_MLFLOW_ENV = re.compile(r"""environ(\.get\(|\.pop\(|\.setdefault\(|\[)\s*["']MLFLOW_|["']MLFLOW_(RUN_ID|EXPERIMENT_ID|TRACKING_URI)["']\s*:""")


def test_mlflow_environment_is_handled_by_tracking_only():
    outside = []
    for path in _modules():
        top = path.relative_to(PACKAGE).parts[0]
        if top in ("tracking", "deploy"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _MLFLOW_ENV.search(line):
                outside.append(f"{_rel(path)}:{number}: {line.strip()}")
    assert not outside, "MLFLOW_* environment read or set outside vitreg/tracking/:\n" + "\n".join(outside)


# --------------------------------------------------------------------------- parameters

MAX_PARAMETERS = 8


def _parameter_count(node) -> int:
    args = node.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def test_no_function_takes_more_than_eight_parameters():
    """Long signatures hide a missing value object (a spec, a context); self/cls not counted, *args/**kwargs are."""
    long = []
    for path in _modules():
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameter_count(node) > MAX_PARAMETERS:
                long.append(f"{_rel(path)}:{node.lineno} {node.name}: {_parameter_count(node)} parameters")
    assert not long, "group these parameters into the values they belong to:\n" + "\n".join(long)


# --------------------------------------------------------------------------- the import graph


def _module_names() -> dict[str, Path]:
    names = {}
    for path in _modules():
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _imports_of(module: str, path: Path, names: dict) -> set[str]:
    """The vitreg modules ``module`` imports, at module level or inside functions: ``from a.b import c`` is
    ``a.b.c`` when that is a module, else ``a.b``."""
    found = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in names:
                    found.add(f"{base}.{alias.name}")
                elif base in names:
                    found.add(base)
    found.discard(module)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_check_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_vitreg():
    """vitreg's modules import in one direction, imports deferred inside functions included: a deferred
    ``vitreg.*`` import still ties the two modules together, only its cost moves. (Only heavy third-party
    imports, torch, timm, mlflow, are deferred for speed.)"""
    names = _module_names()
    graph = {module: _imports_of(module, path, names) for module, path in names.items()}
    assert "vitreg.checkpoint.format" in graph["vitreg.tracking.checkpoint_sources"]  # the graph sees imports
    circles = _circles(graph)
    shown = "\n".join(" <-> ".join(circle) for circle in circles)
    assert not circles, "import circles (move what both need below both):\n" + shown


# --------------------------------------------------------------------------- the layers

#: vitreg's layers, lowest first, each a group of packages and top-level modules of vitreg (``__init__`` is the
#: package root). A module imports from its own layer and the layers below it, never from one above: a value
#: flows up from errors and the environment through the tables (GPUs, models, metrics, options) to the
#: format, analysis and tracking, then to the jobs, the command line, the Python API and the root.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "files", "version", "environment", "console"),  # what all may use: errors, small files, the process, printing
    ("models",),  # model families, building a model, its FLOPs and memory floors
    ("hardware",),  # GPU profiles, runtime, precision, SDPA (which reads a model family's layout)
    ("measure",),  # timing, CUDA graphs, traces, batch search, the metric table
    ("config",),  # the option table and the specs, parsed with what the layers below allow
    ("signals", "checkpoint", "analysis"),  # signals and exit; the checkpoint format; pure statistics
    ("history", "tracking"),  # benchmark histories (pure); the only MLflow door
    ("ddp", "fleet", "deploy", "compare"),  # the DDP world and launcher, sweep engines, the server, compare/check
    ("train",),
    ("bench",),  # the bench job, which also runs a train step and sweeps
    ("cli",),
    ("api",),
    ("__init__", "__main__"),
)


def _layer_unit(module: str) -> str:
    """``vitreg.tracking.runs`` -> ``tracking``; ``vitreg.api`` -> ``api``; ``vitreg`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _back_arrows(graph: dict[str, set[str]], names: dict[str, Path], layers=LAYERS) -> list[str]:
    """Each import from a higher layer: the importing file, the imported one and both layers."""
    level = {unit: number for number, layer in enumerate(layers, 1) for unit in layer}
    arrows = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            low, high = _layer_unit(module), _layer_unit(target)
            if level[high] > level[low]:
                arrows.append(f"{_rel(names[module])} (layer {level[low]}, {low}) imports {_rel(names[target])} "
                              f"(layer {level[high]}, {high})")
    return arrows


def test_every_package_and_top_level_module_has_one_layer():
    units = {_layer_unit(module) for module in _module_names()}
    declared = [unit for layer in LAYERS for unit in layer]
    assert sorted(declared) == sorted(set(declared)), "a package is in two layers"
    assert units == set(declared), f"not in LAYERS: {sorted(units - set(declared))}; gone: {sorted(set(declared) - units)}"


def test_layers_point_one_way():
    """No module of vitreg imports from a higher layer of :data:`LAYERS`, imports inside functions counted."""
    names = _module_names()
    graph = {module: _imports_of(module, path, names) for module, path in names.items()}
    assert "vitreg.environment" in graph["vitreg.models.learned_facts"]  # the graph sees imports
    arrows = _back_arrows(graph, names)
    assert not arrows, "imports that climb back up a layer (move what both need down):\n" + "\n".join(arrows)


def test_the_layer_check_names_both_files_and_both_layers():
    names = {"vitreg.console": REPO / "vitreg/console.py", "vitreg.tracking.uris": REPO / "vitreg/tracking/uris.py"}
    graph = {"vitreg.console": {"vitreg.tracking.uris"}, "vitreg.tracking.uris": {"vitreg.console"}}
    assert _back_arrows(graph, names) == [
        "vitreg/console.py (layer 1, console) imports vitreg/tracking/uris.py (layer 7, tracking)"]


def test_the_architecture_doc_states_these_rules():
    """docs/ARCHITECTURE.md's house rules say what this file checks: the limits, and the layers in order."""
    rules = (REPO / "docs/ARCHITECTURE.md").read_text().split("## House rules")[1]
    for stated in (f"up to {MAX_MODULE_LINES} lines", f"over {MAX_FUNCTION_LINES} lines",
                   f"over {MAX_PARAMETERS} parameters", f"under\n{MIN_LONE_MODULE_LINES} lines",
                   "Kept apart: a table", "Kept apart: a boundary"):
        assert stated.replace("\n", " ") in " ".join(rules.split()), stated
    layers = " ".join(rules.split("lowest first:")[1].split(". A module")[0].split())
    words = [re.findall(r"\w+", part) for part in layers.split(";")]
    named = [[w for w in group if w not in ("and", "the", "package", "root")] for group in words]
    assert named[:-1] == [list(layer) for layer in LAYERS[:-1]] and "package root" in layers.split(";")[-1]


# --------------------------------------------------------------------------- unused names

SCANNED = ("vitreg", "tests", "benchmarks", "entry_points")


def _references() -> set[str]:
    """Every name read anywhere in the code vitreg ships and tests (identifiers, attributes, imported names),
    and every word of its shell scripts and build files (entry points, make targets)."""
    used = set()
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*")) if (REPO / top).is_dir() else ():
            if path.suffix == ".py":
                for node in ast.walk(parsed(path)):
                    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                        used.add(node.id)
                    elif isinstance(node, ast.Attribute):
                        used.add(node.attr)
                    elif isinstance(node, ast.alias):
                        used.add(node.name.rpartition(".")[2])
            elif path.suffix in (".sh", ".toml", ".cfg"):
                used.update(re.findall(r"\w+", path.read_text(errors="ignore")))
    for name in ("pyproject.toml", "MLproject", "Makefile"):
        if (REPO / name).is_file():
            used.update(re.findall(r"\w+", (REPO / name).read_text()))
    return used


def _module_level_names(tree: ast.Module):
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = {element.value for element in node.value.elts}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            names = []
        for name in names:
            if not (name.startswith("__") and name.endswith("__")) and name not in exported:
                yield node.lineno, name


def _unused(paths, used) -> list[str]:
    return [f"{_rel(path)}:{line} {name}" for path in paths
            for line, name in _module_level_names(parsed(path)) if name not in used]


def test_no_unused_module_level_names():
    """A constant, function or class defined at module level in vitreg/ and read nowhere in vitreg/, tests/,
    benchmarks/ or entry_points/ is dead (dunder names and names in ``__all__`` are the module's interface)."""
    unused = _unused(_modules(), _references())
    assert not unused, "remove these (nothing reads them):\n" + "\n".join(unused)


def test_the_unused_names_check_finds_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("__all__ = ['SHOWN']\nSHOWN = 1\nUSED = 2\nDEAD = 3\n__dunder__ = 4\ndef f():\n    return USED\n")
    used = {"USED"}
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            used.add(node.id)
    names = [name for _line, name in _module_level_names(ast.parse(module.read_text())) if name not in used]
    assert names == ["DEAD", "f"]


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("*.py")
                                            if p.name != "timm_benchmark.py"))
def test_each_benchmark_script_loads(script, monkeypatch):
    """CI runs benchmarks/server_load.py after the suite: a name a script imports from vitreg and vitreg no longer
    has must fail here, in seconds, not after the suite (stop 43's CI: ``percentile`` had left measure.timing)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"_benchmark_{script[:-3]}", REPO / "benchmarks" / script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


# --------------------------------------------------------------------------- the Tracker protocol


def _trackers():
    from vitreg.tracking import delivery, handoff, runs

    return [delivery.SpoolingTracker, runs.NullTracker, handoff.HandoffTracker]


def _is_stub(function) -> bool:
    """A protocol call with no body of its own (``...``, after an optional docstring)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    body = body[1:] if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        else body
    return len(body) == 1 and isinstance(body[0], ast.Expr) and body[0].value.value is Ellipsis


def _protocol_gaps(protocol, impl) -> list[str]:
    """What ``impl`` lacks of ``protocol``'s calls: a call it does not define itself (the protocol's ``...``
    stub, inherited, counts as missing) or defines with other parameters."""
    gaps = []
    for name, stub in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(stub):
            continue
        own = next((vars(k)[name] for k in impl.__mro__ if k not in (protocol, object) and name in vars(k)), None)
        if own is None and _is_stub(stub):
            gaps.append(f"{impl.__name__}.{name} is missing")
        elif own is not None and list(inspect.signature(own).parameters) != list(inspect.signature(stub).parameters):
            gaps.append(f"{impl.__name__}.{name} takes {list(inspect.signature(own).parameters)}, "
                        f"not {list(inspect.signature(stub).parameters)}")
    return gaps


def test_every_tracker_implements_the_protocol():
    """The spooling tracker (MLflow behind the spool: what every run uses), the null and the hand-off trackers
    each define every call of the Tracker protocol with the protocol's parameters: a job logs through any of
    them unchanged."""
    from vitreg.tracking.runs import Tracker

    assert len([n for n, f in vars(Tracker).items() if inspect.isfunction(f) and _is_stub(f)]) >= 10
    gaps = [gap for impl in _trackers() for gap in _protocol_gaps(Tracker, impl)]
    assert not gaps, "\n".join(gaps)


def test_the_protocol_check_finds_a_missing_call_and_another_signature():
    from vitreg.tracking.runs import NullTracker, Tracker

    calls = {k: v for k, v in vars(NullTracker).items() if inspect.isfunction(v)}
    lacking = type("Lacking", (Tracker,), {k: v for k, v in calls.items() if k != "set_note"})
    assert _protocol_gaps(Tracker, lacking) == ["Lacking.set_note is missing"]

    def set_tags(self, tags, extra):
        pass

    other = type("Other", (NullTracker,), {"set_tags": set_tags})
    assert _protocol_gaps(Tracker, other) == ["Other.set_tags takes ['self', 'tags', 'extra'], not ['self', 'tags']"]


# --------------------------------------------------------------------------- the specs


def _annotation(text: str) -> str:
    """An annotation as ``from __future__ import annotations`` stores it (ast.unparse's spelling)."""
    return ast.unparse(ast.parse(text, mode="eval"))


def _spec_drift(cls, command: str) -> list[str]:
    """How ``cls``'s declared fields differ from ``command``'s spec options: names and order, kinds, defaults."""
    from vitreg.config.options import spec_options

    kinds = {"str": "str", "choice": "str", "int": "int", "float": "float", "bool": "bool",
             "batch": 'int | Literal["auto"]'}
    options = list(spec_options(command))
    declared = [f for f in fields(cls)]
    drift = []
    if [f.name for f in declared] != [o.name for o in options]:
        drift.append(f"fields {[f.name for f in declared]} are not the options {[o.name for o in options]}")
    for field, option in zip(declared, options):
        if _annotation(field.type) != _annotation(kinds[option.kind]):
            drift.append(f"{field.name}: {field.type} is not {kinds[option.kind]} ({option.kind})")
        if field.default != option.default or type(field.default) is not type(option.default):
            drift.append(f"{field.name} = {field.default!r} is not the table's default {option.default!r}")
    try:
        body = inspect.getsource(cls)
    except (OSError, TypeError):  # a class made in a test has no source file
        return drift
    drift += [f"{f.name} is not declared in the class body" for f in declared if f"    {f.name}: " not in body]
    return drift


@pytest.mark.parametrize("cls_name, command", [("BenchSpec", "bench"), ("TrainSpec", "train")])
def test_the_spec_class_bodies_declare_the_option_table(cls_name, command):
    from vitreg.config import spec

    assert _spec_drift(getattr(spec, cls_name), command) == []


def test_the_spec_check_finds_drift():
    from dataclasses import make_dataclass

    from vitreg.config.spec import BenchSpec

    specs = [(f.name, f.type, f.default) for f in fields(BenchSpec)]
    renamed = make_dataclass("Renamed", [("gpus", *specs[0][1:])] + specs[1:], frozen=True)
    retyped = make_dataclass("Retyped", [(specs[0][0], "int", specs[0][2])] + specs[1:], frozen=True)
    redefaulted = make_dataclass("Redefaulted", specs[:-1] + [(specs[-1][0], specs[-1][1], 1)], frozen=True)
    for drifted, needle in ((renamed, "are not the options"), (retyped, "gpu: int is not str"),
                            (redefaulted, "seed = 1 is not the table's default 0")):
        assert any(needle in line for line in _spec_drift(drifted, "bench")), drifted
