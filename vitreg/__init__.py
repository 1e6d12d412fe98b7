"""vitreg: an MLflow-tracked experiment registry for Vision Transformer benchmarks.

From Python: ``vitreg.bench(...)``, ``vitreg.compare(...)``, ``vitreg.check(...)`` and ``vitreg.runs(...)``
(:mod:`vitreg.api`).
Importing vitreg imports nothing heavy (no torch, mlflow or pandas) and registers nothing.
"""

import types

from vitreg.signals import freeze_at_exit  # noqa: F401  (vitreg.freeze_at_exit, as the CLI calls it)
from vitreg.version import __version__  # noqa: F401


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
