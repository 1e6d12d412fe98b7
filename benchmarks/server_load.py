"""Load check of one tracking server: N concurrent `vitreg bench` runs (CPU, tiny model) against it.

Starts a real `mlflow server` (sqlite backend, proxied artifacts, 1 worker unless --workers) on a free
loopback port, launches N `vitreg bench` processes at once, and meanwhile a probe client times one
representative request (`runs/search` on the experiment, the UI's most common call) every 100 ms.
Afterwards every run must be FINISHED with its metrics and its artifacts in the server's artifact
destination. Prints one JSON object: runs finished, the probe's p50/p99 latency (ms) under load and
idle, wall time.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitreg.deploy import server  # noqa: E402
from vitreg.measure.timing import percentile  # noqa: E402

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
        env.update(MLFLOW_TRACKING_URI=base, MLFLOW_EXPERIMENT_NAME=EXPERIMENT)
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
        runs = api(base, "runs/search", {"experiment_ids": [experiment_id], "max_results": 100})["runs"]
        complete = 0
        for run in runs:
            metrics = {m["key"] for m in run["data"].get("metrics", [])}
            art = Path(cfg.artifacts_destination) / experiment_id / run["info"]["run_id"] / "artifacts"
            if (run["info"]["status"] == "FINISHED" and "infer_throughput_img_per_s" in metrics
                    and all((art / f).is_file() for f in ("results.json", "report.md", "environment.json"))):
                complete += 1
        result = {
            "runs_launched": args.runs, "exit_codes": [c.returncode for c in children],
            "runs_on_server": len(runs), "runs_finished_complete": complete,
            "server_workers": args.workers, "wall_s": round(wall, 1),
            "probe_requests_under_load": len(loaded),
            "probe_runs_search_ms_p50": round(statistics.median(loaded), 1) if loaded else None,
            "probe_runs_search_ms_p99": round(percentile(loaded, 99), 1) if loaded else None,
            "probe_idle_ms_p50": round(statistics.median(idle), 1),
            "probe_idle_ms_p99": round(percentile(idle, 99), 1),
            "cpu_count": os.cpu_count(),
        }
        failed = [err[-500:] for (out, err), c in zip(outputs, children) if c.returncode != 0]
        if failed:
            result["first_failure"] = failed[0]
        print(json.dumps(result))
        return 0 if complete == args.runs else 1
    finally:
        server.stop(proc)


if __name__ == "__main__":
    sys.exit(main())
