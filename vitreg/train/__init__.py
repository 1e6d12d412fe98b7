"""Training: the step loop, its losses, optimizer and schedule, data, checkpoints, and the ``train`` job."""
