"""``vitreg train``: the click command (registered on the ``vitreg`` group with ``main.add_command(train)``).

Its options are the option table's ``train`` entries (:mod:`vitreg.config.options`): one per
:class:`~vitreg.config.spec.TrainSpec` field, as strings that TrainSpec parses, plus the run's and the
launcher's own.
"""

from __future__ import annotations

import click

from vitreg.cli.common import command_options, launcher_options, offline_if_asked, split_options, user_errors
from vitreg.cli.invocation import command_line


@click.command("train")
@command_options("train")
@user_errors
def train(**values):
    """Train a ViT/DeiT (synthetic data or an ImageFolder), log curves and checkpoints to one MLflow run."""
    from vitreg.train.job import train as run_train

    options, own = split_options("train", values)  # options: forwarded to the torchrun ranks, checked by TrainSpec
    with offline_if_asked("train", own):
        run_train(options, experiment=own["experiment"], run_name=own["run_name"], **launcher_options("train", own),
                  command=command_line(click.get_current_context()))
