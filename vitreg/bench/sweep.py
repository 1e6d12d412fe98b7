"""The ``sweep`` job: every combination of models x amp x compile x batch size, each a child run of one
parent run, each in its own process; the parent logs the comparison of its children."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from vitreg.config.options import options_to_args
from vitreg.tracking import runs as tracking
from vitreg.console import progress
from vitreg.errors import VitregError

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
    options = {**common, "model": combo.model, "amp": combo.amp, "compile": combo.compile, "batch_size": batch_size}
    return [sys.executable, "-m", "vitreg.cli", "bench", *options_to_args(options)]


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
                env = tracking.env_for_run(os.environ, child_id, parent.experiment_id)
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
            from vitreg.analysis.comparison import compare_gpus
            from vitreg.analysis.render import format_table
            from vitreg.analysis.report import write_report
            from vitreg.tracking.search import tidy

            comparison = compare_gpus(tidy(children), baseline=None)
            with tempfile.TemporaryDirectory(prefix="vitreg-sweep-") as tmp:
                for f in write_report(comparison, tmp):
                    parent.log_artifact(f, "comparison")
            print(format_table(comparison))
    progress(f"sweep {parent.run_id}: {len(outcome['finished'])} finished, {len(outcome['failed'])} failed")
    return outcome
