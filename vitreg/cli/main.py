"""The ``vitreg`` command (click): the group and every subcommand, each a thin shell over a library call."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from vitreg import signals
from vitreg.cli.common import (OneLineUsageError, OneSpelling, VitregCommand, check_first, command_line,
                               command_options, dashed, offline_if_asked, run_ddp_job, split_options, store_first,
                               user_errors)
from vitreg.cli.param_types import ChoiceText, FloatText, GpuLabel, IntText
from vitreg.config.options import option
from vitreg.config.parse import parse_choice, parse_float, parse_int
from vitreg.console import mask_console, plural, quiet_libraries
from vitreg.errors import VitregError
from vitreg.tracking.store import bound_http_requests, quiet_artifact_downloads, quiet_mlflow_info

_STALE_AFTER_S = "600"  # twenty heartbeat periods: a run silent that long has no process behind it
_LISTED = "20"  # runs `vitreg runs` lists unless -n says: a screenful
_STATUSES = ("running", "finished", "failed", "killed", "scheduled")  # MLflow's run statuses


class VitregGroup(click.Group):
    command_class = VitregCommand  # sections in --help, one-line usage errors

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:  # `vitreg benh`: one line, with click's suggestion
            raise OneLineUsageError(exc.format_message(), ctx) from None


@click.group(cls=VitregGroup, context_settings={"token_normalize_func": dashed})
@click.version_option(package_name="vitreg")
def main():
    """vitreg: ViT/DeiT benchmarks with compile/AMP/DDP, tracked in MLflow."""
    mask_console()  # no credential in any line this process prints, whoever prints it
    signals.freeze_at_exit()
    signals.install()  # SIGTERM/SIGHUP end the run KILLED, like Ctrl-C, instead of leaving it RUNNING
    quiet_artifact_downloads()  # vitreg's progress lines say what is downloaded; MLflow's bars only clutter
    bound_http_requests()  # a sick server costs seconds, not MLflow's minutes of retries
    quiet_mlflow_info()  # and what a run does: MLflow's system-metrics INFO lines only clutter
    quiet_libraries()  # kineto's trace markers and driver probe, timm's short-cosine warning


@main.command()
@command_options("bench")
@user_errors
def bench(**values):
    """Benchmark inference and/or training of one model and log one MLflow run."""
    check_first("bench", values)
    from vitreg.bench.job import bench as run_bench

    run_ddp_job("bench", run_bench, values)


@main.command()
@command_options("compare")
@user_errors
def compare(experiment, baseline, metric, log_experiment, by, include_mismatch, prices):
    """Compare an experiment's runs across GPUs (or --by another axis): table, CSV/HTML/markdown and plots as
    artifacts of a compare run, logged beside the runs compared; with --prices, $ per 1M images too."""
    from vitreg.compare import run_compare

    run_compare(experiment, baseline or None, metric, log_experiment=log_experiment, by=by.strip() or "gpu",
                include_mismatch=option("compare", "include_mismatch").parse(include_mismatch), prices=prices)


@main.command("import-timm")
@click.argument("csv_file", type=click.Path(dir_okay=False))
@click.option("--gpu", type=GpuLabel(), default=None,
              help="GPU label of the file (checked against the one in its name, if any).")
@click.option("--amp", type=ChoiceText(("off", "bf16", "fp16"), case_sensitive=False), default=None,
              help="Precision, when the file name does not say.")
@click.option("--experiment", "--experiment-name", "experiment", cls=OneSpelling, default=None,
              envvar="MLFLOW_EXPERIMENT_NAME", help="MLflow experiment to fill (default: MLflow's active one).")
@user_errors
def import_timm(csv_file, gpu, amp, experiment):
    """Import a timm benchmark.py results CSV as runs tagged source=timm."""
    from vitreg.compare import import_timm as do_import

    do_import(csv_file, gpu, amp, experiment)


@main.command()
@command_options("sweep")
@user_errors
def sweep(**values):
    """Run every combination of models x amp x compile x batch size (and each --axis) as child runs of one
    parent run, on this host's GPUs or (engine=ray) a Ray cluster's."""
    check_first("sweep", values)
    from vitreg.bench.sweep import run_sweep

    common, own = split_options("sweep", values)  # common: the same for every combination
    run_sweep(own, common=common)  # a sweep with failed children raises, naming how to re-run them


@main.command()
@click.option("--dry-run", is_flag=True, help="Print the configuration and the mlflow command; start nothing.")
@click.option("--timeout", type=FloatText(min=0), default="60", show_default=True,
              help="Seconds to wait for the server's /health.")
@user_errors
def server(dry_run, timeout):
    """Start the tracking server from tracking/ (VITREG_SERVER_* variables; see tracking/README.md)."""
    from vitreg.deploy.server import main as server_main

    seconds = parse_float(timeout, "--timeout", minimum=0)
    sys.exit(server_main(["--timeout", str(seconds)] + (["--dry-run"] if dry_run else [])))


@main.command("train")
@command_options("train")
@user_errors
def train(**values):
    """Train a ViT/DeiT (synthetic data or an ImageFolder), log curves and checkpoints to one MLflow run."""
    check_first("train", values)
    from vitreg.train.job import train as run_train

    run_ddp_job("train", run_train, values)


@main.command()
@command_options("check")
@user_errors
def check(experiment, metric, log_experiment, window, candidate, candidate_tag, baseline_tag):
    """Check each configuration x GPU of an experiment against its own history: exit 1 on a regression
    beyond noise (printed with the runs compared, what changed and any throttling or busy host), 3 where the
    history is too short or too noisy to judge (saying what it needs), and log a check run with the series."""
    from vitreg.compare import run_check, selection_of

    result = run_check(experiment, metric, selection_of(window, candidate, candidate_tag, baseline_tag),
                       log_experiment=log_experiment)
    sys.exit(result.exit_code)


@main.command("sync")
@click.option("--spool", "spool_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A spool folder, or a folder of them (default: $VITREG_SPOOL_DIR, else "
                   "~/.local/share/vitreg/spool).")
@click.option("--tracking-uri", "tracking_uri", default=None,
              help="Deliver there (default: the server each run was logged against, else MLFLOW_TRACKING_URI).")
@user_errors
def sync(spool_dir, tracking_uri):
    """Deliver runs that were logged locally (server down, offline=true, killed) exactly once."""
    from vitreg.tracking.spool import spool_root
    from vitreg.tracking.sync import sync as deliver

    results = deliver(spool_dir, tracking_uri)
    if not results:
        click.echo(f"nothing to deliver under {spool_dir or spool_root()}")
    for result in results:
        click.echo(result.describe())


@main.command("runs")
@click.option("-n", "limit", type=IntText(min=1), default=None,
              help=f"How many of the newest runs (default: {_LISTED} in the table; all with --csv/--json).")
@click.option("--experiment", "--experiment-name", "experiment", cls=OneSpelling, default=None,
              help="Look in this experiment only (default: all; --csv and --json need one).")
@click.option("--status", type=ChoiceText(_STATUSES, case_sensitive=False), default=None,
              help="Only runs in this status.")
@click.option("--csv", "as_csv", is_flag=True,
              help="Write the experiment's finished runs as CSV to stdout, one row per (run, task), every column.")
@click.option("--json", "as_json", is_flag=True, help="The same frame as --csv, as JSON records.")
@click.option("--stale", is_flag=True, help="List RUNNING runs whose process is gone (no heartbeat).")
@click.option("--fix", is_flag=True, help="With --stale: end those runs KILLED, the reason in vitreg_error.")
@click.option("--older-than", "older_than", type=FloatText(min=0), default=_STALE_AFTER_S, show_default=True,
              help="With --stale: seconds without a heartbeat (or, for a run that never sent one, since its start).")
@user_errors
def runs(limit, experiment, status, as_csv, as_json, stale, fix, older_than):
    """The newest runs of the store as a table (id, name, status, GPU, img/s, flags of a suspect figure); an
    experiment's finished runs as one frame (--csv, --json); runs left RUNNING by a killed process (--stale;
    --fix ends them KILLED)."""
    status = parse_choice(status, "status", _STATUSES).upper() if status else None
    limit = _count(limit) if limit is not None else None
    if as_csv or as_json:
        _write_frame("--csv" if as_csv else "--json", stale, experiment, limit, status)
    elif stale or fix:
        if limit or status:
            raise VitregError("--stale lists every RUNNING run silent for --older-than seconds: pass it without "
                              "-n and --status")
        _list_stale(stale, fix, experiment, parse_float(older_than, "--older-than", minimum=0))
    else:
        _list_runs(limit or int(_LISTED), experiment, status)


def _count(text: str) -> int:
    try:
        return parse_int(text, "-n", minimum=1)
    except VitregError:
        raise VitregError(f"-n {text!r} is not a number of runs: pass e.g. -n 50") from None


def _list_runs(limit: int, experiment: str | None, status: str | None) -> None:
    from vitreg.tracking import runs as tracking

    found = tracking.newest_runs(limit, experiment, status)
    where = (f" in experiment {experiment!r}" if experiment else "") + (f" with status {status}" if status else "")
    if not len(found):
        click.echo(f"no runs{where} at {tracking.tracking_uri()}; `vitreg bench` logs one")
        return
    from vitreg.analysis.render import runs_table
    from vitreg.tracking.search import NOT_VITREG, run_list

    listed = run_list(found)
    click.echo(runs_table(listed))
    more = f"; more: vitreg runs -n {limit * 2}" if len(listed) == limit else ""
    click.echo(f"{plural(len(listed), 'run')}{where}, newest first{more}")
    orphans = listed["start_time"][listed["status"] == NOT_VITREG]
    if len(orphans):  # no process of vitreg's will end them: say how
        age = int(time.time() - orphans.max().timestamp())
        click.echo(f"{plural(len(orphans), 'run')} RUNNING that vitreg never started (no heartbeat, no vitreg tag; "
                   "`mlflow run` failing before its entry point leaves one): end them KILLED with: vitreg runs --stale "
                   "--fix" + (f" --older-than {age}" if age < float(_STALE_AFTER_S) else ""))


def _list_stale(stale: bool, fix: bool, experiment: str | None, seconds: float) -> None:
    if not stale:
        raise VitregError("--fix ends runs left RUNNING by a process that is gone: pass --stale --fix")
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


def _write_frame(flag: str, stale: bool, experiment: str | None, limit: int | None, status: str | None) -> None:
    if stale:
        raise VitregError(f"{flag} writes finished runs and --stale lists unfinished ones: pass one of them")
    if not experiment:
        raise VitregError(f"{flag} needs the experiment: pass --experiment NAME")
    from vitreg.tracking.runs import newest_runs
    from vitreg.tracking.search import benchmarks_only, tidy

    frame = tidy(benchmarks_only(newest_runs(limit, experiment, status)))
    click.echo(frame.to_csv(index=False) if flag == "--csv" else
               frame.to_json(orient="records", date_format="iso", indent=1) + "\n", nl=False)


@main.command()
@click.argument("checkpoint_uri")
@click.option("--name", required=True,
              help="Registered model name (created if new; its versions must be the same architecture).")
@click.option("--alias", default="latest", show_default=True,
              help="Alias to move to the new version (latest: none set; MLflow resolves @latest to the newest).")
@user_errors
def register(checkpoint_uri, name, alias):
    """Register a run's checkpoint (runs:/<run_id>/checkpoints/last) as a new model version."""
    store_first(checkpoint_uri)
    from vitreg.tracking.model_registry import register_run_checkpoint

    mv = register_run_checkpoint(checkpoint_uri, name, alias)
    click.echo(f"registered models:/{mv.name}/{mv.version}" + (f" (@{alias})" if alias.lower() != "latest" else "")
               + f" from run {mv.run_id}")


