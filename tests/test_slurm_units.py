"""engine=slurm without a cluster: what a child's job asks SLURM for, read from the sweep's options, and sinfo's
gres text (fast tier); and every engine's children import vitreg from anywhere (slow: two processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vitreg.errors import VitregError
from vitreg.fleet import children
from vitreg.fleet.axes import Combination
from vitreg.fleet.slurm_engine import SlurmEngine, SlurmOptions, _gres_gpus, slurm_type


JOBS = Path("/shared/sweep-1/jobs")


def _engine(**own) -> SlurmEngine:
    engine = SlurmEngine.__new__(SlurmEngine)  # no cluster to ask: only the options
    engine.options = SlurmOptions.parse(own)
    return engine


def _combo(**options) -> Combination:
    return Combination(tuple(options.items()), "test")


def test_sinfo_gres_text_gives_gpu_counts_per_type():
    assert _gres_gpus("gpu:h100:2(S:0-1),gpu:a100:1,shard:4") == {"h100": 2, "a100": 1}
    assert _gres_gpus("gpu:4") == {"": 4}
    assert _gres_gpus("(null)") == {}


def test_a_gpu_child_asks_for_nproc_gpus_of_its_type_and_one_task_for_torchrun():
    params = _engine(slurm_partition="gpu", slurm_account="lab", slurm_qos="short", slurm_time_min="30",
                     slurm_sbatch="mem=16G;exclusive").job_parameters(_combo(gpu="a100-80gb", nproc=4), {}, "x", JOBS)
    assert params["gres"] == "gpu:a100_80gb:4" and "constraint" not in params
    assert (params["ntasks_per_node"], params["cpus_per_task"], params["nodes"]) == (1, 4, 1)
    assert (params["partition"], params["account"], params["qos"], params["time"]) == ("gpu", "lab", "short", 30)
    assert params["additional_parameters"] == {"chdir": str(JOBS), "mem": "16G", "exclusive": True}


def test_by_constraint_the_type_is_a_feature_and_the_gpus_an_untyped_count():
    params = _engine(slurm_gpu_by="constraint").job_parameters(_combo(gpu="v100", nproc=2), {}, "x", JOBS)
    assert params["constraint"] == "v100" and params["gpus_per_node"] == 2 and "gres" not in params


def test_a_cpu_child_holds_one_gpu_of_its_type_so_it_runs_on_that_node_alone():
    engine = _engine()
    assert engine.job_parameters(_combo(gpu="h100"), {"device": "cpu"}, "x", JOBS)["gres"] == "gpu:h100:1"
    assert "gres" not in engine.job_parameters(_combo(), {"device": "cpu"}, "x", JOBS)
    assert slurm_type("auto") is None and slurm_type("4090") == "rtx4090"


def test_a_job_starts_in_vitregs_folder_not_the_submitting_one_unless_the_user_names_one():
    """Issue 40: submitit runs `python -m` in the job's working directory, first on the import path: started in
    the submitting folder, a clone's `vitreg/` there was imported instead of the package."""
    assert _engine().job_parameters(_combo(), {}, "x", JOBS)["additional_parameters"] == {"chdir": str(JOBS)}
    mine = _engine(slurm_sbatch="chdir=/scratch/me").job_parameters(_combo(), {}, "x", JOBS)
    assert mine["additional_parameters"] == {"chdir": "/scratch/me"}


def test_a_cpu_child_of_a_type_no_node_has_is_told_the_types_not_to_pass_the_device_it_gave(monkeypatch):
    """Issue 40 item 7: `--gpu a100 --device cpu` said "asks for 1 GPUs of type a100 ...: pass device=cpu"."""
    from vitreg.fleet import slurm_engine

    monkeypatch.setattr(slurm_engine, "cluster_nodes", lambda partition="": [
        slurm_engine.Node("gpu-h100", "idle", {"h100": 1}, frozenset())])
    with pytest.raises(VitregError) as refused:
        _engine().check([_combo(model="test_vit")], {"gpu": "a100", "device": "cpu"})
    assert "gpu=a100: no node of the SLURM cluster has GPU gres type a100 (it has: h100)" in str(refused.value)
    assert "device=cpu" not in str(refused.value)


