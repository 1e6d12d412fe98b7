"""Checkpoints in the tracking store: :func:`resolve_checkpoint`, the one resolver (``train``'s resume= and
teacher=, ``pull``, ``infer``, registration), turns :data:`SOURCES`, a logged model (``models:/m-<id>``) or an
artifact URI into one verified checkpoint, following a run's ``checkpoints/last`` pointer; :func:`pull` rebuilds
it as a timm model. A registered version's files are in its logged model's ``extra_files/``, its weights there
or, shared, in its run (``shared_weights.json``). Nothing is unpickled, and the pt2 graph is never loaded.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vitreg.checkpoint import format as ckpt
from vitreg.checkpoint.export import export_folder
from vitreg.console import progress
from vitreg.errors import CheckpointError, VitregError, path_kind
from vitreg.files import read_json, read_text
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.store import first_line, quiet_artifact_downloads, store_error_for, store_fault
from vitreg.tracking.uris import tracking_uri

#: Where the checkpoint files live inside a registered model version's artifacts.
CHECKPOINT_SUBDIR = "extra_files"
#: Tag that marks a model version as a vitreg checkpoint (value: the checkpoint format).
CHECKPOINT_TAG = "vitreg_checkpoint"
#: In a registered version's extra_files: the run checkpoint whose weights it shares (instead of a copy).
SHARED_WEIGHTS = "shared_weights.json"
SHARED_FORMAT = "vitreg-shared-weights-1"
_RUN_ID = re.compile(r"^[0-9a-fA-F]{1,64}$")
SOURCES = "models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/checkpoints/last or a local checkpoint folder"


# --------------------------------------------------------------------------- resolve


@dataclass(frozen=True)
class Located:
    checkpoint: ckpt.VerifiedCheckpoint
    name: str | None = None  # the registered model, when the source named a version
    version: str | None = None
    alias: str | None = None
    run_id: str | None = None  # the run that logged it
    run_folder: str | None = None  # the run artifact folder it came from (``checkpoints/step-<N>``), if any


def resolve_checkpoint(source: str, dst=None, what: str = "model_uri", progress=progress) -> Located:
    """The one checkpoint ``source`` names, verified; a remote one downloaded into ``dst`` (default: a new
    temporary folder, the caller's to remove). ``what``: the option that holds ``source``, for messages."""
    source = str(source).strip()
    if source.startswith(("models:/", "runs:/")) or "://" in source:
        own_dst = dst is None
        dst = Path(tempfile.mkdtemp(prefix="vitreg-checkpoint-")) if own_dst else Path(dst)
        try:
            directory, origin = _download_source(source, dst, what, progress)
            return Located(ckpt.verify_checkpoint(directory), **origin)
        except BaseException:  # nothing to hand over: the folder made here is not left behind
            if own_dst:
                shutil.rmtree(dst, ignore_errors=True)
            raise
    else:
        path = Path(source).expanduser()
        if path_kind(path, what, f"use {SOURCES}") == "file":
            path = ckpt.follow_last(path)  # a run's checkpoints/last file, downloaded with its step folders
        if path_kind(path, what, f"use {SOURCES}") != "dir":
            raise VitregError(f"{what}={source} does not exist: use {SOURCES}")
        directory, origin = _find_checkpoint(path, source), {}
    return Located(ckpt.verify_checkpoint(directory), **origin)


def mlflow_call(fn, what: str):
    try:
        return fn()
    except mlflow.exceptions.MlflowException as exc:
        if exc.get_http_status_code() < 500:
            raise  # the server answered (no such run or model): the caller says so
        raise store_fault(exc, mlflow.get_tracking_uri(), f"trying to {what}") from None
    except Exception as exc:  # connection refused, DNS, a locked or damaged store file, ...
        if store_error_for(exc) is not None:
            raise store_fault(exc, mlflow.get_tracking_uri(), f"trying to {what}") from None
        raise VitregError(f"cannot reach the MLflow tracking server at {tracking_uri()} to {what}: "
                          f"{first_line(exc)} (check MLFLOW_TRACKING_URI)") from None


def _registered_names(client) -> list[str]:
    try:
        return sorted(rm.name for rm in client.search_registered_models(max_results=50))
    except mlflow.exceptions.MlflowException:
        return []


def _inventory(client, name: str) -> str:
    """'aliases champion (v2), staging (v1); versions 1, 2, 3' for an error message."""
    rm = client.get_registered_model(name)
    versions = sorted((int(mv.version) for mv in client.search_model_versions(f"name = '{name}'")), reverse=True)
    aliases = ", ".join(f"{a} (v{v})" for a, v in sorted((rm.aliases or {}).items())) or "none"
    shown = ", ".join(map(str, versions[:20])) + (", ..." if len(versions) > 20 else "")
    return f"aliases {aliases}; versions {shown or 'none'}" + (f" (@latest = v{versions[0]})" if versions else "")


def _download_model_version(client, uri: str, dst: Path, what: str, progress) -> tuple[Path, dict]:
    body = uri[len("models:/"):].strip("/")
    if body.startswith("m-") and "/" not in body and "@" not in body:  # a logged model id (MLflow 3)
        found = _find_checkpoint(_download(f"models:/{body}", dst, progress), uri)
        return _fetch_shared_weights(client, found, uri, progress), {}
    alias = version = None
    if "/" in body:
        name, suffix = body.split("/", 1)
        if suffix.isdigit():
            version = suffix
        elif suffix.lower() == "latest":
            alias = "latest"
        else:
            name = body  # reported below
    else:
        name, _, alias = body.rpartition("@") if "@" in body else (body, "", None)
    if not name or (alias is None and version is None):
        raise VitregError(f"{what}={uri} is not a model URI: use models:/NAME@ALIAS or models:/NAME/VERSION "
                          f"(e.g. models:/deit-tiny@champion, models:/deit-tiny/3)")
    try:
        mlflow_call(lambda: client.get_registered_model(name), f"look up {name!r}")
    except mlflow.exceptions.MlflowException:
        names = _registered_names(client)
        have = f"registered models are {', '.join(names)}" if names else "there are no registered models yet"
        raise VitregError(f"no registered model {name!r} at {tracking_uri()}: {have}") from None
    if version is None:
        if alias.lower() == "latest":
            versions = [int(mv.version) for mv in client.search_model_versions(f"name = '{name}'")]
            if not versions:
                raise VitregError(f"registered model {name!r} has no versions yet: register one first")
            version = str(max(versions))
        else:
            aliases = client.get_registered_model(name).aliases or {}
            if alias not in aliases:
                raise VitregError(f"registered model {name!r} has no alias {alias!r}: it has "
                                  f"{_inventory(client, name)}")
            version = str(aliases[alias])
    try:
        mv = client.get_model_version(name, version)
    except mlflow.exceptions.MlflowException:
        raise VitregError(f"registered model {name!r} has no version {version}: it has "
                          f"{_inventory(client, name)}") from None
    if CHECKPOINT_TAG not in (mv.tags or {}):
        progress(f"models:/{name}/{version} has no {CHECKPOINT_TAG} tag; looking for checkpoint files anyway")
    base = mlflow_call(lambda: client.get_model_version_download_uri(name, version), "resolve the version")
    label = f"models:/{name}/{version}" + (f" (@{alias})" if alias else "")
    try:
        local = _download(f"{base.rstrip('/')}/{CHECKPOINT_SUBDIR}", dst, progress, label)
    except (mlflow.exceptions.MlflowException, OSError):
        raise VitregError(f"{label} holds no vitreg checkpoint ({CHECKPOINT_SUBDIR}/manifest.json): it was not "
                          f"registered by vitreg; pull a version registered by `train` or register_checkpoint") \
            from None
    found = _fetch_shared_weights(client, _find_checkpoint(local, label), label, progress)
    return found, {"name": name, "version": str(version), "alias": alias, "run_id": mv.run_id}


def _download_run_path(client, uri: str, dst: Path, what: str, progress) -> tuple[Path, dict]:
    body = uri[len("runs:/"):].strip("/")
    run_id, _, path = body.partition("/")
    if not run_id:
        raise VitregError(f"{what}={uri} names no run: use runs:/RUN_ID/checkpoints/last")
    if ".." in path.split("/"):  # said as the input it is, before the store is asked (it refuses it too)
        raise VitregError(f"{what}={uri} leaves the run's artifacts ('..' in the path): use "
                          f"runs:/RUN_ID/checkpoints/last or another folder of the run")
    try:
        mlflow_call(lambda: client.get_run(run_id), f"look up run {run_id}")
    except mlflow.exceptions.MlflowException:
        raise VitregError(f"{what}={uri} cannot be downloaded: no run {run_id!r} at {tracking_uri()}: "
                          f"check the run id (mlflow runs list) or MLFLOW_TRACKING_URI") from None
    try:
        path, entries = _listed(client, run_id, path.strip("/"), uri, dst, progress)
    except mlflow.exceptions.MlflowException as exc:  # the store answered: it is this path that is bad
        raise CheckpointError(f"{what}={uri} cannot be read ({first_line(exc)}): it is no folder or file vitreg "
                              f"wrote; point at one of the run's checkpoints/step-<N> folders instead") from None
    if not any(Path(e.path).name == "manifest.json" for e in entries):
        subdirs = [e.path for e in entries if e.is_dir and any(
            Path(x.path).name == "manifest.json" for x in client.list_artifacts(run_id, e.path))]
        if subdirs:
            lasts = [e.path for e in entries if not e.is_dir and Path(e.path).name == ckpt.LAST]
            options = ", ".join(f"runs:/{run_id}/{p}" for p in sorted(subdirs) + lasts)
            raise VitregError(f"{uri} holds several checkpoints: pull one of {options}")
        parent = str(Path(path).parent) if path and "/" in path else None
        siblings = sorted(Path(e.path).name + ("/" if e.is_dir else "") for e in client.list_artifacts(run_id, parent))
        if entries:
            raise VitregError(f"{uri} holds no vitreg checkpoint (manifest.json + spec.json): point at a "
                              f"checkpoint folder such as runs:/{run_id}/checkpoints/last")
        where = f"{parent}/" if parent else "the run's artifact root"
        raise VitregError(f"run {run_id} has no artifact {path!r}: {where} holds "
                          f"{', '.join(siblings) or 'nothing'}")
    local = _download(f"runs:/{run_id}/{path}" if path else f"runs:/{run_id}", dst, progress)
    return _find_checkpoint(local, uri), {"run_id": run_id, "run_folder": path or None}


def _listed(client, run_id: str, path: str, uri: str, dst: Path, progress) -> tuple[str, list]:
    """``path`` in the run's artifacts and what it holds, a ``last`` file followed to the folder it names."""
    entries = client.list_artifacts(run_id, path or None)
    if not entries and _is_last_file(client, run_id, path):
        pointer = Path(_download(f"runs:/{run_id}/{path}", dst / ".last", progress))
        named = ckpt.read_last_pointer(_pointer_text(pointer, uri), uri)
        shutil.rmtree(dst / ".last", ignore_errors=True)
        path = f"{path.rpartition('/')[0]}/{named}".lstrip("/")
        entries = client.list_artifacts(run_id, path)
    return path, entries


def _pointer_text(local: Path, uri: str) -> str:
    return read_text(local, ckpt.LAST_FIX, CheckpointError, where=uri, limit=ckpt.LAST_BYTES)


def _is_last_file(client, run_id: str, path: str) -> bool:
    parent, _, name = path.rpartition("/")
    return name == ckpt.LAST and any(e.path == path and not e.is_dir
                                     for e in client.list_artifacts(run_id, parent or None))


def _download_source(source: str, dst: Path, what: str, progress) -> tuple[Path, dict]:
    client = mlflow.MlflowClient()
    if source.startswith("models:/"):
        return _download_model_version(client, source, dst, what, progress)
    if source.startswith("runs:/"):
        return _download_run_path(client, source, dst, what, progress)
    return _download_artifact_uri(source, dst, what, progress), {}


def _download_artifact_uri(uri: str, dst: Path, what: str, progress) -> Path:
    try:
        local = _download(uri, dst, progress)
        if local.is_file():  # a run's checkpoints/last: the folder it names sits beside it
            named = ckpt.read_last_pointer(_pointer_text(local, uri), uri)
            local = _download(f"{uri.rstrip('/').rpartition('/')[0]}/{named}", dst / "named", progress)
    except (mlflow.exceptions.MlflowException, OSError) as exc:
        raise VitregError(f"{what}={uri} cannot be downloaded from {tracking_uri()} ({first_line(exc)}): "
                          f"check the URI (MLFLOW_TRACKING_URI must be its store)") from None
    return _find_checkpoint(local, uri)


def _download(artifact_uri: str, dst: Path, progress, label: str | None = None) -> Path:
    quiet_artifact_downloads()  # also for Python callers (load_model): the line below says what is downloaded
    dst.mkdir(parents=True, exist_ok=True)
    progress(f"downloading {label or artifact_uri} into {dst} ...")
    return Path(mlflow_call(lambda: mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri,
                                                                         dst_path=str(dst)), "download"))


