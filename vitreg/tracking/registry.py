"""The MLflow Model Registry side of vitreg: register a checkpoint, pull it back as a real timm model.

A registered version is self-contained. It holds two things:

- the MLflow ``pytorch`` flavor (pt2, ``torch.export``), so the MLflow UI, ``mlflow models serve``
  and pyfunc work as usual;
- the vitreg checkpoint itself (``model.safetensors``, ``spec.json``, ``manifest.json``) in the
  logged model's ``extra_files/``. That is what :func:`pull` reads: it verifies the sha256 of every
  file, rebuilds the timm model from ``spec.json`` and loads the safetensors weights. Nothing is
  unpickled, and the pt2 graph is never loaded (it is a GraphModule pinned to the device it was
  exported on, not the timm model).

URIs :func:`pull` accepts: ``models:/NAME@ALIAS`` (``@latest`` is MLflow's built-in newest version),
``models:/NAME/VERSION``, ``runs:/RUN_ID/checkpoints/last`` (any run folder holding a checkpoint),
``models:/m-<id>`` (a logged model), and a local checkpoint folder.

This module and :mod:`vitreg.tracking.runs` are the only ones that import mlflow.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from vitreg.console import progress
from vitreg.errors import VitregError

#: Where the checkpoint files live inside a registered model version's artifacts.
CHECKPOINT_SUBDIR = "extra_files"
#: Training-only state (optimizer, scheduler, scaler): not needed to use a model, ~2x the weights.
TRAIN_ONLY_FILES = ("train_state.pt",)
#: Tag that marks a model version as a vitreg checkpoint (value: the checkpoint format).
CHECKPOINT_TAG = "vitreg_checkpoint"
#: Batch of the pt2 input example. A batch of 1 makes torch.export specialise the batch dimension to
#: the constant 1 (the served model would take one image at a time); 2 keeps it dynamic.
EXAMPLE_BATCH = 2
_ALIAS_RE = re.compile(r"^[\w\-]+$")
_NAME_RE = re.compile(r"^[\w.\-]+$")
_VERSION_ALIAS_RE = re.compile(r"^[vV]\d+$")


def _checkpoint():
    # Imported when used: vitreg.train.checkpoint is the training side's module.
    from vitreg.train import checkpoint

    return checkpoint


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --------------------------------------------------------------------------- register


def register_checkpoint(tracker, checkpoint_dir, name: str, alias: str | None = "latest", tags: dict | None = None,
                        input_example_size: int | None = None, progress=progress):
    """Register a vitreg checkpoint as a new version of registered model ``name``; returns the ModelVersion.

    ``tracker`` is the :class:`vitreg.tracking.runs.Tracker` of the run that produced the checkpoint: the
    model is logged under that run (MLflow 3: a logged model linked to the run) and the version's
    ``source_run_id``, ``gpu`` and ``train_throughput_img_per_s`` tags come from it.
    ``checkpoint_dir`` is a local checkpoint folder or a ``runs:/`` URI of one. ``alias`` is moved to
    the new version; ``"latest"`` (the default) sets nothing, because MLflow reserves it and already
    resolves ``models:/NAME@latest`` to the newest version. ``input_example_size`` is the side of the
    pt2 input example (default: the checkpoint's ``img_size``).

    Refuses (VitregError) an invalid alias, a tampered checkpoint, and a registered model ``name``
    whose versions are another architecture. Ranks other than 0 (a NullTracker) register nothing and
    get ``None``.
    """
    if getattr(tracker, "run", None) is None:
        return None
    ckpt = _checkpoint()
    _check_alias(alias)
    name = _check_name(name)
    client = MlflowClient()
    with tempfile.TemporaryDirectory(prefix="vitreg-register-") as tmp:
        source_desc = str(checkpoint_dir)
        if source_desc.startswith(("runs:/", "models:/")):
            checkpoint_dir = _download_checkpoint(client, source_desc, Path(tmp) / "download", progress).directory
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.is_dir():
            raise VitregError(f"checkpoint folder {checkpoint_dir} does not exist: pass the folder save_checkpoint "
                              f"wrote (with model.safetensors, spec.json, manifest.json)")
        manifest = ckpt.verify_checkpoint(checkpoint_dir)
        model, info, spec = ckpt.load_model(checkpoint_dir)
        _check_owner(client, name, spec["model"])

        staged = _stage_files(checkpoint_dir, Path(tmp) / "stage")
        side = int(input_example_size or info.img_size)
        import mlflow.pytorch  # the flavor module (imports torch.export machinery): only when registering
        import numpy as np

        example = np.random.default_rng(0).standard_normal((EXAMPLE_BATCH, 3, side, side), dtype=np.float32)
        progress(f"logging {spec['model']} ({info.params_m:.1f} M params) as an MLflow pytorch model (pt2) "
                 f"under run {tracker.run_id} ...")
        try:
            logged = mlflow.pytorch.log_model(
                model.eval(), name="model", input_example=example, serialization_format="pt2",
                pip_requirements=_pip_requirements(), extra_files=[str(p) for p in staged], run_id=tracker.run_id,
                # MLflow would reload the pt2 and serve the example (~half the time), and only warn on failure
                validate_serving_input=False,
                metadata={CHECKPOINT_TAG: _format_of(manifest, checkpoint_dir), "vitreg_model": spec["model"]})
            version_tags = _version_tags(client, tracker.run_id, spec, info, checkpoint_dir, source_desc, tags)
            mv = mlflow.register_model(logged.model_uri, name, tags=version_tags)
            _tag_registered_model(client, name, spec["model"])
            moved_from = None
            if alias and alias.lower() != "latest":
                moved_from = _alias_version(client, name, alias)
                client.set_registered_model_alias(name, alias, mv.version)
            client.set_tag(tracker.run_id, "registered_model_name", name)
            client.set_tag(tracker.run_id, "registered_model_version", str(mv.version))
            mv = client.get_model_version(name, mv.version)
        except MlflowException as exc:
            raise VitregError(f"could not register {name!r} at {mlflow.get_tracking_uri()}: {_first_line(exc)}") \
                from None
    where = f"models:/{name}/{mv.version}"
    if alias and alias.lower() != "latest":
        note = f" (moved from v{moved_from})" if moved_from and str(moved_from) != str(mv.version) else ""
        where += f", models:/{name}@{alias}{note}"
    progress(f"registered {spec['model']} as {where}, models:/{name}@latest")
    return mv


_RUN_CHECKPOINT_RE = re.compile(r"^runs:/([0-9a-fA-F]+)/(checkpoints/[\w.\-]+)/?$")


def register_run_checkpoint(uri: str, name: str, alias: str | None = "latest", progress=progress):
    """Register a checkpoint that a run logged (``runs:/<run_id>/checkpoints/last`` or ``.../step-<N>``)
    after the fact: the model is logged under that run and the version linked to it, exactly as
    ``train -P register_as=NAME`` does at the end of training. Returns the ModelVersion."""
    match = _RUN_CHECKPOINT_RE.match(str(uri).strip())
    if not match:
        raise VitregError(f"{uri} is not a run's checkpoint: pass runs:/<run_id>/checkpoints/last "
                          f"(or .../checkpoints/step-<N>), as a train run logs them")
    run_id = match.group(1)
    client = MlflowClient()
    try:
        run = _mlflow_call(lambda: client.get_run(run_id), "find the run")
    except MlflowException:
        raise VitregError(f"no run {run_id} at {mlflow.get_tracking_uri()}: check the run id and MLFLOW_TRACKING_URI") \
            from None
    from vitreg.tracking.runs import MlflowTracker

    return register_checkpoint(MlflowTracker(run), f"runs:/{run_id}/{match.group(2)}", name, alias, progress=progress)


def check_registration(name: str, alias: str | None, arch: str) -> None:
    """The registration checks that need no checkpoint: a usable name and alias, and a registered
    model ``name`` that holds no other architecture. ``train`` runs them before training, so a bad
    ``register_as`` fails in seconds rather than after the whole training."""
    _check_alias(alias)
    _check_owner(MlflowClient(), _check_name(name), arch)


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
    except MlflowException:
        return  # no such registered model yet
    others = sorted({(mv.tags or {}).get("model", "unknown (not registered by vitreg)") for mv in versions} - {arch})
    if others:
        owned = ", ".join(others)
        raise VitregError(f"registered model {name!r} already holds versions of {owned}, not {arch}: "
                          f"choose another register_as (e.g. register_as={name}-{arch.replace('_', '-')})")


def _tag_registered_model(client, name: str, arch: str) -> None:
    tags = client.get_registered_model(name).tags or {}
    if tags.get("model") != arch:
        client.set_registered_model_tag(name, "model", arch)


def _alias_version(client, name: str, alias: str):
    return (client.get_registered_model(name).aliases or {}).get(alias)


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


def _read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _format_of(manifest, directory: Path) -> str:
    if isinstance(manifest, dict) and manifest.get("format"):
        return str(manifest["format"])
    return str(_read_json(directory / "manifest.json").get("format", "vitreg-checkpoint"))


def _stage_files(directory: Path, stage: Path) -> list[Path]:
    """Copy the checkpoint minus training-only state into ``stage``, with a manifest listing exactly that."""
    stage.mkdir(parents=True, exist_ok=True)
    manifest = _read_json(directory / "manifest.json")
    files = {k: v for k, v in manifest.get("files", {}).items() if k not in TRAIN_ONLY_FILES}
    for rel in files:
        if "/" in rel:
            raise VitregError(f"checkpoint {directory} lists a nested file {rel!r}: vitreg checkpoints are flat folders")
        shutil.copy2(directory / rel, stage / rel)
    (stage / "manifest.json").write_text(json.dumps({**manifest, "files": files}, indent=2, sort_keys=True))
    return [stage / rel for rel in sorted(files)] + [stage / "manifest.json"]


def _version_tags(client, run_id: str, spec: dict, info, directory: Path, source: str, extra: dict | None) -> dict:
    run = client.get_run(run_id)
    manifest = _read_json(directory / "manifest.json")
    weights = manifest.get("files", {}).get("model.safetensors", {})
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
        CHECKPOINT_TAG: manifest.get("format", "vitreg-checkpoint"),
        "checkpoint_source": source if source.startswith(("runs:/", "models:/")) else _run_relative(directory, run_id),
        "weights_sha256": weights.get("sha256"),
    }
    tags.update(extra or {})
    return {k: str(v) for k, v in tags.items() if v is not None and not str(k).startswith("mlflow.")}


def _run_relative(directory: Path, run_id: str) -> str:
    # Training saves checkpoints/step-<N>/ and checkpoints/last/ locally and logs them under the
    # same names: name the run artifact when the folder looks like one, else the local path.
    directory = Path(directory).resolve()
    if directory.parent.name == "checkpoints":
        return f"runs:/{run_id}/checkpoints/{directory.name}"
    return str(directory)


# --------------------------------------------------------------------------- pull


@dataclass
class PullResult:
    """A pulled model: the rebuilt timm model, where its files are, and where it came from."""

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


@dataclass
class _Located:
    directory: Path
    name: str | None = None
    version: str | None = None
    alias: str | None = None
    run_id: str | None = None


def pull(uri: str, out_dir=None, dst=None, progress=progress) -> PullResult:
    """Download, verify (sha256), rebuild and smoke-test a registered model; optionally export it.

    ``dst`` is where the downloaded files go (default: a new temporary folder, kept and printed).
    ``out_dir`` additionally receives a self-contained copy: ``model.safetensors``, ``spec.json``,
    ``manifest.json`` and a README.md showing how to load it with timm + safetensors alone.
    Unknown models, aliases, versions and run paths raise VitregError naming what exists.
    """
    uri = str(uri).strip()
    client = MlflowClient()
    own_dst = dst is None  # a folder we create: removed on failure, and when --out holds the files
    dst = Path(tempfile.mkdtemp(prefix="vitreg-pull-")) if own_dst else Path(dst)
    try:
        located = _download_checkpoint(client, uri, dst, progress)
        ckpt = _checkpoint()
        ckpt.verify_checkpoint(located.directory)
        model, info, spec = ckpt.load_model(located.directory)
        model.eval()
        shape = forward_check(model, info)
        result = PullResult(uri=uri, model=model, info=info, spec=spec, checkpoint_dir=located.directory,
                            registered_model_name=located.name, registered_model_version=located.version,
                            alias=located.alias, run_id=located.run_id, output_shape=shape,
                            files=sorted(p.name for p in located.directory.iterdir()))
        if out_dir:
            result.out_dir = export_folder(located.directory, Path(out_dir), spec, uri)
            if own_dst:
                result.checkpoint_dir = result.out_dir
                shutil.rmtree(dst, ignore_errors=True)
    except BaseException:
        if own_dst:
            shutil.rmtree(dst, ignore_errors=True)
        raise
    return result


def load_model(uri: str, device: str = "cpu"):
    """``(model, ModelInfo, spec_json)`` of a registered model or checkpoint URI (see :func:`pull`)."""
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


def _download_checkpoint(client, uri: str, dst: Path, progress) -> _Located:
    if uri.startswith("models:/"):
        return _download_model_version(client, uri, dst, progress)
    if uri.startswith("runs:/"):
        return _download_run_path(client, uri, dst, progress)
    path = Path(uri).expanduser()
    if path.is_dir():
        return _Located(_find_checkpoint(path, uri))
    raise VitregError(f"cannot pull {uri!r}: use models:/NAME@ALIAS, models:/NAME/VERSION, "
                      f"runs:/RUN_ID/checkpoints/last or a local checkpoint folder")


def _mlflow_call(fn, what: str):
    try:
        return fn()
    except MlflowException:
        raise
    except Exception as exc:  # connection refused, DNS, ...
        raise VitregError(f"cannot reach the MLflow tracking server at {mlflow.get_tracking_uri()} to {what}: "
                          f"{_first_line(exc)} (check MLFLOW_TRACKING_URI)") from None


def _registered_names(client) -> list[str]:
    try:
        return sorted(rm.name for rm in client.search_registered_models(max_results=50))
    except MlflowException:
        return []


def _inventory(client, name: str) -> str:
    """'aliases champion (v2), staging (v1); versions 1, 2, 3' for an error message."""
    rm = client.get_registered_model(name)
    versions = sorted((int(mv.version) for mv in client.search_model_versions(f"name = '{name}'")), reverse=True)
    aliases = ", ".join(f"{a} (v{v})" for a, v in sorted((rm.aliases or {}).items())) or "none"
    shown = ", ".join(map(str, versions[:20])) + (", ..." if len(versions) > 20 else "")
    return f"aliases {aliases}; versions {shown or 'none'}" + (f" (@latest = v{versions[0]})" if versions else "")


def _download_model_version(client, uri: str, dst: Path, progress) -> _Located:
    body = uri[len("models:/"):].strip("/")
    if body.startswith("m-") and "/" not in body and "@" not in body:  # a logged model id (MLflow 3)
        local = _download(f"models:/{body}", dst, progress)
        return _Located(_find_checkpoint(local, uri))
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
        raise VitregError(f"cannot pull {uri!r}: use models:/NAME@ALIAS or models:/NAME/VERSION "
                          f"(e.g. models:/deit-tiny@champion, models:/deit-tiny/3)")
    try:
        _mlflow_call(lambda: client.get_registered_model(name), f"look up {name!r}")
    except MlflowException:
        names = _registered_names(client)
        have = f"registered models are {', '.join(names)}" if names else "there are no registered models yet"
        raise VitregError(f"no registered model {name!r} at {mlflow.get_tracking_uri()}: {have}") from None
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
    except MlflowException:
        raise VitregError(f"registered model {name!r} has no version {version}: it has "
                          f"{_inventory(client, name)}") from None
    if CHECKPOINT_TAG not in (mv.tags or {}):
        progress(f"models:/{name}/{version} has no {CHECKPOINT_TAG} tag; looking for checkpoint files anyway")
    base = _mlflow_call(lambda: client.get_model_version_download_uri(name, version), "resolve the version")
    label = f"models:/{name}/{version}" + (f" (@{alias})" if alias else "")
    try:
        local = _download(f"{base.rstrip('/')}/{CHECKPOINT_SUBDIR}", dst, progress, label)
    except (MlflowException, OSError):
        raise VitregError(f"{label} holds no vitreg checkpoint ({CHECKPOINT_SUBDIR}/manifest.json): it was not "
                          f"registered by vitreg; pull a version registered by `train` or register_checkpoint") \
            from None
    return _Located(_find_checkpoint(local, label), name=name, version=str(version), alias=alias, run_id=mv.run_id)


def _download_run_path(client, uri: str, dst: Path, progress) -> _Located:
    body = uri[len("runs:/"):].strip("/")
    run_id, _, path = body.partition("/")
    if not run_id:
        raise VitregError(f"cannot pull {uri!r}: use runs:/RUN_ID/checkpoints/last")
    try:
        _mlflow_call(lambda: client.get_run(run_id), f"look up run {run_id}")
    except MlflowException:
        raise VitregError(f"no run {run_id!r} at {mlflow.get_tracking_uri()}: check the run id "
                          f"(mlflow runs list) or MLFLOW_TRACKING_URI") from None
    path = path.strip("/")
    entries = client.list_artifacts(run_id, path or None)
    names = {Path(e.path).name: e for e in entries}
    if "manifest.json" not in names:
        subdirs = [e.path for e in entries if e.is_dir and any(
            Path(x.path).name == "manifest.json" for x in client.list_artifacts(run_id, e.path))]
        if subdirs:
            options = ", ".join(f"runs:/{run_id}/{p}" for p in sorted(subdirs))
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
    return _Located(_find_checkpoint(local, uri), run_id=run_id)


def _download(artifact_uri: str, dst: Path, progress, label: str | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    progress(f"downloading {label or artifact_uri} into {dst} ...")
    return Path(_mlflow_call(lambda: mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri,
                                                                         dst_path=str(dst)), "download"))


def _find_checkpoint(root: Path, label: str) -> Path:
    """The one folder under ``root`` that holds manifest.json + spec.json."""
    root = Path(root)
    found = sorted({p.parent for p in root.rglob("manifest.json") if (p.parent / "spec.json").is_file()})
    if len(found) == 1:
        return found[0]
    if not found:
        raise VitregError(f"{label} holds no vitreg checkpoint (manifest.json + spec.json): point at a "
                          f"checkpoint folder such as runs:/RUN_ID/checkpoints/last")
    rel = ", ".join(str(p.relative_to(root)) for p in found)
    raise VitregError(f"{label} holds several checkpoints ({rel}): pull one of them")


# --------------------------------------------------------------------------- export


_README = """\
# {model} ({source})

Exported by `vitreg pull {source} --out DIR`. Weights: `model.safetensors` (sha256 in
`manifest.json`); architecture: `spec.json` (timm `{model}`, {img_size}px, {num_classes} classes).

Load it with timm + safetensors only (no vitreg, no MLflow, nothing unpickled):

```python
import json, safetensors.torch, {lib}
spec = json.load(open("spec.json"))
{build}
model.load_state_dict(safetensors.torch.load_file("model.safetensors")); model.eval()
```
"""

TIMM_BUILD = ('model = timm.create_model(spec["model"], pretrained=False, img_size=spec["img_size"], '
              'num_classes=spec["num_classes"])')
TORCHVISION_BUILD = ('model = getattr(torchvision.models, spec["model"].split(":", 1)[1])(weights=None, '
                     'image_size=spec["img_size"], num_classes=spec["num_classes"])')


def export_folder(checkpoint_dir: Path, out: Path, spec: dict, source: str) -> Path:
    """Copy the verified files into ``out`` and write a README.md with the 3-line loader."""
    if out.resolve() == Path(checkpoint_dir).resolve():
        raise VitregError(f"--out {out} is the download folder itself: pass another folder")
    _stage_files(Path(checkpoint_dir), out)
    torchvision = str(spec["model"]).startswith("torchvision:")
    (out / "README.md").write_text(_README.format(
        model=spec["model"], source=source, img_size=spec.get("img_size"), num_classes=spec.get("num_classes"),
        lib="torchvision" if torchvision else "timm", build=TORCHVISION_BUILD if torchvision else TIMM_BUILD))
    _checkpoint().verify_checkpoint(out)
    return out


# --------------------------------------------------------------------------- infer linkage


def link_infer_run(result: PullResult, run_id: str, metrics: dict, gpu: str | None = None) -> None:
    """Tag the model version (when the URI named one) with the infer run that benchmarked it."""
    if not result.version_uri:
        return
    client = MlflowClient()
    tags = {"last_infer_run_id": run_id, "last_infer_gpu": gpu}
    for key in ("infer_throughput_img_per_s", "infer_latency_ms_p50"):
        if key in metrics:
            tags[f"last_{key}"] = f"{metrics[key]:.6g}"
    for key, value in tags.items():
        if value is not None:
            client.set_model_version_tag(result.registered_model_name, result.registered_model_version, key, value)
