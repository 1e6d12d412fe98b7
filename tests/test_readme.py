"""The README as typed: every shell and Python example runs exactly as printed, in order, in a copy of the
repository on a fresh default store (CPU-sized where the README says so; the few that need a GPU, root or
the set-up itself are marked ``<!-- not-run: why -->`` on the line before their fence): the first half here, the
second (a model's life and the CI gate) in tests/test_readme_model.py, in the other worker at the same time. And
where it shows an `mlflow run` command and then "the same" as a `vitreg` command, both pass the same options
with the same values (the train example once dropped register_as/alias)."""

from __future__ import annotations

import re
import shlex

import pytest

from _sessions import README, RUNS, examples, runnable


def bash_blocks() -> list[list[list[str]]]:
    """The commands of each of the README's bash blocks, continuation lines joined, comments dropped."""
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
        blocks.append([words for words in commands if words])
    return blocks


def mlflow_params(words: list[str]) -> tuple[str, dict]:
    """The entry point and what the run gets: its -P params, and the experiment of --experiment-name."""
    entry = words[words.index("-e") + 1]
    params = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "-P")
    if "--experiment-name" in words:
        params.setdefault("experiment", words[words.index("--experiment-name") + 1])
    return entry, params


def vitreg_options(words: list[str]) -> tuple[str, dict]:
    pairs = zip(words[2::2], words[3::2])
    options = {flag.removeprefix("--").replace("-", "_"): value for flag, value in pairs}
    return words[1], options


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


# ---------------------------------------------------------------- every example runs as printed
# The examples run once per test run, in two halves (the session fixtures ``readme_run`` here and
# ``readme_model_run`` in tests/test_readme_model.py, of tests/_sessions.py), each in a copy of the repository.

MAX_NOT_RUN = 5  # a GPU, conda on an A100, a Ray cluster of GPU nodes, the set-up itself, root for CI's services


def test_every_example_is_run_or_says_why_not():
    blocks = examples()
    assert {b.lang for b in blocks} <= {*RUNS, "text"}, [(b.line, b.lang) for b in blocks]  # no untyped fence
    skipped = [b for b in blocks if b.not_run]
    assert all(b.lang in RUNS for b in skipped)  # a mark on a text block would hide nothing
    assert len(skipped) <= MAX_NOT_RUN, [(b.line, b.not_run) for b in skipped]
    assert len(runnable()) >= 8  # the user's path is run


def test_the_parser_sees_marks_and_fences_as_written():
    text = "x\n<!-- not-run: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n```python\nprint(1)\n```\n"
    gpu, py = examples(text)
    assert (gpu.lang, gpu.code, gpu.not_run, gpu.line) == ("bash", "nvidia-smi\n", "needs a GPU", 3)
    assert (py.lang, py.code, py.not_run) == ("python", "print(1)\n", None)


def test_the_two_halves_of_the_readme_run_hold_every_example_once():
    """The README run is two halves, one per worker (tests/_sessions.py); tests/test_readme_model.py runs the
    second: a model's life and the CI gate."""
    first, second = runnable(half=1), runnable(half=2)
    assert sorted(first + second, key=lambda e: e.line) == runnable() and not set(first) & set(second)
    assert any("vitreg bench" in e.code for e in first) and any("-e sweep" in e.code for e in first)
    assert any("-e train" in e.code for e in second) and any("vitreg check" in e.code for e in second)


@pytest.mark.slow
def test_every_readme_example_of_the_first_half_runs_as_printed(readme_run):
    readme_run.assert_ran_as_printed(half=1)  # bench, Python, compare, sweep


def test_the_readme_s_curls_wait_quietly():
    """A curl that retries while a server starts prints each failed attempt under ``-S`` (``--show-error``): the
    README's waiting curl is silent (``-s`` alone, its output dropped); only the request itself shows errors."""
    curls = [words for block in bash_blocks() for words in block if words[0] == "curl"]
    waiting = [words for words in curls if "--retry" in words]
    assert curls and waiting, curls
    for words in waiting:
        flags = [w for w in words if w.startswith("-") and not w.startswith("--")]
        assert "-s" in flags and not any("S" in f for f in flags) and "--show-error" not in words, words
        assert words[words.index("-o") + 1] == "/dev/null", words
