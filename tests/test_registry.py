"""Model registry: register a checkpoint, pull it back (alias, version, run), export it, benchmark it.

One sqlite store per module holds a registered model ``tv`` with two versions of a tiny ``test_vit``
(32px, 10 classes): v1 under alias ``champion``, v2 the newest (``@latest``). Both checkpoints are
also logged as run artifacts like training does (``checkpoints/step-<N>`` folders, and the file
``checkpoints/last`` naming step-10), so both versions share their weights with the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from conftest import REPO, migrated_store, subprocess_env, wait_until
from vitreg.tracking import checkpoint_sources, model_registry
from vitreg.tracking import runs as tracking
from vitreg.checkpoint.format import last_pointer, save_checkpoint
from vitreg.errors import VitregError
from vitreg.models.factory import create_model

IMG, CLASSES = 32, 10

TINY_BENCH = {"batch_size": "2", "warmup": "2", "steps": "3", "repeats": "2", "gpu": "auto"}


def one_line(exc) -> str:
    text = str(exc.value if hasattr(exc, "value") else exc)
    assert "\n" not in text and text
    return text


def make_checkpoint(directory: Path, step: int, arch: str = "test_vit", seed: int = 0):
    torch.manual_seed(seed)
    model, info = create_model(arch, IMG, CLASSES)
    path = save_checkpoint(directory, model, step=step, spec={"model": arch, "steps": str(step)}, model_info=info)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def weights_equal(model, state: dict) -> bool:
    got = model.state_dict()
    return set(got) == set(state) and all(torch.equal(got[k].cpu(), state[k]) for k in state)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sqlite store with registered model ``tv``: v1 (@champion, step 5) and v2 (@latest, step 10)."""
    root = tmp_path_factory.mktemp("registry")
    uri = migrated_store(root)
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
            mp.delenv(key)
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mp.chdir(root)  # the default experiment's artifacts land in ./mlruns here
        import mlflow

        mlflow.set_tracking_uri(uri)
        ck1, w1 = make_checkpoint(root / "ckpt" / "checkpoints" / "step-5", step=5, seed=1)
        ck2, w2 = make_checkpoint(root / "ckpt" / "checkpoints" / "step-10", step=10, seed=2)
        with tracking.tracked_run(run_name="train-tiny", experiment="train", system_metrics=False) as run:
            run.set_tags({"gpu": "cpu"})
            run.log_metrics({"train_throughput_img_per_s": 123.5})
            run.log_artifacts(ck1, "checkpoints/step-5")
            run.log_artifacts(ck2, "checkpoints/step-10")
            run.log_text(last_pointer(10), "checkpoints/last")
            mv1 = model_registry.register_checkpoint(run, ck1, "tv", alias="champion", tags={"dataset": "synthetic"})
            # from the run artifact, as training may; alias="latest" (the default) is MLflow's built-in
            mv2 = model_registry.register_checkpoint(run, f"runs:/{run.run_id}/checkpoints/step-10", "tv")
        yield SimpleNamespace(uri=uri, root=root, run_id=run.run_id, mv1=mv1, mv2=mv2, w1=w1, w2=w2,
                              ck1=ck1, ck2=ck2)
        while mlflow.active_run():
            mlflow.end_run()


@pytest.fixture(autouse=True)
def _use_store(request, monkeypatch):
    if "store" in request.fixturenames:
        st = request.getfixturevalue("store")
        import mlflow

        monkeypatch.setenv("MLFLOW_TRACKING_URI", st.uri)
        monkeypatch.chdir(st.root)
        mlflow.set_tracking_uri(st.uri)


def client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


# --------------------------------------------------------------------------- register


