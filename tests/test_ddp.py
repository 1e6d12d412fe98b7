"""DDP: `-P nproc=N` launches torchrun; one MLflow run; rank 0 logs the job's reduced figures.

The slow tests are real jobs on the CPU (gloo) with the tiny ``test_vit`` at 32 px: two hosts of two
processes (node 0 through ``mlflow run -P nproc=2``, node 1 through the plain ``vitreg bench``), and a
standalone ``--nproc 2`` job whose rank dies hard. The fast tests cover the pieces: the GPU-count check, the reduction rule, torchrun's
command line, and how a failure's root cause is found.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from conftest import REPO, free_port, migrated_store, subprocess_env
from vitreg.measure.energy import FLAGS
from vitreg.ddp import world as distributed
from vitreg.ddp import diagnose as diagnosis
from vitreg.ddp import launcher as launch
from vitreg.errors import VitregError
from vitreg.measure.figures import Figures

TINY = {"model": "test_vit", "img_size": "32", "batch_size": "2", "warmup": "1", "steps": "2", "repeats": "2",
        "task": "train", "device": "cpu"}


def cli_args(options: dict) -> list[str]:
    return launch.options_to_args(options)


def mlflow_params(options: dict) -> list[str]:
    return [arg for k, v in options.items() for arg in ("-P", f"{k}={v}")]


def child_env(uri: str, **extra) -> dict:
    return subprocess_env(uri, MLFLOW_DISABLE_TELEMETRY="true", **extra)


def all_runs(uri: str):
    """Every run in every experiment of the store: "exactly one run" means no stray second one anywhere."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(ids)


def assert_rank0_only_logging(client, run) -> None:
    """Each metric was logged once (a second logging rank would add a second value to its history)."""
    for key in run.data.metrics:
        if key.startswith("system/"):
            continue  # sampled every few seconds by the launcher: many values by design
        history = client.get_metric_history(run.info.run_id, key)
        assert len(history) == 1, (key, [m.value for m in history])


def assert_reduced(client, run, tmp_path, world: int) -> None:
    """Global throughput = per-window sum over ranks; step time = per-iteration max over ranks."""
    m = run.data.metrics
    assert m["train_world_size"] == world
    assert m["train_throughput_img_per_s_per_gpu"] == pytest.approx(m["train_throughput_img_per_s"] / world)
    ranks = json.loads(open(client.download_artifacts(run.info.run_id, "ranks.json", str(tmp_path))).read())["train"]
    assert [r["rank"] for r in ranks] == list(range(world))
    per_window = [sum(ws) for ws in zip(*(r["throughput_img_per_s_windows"] for r in ranks))]
    assert m["train_throughput_img_per_s"] == pytest.approx(statistics.median(per_window))
    assert m["train_step_ms_p50"] >= max(r["iter_ms_p50"] for r in ranks) * (1 - 1e-9)


# --------------------------------------------------------------------------------------------
# end to end (CPU, gloo)


# Records, in each launcher (not in torchrun, not in a rank), whether it imported timm or torchvision: a
# launcher is `vitreg bench`, `vitreg train` or the entry point that `mlflow run` starts. And in each rank
# (LOCAL_RANK set) the mlflow modules it imported, at its end: importing mlflow costs a process ~2.8 s of
# CPU, and a rank of a vitreg launcher only writes the hand-off journal (rank 0) or nothing.
# (sys.argv is read at exit: while sitecustomize runs, `-m`'s module is not in it yet.)
LAUNCHER_IMPORTS = """
import atexit, json, os, sys
LAUNCHERS = tuple(os.path.join(*p) for p in (("vitreg", "cli", "__main__.py"), ("entry_points", "bench.py"),
                                             ("entry_points", "train.py")))
def _record():
    if "LOCAL_RANK" in os.environ:
        with open(os.path.join(os.environ["RECORD_DIR"], f"rank-{os.environ['RANK']}.json"), "w") as fh:
            json.dump(sorted(m for m in sys.modules if m.split(".")[0] == "mlflow"), fh)
    elif sys.argv[0].endswith(LAUNCHERS):
        with open(os.path.join(os.environ["RECORD_DIR"], f"launcher-{os.getpid()}.json"), "w") as fh:
            json.dump({m: m in sys.modules for m in ("timm", "torchvision")}, fh)
atexit.register(_record)
"""


def record_imports(tmp_path) -> Path:
    """A folder holding :data:`LAUNCHER_IMPORTS` as a sitecustomize (put it first on the PYTHONPATH of the
    launchers: their ranks inherit it), where the records go (RECORD_DIR)."""
    record = tmp_path / "record"
    record.mkdir()
    (record / "sitecustomize.py").write_text(LAUNCHER_IMPORTS)
    return record


def ranks_imported_mlflow(record: Path, world: int) -> dict:
    """Each rank's record: the mlflow modules it imported (a rank that left none fails the asking test)."""
    found = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in record.glob("rank-*.json")}
    assert sorted(found) == list(range(world)), found
    return found


