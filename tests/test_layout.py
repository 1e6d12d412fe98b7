"""The house rules a newcomer relies on, checked on every test run: small units, and MLflow behind one door.

- no module in vitreg/ over 450 lines, no function over 80;
- only vitreg/tracking/ imports mlflow (runners and loops return typed results, the tracking layer logs them);
- no MLFLOW_* environment handling outside vitreg/tracking/ (deploy/ sets the server's own variables).
"""

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "vitreg"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_modules_and_functions_stay_small():
    too_long = []
    for path in _modules():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{_rel(path)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{_rel(path)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "split these by what they do:\n" + "\n".join(too_long)


def _imports_mlflow(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mlflow" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlflow":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "vitreg.tracking.lazy":  # mlflow on first use
            return True
    return False


def test_only_the_tracking_layer_imports_mlflow():
    outside = [_rel(p) for p in _modules()
               if "tracking" != p.relative_to(PACKAGE).parts[0] and _imports_mlflow(ast.parse(p.read_text()))]
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
