"""A checkpoint as a self-contained folder for users (``vitreg pull --out``, a registered version's files): the
weights, spec.json, their manifest and a README with the loader, written all or nothing. The files get the user's
umask, not the 0600 safetensors writes (MLflow keeps that mode; copying it made exports readable by their owner only).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from vitreg.checkpoint import format as ckpt
from vitreg.errors import VitregError

#: Training-only state (optimizer, scheduler, scaler): not needed to use a model, ~2x the weights.
TRAIN_ONLY_FILES = (ckpt.STATE,)
README = "README.md"


def stage_files(checkpoint: ckpt.VerifiedCheckpoint, stage: Path, leave_out: tuple = ()) -> list[Path]:
    """The checkpoint minus training-only state, with its manifest, into ``stage``. ``leave_out``: listed, not
    copied (weights a registered version shares with its run: their sha256 checks the bytes fetched later)."""
    stage.mkdir(parents=True, exist_ok=True)
    manifest = checkpoint.manifest
    files = {k: v for k, v in manifest["files"].items() if k not in TRAIN_ONLY_FILES}
    copied = [rel for rel in sorted(files) if rel not in leave_out]
    for rel in copied:  # verify_checkpoint confined every name to the folder already: a flat name each
        copy_as_new_file(ckpt.confined(checkpoint.directory, rel), stage / rel)  # the user's umask, not 0600
    (stage / ckpt.MANIFEST).write_text(json.dumps({**manifest, "files": files}, indent=2, sort_keys=True))
    return [stage / rel for rel in copied] + [stage / ckpt.MANIFEST]


_README = """\
# {model} ({source})

Exported by `vitreg pull {source} --out DIR`. Weights: `model.safetensors` (sha256 in
`manifest.json`); architecture: `spec.json` ({family} `{model}`, {img_size}px, {num_classes} classes).

Load it with {family} + safetensors only (no vitreg, no MLflow, nothing unpickled):

```python
import json, safetensors.torch, {family}
spec = json.load(open("spec.json"))
{build}
model.load_state_dict(safetensors.torch.load_file("model.safetensors")); model.eval()
```
"""


def export_folder(checkpoint: ckpt.VerifiedCheckpoint, out: Path, source: str) -> Path:
    """The verified files and a README.md with the loader into ``out`` (new, empty or an earlier export)."""
    from vitreg.models.families import family_of

    out = Path(out)
    if out.resolve() == checkpoint.directory.resolve():
        raise VitregError(f"--out {out} is the download folder itself: pass another folder")
    _check_replaceable(out)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        stage_files(checkpoint, partial)
        spec = checkpoint.spec
        family = family_of(str(spec["model"]))
        (partial / README).write_text(_README.format(
            model=spec["model"], source=source, img_size=spec.get("img_size"), num_classes=spec.get("num_classes"),
            family=family.library, build=family.loader_line))
        ckpt.verify_checkpoint(partial)  # the copy, as a user will load it
        _swap_into_place(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _check_replaceable(out: Path) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise VitregError(f"--out {out} is a file: pass a folder (new, empty, or an earlier export)")
    theirs = sorted(p.name for p in out.iterdir() if p.name not in (ckpt.WEIGHTS, ckpt.SPEC, ckpt.MANIFEST, README))
    if theirs:
        raise VitregError(f"--out {out} holds files an export does not write ({', '.join(theirs[:3])}): pass a new "
                          f"or empty folder")


def _swap_into_place(partial: Path, out: Path) -> None:
    if not out.exists():
        os.rename(partial, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    try:
        os.rename(partial, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def copy_as_new_file(src, dst) -> Path:
    """Copy ``src``'s bytes (not its mode) to ``dst``, a new file created with the umask's mode."""
    dst = Path(dst)
    dst.unlink(missing_ok=True)  # an existing file would keep its own mode; a new one gets 0666 & ~umask
    shutil.copyfile(src, dst)
    return dst
