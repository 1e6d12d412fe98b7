"""What every ``vitreg`` subcommand module shares: one-line user errors and the bench defaults.

A module of its own so that :mod:`vitreg.cli` and the command modules it registers
(:mod:`vitreg.commands_registry`, :mod:`vitreg.commands_train`) import it without importing each other.
"""

from __future__ import annotations

import functools
import sys

import click

from vitreg.errors import VitregError
from vitreg.spec import BenchSpec


def bench_default(name: str):
    """BenchSpec's default for ``name`` (the click options show the same defaults as the spec)."""
    return BenchSpec.__dataclass_fields__[name].default


def user_errors(fn):
    """Turn VitregError into a one-line message and exit 2 (no traceback), everywhere in the CLI;
    the MLflow run the command was asked to log into (``mlflow run``'s) is marked FAILED."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except VitregError as exc:
            from vitreg import tracking

            tracking.fail_requested_run(str(exc))
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper
