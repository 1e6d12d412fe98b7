"""What the user asks for: the option table (:mod:`~vitreg.config.options`), the parsers
(:mod:`~vitreg.config.parse`), the specs (:mod:`~vitreg.config.spec`) and the files generated from
the table (:mod:`~vitreg.config.generate`: MLproject, the README's parameter tables)."""
