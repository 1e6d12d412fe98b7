"""``vitreg pull`` and ``vitreg infer``: thin click shells over :mod:`vitreg.tracking.model_registry` and :mod:`vitreg.bench.infer`.

Registered in :mod:`vitreg.cli` with ``main.add_command(pull)`` / ``main.add_command(infer)``; the
one-line-error handling and infer's options (from the option table) come from :mod:`vitreg.cli.common`.
"""

from __future__ import annotations

import click

from vitreg.cli.common import command_options, offline_if_asked, split_options, user_errors
from vitreg.cli.invocation import command_line


@click.command()
@click.argument("checkpoint_uri")
@click.option("--name", required=True, help="Registered model name (created if new; its versions must be the same architecture).")
@click.option("--alias", default="latest", show_default=True,
              help="Alias to move to the new version (latest: none set; MLflow resolves @latest to the newest).")
@user_errors
def register(checkpoint_uri, name, alias):
    """Register a run's checkpoint (runs:/<run_id>/checkpoints/last) as a new model version."""
    from vitreg.tracking.model_registry import register_run_checkpoint

    mv = register_run_checkpoint(checkpoint_uri, name, alias)
    click.echo(f"registered models:/{mv.name}/{mv.version}" + (f" (@{alias})" if alias.lower() != "latest" else "")
               + f" from run {mv.run_id}")


@click.command()
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

    from vitreg.tracking.checkpoint_sources import pull as pull_model

    if out_dir:
        click.echo(pull_model(model_uri, out_dir=out_dir).describe())
        return
    with tempfile.TemporaryDirectory(prefix="vitreg-pull-") as tmp:  # a check only: nothing left behind
        described = pull_model(model_uri, dst=tmp).describe().splitlines()
    click.echo("\n".join(line if not line.startswith("  files:") else
                         "  files:   sha256 verified, then removed (--out DIR keeps a self-contained copy)"
                         for line in described))


@click.command()
@command_options("infer")
@user_errors
def infer(**values):
    """Benchmark a registered model's weights (task=infer by default) and link the run to its version."""
    from vitreg.bench.infer import infer as run_infer

    options, own = split_options("infer", values)
    with offline_if_asked("infer", own):
        run_infer(own["model_uri"], options, experiment=own["experiment"], run_name=own["run_name"],
                  command=command_line(click.get_current_context()))
