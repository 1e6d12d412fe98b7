"""vitreg.deploy."""