@main.command()
@click.argument("model_uri")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Also write a self-contained folder: model.safetensors, spec.json, manifest.json, README.md.")
@user_errors
def pull(model_uri, out_dir):
    """Pull a registered model and rebuild it as a timm model (sha256-verified, forward-checked).

    MODEL_URI: models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/checkpoints/last or a local
    checkpoint folder.
    """
    import tempfile

    store_first(model_uri)
    from vitreg.tracking.checkpoint_sources import pull as pull_model

    if out_dir:
        click.echo(pull_model(model_uri, out_dir=out_dir).describe())
        return
    with tempfile.TemporaryDirectory(prefix="vitreg-pull-") as tmp:  # a check only: nothing left behind
        described = pull_model(model_uri, dst=tmp).describe().splitlines()
    click.echo("\n".join(line if not line.startswith("  files:") else
                         "  files:   sha256 verified, then removed (--out DIR keeps a self-contained copy)"
                         for line in described))


@main.command()
@command_options("infer")
@user_errors
def infer(**values):
    """Benchmark a registered model's weights (task=infer by default) and link the run to its version."""
    check_first("infer", values)
    from vitreg.bench.job import infer as run_infer

    options, own = split_options("infer", values)
    with offline_if_asked("infer", own):
        run_infer(own["model_uri"], options, experiment=own["experiment"], run_name=own["run_name"],
                  command=command_line(click.get_current_context()))