@pytest.mark.slow
def test_two_hosts_of_two_processes_make_one_run_logged_by_node_0(tmp_path):
    """A bench on two hosts of two processes each (nnodes=2, one rendezvous endpoint): node 0 started by
    `mlflow run -e bench -P nproc=2 ...`, node 1 by the plain `vitreg bench --nproc 2 --node-rank 1`.

    One run, mlflow's, resumed by node 0's launcher (node 1's opens none). It holds the figures of four
    ranks reduced, rank 0's logging alone, node 0's rank logs, the scaling efficiency against a
    baseline, gloo's all-reduce time (profile_steps=2) and report.md with the command the user typed.
    The launchers check the model without importing timm (an earlier process listed it). (The
    standalone `--nproc 2` path: the killed-rank test below.)"""
    from vitreg.models import families, memory

    families.all_names(listed_before_ok=False)  # timm's listing: what any earlier job leaves in the user's cache
    memory.footprint(TINY["model"], int(TINY["img_size"]))
    uri = migrated_store(tmp_path)
    record = record_imports(tmp_path)
    env = child_env(uri, PYTHONPATH=os.pathsep.join([str(record), str(REPO)]), RECORD_DIR=str(record))
    base_id = fake_baseline_run(uri, throughput=100.0)
    options = {**TINY, "nproc": "2", "profile_steps": "2", "baseline_run": base_id,
               "nnodes": "2", "rdzv_endpoint": f"127.0.0.1:{free_port()}"}
    node0 = [sys.executable, "-m", "mlflow", "run", str(REPO), "-e", "bench", "--env-manager", "local",
             "--experiment-name", "ddp4", *mlflow_params({**options, "node_rank": "0"})]
    node1 = [sys.executable, "-m", "vitreg.cli", "bench", *cli_args({**options, "node_rank": "1"})]
    procs = [subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in (node0, node1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    client, runs = all_runs(uri)
    runs = [r for r in runs if r.data.tags.get("vitreg_job") == "bench"]
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]  # the launcher resumed mlflow's run
    run = runs[0]
    tags, m = run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "ddp4"
    assert run.data.params["nproc"] == "2" and tags["world_size"] == "4" and tags["nnodes"] == "2"
    assert tags["dist_backend"] == "gloo"
    name = " · ".join(w for w in run.info.run_name.split(" · ") if w not in FLAGS)  # the flags a loaded host earns
    assert name.startswith("cpu · ") and " · test_vit img32 · " in name and name.endswith(" · x4")  # the GPU first
    assert f"logged run {run.info.run_id}" in outs[0][0] and "logged run" not in outs[1][0]
    assert_rank0_only_logging(client, run)
    assert_reduced(client, run, tmp_path, 4)
    assert any(k.startswith("system/") for k in m), "the launcher samples system metrics"
    assert m["train_scaling_efficiency"] == pytest.approx(m["train_throughput_img_per_s"] / (4 * 100.0))
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "ranks.json", "report.md", "torchrun"} <= arts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "torchrun")} == {"torchrun/rank0", "torchrun/rank1",
                                                                                 "torchrun/torchrun.log"}
    # report.md shows what the user typed, not the launcher's generated line for the ranks
    report = open(client.download_artifacts(run.info.run_id, "report.md", str(tmp_path))).read()
    assert "mlflow run . -e bench" in report and "-P nproc=2" in report and "-P nnodes=2" in report, report
    assert "vitreg bench --" not in report and "--ddp-bucket-mb" not in report, report
    # rank 0 speaks for the job: its progress shows (prefixed), no other rank's does
    assert "[rank0]: [vitreg] train: window 2/2" in outs[0][1]
    assert not any(f"[rank{r}]: [vitreg]" in err for _, err in outs for r in (1, 2, 3))
    # profile_steps=2: gloo's all-reduce time per step, from the profiler after the windows (no device on CPU)
    assert m["train_allreduce_ms_per_step"] > 0
    assert "train_device_busy_ms_per_step" not in m
    launchers = [json.loads(f.read_text()) for f in record.glob("launcher-*.json")]
    assert launchers == [{"timm": False, "torchvision": False}] * 2, launchers
    # no rank imported mlflow: rank 0 handed its calls to node 0's launcher, the others logged nothing
    assert ranks_imported_mlflow(record, 4) == {rank: [] for rank in range(4)}


