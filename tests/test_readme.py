"""The README as typed: every shell and Python example runs exactly as printed, in order, in a copy of the
repository on a fresh default store (CPU-sized where the README says so; the few that need a GPU, root or
the set-up itself are marked ``<!-- not-run: why -->`` on the line before their fence). And where it shows an
`mlflow run` command and then "the same" as a `vitreg` command, both pass the same options with the same
values (the train example once dropped register_as/alias)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest

from _sessions import README, RUNS, examples, runnable
from conftest import REPO, subprocess_env


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
# The examples run once per test run (the session fixture ``readme_run`` of tests/_sessions.py), in a copy of the
# repository; the tests below read that one run.

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


@pytest.mark.slow
def test_every_readme_example_runs_as_printed(readme_run):
    for example, done in readme_run.ran:
        assert done.returncode == 0, f"README line {example.line}:\n{example.code}\n{done.stdout[-4000:]}"
    assert [example for example, _ in readme_run.ran] == runnable()  # every one, in the README's order


@pytest.mark.slow
def test_the_readme_s_scoring_server_answers_and_its_files_are_where_it_says(readme_run):
    served = [done.stdout for example, done in readme_run.ran if "/invocations" in example.code]
    assert served and '"predictions"' in served[0], served  # the scoring server answered the posted batch
    assert "curl:" not in served[0], served  # it waited for the server quietly (once ~169 "Failed to connect")
    clone = readme_run.clone
    assert (clone / "mlflow.db").is_file() and (clone / "deit-tiny" / "model.safetensors").is_file()


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


# ---------------------------------------------------------------- the CI recipe fails a job on a regression
# ("Gate a change on its benchmark", run as typed, on CPU: real `vitreg bench` runs of a tiny timm model, a
# history of earlier runs, and `vitreg check` failing the job)

def recipe() -> str:
    """The bash block of the README's section "Gate a change on its benchmark"."""
    section = README.split("## Gate a change on its benchmark", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _bash(script: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in subprocess_env("").items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's vitreg, also for the venv's `vitreg` script
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _earlier_copies(uri: str, n: int, speedup: float) -> list[str]:
    """``n`` copies of the store's one bench run (its params and tags: the same configuration and GPU), started
    before it, each ``speedup`` times as fast: a history the next real run falls short of."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    # the recipe's bench run (its `vitreg check` logged a check run apart, in ci/analysis)
    (real,) = client.search_runs([client.get_experiment_by_name("ci").experiment_id], "tags.vitreg_job = 'bench'")
    tags = {k: v for k, v in real.data.tags.items() if not k.startswith("mlflow.")}
    ids = []
    for i in range(n):
        start = real.info.start_time - (n - i) * 60_000
        run = client.create_run(real.info.experiment_id, start_time=start, tags=tags)
        metrics = [Metric(k, v * (speedup if k.endswith("_img_per_s") else 1), start, 0)
                   for k, v in real.data.metrics.items() if k.startswith("infer_")]
        client.log_batch(run.info.run_id, metrics=metrics,
                         params=[Param(k, v) for k, v in real.data.params.items()], tags=[RunTag("copy", "yes")])
        client.set_terminated(run.info.run_id, end_time=start + 1000)
        ids.append(run.info.run_id)
    return ids


@pytest.mark.slow
def test_the_readme_ci_recipe_fails_the_job_on_a_regressed_run(readme_run, tmp_path):
    """The README run (tests/_sessions.py) ran the recipe once on a fresh store: its bench is the first real
    run. A copy of that store gets a history that run falls short of; the recipe as typed runs again on it."""
    script = recipe()
    assert "vitreg bench" in script and "vitreg check" in script
    uri_line = next(line for line in script.splitlines() if line.startswith("export"))
    db = re.search(r"sqlite:///(\S+)", uri_line).group(1)
    first = readme_run.of(script)
    assert first.returncode == 0, first.stdout[-2000:]
    shutil.copyfile(readme_run.clone / db, tmp_path / db)  # the README run's store stays as it left it
    # 10x: a loaded 2-core machine moved one CPU run's median by 3x between two runs of the same work
    history = _earlier_copies(f"sqlite:///{tmp_path / db}", 10, speedup=10.0)

    job = _bash(script, tmp_path)  # the recipe as typed: a second real bench, then the check
    assert job.returncode == 1, job.stdout + job.stderr[-2000:]
    (line,) = [x for x in job.stdout.splitlines() if x.startswith("REGRESSED: deit_tiny_patch16_224")]
    assert re.search(r"on cpu: 0\.[0-3]\d*x \[", line), line  # a tenth of the history's speed, give or take load
    assert f"vs 10 runs ({history[1]}.." in line  # the 9 newest copies and the first real run

    again = _bash(f"{uri_line}\nvitreg check --experiment ci --window 0", tmp_path)
    assert again.returncode == 2 and again.stderr.count("error: ") == 1 and "window=0" in again.stderr
