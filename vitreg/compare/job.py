"""The cross-GPU jobs: ``compare``, ``sweep`` and ``import-timm``.

Each reads or writes runs only through :mod:`vitreg.tracking.runs`; the statistics live in
:mod:`vitreg.analysis.comparison` and the parsing in :mod:`vitreg.analysis.timm_csv`, both pure.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vitreg.tracking import runs as tracking
from vitreg.console import progress
from vitreg.errors import VitregError


# ---------------------------------------------------------------- compare

def benchmark_runs(experiment: str):
    """The experiment's benchmark runs (bench, infer, train, timm imports), not its compare/sweep parents."""
    runs = tracking.search_runs(experiment)
    if "tags.vitreg_job" in runs:
        runs = runs[~runs["tags.vitreg_job"].isin(["compare", "sweep"])]
    return runs


def run_compare(experiment: str, baseline: str | None = None, metric: str = "throughput_img_per_s",
                run_name: str | None = None, log_experiment: str | None = None, progress=progress):
    """Compare the experiment's runs across GPUs; log the table and plots as artifacts of a compare run.

    The comparison is computed (and every input checked) before a run is opened, so a bad request
    leaves no half-written run behind.
    """
    from vitreg.analysis.comparison import compare_gpus, format_table, write_report

    tracking.check_server()
    runs = benchmark_runs(experiment)
    comparison = compare_gpus(runs, baseline=baseline or None, metric=metric)
    with tempfile.TemporaryDirectory(prefix="vitreg-compare-") as tmp:
        files = write_report(comparison, tmp)
        with tracking.tracked_run(run_name=run_name or f"compare-{experiment}", experiment=log_experiment,
                                  system_metrics=False) as run:
            run.set_tags({"vitreg_job": "compare", "compared_experiment": experiment})
            run.log_params({"experiment": experiment, "baseline": baseline or "", "metric": metric})
            summary = comparison.summary()
            metrics = {"n_runs": summary["n_runs"], "n_configurations": summary["n_configurations"]}
            metrics.update({f"speedup_geomean_{gpu}": v for gpu, v in summary["geomean_speedup"].items()})
            run.log_metrics(metrics)
            run.log_dict(summary, "comparison_summary.json")
            for f in files:
                run.log_artifact(f, "comparison")
    print(format_table(comparison))
    progress(f"compare run {run.run_id}: {len(files)} files under artifacts/comparison "
             f"({', '.join(Path(f).name for f in files)})")
    return comparison


# ---------------------------------------------------------------- import-timm

def import_timm(path: str, gpu: str | None = None, amp: str | None = None, experiment: str | None = None,
                progress=progress) -> list[str]:
    """Log each row of a timm ``benchmark.py`` CSV as a run tagged ``source=timm``; returns the run ids."""
    from vitreg.analysis.timm_csv import read_timm_csv

    if not Path(path).is_file():
        raise VitregError(f"{path}: no such file: pass the path of a timm benchmark.py results CSV")
    records = read_timm_csv(path, gpu, amp=amp)  # parsed and checked in full before anything is logged
    tracking.check_server()
    ids = []
    for rec in records:
        with tracking.tracked_run(run_name=rec.run_name, experiment=experiment, system_metrics=False) as run:
            run.log_params(rec.params)
            run.set_tags({**rec.tags, "vitreg_job": "import-timm"})
            run.log_metrics(rec.metrics)
            ids.append(run.run_id)
    progress(f"imported {len(ids)} run(s) from {Path(path).name} at {tracking.tracking_uri()}")
    return ids


# ---------------------------------------------------------------- sweep

SWEEP_LISTS = ("models", "amp", "compile", "batch_size")


@dataclass(frozen=True)
class Combination:
    model: str
    amp: str
    compile: str
    batch_size: int

    def label(self) -> str:
        return f"{self.model}-{self.amp}-{self.compile}-bs{self.batch_size}"


def _split(value: str, name: str) -> list[str]:
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    if not items:
        raise VitregError(f"{name} is empty: pass a comma-separated list, e.g. {name}=off,bf16")
    return items