@pytest.mark.slow
def test_rank_killed_hard_fails_the_run(tmp_path):
    """Rank 0 dies by SIGKILL (as under the OOM killer), so it cannot end the run the launcher opened:
    the launcher must, FAILED, with rank 0's last error line; nothing stays RUNNING.

    The crash is injected through a sitecustomize on the workers' PYTHONPATH (only torchrun's
    workers have RANK set), at interpreter start-up, to keep the test short.
    """
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, signal, sys
        if os.environ.get("RANK") == "0" and "LOCAL_RANK" in os.environ:
            print("RuntimeError: simulated hard crash of rank 0", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    uri = migrated_store(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "vitreg.cli", "bench", *cli_args({**TINY, "nproc": "2"})],
                          env=child_env(uri, PYTHONPATH=os.pathsep.join([str(inject), str(REPO)])), cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # a signal has no exit status of its own to pass on
    last = proc.stderr.strip().splitlines()[-1]
    client, runs = all_runs(uri)
    assert len(runs) == 1
    run = runs[0]
    # the signal torchrun's summary saw, the rank's last words, and where the tracebacks are kept
    assert last == (f"error: rank 0: killed by SIGKILL (as the OOM killer does when the host runs out of memory); "
                    f"its last error line: RuntimeError: simulated hard crash of rank 0 (tracebacks and "
                    f"torchrun's output: artifacts torchrun/ of run {run.info.run_id})"), proc.stderr[-3000:]
    assert run.info.status == "FAILED"
    assert run.data.tags["vitreg_error"] == last[len("error: "):]
    # the ranks never logged, yet the launcher labelled the run: it is found by model, job and params
    assert run.data.tags["model"] == TINY["model"] and run.data.tags["vitreg_job"] == "bench"
    assert run.data.params["nproc"] == "2" and run.data.params["batch_size"] == TINY["batch_size"]
    logs = {a.path for a in client.list_artifacts(run.info.run_id, "torchrun/rank0")}
    assert "torchrun/rank0/stderr.log" in logs


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_under_the_launcher_hands_off_or_logs_nothing(sqlite_store, tmp_path, monkeypatch, rank):
    """Under a vitreg launcher, rank 0's tracker writes the hand-off journal and any other rank's does nothing;
    both name the launcher's run and the tracking URI from the environment. (That no rank imports mlflow, for
    it all: the real ranks of the two-host jobs here and in tests/test_train_ddp.py record it.)"""
    from vitreg.tracking import runs as tracking
    from vitreg.tracking.handoff import HandoffReader, announce_run

    announce_run(tmp_path / "handoff", "r" * 32, "1")
    # the store as MLflow's environment and global state both name it: in this process an earlier test may have
    # set MLflow's URI (a real rank never imports mlflow, and reads the environment)
    uri = sqlite_store
    for name, value in {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": "2",
                        launch.ENV_LAUNCH_DIR: str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    reader = HandoffReader(tmp_path / "handoff")
    with launch.rank_run() as tracker:
        tracker.set_tags({"gpu": "cpu"})
        tracker.log_metrics({"infer_throughput_img_per_s": 1.0})
        printed = f"{tracking.tracking_uri()} {tracking.where_logged(tracker)} {type(tracker).__name__}"
    assert printed.startswith(f"{uri} logged run ")
    assert printed.endswith("HandoffTracker" if rank == 0 else "NullTracker")
    assert bool(reader.read_new()) == (rank == 0)  # rank 0's calls are in the journal; rank 1 wrote none


def test_bad_model_refused_before_launching(sqlite_store):
    """Checks that need no GPU run once, in the launcher: one error, exit 2; a typo of the model is refused
    before any run exists (the store stays empty)."""
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    result = CliRunner().invoke(main, ["bench", *cli_args({**TINY, "nproc": "2", "model": "test_vti"})])
    assert result.exit_code == 2, result.output
    assert result.output.count("error: ") == 1 and "did you mean test_vit" in result.output
    assert "launching" not in result.output
    client = MlflowClient()
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_cuda_graph_on_cpu_refused_before_launching(sqlite_store):
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    result = CliRunner().invoke(main, ["bench", *cli_args({**TINY, "nproc": "2", "cuda_graph": "true"})])
    assert result.exit_code == 2, result.output
    assert result.output.count("error: ") == 1 and "cuda_graph=true needs a CUDA GPU" in result.output
    assert "launching" not in result.output
    runs = MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()])
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert "cuda_graph=true needs a CUDA GPU" in runs[0].data.tags["vitreg_error"]


def fake_baseline_run(uri: str, throughput: float) -> str:
    """A finished 1-process run of the TINY config, as bench would have logged it."""
    from mlflow.tracking import MlflowClient

    from vitreg.tracking.store import create_experiment

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("baseline") or client.get_experiment(create_experiment(client, "baseline"))
    run = client.create_run(exp.experiment_id, tags={
        "model": "test_vit", "gpu": "cpu", "amp": "off", "compile": "off", "batch_size": "2", "img_size": "32",
        "device": "cpu", "vitreg_job": "baseline"})
    client.log_param(run.info.run_id, "nproc", "1")
    client.log_metric(run.info.run_id, "train_throughput_img_per_s", throughput)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


# --------------------------------------------------------------------------------------------
# the pieces


@pytest.mark.parametrize("nproc,device,gpus", [(4, "cpu", 0), (4, "auto", 0), (2, "auto", 2), (2, "cuda", 8),
                                               (1, "cuda", 0), (8, "cpu", 2)])
def test_check_nproc_allows(nproc, device, gpus):
    launch.check_nproc(nproc, device, gpus)


@pytest.mark.parametrize("nproc,device,gpus,needle", [
    (4, "cuda", 2, "nproc=4 but only 2 CUDA GPUs are visible: use nproc<=2"),
    (4, "auto", 2, "nproc=4 but only 2 CUDA GPUs are visible: use nproc<=2"),
    (2, "cuda", 1, "nproc=2 but only 1 CUDA GPU is visible: use nproc<=1"),
    (2, "cuda", 0, "no CUDA GPU is visible"),
])
def test_check_nproc_refuses_more_processes_than_gpus(nproc, device, gpus, needle):
    with pytest.raises(VitregError, match=needle.replace("(", r"\(")):
        launch.check_nproc(nproc, device, gpus)


def test_check_nodes():
    launch.check_nodes(1, 0, None)
    launch.check_nodes(2, 1, "10.0.0.1:29500")
    for args, needle in [((2, 0, None), "needs rdzv_endpoint=HOST:PORT"), ((2, 2, "h:1"), "node_rank=2 must be in 0..1"),
                         ((2, 0, "nohost"), "is not HOST:PORT"), ((0, 0, None), "nnodes=0")]:
        with pytest.raises(VitregError, match=needle):
            launch.check_nodes(*args)


