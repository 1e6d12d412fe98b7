"""How long `vitreg check` takes over an experiment of many runs, and how that grows with the runs.

Makes runs cheaply with a plain MLflow client (benchmarks/check_runs.py: the params, tags and metrics a bench
run logs, no model) in a temporary sqlite store, in steps up to --runs, and after each step times the command
as a user runs it (`python -m vitreg check --experiment scale`, a fresh process: imports included), then the
phases in this process: MLflow's search, the tidy frame and the verdicts, the report (one PNG per series) and
the check run. Prints one line per step; figures in docs/benchmarks.md (suite check-scale).

    PYTHONPATH=$PWD python benchmarks/check_scale.py --runs 5000 --series 100
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_runs import log_run  # noqa: E402

MODELS = ("deit_tiny_patch16_224", "deit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224",
          "deit3_small_patch16_224")


def _series_keys(n_series: int) -> list[dict]:
    """``n_series`` configuration x GPU combinations: models x batch sizes x GPUs."""
    keys = [dict(model=m, gpu=g, params={"batch_size": str(b)})
            for m in MODELS for g in ("h200", "a100") for b in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)]
    return keys[:n_series]


def _make(client, exp: str, keys: list[dict], start: int, stop: int, rng) -> None:
    """Runs ``start`` .. ``stop - 1``, round-robin over the series, 1 % noise."""
    for i in range(start, stop):
        key = keys[i % len(keys)]
        log_run(client, exp, i, 1000 * rng.normal(1, 0.01), **key)


def _timed_phases(experiment: str) -> dict[str, float]:
    from vitreg.compare import run_check
    from vitreg.history.check import Selection, carried_columns, check_runs
    from vitreg.tracking.search import benchmark_runs, tidy

    t0 = time.perf_counter()
    raw = benchmark_runs(experiment)
    t1 = time.perf_counter()
    check_runs(tidy(raw, axes=carried_columns(Selection())))
    t2 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # its verdict lines: the CLI run printed them
        run_check(experiment, progress=lambda _: None)  # everything again, with the report and the check run
    t3 = time.perf_counter()
    return {"search_s": t1 - t0, "verdicts_s": t2 - t1, "report_and_run_s": (t3 - t2) - (t2 - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5000)
    ap.add_argument("--series", type=int, default=100)
    ap.add_argument("--steps", type=int, default=4, help="measure after runs/2**k runs, k = steps-1 .. 0")
    args = ap.parse_args()
    shm = Path("/dev/shm")  # sqlite commits on tmpfs: 20 ms a run instead of 100 ms (the runs' making only)
    with tempfile.TemporaryDirectory(prefix="vitreg-check-scale-", dir=shm if shm.is_dir() else None) as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        os.environ["MLFLOW_TRACKING_URI"] = uri
        os.chdir(tmp)
        import mlflow
        from mlflow.tracking import MlflowClient

        mlflow.set_tracking_uri(uri)
        client = MlflowClient()
        exp = client.create_experiment("scale")
        keys, rng, made = _series_keys(args.series), np.random.default_rng(0), 0
        for k in reversed(range(args.steps)):
            target = args.runs // 2**k
            t0 = time.perf_counter()
            _make(client, exp, keys, made, target, rng)
            made, making = target, time.perf_counter() - t0
            t0 = time.perf_counter()
            cli = subprocess.run([sys.executable, "-m", "vitreg", "check", "--experiment", "scale"],
                                 capture_output=True, text=True)
            wall = time.perf_counter() - t0
            phases = _timed_phases("scale")
            print(f"runs={made} series={len(keys)} check_cli_s={wall:.1f} (exit {cli.returncode}, "
                  f"{cli.stdout.count('REGRESSED:')} regressed) "
                  + " ".join(f"{k}={v:.2f}" for k, v in phases.items()) + f" (made in {making:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
