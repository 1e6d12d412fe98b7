"""Benchmark runs made cheaply with a plain MLflow client: what a `vitreg bench` run logs that `vitreg check`
reads (params, environment tags, the task's metrics), without running a model. Used by
benchmarks/check_scale.py and tests/test_check.py."""

from __future__ import annotations

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

START_MS = 1_767_225_600_000  # 2026-01-01, the first run's start; each next run starts a minute later
ENV = {"torch_version": "2.11.0", "cuda_version": "13.0", "cudnn_version": "91300", "driver_version": "580.159.04",
       "timm_version": "1.0.29", "vitreg_git_sha": "0" * 40}


def log_run(client: MlflowClient, experiment_id: str, index: int, throughput: float, *, model="deit_tiny_patch16_224",
            gpu="h200", task="infer", cv=0.005, status="FINISHED", env=None, tags=None, params=None) -> str:
    """One finished bench-like run started ``index`` minutes after START_MS; returns its id."""
    env = {**ENV, **(env or {})}
    run_tags = {"vitreg_job": "bench", "gpu": gpu, "gpu_name": "NVIDIA H200" if gpu == "h200" else gpu,
                "detected_gpu": gpu, "gpu_mismatch": "false", "amp": "bf16", "img_size": "224", **env, **(tags or {})}
    run = client.create_run(experiment_id, start_time=START_MS + index * 60_000, tags=run_tags)
    run_params = {"model": model, "task": task, "gpu": gpu, "amp": "bf16", "compile": "off", "batch_size": "256",
                  "img_size": "0", "sdpa": "auto", "compile_backend": "inductor", "nproc": "1",
                  "cuda_graph": "false", **(params or {})}
    client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in run_params.items()],
                     metrics=[Metric(f"{task}_throughput_img_per_s", float(throughput), START_MS, 0),
                              Metric(f"{task}_throughput_cv", float(cv), START_MS, 0)])
    client.set_terminated(run.info.run_id, status=status, end_time=START_MS + index * 60_000 + 30_000)
    return run.info.run_id
