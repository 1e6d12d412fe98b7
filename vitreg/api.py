"""vitreg from Python: :func:`bench`, :func:`compare`, :func:`check` and :func:`runs`, each taking the options of
the command of the same name and returning what it computed; bad input raises the CLI's one-line
:class:`~vitreg.errors.VitregError`. Heavy imports happen inside the calls, so ``import vitreg`` stays cheap.

Kept apart: a boundary, the names and signatures users' code calls.
"""

from __future__ import annotations

import functools

from vitreg.console import masked_output
from vitreg.errors import VitregError


def _masked(fn):
    """``fn`` with no credential of the tracking URI in anything printed or logged while it runs (MLflow's warnings
    quote the URI with its password), nor in what it raises (a store failure becomes the CLI's one line)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with masked_output():
            try:
                return fn(*args, **kwargs)
            except VitregError:
                raise
            except Exception as exc:
                from vitreg.tracking.store import store_error_for

                error = store_error_for(exc)
                if error is None:
                    raise
                raise error from None  # MLflow's text names the URI, credentials and all

    return call


_BENCH_LAUNCHER = ("nnodes", "node_rank", "rdzv_endpoint", "baseline_run")  # bench()'s own keyword arguments


@_masked
def bench(*, experiment: str | None = None, run_name: str | None = None, **options):
    """Run one benchmark and log it as one MLflow run, as ``vitreg bench`` does; returns its BenchResult (None in
    the launching process of an ``nproc > 1`` job: its ranks log)."""
    from vitreg.bench.job import bench as run_bench
    from vitreg.cli.common import check_first, launcher_options
    from vitreg.config.options import option

    command = _call_text("bench", options)
    own = {name: options.pop(name, option("bench", name).default) for name in _BENCH_LAUNCHER}
    check_first("bench", {**options, **own})  # a typo refused as the CLI refuses it: before any run exists
    return run_bench(options, experiment=experiment, run_name=run_name, command=command,
                     **launcher_options("bench", own))


@_masked
def compare(experiment: str, baseline: str | None = None, metric: str = "throughput_img_per_s", by: str = "gpu",
            include_mismatch: bool = False, prices: str = "", **analysis):
    """The comparison ``vitreg compare`` prints, without logging a compare run; ``analysis`` goes to
    :func:`vitreg.analysis.comparison.compare_runs` (``n_boot``, ``seed``, ``confidence``), ``prices``
    ("h200=3.50,l4=0.80" or a price file) gives every run its ``usd_per_1m_img``."""
    from vitreg.analysis.comparison import compare_runs
    from vitreg.analysis.cost import parse_prices, with_costs
    from vitreg.tracking.store import check_server
    from vitreg.tracking.search import benchmark_runs, tidy

    check_server()  # as `vitreg compare`: a store that does not answer is said at once, not after MLflow's retries
    runs_frame = with_costs(tidy(benchmark_runs(experiment), axes=(by,)), parse_prices(prices))
    return compare_runs(runs_frame, baseline=baseline or None, metric=metric, by=by,
                        include_mismatch=include_mismatch, **analysis)


@_masked
def check(experiment: str, metric: str = "throughput_img_per_s", window: int = 10, candidate: str | None = None,
          candidate_tag: str | None = None, baseline_tag: str | None = None, seed: int = 0):
    """What ``vitreg check`` finds, without logging a check run: a :class:`~vitreg.history.check.CheckResult`
    (``table``, ``lines()``, ``exit_code``)."""
    from vitreg.compare import check as run, selection_of

    return run(experiment, metric, selection_of(window, candidate, candidate_tag, baseline_tag), seed=seed)[0]


@_masked
def runs(experiment: str):
    """The experiment's tidy frame, as ``vitreg runs --experiment NAME --csv`` writes it."""
    from vitreg.tracking.store import check_server
    from vitreg.tracking.search import benchmark_runs, tidy

    check_server()  # a store that does not answer is said at once, not after MLflow's retries (100 s for a SQL one)
    return tidy(benchmark_runs(experiment))


def _call_text(command: str, options: dict) -> str:
    return f"vitreg.api.{command}({', '.join(f'{k}={v!r}' for k, v in options.items())})"
