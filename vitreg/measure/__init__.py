"""vitreg.measure."""
