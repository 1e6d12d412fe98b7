"""The ``vitreg`` command (click). Every subcommand is a thin shell over a library call.

Errors the user can fix (:class:`VitregError`) print one line, ``error: ...``, and exit 2; the
MLflow run, if one was opened, has already been marked FAILED by the tracking layer.
"""

from __future__ import annotations

import functools
import sys

import click

from vitreg.errors import VitregError
from vitreg.spec import AMP_CHOICES, COMPILE_BACKENDS, COMPILE_CHOICES, DEVICE_CHOICES, TASKS, BenchSpec

_DEFAULTS = BenchSpec.__dataclass_fields__


def _default(name):
    return _DEFAULTS[name].default


def user_errors(fn):
    """Turn VitregError into a one-line message and exit 2 (no traceback), everywhere in the CLI."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except VitregError as exc:
            from vitreg import tracking

            tracking.fail_requested_run(str(exc))
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def bench_options(fn):
    """The bench options, shared by ``vitreg bench`` and ``entry_points/bench.py`` (the MLproject params).

    Values stay strings and are parsed by BenchSpec, so ``-P flag=false`` and ``--flag false`` mean
    the same thing.
    """
    opts = [
        click.option("--gpu", default=_default("gpu"), show_default=True,
                     help="GPU label (a100, a100-80gb, h100, h100-pcie, h200, l4, t4, v100, rtx4090, cpu) or auto; "
                          "checked against the detected hardware."),
        click.option("--model", default=_default("model"), show_default=True,
                     help="timm vit_*/deit_*/deit3_* name, or torchvision:vit_b_16."),
        click.option("--task", default=_default("task"), show_default=True, help="/".join(TASKS)),
        click.option("--batch-size", "batch_size", default=str(_default("batch_size")), show_default=True),
        click.option("--img-size", "img_size", default=str(_default("img_size")), show_default=True,
                     help="0 = the model's default resolution."),
        click.option("--amp", default=_default("amp"), show_default=True,
                     help=f"{'/'.join(AMP_CHOICES)}; auto = bf16 where the GPU has it, fp16 on V100/T4, off on CPU."),
        click.option("--compile", "compile_", default=_default("compile"), show_default=True,
                     help="/".join(COMPILE_CHOICES)),
        click.option("--compile-backend", "compile_backend", default=_default("compile_backend"), show_default=True,
                     help="/".join(COMPILE_BACKENDS)),
        click.option("--warmup", default=str(_default("warmup")), show_default=True,
                     help="untimed iterations (the first one is timed apart as compile/first-call time)."),
        click.option("--steps", default=str(_default("steps")), show_default=True, help="iterations per timed window."),
        click.option("--repeats", default=str(_default("repeats")), show_default=True, help="timed windows."),
        click.option("--device", default=_default("device"), show_default=True, help="/".join(DEVICE_CHOICES)),
        click.option("--allow-gpu-mismatch", "allow_gpu_mismatch", default="false", show_default=True,
                     help="true: file the run under --gpu even if the hardware differs (tagged gpu_mismatch=true)."),
        click.option("--nproc", default=str(_default("nproc")), show_default=True,
                     help="processes (GPUs) on this host; >1 launches torchrun."),
        click.option("--seed", default=str(_default("seed")), show_default=True),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def bench_kwargs_to_options(kwargs: dict) -> dict:
    options = dict(kwargs)
    options["compile"] = options.pop("compile_")
    return options


@click.group()
@click.version_option(package_name="vitreg")
def main():
    """vitreg: ViT/DeiT benchmarks with compile/AMP/DDP, tracked in MLflow."""


@main.command()
@bench_options
@click.option("--experiment", default=None, envvar="MLFLOW_EXPERIMENT_NAME",
              help="MLflow experiment (ignored under `mlflow run`, which picks its own).")
@click.option("--run-name", default=None, help="MLflow run name (default: model-gpu-amp-compile-bsN).")
@user_errors
def bench(experiment, run_name, **kwargs):
    """Benchmark inference and/or training of one model and log one MLflow run."""
    from vitreg.bench import bench as run_bench

    run_bench(bench_kwargs_to_options(kwargs), experiment=experiment, run_name=run_name)


if __name__ == "__main__":  # pragma: no cover
    main()
