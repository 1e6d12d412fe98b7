"""The one exception type that means "the user asked for something we cannot do".

Every check on user input raises :class:`VitregError` with a one-line message that names the fix.
The CLI turns it into ``error: <message>`` on stderr and exit status 2; the tracking layer marks the
MLflow run FAILED and stores the message in the ``vitreg_error`` tag. Anything else is a bug and
keeps its traceback.
"""


class VitregError(ValueError):
    """Bad input or an unusable environment; the message is one line and says what to do."""

    exit_code = 2

    def __init__(self, message: str):
        # One line, always: the message ends up in a terminal, a tag and a table cell.
        super().__init__(" ".join(str(message).split()))


class StoreError(VitregError):
    """The tracking store (a local database file or a server) cannot be used; the message names it."""
