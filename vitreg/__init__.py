"""vitreg: an MLflow-tracked experiment registry for Vision Transformer benchmarks.

From Python: ``vitreg.bench(...)``, ``vitreg.compare(...)``, ``vitreg.check(...)`` and ``vitreg.runs(...)``
(:mod:`vitreg.api`).
Importing vitreg imports nothing heavy (no torch, mlflow or pandas) and registers nothing.
"""

import atexit
import gc
import types

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


def runs(experiment: str):
    """The experiment's finished benchmark runs as one DataFrame: :func:`vitreg.api.runs`."""
    from vitreg import api

    return api.runs(experiment)


def check(experiment: str, **options):
    """Each configuration x GPU of the experiment against its history, as ``vitreg check``: :func:`vitreg.api.check`."""
    from vitreg import api

    return api.check(experiment, **options)


class _CallablePackage(types.ModuleType):
    """``vitreg.bench`` and ``vitreg.compare`` are packages and, called, the API functions of those names.

    A plain function ``vitreg.bench`` could not stay: importing the package ``vitreg.bench`` (any
    ``import vitreg.bench.job``) sets the attribute ``vitreg.bench`` to the package, replacing it.
    So the packages themselves answer the call, with :func:`vitreg.api.bench` / :func:`vitreg.api.compare`.
    """

    def __call__(self, *args, **kwargs):
        from vitreg import api

        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


from vitreg import bench, compare  # noqa: E402  (their __init__ is a docstring: nothing heavy)

bench.__class__ = compare.__class__ = _CallablePackage
