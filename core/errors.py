"""The one exception type that means "the user must fix something".

Every command catches `UserError` at the top (resmlp.cli) and prints its message
as a single line with exit code 2. Raise it for bad input (a missing dataset, a
misspelled config key, an unknown model); let programming errors stay tracebacks.
"""


class UserError(Exception):
    """Bad input: the message is one line that says what to fix."""


class RunFailed(Exception):
    """A run that cannot go on (e.g. a non-finite loss); its last checkpoint is intact.

    The CLI prints the message as one line and exits with code 1.
    """
