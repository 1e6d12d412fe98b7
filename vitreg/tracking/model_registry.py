"""Register a checkpoint as a model version: MLflow's ``pytorch`` flavor (pt2: the UI, ``mlflow models serve``
and pyfunc work as usual) and the vitreg checkpoint in the logged model's ``extra_files/``. A checkpoint its
registering run logged itself is not copied a second time: ``shared_weights.json`` names the run's
``checkpoints/step-<N>`` folder whose weights have the manifest's sha256; deleting the run (``mlflow gc``)
leaves such a version unpullable.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from vitreg.checkpoint import format as ckpt
from vitreg.checkpoint.export import stage_files
from vitreg.console import progress
from vitreg.errors import VitregError
from vitreg.files import parse_json, read_bytes
from vitreg.tracking.checkpoint_sources import (CHECKPOINT_TAG, SHARED_WEIGHTS, first_line, mlflow_call,
                                               resolve_checkpoint, shared_weights_text)
from vitreg.tracking.checkpoint_sources import load_model, pull  # noqa: F401  (the README's import path)
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.spool import clean_tags
from vitreg.tracking.uris import tracking_uri

#: Batch of the pt2 input example. A batch of 1 makes torch.export specialise the batch dimension to
#: the constant 1 (the served model would take one image at a time); 2 keeps it dynamic.
EXAMPLE_BATCH = 2
_ALIAS_RE = re.compile(r"^[\w\-]+$")
_NAME_RE = re.compile(r"^[\w.\-]+$")
_VERSION_ALIAS_RE = re.compile(r"^[vV]\d+$")


def register_checkpoint(tracker, checkpoint_dir, name: str, alias: str | None = "latest", tags: dict | None = None,
                        progress=progress):
    """Register a vitreg checkpoint (a local folder or a ``runs:/`` URI) as a new version of ``name`` under
    ``tracker``'s run; returns the ModelVersion (None for a rank that does not log). ``alias`` moves to the new
    version; ``"latest"`` sets nothing (MLflow resolves ``@latest`` itself)."""
    check_on_server = getattr(tracker, "check_on_server", None)  # a spooling tracker may hold the run locally
    if check_on_server is not None:
        check_on_server(name)
    if not tracker.run_id:  # a rank that does not log (NullTracker)
        return None
    return _register(tracker.run_id, _Request(name, alias, tags, str(checkpoint_dir)), progress)


def _register(run_id: str, request: _Request, progress):
    _check_alias(request.alias)
    request = replace(request, name=_check_name(request.name))
    name, alias = request.name, request.alias
    client = mlflow.MlflowClient()
    with tempfile.TemporaryDirectory(prefix="vitreg-register-") as tmp:
        located = resolve_checkpoint(request.source, Path(tmp) / "download", what="checkpoint", progress=progress)
        model, info, spec = ckpt.load_model(located.checkpoint)
        _check_owner(client, name, spec["model"])
        try:
            mv, moved_from = _log_and_register(client, run_id, (model, info, spec), located, request,
                                               Path(tmp) / "stage", progress)
        except mlflow.exceptions.MlflowException as exc:
            raise VitregError(f"could not register {name!r} at {tracking_uri()}: {first_line(exc)}") \
                from None
    where = f"models:/{name}/{mv.version}"
    if alias and alias.lower() != "latest":
        note = f" (moved from v{moved_from})" if moved_from and str(moved_from) != str(mv.version) else ""
        where += f", models:/{name}@{alias}{note}"
    progress(f"registered {spec['model']} as {where}, models:/{name}@latest")
    return mv


@dataclass(frozen=True)
class _Request:
    name: str
    alias: str | None
    tags: dict | None
    source: str


def _log_and_register(client, run_id: str, loaded: tuple, located, request: _Request, stage: Path, progress):
    """The pt2 model with the checkpoint files under the run, its version, the alias; ``(version, moved_from)``."""
    import mlflow.pytorch  # the flavor module (imports torch.export machinery): only when registering
    import numpy as np

    model, info, spec = loaded
    name, alias, checkpoint = request.name, request.alias, located.checkpoint
    shared = _shared_folder(client, run_id, located)
    staged = stage_files(checkpoint, stage, leave_out=(ckpt.WEIGHTS,) if shared else ())
    if shared:
        (stage / SHARED_WEIGHTS).write_text(shared_weights_text(run_id, shared))
        staged.append(stage / SHARED_WEIGHTS)
    # Zeros: torch.export reads the example's shape and dtype, not its values, and MLflow keeps it twice as
    # JSON text (input_example.json, serving_input_example.json), where a random float32 takes ~20
    # characters and 0.0 three: 15.5 MB against ~2 MB for a 224 px batch of 2.
    example = np.zeros((EXAMPLE_BATCH, 3, info.img_size, info.img_size), dtype=np.float32)
    progress(f"logging {spec['model']} ({info.params_m:.1f} M params) as an MLflow pytorch model (pt2) "
             f"under run {run_id} ...")
    logged = mlflow.pytorch.log_model(
        model.eval(), name="model", input_example=example, serialization_format="pt2",
        pip_requirements=_pip_requirements(), extra_files=[str(p) for p in staged], run_id=run_id,
        # MLflow would reload the pt2 and serve the example (~half the time), and only warn on failure
        validate_serving_input=False,
        metadata={CHECKPOINT_TAG: checkpoint.manifest["format"], "vitreg_model": spec["model"]})
    version_tags = _version_tags(client, run_id, (spec, info), located, request.source, request.tags)
    mv = mlflow.register_model(logged.model_uri, name, tags=version_tags)
    registered = client.get_registered_model(name)
    if (registered.tags or {}).get("model") != spec["model"]:
        client.set_registered_model_tag(name, "model", spec["model"])
    moved_from = None
    if alias and alias.lower() != "latest":
        moved_from = (registered.aliases or {}).get(alias)
        client.set_registered_model_alias(name, alias, mv.version)
    client.set_tag(run_id, "registered_model_name", name)
    client.set_tag(run_id, "registered_model_version", str(mv.version))
    return client.get_model_version(name, mv.version), moved_from


_RUN_CHECKPOINT_RE = re.compile(r"^runs:/([0-9a-fA-F]+)/(checkpoints/[\w.\-]+)/?$")


def register_run_checkpoint(uri: str, name: str, alias: str | None = "latest", progress=progress):
    """Register a checkpoint that a run logged (``runs:/<run_id>/checkpoints/last`` or ``.../step-<N>``) after
    the fact, under that run, exactly as ``train -P register_as=NAME`` does at the end of training."""
    match = _RUN_CHECKPOINT_RE.match(str(uri).strip())
    if not match:
        raise VitregError(f"{uri} is not a run's checkpoint: pass runs:/<run_id>/checkpoints/last "
                          f"(or .../checkpoints/step-<N>), as a train run logs them")
    run_id = match.group(1)
    client = mlflow.MlflowClient()
    try:
        run = mlflow_call(lambda: client.get_run(run_id), "find the run")
    except mlflow.exceptions.MlflowException:
        raise VitregError(f"no run {run_id} at {tracking_uri()}: check the run id and MLFLOW_TRACKING_URI") \
            from None
    return _register(run.info.run_id, _Request(name, alias, None, f"runs:/{run_id}/{match.group(2)}"), progress)


def check_registration(name: str, alias: str | None, arch: str) -> None:
    """The registration checks that need no checkpoint, which ``train`` runs first: a bad ``register_as`` fails in
    seconds rather than after the whole training."""
    _check_alias(alias)
    _check_owner(mlflow.MlflowClient(), _check_name(name), arch)


def _check_name(name: str) -> str:
    name = str(name).strip()
    if not _NAME_RE.match(name):
        raise VitregError(f"registered model name {name!r} is not usable: use letters, digits, '-', '_' or '.', "
                          f"e.g. register_as=deit-tiny")
    return name


def _check_alias(alias: str | None) -> None:
    if alias is None or alias == "" or alias.lower() == "latest":
        return
    if not _ALIAS_RE.match(alias) or _VERSION_ALIAS_RE.match(alias):
        raise VitregError(f"alias {alias!r} is not usable: MLflow aliases are letters, digits, '_' and '-', and "
                          f"v<digits> is reserved; use e.g. alias=champion")


def _check_owner(client, name: str, arch: str) -> None:
    """A registered model name holds one architecture: refuse to mix another one into it."""
    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except mlflow.exceptions.MlflowException:
        return  # no such registered model yet
    others = sorted({(mv.tags or {}).get("model", "unknown (not registered by vitreg)") for mv in versions} - {arch})
    if others:
        owned = ", ".join(others)
        raise VitregError(f"registered model {name!r} already holds versions of {owned}, not {arch}: "
                          f"choose another register_as (e.g. register_as={name}-{arch.replace('_', '-')})")


def _pip_requirements() -> list[str]:
    # Explicit requirements: MLflow's own inference of them imports and runs the model again (~6 s).
    from importlib import metadata

    reqs = []
    for dist in ("torch", "timm", "safetensors", "numpy", "mlflow"):
        try:
            reqs.append(f"{dist}=={metadata.version(dist).split('+')[0]}")
        except metadata.PackageNotFoundError:
            reqs.append(dist)
    return reqs


def _shared_folder(client, run_id: str, located) -> str | None:
    """The ``checkpoints/step-<N>`` folder of run ``run_id`` with these very weights (same sha256), for the
    version to share; None: the version holds a copy."""
    checkpoint = located.checkpoint
    if located.run_folder and located.run_id == run_id:
        folder = located.run_folder
    elif checkpoint.directory.parent.name == "checkpoints":  # train's own step-<N>, logged under that name
        folder = f"checkpoints/{checkpoint.directory.name}"
    else:
        return None
    if not re.fullmatch(r"checkpoints/step-\d+", folder):
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="vitreg-shared-") as tmp:
            logged = parse_json(read_bytes(client.download_artifacts(run_id, f"{folder}/{ckpt.MANIFEST}", tmp)))
        sha = logged["files"][ckpt.WEIGHTS]["sha256"]
    except (mlflow.exceptions.MlflowException, OSError, ValueError, KeyError, TypeError):
        return None
    return folder if sha == checkpoint.manifest["files"][ckpt.WEIGHTS]["sha256"] else None


def _version_tags(client, run_id: str, loaded: tuple, located, source: str, extra: dict | None) -> dict:
    spec, info = loaded
    checkpoint = located.checkpoint
    if located.run_folder and located.run_id:  # the folder `last` named, not the moving name
        source = f"runs:/{located.run_id}/{located.run_folder}"
    run = client.get_run(run_id)
    tags = {
        "model": spec["model"],
        "img_size": spec.get("img_size", info.img_size),
        "num_classes": spec.get("num_classes", info.num_classes),
        "distilled": str(bool(spec.get("distilled", info.distilled))).lower(),
        "params_m": f"{info.params_m:.3f}",
        "step": spec.get("step"),
        "epoch": spec.get("epoch"),
        "source_run_id": run_id,
        "gpu": run.data.tags.get("gpu") or run.data.params.get("gpu"),
        "train_throughput_img_per_s": run.data.metrics.get("train_throughput_img_per_s"),
        CHECKPOINT_TAG: checkpoint.manifest["format"],
        "checkpoint_source": _checkpoint_source(source, checkpoint.directory, run_id),
        "weights_sha256": checkpoint.manifest["files"][ckpt.WEIGHTS]["sha256"],
    }
    return clean_tags({**tags, **(extra or {})})


def _checkpoint_source(source: str, directory: Path, run_id: str) -> str:
    # A URI names itself. Training saves checkpoints/step-<N>/ locally and logs it under the same name:
    # name the run artifact when the folder looks like one, else the local path.
    if source.startswith(("runs:/", "models:/")):
        return source
    directory = Path(directory).resolve()
    if directory.parent.name == "checkpoints":
        return f"runs:/{run_id}/checkpoints/{directory.name}"
    return str(directory)
