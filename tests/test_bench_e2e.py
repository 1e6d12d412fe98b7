"""`bench` end to end: real `mlflow run` subprocesses against a real sqlite store, and every bad input."""

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from conftest import REPO, migrated_store, subprocess_env
from vitreg.measure.energy import FLAGS

TINY = ["-P", "img_size=32", "-P", "batch_size=2", "-P", "warmup=2", "-P", "steps=3",
        "-P", "repeats=2"]


def mlflow_run(uri, *params, cwd):
    return subprocess.run([sys.executable, "-m", "mlflow", "run", str(REPO), "-e", "bench", "--env-manager", "local",
                           "--experiment-name", "e2e", *params],
                          env=subprocess_env(uri), cwd=cwd, capture_output=True, text=True, timeout=300)


def only_run(uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("e2e")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


@pytest.mark.slow
def test_mlflow_run_bench_logs_one_complete_finished_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # a fresh store: the mission's first run makes it
    # windows of 300 steps: MLflow's system metrics need 2 s of a run's life for their first sample, and a tiny
    # run set up in parallel can end sooner
    longer = [word.replace("steps=3", "steps=300") for word in TINY]
    proc = mlflow_run(uri, "-P", "gpu=auto", "-P", "model=test_vit", *longer, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "infer_throughput" not in proc.stdout  # the table uses readable headers...
    assert "img/s median" in proc.stdout and "logged run" in proc.stdout  # ...and ends the output
    assert "window 2/2" in proc.stderr  # progress while it runs
    client, run = only_run(uri)
    assert run.info.status == "FINISHED"
    p, t, m = run.data.params, run.data.tags, run.data.metrics
    # the runs list reads without set-up: the GPU and the figures first, then model and image size (issues 14,
    # 32, 47); the page's note, its table's cells spaced for MLflow's renderer
    # cpu · N img/s infer · N img/s train · test_vit img32 · fp32 · bs2, then any flag a loaded host earns
    words = [w for w in run.info.run_name.split(" · ") if w not in FLAGS]
    assert words[0] == "cpu" and words[3:] == ["test_vit img32", "fp32", "bs2"], words
    assert re.fullmatch(r"[\d.,]+ img/s infer", words[1]) and re.fullmatch(r"[\d.,]+ img/s train", words[2]), words
    assert "img/s" in t["mlflow.note.content"] and "| \u00a0infer\u00a0 |" in t["mlflow.note.content"]
    page = f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    assert f"logged run {run.info.run_id}" in proc.stdout and page in proc.stdout  # where to open it
    # params: as typed through -P (MLflow logs them first and they are immutable) plus ours
    assert p["gpu"] == "auto" and p["model"] == "test_vit" and p["task"] == "both" and p["batch_size"] == "2"
    assert {"amp", "compile", "warmup", "steps", "repeats", "device", "img_size"} <= set(p)
    # resolved values and the environment as tags
    assert t["gpu"] == "cpu" and t["amp"] == "off" and t["device"] == "cpu" and t["img_size"] == "32"
    assert t["gpu_mismatch"] == "false"
    for key in ["gpu_name", "gpu_count", "torch_version", "timm_version", "mlflow_version", "python_version",
                "cpu_model", "hostname", "vitreg_git_sha", "os", "cuda_version", "torchvision_version"]:
        assert key in t, key
    assert not any(k.startswith("mlflow.") and k in ("mlflow.gpu",) for k in t)
    for key in ["infer_throughput_img_per_s", "infer_latency_ms_p50", "infer_latency_ms_p99",
                "train_throughput_img_per_s", "train_step_ms_p50", "fwd_gflops_per_img", "train_throughput_cv"]:
        assert m[key] > 0, key
    assert any(k.startswith("system/") for k in m), "system metrics are on"
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "report.md", "environment.json", "pip_freeze.txt"} <= arts
    local = client.download_artifacts(run.info.run_id, "results.json", str(tmp_path / "dl"))
    doc = json.loads(open(local).read())
    assert [x["task"] for x in doc["tasks"]] == ["infer", "train"]
    assert doc["tasks"][1]["metrics"]["train_throughput_img_per_s"] == pytest.approx(m["train_throughput_img_per_s"])
    report = open(client.download_artifacts(run.info.run_id, "report.md", str(tmp_path / "dl2"))).read()
    assert "## Environment" in report and "| infer |" in report.replace("| infer  |", "| infer |")


@pytest.mark.slow
@pytest.mark.parametrize("params,needle", [
    (["-P", "gpu=a100", "-P", "model=test_vit"], "use gpu=cpu"),
])
def test_mlflow_run_bad_input_fails_the_run(tmp_path, params, needle):
    """Through the real `mlflow run` path once; the other refusals are the same code, tested in-process below."""
    uri = migrated_store(tmp_path)
    proc = mlflow_run(uri, *TINY, *params, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and needle in error_lines[0]
    _, run = only_run(uri)
    assert run.info.status == "FAILED" and needle in run.data.tags["vitreg_error"]


@pytest.fixture
def requested_run(sqlite_store, monkeypatch):
    """A run created the way `mlflow run` creates it: RUNNING, -P values logged, MLFLOW_RUN_ID set."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.create_experiment("e2e")
    run = client.create_run(exp)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    return client, run.info.run_id


@pytest.mark.parametrize("args,needle", [
    (["--batch-size", "0"], "batch_size=0 must be >= 1"),
    (["--amp", "int8"], "amp='int8' is not one of"),
    (["--batch-size", "lots"], "batch_size='lots' is not an integer or auto"),
    (["--amp", "fp8"], "amp=fp8 is inference only"),
    (["--amp", "bf16-weights", "--task", "train"], "use task=infer, or amp=bf16 (autocast) to train"),
    (["--amp", "fp8", "--task", "infer"], "amp=fp8 needs FP8 tensor cores (compute capability >= 8.9"),
    (["--amp", "tf32"], "amp=tf32 needs an NVIDIA GPU"),
    (["--sdpa", "efficient"], "sdpa=efficient cannot run on cpu"),
    (["--sdpa", "cudnn", "--task", "infer"], "sdpa=cudnn cannot run on cpu"),
    (["--compile", "default", "--compile-cache", "/dev/null/cache"], "compile cache folder '/dev/null/cache' is not "
                                                                      "writable"),
    (["--profile", "true", "--cuda-graph", "true"], "profile=true cannot see inside a CUDA graph replay"),
    (["--compile", "fastest"], "compile='fastest' is not one of"),
    (["--device", "cuda"], "no CUDA GPU is visible"),
    (["--img-size", "30"], "use img_size=16 or 32"),
    (["--gpu", "h100"], "use gpu=cpu or gpu=auto"),
    (["--model", "resnet50"], "is not a vision transformer vitreg builds"),
    (["--model", "vit_bsae_patch16_224"], "did you mean vit_base_patch16_224"),
    (["--allow-gpu-mismatch", "perhaps"], "allow_gpu_mismatch=true or"),
    (["--cuda-graph", "true"], "cuda_graph=true needs a CUDA GPU and this run is on cpu: pass cuda_graph=false"),
])
def test_bad_input_exit_2_and_failed_run(requested_run, args, needle):
    from vitreg.cli.main import main

    client, run_id = requested_run
    result = CliRunner().invoke(main, ["bench", "--model", "test_vit", "--img-size", "32", *args])
    assert result.exit_code == 2, result.output
    assert result.output.count("error: ") == 1 and needle in result.output
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and needle in run.data.tags["vitreg_error"]


@pytest.mark.parametrize("gpu,needle", [
    ("h200", "amp=fp8 needs torchao (the optional fp8 extra): pip install torchao"),
    ("a100", "amp=fp8 needs FP8 tensor cores (compute capability >= 8.9: L4, RTX 4090, H100, H200), here compute "
             "capability 8.0"),
])
def test_fp8_refused_on_a_gpu_without_fp8_or_without_torchao(requested_run, monkeypatch, gpu, needle):
    """The GPU is faked (detection only: the refusal comes before any device work); torchao is made absent."""
    from vitreg.cli.main import main
    from vitreg.ddp import context
    from vitreg.hardware.profiles import PROFILES, DetectedHardware

    monkeypatch.setattr(context, "detect_hardware", lambda device: DetectedHardware("cuda", PROFILES[gpu].name, 1,
                                                                                PROFILES[gpu]))
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    client, run_id = requested_run
    result = CliRunner().invoke(main, ["bench", "--model", "test_vit", "--amp", "fp8", "--task", "infer"])
    assert result.exit_code == 2, result.output
    assert result.output.count("error: ") == 1 and needle in result.output
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and needle in run.data.tags["vitreg_error"]


@pytest.mark.slow  # end to end through the CLI; the search, its tags and results are tested in-process by
# test_runner.py::test_batch_size_auto_on_cpu_searches_a_small_range_and_says_what_it_chose
def test_batch_size_auto_on_cpu_runs_a_small_search(requested_run):
    from vitreg.cli.main import main

    client, run_id = requested_run
    result = CliRunner().invoke(main, ["bench", "--model", "test_vit", "--img-size", "32", "--task", "infer",
                                       "--batch-size", "auto", "--warmup", "1", "--steps", "2", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["batch_size"] == "auto"
    local = client.download_artifacts(run_id, "results.json")
    (infer,) = json.loads(open(local).read())["tasks"]
    assert infer["batch_choice"]["probes"][0]["batch"] == 8 and infer["batch_size"] == infer["batch_choice"]["batch"]


def test_mismatch_allowed_is_tagged(requested_run):
    from vitreg.cli.main import main

    client, run_id = requested_run
    result = CliRunner().invoke(main, ["bench", "--model", "test_vit", "--img-size", "32", "--gpu", "a100",
                                       "--allow-gpu-mismatch", "true", "--task", "infer", "--warmup", "1",
                                       "--steps", "2", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["gpu"] == "a100" and run.data.tags["gpu_mismatch"] == "true"
    # filed as a100 and ran on the CPU: no MFU (the A100's peak is not this hardware's), issue 22
    assert run.data.params["gpu"] == "a100" and "infer_mfu" not in run.data.metrics


@pytest.mark.slow
def test_entry_point_script_exits_2_without_traceback(tmp_path):
    from mlflow.tracking import MlflowClient

    from vitreg.tracking.store import create_experiment

    uri = migrated_store(tmp_path)
    client = MlflowClient(uri)
    run = client.create_run(create_experiment(client, "e2e"))  # artifacts beside the store, not in the checkout
    proc = subprocess.run([sys.executable, str(REPO / "entry_points" / "bench.py"), "--batch-size", "-1"],
                          env=subprocess_env(uri, MLFLOW_RUN_ID=run.info.run_id), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: batch_size=-1")
    assert client.get_run(run.info.run_id).info.status == "FAILED"


@pytest.mark.parametrize("entry_name,extra", [
    ("bench", {"nnodes": "1", "node_rank": "0", "rdzv_endpoint": "", "baseline_run": "", "offline": "false"}),
    ("infer", {"model_uri": None, "offline": "false"}),
])
def test_mlproject_bench_and_infer_entries_match_bench_spec(entry_name, extra):
    """bench: every BenchSpec field is a parameter with BenchSpec's default and reaches the command line
    (plus the launcher's and the run's own options); infer: the same for the fields it takes (its model
    comes from the URI)."""
    import yaml

    from vitreg.config.spec import BenchSpec

    entry = yaml.safe_load((REPO / "MLproject").read_text())["entry_points"][entry_name]
    spec = BenchSpec().to_params()
    params = entry["parameters"]
    if entry_name == "bench":
        assert set(params) == set(spec) | set(extra)
    else:  # infer: no model/img_size (the checkpoint's) and no DDP options (one process)
        assert "cuda_graph" in params and set(params) - set(extra) <= set(spec)
    for name, param in params.items():
        assert param["type"] == "string", name
        if name in spec and name != "task":
            assert str(param["default"]) == spec[name], name
        assert f"--{name.replace('_', '-')} {{{name}}}" in entry["command"], name


def _bench_process(tmp_path, *args):
    """`vitreg bench` in a process of its own (the import phase is then the interpreter's start and every
    import), against a fresh copy of a migrated store; returns (its run, its wall seconds, its output)."""
    import time

    from mlflow.tracking import MlflowClient

    uri = migrated_store(tmp_path)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vitreg.cli", "bench", "--model", "test_vit", "--img-size", "32",
                           "--batch-size", "2", "--device", "cpu", "--task", "infer", "--experiment", "e2e", *args],
                          env=subprocess_env(uri, PYTHONPATH=str(REPO)), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    wall_s = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    return run, wall_s, done.stdout + done.stderr


@pytest.mark.slow
def test_by_default_bench_times_to_a_precision_target_and_logs_how_long_and_where_its_time_went(tmp_path):
    run, wall_s, output = _bench_process(tmp_path, "--window-min-s", "0.05", "--precision-pct", "2",
                                         "--max-time-s", "5")
    m, tags, params = run.data.metrics, run.data.tags, run.data.params
    assert (params["steps"], params["repeats"], params["precision_pct"]) == ("0", "0", "2.0")
    stop, halfwidth = tags["infer_timing_stop"], m.get("infer_throughput_ci95_halfwidth_pct")
    assert stop in ("precision_met", "max_time", "max_windows"), stop
    # the target met means six windows or more and the half-width within it; missed, the run says so
    assert (stop == "precision_met") == (halfwidth is not None and halfwidth <= 2.0 and m["infer_timed_windows"] >= 6)
    assert stop == "precision_met" or "the precision target 2 % was not reached" in output  # in the one warning line
    # each window lasted at least window_min_s, in whole steps
    assert m["infer_steps_per_window"] >= 1 and m["infer_timed_windows"] >= 1
    # the overhead by phase: every phase before and after the windows, their total, inside the process's life
    phases = {k: v for k, v in m.items() if k.startswith("overhead_") and k != "overhead_total_s"}
    assert {"overhead_import_s", "overhead_setup_s", "overhead_model_s", "overhead_first_call_s",
            "overhead_warmup_s", "overhead_after_windows_s", "overhead_report_s"} <= set(phases)
    assert m["overhead_total_s"] == pytest.approx(sum(phases.values()), rel=1e-6)
    assert 0 < m["overhead_import_s"] and m["overhead_total_s"] < wall_s
    assert m["estimated_work_s"] > 0 and m["work_s"] > 0


@pytest.mark.slow
def test_given_steps_and_repeats_bench_times_exactly_those_counts(sqlite_store):
    """In this process (the counts are the runner's, not the process's: its phases are the test above's)."""
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    result = CliRunner().invoke(main, ["bench", "--model", "test_vit", "--img-size", "32", "--batch-size", "2",
                                       "--device", "cpu", "--task", "infer", "--experiment", "e2e", "--warmup", "2",
                                       "--steps", "3", "--repeats", "2", "--max-time-s", "0"])
    assert result.exit_code == 0, result.output[-3000:]
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    m, tags = run.data.metrics, run.data.tags
    assert tags["infer_timing_stop"] == "fixed" and (m["infer_timed_windows"], m["infer_steps_per_window"]) == (2, 3)
