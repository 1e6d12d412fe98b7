"""The jobs that read an experiment's runs back and log what they found beside them: ``compare``, ``check``, and
``import-timm`` (timm's published numbers as runs to compare with). Every input is checked before a run is opened.
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
from pathlib import Path

from vitreg.config.options import option
from vitreg.console import progress
from vitreg.history.check import CheckError, Selection, parse_tag
from vitreg.tracking import naming, runs as tracking

TAG_LIMIT = 5000  # characters of a tag value (MLflow stores up to 8,000); the full lists are in runs_read.json
PRICES_TAG = "vitreg_prices"  # the experiment's price table, LABEL=USD_PER_GPU_HOUR pairs: shared by the team


# ---------------------------------------------------------------- compare

def run_compare(experiment: str, baseline: str | None = None, metric: str = "throughput_img_per_s",
                run_name: str | None = None, log_experiment: str | None = None, by: str = "gpu",
                include_mismatch: bool = False, prices: str = ""):
    """Compare the experiment's runs along ``by``; log the table and plots as artifacts of a compare run in
    ``<experiment>/analysis`` (or ``log_experiment``). ``prices`` is kept in the experiment's tag for the next
    compare; left empty, that tag's are used."""
    from vitreg.analysis.comparison import compare_runs
    from vitreg.analysis.cost import energy_and_cost, parse_prices, price_text, with_costs
    from vitreg.analysis.render import format_table
    from vitreg.analysis.report import write_report
    from vitreg.tracking.search import benchmark_runs, experiment_tag, set_experiment_tag, tidy

    tracking.check_server()
    price_table = parse_prices(prices or experiment_tag(experiment, PRICES_TAG) or "")
    runs = with_costs(tidy(benchmark_runs(experiment), axes=(by,)), price_table)
    comparison = compare_runs(runs, baseline=baseline or None, metric=metric, by=by,
                              include_mismatch=include_mismatch)
    extra = energy_and_cost(runs, price_table, comparison.baseline, by, include_mismatch)
    # under the main table: each energy and cost comparison's table, then what to say of them
    lines = [format_table(comparison), ""] + (["energy and cost (vitreg.analysis.cost):"] if extra.comparisons else [])
    lines += [line for each in extra.comparisons.values() for line in (format_table(each), "")]
    table = "\n".join(lines + [f"- {line}" for line in extra.lines])
    with tempfile.TemporaryDirectory(prefix="vitreg-compare-") as tmp:
        files = write_report(comparison, tmp) + _extra_reports(extra, Path(tmp), write_report)
        names = [str(Path(f).relative_to(tmp)) for f in files]  # energy_and_cost/<metric>/ holds the same names
        filed = log_experiment or naming.analysis_experiment(experiment)
        with tracking.tracked_run(run_name=run_name, experiment=filed, system_metrics=False) as run:
            # named and described here, also under `mlflow run`, whose run arrives with a random name
            run.set_name(run_name or naming.compare_run_name(experiment, comparison.summary()))
            run.set_note(note := naming.compare_note(experiment, comparison.summary(), table))
            _log_comparison(run, comparison, experiment, files, Path(tmp))
        # the experiment's description, what its page shows first: the UI answers "which GPU?" with no set-up
        set_experiment_tag(experiment, naming.NOTE_TAG, f"{note}\n\nAs of compare run {run.run_id} "
                           f"(experiment `{logged_into(run, filed)}`); `vitreg compare` renews it.")
        if prices:
            set_experiment_tag(experiment, PRICES_TAG, price_text(price_table))
    print(table)
    progress(f"compare run {run.run_id} (experiment {logged_into(run, filed)!r}, id {run.experiment_id}): "
             f"{len(files)} files in {tracking.artifacts_at(run, 'comparison')} "
             f"({', '.join(names)})")
    progress(tracking.where_logged(run))  # its page in the UI
    return comparison


def _extra_reports(extra, tmp: Path, write_report) -> list[Path]:
    """Each energy or cost comparison's report under energy_and_cost/<metric>/, the sentences in its summary.md."""
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
    """The experiment the run really went to (under ``mlflow run``: the one ``mlflow run`` chose)."""
    return getattr(run, "experiment_name", None) or asked


def _log_comparison(run, comparison, experiment: str, files, root: Path) -> None:
    run.set_tags({"vitreg_job": "compare", "compared_experiment": experiment, "compared_by": comparison.by,
                  "gpu": ",".join(comparison.gpus)})  # the GPUs compared, as `vitreg runs` shows them
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
    from vitreg.analysis.timm_benchmark import read_timm_csv

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


# ---------------------------------------------------------------- check

