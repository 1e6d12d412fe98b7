"""How long `vitreg runs` takes as a user runs it (a fresh process, imports included): in a folder with no store,
and over a sqlite store of --runs runs (benchmarks/check_runs.py: what a bench run logs, no model). Prints one
line per case: wall seconds and the CPU seconds of the process (user + system), best of --repeat. Issue 47's
bounds on a 2-core machine: no store within 1 s of CPU, 1,000 runs within 3 s; figures in docs/benchmarks.md.

    PYTHONPATH=$PWD python benchmarks/runs_scale.py --runs 1000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_runs import log_run  # noqa: E402


def _timed(command: list[str], cwd: str, env: dict) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.monotonic()
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(time.monotonic() - begin, 2), "cpu_s": round(cpu, 2), "last_line": out.splitlines()[-1]}


def _best(case: str, command: list[str], cwd: str, env: dict, repeat: int) -> None:
    tries = [_timed(command, cwd, env) for _ in range(repeat)]
    best = min(tries, key=lambda t: t["wall_s"])
    print(json.dumps({"case": case, **best, "load_1min": round(os.getloadavg()[0], 2)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    command = [sys.executable, "-m", "vitreg", "runs"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    shm = Path("/dev/shm")  # sqlite commits on tmpfs: the runs' making only
    with tempfile.TemporaryDirectory(prefix="vitreg-runs-scale-", dir=shm if shm.is_dir() else None) as tmp:
        empty = Path(tmp, "empty")
        empty.mkdir()
        _best("no store", command, str(empty), env, args.repeat)
        uri = f"sqlite:///{tmp}/mlflow.db"
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        exp = client.create_experiment("scale", artifact_location=f"{tmp}/mlruns")
        for i in range(args.runs):
            log_run(client, exp, i, 1000.0 + i % 7, gpu=("h200", "a100")[i % 2])
        _best(f"{args.runs} runs", command, tmp, {**env, "MLFLOW_TRACKING_URI": uri}, args.repeat)


if __name__ == "__main__":
    main()
