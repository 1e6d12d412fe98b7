"""vitreg: an MLflow-tracked experiment registry for Vision Transformer benchmarks."""

__version__ = "0.1.0"
