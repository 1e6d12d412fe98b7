"""A sweep's children spread over this host's GPUs, a Ray cluster or a SLURM cluster (docs/ARCHITECTURE.md)."""
