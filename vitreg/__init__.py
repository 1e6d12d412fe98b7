"""vitreg: an MLflow-tracked experiment registry for Vision Transformer benchmarks.

From Python: :mod:`vitreg.api` (``vitreg.api.bench(...)``, ``vitreg.api.compare(...)``, ``vitreg.api.check(...)``,
``vitreg.api.runs(...)``), imported here so that ``import vitreg`` is enough. The API keeps its own names
apart from the packages of the same names (``vitreg.bench``, the benchmark job): a package is never called.
Importing vitreg imports nothing heavy (no torch, mlflow or pandas) and registers nothing.
"""

from vitreg import api  # noqa: F401  (vitreg.api, the Python API)
from vitreg.version import __version__  # noqa: F401
