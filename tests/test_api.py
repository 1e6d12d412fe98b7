"""vitreg from Python (vitreg.api.bench / .compare / .runs) and `vitreg runs --csv`: typed results
and one DataFrame of many runs, from a real sqlite store; `import vitreg` stays cheap."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

import vitreg
from conftest import REPO, migrated_store
from vitreg.errors import VitregError

TINY = dict(model="test_vit", img_size=32, batch_size=2, warmup=1, steps=2, repeats=1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sqlite store with experiment ``api``: one infer run and one train run of test_vit, made by vitreg.api.bench."""
    root = tmp_path_factory.mktemp("api")
    uri = migrated_store(root)
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
            mp.delenv(key)
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(root)
        import mlflow

        mlflow.set_tracking_uri(uri)
        infer = vitreg.api.bench(task="infer", experiment="api", **TINY)
        train = vitreg.api.bench(task="train", experiment="api", run_name="api-train", **{**TINY, "batch_size": "4"})
        yield uri, infer, train


@pytest.mark.slow
def test_import_vitreg_is_cheap_and_its_api_is_vitreg_api():
    """``import vitreg`` imports nothing heavy and gives ``vitreg.api``; the API's names stay its own after the
    packages of the same names are imported, and no package of vitreg is callable (none has its class changed)."""
    code = ("import sys, types, vitreg\n"
            "print(sorted(m for m in ('torch', 'mlflow', 'pandas', 'numpy', 'timm', 'click') if m in sys.modules))\n"
            "import vitreg.bench.job, vitreg.compare\n"
            "print([getattr(vitreg.api, n).__module__ for n in ('bench', 'compare', 'check', 'runs')])\n"
            "print(type(vitreg.bench) is types.ModuleType, callable(vitreg.bench), callable(vitreg.compare),\n"
            "      hasattr(vitreg, 'runs'), hasattr(vitreg, 'check'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", str(["vitreg.api"] * 4), "True False False False False"]


def test_bench_returns_the_typed_result_and_logs_the_run(store):
    from mlflow.tracking import MlflowClient

    uri, infer, train = store
    assert [t.task for t in infer.tasks] == ["infer"] and [t.task for t in train.tasks] == ["train"]
    assert infer.model.name == "test_vit" and infer.metrics()["infer_throughput_img_per_s"] > 0
    assert train.tasks[0].batch_size == 4  # "4" as text means the same as 4
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("api").experiment_id], order_by=["start_time"])
    assert [r.data.tags["mlflow.runName"] for r in runs][1] == "api-train"
    assert all(r.info.status == "FINISHED" for r in runs)


def test_bench_report_shows_the_python_call(store):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri, _, _ = store
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("api").experiment_id], "tags.task = 'train'")
    report = mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/report.md")
    assert ("vitreg.api.bench(task='train', model='test_vit', img_size=32, batch_size='4', warmup=1, steps=2, "
            "repeats=1)") in report


def test_bench_bad_input_is_the_cli_s_one_line_error(store):
    with pytest.raises(VitregError, match=r"unknown bench option 'batchsize' \(did you mean batch_size\?\)"):
        vitreg.api.bench(batchsize=2, experiment="api-bad", model="test_vit")
    with pytest.raises(VitregError, match="amp='int8' is not one of"):
        vitreg.api.bench(amp="int8", experiment="api-bad", **TINY)
    with pytest.raises(VitregError, match="did you mean deit_tiny_patch16_224"):
        vitreg.api.bench(experiment="api-bad", **{**TINY, "model": "deit_tiny"})
    from mlflow.tracking import MlflowClient

    assert MlflowClient(store[0]).get_experiment_by_name("api-bad") is None  # refused before any run existed


def test_runs_is_one_frame_and_the_csv_holds_the_same(store):
    import pandas as pd

    from vitreg.cli.main import main

    frame = vitreg.api.runs("api")
    assert isinstance(frame, pd.DataFrame) and sorted(frame["task"]) == ["infer", "train"]
    assert (frame["gpu"] == "cpu").all() and (frame["throughput_img_per_s"] > 0).all()
    result = CliRunner().invoke(main, ["runs", "--experiment", "api", "--csv"])
    assert result.exit_code == 0, result.output
    read = pd.read_csv(io.StringIO(result.stdout))
    assert list(read.columns) == list(frame.columns)
    assert list(read["run_id"]) == list(frame["run_id"])
    assert read["throughput_img_per_s"].tolist() == pytest.approx(frame["throughput_img_per_s"].tolist())


@pytest.mark.parametrize("args,needle", [
    (["--csv"], "--csv needs the experiment: pass --experiment NAME"),
    (["--csv", "--stale", "--experiment", "api"], "--csv writes finished runs and --stale lists unfinished ones: "
                                                  "pass one of them"),
])
def test_runs_csv_refusals_are_one_line(store, args, needle):
    from vitreg.cli.main import main

    result = CliRunner().invoke(main, ["runs", *args])
    assert result.exit_code == 2 and result.output.strip() == f"error: {needle}"


def test_compare_returns_the_comparison(store):
    comparison = vitreg.api.compare("api")
    assert comparison.gpus == ["cpu"] and comparison.metric == "throughput_img_per_s"
    assert set(comparison.table["task"]) == {"infer", "train"} and (comparison.table["n_runs"] == 1).all()
    assert comparison.summary()["n_runs"] == 2
