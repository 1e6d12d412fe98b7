"""vitreg.ddp."""
