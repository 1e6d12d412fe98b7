"""The cross-GPU jobs: compare and import-timm."""
