"""What every ``vitreg`` subcommand module shares: one-line user errors, the bench defaults and the
multi-host options of the DDP jobs (bench, train).

A module of its own so that :mod:`vitreg.cli` and the command modules it registers
(:mod:`vitreg.cli.registry_cmds`, :mod:`vitreg.cli.train_cmd`) import it without importing each other.
"""

from __future__ import annotations

import functools
import sys

import click

from vitreg.errors import VitregError
from vitreg.config.spec import BenchSpec


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
            from vitreg.dist.diagnose import record_error
            from vitreg.tracking import runs as tracking

            tracking.fail_requested_run(str(exc))
            record_error(str(exc), exc.exit_code)  # in a torchrun worker: the launcher's root cause
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def host_options(fn):
    """``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``: where this host sits in a multi-host DDP job.
    Not spec fields: the launcher uses them and does not forward them to the ranks. Both spellings
    (``--node-rank``/``--node_rank``), as ``mlflow run`` appends undeclared ``-P k=v`` as ``--k v``."""
    opts = [
        click.option("--nnodes", default="1", show_default=True,
                     help="hosts in a multi-host DDP job: the same command on each, with its --node-rank and one "
                          "--rdzv-endpoint."),
        click.option("--node-rank", "--node_rank", "node_rank", default="0", show_default=True,
                     help="this host's index, 0..nnodes-1; node 0 holds rank 0, which logs the MLflow run."),
        click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", default="",
                     help="HOST:PORT on node 0 that every host can reach (nnodes>1)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def host_kwargs(nnodes: str, node_rank: str, rdzv_endpoint: str) -> dict:
    """:func:`host_options`' strings, parsed, as keyword arguments of ``bench()`` and ``train()``."""
    from vitreg.config.spec import parse_int

    return {"nnodes": parse_int(nnodes, "nnodes", 1), "node_rank": parse_int(node_rank, "node_rank", 0),
            "rdzv_endpoint": rdzv_endpoint.strip() or None}
