"""The checkpoint format, below both training and tracking: the files and their manifest
(:mod:`~vitreg.checkpoint.format`), what they hold checked as strictly as user input
(:mod:`~vitreg.checkpoint.contents`), the folder a user gets (:mod:`~vitreg.checkpoint.export`)."""
