"""vitreg.config."""
