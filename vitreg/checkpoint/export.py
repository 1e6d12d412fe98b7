"""A checkpoint as a self-contained folder for users: the weights, spec.json, a manifest of exactly those, and
a README with the loader (``vitreg pull --out``, and the files a registered version holds). The training-only
state is left out. ``--out`` is written all or nothing (a temporary folder beside it, verified, then renamed).

The files get the user's permissions (their umask), whatever mode the file they were made from had:
``safetensors`` writes ``model.safetensors`` as 0600, MLflow's store and downloads keep that mode, and
``shutil.copy2`` copied it, so exported weights were readable by their owner only.
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
    """Copy the checkpoint minus training-only state into ``stage``, with a manifest listing exactly that.

    ``leave_out``: files the manifest still lists but that are not copied (weights a registered version
    shares with its run: the manifest keeps their sha256, so the bytes fetched later are checked)."""
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
    """Write the verified files and a README.md with the 3-line loader into ``out``, all or nothing.

    ``out`` must be new, empty, or an earlier export (only the files an export writes): nothing of
    the user's is replaced.
    """
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
    """Rename ``partial`` to ``out``; an earlier export there is moved aside first and removed after."""
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


# ---------------------------------------------------------------- file modes

def copy_as_new_file(src, dst) -> Path:
    """Copy ``src``'s bytes (not its mode) to ``dst``, a new file created with the umask's mode."""
    dst = Path(dst)
    dst.unlink(missing_ok=True)  # an existing file would keep its own mode; a new one gets 0666 & ~umask
    shutil.copyfile(src, dst)
    return dst


def follow_umask(path) -> Path:
    """Give a file that a library created with its own mode (safetensors' 0600) the umask's mode."""
    path = Path(path)
    os.chmod(path, 0o666 & ~current_umask())
    return path


def current_umask() -> int:
    """The process's umask. Linux shows it in /proc/self/status; elsewhere it is read by setting it
    and setting it back (a moment in which another thread's new files would get 0o022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
