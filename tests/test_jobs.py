"""compare / sweep / import-timm through the CLI against a real sqlite store."""

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vitreg.cli.main import main
from vitreg.fleet import children as child_commands

DATA = Path(__file__).parent / "data"


def _log_fake_bench(client, exp_id, gpu, throughputs, model="deit_tiny_patch16_224"):
    """Runs shaped like bench's (params, resolved tags, per-task metrics), one per throughput."""
    for value in throughputs:
        run = client.create_run(exp_id, run_name=f"{model}-{gpu}")
        rid = run.info.run_id
        for k, v in {"gpu": gpu, "model": model, "task": "infer", "amp": "bf16", "compile": "off",
                     "batch_size": "256", "img_size": "224", "nproc": "1"}.items():
            client.log_param(rid, k, v)
        client.set_tag(rid, "gpu", gpu)
        client.set_tag(rid, "amp", "bf16")
        client.set_tag(rid, "vitreg_job", "bench")
        client.log_metric(rid, "infer_throughput_img_per_s", value)
        client.log_metric(rid, "infer_latency_ms_p50", 256 / value * 1e3)
        client.set_terminated(rid, "FINISHED")


def _runs(client, name):
    exp = client.get_experiment_by_name(name)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def test_compare_logs_table_and_plots_with_verdicts(sqlite_store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.create_experiment("gpus")
    _log_fake_bench(client, exp, "a100", [10000, 10100, 9950, 10050])
    _log_fake_bench(client, exp, "h200", [20000, 20300, 19900, 20100])
    result = CliRunner().invoke(main, ["compare", "--experiment", "gpus", "--baseline", "a100",
                                       "--log-experiment", "reports"])
    assert result.exit_code == 0, result.output
    assert "faster" in result.output and "h200" in result.output
    (run,) = _runs(client, "reports")
    assert run.info.status == "FINISHED" and run.data.tags["vitreg_job"] == "compare"
    assert run.data.metrics["speedup_geomean_h200"] == pytest.approx(2.0, rel=0.02)
    files = {a.path for a in client.list_artifacts(run.info.run_id, "comparison")}
    assert {"comparison/comparison.md", "comparison/comparison.csv", "comparison/comparison.html",
            "comparison/throughput_by_gpu.png"} <= files


@pytest.mark.parametrize("args,needle", [
    (["--experiment", "missing"], "experiment 'missing' does not exist"),
    (["--experiment", "empty"], "no runs to compare; record some with `vitreg bench`"),
    (["--experiment", "gpus", "--baseline", "v100"], "GPUs present: a100"),
])
def test_compare_bad_input_writes_nothing(sqlite_store, args, needle):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    client.create_experiment("empty")
    _log_fake_bench(client, client.create_experiment("gpus"), "a100", [100.0])
    result = CliRunner().invoke(main, ["compare", *args, "--log-experiment", "reports"])
    assert result.exit_code == 2 and result.output.count("error: ") == 1
    assert needle in result.output
    assert _runs(client, "reports") == []  # no half-written compare run


def test_import_timm_then_compare(sqlite_store):
    from mlflow.tracking import MlflowClient

    result = CliRunner().invoke(main, ["import-timm", str(DATA / "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv"),
                                       "--gpu", "rtx4090", "--experiment", "published"])
    assert result.exit_code == 0, result.output
    runs = _runs(MlflowClient(), "published")
    assert runs and all(r.data.tags["source"] == "timm" and r.data.tags["gpu"] == "rtx4090" for r in runs)
    assert all(r.data.metrics["infer_throughput_img_per_s"] > 0 for r in runs)
    mismatch = CliRunner().invoke(main, ["import-timm", str(DATA / "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv"),
                                         "--gpu", "a100", "--experiment", "published"])
    assert mismatch.exit_code == 2 and "rtx4090" in mismatch.output
    assert len(_runs(MlflowClient(), "published")) == len(runs)


def test_sweep_unknown_value_refused_before_running(sqlite_store):
    from mlflow.tracking import MlflowClient

    for args, needle in [(["--models", "test_vit,vit_nope"], "unknown model 'vit_nope'"),
                         (["--models", "test_vit", "--amp", "off,fp9"], "amp='fp9'"),
                         (["--models", "test_vit", "--batch-size", "2,x"], "batch_size='x' is not an integer")]:
        result = CliRunner().invoke(main, ["sweep", *args, "--experiment", "sw"])
        assert result.exit_code == 2 and needle in result.output, result.output
    assert _runs(MlflowClient(), "sw") == []


@pytest.mark.slow
def test_sweep_children_failures_and_oom_retry(sqlite_store, monkeypatch, tmp_path):
    """Three combinations: one fine, one failing (compile error: unknown backend mode), one OOM at batch 4
    that is retried at batch 3, then 2 (the fake GPU holds 2 images)."""
    from mlflow.tracking import MlflowClient

    script = tmp_path / "fake_child.py"
    script.write_text(
        "import sys\n"
        "args = sys.argv[1:]\n"
        "bs = int(args[args.index('--batch-size') + 1])\n"
        "if args[args.index('--amp') + 1] == 'fp16':  # a crash before anything is imported\n"
        "    raise RuntimeError('inductor compile error: simulated')\n"
        "from vitreg.tracking import runs as tracking\n"
        "from vitreg.errors import OutOfMemory, VitregError\n"
        "from vitreg.cli.main import main\n"
        "if bs > 2:\n"
        "    try:\n"
        "        with tracking.tracked_run(system_metrics=False):\n"
        "            raise OutOfMemory(f'train with batch_size={bs} ran out of GPU memory: use a smaller batch_size')\n"
        "    except VitregError as e:\n"
        "        print('error:', e, file=sys.stderr); sys.exit(2)\n"
        "main(['bench', *args])\n")
    real = child_commands.child_command

    def fake(combo, batch_size, common):
        return [sys.executable, str(script), *real(combo, batch_size, common)[4:]]

    monkeypatch.setattr(child_commands, "child_command", fake)
    result = CliRunner().invoke(main, ["sweep", "--isolate", "process", "--models", "test_vit", "--amp", "off,fp16", "--batch-size", "1,3",
                                       "--img-size", "32", "--task", "infer", "--warmup", "1", "--steps", "2",
                                       "--repeats", "2", "--experiment", "sw"])
    # the parent FAILED with its two fp16 combinations; the OOM child retried to a finish counts as finished
    assert result.exit_code == 2, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert ": 2 finished, 2 failed" in error and "--rerun-failed" in error, error
    # each child's own phases show as they come, under its place in the sweep (issue 14)
    assert re.search(r"sweep 1/\d: infer: window 2/2: ", result.output), result.output[-3000:]
    runs = _runs(MlflowClient(), "sw")
    parent = [r for r in runs if r.data.tags.get("vitreg_job") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parent) == 1 and parent[0].info.status == "FAILED"
    assert parent[0].info.run_name == "sweep test_vit img32 · amp×batch_size · 4 runs"  # named by what it swept
    assert all(c.data.tags["mlflow.parentRunId"] == parent[0].info.run_id for c in children)
    finished = [c for c in children if c.info.status == "FINISHED"]
    failed = [c for c in children if c.info.status == "FAILED"]
    # off/bs1 fine; off/bs3 OOM -> retried at 2 (timm decay: 3 -> 2) fine; fp16 x2 fail with the compile error
    assert sorted(c.data.params["batch_size"] for c in finished) == ["1", "2"]
    retried = [c for c in finished if c.data.tags.get("requested_batch_size") == "3"]
    assert len(retried) == 1 and retried[0].data.params["batch_size"] == "2"
    assert len(failed) == 3
    assert sum("ran out of GPU memory" in c.data.tags["vitreg_error"] for c in failed) == 1
    assert [c.data.tags.get("vitreg_error_kind") for c in failed].count("OutOfMemory") == 1  # what sweep retries on
    assert sum("compile error" in c.data.tags["vitreg_error"] for c in failed) == 2
    files = {a.path for a in MlflowClient().list_artifacts(parent[0].info.run_id, "comparison")}
    assert "comparison/comparison.md" in files


def test_a_failed_run_tags_the_kind_of_its_error(sqlite_store):
    """What sweep branches on: the error's class travels as the child run's vitreg_error_kind tag."""
    from mlflow.tracking import MlflowClient

    from vitreg.errors import OutOfMemory, VitregError
    from vitreg.tracking import runs as tracking

    for name, error in (("oom", OutOfMemory("infer with batch_size=8 ran out of GPU memory")),
                        ("bad", VitregError("ran out of GPU memory, says the text only"))):
        with pytest.raises(VitregError):
            with tracking.tracked_run(run_name=name, experiment="kinds", system_metrics=False):
                raise error
    tags = {r.info.run_name: r.data.tags for r in _runs(MlflowClient(), "kinds")}
    assert tags["oom"]["vitreg_error_kind"] == "OutOfMemory" and tags["bad"]["vitreg_error_kind"] == "VitregError"
    assert tags["oom"]["vitreg_error"] == "infer with batch_size=8 ran out of GPU memory"
