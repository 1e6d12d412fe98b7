"""The command a user typed to start this job, as report.md shows it.

Under ``mlflow run`` the process sees only the MLproject command line (``entry_points/bench.py --gpu auto
--model ... `` with every param, defaults included) and MLFLOW_RUN_ID / MLFLOW_TRACKING_URI /
MLFLOW_EXPERIMENT_ID; ``mlflow run``'s own flags (``--env-manager``, ``--experiment-name``) never reach
it. So the command is rebuilt from the params: ``mlflow run . -e bench -P k=v`` for each param that
differs from its default, which runs the same job, with ``--env-manager local`` when the job runs in no
environment ``mlflow run`` made (its conda envs are named ``mlflow-<hash>``, its virtualenvs live under
``~/.mlflow/envs``): the command as it was typed. A ``vitreg`` command is rebuilt from the options
given on its command line or in the environment, in the option table's order.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import PurePath

import click
from click.core import ParameterSource

from vitreg.config.options import options_of
from vitreg.config.parse import param_text

ENTRY_POINTS_DIR = "entry_points"  # the MLproject scripts call the CLI with prog_name="entry_points/<name>.py"


def command_line(ctx: click.Context) -> str:
    """``mlflow run . -e bench -P model=deit_tiny_patch16_224`` or ``vitreg bench --model deit_tiny_patch16_224``."""
    command = ctx.info_name
    prog = PurePath(ctx.find_root().info_name or "vitreg")
    if prog.parent.name == ENTRY_POINTS_DIR:
        return _mlflow_run(prog.stem, ctx.params)
    given = [o for o in options_of(command) if ctx.get_parameter_source(o.name) in
             (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT) and ctx.params.get(o.name) is not None]
    words = ["vitreg", command]
    for o in given:
        words += [o.flags[0], param_text(ctx.params[o.name])]
    return shlex.join(words)


def _env_manager_local() -> bool:
    """True when this process runs in an environment ``mlflow run`` did not build (``--env-manager local``)."""
    conda = os.environ.get("CONDA_DEFAULT_ENV", "")
    return not conda.startswith("mlflow-") and f"{os.sep}.mlflow{os.sep}envs{os.sep}" not in sys.prefix


def _mlflow_run(entry_point: str, values: dict) -> str:
    words = ["mlflow", "run", ".", "-e", entry_point] + (["--env-manager", "local"] if _env_manager_local() else [])
    for o in options_of(entry_point):
        value = values.get(o.name)
        if o.mlproject and value is not None and param_text(value) != o.default_text:
            words += ["-P", f"{o.name}={param_text(value)}"]
    return shlex.join(words)