def plan_sweep(models: str, amp: str, compile: str, batch_size: str, common: dict) -> list[Combination]:
    """Every combination, each validated as a BenchSpec before anything runs."""
    from vitreg.models.factory import check_model_name
    from vitreg.config.spec import BenchSpec

    combos = []
    for m, a, c, b in itertools.product(_split(models, "models"), _split(amp, "amp"), _split(compile, "compile"),
                                        _split(batch_size, "batch_size")):
        spec = BenchSpec.from_options({**common, "model": m, "amp": a, "compile": c, "batch_size": b})
        combos.append(Combination(spec.model, spec.amp, spec.compile, spec.batch_size))
    for m in dict.fromkeys(c.model for c in combos):
        check_model_name(m)
    return list(dict.fromkeys(combos))


def decay_batch(batch_size: int) -> int:
    """The next smaller batch after an OOM, timm's way (256 -> 192 -> 128 -> 96 -> 64 ...); 0 below 2."""
    from timm.utils import decay_batch_step

    return decay_batch_step(batch_size)


def _child_command(combo: Combination, batch_size: int, common: dict) -> list[str]:
    args = [sys.executable, "-m", "vitreg.cli", "bench"]
    options = {**common, "model": combo.model, "amp": combo.amp, "compile": combo.compile, "batch_size": batch_size}
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def run_sweep(models: str, amp: str = "auto", compile: str = "off", batch_size: str = "64",
              common: dict | None = None, experiment: str | None = None, max_oom_retries: int = 3,
              progress=progress) -> dict:
    """Run every combination as a child run of one parent run, each in its own process.

    A child that fails is recorded FAILED with its reason and the sweep goes on; a child that ran
    out of GPU memory is retried with a smaller batch (``decay_batch``), the batch it used is its
    ``batch_size`` param and the one asked for is its ``requested_batch_size`` tag. The parent logs
    the comparison table of its children.
    """
    common = dict(common or {})
    combos = plan_sweep(models, amp, compile, batch_size, common)
    tracking.check_server()
    outcome = {"finished": [], "failed": []}
    with tracking.tracked_run(run_name=f"sweep-{len(combos)}", experiment=experiment, system_metrics=False) as parent:
        parent.set_tags({"vitreg_job": "sweep"})
        parent.log_params({"models": models, "amp_list": amp, "compile_list": compile, "batch_size_list": batch_size,
                           "n_combinations": len(combos)})
        for i, combo in enumerate(combos, 1):
            bs = combo.batch_size
            for attempt in range(max_oom_retries + 1):
                progress(f"sweep {i}/{len(combos)}: {combo.label()} (batch {bs})")
                child_id = tracking.create_child_run(parent, f"{combo.label()}" + (f"-retry{attempt}" if attempt else ""),
                                                     {"requested_batch_size": combo.batch_size, "sweep_index": i})
                env = {**os.environ, "MLFLOW_RUN_ID": child_id, "MLFLOW_EXPERIMENT_ID": parent.experiment_id}
                proc = subprocess.run(_child_command(combo, bs, common), env=env, capture_output=True, text=True)
                sys.stdout.write(proc.stdout)
                reason = tracking.finish_child_run(child_id, proc.returncode, proc.stderr)
                if proc.returncode == 0:
                    outcome["finished"].append(child_id)
                    break
                progress(f"sweep {i}/{len(combos)}: FAILED: {reason}")
                outcome["failed"].append(child_id)
                smaller = decay_batch(bs)
                if "out of GPU memory" not in reason or smaller < 1 or attempt == max_oom_retries:
                    break
                progress(f"out of memory at batch {bs}: retrying with batch {smaller}")
                bs = smaller
        parent.log_metrics({"n_finished": len(outcome["finished"]), "n_failed": len(outcome["failed"])})
        children = tracking.child_runs(parent)
        if len(outcome["finished"]):
            from vitreg.analysis.comparison import compare_gpus, format_table, write_report

            comparison = compare_gpus(children, baseline=None)
            with tempfile.TemporaryDirectory(prefix="vitreg-sweep-") as tmp:
                for f in write_report(comparison, tmp):
                    parent.log_artifact(f, "comparison")
            print(format_table(comparison))
    progress(f"sweep {parent.run_id}: {len(outcome['finished'])} finished, {len(outcome['failed'])} failed")
    return outcome
