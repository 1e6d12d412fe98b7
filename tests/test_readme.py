"""The README as typed: every shell and Python example runs exactly as printed, in order, in a copy of the
repository on a fresh default store (CPU-sized where the README says so; the few that need a GPU, root or
the set-up itself are marked ``<!-- not-run: why -->`` on the line before their fence). And where it shows an
`mlflow run` command and then "the same" as a `vitreg` command, both pass the same options with the same
values (the train example once dropped register_as/alias)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN

README = (REPO / "README.md").read_text()


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

NOT_RUN = re.compile(r"^<!-- not-run: (?P<why>.+\S) -->$")
FENCE = re.compile(r"^```(?P<lang>[a-z]*)$")
RUNS = ("bash", "python")
MAX_NOT_RUN = 5  # a GPU, conda on an A100, a Ray cluster of GPU nodes, the set-up itself, root for CI's services


@dataclass(frozen=True)
class Example:
    lang: str
    code: str
    line: int  # of its opening fence, 1-based
    not_run: str | None  # why it is not run here

    def argv(self) -> list[str]:
        # bash -e: a failing command fails the example (no pipefail: `curl ... | head -c 300` closes early)
        return ["bash", "-e", "-c", self.code] if self.lang == "bash" else [sys.executable, "-c", self.code]


def examples(text: str = README) -> list[Example]:
    """The README's fenced blocks, each with the not-run reason written on the line before it, if any."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
        mark = NOT_RUN.match(lines[i - 1]) if i else None
        found.append(Example(fence["lang"], "\n".join(lines[i + 1:end]) + "\n", i + 1, mark and mark["why"]))
        i = end + 1
    return found


def test_every_example_is_run_or_says_why_not():
    blocks = examples()
    assert {b.lang for b in blocks} <= {*RUNS, "text"}, [(b.line, b.lang) for b in blocks]  # no untyped fence
    skipped = [b for b in blocks if b.not_run]
    assert all(b.lang in RUNS for b in skipped)  # a mark on a text block would hide nothing
    assert len(skipped) <= MAX_NOT_RUN, [(b.line, b.not_run) for b in skipped]
    assert len([b for b in blocks if b.lang in RUNS and not b.not_run]) >= 8  # the user's path is run


def test_the_parser_sees_marks_and_fences_as_written():
    text = "x\n<!-- not-run: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n```python\nprint(1)\n```\n"
    gpu, py = examples(text)
    assert (gpu.lang, gpu.code, gpu.not_run, gpu.line) == ("bash", "nvidia-smi\n", "needs a GPU", 3)
    assert (py.lang, py.code, py.not_run) == ("python", "print(1)\n", None)


def repository_copy(dst: Path) -> Path:
    """The repository's files as a fresh clone holds them (tracked and new, not ignored), in ``dst``."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            (dst / name).write_bytes(source.read_bytes())
    return dst


def user_env(clone: Path) -> dict:
    """A user's shell after `. .venv/bin/activate` in the clone: the venv first on PATH, MLflow's defaults
    (no tracking URI: ./mlflow.db), the clone's vitreg."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VIRTUAL_ENV", "PYTHONPATH"))}
    return {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": str(clone),
            "PYTHONUNBUFFERED": "1"}


def run_example(example: Example, clone: Path, env: dict) -> subprocess.CompletedProcess:
    """One example, in its own process group: what it leaves running (a server started with `&`) is ended."""
    proc = subprocess.Popen(example.argv(), cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(example.argv(), proc.returncode, out)


@pytest.mark.slow
def test_every_readme_example_runs_as_printed(tmp_path):
    clone = repository_copy(tmp_path / "vitreg")
    env = user_env(clone)
    ran = []
    for example in [e for e in examples() if e.lang in RUNS and not e.not_run]:
        done = run_example(example, clone, env)
        assert done.returncode == 0, f"README line {example.line}:\n{example.code}\n{done.stdout[-4000:]}"
        ran.append((example, done.stdout))
    served = [out for example, out in ran if "/invocations" in example.code]
    assert served and '"predictions"' in served[0], served  # the scoring server answered the posted batch
    assert (clone / "mlflow.db").is_file() and (clone / "deit-tiny" / "model.safetensors").is_file()
