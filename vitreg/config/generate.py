"""MLproject and the README's parameter tables, written from the option table (``make mlproject``; ``--check``
changes nothing and exits 1 naming the files out of date). Both stay checked in: ``mlflow run`` reads
MLproject, and a reader reads the README on the web.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from vitreg.config.options import Option, options_of

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = ("bench", "compare", "check", "sweep", "infer", "train")  # their order in MLproject
README_TABLES = ("bench", "train")

_HEADER = """\
# Generated from vitreg/config/options.py by `make mlproject`: edit the option table, not this file.
name: vitreg

# conda users: `mlflow run . -e bench -P gpu=a100` builds the env from conda.yaml.
# pip users (after `pip install -e .`): add `--env-manager local`.
conda_env: conda.yaml

entry_points:
"""
_COMMAND_WIDTH = 110
_PLAIN = re.compile(r"[A-Za-z][\w\-]*")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "none"}  # YAML 1.1 reads these as non-strings


def mlproject_params(command: str) -> list[Option]:
    """The options of ``command`` that are params of its MLproject entry point."""
    return [o for o in options_of(command) if o.mlproject]


def _yaml_scalar(text: str) -> str:
    if _PLAIN.fullmatch(text) and text.lower() not in _YAML_WORDS:
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _entry_point(command: str) -> list[str]:
    params = mlproject_params(command)
    lines = [f"  {command}:", "    parameters:"]
    for o in params:
        default = "" if o.default is None else f", default: {_yaml_scalar(o.default_text)}"
        lines.append(f"      {o.name}: {{type: string{default}}}")
    # every param reaches the command line as --flag {param}; folded (>-): the line breaks are spaces
    words = [f"python entry_points/{command}.py", *(f"{o.flags[0]} {{{o.name}}}" for o in params)]
    lines.append("    command: >-")
    line = ""
    for word in words:
        if line and len(line) + 1 + len(word) > _COMMAND_WIDTH:
            lines.append(line)
            line = ""
        line = f"{line} {word}" if line else f"      {word}"
    return lines + [line]


def mlproject_text() -> str:
    """MLproject as generated from the option table."""
    return _HEADER + "\n\n".join("\n".join(_entry_point(c)) for c in ENTRY_POINTS) + "\n"


def _default_cell(o: Option) -> str:
    return f"`{o.default_text}`" if o.default_text else '`""`'


def _rows(options: list[Option]) -> list[str]:
    return [f"| `{o.name}` | {_default_cell(o)} | {o.meaning} |" for o in options]


def readme_table(command: str) -> str:
    """The README's parameter table of ``command``. For train, the options it shares with bench are one
    row, "as in bench": the same option, the same meaning."""
    params = mlproject_params(command)
    lines = ["| param | default | meaning |", "|---|---|---|"]
    if command != "bench":
        shared = [o for o in params if "bench" in o.commands]
        params = [o for o in params if o not in shared]
        if shared:
            lines.append(f"| {', '.join(f'`{o.name}`' for o in shared)} | as in bench | |")
    return "\n".join(lines + _rows(params))


def readme_text(readme: str) -> str:
    """``readme`` with each generated block (between ``<!-- options:NAME -->`` and
    ``<!-- /options:NAME -->``) rewritten from the option table."""
    for command in README_TABLES:
        start, end = f"<!-- options:{command} -->", f"<!-- /options:{command} -->"
        block = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
        if not block.search(readme):
            raise ValueError(f"README.md has no {start} ... {end} block")
        readme = block.sub(lambda _: f"{start}\n{readme_table(command)}\n{end}", readme)
    return readme


def generated_files(repo: Path = REPO) -> dict[Path, str]:
    """``{path: the text it should hold}`` for every generated file."""
    readme = repo / "README.md"
    return {repo / "MLproject": mlproject_text(), readme: readme_text(readme.read_text())}


def main(argv: list[str]) -> int:
    stale = [p for p, text in generated_files().items() if p.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path.name} is out of date with vitreg/config/options.py: run `make mlproject`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated_files().items():
        if path in stale:
            path.write_text(text)
            print(f"wrote {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
