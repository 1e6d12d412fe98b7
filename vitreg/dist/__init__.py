"""vitreg.dist."""