def selection_of(window, candidate, candidate_tag, baseline_tag) -> Selection:
    return Selection(window=option("check", "window").parse(window), candidate=(candidate or "").strip() or None,
                     candidate_tag=parse_tag(candidate_tag, "--candidate-tag"),
                     baseline_tag=parse_tag(baseline_tag, "--baseline-tag"))


def check(experiment: str, metric: str = "throughput_img_per_s", selection: Selection = Selection(), seed: int = 0):
    from vitreg.history.check import carried_columns, check_runs
    from vitreg.tracking.search import benchmark_runs, tidy

    tracking.check_server()
    with collector_paused():
        raw = benchmark_runs(experiment)
        if selection.candidate:
            _require_finished(raw, selection.candidate, experiment)
        return check_runs(tidy(raw, axes=carried_columns(selection)), metric, selection, seed=seed), raw


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block: each collection walks every object of the process,
    and MLflow's search makes many (400 runs read in 5.3 s with it on, 1.9 s off: benchmarks/check_scale.py)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def run_check(experiment: str, metric: str = "throughput_img_per_s", selection: Selection = Selection(),
              log_experiment: str | None = None, run_name: str | None = None, progress=progress):
    """Check the experiment's runs, print one line per series (regressions first), log the check run."""
    from vitreg.history.check import about, write_check

    result, raw = check(experiment, metric, selection)
    experiment_id = str(raw["experiment_id"].iloc[0])
    filed = log_experiment or naming.analysis_experiment(experiment)
    outcome = _outcome(result)
    with tempfile.TemporaryDirectory(prefix="vitreg-check-") as tmp:
        with collector_paused():  # the charts too: each figure is thousands of objects
            files = write_check(result, tmp)
        with tracking.tracked_run(run_name=run_name, experiment=filed, system_metrics=False) as run:
            # named here, also under `mlflow run`, whose run arrives with a random name
            run.set_name(run_name or naming.check_run_name(experiment, outcome))
            _log_check(run, result, experiment, files)
            verdicts = [_linked(r, experiment_id) for _, r in result.ordered().iterrows()]
            run.set_note("\n\n".join(about(result) + verdicts))
    for line in result.lines():
        print(line)
    progress(f"check run {run.run_id} (experiment {logged_into(run, filed)!r}): "
             f"{len(result.regressions)} regressed of {len(result.table)} series; artifacts under check/")
    return result


def _log_check(run, result, experiment: str, files: list[Path]) -> None:
    sel, counts = result.selection, result.counts()
    read = result.run_ids()
    candidates = list(dict.fromkeys(i for ids in result.table["candidate_runs"] for i in ids.split(",")))
    run.set_tags({"vitreg_job": "check", "checked_experiment": experiment,
                  "check_result": _outcome(result),
                  "check_candidate_runs": _capped(",".join(candidates)),
                  "check_regressed_runs": _capped(",".join(result.regressions["candidate_runs"])),
                  "check_runs_read": _capped(",".join(read))})
    run.log_params({"experiment": experiment, "metric": result.metric, "window": sel.window,
                    "candidate": sel.candidate or "", "candidate_tag": "=".join(sel.candidate_tag or ()),
                    "baseline_tag": "=".join(sel.baseline_tag or ())})
    run.log_metrics({"n_series": len(result.table), "n_runs_read": len(read),
                     "n_mislabelled_rows": result.n_mislabelled,
                     **{f"n_{verdict.replace(' ', '_')}": n for verdict, n in counts.items()}})
    run.log_dict({"runs_read": read, "candidate_runs": candidates}, "check/runs_read.json")
    for f in files:
        run.log_artifact(f, "check" if f.parent.name != "series" else "check/series")


def _outcome(result) -> str:
    return {1: "regressed", 3: "cannot judge"}.get(result.exit_code, "ok")


def _require_finished(raw, run_id: str, experiment: str) -> None:
    match = raw[raw["run_id"] == run_id] if "run_id" in raw else raw.iloc[0:0]
    if match.empty:
        raise CheckError(f"--candidate {run_id}: no such benchmark run in experiment {experiment!r}: pass the "
                         "id of one of its runs (vitreg runs --experiment NAME lists them)")
    status = str(match["status"].iloc[0])
    if status != "FINISHED":
        raise CheckError(f"--candidate {run_id} is {status}, not FINISHED: only finished runs have figures to "
                         "check; re-run the benchmark or pass a finished run")


def _linked(row, experiment_id: str) -> str:
    """A verdict line with a link to its candidate run in the MLflow UI (the note is markdown)."""
    from vitreg.history.check import verdict_line

    run_id = row["candidate_runs"].split(",")[0]
    return f"- {verdict_line(row)} ([candidate]({naming.runs_page(experiment_id, run_id)}))"


def _capped(text: str) -> str:
    return text if len(text) <= TAG_LIMIT else text[:TAG_LIMIT - 40] + "... (+ more: check/runs_read.json)"
