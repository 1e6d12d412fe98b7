"""The ``sweep`` job: every combination of models x amp x compile x batch size, each a child run of one
parent run, each in its own process; the parent logs the comparison of its children."""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from vitreg.config.options import options_to_args
from vitreg.tracking import runs as tracking
from vitreg.tracking.spool import offline_mode
from vitreg.console import progress
from vitreg.config.options import AUTO_BATCH
from vitreg.errors import OutOfMemory, VitregError

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
    out of GPU memory (its run's ``vitreg_error_kind`` tag is ``OutOfMemory``) is retried with a
    smaller batch (``decay_batch``), the batch it used is its ``batch_size`` param and the one asked
    for is its ``requested_batch_size`` tag. The parent logs the comparison table of its children.
    """
    common = dict(common or {})
    combos = plan_sweep(models, amp, compile, batch_size, common)
    if offline_mode():
        raise VitregError("sweep needs the tracking store (its runs are child runs of one parent run there): "
                          "unset VITREG_OFFLINE, or run `vitreg bench --offline true` once per combination")
    tracking.check_server()
    outcome = {"finished": [], "failed": []}
    with tracking.tracked_run(run_name=f"sweep-{len(combos)}", experiment=experiment, system_metrics=False) as parent:
        parent.set_tags({"vitreg_job": "sweep"})
        parent.log_params({"models": models, "amp_list": amp, "compile_list": compile, "batch_size_list": batch_size,
                           "n_combinations": len(combos)})
        for i, combo in enumerate(combos, 1):
            _run_combination(parent, combo, f"sweep {i}/{len(combos)}", i, common, max_oom_retries, outcome,
                             progress)
        parent.log_metrics({"n_finished": len(outcome["finished"]), "n_failed": len(outcome["failed"])})
        if outcome["finished"]:
            _log_comparison(parent)
    progress(f"sweep {parent.run_id}: {len(outcome['finished'])} finished, {len(outcome['failed'])} failed")
    return outcome


def _run_combination(parent, combo: Combination, label: str, index: int, common: dict, max_oom_retries: int,
                     outcome: dict, progress) -> None:
    """One combination: a child run, and a retry with a smaller batch after each out-of-memory failure."""
    bs = combo.batch_size
    for attempt in range(max_oom_retries + 1):
        progress(f"{label}: {combo.label()} (batch {bs})")
        child_id = tracking.create_child_run(parent, f"{combo.label()}" + (f"-retry{attempt}" if attempt else ""),
                                             {"requested_batch_size": combo.batch_size, "sweep_index": index})
        env = tracking.env_for_run(os.environ, child_id, parent.experiment_id)
        returncode, stderr_tail = _run_child(_child_command(combo, bs, common), env, label, progress)
        reason = tracking.finish_child_run(child_id, returncode, stderr_tail)
        if returncode == 0:
            outcome["finished"].append(child_id)
            return
        progress(f"{label}: FAILED: {reason}")
        outcome["failed"].append(child_id)
        if bs == AUTO_BATCH or not _ran_out_of_memory(child_id) or attempt == max_oom_retries:
            return  # batch_size=auto backs off inside the child already
        smaller = decay_batch(bs)
        if smaller < 1:
            return
        progress(f"out of memory at batch {bs}: retrying with batch {smaller}")
        bs = smaller


def _run_child(cmd: list[str], env: dict, label: str, progress) -> tuple[int, str]:
    """Run one child bench; its progress lines show as they come, prefixed with the sweep's position
    (``sweep 2/4: infer: window 3/5: ...``), its results table as it prints it. Returns its exit status
    and the tail of its stderr (where its one-line error is)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    relay = threading.Thread(target=lambda: sys.stdout.writelines(proc.stdout), daemon=True)
    relay.start()
    tail: collections.deque = collections.deque(maxlen=40)
    for line in proc.stderr:
        tail.append(line)
        if line.strip():
            progress(f"{label}: {line.rstrip().removeprefix('[vitreg] ')}")
    relay.join()
    return proc.wait(), "".join(tail)


def _ran_out_of_memory(child_id: str) -> bool:
    # the child is another process: its error's class reaches us as the tag its tracked_run set
    return tracking.get_run(child_id).data.tags.get(tracking.ERROR_KIND_TAG) == OutOfMemory.__name__


def _log_comparison(parent) -> None:
    from vitreg.analysis.comparison import compare_gpus
    from vitreg.analysis.render import format_table
    from vitreg.analysis.report import write_report
    from vitreg.tracking.search import tidy

    comparison = compare_gpus(tidy(tracking.child_runs(parent)), baseline=None)
    with tempfile.TemporaryDirectory(prefix="vitreg-sweep-") as tmp:
        for f in write_report(comparison, tmp):
            parent.log_artifact(f, "comparison")
    print(format_table(comparison))
