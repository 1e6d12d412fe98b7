"""The ``vitreg`` command (click). Every subcommand is a thin shell over a library call.

Errors the user can fix (:class:`VitregError`) print one line, ``error: ...``, and exit 2; the
MLflow run, if one was opened, has already been marked FAILED by the tracking layer.
"""

from __future__ import annotations

import sys

import click

from vitreg.cli.common import bench_default, host_kwargs, host_options, user_errors
from vitreg.errors import VitregError
from vitreg.config.spec import AMP_CHOICES, COMPILE_BACKENDS, COMPILE_CHOICES, DEVICE_CHOICES, TASKS

def bench_options(fn):
    """The bench options, shared by ``vitreg bench`` and ``entry_points/bench.py`` (the MLproject params).

    Values stay strings and are parsed by BenchSpec, so ``-P flag=false`` and ``--flag false`` mean
    the same thing.
    """
    opts = [
        click.option("--gpu", default=bench_default("gpu"), show_default=True,
                     help="GPU label (a100, a100-80gb, h100, h100-pcie, h200, l4, t4, v100, rtx4090, cpu) or auto; "
                          "checked against the detected hardware."),
        click.option("--model", default=bench_default("model"), show_default=True,
                     help="timm vit_*/deit_*/deit3_* name, or torchvision:vit_b_16."),
        click.option("--task", default=bench_default("task"), show_default=True, help="/".join(TASKS)),
        click.option("--batch-size", "batch_size", default=str(bench_default("batch_size")), show_default=True),
        click.option("--img-size", "img_size", default=str(bench_default("img_size")), show_default=True,
                     help="0 = the model's default resolution."),
        click.option("--amp", default=bench_default("amp"), show_default=True,
                     help=f"{'/'.join(AMP_CHOICES)}; auto = bf16 where the GPU has it, fp16 on V100/T4, off on CPU."),
        click.option("--compile", "compile_", default=bench_default("compile"), show_default=True,
                     help="/".join(COMPILE_CHOICES)),
        click.option("--compile-backend", "compile_backend", default=bench_default("compile_backend"),
                     show_default=True,
                     help="/".join(COMPILE_BACKENDS)),
        click.option("--warmup", default=str(bench_default("warmup")), show_default=True,
                     help="untimed iterations (the first one is timed apart as compile/first-call time)."),
        click.option("--steps", default=str(bench_default("steps")), show_default=True,
                     help="iterations per timed window."),
        click.option("--repeats", default=str(bench_default("repeats")), show_default=True, help="timed windows."),
        click.option("--device", default=bench_default("device"), show_default=True, help="/".join(DEVICE_CHOICES)),
        click.option("--allow-gpu-mismatch", "allow_gpu_mismatch", default="false", show_default=True,
                     help="true: file the run under --gpu even if the hardware differs (tagged gpu_mismatch=true)."),
        click.option("--nproc", default=str(bench_default("nproc")), show_default=True,
                     help="processes (GPUs) per host; >1 launches torchrun; batch_size is per process."),
        click.option("--ddp-bucket-mb", "ddp_bucket_mb", default=str(bench_default("ddp_bucket_mb")), show_default=True,
                     help="DDP gradient bucket size in MB (torch's bucket_cap_mb): gradient all-reduced per call."),
        click.option("--ddp-static-graph", "ddp_static_graph", default="false", show_default=True,
                     help="true: DDP static_graph (skips per-step graph bookkeeping; the graph must not change)."),
        click.option("--ddp-comm-hook", "ddp_comm_hook", default=bench_default("ddp_comm_hook"), show_default=True,
                     help="none, or bf16/fp16: DDP all-reduces the gradients in that precision (torch's compress hook)."),
        click.option("--profile-steps", "profile_steps", default=str(bench_default("profile_steps")), show_default=True,
                     help="train: after the timed windows, this many more steps under torch.profiler, logging "
                          "train_allreduce_ms_per_step and (GPU) train_device_busy_ms_per_step; 0 = none."),
        click.option("--cuda-graph", "cuda_graph", default="false", show_default=True,
                     help="true (CUDA, amp bf16/off): capture each step (train: forward, backward with DDP's "
                          "all-reduce, AdamW) in one CUDA graph and time its replays."),
        click.option("--seed", default=str(bench_default("seed")), show_default=True),
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
@host_options
@click.option("--baseline-run", "baseline_run", default="",
              help="run id of a nproc=1 run of the same config: logs train_scaling_efficiency = img/s_N / (N x img/s_1).")
@user_errors
def bench(experiment, run_name, nnodes, node_rank, rdzv_endpoint, baseline_run, **kwargs):
    """Benchmark inference and/or training of one model and log one MLflow run."""
    from vitreg.bench.job import bench as run_bench

    # Not in bench_options: those are forwarded to the torchrun ranks, which BenchSpec checks.
    run_bench(bench_kwargs_to_options(kwargs), experiment=experiment, run_name=run_name,
              **host_kwargs(nnodes, node_rank, rdzv_endpoint), baseline_run=baseline_run.strip() or None)


@main.command()
@click.option("--experiment", required=True, help="The experiment whose runs to compare.")
@click.option("--baseline", default="", help="GPU label to compute speedups against (e.g. a100); empty: none.")
@click.option("--metric", default="throughput_img_per_s", show_default=True,
              help="Metric (task prefix stripped) to compare, e.g. latency_ms_p50, step_ms_p50.")
@click.option("--log-experiment", default=None, envvar="MLFLOW_EXPERIMENT_NAME",
              help="Experiment for the compare run itself (ignored under `mlflow run`).")
@user_errors
def compare(experiment, baseline, metric, log_experiment):
    """Compare an experiment's runs across GPUs: table, CSV/HTML/markdown and plots as artifacts of a compare run."""
    from vitreg.compare.job import run_compare

    run_compare(experiment, baseline or None, metric, log_experiment=log_experiment)


@main.command("import-timm")
@click.argument("csv_file", type=click.Path(dir_okay=False))
@click.option("--gpu", default=None, help="GPU label of the file (checked against the one in its name, if any).")
@click.option("--amp", default=None, help="Precision, when the file name does not say (off/bf16/fp16).")
@click.option("--experiment", default=None, envvar="MLFLOW_EXPERIMENT_NAME")
@user_errors
def import_timm(csv_file, gpu, amp, experiment):
    """Import a timm benchmark.py results CSV as runs tagged source=timm."""
    from vitreg.compare.job import import_timm as do_import

    do_import(csv_file, gpu, amp, experiment)


@main.command()
@click.option("--models", required=True, help="Comma-separated model names.")
@click.option("--amp", "amp_list", default="auto", show_default=True, help="Comma-separated, e.g. off,bf16.")
@click.option("--compile", "compile_list", default="off", show_default=True, help="Comma-separated, e.g. off,default.")
@click.option("--batch-size", "batch_list", default="64", show_default=True, help="Comma-separated, e.g. 32,256.")
@click.option("--gpu", default="auto", show_default=True)
@click.option("--task", default="both", show_default=True)
@click.option("--img-size", "img_size", default="0", show_default=True)
@click.option("--compile-backend", "compile_backend", default="inductor", show_default=True)
@click.option("--warmup", default="10", show_default=True)
@click.option("--steps", default="30", show_default=True)
@click.option("--repeats", default="5", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--allow-gpu-mismatch", "allow_gpu_mismatch", default="false", show_default=True)
@click.option("--experiment", default=None, envvar="MLFLOW_EXPERIMENT_NAME")
@user_errors
def sweep(models, amp_list, compile_list, batch_list, experiment, **common):
    """Run every combination of models x amp x compile x batch size as child runs of one parent run."""
    from vitreg.bench.sweep import run_sweep

    outcome = run_sweep(models, amp_list, compile_list, batch_list, common=common, experiment=experiment)
    if not outcome["finished"]:
        raise VitregError(f"all {len(outcome['failed'])} sweep runs failed: see the vitreg_error tags of the child runs")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def server(ctx):
    """Start the tracking server from tracking/ (VITREG_SERVER_* variables; see tracking/README.md)."""
    from vitreg.deploy.server import main as server_main

    sys.exit(server_main(ctx.args))


from vitreg.cli.registry_cmds import infer as infer_command, pull as pull_command, register as register_command  # noqa: E402,E501

from vitreg.cli.train_cmd import train as train_command  # noqa: E402

main.add_command(pull_command)
main.add_command(register_command)
main.add_command(infer_command)
main.add_command(train_command)

if __name__ == "__main__":  # pragma: no cover
    main()
