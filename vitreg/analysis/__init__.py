"""vitreg.analysis."""
