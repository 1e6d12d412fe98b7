"""vitreg.train.job."""
