"""What every job's run is labelled with: the setup params and artifacts, the resolved tags, the DDP tags.
Shared by the bench, infer and train jobs; each says what it ran (``task``, ``cuda_graph``, DDP settings).
"""

from __future__ import annotations

import shutil
from dataclasses import fields

from vitreg.analysis.frame import RUN_COMMANDS, options_shown_in
from vitreg.config.options import identity_names
from vitreg.config.parse import param_text
from vitreg.environment import pip_freeze
from vitreg.tracking.runs import note_skipped_params


def log_setup(run, params: dict, env, progress) -> None:
    note_skipped_params(run.log_params(params), progress)
    run.log_text(env.to_json(), "environment.json")
    run.log_text(pip_freeze(), "pip_freeze.txt")


def _graph_tag(cuda_graph: bool | None) -> dict:
    return {} if cuda_graph is None else {"cuda_graph": str(cuda_graph).lower()}


def identity_tags(spec) -> dict:
    """The spec's value of every identity option as tags, what the runs list groups by (the DDP settings are
    :func:`world_tags`'s)."""
    names = {name for command in RUN_COMMANDS for name in identity_names(command)} - set(options_shown_in("ddp"))
    values = {f.name: param_text(getattr(spec, f.name)) for f in fields(spec) if f.name in names}
    return {name: value for name, value in values.items() if value != ""}  # teacher="": no teacher, no tag


def resolved_tags(spec, hw, runtime, img_size: int, *, task: str, cuda_graph: bool | None = None) -> dict:
    """What actually ran: the :func:`identity_tags`, resolved where a request was (amp=auto -> bf16)."""
    tags = {
        **identity_tags(spec),
        "gpu": hw.label,
        "amp": runtime.amp,
        "device": runtime.device,
        "img_size": img_size,
        "task": task,
        "gpu_mismatch": "true" if hw.mismatch else "false",
        "detected_gpu": hw.detected.profile.label,
        "vitreg_job": "bench",
    }
    return {**tags, **_graph_tag(cuda_graph)}


def label_launcher_run(run, spec, job: str, *, task: str, cuda_graph: bool | None = None) -> None:
    """Params and the configuration tags on a DDP job's run before torchrun starts: a job whose ranks never get
    to log (a crash at start-up) is still found by model, task, batch and job in the UI."""
    if run is None:
        return
    run.log_params(spec.to_params())
    run.set_tags({**identity_tags(spec), "task": task, "vitreg_job": job, **_graph_tag(cuda_graph)})


def world_tags(world, runtime, env, ddp_spec=None) -> dict:
    """Tags of a DDP run; none for a single process. ``ddp_spec``: the spec whose DDP settings wrapped a model
    (None for inference)."""
    if not world.distributed:
        return {}
    tags = {"world_size": world.world_size, "nnodes": world.nnodes, "dist_backend": world.backend,
            "host_gpu_count": env.gpu_count}
    if ddp_spec is not None:
        tags.update(ddp_bucket_mb=f"{ddp_spec.ddp_bucket_mb:g}",
                    ddp_static_graph=str(ddp_spec.ddp_static_graph).lower(), ddp_comm_hook=ddp_spec.ddp_comm_hook)
    if runtime.device == "cuda":
        tags["gpu_count"] = world.world_size  # the GPUs this run used, not the ones the host has
    return tags


def log_what_ran(run, result) -> None:
    """What a bench result says actually ran as tags, the batch probes as a series (step = the batch probed),
    the profiler's trace as artifacts."""
    run.set_tags(result.tags())
    for step, values in result.series():
        run.log_metrics(values, step=step)
    if result.profile_dir:
        run.log_artifacts(result.profile_dir, "profile")  # copied (into the spool) before it returns
        shutil.rmtree(result.profile_dir, ignore_errors=True)
