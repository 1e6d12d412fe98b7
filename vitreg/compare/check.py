"""The ``check`` job: read an experiment's runs through :mod:`vitreg.tracking`, check each configuration x
GPU against its history (:mod:`vitreg.history`, pure), and log a check run beside them: the summary
(markdown, HTML, CSV) and one chart per series as artifacts, the verdicts as its note, and tags naming the
runs it read. Every input is checked before the run is opened: a bad request writes nothing.
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
from pathlib import Path

from vitreg.console import progress
from vitreg.history.series import CheckError, Selection
from vitreg.tracking import runs as tracking

TAG_LIMIT = 5000  # characters of a tag value (MLflow stores up to 8,000); the full lists are in runs_read.json


def check(experiment: str, metric: str = "throughput_img_per_s", selection: Selection = Selection(), seed: int = 0):
    """The :class:`~vitreg.history.check.CheckResult` of the experiment's runs, logging nothing."""
    from vitreg.history.check import check_runs
    from vitreg.history.series import carried_columns
    from vitreg.tracking.search import benchmark_runs, tidy

    tracking.check_server()
    with collector_paused():
        raw = benchmark_runs(experiment)
        if selection.candidate:
            _require_finished(raw, selection.candidate, experiment)
        return check_runs(tidy(raw, axes=carried_columns(selection)), metric, selection, seed=seed), raw


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block, as it was after. MLflow's search builds a few
    objects per param, tag and metric of every run, and each full collection walks every object of the
    process (~300,000 after importing mlflow and pandas): with it on, 400 runs took 5.3 s to read, off 1.9 s
    (benchmarks/check_scale.py's runs, profiled). What the block allocates is freed by reference counting
    or at the next collection."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def run_check(experiment: str, metric: str = "throughput_img_per_s", selection: Selection = Selection(),
              log_experiment: str | None = None, run_name: str | None = None, progress=progress):
    """Check the experiment's runs, print one line per series (regressions first), log the check run;
    returns the result (its ``exit_code``: 0 nothing regressed, 1 something did, 3 some series could not be
    judged: too little or too noisy a history, each line saying what it needs)."""
    from vitreg.history.report import about, write_check

    result, raw = check(experiment, metric, selection)
    experiment_id = str(raw["experiment_id"].iloc[0])
    with tempfile.TemporaryDirectory(prefix="vitreg-check-") as tmp:
        with collector_paused():  # the charts too: each figure is thousands of objects
            files = write_check(result, tmp)
        with tracking.tracked_run(run_name=run_name or f"check-{experiment}", experiment=log_experiment or experiment,
                                  system_metrics=False) as run:
            _log_check(run, result, experiment, files)
            verdicts = [_linked(r, experiment_id) for _, r in result.ordered().iterrows()]
            run.set_note("\n\n".join(about(result) + verdicts))
    for line in result.lines():
        print(line)
    progress(f"check run {run.run_id} (experiment {log_experiment or experiment!r}): "
             f"{len(result.regressions)} regressed of {len(result.table)} series; artifacts under check/")
    return result


def _log_check(run, result, experiment: str, files: list[Path]) -> None:
    sel, counts = result.selection, result.counts()
    read = result.run_ids()
    candidates = list(dict.fromkeys(i for ids in result.table["candidate_runs"] for i in ids.split(",")))
    run.set_tags({"vitreg_job": "check", "checked_experiment": experiment,
                  "check_result": {1: "regressed", 3: "cannot judge"}.get(result.exit_code, "ok"),
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


def _require_finished(raw, run_id: str, experiment: str) -> None:
    """CheckError unless ``run_id`` is a FINISHED benchmark run of the experiment."""
    match = raw[raw["run_id"] == run_id] if "run_id" in raw else raw.iloc[0:0]
    if match.empty:
        raise CheckError(f"--candidate {run_id}: no such benchmark run in experiment {experiment!r}: pass the "
                         "id of one of its runs (vitreg runs --experiment NAME lists them)")
    status = str(match["status"].iloc[0])
    if status != "FINISHED":
        raise CheckError(f"--candidate {run_id} is {status}, not FINISHED: only finished runs have figures to "
                         "check; re-run the benchmark or pass a finished run")


def _linked(row, experiment_id: str) -> str:
    """A verdict line with a link to its candidate run in the MLflow UI (the note is rendered as markdown)."""
    from vitreg.history.check import verdict_line

    run_id = row["candidate_runs"].split(",")[0]
    return f"- {verdict_line(row)} ([candidate](#/experiments/{experiment_id}/runs/{run_id}))"


def _capped(text: str) -> str:
    return text if len(text) <= TAG_LIMIT else text[:TAG_LIMIT - 40] + "... (+ more: check/runs_read.json)"
