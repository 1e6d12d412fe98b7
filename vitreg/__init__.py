"""vitreg: an MLflow-tracked experiment registry for Vision Transformer benchmarks."""

import atexit
import gc

__version__ = "0.1.0"

_freeze_registered = False


def freeze_at_exit() -> None:
    """Skip interpreter shutdown's garbage collections in this process (once; called by the CLI and the
    torchrun worker shim when they start, not on import: a library importer keeps its own exit).

    A process that has imported torch, timm and mlflow holds millions of objects, and the garbage
    collections of interpreter shutdown walk all of them: 1.5-1.7 s after the last line of work, in
    every vitreg process (the CLI, the launcher, each DDP rank). Freezing them when the exit handlers
    run skips those walks (0.2 s). Registered before the work imports torch or mlflow, this handler runs
    after every handler they register (mlflow's flushes, multiprocessing's clean-up), so those all still
    run; what is skipped is collecting cyclic garbage that the OS reclaims a moment later anyway.
    """
    global _freeze_registered
    if not _freeze_registered:
        atexit.register(gc.freeze)
        _freeze_registered = True
