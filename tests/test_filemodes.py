"""Files vitreg writes for the user follow the user's umask, not the 0600 of the file they came from
(safetensors writes model.safetensors as 0600; `pull --out` copied that mode)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from vitreg.checkpoint.export import copy_as_new_file


def mode(path) -> int:
    return stat.S_IMODE(Path(path).stat().st_mode)


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_a_copy_of_a_0600_file_gets_the_umask_s_mode(tmp_path, umask):
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"weights")
    src.chmod(0o600)
    dst = copy_as_new_file(src, tmp_path / "out.safetensors")
    assert dst.read_bytes() == b"weights" and mode(dst) == 0o666 & ~umask
    (tmp_path / "again").write_bytes(b"old")
    (tmp_path / "again").chmod(0o600)  # a file already there is replaced, not reused with its mode
    assert mode(copy_as_new_file(src, tmp_path / "again")) == 0o666 & ~umask


def test_pull_out_folder_follows_the_umask(tmp_path):
    from click.testing import CliRunner

    from vitreg.cli.main import main
    from vitreg.models.factory import create_model
    from vitreg.checkpoint.format import save_checkpoint

    old = os.umask(0o022)
    try:
        model, info = create_model("test_vit", 32, 10)
        ckpt = save_checkpoint(tmp_path / "ckpt", model, step=1, spec={"model": "test_vit"}, model_info=info)
        res = CliRunner().invoke(main, ["pull", str(ckpt), "--out", str(tmp_path / "export")])
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    modes = {p.name: mode(p) for p in (tmp_path / "export").iterdir()}
    assert modes == dict.fromkeys(["README.md", "manifest.json", "model.safetensors", "spec.json"], 0o644), modes