def test_register_sets_alias_tags_and_self_contained_artifacts(store):
    c = client()
    rm = c.get_registered_model("tv")
    assert {k: str(v) for k, v in rm.aliases.items()} == {"champion": "1"}
    assert rm.tags["model"] == "test_vit"
    tags = c.get_model_version("tv", "1").tags
    assert tags["model"] == "test_vit" and tags["gpu"] == "cpu" and tags["source_run_id"] == store.run_id
    assert float(tags["train_throughput_img_per_s"]) == 123.5
    assert tags["vitreg_checkpoint"] == "vitreg-checkpoint-1" and tags["step"] == "5"
    assert tags["img_size"] == "32" and tags["num_classes"] == "10" and tags["dataset"] == "synthetic"
    assert tags["checkpoint_source"] == f"runs:/{store.run_id}/checkpoints/step-5"
    manifest = json.loads((store.ck1 / "manifest.json").read_text())
    assert tags["weights_sha256"] == manifest["files"]["model.safetensors"]["sha256"]
    v2 = c.get_model_version("tv", "2")
    assert v2.tags["step"] == "10" and v2.aliases == []
    assert v2.tags["checkpoint_source"] == f"runs:/{store.run_id}/checkpoints/step-10"
    run = c.get_run(store.run_id)
    assert run.data.tags["registered_model_name"] == "tv" and run.data.tags["registered_model_version"] == "2"
    # the version holds the pt2 flavor, the spec and the manifest; the weights it shares with the run's
    # step-5 folder (no second copy), and its manifest still pins their sha256
    base = Path(c.get_model_version_download_uri("tv", "1").replace("file://", ""))
    assert (base / "data" / "model.pt2").is_file() and (base / "MLmodel").is_file()
    assert sorted(p.name for p in (base / "extra_files").iterdir()) == ["manifest.json", "shared_weights.json",
                                                                       "spec.json"]
    shared = json.loads((base / "extra_files" / "shared_weights.json").read_text())
    assert shared == {"format": "vitreg-shared-weights-1", "run_id": store.run_id, "checkpoint": "checkpoints/step-5"}
    assert json.loads((base / "extra_files" / "manifest.json").read_text())["files"]["model.safetensors"] == \
        manifest["files"]["model.safetensors"]


def test_a_checkpoint_the_run_did_not_log_is_copied_into_the_version(store, tmp_path):
    """Sharing needs the run's own folder with the same sha256; a loose folder is copied, as before."""
    loose, weights = make_checkpoint(tmp_path / "loose" / "step-7", step=7, seed=3)
    with tracking.tracked_run(run_name="loose", system_metrics=False) as run:
        mv = model_registry.register_checkpoint(run, loose, "tv-copy")
    base = Path(client().get_model_version_download_uri("tv-copy", mv.version).replace("file://", ""))
    assert sorted(p.name for p in (base / "extra_files").iterdir()) == ["manifest.json", "model.safetensors",
                                                                       "spec.json"]
    assert "path: extra_files/model.safetensors" in (base / "MLmodel").read_text()
    assert mv.tags["checkpoint_source"] == str(loose.resolve())
    assert weights_equal(checkpoint_sources.pull(f"models:/tv-copy/{mv.version}", dst=tmp_path / "dl").model, weights)


def test_register_refuses_a_name_owned_by_another_architecture(store, tmp_path):
    other, _ = make_checkpoint(tmp_path / "other", step=1, arch="test_vit2")
    with tracking.tracked_run(run_name="other", system_metrics=False) as run:
        with pytest.raises(VitregError) as exc:
            model_registry.register_checkpoint(run, other, "tv", alias="champion")
    msg = one_line(exc)
    assert "'tv' already holds versions of test_vit, not test_vit2" in msg and "choose another register_as" in msg
    assert {str(mv.version) for mv in client().search_model_versions("name = 'tv'")} == {"1", "2"}  # nothing logged


def test_register_cli_registers_a_run_checkpoint_after_the_fact(store):
    from vitreg.cli.main import register

    res = CliRunner().invoke(register, [f"runs:/{store.run_id}/checkpoints/step-5", "--name", "tv-later",
                                        "--alias", "best"])
    assert res.exit_code == 0, res.output
    mv = client().get_model_version_by_alias("tv-later", "best")
    assert mv.run_id == store.run_id and mv.tags["source_run_id"] == store.run_id and mv.tags["step"] == "5"
    assert f"registered models:/tv-later/{mv.version} (@best) from run {store.run_id}" in res.output
    model, _, _ = checkpoint_sources.load_model("models:/tv-later@best")
    assert weights_equal(model, store.w1)


