"""The checkpoint format, below both training and tracking (docs/ARCHITECTURE.md)."""
