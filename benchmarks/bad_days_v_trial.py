"""Issue 45's fresh trial: hostile cases written before reading the code that handles them, each run as a user
would (`python -m vitreg.cli ...` in its own folder and sqlite store). A case holds when it exits as expected
(2 for bad input, one `error:` line), prints no traceback and no secret, and leaves no RUNNING run.

    PYTHONPATH=$PWD python benchmarks/bad_days_v_trial.py [OUT_DIR] [CASE_PREFIX]
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

SECRET = "S3cretTrialPw77"
TINY = ["--model", "test_vit", "--img-size", "32", "--device", "cpu", "--warmup", "1", "--steps", "2",
        "--repeats", "1", "--task", "infer", "--batch-size", "2", "--amp", "off"]
BENCH = ["bench", *TINY]
SWEEP = ["sweep", "--models", "test_vit", "--device", "cpu", "--img-size", "32", "--task", "infer"]
TRAIN = ["train", "--model", "test_vit", "--img-size", "32", "--device", "cpu", "--batch-size", "2",
         "--num-classes", "10", "--num-workers", "0", "--steps", "2"]
RAY = [*SWEEP, "--engine", "ray", "--ray-address", "127.0.0.1:9"]

# (name, argv, extra environment, expected exit) -- 2: refused in one line
CASES = [
    ("bench-batch-0", [*BENCH, "--batch-size", "0"], {}, 2),
    ("bench-batch-negative", [*BENCH, "--batch-size", "-5"], {}, 2),
    ("bench-batch-float", [*BENCH, "--batch-size", "1e3"], {}, 2),
    ("bench-img-0", [*BENCH, "--img-size", "0"], {}, 0),  # 0: the model default (documented)
    ("bench-img-7", [*BENCH, "--img-size", "7"], {}, 2),
    ("bench-model-empty", [*BENCH, "--model", ""], {}, 2),
    ("bench-model-blank", [*BENCH, "--model", "   "], {}, 2),
    ("bench-model-shell", [*BENCH, "--model", "vit_tiny;rm -rf /"], {}, 2),
    ("bench-model-100k", [*BENCH, "--model", "v" * 100_000], {}, 2),
    ("bench-warmup-negative", [*BENCH, "--warmup", "-1"], {}, 2),
    ("bench-steps-0", [*BENCH, "--steps", "0"], {}, 0),  # 0: as many as window_min_s (documented)
    ("bench-repeats-0", [*BENCH, "--repeats", "0"], {}, 0),  # 0: until precision (documented)
    ("bench-precision-nan", [*BENCH, "--precision-pct", "nan"], {}, 2),
    ("bench-precision-negative", [*BENCH, "--precision-pct", "-1"], {}, 2),
    ("bench-window-inf", [*BENCH, "--window-min-s", "inf"], {}, 2),
    ("bench-max-time-negative", [*BENCH, "--max-time-s", "-3"], {}, 2),
    ("bench-amp-fp64", [*BENCH, "--amp", "fp64"], {}, 2),
    ("bench-compile-turbo", [*BENCH, "--compile", "turbo"], {}, 2),
    ("bench-sdpa-nope", [*BENCH, "--sdpa", "nope"], {}, 2),
    ("bench-device-tpu", [*BENCH, "--device", "tpu"], {}, 2),
    ("bench-gpu-h999", [*BENCH, "--gpu", "h999"], {}, 2),
    ("bench-nproc-0", [*BENCH, "--nproc", "0"], {}, 2),
    ("bench-nproc-huge", [*BENCH, "--nproc", "100000"], {}, 2),
    ("bench-seed-negative", [*BENCH, "--seed", "-1"], {}, 2),
    ("bench-seed-2e64", [*BENCH, "--seed", str(2**64)], {}, 2),
    ("bench-experiment-blank", [*BENCH, "--experiment", "   "], {}, 2),
    ("bench-run-name-newline", [*BENCH, "--run-name", "a\nb"], {}, 0),
    ("bench-run-name-10k", [*BENCH, "--run-name", "n" * 10_000], {}, 2),
    ("bench-num-classes-negative", [*BENCH, "--num-classes", "-1"], {}, 2),
    ("bench-task-two", [*BENCH, "--task", "both,infer"], {}, 2),
    ("bench-profile-steps-0", [*BENCH, "--profile-steps", "0"], {}, 0),  # 0: none (documented)
    ("bench-compile-backend-nope", [*BENCH, "--compile-backend", "nope"], {}, 2),
    ("bench-baseline-run-bogus", [*BENCH, "--baseline-run", "xyz"], {}, 0),  # nproc=1: said ignored
    ("env-heartbeat-negative", BENCH, {"VITREG_HEARTBEAT_S": "-1"}, 2),
    ("env-http-timeout-0", BENCH, {"VITREG_HTTP_TIMEOUT_S": "0"}, 2),
    ("env-stop-grace-0", BENCH, {"VITREG_STOP_GRACE_S": "0"}, 2),
    ("env-stop-grace-negative", BENCH, {"VITREG_STOP_GRACE_S": "-5"}, 2),
    ("env-offline-maybe", BENCH, {"VITREG_OFFLINE": "maybe"}, 2),
    ("env-spool-dev-null", [*BENCH, "--offline", "true"], {"VITREG_SPOOL_DIR": "/dev/null"}, 2),
    ("env-flush-timeout-inf", BENCH, {"VITREG_FLUSH_TIMEOUT_S": "inf"}, 2),
    ("env-uri-secret-closed-port", BENCH, {"MLFLOW_TRACKING_URI": f"http://user:{SECRET}@127.0.0.1:9"}, 2),
    ("env-uri-sqlite-under-proc", BENCH, {"MLFLOW_TRACKING_URI": "sqlite:////proc/no/db.sqlite"}, 2),
    ("env-uri-garbage-scheme", BENCH, {"MLFLOW_TRACKING_URI": "garbage://x"}, 2),
    ("env-energy-trace-is-dir", BENCH, {"VITREG_ENERGY_TRACE": "/tmp"}, 2),
    ("ray-env-int-value", [*RAY, "--ray-runtime-env", json.dumps({"env_vars": {"K": 5, "T": SECRET}})], {}, 2),
    ("ray-env-vars-string", [*RAY, "--ray-runtime-env", json.dumps({"env_vars": f"TOKEN={SECRET}"})], {}, 2),
    ("ray-env-list", [*RAY, "--ray-runtime-env", "[]"], {}, 2),
    ("ray-env-null", [*RAY, "--ray-runtime-env", "null"], {}, 2),
    ("ray-env-missing-requirements", [*RAY, "--ray-runtime-env", '{"pip": "/nonexistent/requirements.txt"}'], {}, 2),
    ("ray-env-nul-in-value", [*RAY, "--ray-runtime-env", '{"env_vars": {"A": "x\\u0000y' + SECRET + '"}}'], {}, 2),
    ("ray-env-deep", [*RAY, "--ray-runtime-env", "[" * 1900 + "]" * 1900], {}, 2),
    ("ray-env-secret-in-bad-key", [*RAY, "--ray-runtime-env", json.dumps({"env_vars": {SECRET: 7}})], {}, 2),
    ("sweep-max-parallel-negative", [*SWEEP, "--max-parallel", "-1"], {}, 2),
    ("sweep-max-combinations-0", [*SWEEP, "--max-combinations", "0"], {}, 2),
    ("sweep-axis-no-values", [*SWEEP, "--axis", "batch_size="], {}, 2),
    ("sweep-axis-no-name", [*SWEEP, "--axis", "=1,2"], {}, 2),
    ("sweep-models-empty-item", [*SWEEP, "--models", "test_vit,,test_vit"], {}, 2),
    ("sweep-slurm-time-0", [*SWEEP, "--engine", "slurm", "--slurm-time-min", "0"], {}, 2),
    ("sweep-slurm-sbatch-junk", [*SWEEP, "--engine", "slurm", "--slurm-sbatch", "mem=;;;="], {}, 2),
    ("sweep-rerun-unknown", ["sweep", "--rerun-failed", "does-not-exist"], {}, 2),
    ("sweep-rerun-path", ["sweep", "--rerun-failed", "../../etc/passwd"], {}, 2),
    ("sweep-rerun-tab", ["sweep", "--rerun-failed", "\t\n"], {}, 2),
    ("compare-no-experiment", ["compare", "--experiment", "nonexistent-exp"], {}, 2),
    ("check-no-experiment", ["check", "--experiment", "nonexistent-exp"], {}, 2),
    ("check-metric-nope", ["check", "--experiment", "nonexistent-exp", "--metric", "nope"], {}, 2),
    ("runs-older-than-negative", ["runs", "--stale", "--older-than", "-1"], {}, 2),
    ("sync-spool-missing", ["sync", "--spool", "/nonexistent/spool"], {}, 2),
    ("sync-spool-file", ["sync", "--spool", "/etc/hostname"], {}, 2),
    ("infer-models-empty", ["infer", "--model-uri", "models:/", "--device", "cpu"], {}, 2),
    ("infer-runs-dotdot", ["infer", "--model-uri", "runs:/abc/../../x", "--device", "cpu"], {}, 2),
    ("train-epochs-0", [*TRAIN, "--epochs", "0"], {}, 0),  # --steps given: epochs unused
    ("train-lr-nan", [*TRAIN, "--lr", "nan"], {}, 2),
    ("train-lr-negative", [*TRAIN, "--lr", "-1"], {}, 2),
    ("train-data-missing", [*TRAIN, "--data", "/nonexistent/imagenet"], {}, 2),
    ("train-resume-bogus", [*TRAIN, "--resume", "runs:/nope/checkpoints/last"], {}, 2),
]


def running_runs(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        try:
            return con.execute("select count(*) from runs where status = 'RUNNING'").fetchone()[0]
        except sqlite3.Error:
            return 0


def run_case(root: Path, name: str, argv: list, extra: dict, expected: int) -> dict:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/db.sqlite", "VITREG_SPOOL_DIR": str(folder / "spool"),
           "VITREG_BATCH_CACHE": str(folder / "batch-cache.json"), **extra}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "vitreg.cli", *argv], env=env, cwd=folder, capture_output=True,
                              text=True, timeout=240)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = "timeout", (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    took = time.monotonic() - started
    stored = "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".txt", ".md", ".log"))
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    faults = []
    if code != expected:
        faults.append(f"exit {code}, expected {expected}")
    if "Traceback" in out:
        faults.append("traceback")
    if SECRET in out or SECRET in stored:
        faults.append("secret printed or stored")
    if expected == 2 and (len(errors) != 1 or len(errors[0]) > 600):
        faults.append(f"{len(errors)} error lines" + (f" of {len(errors[0])} characters" if errors else ""))
    if running_runs(folder / "db.sqlite"):
        faults.append("a RUNNING run left")
    return {"case": name, "exit": code, "seconds": round(took, 1), "held": not faults, "faults": faults,
            "line": (errors[0] if errors else (out.strip().splitlines() or [""])[-1])[:300]}


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/vitreg-bad-days-v")
    prefix = sys.argv[2] if len(sys.argv) > 2 else ""
    results = []
    for case in CASES:
        if case[0].startswith(prefix):
            results.append(run_case(root, *case))
            print(json.dumps(results[-1]), flush=True)
    held = sum(r["held"] for r in results)
    print(f"{held} of {len(results)} held", flush=True)


if __name__ == "__main__":
    main()