def test_torchrun_command_single_and_multi_node(tmp_path):
    argv = ["-m", "vitreg.cli", "bench", "--nproc", "2"]
    one = launch.torchrun_command(argv, 2, log_dir=str(tmp_path))
    assert one[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in one and "--nproc-per-node=2" in one and "--max-restarts=0" in one
    # the workers' own options come after "--", out of reach of torchrun's option parser
    assert one[one.index("vitreg.ddp.launcher") + 1:] == ["--", *argv]
    # only options torch 2.2+ knows: torch 2.11's torchrun passed --log-line-prefix-template on to
    # the workers' python (exit 2 on the H200s); the rank prefix comes from LINE_PREFIX_ENV instead
    assert not any(c.startswith("--log-line-prefix") for c in one)
    multi = launch.torchrun_command(argv, 8, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    assert "--standalone" not in multi
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-endpoint=node0:29500"} <= set(multi)


def test_options_to_args_round_trip_through_click():
    from vitreg.cli.common import command_options
    import click

    seen = {}

    @click.command()
    @command_options("bench")
    def cmd(**kwargs):
        seen.update(kwargs)

    options = {**TINY, "nproc": "2", "compile": "default", "allow_gpu_mismatch": True, "gpu": None}
    result = CliRunner().invoke(cmd, launch.options_to_args(options))
    assert result.exit_code == 0, result.output
    assert seen["compile"] == "default" and seen["nproc"] == "2" and seen["allow_gpu_mismatch"] == "true"
    assert seen["batch_size"] == "2" and seen["gpu"] == "auto"  # None: not passed, the default applies


def _rank(windows, iters, first, warm, alloc=None, reserved=None):
    return Figures("train", {"window_img_per_s": windows, "step_ms": iters, "first_call_s": first,
                             "warmup_s": warm, "peak_mem_allocated_mb": alloc, "peak_mem_reserved_mb": reserved})


def test_reduce_figures_sums_rates_and_takes_the_slowest_step():
    a = _rank((100.0, 110.0, 90.0), (10.0, 12.0, 11.0, 9.0), 2.0, 0.5, 100.0, 120.0)
    b = _rank((95.0, 105.0, 100.0), (11.0, 10.0, 13.0, 9.5), 3.0, 0.4, 110.0, 115.0)
    total = distributed.reduce_figures([a, b])
    assert total["window_img_per_s"] == (195.0, 215.0, 190.0)
    assert total["step_ms"] == (11.0, 12.0, 13.0, 9.5)
    assert (total["first_call_s"], total["warmup_s"]) == (3.0, 0.5)
    assert (total["peak_mem_allocated_mb"], total["peak_mem_reserved_mb"]) == (110.0, 120.0)
    cpu = _rank((1.0,), (1.0,), 0.0, 0.0)
    assert distributed.reduce_figures([cpu, cpu])["peak_mem_allocated_mb"] is None
    with pytest.raises(ValueError, match="different"):
        distributed.reduce_figures([a, cpu])


def test_task_result_from_reducer_is_global_and_mfu_per_gpu():
    """The runner's figures under a reducer: throughput of the job, MFU against ONE GPU's peak."""
    from vitreg.hardware.profiles import PROFILES, DetectedHardware, ResolvedHardware
    from vitreg.models.factory import ModelInfo
    from vitreg.bench.runner import _Bench, _job_figures
    from vitreg.hardware.runtime import Runtime
    from vitreg.config.spec import BenchSpec

    class TwoIdenticalRanks:
        world_size = 2

        def align(self):
            pass

        def __call__(self, task, figures):
            return distributed.reduce_figures([figures, figures])

    spec = BenchSpec(model="test_vit", batch_size=8, steps=2, repeats=2, nproc=2)
    info = ModelInfo("test_vit", "timm", 32, 16, 1000, 0.4, False)
    profile = PROFILES["h100"]
    hw = ResolvedHardware("h100", profile, DetectedHardware("cuda", "H100", 2, profile), False)
    rt = Runtime("cpu", "bf16", "off")  # MFU only needs the profile
    rank = _rank((800.0, 800.0), (10.0, 10.0, 10.0, 10.0), 1.0, 0.1)  # 8 img / 10 ms = 800 img/s per rank
    single = _job_figures(rank, _Bench(spec, rt, hw, info), 1e9)
    double = _job_figures(rank, _Bench(spec, rt, hw, info, reducer=TwoIdenticalRanks()), 1e9)
    assert single["throughput_img_per_s"] == pytest.approx(800.0) and single["world_size"] is None
    assert double["throughput_img_per_s"] == pytest.approx(1600.0) and double["world_size"] == 2
    assert double.metrics()["train_throughput_img_per_s_per_gpu"] == pytest.approx(800.0)
    assert double["achieved_tflops"] == pytest.approx(2 * single["achieved_tflops"])
    assert double["mfu"] == pytest.approx(single["mfu"]) == pytest.approx(single["achieved_tflops"] / profile.peak_tflops["bf16"])


@pytest.mark.parametrize("text,line", [
    ("[vitreg] train: window 1/2\nerror: img_size=30 is not a multiple of 16\n", "img_size=30 is not a multiple of 16"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\n    raise RuntimeError('boom')\n"
     "RuntimeError: boom\n", "RuntimeError: boom"),
    ("torch.distributed.DistBackendError: NCCL error in: x\n[W] warning after\n",
     "torch.distributed.DistBackendError: NCCL error in: x"),
    ("[vitreg] all fine\nUserWarning: something\n", None),
    ("", None),
])
def test_last_error_line(text, line):
    assert diagnosis.last_error_line(text) == line


def fake_logs(tmp_path, stderr_by_rank: dict, errors: dict | None = None):
    """torchrun's log folder: each rank's stderr, and the error files of ``errors`` ({rank: (message, code)}),
    written in that order (the first written is the root cause)."""
    for rank, text in stderr_by_rank.items():
        d = tmp_path / "job_abc" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text(text)
        (d / "stdout.log").write_text("")
    for when, (rank, (message, code)) in enumerate((errors or {}).items()):
        path = tmp_path / "job_abc" / "attempt_0" / str(rank) / "error.json"
        path.write_text(json.dumps({"message": {"message": message, "errorCode": code,
                                                "extraInfo": {"py_callstack": "", "timestamp": "0"}}}))
        os.utime(path, (1000.0 + when, 1000.0 + when))
    return tmp_path


def test_diagnose_takes_the_first_error_file_and_its_exit_status(tmp_path):
    logs = fake_logs(tmp_path, {0: "RuntimeError: Connection closed by peer\n", 1: "error: img_size=30 is not a multiple of 16\n"},
                     errors={1: ("img_size=30 is not a multiple of 16", 2), 0: ("RuntimeError: Connection closed by peer", 1)})
    out = diagnosis.diagnose(1, logs, nproc=2)
    assert (out.rank, out.exit_code) == (1, 2)  # a VitregError's exit 2 survives torchrun's blanket 1
    assert out.message == "rank 1: img_size=30 is not a multiple of 16"
    assert set(out.rank_logs()) == {0, 1}
    on_node_1 = diagnosis.diagnose(1, logs, nproc=2, node_rank=1)
    assert on_node_1.rank == 3 and set(on_node_1.rank_logs()) == {2, 3}  # global ranks: node-major


def test_diagnose_names_the_rank_that_died_not_the_ones_torchrun_stopped_after_it(tmp_path):
    # rank 0 SIGKILLed (no error file, its last words on stderr); torchrun then stops rank 1 with SIGTERM,
    # which records exit 143 first in time: the consequence must not be named the cause
    logs = fake_logs(tmp_path, {0: "RuntimeError: simulated hard crash of rank 0\n",
                                1: "error: stopped by SIGTERM; the run is marked KILLED\n"}, errors={1: ("", 143)})
    out = diagnosis.diagnose(1, logs, nproc=2)
    assert (out.rank, out.exit_code, out.message) == (0, 1, "rank 0: RuntimeError: simulated hard crash of rank 0")
    # the whole job stopped from outside: every rank stopped, the first one names it, with its 143
    stopped = fake_logs(tmp_path / "stopped", {0: "error: stopped by SIGTERM; the run is marked KILLED\n",
                                               1: "error: stopped by SIGTERM; the run is marked KILLED\n"},
                        errors={1: ("", 143), 0: ("", 143)})
    out = diagnosis.diagnose(1, stopped, nproc=2)
    assert (out.rank, out.exit_code) == (1, 143) and out.message == "rank 1: stopped by SIGTERM; the run is marked KILLED"


TORCHRUN_SUMMARY = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
vitreg.ddp.launcher FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_09:00:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 12)
  error_file: /tmp/x/1/error.json
  traceback : RuntimeError: Connection closed by peer
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_09:00:00
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 11) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 11
============================================================
"""


def test_diagnose_names_a_rank_killed_by_sigkill_over_its_peer_s_lost_connection(tmp_path):
    # rank 0 SIGKILLed: no error file, nothing on its stderr; rank 1 fails on the closed connection first
    logs = fake_logs(tmp_path, {0: "[vitreg] step 5/100\n", 1: "RuntimeError: Connection closed by peer\n"},
                     errors={1: ("RuntimeError: [pair.cc:561] Connection closed by peer", 1)})
    assert diagnosis.killed_ranks(TORCHRUN_SUMMARY) == {0: -9}
    out = diagnosis.diagnose(1, logs, nproc=2, torchrun_text=TORCHRUN_SUMMARY)
    assert (out.rank, out.exit_code) == (0, 1), out
    assert out.message == "rank 0: killed by SIGKILL (as the OOM killer does when the host runs out of memory)"
    # the SIGTERM with which torchrun stops the survivors is not a kill of its own
    assert diagnosis.killed_ranks(TORCHRUN_SUMMARY.replace("-9 (pid: 11) (SIGKILL)", "-15 (pid: 11) (SIGTERM)")) == {}


def test_diagnose_names_the_stopped_rank_over_its_peer_s_lost_connection(tmp_path):
    """CI once: SIGTERM to rank 0, whose peer recorded "Connection closed by peer" (exit 1) before rank 0 wrote
    its own stop; the lost connection follows the stop and must not be named the cause."""
    lost = ("RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:16296", 1)
    stop_line = "[vitreg] stopped by SIGTERM: stopped at step 6/100000; final checkpoint step-6\n"
    later = fake_logs(tmp_path / "later", {0: stop_line + "error: stopped by SIGTERM\n", 1: lost[0] + "\n"},
                      errors={1: lost, 0: ("", 143)})
    out = diagnosis.diagnose(1, later, nproc=2)
    assert (out.rank, out.exit_code, out.message) == (0, 143, "rank 0: stopped by SIGTERM")
    # rank 0 ended before it wrote any record: torchrun's summary gives its status
    summary = TORCHRUN_SUMMARY.replace("-9 (pid: 11) (SIGKILL)", "143 (pid: 11)")
    silent = fake_logs(tmp_path / "silent", {0: stop_line, 1: lost[0] + "\n"}, errors={1: lost})
    out = diagnosis.diagnose(1, silent, nproc=2, torchrun_text=summary)
    assert (out.rank, out.exit_code, out.message) == (0, 143, "rank 0: stopped by SIGTERM")
    # with nothing else to go by, the lost connection is still said
    assert diagnosis.diagnose(1, silent, nproc=2).message == f"rank 1: {lost[0]}"


def test_diagnose_names_torchrun_itself_when_it_was_stopped(tmp_path):
    logs = fake_logs(tmp_path, {0: "error: stopped by SIGTERM\n", 1: "error: stopped by SIGTERM\n"},
                     errors={0: ("", 143), 1: ("", 143)})
    text = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 got signal: 15\n"
    out = diagnosis.diagnose(1, logs, nproc=2, torchrun_text=text)
    assert (out.rank, out.exit_code, out.message) == (None, 143, "torchrun was stopped by SIGTERM, and its ranks with it")
    assert launch.LaunchError(out.message, out.exit_code).run_status == "KILLED"
    assert launch.LaunchError("rank 1: ValueError: nope", 1).run_status == "FAILED"


def test_the_console_gets_the_ranks_lines_without_tracebacks_error_lines_or_torchrun_s_own(tmp_path):
    lines = [b"W1202 torch/distributed/run.py:1 Setting OMP_NUM_THREADS\n",
             b"[rank0]: [vitreg] step 5/100  loss 2.3\n",
             b"[rank1]: [rank1]: Traceback (most recent call last):\n",
             b"[rank0]: [vitreg] step 10/100  loss 2.1\n",
             b'[rank1]:   File "x.py", line 3, in <module>\n',
             b"[rank1]:     boom()\n",
             b"[rank1]: RuntimeError: Connection closed by peer\n",
             b"[rank1]: \n",
             b"[rank1]: During handling of the above exception, another exception occurred:\n",
             b"[rank1]: Traceback (most recent call last):\n",
             b'[rank1]:   File "y.py", line 1\n',
             b"[rank1]: KeyError: 'x'\n",
             b"[rank0]: error: stopped by SIGTERM\n",
             b"Traceback (most recent call last):\n",
             b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
             b"[rank0]: [vitreg] stopped at step 10/100\n"]
    lines.append(b"[rank0]: [rank0]: [vitreg] step 15/100  loss 2.0\n")  # torch 2.11 prefixes copied lines again
    forwarder = launch._Forwarder(None, tmp_path / "torchrun.log")
    shown = [forwarder.console_line(line) for line in lines]
    assert [line for line in shown if line is not None] == [lines[1], lines[3], lines[-2],
                                                            b"[rank0]: [vitreg] step 15/100  loss 2.0\n"]


def test_diagnose_fallbacks(tmp_path):
    # an error file without a message (the shim's record of a bare sys.exit(3)): the stderr's last error line
    logs = fake_logs(tmp_path, {0: "[vitreg] run ...\n", 1: "ValueError: nope\n"}, errors={1: ("", 3)})
    assert (diagnosis.diagnose(1, logs, nproc=2).message, diagnosis.diagnose(1, logs, nproc=2).exit_code) == (
        "rank 1: ValueError: nope", 3)
    # no error file (killed by a signal): the first rank whose stderr ends with an error, torchrun's status
    bare = fake_logs(tmp_path / "bare", {0: "", 1: "RuntimeError: simulated hard crash\n"})
    killed = diagnosis.diagnose(1, bare, nproc=2)
    assert killed.message == "rank 1: RuntimeError: simulated hard crash" and killed.exit_code == 1
    silent = fake_logs(tmp_path / "silent", {0: ""}, errors={0: ("", 1)})
    assert diagnosis.diagnose(1, silent, nproc=1).message == "rank 0 exited with status 1 without an error message (killed?)"
    assert "no rank reported an error" in diagnosis.diagnose(1, fake_logs(tmp_path / "none", {0: ""}), nproc=1).message
    assert diagnosis.diagnose(0, bare, nproc=2).ok


@pytest.mark.parametrize("script,status,message", [
    ("import sys\nprint('error: nope', file=sys.stderr)\nsys.exit(2)\n", 2, ""),
    ("raise RuntimeError('boom')\n", 1, "RuntimeError: boom"),
])
def test_worker_shim_writes_the_error_file(tmp_path, monkeypatch, script, status, message):
    path = tmp_path / "w.py"
    path.write_text(script)
    error_file = tmp_path / "0" / "error.json"
    monkeypatch.setenv(diagnosis.ERROR_FILE_ENV, str(error_file))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert launch.worker_main(["--", str(path)]) == status
    error = json.loads(error_file.read_text())["message"]
    assert error["errorCode"] == status and error["message"] == message
    assert int(error["extraInfo"]["timestamp"]) > 0  # torch elastic's format: torchrun's summary reads it too


def test_cli_error_in_a_worker_goes_to_its_error_file(sqlite_store, tmp_path, monkeypatch):
    """vitreg's one-line message is what the launcher shows: the CLI writes it before the shim's exit record."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(diagnosis.ERROR_FILE_ENV, str(error_file))
    from vitreg.cli.main import main

    result = CliRunner().invoke(main, ["bench", *cli_args({**TINY, "model": "test_vti"})])
    assert result.exit_code == 2
    error = json.loads(error_file.read_text())["message"]
    assert error["errorCode"] == 2 and "did you mean test_vit" in error["message"]
    assert f"error: {error['message']}" in result.output
    diagnosis.record_error("a later failure", 1)  # the first failure recorded wins
    assert json.loads(error_file.read_text())["message"]["message"] == error["message"]


