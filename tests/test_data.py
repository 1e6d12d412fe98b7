"""An ImageFolder with a file PIL cannot decode: `train` stops with one line naming the file, with and
without DataLoader worker processes (whose errors reach the main process as a traceback string)."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from vitreg.cli.main import main


@pytest.fixture
def folder_with_a_corrupt_jpeg(tmp_path):
    """train/<a|b>/ with 8 real PNGs and one .jpg that is a truncated JPEG: 9 images, 3 batches of 3."""
    import io

    from PIL import Image

    root = tmp_path / "data"
    for i in range(8):
        cls = root / "train" / "ab"[i % 2]
        cls.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 40), (30 * i, 20, 200 - 20 * i)).save(cls / f"{i}.png")
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), (1, 2, 3)).save(buffer, format="JPEG")
    bad = root / "train" / "b" / "broken.jpg"
    bad.write_bytes(buffer.getvalue()[:40])  # the header and no image data, as a cut-off copy leaves it
    return root, bad


@pytest.mark.parametrize("workers", ["0", "2"])
def test_an_undecodable_image_is_one_line_naming_the_file(sqlite_store, folder_with_a_corrupt_jpeg, workers):
    from mlflow.tracking import MlflowClient

    root, bad = folder_with_a_corrupt_jpeg
    res = CliRunner().invoke(main, ["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "3",
                                    "--steps", "3", "--data", str(root), "--num-workers", workers, "--device", "cpu",
                                    "--experiment", "corrupt"])
    assert res.exit_code == 2, (res.output[-3000:], res.exception)
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "cannot be decoded" in errors[0], res.output
    assert "Traceback" not in res.output and "DataLoader worker" not in errors[0]
    c = MlflowClient()
    (run,) = c.search_runs([c.get_experiment_by_name("corrupt").experiment_id])
    tag = run.data.tags["vitreg_error"]
    assert run.info.status == "FAILED" and str(bad) in tag and "Traceback" not in tag, tag


def test_the_same_folder_without_the_broken_file_trains(sqlite_store, folder_with_a_corrupt_jpeg):
    root, bad = folder_with_a_corrupt_jpeg
    bad.unlink()
    res = CliRunner().invoke(main, ["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "2",
                                    "--steps", "3", "--data", str(root), "--num-workers", "0", "--device", "cpu"])
    assert res.exit_code == 0, (res.output[-3000:], res.exception)


def _train_on(root, experiment: str):
    return CliRunner().invoke(main, ["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "2",
                                     "--steps", "2", "--data", str(root), "--num-workers", "0", "--device", "cpu",
                                     "--experiment", experiment])


def _one_error_line(res) -> str:
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output[-3000:], res.exception)
    (line,) = [line for line in res.output.splitlines() if line.startswith("error:")]
    return line


def test_a_symlink_loop_in_the_data_is_refused_before_training(sqlite_store, folder_with_a_corrupt_jpeg):
    """ImageFolder follows links: a link from a class folder back up to train/ made it read the tree over and
    over (one class counted 41 times). The loop is refused in one line, before any model or step."""
    root, bad = folder_with_a_corrupt_jpeg
    bad.unlink()
    (root / "train" / "a" / "again").symlink_to(root / "train", target_is_directory=True)
    line = _one_error_line(_train_on(root, "loop"))
    assert "link loop" in line and "remove the link" in line, line
    (root / "train" / "a" / "again").unlink()  # the same tree without the link trains
    assert _train_on(root, "loop").exit_code == 0


def test_a_folder_of_one_class_is_refused(sqlite_store, folder_with_a_corrupt_jpeg):
    """One class folder trained to loss 0.0000 without a word: cross-entropy over one class is 0 at once."""
    import shutil

    root, _ = folder_with_a_corrupt_jpeg
    shutil.rmtree(root / "train" / "b")
    line = _one_error_line(_train_on(root, "one-class"))
    assert "one class folder (a)" in line and "at least two" in line, line


# issue 31: a text file named .jpg passed every check and failed at the batch that reached it (or never,
# when the run ended first). Each file ImageFolder would load is refused by its header, before any step.
NOT_IMAGES = [
    ("train/b/notes.jpg", b"this is text, not a JPEG\n"),
    ("train/a/empty.png", b""),
    ("train/b/page.JPEG", b"<!DOCTYPE html><html><body>403 Forbidden</body></html>"),  # an upper-case extension
    ("val/a/readme.webp", b"RIFF\x00\x00\x00\x00TEXT is no WEBP"),  # a RIFF file of another kind
]


@pytest.mark.parametrize("name, content", NOT_IMAGES, ids=[n for n, _ in NOT_IMAGES])
def test_a_file_that_is_not_an_image_is_refused_before_training(sqlite_store, folder_with_a_corrupt_jpeg, name,
                                                                  content):
    from mlflow.tracking import MlflowClient

    root, broken = folder_with_a_corrupt_jpeg
    broken.unlink()
    if name.startswith("val/"):
        for cls in "ab":  # val/ as train/: its own real images
            (root / "val" / cls).mkdir(parents=True)
            shutil.copy(next((root / "train" / cls).glob("*.png")), root / "val" / cls / "0.png")
    (root / name).write_bytes(content)
    line = _one_error_line(_train_on(root, "not-images"))
    assert str(root / name) in line and "is not an image" in line and "replace or remove" in line, line
    c = MlflowClient()
    (run,) = c.search_runs([c.get_experiment_by_name("not-images").experiment_id])
    assert run.info.status == "FAILED" and run.data.metrics == {}, (run.info.status, run.data.metrics)  # no step ran
    (root / name).unlink()  # the same folder without it trains
    assert _train_on(root, "not-images").exit_code == 0


def test_every_format_pil_reads_passes_the_header_check(tmp_path):
    """The check knows an image by PIL's own header tests: every format ImageFolder loads passes it."""
    from PIL import Image

    from vitreg.train.data import _check_header

    for fmt, suffix in (("JPEG", "jpg"), ("PNG", "png"), ("BMP", "bmp"), ("PPM", "ppm"), ("TIFF", "tif"),
                        ("WEBP", "webp"), ("GIF", "gif")):
        path = tmp_path / f"x.{suffix}"
        Image.new("RGB", (8, 8), (1, 2, 3)).save(path, format=fmt)
        _check_header(tmp_path, str(path))  # no error
