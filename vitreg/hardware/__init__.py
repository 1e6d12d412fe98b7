"""vitreg.hardware.profiles."""
