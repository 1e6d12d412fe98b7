"""The README as typed: where it shows an `mlflow run` command and then "the same" as a `vitreg` command,
both pass the same options with the same values (the train example once dropped register_as/alias)."""

from __future__ import annotations

import re
import shlex

from conftest import REPO

README = (REPO / "README.md").read_text()


def bash_blocks() -> list[list[list[str]]]:
    """The commands of each of the README's bash blocks, continuation lines joined, comments dropped."""
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
        blocks.append([words for words in commands if words])
    return blocks


def mlflow_params(words: list[str]) -> tuple[str, dict]:
    entry = words[words.index("-e") + 1]
    params = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "-P")
    return entry, params


def vitreg_options(words: list[str]) -> tuple[str, dict]:
    pairs = zip(words[2::2], words[3::2])
    return words[1], {flag.removeprefix("--").replace("-", "_"): value for flag, value in pairs}


def twin_commands() -> list[tuple[list[str], list[str]]]:
    """(mlflow run ..., vitreg ...) pairs: a `vitreg <entry>` command right after `mlflow run . -e <entry>`
    in one block."""
    return [(a, b) for commands in bash_blocks() for a, b in zip(commands, commands[1:])
            if a[:2] == ["mlflow", "run"] and b[0] == "vitreg" and b[1] == mlflow_params(a)[0]]


def test_the_readme_s_vitreg_twins_pass_what_its_mlflow_run_commands_pass():
    pairs = twin_commands()
    assert {mlflow_params(a)[0] for a, _ in pairs} >= {"train", "infer"}  # the examples this test guards
    for run, twin in pairs:
        assert vitreg_options(twin) == mlflow_params(run), (shlex.join(run), shlex.join(twin))