def _find_checkpoint(root: Path, label: str) -> Path:
    root = Path(root)
    found = sorted({p.parent for p in root.rglob("manifest.json") if (p.parent / "spec.json").is_file()})
    if len(found) == 1:
        return found[0]
    if not found:
        raise VitregError(f"{label} holds no vitreg checkpoint (manifest.json + spec.json): point at a "
                          f"checkpoint folder such as runs:/RUN_ID/checkpoints/last")
    rel = ", ".join(str(p.relative_to(root)) for p in found)
    raise VitregError(f"{label} holds several checkpoints ({rel}): pull one of them")


def shared_weights_text(run_id: str, folder: str) -> str:
    """The ``shared_weights.json`` of a version whose weights are those of run ``run_id``'s ``folder``."""
    return json.dumps({"format": SHARED_FORMAT, "run_id": run_id, "checkpoint": folder}, indent=2)


def _fetch_shared_weights(client, directory: Path, label: str, progress) -> Path:
    """``directory`` with its weights: a version that shares them with its run gets them from there."""
    pointer = directory / SHARED_WEIGHTS
    if (directory / ckpt.WEIGHTS).exists() or not pointer.is_file():
        return directory
    shared = read_json(pointer, "register the model again from its checkpoint", where=f"{label}: {pointer.name}")
    try:
        run_id, folder = shared["run_id"], shared["checkpoint"]
        usable = shared.get("format") == SHARED_FORMAT and _RUN_ID.match(run_id) and \
            re.fullmatch(r"checkpoints/step-\d+", folder)
    except (KeyError, TypeError):
        usable = False
    if not usable:
        raise VitregError(f"{label}: {CHECKPOINT_SUBDIR}/{SHARED_WEIGHTS} does not name a run checkpoint "
                          f"(run_id, checkpoints/step-<N>): register the model again from its checkpoint")
    where = f"runs:/{run_id}/{folder}/{ckpt.WEIGHTS}"
    try:
        mlflow_call(lambda: client.get_run(run_id), f"look up run {run_id}")
        _download(where, directory, progress, f"{label}'s weights ({where})")
    except (mlflow.exceptions.MlflowException, OSError) as exc:
        raise VitregError(f"{label} shares its weights with {where}, which cannot be read ({first_line(exc)}): "
                          f"the run or its checkpoint was deleted; register the model again from a checkpoint "
                          f"folder") from None
    return directory


