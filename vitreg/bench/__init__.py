"""vitreg.bench.job."""
