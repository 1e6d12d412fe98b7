"""The train job's plan (vitreg.train.job.resolve_plan): what every later step reads, resolved once at the
job's top from the options as they came; in-process, nothing trained or launched."""

import dataclasses

import pytest

from vitreg.tracking.runs import NullTracker
from vitreg.train.job import resolve_plan

TINY = {"model": "test_vit", "img_size": "32", "batch_size": "4", "num_classes": "10", "num_workers": "0",
        "steps": "2", "device": "cpu"}


def quiet(message):
    pass


def test_a_launchers_plan_forwards_the_options_and_builds_no_model(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    options = {**TINY, "nproc": "2"}
    plan = resolve_plan(None, options, tmp_path, command="vitreg train", progress=quiet)
    assert plan.launches and plan.options == options and plan.spec.nproc == 2 and plan.num_classes == 10
    assert plan.ctx is None and plan.model is None and plan.info is None and plan.gflops is None
    assert plan.command == "vitreg train" and plan.workdir == tmp_path


def test_a_training_plan_holds_the_model_facts_context_and_title(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    plan = resolve_plan(NullTracker(), TINY, tmp_path, progress=quiet)
    assert not plan.launches and plan.world.world_size == 1 and plan.runtime.device == "cpu"
    assert (plan.info.name, plan.info.img_size, plan.info.num_classes) == ("test_vit", 32, 10)
    assert plan.ctx.spec is plan.spec and plan.gflops > 0  # rank 0 (the one process) counts the work per image
    assert plan.teacher is None and plan.resume is None and plan.run_name is None
    assert plan.hardware.label in plan.title.name(plan.spec.batch_size) and plan.title.job == "train"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.spec = None


def test_the_plan_refuses_before_any_model_is_built(tmp_path, monkeypatch):
    """A bad model name or data path fails while the plan is resolved, launcher or not."""
    from vitreg.errors import VitregError

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for extra, needle in [({"model": "test_vti"}, "did you mean test_vit"), ({"data": str(tmp_path / "none")}, "does not exist")]:
        for nproc in ("1", "2"):
            with pytest.raises(VitregError, match=needle):
                resolve_plan(None, {**TINY, **extra, "nproc": nproc}, tmp_path, progress=quiet)
