"""What a training run returns: :class:`TrainResult`, and the summary metrics it logs as."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TrainResult:
    """What a training run did and how fast. Throughput is global (all ranks), images per second."""

    final_loss: float  # mean train loss of the last logged interval
    step: int  # optimizer updates reached, counting those before a resume
    start_step: int  # 0, or the step the run resumed at
    steps_run: int  # updates made by this run
    epoch: int  # completed epochs
    total_steps: int
    steps_per_epoch: int
    batch_size: int  # per process
    world_size: int
    images: int  # images trained on by this run, all ranks
    throughput_img_per_s: float | None  # after the first step and the warm-up
    step_ms_p50: float | None
    step_ms_p90: float | None
    measured_steps: int
    data_wait_frac: float | None  # host time blocked on the loader / step time, same steps
    first_step_s: float  # the first step alone: compilation (if any) + lazy init
    compile_time_s: float | None  # first_step_s when compile is on
    val_top1: float | None  # percent, last evaluation
    val_loss: float | None
    last_checkpoint: str | None

    def metrics(self) -> dict[str, float]:
        m = {
            "train_final_loss": self.final_loss,
            "train_throughput_img_per_s": self.throughput_img_per_s,
            "train_step_ms_p50": self.step_ms_p50,
            "train_step_ms_p90": self.step_ms_p90,
            "train_data_wait_frac": self.data_wait_frac,
            "train_first_step_s": self.first_step_s,
            "compile_time_s": self.compile_time_s,
            "val_top1": self.val_top1,
            "val_loss": self.val_loss,
            "train_images": float(self.images),
            "train_steps": float(self.step),
        }
        if self.world_size > 1 and self.throughput_img_per_s is not None:
            m["train_world_size"] = float(self.world_size)
            m["train_throughput_img_per_s_per_gpu"] = self.throughput_img_per_s / self.world_size
        return {k: v for k, v in m.items() if v is not None}

    def to_dict(self) -> dict:
        return {**asdict(self), "metrics": self.metrics()}
