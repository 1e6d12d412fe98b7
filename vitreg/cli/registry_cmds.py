"""``vitreg pull`` and ``vitreg infer``: thin click shells over :mod:`vitreg.tracking.registry` and :mod:`vitreg.bench.infer`.

Registered in :mod:`vitreg.cli` with ``main.add_command(pull)`` / ``main.add_command(infer)``; the
one-line-error handling and the bench defaults come from :mod:`vitreg.cli.common`, as cli's do.
"""

from __future__ import annotations

import click

from vitreg.cli.common import bench_default, user_errors
from vitreg.config.spec import AMP_CHOICES, COMPILE_BACKENDS, COMPILE_CHOICES, DEVICE_CHOICES, TASKS

@click.command()
@click.argument("checkpoint_uri")
@click.option("--name", required=True, help="registered model name (created if new; its versions must be the same architecture).")
@click.option("--alias", default="latest", show_default=True,
              help="alias to move to the new version (latest: none set; MLflow resolves @latest to the newest).")
@user_errors
def register(checkpoint_uri, name, alias):
    """Register a run's checkpoint (runs:/<run_id>/checkpoints/last) as a new model version."""
    from vitreg.tracking.registry import register_run_checkpoint

    mv = register_run_checkpoint(checkpoint_uri, name, alias)
    click.echo(f"registered models:/{mv.name}/{mv.version}" + (f" (@{alias})" if alias.lower() != "latest" else "")
               + f" from run {mv.run_id}")


@click.command()
@click.argument("model_uri")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="also write a self-contained folder: model.safetensors, spec.json, manifest.json, README.md.")
@user_errors
def pull(model_uri, out_dir):
    """Pull a registered model and rebuild it as a timm model (sha256-verified, forward-checked).

    MODEL_URI: models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/checkpoints/last or a local
    checkpoint folder.
    """
    from vitreg.tracking.checkpoints import pull as pull_model

    click.echo(pull_model(model_uri, out_dir=out_dir).describe())


def infer_options(fn):
    """The ``infer`` options (the MLproject ``infer`` params). Model and img_size come from the checkpoint."""
    opts = [
        click.option("--model-uri", "model_uri", required=True,
                     help="models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID/checkpoints/last."),
        click.option("--gpu", default=bench_default("gpu"), show_default=True,
                     help="GPU label (a100, h100, h200, l4, t4, v100, rtx4090, cpu, ...) or auto."),
        click.option("--task", default="infer", show_default=True, help="/".join(TASKS)),
        click.option("--batch-size", "batch_size", default=str(bench_default("batch_size")), show_default=True),
        click.option("--amp", default=bench_default("amp"), show_default=True, help="/".join(AMP_CHOICES)),
        click.option("--compile", "compile_", default=bench_default("compile"), show_default=True,
                     help="/".join(COMPILE_CHOICES)),
        click.option("--compile-backend", "compile_backend", default=bench_default("compile_backend"),
                     show_default=True, help="/".join(COMPILE_BACKENDS)),
        click.option("--warmup", default=str(bench_default("warmup")), show_default=True),
        click.option("--steps", default=str(bench_default("steps")), show_default=True,
                     help="iterations per timed window."),
        click.option("--repeats", default=str(bench_default("repeats")), show_default=True, help="timed windows."),
        click.option("--device", default=bench_default("device"), show_default=True, help="/".join(DEVICE_CHOICES)),
        click.option("--allow-gpu-mismatch", "allow_gpu_mismatch", default="false", show_default=True),
        click.option("--cuda-graph", "cuda_graph", default="false", show_default=True,
                     help="true (CUDA, amp bf16/off): capture each step in one CUDA graph and time its replays."),
        click.option("--seed", default=str(bench_default("seed")), show_default=True),
        click.option("--experiment", default=None, envvar="MLFLOW_EXPERIMENT_NAME",
                     help="MLflow experiment (ignored under `mlflow run`, which picks its own)."),
        click.option("--run-name", "run_name", default=None, help="MLflow run name."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@click.command()
@infer_options
@user_errors
def infer(model_uri, experiment, run_name, compile_, **kwargs):
    """Benchmark a registered model's weights (task=infer by default) and link the run to its version."""
    from vitreg.bench.infer import infer as run_infer

    run_infer(model_uri, {**kwargs, "compile": compile_}, experiment=experiment, run_name=run_name)
