"""``mlflow``, imported at the first attribute the tracking layer reads, not when a job's code is imported.

A torchrun rank under a vitreg launcher never talks to MLflow, yet imports this package through the job's
modules; importing mlflow costs ~2.8 s of CPU, paid by every rank of every DDP job. Kept apart on purpose:
``tests/test_layout.py`` treats importing it as importing mlflow.
"""

from __future__ import annotations

import importlib


class _LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


mlflow = _LazyModule("mlflow")