@pytest.mark.parametrize("source,needle", [
    ("models:/tv@champion", "is not a run's checkpoint: pass runs:/<run_id>/checkpoints/last"),
    ("runs:/0123456789abcdef/checkpoints/last", "no run 0123456789abcdef at sqlite:"),
])
def test_register_cli_bad_sources_are_one_line_exit_2(store, source, needle):
    from vitreg.cli.main import register

    res = CliRunner().invoke(register, [source, "--name", "tv-x"])
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], res.output


def test_train_refuses_a_register_as_of_another_architecture_before_training(store):
    from vitreg.cli.main import main

    res = CliRunner().invoke(main, ["train", "--model", "test_vit2", "--img-size", "32", "--num-classes", "10",
                                    "--num-workers", "0", "--steps", "500", "--device", "cpu", "--register-as", "tv",
                                    "--experiment", "early-refusal"])
    assert res.exit_code == 2, res.output
    assert "'tv' already holds versions of test_vit, not test_vit2" in res.output
    exp = client().get_experiment_by_name("early-refusal")
    (run,) = client().search_runs([exp.experiment_id])
    assert run.info.status == "FAILED" and "already holds versions" in run.data.tags["vitreg_error"]
    assert "train_loss" not in run.data.metrics  # refused before the first step


@pytest.mark.parametrize("name,alias,needle", [
    ("tv", "v3", "alias=champion"),
    ("tv", "has space", "alias=champion"),
    ("tv", "a/b", "alias=champion"),
    ("a/b", "champion", "register_as=deit-tiny"),
    ("it's", "champion", "register_as=deit-tiny"),
])
def test_register_refuses_unusable_names_and_aliases(store, name, alias, needle):
    with tracking.tracked_run(run_name="alias", system_metrics=False) as run:
        with pytest.raises(VitregError) as exc:
            model_registry.register_checkpoint(run, store.ck1, name, alias=alias)
    assert needle in one_line(exc)


