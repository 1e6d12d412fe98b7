"""Options that size work, bounded by the machine: DataLoader workers by the usable CPUs, node_rank by nnodes.
Each is one `error:` line naming the bound, exit 2, the run FAILED (never RUNNING, never the OOM killer)."""

from __future__ import annotations

import os

from click.testing import CliRunner

from vitreg.cli.main import main
from vitreg.train.data import check_num_workers, usable_cpus


def _png_folder(root):
    from PIL import Image

    for i in range(4):
        cls = root / "train" / "ab"[i % 2]
        cls.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 40), (40 * i, 20, 20)).save(cls / f"{i}.png")
    return root


def test_the_worker_bound_is_two_per_usable_cpu():
    cpus = len(os.sched_getaffinity(0))
    assert usable_cpus() == cpus
    check_num_workers(2 * cpus)  # the bound itself is allowed


def test_num_workers_in_the_hundred_thousands_is_one_line_and_the_run_fails(sqlite_store, tmp_path):
    from mlflow.tracking import MlflowClient

    res = CliRunner().invoke(main, ["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "2",
                                    "--steps", "2", "--data", str(_png_folder(tmp_path / "data")),
                                    "--num-workers", "100000", "--device", "cpu", "--experiment", "bounds"])
    assert res.exit_code == 2, (res.output[-3000:], res.exception)
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"num_workers<={max(2, 2 * usable_cpus())}" in errors[0], res.output
    c = MlflowClient()
    (run,) = c.search_runs([c.get_experiment_by_name("bounds").experiment_id])
    assert run.info.status == "FAILED" and "num_workers=100000" in run.data.tags["vitreg_error"]


def test_a_node_rank_beyond_nnodes_is_one_line_even_on_one_host(sqlite_store):
    for command in ("train", "bench"):
        res = CliRunner().invoke(main, [command, "--model", "test_vit", "--img-size", "32", "--device", "cpu",
                                        "--node-rank", "5", "--steps", "2"])
        assert res.exit_code == 2, (res.output[-3000:], res.exception)
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "node_rank=5 must be in 0..0 (nnodes=1)" in errors[0], res.output
        assert "Traceback" not in res.output