def test_scaling_efficiency_checks_the_baseline(sqlite_store):
    from mlflow.tracking import MlflowClient

    from vitreg.bench import job as bench_mod
    from vitreg.config.spec import BenchSpec

    spec = BenchSpec(**{**TINY, "nproc": "2"})
    base_id = fake_baseline_run(sqlite_store, throughput=100.0)
    base = bench_mod.read_baseline(base_id, spec)
    assert bench_mod.scaling_efficiency(base.metrics, {"train_throughput_img_per_s": 180.0}, 2) == {
        "train_scaling_efficiency": pytest.approx(0.9)}
    with pytest.raises(VitregError, match="another config"):
        bench_mod.read_baseline(base_id, spec.replace(batch_size=4))
    MlflowClient().set_tag(base_id, "cuda_graph", "false")
    with pytest.raises(VitregError, match="cuda_graph=false there, true here"):
        bench_mod.read_baseline(base_id, spec.replace(cuda_graph=True))
    with pytest.raises(VitregError, match="cannot be read"):
        bench_mod.read_baseline("0" * 32, spec)
    client = MlflowClient()
    multi = fake_baseline_run(sqlite_store, throughput=100.0)
    client.log_metric(multi, "train_world_size", 2)
    with pytest.raises(VitregError, match="must be a 1-process"):
        bench_mod.read_baseline(multi, spec)


