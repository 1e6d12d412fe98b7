"""The train job's progress on the terminal."""

from __future__ import annotations

import sys

from vitreg.console import progress


class Progress:
    """A tqdm bar on a terminal (step, loss, img/s); plain lines at each log when stderr is not a terminal."""

    def __init__(self, total: int, initial: int = 0, progress=progress, enabled: bool = True):
        self.total = total
        self.progress = progress
        self.enabled = enabled  # False on DDP ranks other than 0: rank 0 speaks for the job
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True,
                            desc="train")

    def step(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        loss, ips = metrics.get("train_loss"), metrics.get("train_img_per_s")
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{ips:,.0f}" if ips else "-", refresh=False)
            return
        line = f"[vitreg] step {step}/{self.total}  loss {loss:.4f}  " + (f"{ips:,.1f} img/s" if ips else "")
        print(line, file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"[vitreg] {text}", file=sys.stderr)
        else:
            self.progress(text)

    def close(self) -> None:
        """End the bar (once: later calls do nothing), so that what follows prints below it."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
