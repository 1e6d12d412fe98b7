"""``register_as``: checked against the registry before training, the final checkpoint registered after."""

from __future__ import annotations

from pathlib import Path

from vitreg.config.spec import TrainSpec
from vitreg.errors import VitregError
from vitreg.tracking import model_registry
from vitreg.tracking.handoff import HandoffTracker
from vitreg.train.run_logger import CHECKPOINT_ARTIFACTS


def check_registration(spec: TrainSpec) -> None:
    """``register_as``/``alias`` checked against the registry before training (no-op without them)."""
    if spec.register_as:
        model_registry.check_registration(spec.register_as, spec.alias, spec.model)


def register_if_requested(tracker, spec: TrainSpec, checkpoint_dir, tags: dict):
    """When ``register_as`` is set, register the final checkpoint (already logged under ``checkpoints/last``)
    as a new version of that model and move the alias; returns the ModelVersion, or None. Under a
    vitreg launcher rank 0's tracker hands the request back, and the launcher calls this with its run."""
    if not spec.register_as:
        return None
    if checkpoint_dir is None:
        raise VitregError(f"register_as={spec.register_as} but this run wrote no checkpoint")
    try:
        if isinstance(tracker, HandoffTracker):  # rank 0 under a vitreg launcher: the launcher registers
            return tracker.hand_back_registration(Path(checkpoint_dir), spec.register_as, spec.alias, tags)
        return model_registry.register_checkpoint(tracker, Path(checkpoint_dir), spec.register_as, spec.alias, tags)
    except VitregError as exc:
        # the training is done and its checkpoint logged: say how to register it once the cause is fixed
        raise VitregError(f"{exc} (the checkpoint is logged: once fixed, `vitreg register "
                          f"runs:/{tracker.run_id}/{CHECKPOINT_ARTIFACTS}/last --name {spec.register_as}"
                          + (f" --alias {spec.alias}`)" if spec.alias.lower() != "latest" else "`)")) from None