# --------------------------------------------------------------------------- pull


@dataclass
class PullResult:
    uri: str
    model: object
    info: object  # vitreg.models.factory.ModelInfo
    spec: dict
    checkpoint_dir: Path  # the verified files (a download folder, or the local folder given)
    registered_model_name: str | None = None
    registered_model_version: str | None = None
    alias: str | None = None
    run_id: str | None = None  # the run that produced the checkpoint
    out_dir: Path | None = None
    output_shape: tuple = ()
    files: list = field(default_factory=list)

    @property
    def version_uri(self) -> str | None:
        if self.registered_model_name and self.registered_model_version:
            return f"models:/{self.registered_model_name}/{self.registered_model_version}"
        return None

    def describe(self) -> str:
        what = self.version_uri or self.uri
        if self.alias:
            what = f"{self.uri} (= {self.version_uri})"
        lines = [f"pulled {what}: {self.info.name}, {self.info.img_size}px, {self.info.num_classes} classes, "
                 f"{self.info.params_m:.1f} M params, step {self.spec.get('step', '?')}",
                 f"  files:   {self.checkpoint_dir} (sha256 verified)",
                 f"  forward: {tuple(self.output_shape)} finite on a random batch"]
        if self.run_id:
            lines.append(f"  run:     {self.run_id}")
        if self.out_dir:
            lines.append(f"  out:     {self.out_dir} (model.safetensors, spec.json, manifest.json, README.md)")
        return "\n".join(lines)