def test_single_process_path_untouched_by_torchrun_env(monkeypatch):
    """nproc=1 on one host runs here; inside torchrun, bench never relaunches (it runs as a rank)."""
    assert not launch.needs_torchrun(1)
    assert launch.needs_torchrun(2)
    assert launch.needs_torchrun(1, nnodes=2)  # one process on each of two hosts
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.inside_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.init_from_env("cpu") == distributed.World(0, 0, 1, "cpu", None, 1)  # no process group


def test_a_rank_reports_the_command_its_launcher_was_typed_as(monkeypatch):
    """report.md's command: in a rank of a vitreg launcher, what the launcher was given (the plain
    `vitreg bench --nproc 2` line or the `mlflow run` one); outside one, the caller's text or this
    process's own argv."""
    monkeypatch.setattr(sys, "argv", ["vitreg", "bench", "--nproc", "2"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(launch.ENV_LAUNCH_DIR, raising=False)
    monkeypatch.setenv(launch.ENV_COMMAND, "vitreg bench --nproc 2 --nnodes 2")
    assert launch.typed_command() == "vitreg bench --nproc 2"  # not a rank: the environment is not read
    assert launch.typed_command("mlflow run . -e bench -P nproc=2") == "mlflow run . -e bench -P nproc=2"
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(launch.ENV_LAUNCH_DIR, "/tmp/launch")
    monkeypatch.setattr(sys, "argv", ["-m", "vitreg.cli", "bench", "--ddp-bucket-mb", "25"])
    assert launch.typed_command() == "vitreg bench --nproc 2 --nnodes 2"
    assert launch.typed_command("python entry_points/bench.py") == "vitreg bench --nproc 2 --nnodes 2"


def test_launcher_run_only_on_node_0(sqlite_store, monkeypatch):
    """Node 0 owns the job's run; another node's launcher opens none (unless `mlflow run` made one)."""
    with launch.launcher_run(node_rank=1) as run:
        assert run is None
    with launch.launcher_run(run_name="x", node_rank=0) as run:
        assert run is not None and run.run_id


def test_ddp_wrap_applies_the_bucket_size_static_graph_and_comm_hook(tmp_path):
    """A real DistributedDataParallel over a one-process gloo group (the World claims two ranks so
    that ddp_wrap wraps at all: the settings are what is tested, not the communication)."""
    import torch
    import torch.distributed as dist

    from vitreg.ddp.world import World, ddp_wrap
    from vitreg.config.spec import BenchSpec

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        world = World(rank=0, local_rank=0, world_size=2, device="cpu", backend="gloo")
        spec = BenchSpec(ddp_bucket_mb="2", ddp_static_graph="true")
        ddp = ddp_wrap(torch.nn.Linear(4, 4), world, **spec.ddp_options())
        assert ddp.bucket_bytes_cap == 2 * 1024 * 1024 and ddp.static_graph is True
        default = ddp_wrap(torch.nn.Linear(4, 4), world, **BenchSpec().ddp_options())
        assert default.bucket_bytes_cap == 25 * 1024 * 1024 and default.static_graph is False
        assert ddp_wrap(lin := torch.nn.Linear(4, 4), World(), **spec.ddp_options()) is lin  # one process

        # comm_hook=bf16: the gradients come back through a bf16 all-reduce, so they are bf16 values
        def grads(comm_hook):
            torch.manual_seed(0)
            net = ddp_wrap(torch.nn.Linear(64, 64), world, comm_hook=comm_hook)
            net(torch.randn(8, 64)).square().sum().backward()
            return net.module.weight.grad

        plain, hooked = grads("none"), grads("bf16")
        assert torch.equal(hooked, hooked.bfloat16().float()) and not torch.equal(plain, plain.bfloat16().float())
        assert torch.allclose(hooked, plain, rtol=1e-2, atol=1e-3)
    finally:
        dist.destroy_process_group()


def test_profile_comm_counts_gloo_all_reduce_and_nothing_else(tmp_path):
    import torch
    import torch.distributed as dist

    from vitreg.measure.traces import profile_comm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        grad = torch.ones(10_000)
        with_comm = profile_comm(lambda: dist.all_reduce(grad), 3, "cpu")
        without = profile_comm(lambda: grad * 2, 3, "cpu")
    finally:
        dist.destroy_process_group()
    assert with_comm.steps == 3 and with_comm.allreduce_ms_per_step > 0 and with_comm.device_busy_ms_per_step is None
    assert without.allreduce_ms_per_step == 0


def test_handoff_replays_rank0_calls_into_the_launchers_run(sqlite_store, tmp_path):
    """Rank 0's tracker calls, written down and read back as they come, land in the launcher's run
    as if rank 0 had made them; the launcher reads the job's figures from the hand-off itself."""
    from mlflow.tracking import MlflowClient

    from vitreg.tracking import handoff
    from vitreg.tracking import runs as tracking

    folder = tmp_path / "handoff"
    ckpt = tmp_path / "work" / "checkpoints" / "step-2"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    with tracking.tracked_run(run_name="launcher", system_metrics=False) as run:
        handoff.announce_run(folder, run.run_id, run.experiment_id)
        rank0 = handoff.HandoffTracker(folder)
        assert rank0.run_id == run.run_id and rank0.artifact_uri("x") == f"runs:/{run.run_id}/x"
        reader = handoff.HandoffReader(folder)
        assert reader.read_new() == []  # nothing written yet
        rank0.set_name("bench-ddp2")
        rank0.log_params({"nproc": 2})
        rank0.log_metrics({"train_loss": 2.0}, step=2)
        handoff.replay(folder, reader.read_new(), run, progress=lambda message: None)  # while the job runs
        rank0.set_tags({"gpu": "cpu", "mlflow.user": "no", "empty": None})
        rank0.log_metrics({"train_throughput_img_per_s": 400.0, "train_world_size": 2})
        rank0.log_dict({"tasks": [1]}, "results.json")
        rank0.log_artifacts(ckpt, "checkpoints/step-2")
        assert rank0.hand_back_registration(ckpt, "tiny", "champion", {"steps": 2}) is None  # the launcher's
        shutil.rmtree(tmp_path / "work")  # rank 0's own folder goes: the hand-off kept copies
        with open(folder / handoff.CALLS, "a") as out:
            out.write('{"call": "set_tags", "tags": {"cut": ')  # a rank killed mid-line
        handoff.replay(folder, reader.read_new(), run, progress=lambda message: None)
    handed = reader.handoff
    assert handed.metrics == {"train_throughput_img_per_s": 400.0, "train_world_size": 2.0}
    assert handed.tags == {"gpu": "cpu"}
    request = handed.registration
    assert request["name"] == "tiny" and request["tags"] == {"steps": 2}
    assert (request["path"] / "model.safetensors").read_bytes() == b"weights"
    assert request["path"].parent.name == "checkpoints"  # so the registry names it as a run artifact

    client = MlflowClient()
    logged = client.get_run(run.run_id)
    assert logged.info.run_name == "bench-ddp2" and logged.data.params == {"nproc": "2"}
    assert logged.data.tags["gpu"] == "cpu" and "cut" not in logged.data.tags
    assert logged.data.metrics["train_throughput_img_per_s"] == 400.0
    assert [m.step for m in client.get_metric_history(run.run_id, "train_loss")] == [2]
    assert {a.path for a in client.list_artifacts(run.run_id)} >= {"results.json", "checkpoints"}
    assert [a.path for a in client.list_artifacts(run.run_id, "checkpoints/step-2")] == [
        "checkpoints/step-2/model.safetensors"]


@pytest.mark.slow
def test_adaptive_windows_under_ddp_are_the_same_windows_on_every_rank(tmp_path):
    """repeats=0 and steps=0 with nproc=2: rank 0's window length and stopping decision hold on every rank (a
    collective between windows), so the ranks time the same windows and their samples combine."""
    uri = migrated_store(tmp_path)
    # windows of 0.05 s for at most 1 s: over 6 windows (the fewest a precision stop needs) with room to spare,
    # while both ranks spin for a quarter of the former 4 s
    options = {**TINY, "nproc": "2", "steps": "0", "repeats": "0", "window_min_s": "0.05", "max_time_s": "1"}
    proc = subprocess.run([sys.executable, "-m", "vitreg.cli", "bench", *cli_args(options)],
                          env=child_env(uri, PYTHONPATH=str(REPO)), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, (run,) = all_runs(uri)
    assert run.info.status == "FINISHED"
    assert run.data.tags["train_timing_stop"] in ("precision_met", "max_time", "max_windows")
    windows = run.data.metrics["train_timed_windows"]
    ranks = json.load(open(client.download_artifacts(run.info.run_id, "ranks.json")))["train"]
    assert [len(r["throughput_img_per_s_windows"]) for r in ranks] == [windows, windows]
