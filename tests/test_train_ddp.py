"""DDP for `train`: `--nproc N` launches torchrun; one MLflow run; rank 0 logs, checkpoints and registers.

The slow tests are real jobs on the CPU (gloo) with the tiny ``test_vit`` at 32 px: a training on two
hosts (two launchers on this machine) that registers its checkpoint, and a standalone 2-process job
whose ranks fail. The fast tests cover the
launcher's checks, the reduction rule and the engine's use of the reducer (one collective per log
boundary, none per step).
"""

from __future__ import annotations

import os
import re
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import REPO, free_port, migrated_store, subprocess_env
from test_ddp import ranks_imported_mlflow, record_imports
from vitreg.ddp import world as distributed
from vitreg.measure.figures import Figures
from vitreg.ddp import launcher as launch

TINY = {"model": "test_vit", "img_size": "32", "batch_size": "8", "num_classes": "10", "num_workers": "0",
        "lr": "2e-3", "warmup_steps": "2", "label_smoothing": "0", "device": "cpu"}
STEPS, LOG_EVERY, CKPT_EVERY = 8, 2, 4


def all_runs(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client, client.search_runs([e.experiment_id for e in client.search_experiments()])


def vitreg_train(tmp_path, uri, options: dict, timeout=180):
    return subprocess.run([sys.executable, "-m", "vitreg.cli", "train", *launch.options_to_args(options)],
                          env=subprocess_env(uri, MLFLOW_DISABLE_TELEMETRY="true"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------------------------
# end to end (CPU, gloo)


@pytest.mark.slow
def test_two_hosts_make_one_run_rank0_logs_checkpoints_and_registers(tmp_path):
    """Two launchers as two hosts (nnodes=2, node_rank 0 and 1, one rendezvous endpoint), one process
    each: one MLflow run, from node 0, with world size 2, whose figures are the two ranks' reduced, and
    whose checkpoints and registered version come from rank 0 alone; node 1's launcher opens no run; neither
    rank imports mlflow (rank 0 hands its calls, checkpoints and registration request to the launcher).
    (The standalone ``--nproc 2`` path: the failing-ranks test below; bench on two hosts: test_ddp.py.)"""
    uri = migrated_store(tmp_path)
    record = record_imports(tmp_path)
    env = subprocess_env(uri, MLFLOW_DISABLE_TELEMETRY="true", PYTHONPATH=os.pathsep.join([str(record), str(REPO)]),
                         RECORD_DIR=str(record))
    options = {**TINY, "steps": str(STEPS), "log_every": str(LOG_EVERY), "checkpoint_every": str(CKPT_EVERY),
               "register_as": "tiny-ddp", "alias": "champion", "experiment": "ddp-train",
               "ddp_bucket_mb": "1", "ddp_static_graph": "true", "ddp_comm_hook": "bf16"}
    hosts = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    procs = [subprocess.Popen([sys.executable, "-m", "vitreg.cli", "train", *launch.options_to_args(options), *hosts,
                               "--node-rank", str(node)],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    client, runs = all_runs(uri)
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]  # ranks resumed node 0's run
    run = runs[0]
    rid, m, tags = run.info.run_id, run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and re.fullmatch(r"cpu · [\d.,]+ img/s train · test_vit img32 · fp32 · bs8 · x2",
                                                          run.info.run_name), run.info.run_name  # with its figure
    assert run.data.params["nproc"] == "1"
    assert tags["world_size"] == "2" and tags["nnodes"] == "2"
    assert tags["dist_backend"] == "gloo" and tags["vitreg_job"] == "train"
    assert tags["ddp_bucket_mb"] == "1" and tags["ddp_static_graph"] == "true" and tags["ddp_comm_hook"] == "bf16"
    assert f"logged run {rid}" in outs[0][0] and "logged run" not in outs[1][0]

    # rank 0 alone logged: one value per step of every curve, one value of every summary metric
    for key in m:
        if key.startswith("system/"):
            continue  # sampled by the launcher every few seconds
        steps = [h.step for h in client.get_metric_history(rid, key)]
        assert len(steps) == len(set(steps)), (key, steps)
    assert [h.step for h in client.get_metric_history(rid, "train_loss")] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert len(client.get_metric_history(rid, "train_throughput_img_per_s")) == 1

    # the figures of the job: rates summed over the ranks, the slowest rank's step time, the mean loss
    assert m["train_world_size"] == 2 and m["train_images"] == STEPS * 8 * 2
    assert m["train_throughput_img_per_s_per_gpu"] == pytest.approx(m["train_throughput_img_per_s"] / 2)
    ranks = json.loads(open(client.download_artifacts(rid, "ranks.json", str(tmp_path))).read())["train"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert m["train_throughput_img_per_s"] == pytest.approx(sum(r["throughput_img_per_s"] for r in ranks))
    assert m["train_step_ms_p50"] == pytest.approx(max(r["step_ms_p50"] for r in ranks))
    assert ranks[0]["final_loss"] != ranks[1]["final_loss"]  # each rank trained on its own batches
    assert m["train_final_loss"] == pytest.approx(statistics.mean(r["final_loss"] for r in ranks), rel=1e-5)

    # checkpoints written and uploaded once, by rank 0 (keep_checkpoints=1: step-4 deleted once step-8 was
    # logged); the registered version comes from the last one
    assert {a.path: a.is_dir for a in client.list_artifacts(rid, "checkpoints")} == {
        "checkpoints/step-8": True, "checkpoints/last": False}
    from vitreg.checkpoint.format import follow_last, verify_checkpoint

    folder = Path(client.download_artifacts(rid, "checkpoints", str(tmp_path / "checkpoints")))
    last = verify_checkpoint(follow_last(folder / "last")).directory  # the step folder checkpoints/last names
    spec = json.loads(open(f"{last}/spec.json").read())
    assert spec["step"] == STEPS and spec["world_size"] == 2
    versions = client.search_model_versions("name = 'tiny-ddp'")
    assert len(versions) == 1 and versions[0].run_id == rid
    assert str(client.get_model_version_by_alias("tiny-ddp", "champion").version) == str(versions[0].version)
    assert tags["registered_model_version"] == str(versions[0].version)

    # rank 0 speaks for the job; rank 1 (node 1's only process) says nothing
    assert "[rank0]: [vitreg] step 8/8" in outs[0][1]
    assert not any("[rank1]: [vitreg]" in err for _, err in outs)
    assert {a.path for a in client.list_artifacts(rid, "torchrun")} == {"torchrun/rank0", "torchrun/torchrun.log"}  # node 0's own
    assert ranks_imported_mlflow(record, 2) == {0: [], 1: []}


@pytest.mark.slow
def test_failing_ranks_fail_the_run_with_their_error_and_status(tmp_path):
    """An error only the ranks see (a batch no host could hold: each rank refuses it before allocating,
    as a single process does): exit 2 (the ranks' own VitregError status, not torchrun's 1), one error line
    and no traceback on the console, one FAILED run whose vitreg_error names the rank. (The student without
    a distillation token is refused one line later in the same plan, tests/test_train_e2e.py's BAD.)"""
    uri = migrated_store(tmp_path)
    proc = vitreg_train(tmp_path, uri, {**TINY, "nproc": "2", "steps": "2", "batch_size": "100000000"}, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: rank ") and "batch_size=" in errors[0], output[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == errors[0], proc.stderr[-3000:]
    client, runs = all_runs(uri)
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert runs[0].data.tags["vitreg_error"] == last[len("error: "):]
    assert runs[0].data.tags["vitreg_job"] == "train" and runs[0].data.params["batch_size"] == "100000000"
    # a standalone launcher keeps both ranks' output in the run, the failing ones' included
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id, "torchrun")} == {"torchrun/rank0", "torchrun/rank1",
                                                                                     "torchrun/torchrun.log"}


# --------------------------------------------------------------------------------------------
# the launcher's checks (in-process, nothing launched)


@pytest.mark.parametrize("extra,needle,run_left", [
    ({"model": "test_vti"}, "did you mean test_vit", False),  # a typo: refused before any run exists
    ({"device": "cuda"}, "no CUDA GPU is visible", True),
    ({"data": "/nonexistent/imagenet"}, "does not exist", True),
])
def test_launcher_refuses_before_launching(sqlite_store, monkeypatch, extra, needle, run_left):
    from mlflow.tracking import MlflowClient

    from vitreg.cli.main import main

    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 0)
    result = CliRunner().invoke(main, ["train", *launch.options_to_args({**TINY, "nproc": "2", **extra})])
    assert result.exit_code == 2, result.output
    assert result.output.count("error: ") == 1 and needle in result.output and "launching" not in result.output, result.output
    client = MlflowClient()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    if not run_left:
        assert runs == []
        return
    (run,) = runs
    assert run.info.status == "FAILED" and needle in run.data.tags["vitreg_error"]


def test_needs_torchrun():
    assert launch.needs_torchrun(2) and launch.needs_torchrun(1, nnodes=2)
    assert not launch.needs_torchrun(1)


def test_a_rank_never_relaunches(sqlite_store, monkeypatch):
    """Inside torchrun, train is one rank of the job whatever its nproc: it checks that torchrun's
    process count is the nproc asked for, where a launcher would have launched."""
    from vitreg.errors import VitregError
    from vitreg.train.job import train

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(VitregError, match="nproc=2 but torchrun started 1 process"):
        train({**TINY, "nproc": "2", "steps": "1"}, progress=lambda message: None)


def test_join_world_refuses_another_process_count(monkeypatch):
    from vitreg.errors import VitregError

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(VitregError, match="nproc=2 but torchrun started 4 process"):
        distributed.join_world(2, "cpu")


# --------------------------------------------------------------------------------------------
# the reduction


def test_reduce_train_figures_sums_rates_and_takes_the_slowest():
    a = {"throughput_img_per_s": 100.0, "step_ms_p50": 10.0, "step_ms_p90": 12.0, "data_wait_frac": 0.1,
         "first_step_s": 2.0, "measured_steps": 20}
    b = {"throughput_img_per_s": 90.0, "step_ms_p50": 11.0, "step_ms_p90": 11.5, "data_wait_frac": 0.3,
         "first_step_s": 1.0, "measured_steps": 19}
    out = distributed.reduce_figures([Figures("train", a), Figures("train", b)])
    assert out.values == {"throughput_img_per_s": 190.0, "step_ms_p50": 11.0, "step_ms_p90": 12.0,
                          "data_wait_frac": 0.3, "first_step_s": 2.0, "measured_steps": 19}
    partial = Figures("train", {**b, "throughput_img_per_s": None})
    assert distributed.reduce_figures([Figures("train", a), partial])["throughput_img_per_s"] is None
    with pytest.raises(ValueError):
        distributed.reduce_figures([])


class CountingReducer(distributed.TrainReducer):
    """A one-process TrainReducer that pretends a second, identical rank: counts its collectives."""

    def __init__(self):
        super().__init__(distributed.World(world_size=2, local_world_size=2))
        self.figure_calls = 0

    def interval(self, loss, img_per_s):
        half, rate = super().interval(loss, img_per_s)  # no process group: the local sums, divided by 2
        return half * 2, (rate * 2 if rate is not None else None)

    def figures(self, local):
        self.figure_calls += 1
        twin = local.with_values(step_ms_p50=local["step_ms_p50"] * 1.5)  # a slower second rank
        self.per_rank = [{**local.values, "final_loss": self.last_local_loss}, twin.values]
        return distributed.reduce_figures([local, twin])


def test_engine_reduces_once_per_log_boundary_and_once_at_the_end():
    from vitreg.train import loop as engine
    from vitreg.hardware.profiles import PROFILES, DetectedHardware
    from vitreg.models.factory import create_model
    from vitreg.hardware.runtime import resolve_runtime
    from vitreg.config.spec import TrainSpec

    spec = TrainSpec(model="test_vit", img_size=32, num_classes=10, batch_size=4, steps=7, log_every=3,
                     label_smoothing=0)
    runtime = resolve_runtime("off", "off", "inductor", DetectedHardware("cpu", "CPU", 1, PROFILES["cpu"]))
    torch.manual_seed(0)
    model, info = create_model(spec.model, spec.img_size, spec.num_classes)
    reducer, logs = CountingReducer(), {}
    result = engine.train(spec, runtime, model, info, ranks=engine.Ranks(world_size=2, reducer=reducer),
                          hooks=engine.Hooks(on_log=lambda step, metrics: logs.__setitem__(step, metrics),
                                             progress=lambda m: None))
    assert sorted(logs) == [3, 6, 7] and reducer.intervals == 3  # the boundaries, never per step
    assert reducer.figure_calls == 1
    local = reducer.per_rank[0]
    assert result.figure("throughput_img_per_s") == pytest.approx(2 * local["throughput_img_per_s"])
    assert result.figure("step_ms_p50") == pytest.approx(1.5 * local["step_ms_p50"])
    assert result.figure("final_loss") == pytest.approx(logs[7]["train_loss"]) == pytest.approx(local["final_loss"])
    assert result.figure("images") == 7 * 4 * 2


@pytest.mark.parametrize("launched_by_vitreg", [True, False], ids=["vitreg-launcher", "own-torchrun"])
def test_rank0_checks_the_registration_only_without_a_vitreg_launcher(tmp_path, monkeypatch, launched_by_vitreg):
    """A vitreg launcher checked register_as against the registry before launching: its rank 0 does not check
    again (that check imported mlflow into the rank, ~2.8 s of CPU, and asked the registry). Under a torchrun the
    user started, rank 0 logs and registers itself, so it checks first."""
    from vitreg.train import job

    class Checked(Exception):
        pass

    class Planned(Exception):
        pass

    monkeypatch.setattr(job.model_registry, "check_registration", lambda *a: (_ for _ in ()).throw(Checked()))
    monkeypatch.setattr(job, "job_context", lambda *a, **k: (_ for _ in ()).throw(Planned()))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    if launched_by_vitreg:
        monkeypatch.setenv(launch.ENV_LAUNCH_DIR, str(tmp_path))
    else:
        monkeypatch.delenv(launch.ENV_LAUNCH_DIR, raising=False)
    with pytest.raises(Planned if launched_by_vitreg else Checked):
        job.resolve_plan(None, {**TINY, "nproc": "2", "steps": "2", "register_as": "tiny"}, tmp_path)