def pull(uri: str, out_dir=None, dst=None, progress=progress) -> PullResult:
    """Download, verify (sha256), rebuild and smoke-test a registered model. ``dst``: where the files go
    (default: a new temporary folder, kept and printed); ``out_dir``: a self-contained copy besides."""
    uri = str(uri).strip()
    own_dst = dst is None  # a folder we create: removed on failure, and when --out holds the files
    dst = Path(tempfile.mkdtemp(prefix="vitreg-pull-")) if own_dst else Path(dst)
    try:
        located = resolve_checkpoint(uri, dst, progress=progress)
        directory = located.checkpoint.directory
        model, info, spec = ckpt.load_model(located.checkpoint)
        shape = forward_check(model, info)
        result = PullResult(uri=uri, model=model, info=info, spec=spec, checkpoint_dir=directory,
                            registered_model_name=located.name, registered_model_version=located.version,
                            alias=located.alias, run_id=located.run_id, output_shape=shape,
                            files=sorted(p.name for p in directory.iterdir()))
        if out_dir:
            result.out_dir = export_folder(located.checkpoint, Path(out_dir), uri)
            if own_dst:
                result.checkpoint_dir = result.out_dir
                shutil.rmtree(dst, ignore_errors=True)
    except BaseException:
        if own_dst:
            shutil.rmtree(dst, ignore_errors=True)
        raise
    return result


