"""``vitreg train``: the click command (registered on the ``vitreg`` group with ``main.add_command(train)``).

Its options are the option table's ``train`` entries (:mod:`vitreg.config.options`): one per
:class:`~vitreg.config.spec.TrainSpec` field, as strings that TrainSpec parses, plus the run's and the
launcher's own.
"""

from __future__ import annotations

import click

from vitreg.cli.common import command_options, run_ddp_job, user_errors


@click.command("train")
@command_options("train")
@user_errors
def train(**values):
    """Train a ViT/DeiT (synthetic data or an ImageFolder), log curves and checkpoints to one MLflow run."""
    from vitreg.train.job import train as run_train

    run_ddp_job("train", run_train, values)
