"""``mlflow``, imported when the tracking layer first uses it, not when a job's code is imported.

A torchrun rank under a vitreg launcher never talks to MLflow (rank 0 writes the hand-off journal,
the other ranks log nothing), yet it imports the job's modules and through them this package.
Importing mlflow costs a process ~2.8 s of CPU (it brings pandas, sqlalchemy, mlflow.genai...), paid
by every rank of every DDP job. The tracking modules reach MLflow through :data:`mlflow` instead,
so the import happens at the first attribute they read: ``mlflow.MlflowClient()``,
``except mlflow.exceptions.MlflowException``, ``mlflow.log_metrics(...)``. A boundary, kept apart on
purpose: ``tests/test_layout.py`` treats importing it as importing mlflow.
"""

from __future__ import annotations

import importlib


class _LazyModule:
    """Reads each attribute from the real module, importing it on the first read."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


mlflow = _LazyModule("mlflow")
