"""The ``vitreg`` command line: the click group (:mod:`vitreg.cli.main`) and its commands."""

from vitreg.cli.main import main

__all__ = ["main"]