def test_register_refuses_a_tampered_checkpoint(store, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(store.ck1, bad)
    (bad / "spec.json").write_text((bad / "spec.json").read_text().replace('"num_classes": 10', '"num_classes": 11'))
    with tracking.tracked_run(run_name="tampered", system_metrics=False) as run:
        with pytest.raises(VitregError) as exc:
            model_registry.register_checkpoint(run, bad, "tv")
    assert "spec.json" in one_line(exc)


# --------------------------------------------------------------------------- pull


@pytest.mark.parametrize("uri,which,version", [
    ("models:/tv@champion", "w1", "1"),
    ("models:/tv/1", "w1", "1"),
    ("models:/tv/2", "w2", "2"),
    ("models:/tv@latest", "w2", "2"),
    ("runs:/{run}/checkpoints/last", "w2", None),
    ("runs:/{run}/checkpoints/step-5", "w1", None),
])
def test_pull_rebuilds_the_exact_weights(store, tmp_path, uri, which, version):
    uri = uri.format(run=store.run_id)
    result = checkpoint_sources.pull(uri, dst=tmp_path / "dl")
    assert weights_equal(result.model, getattr(store, which))
    assert result.info.name == "test_vit" and result.info.img_size == IMG and result.info.num_classes == CLASSES
    assert result.output_shape == (2, CLASSES) and not result.model.training
    assert result.registered_model_version == version and result.run_id == store.run_id
    assert str(tmp_path / "dl") in result.describe()
    out = result.model(torch.randn(3, 3, IMG, IMG))
    assert out.shape == (3, CLASSES) and torch.isfinite(out).all()


def test_load_model_returns_model_info_and_spec(store):
    from vitreg.tracking.model_registry import load_model  # the README's import path

    assert load_model is checkpoint_sources.load_model
    model, info, spec = load_model("models:/tv@champion")
    assert weights_equal(model, store.w1) and info.name == spec["model"] == "test_vit" and spec["step"] == 5


def test_pull_refuses_a_tampered_registry_artifact(store, tmp_path):
    """The shared weights come from the run's folder and are checked against the version's own manifest."""
    run_artifacts = Path(client().get_run(store.run_id).info.artifact_uri.replace("file://", ""))
    weights = run_artifacts / "checkpoints" / "step-5" / "model.safetensors"
    original = weights.read_bytes()
    try:
        data = bytearray(original)
        data[-100] ^= 0xFF  # same size, one byte flipped in the tensor data
        weights.write_bytes(bytes(data))
        with pytest.raises(VitregError) as exc:
            checkpoint_sources.pull("models:/tv@champion", dst=tmp_path / "dl")
        assert "model.safetensors sha256 mismatch" in one_line(exc)
    finally:
        weights.write_bytes(original)


@pytest.mark.parametrize("uri,needles", [
    ("models:/tv@nope", ["no alias 'nope'", "aliases champion (v1)", "versions 2, 1", "@latest = v2"]),
    ("models:/tv/7", ["no version 7", "versions 2, 1"]),
    ("models:/nope@champion", ["no registered model 'nope'", "registered models are tv"]),
    ("models:/tv/Production", ["models:/NAME@ALIAS or models:/NAME/VERSION"]),
    ("runs:/{run}/checkpoints/lastt", ["no artifact 'checkpoints/lastt'", "holds last, step-10/, step-5/"]),
    ("runs:/{run}/checkpoints", ["holds several checkpoints", "runs:/{run}/checkpoints/last"]),
    ("runs:/0123456789abcdef/checkpoints/last", ["no run '0123456789abcdef'"]),
    ("s3:/bucket/x", ["use models:/NAME@ALIAS"]),
])
def test_pull_errors_name_what_exists(store, tmp_path, uri, needles):
    with pytest.raises(VitregError) as exc:
        checkpoint_sources.pull(uri.format(run=store.run_id), dst=tmp_path / "dl")
    msg = one_line(exc)
    for needle in needles:
        assert needle.format(run=store.run_id) in msg, msg


def test_pull_of_a_version_whose_run_checkpoint_is_gone_says_so(store, tmp_path):
    """A shared version needs its run's folder: without it, one line naming the folder and the fix."""
    run_artifacts = Path(client().get_run(store.run_id).info.artifact_uri.replace("file://", ""))
    folder = run_artifacts / "checkpoints" / "step-10"
    shutil.move(folder, tmp_path / "aside")
    try:
        with pytest.raises(VitregError) as exc:
            checkpoint_sources.pull("models:/tv/2", dst=tmp_path / "dl")
    finally:
        shutil.move(tmp_path / "aside", folder)
    msg = one_line(exc)
    assert f"shares its weights with runs:/{store.run_id}/checkpoints/step-10/model.safetensors" in msg
    assert "register the model again" in msg


def test_run_last_file_names_the_newest_step_and_is_followed(store, tmp_path):
    """checkpoints/last is a small file naming step-10, no second copy; runs:/.../last and a local
    download of the checkpoints folder both resolve to that folder."""
    listed = {a.path: a.is_dir for a in client().list_artifacts(store.run_id, "checkpoints")}
    assert listed == {"checkpoints/last": False, "checkpoints/step-10": True, "checkpoints/step-5": True}
    located = checkpoint_sources.resolve_checkpoint(f"runs:/{store.run_id}/checkpoints/last", tmp_path / "dl")
    assert located.checkpoint.step == 10 and located.run_folder == "checkpoints/step-10"
    local = Path(client().download_artifacts(store.run_id, "checkpoints", str(tmp_path / "all")))
    assert checkpoint_sources.resolve_checkpoint(str(local / "last")).checkpoint.step == 10
    artifact_uri = client().get_run(store.run_id).info.artifact_uri  # an artifact URI of the file itself
    file_uri = artifact_uri if "://" in artifact_uri else Path(artifact_uri).resolve().as_uri()
    assert checkpoint_sources.resolve_checkpoint(f"{file_uri}/checkpoints/last", tmp_path / "uri").checkpoint.step == 10


@pytest.mark.parametrize("text", ['{"format": "vitreg-last-1", "checkpoint": "../../elsewhere"}',
                                  '{"format": "vitreg-last-1", "checkpoint": "step-1/.."}', "step-10", ""])
def test_a_last_file_naming_anything_but_a_step_folder_is_refused(tmp_path, text):
    (tmp_path / "step-1").mkdir()
    (tmp_path / "last").write_text(text)
    with pytest.raises(VitregError) as exc:
        checkpoint_sources.resolve_checkpoint(str(tmp_path / "last"))
    assert "is not a vitreg 'last' file" in one_line(exc)


@pytest.mark.slow
def test_pull_cli_out_folder_loads_with_timm_and_safetensors_only(store, tmp_path):
    from vitreg.cli.main import pull

    out = tmp_path / "export"
    res = CliRunner().invoke(pull, ["models:/tv@champion", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "pulled models:/tv@champion (= models:/tv/1)" in res.output and str(out) in res.output
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "manifest.json", "model.safetensors", "spec.json"]
    readme = (out / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) == 4  # the import line + 3 lines
    # run the README's code with vitreg and mlflow made unimportable, in the folder, in a fresh process
    script = "import sys\nsys.modules['vitreg'] = None\nsys.modules['mlflow'] = None\n" + code + textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        x = torch.randn(2, 3, spec["img_size"], spec["img_size"])
        with torch.no_grad():
            print(json.dumps(model(x).tolist()))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=out, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PYTHONPATH"))})
    assert proc.returncode == 0, proc.stderr[-2000:]
    model, _, _ = checkpoint_sources.load_model("models:/tv/1")
    torch.manual_seed(0)
    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        expected = model(x)
    assert torch.allclose(torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1])), expected, atol=1e-5)


