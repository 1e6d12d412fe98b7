"""What a Ray sweep costs beyond its children's own work (docs/benchmarks.md, suite sweep): run as a script,
``PYTHONPATH=$PWD python tests/test_fleet_cost.py``; it holds no test (pytest collects nothing here).

It times one child alone (``vitreg bench``, the same options), then a sweep of 8 such children on a Ray cluster
of one node and of two nodes (one CPU each, so one child at a time per node), all logging to a real
``mlflow server``, and prints the wall times and the overhead per child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import free_port, premigrated, subprocess_env  # noqa: E402

CHILD = ["--device", "cpu", "--task", "infer", "--img-size", "32", "--warmup", "1", "--steps", "2", "--repeats", "2",
         "--batch-size", "2", "--amp", "off"]
AXES = ["--models", "test_vit,test_vit2", "--axis", "seed=0,1", "--axis", "sdpa=auto,math"]  # 8 children


def _timed(cmd: list[str], env: dict, cwd: str) -> float:
    start = time.monotonic()
    subprocess.run(cmd, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - start


def main() -> None:
    from ray.cluster_utils import Cluster

    from vitreg.deploy import server
    from vitreg.deploy.server import ServerConfig

    tmp = tempfile.mkdtemp(prefix="vitreg-fleet-cost-")
    cfg = ServerConfig(port=free_port(), data_dir=premigrated(Path(tmp) / "server"))
    proc = server.start(cfg, timeout=120, quiet=True)
    small = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    try:
        env = subprocess_env(cfg.url)
        bench = [sys.executable, "-m", "vitreg.cli", "bench", "--model", "test_vit", *CHILD, "--experiment", "alone"]
        alone = [_timed(bench, env, tmp) for _ in range(2)]
        sweep = [sys.executable, "-m", "vitreg.cli", "sweep", "--engine", "ray", "--ray-address", cluster.address,
                 *AXES, *CHILD]
        one = _timed([*sweep, "--experiment", "one-node"], env, tmp)
        cluster.add_node(**small)
        cluster.wait_for_nodes()
        two = _timed([*sweep, "--experiment", "two-nodes"], env, tmp)
    finally:
        cluster.shutdown()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    child = min(alone)
    print(f"one child alone (vitreg bench): {', '.join(f'{a:.1f}' for a in alone)} s")
    print(f"8 children, 1 node: {one:.1f} s = {one / 8:.1f} s a child, overhead {one / 8 - child:+.1f} s a child")
    print(f"8 children, 2 nodes: {two:.1f} s ({one / two:.2f}x the 1-node time)")


if __name__ == "__main__":
    main()
