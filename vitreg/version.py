"""This vitreg's version (pyproject.toml's), in a module that imports nothing: the checkpoint format
records it, and no module below the package root imports the root."""

__version__ = "0.1.0"
