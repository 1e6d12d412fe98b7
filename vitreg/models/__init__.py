"""vitreg.models.factory."""
