"""The ``vitreg`` command (click). Every subcommand is a thin shell over a library call.

Errors the user can fix (:class:`VitregError`) print one line, ``error: ...``, and exit 2; the
MLflow run, if one was opened, has already been marked FAILED by the tracking layer.
"""

from __future__ import annotations

import sys

import click

import vitreg
from vitreg import signals
from vitreg.cli.common import OneSpelling, command_options, run_ddp_job, split_options, user_errors
from vitreg.cli.param_types import ChoiceText, GpuLabel
from vitreg.config.options import option
from vitreg.errors import VitregError
from vitreg.console import quiet_libraries
from vitreg.tracking.delivery import bound_http_requests
from vitreg.tracking.quiet import quiet_artifact_downloads, quiet_mlflow_info


@click.group()
@click.version_option(package_name="vitreg")
def main():
    """vitreg: ViT/DeiT benchmarks with compile/AMP/DDP, tracked in MLflow."""
    vitreg.freeze_at_exit()
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
    from vitreg.bench.job import bench as run_bench

    run_ddp_job("bench", run_bench, values)


@main.command()
@command_options("compare")
@user_errors
def compare(experiment, baseline, metric, log_experiment, by, include_mismatch, prices):
    """Compare an experiment's runs across GPUs (or --by another axis): table, CSV/HTML/markdown and plots as
    artifacts of a compare run, logged beside the runs compared; with --prices, $ per 1M images too."""
    from vitreg.compare.job import run_compare

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
    from vitreg.compare.job import import_timm as do_import

    do_import(csv_file, gpu, amp, experiment)


@main.command()
@command_options("sweep")
@user_errors
def sweep(**values):
    """Run every combination of models x amp x compile x batch size (and each --axis) as child runs of one
    parent run, on this host's GPUs or (engine=ray) a Ray cluster's."""
    from vitreg.bench.sweep import run_sweep

    common, own = split_options("sweep", values)  # common: the same for every combination
    outcome = run_sweep(own, common=common)
    if not outcome["finished"]:
        raise VitregError(f"all {len(outcome['failed'])} sweep runs failed: see the vitreg_error tags of the child runs")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def server(ctx):
    """Start the tracking server from tracking/ (VITREG_SERVER_* variables; see tracking/README.md)."""
    from vitreg.deploy.server import main as server_main

    sys.exit(server_main(ctx.args))


from vitreg.cli.registry_cmds import infer as infer_command, pull as pull_command, register as register_command  # noqa: E402,E501

from vitreg.cli.check_cmd import check as check_command  # noqa: E402
from vitreg.cli.runs_cmds import runs as runs_command, sync as sync_command  # noqa: E402
from vitreg.cli.train_cmd import train as train_command  # noqa: E402

main.add_command(pull_command)
main.add_command(register_command)
main.add_command(infer_command)
main.add_command(train_command)
main.add_command(runs_command)
main.add_command(sync_command)
main.add_command(check_command)

if __name__ == "__main__":  # pragma: no cover
    main()
