"""Load check of one tracking server: N concurrent `vitreg bench` runs (CPU, tiny model) against it.

Starts a real `mlflow server` (sqlite backend, proxied artifacts, 1 worker unless --workers) on a free
loopback port, launches N `vitreg bench` processes at once, and meanwhile a probe client times one
representative request (`runs/search` on the experiment, the UI's most common call) every 100 ms.
Afterwards every run must be FINISHED with its metrics and its artifacts in the server's artifact
destination. A run whose delivery did not finish inside its flush timeout waits in its spool (the
children's spools live in the check's own folder); the check then delivers those with `vitreg sync`, as a
user would, and counts them: nothing measured may be lost, and a server that stalls is reported, not
hidden. Prints one JSON object: runs complete (and how many needed the sync), the probe's p50/p99
latency (ms) under load and idle, wall time. On failure it also prints the server log's last lines.

    python benchmarks/server_load.py --runs 8
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitreg.deploy import server  # noqa: E402

EXPERIMENT = "load"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def api_patient(base, path, body, attempts=4):
    """The check's own reads after the load: a server still busy with the children's last uploads may
    answer a request late; give it a few tries before calling the run missing."""
    for attempt in range(attempts):
        try:
            return api(base, path, body)
        except (TimeoutError, OSError) as exc:
            if attempt == attempts - 1:
                raise SystemExit(f"error: the server at {base} did not answer {path} in {attempts} tries: {exc}")


def complete_runs(base, experiment_id, artifacts_destination):
    """The runs on the server, and how many are FINISHED with their metrics and all three artifacts."""
    runs = api_patient(base, "runs/search", {"experiment_ids": [experiment_id], "max_results": 100})["runs"]
    complete = 0
    for run in runs:
        metrics = {m["key"] for m in run["data"].get("metrics", [])}
        art = Path(artifacts_destination) / experiment_id / run["info"]["run_id"] / "artifacts"
        if (run["info"]["status"] == "FINISHED" and "infer_throughput_img_per_s" in metrics
                and all((art / f).is_file() for f in ("results.json", "report.md", "environment.json"))):
            complete += 1
    return runs, complete


def probe(base, experiment_id, stop, out):
    while not stop.is_set():
        t0 = time.perf_counter()
        api(base, "runs/search", {"experiment_ids": [experiment_id], "max_results": 50})
        out.append((time.perf_counter() - t0) * 1e3)
        stop.wait(0.1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()

    data = Path(tempfile.mkdtemp(prefix="vitreg-load-"))
    cfg = server.ServerConfig(port=free_port(), data_dir=data, workers=args.workers)
    proc = server.start(cfg, timeout=120, quiet=True)
    try:
        base = cfg.url
        experiment_id = api(base, "experiments/create", {"name": EXPERIMENT})["experiment_id"]
        idle, loaded, stop = [], [], threading.Event()
        for _ in range(20):
            t0 = time.perf_counter()
            api(base, "runs/search", {"experiment_ids": [experiment_id], "max_results": 50})
            idle.append((time.perf_counter() - t0) * 1e3)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        spools = data / "spools"
        env.update(MLFLOW_TRACKING_URI=base, MLFLOW_EXPERIMENT_NAME=EXPERIMENT, VITREG_SPOOL_DIR=str(spools))
        cmd = [sys.executable, "-m", "vitreg.cli", "bench", "--model", "test_vit", "--img-size", "32",
               "--batch-size", "2", "--task", "infer", "--warmup", "2", "--steps", "5", "--repeats", "3"]
        start = time.perf_counter()
        thread = threading.Thread(target=probe, args=(base, experiment_id, stop, loaded), daemon=True)
        thread.start()
        children = [subprocess.Popen(cmd, env=env, cwd=tempfile.mkdtemp(prefix="vitreg-client-"),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for _ in range(args.runs)]
        outputs = [c.communicate(timeout=600) for c in children]
        wall = time.perf_counter() - start
        stop.set()
        thread.join()
        runs, complete_at_exit = complete_runs(base, experiment_id, cfg.artifacts_destination)
        left = sorted(p.name for p in spools.iterdir()) if spools.is_dir() else []
        synced = None
        if left:  # delivery outlasted a child's flush timeout: its data waits in its spool
            synced = subprocess.run([sys.executable, "-m", "vitreg.cli", "sync", "--spool", str(spools)],
                                    env=env, capture_output=True, text=True, timeout=600)
            runs, complete = complete_runs(base, experiment_id, cfg.artifacts_destination)
        else:
            complete = complete_at_exit
        result = {
            "runs_launched": args.runs, "exit_codes": [c.returncode for c in children],
            "runs_on_server": len(runs), "runs_complete_when_children_ended": complete_at_exit,
            "spools_left_by_children": len(left), "runs_finished_complete": complete,
            "server_workers": args.workers, "wall_s": round(wall, 1),
            "probe_requests_under_load": len(loaded),
            "probe_runs_search_ms_p50": round(statistics.median(loaded), 1) if loaded else None,
            "probe_runs_search_ms_p99": round(float(np.percentile(loaded, 99)), 1) if loaded else None,
            "probe_idle_ms_p50": round(statistics.median(idle), 1),
            "probe_idle_ms_p99": round(float(np.percentile(idle, 99)), 1),
            "cpu_count": os.cpu_count(),
        }
        failed = [err[-500:] for (out, err), c in zip(outputs, children) if c.returncode != 0]
        if failed:
            result["first_failure"] = failed[0]
        if synced is not None:
            result["sync_exit_code"] = synced.returncode
            result["sync_output"] = (synced.stdout + synced.stderr)[-800:]
        print(json.dumps(result))
        if complete != args.runs or left:
            # Either nothing was lost but the server stalled (the spools had to be synced), or runs are
            # missing: both are worth the server's side of the story.
            log = Path(cfg.data_dir) / "server.log"
            tail = log.read_text(errors="replace").splitlines()[-40:] if log.is_file() else []
            print("server log, last lines:\n" + "\n".join(tail), file=sys.stderr)
        return 0 if complete == args.runs else 1
    finally:
        server.stop(proc)


if __name__ == "__main__":
    sys.exit(main())
