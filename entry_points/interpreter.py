"""Run an MLproject entry point in the Python that has vitreg's dependencies. Standard library only: it runs
before anything else is imported.

``mlflow run`` starts an entry point as ``bash -c "python entry_points/<name>.py ..."``: the ``python`` first on
PATH, not the one ``mlflow`` itself runs in. From a virtualenv that is not activated (``.venv/bin/mlflow run . -e
train --env-manager local``) that is another Python, without pandas or torch: the run ended in a
``ModuleNotFoundError`` traceback, FAILED. So an entry point first checks that its Python has every dependency
pyproject.toml names; where one is missing it starts itself again in the Python of the ``mlflow`` command that
started it (``/proc``: Linux), else in the project's ``.venv``; where neither is there, one line names the fix
(exit 2). ``mlflow run`` then marks its run FAILED, as for any failed entry point.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
#: Set in the environment of the second start, so an entry point never starts itself more than once.
STARTED_AGAIN = "VITREG_ENTRY_POINT_RESTARTED"
#: A distribution whose module is not its name with dashes as underscores.
MODULE_OF = {"nvidia-ml-py": "pynvml"}


def dependencies() -> list[str]:
    """The distribution names of pyproject.toml's ``[project] dependencies`` (``torch``, ``nvidia-ml-py``)."""
    text = (PROJECT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
    lines = [line.split("#", 1)[0] for line in block.group(1).splitlines()] if block else []
    return re.findall(r"""["']([A-Za-z0-9][A-Za-z0-9._-]*)""", "\n".join(lines))


def missing_modules() -> list[str]:
    """The dependencies this Python cannot import (found without importing them: a path search each)."""
    modules = [MODULE_OF.get(name, name.replace("-", "_")) for name in dependencies()]
    return [module for module in modules if importlib.util.find_spec(module) is None]


def mlflow_python(pid: int | None = None, levels: int = 4) -> str | None:
    """The Python running the ``mlflow`` command among this process's parents (``bash -c`` sits between):
    the interpreter its kernel started, ``/venv/bin/python /venv/bin/mlflow run ...``."""
    pid = os.getppid() if pid is None else pid
    for _ in range(levels):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if (len(argv) > 1 and os.path.isabs(argv[0]) and Path(argv[0]).name.startswith("python")
                and (Path(argv[1]).name == "mlflow" or argv[1:3] == ["-m", "mlflow"])):
            return argv[0]
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
        if pid <= 1:
            return None
    return None


def use_the_python_with_dependencies() -> None:
    """Return when this Python has every dependency; else start this script again in one that may, or exit 2
    with one line."""
    missing = missing_modules()
    if not missing:
        return
    if not os.environ.get(STARTED_AGAIN):
        for python in (mlflow_python(), str(PROJECT / ".venv" / "bin" / "python")):
            if python and os.path.exists(python) and os.path.abspath(python) != os.path.abspath(sys.executable):
                os.execve(python, [python, *sys.argv], {**os.environ, STARTED_AGAIN: "1"})
    print(f"error: {sys.executable} has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} (vitreg's "
          f"dependencies): `mlflow run` starts entry points with the python first on PATH; activate the "
          f"environment vitreg is installed in (`source .venv/bin/activate`), or `pip install -e .` into this "
          f"python", file=sys.stderr)
    sys.exit(2)