def test_pull_cli_unknown_alias_is_one_line_exit_2(store):
    from vitreg.cli.main import pull

    res = CliRunner().invoke(pull, ["models:/tv@nope"])
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "aliases champion (v1)" in errors[0]



@pytest.mark.parametrize("uri", ["models:/tv@nope", "models:/no-such-model/1", "runs:/0123456789abcdef/checkpoints/last"])
def test_a_checkpoint_that_cannot_be_found_leaves_no_temporary_folder(store, tmp_path, monkeypatch, uri):
    """resolve_checkpoint makes a folder for the download; when it raises, it removes that folder too."""
    import tempfile

    from vitreg.tracking.checkpoint_sources import resolve_checkpoint

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(VitregError):
        resolve_checkpoint(uri, progress=lambda message: None)
    assert list(tmp_path.iterdir()) == []

# --------------------------------------------------------------------------- infer


def test_infer_in_process_from_a_run_checkpoint(store):
    from vitreg.bench.job import infer

    result = infer(f"runs:/{store.run_id}/checkpoints/last", {**TINY_BENCH}, experiment="infer-local",
                   progress=lambda message: None)
    assert [t.task for t in result.tasks] == ["infer"] and result.model.name == "test_vit"
    runs = client().search_runs([client().get_experiment_by_name("infer-local").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    t, m = run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED" and t["vitreg_job"] == "infer" and t["model"] == "test_vit"
    assert t["model_uri"] == f"runs:/{store.run_id}/checkpoints/last" and t["source_run_id"] == store.run_id
    assert "registered_model_name" not in t and m["infer_throughput_img_per_s"] > 0
    assert "train_throughput_img_per_s" not in m


@pytest.mark.parametrize("options,needle", [
    ({"model": "vit_base_patch16_224"}, "model comes from the registered model's spec.json"),
    ({"img_size": "224"}, "img_size comes from the registered model's spec.json"),
    ({"nproc": "2"}, "pass nproc=1"),
])
def test_infer_refuses_options_the_checkpoint_decides(store, options, needle):
    from vitreg.bench.job import infer

    with pytest.raises(VitregError) as exc:
        infer("models:/tv/1", {**TINY_BENCH, **options}, progress=lambda message: None)
    assert needle in one_line(exc)


def test_infer_cli_unknown_alias_fails_the_run_in_one_line(store):
    from vitreg.cli.main import infer

    res = CliRunner().invoke(infer, ["--model-uri", "models:/tv@nope", "--batch-size", "2", "--experiment", "bad"])
    assert res.exit_code == 2 and "error: registered model 'tv' has no alias 'nope'" in res.output
    c = client()
    (run,) = c.search_runs([c.get_experiment_by_name("bad").experiment_id])
    assert run.info.status == "FAILED" and "no alias 'nope'" in run.data.tags["vitreg_error"]


@pytest.mark.slow
def test_mlflow_run_infer_entry_end_to_end(store, tmp_path):
    params = ["-P", "model_uri=models:/tv@champion"] + [a for k, v in TINY_BENCH.items() for a in ("-P", f"{k}={v}")]
    proc = subprocess.run([sys.executable, "-m", "mlflow", "run", str(REPO), "-e", "infer", "--env-manager",
                           "local", "--experiment-name", "infer-e2e", *params],
                          env=subprocess_env(store.uri), cwd=store.root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "img/s median" in proc.stdout and "last_infer_run_id=" in proc.stdout
    c = client()
    runs = c.search_runs([c.get_experiment_by_name("infer-e2e").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    t, p, m = run.data.tags, run.data.params, run.data.metrics
    assert run.info.status == "FINISHED"
    assert t["model_uri"] == "models:/tv@champion" and t["registered_model_name"] == "tv"
    assert t["registered_model_version"] == "1" and t["registered_model_alias"] == "champion"
    assert t["vitreg_job"] == "infer" and t["model"] == "test_vit" and t["img_size"] == "32" and t["gpu"] == "cpu"
    assert p["model_uri"] == "models:/tv@champion" and p["task"] == "infer" and p["model"] == "test_vit"
    for key in ["infer_throughput_img_per_s", "infer_latency_ms_p50", "infer_latency_ms_p99", "fwd_gflops_per_img"]:
        assert m[key] > 0, key
    assert "train_throughput_img_per_s" not in m
    arts = {a.path for a in c.list_artifacts(run.info.run_id)}
    assert {"results.json", "report.md", "environment.json", "model_spec.json"} <= arts
    vtags = c.get_model_version("tv", "1").tags
    assert vtags["last_infer_run_id"] == run.info.run_id and vtags["last_infer_gpu"] == "cpu"
    assert float(vtags["last_infer_throughput_img_per_s"]) == pytest.approx(m["infer_throughput_img_per_s"], rel=1e-5)


@pytest.mark.parametrize("args", [
    ["pull", "models:/tv@champion"],
    ["infer", "--model-uri", "models:/tv/1", "--batch-size", "2", "--warmup", "1", "--steps", "2", "--repeats", "1",
     "--experiment", "quiet"],
])
def test_pull_and_infer_print_no_download_progress_bar(store, args):
    from vitreg.cli.main import main

    # unset, as on a user's machine (MLflow's default: bars on); the CLI turns them off for its downloads
    res = CliRunner(env={"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": None}).invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "downloading models:/tv" in res.output  # vitreg's own progress line says it
    assert "Downloading artifacts" not in res.output and "it/s]" not in res.output, res.output


@pytest.mark.slow
def test_a_registered_model_serves_with_mlflow_models_serve(store, tmp_path):
    """`mlflow models serve -m models:/NAME@ALIAS --env-manager local` (README): a real server process and a
    real request; the pt2 flavor answers one row of logits per image."""
    import json
    import subprocess
    import sys
    import urllib.request

    import numpy as np

    from conftest import free_port, subprocess_env

    port = free_port()

    env = subprocess_env(store.uri, MLFLOW_DISABLE_TELEMETRY="true")  # the venv's bin on PATH (uvicorn), as activated
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/tv@champion",
                             "--env-manager", "local", "--host", "127.0.0.1", "-p", str(port), "-w", "1"],
                            env=env, cwd=store.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def pings() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                return False

        wait_until(pings, 180, "the scoring server's /ping")
        batch = np.random.default_rng(0).standard_normal((2, 3, IMG, IMG), dtype=np.float32)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", method="POST",
                                         data=json.dumps({"inputs": batch.tolist()}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            predictions = np.asarray(json.loads(resp.read())["predictions"])
        assert predictions.shape == (2, CLASSES) and np.isfinite(predictions).all()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
        log.close()