def load_model(uri: str, device: str = "cpu"):
    with tempfile.TemporaryDirectory(prefix="vitreg-pull-") as tmp:
        result = pull(uri, dst=tmp, progress=lambda message: None)
    return result.model.to(device), result.info, result.spec


def forward_check(model, info, batch: int = 2) -> tuple:
    """One forward pass on a random batch: the output must be (batch, num_classes) and finite."""
    import torch

    x = torch.randn(batch, 3, info.img_size, info.img_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(x)
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    for o in outputs:
        if tuple(o.shape) != (batch, info.num_classes):
            raise VitregError(f"pulled {info.name} returns shape {tuple(o.shape)} for a batch of {batch}, expected "
                              f"{(batch, info.num_classes)}: its spec.json does not match its weights")
        if not bool(torch.isfinite(o).all()):
            raise VitregError(f"pulled {info.name} returns non-finite outputs: the weights are broken (NaN/inf); "
                              f"pull another version")
    return tuple(outputs[0].shape)


def link_infer_run(result: PullResult, run_id: str, metrics: dict, gpu: str | None = None) -> None:
    if not result.version_uri:
        return
    client = mlflow.MlflowClient()
    tags = {"last_infer_run_id": run_id, "last_infer_gpu": gpu}
    for key in ("infer_throughput_img_per_s", "infer_latency_ms_p50"):
        if key in metrics:
            tags[f"last_{key}"] = f"{metrics[key]:.6g}"
    for key, value in tags.items():
        if value is not None:
            client.set_model_version_tag(result.registered_model_name, result.registered_model_version, key, value)
