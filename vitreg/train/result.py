"""What a training run returns: :class:`TrainResult`, its figures one :class:`~vitreg.measure.figures.Figures`
record (named and logged by the metric table, as bench's are)."""

from __future__ import annotations

from dataclasses import dataclass

from vitreg.measure.figures import Figures


@dataclass(frozen=True)
class TrainResult:
    """What a training run did, and its figures (throughput global over the ranks, images per second)."""

    step: int  # optimizer updates reached, counting those before a resume
    start_step: int  # 0, or the step the run resumed at
    steps_run: int  # updates made by this run
    epoch: int  # completed epochs
    total_steps: int
    steps_per_epoch: int
    batch_size: int  # per process
    world_size: int
    figures: Figures  # train_final_loss, train_throughput_img_per_s, train_step_ms_p50, val_top1, ...
    last_checkpoint: str | None
    stopped_by: str | None = None  # why the run ended before total_steps (Ctrl-C, SIGTERM, SIGHUP); None: it did not

    def figure(self, name: str):
        """The figure ``name`` (a metric table name, no task prefix); None where it was not measured."""
        return self.figures.get(name)

    def metrics(self) -> dict[str, float]:
        return self.figures.metrics()

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("step", "start_step", "steps_run", "epoch", "total_steps",
                                             "steps_per_epoch", "batch_size", "world_size", "last_checkpoint",
                                             "stopped_by")}
        return {**out, "figures": self.figures.to_dict(), "metrics": self.metrics()}
