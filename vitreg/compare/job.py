"""The comparison jobs: ``compare`` and ``import-timm``.

Each reads runs through :mod:`vitreg.tracking.search` (MLflow's frame -> the tidy frame) and writes
them through :mod:`vitreg.tracking.runs`; the statistics live in :mod:`vitreg.analysis` and the
parsing in :mod:`vitreg.analysis.timm_csv`, all pure.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from vitreg.tracking import naming, runs as tracking
from vitreg.console import progress
from vitreg.errors import VitregError


# ---------------------------------------------------------------- compare

def run_compare(experiment: str, baseline: str | None = None, metric: str = "throughput_img_per_s",
                run_name: str | None = None, log_experiment: str | None = None, by: str = "gpu",
                include_mismatch: bool = False, prices: str = ""):
    """Compare the experiment's runs along ``by`` (across GPUs by default); log the table and plots as
    artifacts of a compare run.

    The compare run goes into the compared experiment itself, beside the runs it read, unless
    ``log_experiment`` names another (under ``mlflow run`` it is the run ``mlflow run`` opened, in the
    experiment that chose). The comparison is computed (and every input checked) before a run is
    opened, so a bad request leaves no half-written run behind. ``prices`` (LABEL=USD pairs or a price
    file, :mod:`vitreg.analysis.cost`) adds the cost per image; given, it is kept in the experiment's
    ``vitreg_prices`` tag, and left empty, that tag's prices are used.
    """
    from vitreg.analysis.comparison import compare_runs
    from vitreg.analysis.cost import energy_and_cost, parse_prices, with_costs
    from vitreg.analysis.render import format_table
    from vitreg.analysis.report import write_report
    from vitreg.tracking.search import benchmark_runs, tidy

    tracking.check_server()
    price_table = parse_prices(prices or tracking.experiment_tag(experiment, PRICES_TAG) or "")
    runs = with_costs(tidy(benchmark_runs(experiment), axes=(by,)), price_table)
    comparison = compare_runs(runs, baseline=baseline or None, metric=metric, by=by,
                              include_mismatch=include_mismatch)
    extra = energy_and_cost(runs, price_table, comparison.baseline, by, include_mismatch)
    table = "\n".join([format_table(comparison), "", *_energy_and_cost_text(extra)])
    with tempfile.TemporaryDirectory(prefix="vitreg-compare-") as tmp:
        files = write_report(comparison, tmp) + _extra_reports(extra, Path(tmp), write_report)
        with tracking.tracked_run(run_name=run_name, experiment=log_experiment or experiment,
                                  system_metrics=False) as run:
            # named and described here, also under `mlflow run`, whose run arrives with a random name
            run.set_name(run_name or naming.compare_run_name(experiment, comparison.summary()))
            run.set_note(naming.compare_note(experiment, comparison.summary(), table))
            _log_comparison(run, comparison, experiment, files, Path(tmp))
        if prices:
            tracking.set_experiment_tag(experiment, PRICES_TAG, price_text_of(price_table))
    print(table)
    progress(f"compare run {run.run_id} (experiment {logged_into(run, log_experiment or experiment)!r}, "
             f"id {run.experiment_id}): {len(files)} files under artifacts/comparison "
             f"({', '.join(Path(f).name for f in files)})")
    return comparison


PRICES_TAG = "vitreg_prices"  # the experiment's price table, LABEL=USD_PER_GPU_HOUR pairs: shared by the team


def price_text_of(prices: dict) -> str:
    from vitreg.analysis.cost import price_text

    return price_text(prices)


def _energy_and_cost_text(extra) -> list[str]:
    """The energy and cost block under the main table: the conditions, each comparison's table, its sentences."""
    from vitreg.analysis.render import format_table

    lines = ["energy and cost (vitreg.analysis.cost):"] if extra.comparisons else []
    for comparison in extra.comparisons.values():
        lines += [format_table(comparison), ""]
    return lines + [f"- {line}" for line in extra.lines]


def _extra_reports(extra, tmp: Path, write_report) -> list[Path]:
    """The report of each energy or cost comparison (its table, CSV and chart) under energy_and_cost/<metric>/,
    and energy_and_cost/summary.md with the sentences."""
    files = []
    for metric, comparison in extra.comparisons.items():
        files += write_report(comparison, tmp / "energy_and_cost" / metric)
    if extra.lines:
        summary = tmp / "energy_and_cost" / "summary.md"
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text("# Energy and cost\n\n" + "".join(f"- {line}\n" for line in extra.lines))
        files.append(summary)
    return files


def logged_into(run, asked: str) -> str:
    """The experiment the compare run really went to: under ``mlflow run`` the one ``mlflow run`` chose
    (its --experiment-name, else Default), whatever ``experiment=`` named as the runs to compare."""
    return getattr(run, "experiment_name", None) or asked


def _log_comparison(run, comparison, experiment: str, files, root: Path) -> None:
    run.set_tags({"vitreg_job": "compare", "compared_experiment": experiment, "compared_by": comparison.by})
    run.log_params({"experiment": experiment, "baseline": comparison.baseline or "", "metric": comparison.metric,
                    "by": comparison.by, "include_mismatch": str(comparison.include_mismatch).lower()})
    summary = comparison.summary()
    metrics = {"n_runs": summary["n_runs"], "n_configurations": summary["n_configurations"],
               "n_mislabelled_runs": summary["n_mislabelled_runs"]}
    metrics.update({f"speedup_geomean_{value}": v for value, v in summary["geomean_speedup"].items()})
    run.log_metrics(metrics)
    run.log_dict(summary, "comparison_summary.json")
    for f in files:  # the energy and cost reports keep their folders (comparison/energy_and_cost/<metric>/)
        run.log_artifact(f, (Path("comparison") / Path(f).parent.relative_to(root)).as_posix())


# ---------------------------------------------------------------- import-timm

def import_timm(path: str, gpu: str | None = None, amp: str | None = None, experiment: str | None = None,
                progress=progress) -> list[str]:
    """Log each row of a timm ``benchmark.py`` CSV as a run tagged ``source=timm``; returns the run ids."""
    from vitreg.analysis.timm_csv import read_timm_csv

    if not Path(path).is_file():
        raise VitregError(f"{path}: no such file: pass the path of a timm benchmark.py results CSV")
    records = read_timm_csv(path, gpu, amp=amp)  # parsed and checked in full before anything is logged
    tracking.check_server()
    ids, experiment_name = [], experiment
    for rec in records:
        with tracking.tracked_run(run_name=rec.run_name, experiment=experiment, system_metrics=False) as run:
            run.log_params(rec.params)
            run.set_tags({**rec.tags, "vitreg_job": "import-timm"})
            run.log_metrics(rec.metrics)
            ids.append(run.run_id)
            experiment_name = logged_into(run, experiment or "Default")
    progress(f"imported {len(ids)} run(s) from {Path(path).name} into experiment {experiment_name!r} at "
             f"{tracking.tracking_uri()}")
    return ids
