"""vitreg: an MLflow-tracked experiment registry for Vision Transformer benchmarks.

From Python: :mod:`vitreg.api` (``vitreg.api.bench(...)``), imported here so that ``import vitreg`` is enough;
it imports nothing heavy (no torch, mlflow or pandas) and registers nothing.
"""

from vitreg import api  # noqa: F401  (vitreg.api, the Python API)
from vitreg.version import __version__  # noqa: F401