def test_a_bad_slurm_option_is_one_line():
    with pytest.raises(VitregError, match="slurm_gpu_by"):
        _engine(slurm_gpu_by="label")
    with pytest.raises(VitregError, match="slurm_time_min"):
        _engine(slurm_time_min="0")


@pytest.mark.slow
def test_children_import_vitreg_from_anywhere_even_beside_a_folder_called_vitreg(tmp_path):
    """Issue 29: from the folder holding the clone, `python -m vitreg.cli` imported the clone's folder as
    `vitreg` (the working directory comes first on the import path) and every child failed."""
    shadow = tmp_path / "vitreg"
    (shadow / "tracking").mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the folder beside the clone, not the package')\n")
    command = children.child_command(_combo(model="test_vit"), 2, {})
    done = subprocess.run([*command[:4], "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--models" in done.stdout or "--model" in done.stdout
    shadowed = subprocess.run([sys.executable, "-m", "vitreg.cli", "bench", "--help"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert shadowed.returncode != 0 and "the folder beside the clone" in shadowed.stderr


def test_a_childs_cpus_are_nproc_unless_slurm_sbatch_names_them():
    """What the README says a child is granted: ``--cpus-per-task=nproc``, or what ``slurm_sbatch`` says (the
    sbatch script submitit writes: its additional parameters come last and win)."""
    from submitit.slurm.slurm import _make_sbatch_string

    def script(**own) -> str:
        return _make_sbatch_string("true", str(JOBS), **_engine(**own).job_parameters(_combo(nproc=2), {}, "x", JOBS))

    assert "#SBATCH --cpus-per-task=2\n" in script()
    mine = script(slurm_sbatch="cpus-per-task=8;exclusive")
    assert "#SBATCH --cpus-per-task=8\n" in mine and "#SBATCH --exclusive\n" in mine and "=2\n" not in mine


def test_a_cpu_child_has_its_node_alone_unless_share_node_and_a_gpu_child_shares_it_with_other_gpus():
    """Issue 40 item 4: a CPU child asked `--cpus-per-task=nproc`, so two CPU children could time side by side on
    one node. Now its job is `--exclusive` (every CPU of the node its own); a GPU child keeps its gres and nproc
    CPUs (the node's other GPUs take other children); share_node=true packs CPU children as before."""
    from submitit.slurm.slurm import _make_sbatch_string

    def script(engine, common) -> str:
        return _make_sbatch_string("true", str(JOBS), **engine.job_parameters(_combo(gpu="h100"), common, "x", JOBS))

    cpu = script(_engine(), {"device": "cpu"})
    assert "#SBATCH --exclusive\n" in cpu and "--cpus-per-task" not in cpu and "--gres=gpu:h100:1\n" in cpu
    gpu = script(_engine(), {"nproc": 2})
    assert "--exclusive" not in gpu and "#SBATCH --cpus-per-task=2\n" in gpu and "--gres=gpu:h100:2\n" in gpu
    shared = _engine()
    shared.share_node = True
    packed = script(shared, {"device": "cpu"})
    assert "--exclusive" not in packed and "#SBATCH --cpus-per-task=1\n" in packed


def test_a_child_log_keeps_its_last_lines_and_writes_each_to_its_stream(monkeypatch):
    import io

    from vitreg.fleet import local

    monkeypatch.setattr(local, "LOG_MAX_CHARS", 10)
    out, err = io.StringIO(), io.StringIO()
    log = local.ChildLog()
    for line, stream in (("first\n", out), ("second\n", err), ("third\n", out)):
        log.keep(line, stream)
    assert log.text() == "third\n" and out.getvalue() == "first\nthird\n" and err.getvalue() == "second\n"


def test_a_jobs_log_is_its_stdout_and_stderr_files_or_nothing(tmp_path):
    from types import SimpleNamespace

    from vitreg.fleet.slurm_jobs import job_log

    job = SimpleNamespace(paths=SimpleNamespace(stdout=tmp_path / "7_0_log.out", stderr=tmp_path / "7_0_log.err"))
    assert job_log(job) == ""
    job.paths.stdout.write_text("logged run abc\n")
    job.paths.stderr.write_text("[vitreg] sweep child\n")
    text = job_log(job)
    assert text.index("logged run abc") < text.index("==> the job's stderr") < text.index("[vitreg] sweep child")
    assert text.startswith(f"==> the job's stdout ({job.paths.stdout}) <==\n")
