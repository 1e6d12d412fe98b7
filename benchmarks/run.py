"""One entry for vitreg's measurements: named suites of commands, each timed, their output kept, and a summary of
every run they logged (figures, timed windows, overhead by phase, estimate against work) with the command, the
commit and the machine.

    python benchmarks/run.py time-to-answer --out DIR        # on the GPU machine, from the project root
    python benchmarks/run.py sweep-isolation --out DIR
    python benchmarks/run.py --list

Run on the lent GPU machine after ``source benchmarks/gpu_env.sh`` (the wheels the image lacks, a store under
gpu-runs/). ``--deadline S``: no command starts after S seconds (a device call has a limit). Every command's
output goes to DIR/NAME.txt; DIR/SUITE.json holds the commands, their exit status and wall time, and the runs.
timm's own ``benchmark.py`` is read from benchmarks/timm_benchmark.py: a copy of the installed timm's, kept
beside this file on the GPU machine only (it is timm's code: never committed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

VITREG = [sys.executable, "-m", "vitreg.cli"]
MISSION = ["mlflow", "run", ".", "-e", "bench", "--env-manager", "local", "-P", "gpu=h200"]
TIMM = [sys.executable, "benchmarks/timm_benchmark.py", "--model", "vit_base_patch16_224"]
SWEEP_FP8 = [*VITREG, "sweep", "--gpu", "h200", "--models", "vit_base_patch16_224", "--task", "infer", "--amp",
             "bf16,fp8", "--compile", "off,default", "--batch-size", "256,1024"]
SWEEP_TF32 = [*VITREG, "sweep", "--gpu", "h200", "--models", "vit_base_patch16_224", "--task", "infer", "--amp",
              "tf32,bf16", "--compile", "off,default", "--batch-size", "32,256"]
ALONE = ["--gpu", "h200", "--model", "vit_base_patch16_224", "--task", "infer", "--batch-size", "256"]

#: suite -> [(name, timeout s, command)], run in this order
SUITES = {
    # issue 35: the mission's command on a fresh machine and again, beside timm's defaults; the sweeps
    "time-to-answer": [
        ("timm_infer", 120, [*TIMM, "--bench", "inference"]),
        ("timm_train", 120, [*TIMM, "--bench", "train"]),
        ("mission1", 200, MISSION),
        ("mission2", 200, MISSION),
        ("sweep_tf32", 240, [*SWEEP_TF32, "--experiment", "sweep-tf32"]),
        ("sweep_fp8", 330, [*SWEEP_FP8, "--experiment", "sweep-fp8"]),
    ],
    # a child in the warm worker against the same configurations in fresh processes (within 1 %: compare with
    # the children of time-to-answer's sweep_tf32), where a process's set-up goes (a profile), the fp8 sweep
    "sweep-isolation": [
        ("alone_bf16_eager", 120, [*VITREG, "bench", *ALONE, "--amp", "bf16", "--compile", "off", "--experiment",
                                   "alone"]),
        ("alone_tf32_compiled", 150, [*VITREG, "bench", *ALONE, "--amp", "tf32", "--compile", "default",
                                      "--experiment", "alone"]),
        ("profile", 150, [sys.executable, "-m", "cProfile", "-o", "bench.prof", "-m", "vitreg.cli", "bench", *ALONE,
                          "--amp", "bf16", "--compile", "off", "--experiment", "profile"]),
        ("profile_stats", 60, [sys.executable, "-c", "import pstats; pstats.Stats('bench.prof').sort_stats("
                               "'cumulative').print_stats(r'vitreg/|mlflow/(store|tracking)|torch/cuda', 70)"]),
        ("sweep_fp8", 330, [*SWEEP_FP8, "--experiment", "sweep-fp8"]),
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", nargs="?", choices=sorted(SUITES))
    parser.add_argument("--out", default="out", help="folder for the outputs")
    parser.add_argument("--deadline", type=float, default=540.0, help="no command starts after this many seconds")
    parser.add_argument("--list", action="store_true", help="list the suites and their commands")
    args = parser.parse_args()
    if args.list or not args.suite:
        for suite, items in SUITES.items():
            print(suite + "\n" + "\n".join(f"  {name}: {shlex.join(cmd)}" for name, _, cmd in items))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = []
    for name, limit, command in SUITES[args.suite]:
        if time.monotonic() - started > args.deadline:
            results.append({"name": name, "command": shlex.join(command), "skipped": "deadline"})
            continue
        results.append(_timed(name, min(limit, args.deadline + 60 - (time.monotonic() - started)), command, out))
        print(json.dumps(results[-1]), flush=True)
    record = {"suite": args.suite, "commit": _output(["git", "rev-parse", "--short", "HEAD"]),
              "machine": _output(["nvidia-smi", "--query-gpu=name,driver_version,power.limit",
                                  "--format=csv,noheader"]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commands": results, "runs": _runs()}
    (out / f"{args.suite}.json").write_text(json.dumps(record, indent=1))
    for run in record["runs"]:
        print(json.dumps(run))
    return 0


def _timed(name: str, limit: float, command: list[str], out: Path) -> dict:
    begin = time.monotonic()
    with open(out / f"{name}.txt", "w") as log:
        try:
            status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    return {"name": name, "command": shlex.join(command), "rc": status, "wall_s": round(time.monotonic() - begin, 1)}


def _output(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _runs() -> list[dict]:
    """Every run of the store with a figure: its name, status, throughputs, windows, estimate against work and
    overhead by phase."""
    from mlflow.tracking import MlflowClient

    client, rows = MlflowClient(), []
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]):
            metrics = run.data.metrics
            keep = {k: round(v, 3) for k, v in metrics.items() if k.startswith("overhead_") or k in (
                "work_s", "estimated_work_s") or k.endswith(("throughput_img_per_s", "_timed_windows",
                                                               "_compile_time_s", "ci95_halfwidth_pct"))}
            if keep:
                rows.append({"experiment": exp.name, "name": run.info.run_name, "status": run.info.status,
                             "parent": run.data.tags.get("mlflow.parentRunId"), **keep})
    return rows


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
