"""Options that size work, bounded by the machine: DataLoader workers by the usable CPUs, node_rank by nnodes.
Each is one `error:` line naming the bound, exit 2, the run FAILED (never RUNNING, never the OOM killer)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from vitreg.cli.main import main
from vitreg.config.options import COUNT_MAX
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


# issue 31: `--warmup 1000000000000000000000000000000` was accepted after an estimate of 4.8e24 hours and ran
# until killed. Each count option is bounded in the option table (COUNT_MAX), and work within the bounds
# that still cannot finish here is refused by the estimate, before any iteration.
HUGE = str(10**30)
TINY_BENCH = ["bench", "--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--device", "cpu",
              "--task", "infer", "--warmup", "1", "--steps", "1", "--repeats", "1"]
TINY_TRAIN = ["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--device", "cpu",
              "--num-classes", "10", "--steps", "2"]


def _refused_in_one_line(args: list[str], experiment: str) -> tuple[str, object]:
    """The one error line, and the run: FAILED (never RUNNING) with no metric logged (no iteration ran)."""
    from mlflow.tracking import MlflowClient

    res = CliRunner().invoke(main, [*args, "--experiment", experiment])
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output[-3000:], res.exception)
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    c = MlflowClient()
    (run,) = c.search_runs([c.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FAILED" and run.data.metrics == {}, (run.info.status, run.data.metrics)
    return errors[0], run


@pytest.mark.parametrize("base, name", [(TINY_BENCH, "warmup"), (TINY_BENCH, "steps"), (TINY_BENCH, "repeats"),
                                        (TINY_TRAIN, "steps"), (TINY_TRAIN, "epochs")],
                         ids=["bench-warmup", "bench-steps", "bench-repeats", "train-steps", "train-epochs"])
def test_a_count_past_any_job_is_one_line_naming_the_bound(sqlite_store, base, name):
    """Refused with the other option checks (cli.common.check_first): before any run exists."""
    from mlflow.tracking import MlflowClient

    experiment = f"count-{base[0]}-{name}"
    res = CliRunner().invoke(main, [*base, f"--{name}", HUGE, "--experiment", experiment])
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output[-3000:], res.exception)
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{name}={HUGE} must be <= {COUNT_MAX}" in errors[0], res.output
    assert MlflowClient().get_experiment_by_name(experiment) is None


@pytest.mark.parametrize("args, what", [
    ([*TINY_BENCH, "--warmup", str(COUNT_MAX), "--steps", str(COUNT_MAX), "--repeats", str(COUNT_MAX)], "bench"),
    ([*TINY_TRAIN, "--steps", "0", "--epochs", str(COUNT_MAX)], "train"),  # 5,000 updates an epoch
], ids=["bench", "train"])
def test_work_within_the_bounds_that_cannot_finish_is_refused_before_it_starts(sqlite_store, args, what):
    line, _ = _refused_in_one_line(args, f"endless-{what}")
    assert line.startswith(f"error: {what} would take at least ") and "it cannot finish" in line, line
    assert "for a short run: --model deit_tiny_patch16_224" in line, line
