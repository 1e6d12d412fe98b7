"""``vitreg train``: the click command (registered on the ``vitreg`` group with ``main.add_command(train)``).

One option per :class:`~vitreg.config.spec.TrainSpec` field, as strings that TrainSpec parses, so
``--flag false``, ``-P flag=false`` and ``flag="false"`` mean the same thing. Each option takes both
spellings, ``--batch-size`` and ``--batch_size``, because ``mlflow run`` appends undeclared ``-P k=v``
as ``--k v``.
"""

from __future__ import annotations

from dataclasses import MISSING, fields

import click

from vitreg.cli.common import host_kwargs, host_options, user_errors
from vitreg.config.spec import (AMP_CHOICES, COMPILE_BACKENDS, COMPILE_CHOICES, DEVICE_CHOICES, DISTILLATION_CHOICES,
                         TrainSpec)

HELP = {
    "model": "timm vit_*/deit_*/deit3_* name (deit_*_distilled_* for distillation), or torchvision:vit_b_16.",
    "gpu": "GPU label (a100, h100, h200, l4, ..., cpu) or auto; checked against the detected hardware.",
    "img_size": "0 = the model's default resolution.",
    "batch_size": "images per step per process.",
    "steps": "optimizer updates in all (counted from step 0, also when resuming); 0 = use --epochs.",
    "epochs": "passes over the data when --steps is 0 (a synthetic epoch is 10,000 images).",
    "lr": "peak learning rate (AdamW). DeiT: 5e-4 x batch/512.",
    "weight_decay": "AdamW weight decay (not on biases, norms, position embeddings, tokens).",
    "warmup_steps": "linear LR warm-up steps (from 1e-6), then a cosine to --min-lr at the last step.",
    "min_lr": "LR at the end of the cosine.",
    "clip_grad": "max global gradient norm; 0 = no clipping.",
    "label_smoothing": "label smoothing of the cross-entropy (DeiT: 0.1).",
    "amp": f"{'/'.join(AMP_CHOICES)}; auto = bf16 where the GPU has it, fp16 on V100/T4, off on CPU.",
    "compile": "/".join(COMPILE_CHOICES),
    "compile_backend": "/".join(COMPILE_BACKENDS),
    "device": "/".join(DEVICE_CHOICES),
    "allow_gpu_mismatch": "true: file the run under --gpu even if the hardware differs (tagged gpu_mismatch=true).",
    "data": "synthetic (class-conditional tensors made on the device) or a folder with train/<class>/ and "
            "optionally val/<class>/ (torchvision ImageFolder).",
    "num_workers": "DataLoader processes for --data PATH.",
    "num_classes": "classifier classes; 0 = the class folders of --data (1000 for synthetic).",
    "log_every": "steps between logged metrics (the only CPU-GPU sync of the loop).",
    "checkpoint_every": "steps between checkpoints (checkpoints/step-<N> and checkpoints/last); 0 = only at the end.",
    "resume": "runs:/<run_id>/checkpoints/last or a checkpoint directory: continue at its step, same LR schedule.",
    "distillation": f"{'/'.join(DISTILLATION_CHOICES)} (DeiT), for deit_*_distilled_* models.",
    "teacher": "timm name (random weights: vitreg never downloads), models:/<name>@<alias>, runs:/... or a "
               "checkpoint directory.",
    "distill_alpha": "weight of the distillation loss.",
    "distill_tau": "temperature of soft distillation.",
    "register_as": "register the final checkpoint as this model name (empty: do not register).",
    "alias": "alias of the registered version.",
    "nproc": "processes (GPUs) on this host; >1 launches torchrun (DDP, one MLflow run, rank 0 logs); "
             "batch_size is per process. Refused if larger than the visible GPUs; any number with --device cpu "
             "(gloo).",
    "ddp_bucket_mb": "DDP gradient bucket size in MB (torch's bucket_cap_mb), with nproc>1.",
    "ddp_static_graph": "true: DDP static_graph (skips per-step graph bookkeeping), with nproc>1.",
    "ddp_comm_hook": "none, or bf16/fp16: DDP all-reduces the gradients in that precision (torch's compress hook), "
                     "with nproc>1.",
    "seed": "seed of the model init and the data.",
}


def _param_default(f) -> str:
    value = f.default if f.default is not MISSING else ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def train_options(fn):
    """Every TrainSpec field as a string option (also for ``entry_points/train.py``)."""
    for f in reversed(fields(TrainSpec)):
        dest = "compile_" if f.name == "compile" else f.name
        names = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            names.append(f"--{f.name}")
        fn = click.option(*names, dest, default=_param_default(f), show_default=True, help=HELP.get(f.name))(fn)
    return fn


def options_from_kwargs(kwargs: dict) -> dict:
    options = dict(kwargs)
    options["compile"] = options.pop("compile_")
    return options


@click.command("train")
@train_options
@click.option("--experiment", default=None, envvar="MLFLOW_EXPERIMENT_NAME",
              help="MLflow experiment (ignored under `mlflow run`, which picks its own).")
@click.option("--run-name", default=None, help="MLflow run name (default: train-model-gpu-amp-bsN).")
@host_options
@user_errors
def train(experiment, run_name, nnodes, node_rank, rdzv_endpoint, **kwargs):
    """Train a ViT/DeiT (synthetic data or an ImageFolder), log curves and checkpoints to one MLflow run."""
    from vitreg.train.job import train as run_train

    run_train(options_from_kwargs(kwargs), experiment=experiment, run_name=run_name,
              **host_kwargs(nnodes, node_rank, rdzv_endpoint))


if __name__ == "__main__":  # pragma: no cover
    train()
