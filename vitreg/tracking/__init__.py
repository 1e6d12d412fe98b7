"""vitreg.tracking.runs."""
