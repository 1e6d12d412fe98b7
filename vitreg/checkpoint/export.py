"""A checkpoint as a self-contained folder for users: the weights, spec.json, a manifest of exactly
those, and a README with the loader (``vitreg pull --out``, and the files a registered version holds).

The training-only state (``train_state.pt``: optimizer, scheduler, scaler, ~2x the weights) is left out.
"""

from __future__ import annotations

import json
from pathlib import Path

from vitreg.checkpoint import format as ckpt
from vitreg.checkpoint.filemodes import copy_as_new_file
from vitreg.errors import VitregError

#: Training-only state (optimizer, scheduler, scaler): not needed to use a model, ~2x the weights.
TRAIN_ONLY_FILES = (ckpt.STATE,)


def stage_files(checkpoint: ckpt.VerifiedCheckpoint, stage: Path) -> list[Path]:
    """Copy the checkpoint minus training-only state into ``stage``, with a manifest listing exactly that."""
    stage.mkdir(parents=True, exist_ok=True)
    manifest = checkpoint.manifest
    files = {k: v for k, v in manifest["files"].items() if k not in TRAIN_ONLY_FILES}
    for rel in files:
        if "/" in rel:
            raise VitregError(f"checkpoint {checkpoint.directory} lists a nested file {rel!r}: vitreg checkpoints "
                              f"are flat folders")
        copy_as_new_file(checkpoint.directory / rel, stage / rel)  # the user's umask, not safetensors' 0600
    (stage / ckpt.MANIFEST).write_text(json.dumps({**manifest, "files": files}, indent=2, sort_keys=True))
    return [stage / rel for rel in sorted(files)] + [stage / ckpt.MANIFEST]


_README = """\
# {model} ({source})

Exported by `vitreg pull {source} --out DIR`. Weights: `model.safetensors` (sha256 in
`manifest.json`); architecture: `spec.json` ({lib} `{model}`, {img_size}px, {num_classes} classes).

Load it with {lib} + safetensors only (no vitreg, no MLflow, nothing unpickled):

```python
import json, safetensors.torch, {lib}
spec = json.load(open("spec.json"))
{build}
model.load_state_dict(safetensors.torch.load_file("model.safetensors")); model.eval()
```
"""


def export_folder(checkpoint: ckpt.VerifiedCheckpoint, out: Path, source: str) -> Path:
    """Copy the verified files into ``out`` and write a README.md with the 3-line loader."""
    if out.resolve() == checkpoint.directory.resolve():
        raise VitregError(f"--out {out} is the download folder itself: pass another folder")
    from vitreg.models.families import family_of

    stage_files(checkpoint, out)
    spec = checkpoint.spec
    family = family_of(str(spec["model"]))
    (out / "README.md").write_text(_README.format(
        model=spec["model"], source=source, img_size=spec.get("img_size"), num_classes=spec.get("num_classes"),
        lib=family.library, build=family.loader_line))
    ckpt.verify_checkpoint(out)  # the copy, as a user will load it
    return out
