"""``vitreg sync``, ``vitreg runs --stale`` and ``vitreg runs --csv``: thin click shells over
:func:`vitreg.tracking.delivery.sync`, :func:`vitreg.tracking.runs.find_stale` and :func:`vitreg.api.runs`.

Registered on the group with ``main.add_command(sync)`` and ``main.add_command(runs)``.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from vitreg.cli.common import OneSpelling, user_errors
from vitreg.cli.param_types import FloatText
from vitreg.config.parse import parse_float
from vitreg.errors import VitregError

_STALE_AFTER_S = "600"  # twenty heartbeat periods: a run silent that long has no process behind it


@click.command("sync")
@click.option("--spool", "spool_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A spool folder, or a folder of them (default: $VITREG_SPOOL_DIR, else "
                   "~/.local/share/vitreg/spool).")
@click.option("--tracking-uri", "tracking_uri", default=None,
              help="Deliver there (default: the server each run was logged against, else MLFLOW_TRACKING_URI).")
@user_errors
def sync(spool_dir, tracking_uri):
    """Deliver runs that were logged locally (server down, offline=true, killed) exactly once."""
    from vitreg.tracking.spool import spool_root
    from vitreg.tracking.delivery import sync as deliver

    results = deliver(spool_dir, tracking_uri)
    if not results:
        click.echo(f"nothing to deliver under {spool_dir or spool_root()}")
    for result in results:
        click.echo(result.describe())


@click.command("runs")
@click.option("--stale", is_flag=True, help="List RUNNING runs whose process is gone (no heartbeat).")
@click.option("--fix", is_flag=True, help="With --stale: end those runs KILLED, the reason in vitreg_error.")
@click.option("--csv", "as_csv", is_flag=True,
              help="Write the experiment's finished runs as CSV to stdout, one row per (run, task).")
@click.option("--experiment", "--experiment-name", "experiment", cls=OneSpelling, default=None,
              help="Look in this experiment only (default: all; --csv needs one).")
@click.option("--older-than", "older_than", type=FloatText(min=0), default=_STALE_AFTER_S, show_default=True,
              help="Seconds without a heartbeat (or, for a run that never sent one, since its start).")
@user_errors
def runs(stale, fix, as_csv, experiment, older_than):
    """An experiment's runs as one table (--csv), or runs left RUNNING by a killed process: list them
    (--stale) and end them KILLED (--fix)."""
    if as_csv:
        _write_csv(stale, experiment)
        return
    if not stale:
        raise VitregError("vitreg runs lists runs left RUNNING by a process that is gone: pass --stale "
                          "(and --fix to end them KILLED), or --csv --experiment NAME for an experiment's results")
    seconds = parse_float(older_than, "--older-than", minimum=0)
    from vitreg.tracking.runs import find_stale, mark_killed

    found = find_stale(seconds, experiment)
    for run in found:
        seen = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(run.last_seen))
        click.echo(f"{run.run_id}  {run.experiment}  {run.run_name or '-'}  "
                   f"{'heartbeat' if run.heartbeat else 'started'} {seen} UTC")
    if fix:
        click.echo(f"marked {mark_killed(found)} run(s) KILLED")
    elif found:
        click.echo(f"{len(found)} stale run(s); end them with: vitreg runs --stale --fix")
    else:
        click.echo(f"no RUNNING run silent for more than {seconds:g} s")


def _write_csv(stale: bool, experiment: str | None) -> None:
    """The tidy frame of :func:`vitreg.api.runs` (what ``vitreg compare`` compares) as CSV on stdout."""
    if stale:
        raise VitregError("--csv writes finished runs and --stale lists unfinished ones: pass one of them")
    if not experiment:
        raise VitregError("--csv needs the experiment: pass --experiment NAME")
    from vitreg.api import runs as runs_frame

    click.echo(runs_frame(experiment).to_csv(index=False), nl=False)
