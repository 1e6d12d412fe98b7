"""``vitreg check``: a benchmark history gate. Exit 0 when no configuration x GPU regressed, 1 when one did,
2 on bad input (one line naming the fix, nothing written), 3 when nothing regressed but some series could not be
judged (too little history, or too noisy to see a 15 % change: its line says what it needs)."""

from __future__ import annotations

import sys

import click

from vitreg.cli.common import command_options, user_errors
from vitreg.config.options import option


def selection_of(window, candidate, candidate_tag, baseline_tag):
    """The check's :class:`~vitreg.history.series.Selection` from the command's text values."""
    from vitreg.history.series import Selection, parse_tag

    return Selection(window=option("check", "window").parse(window), candidate=(candidate or "").strip() or None,
                     candidate_tag=parse_tag(candidate_tag, "--candidate-tag"),
                     baseline_tag=parse_tag(baseline_tag, "--baseline-tag"))


@click.command()
@command_options("check")
@user_errors
def check(experiment, metric, log_experiment, window, candidate, candidate_tag, baseline_tag):
    """Check each configuration x GPU of an experiment against its own history: exit 1 on a regression
    beyond noise (printed with the runs compared, what changed and any throttling or busy host), 3 where the
    history is too short or too noisy to judge (saying what it needs), and log a check run with the series."""
    from vitreg.compare.check import run_check

    result = run_check(experiment, metric, selection_of(window, candidate, candidate_tag, baseline_tag),
                       log_experiment=log_experiment)
    sys.exit(result.exit_code)
