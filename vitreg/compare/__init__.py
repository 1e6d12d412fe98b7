"""vitreg.analysis.comparison."""
