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


# The exit code of a run stopped by SIGTERM / SIGUSR1 after saving its state (sysexits.h's
# EX_TEMPFAIL: "try again later"). Distinct from 1 (failed), 2 (bad input) and 128 + N
# (killed by signal N before anything was saved): a job script may requeue on it.
PREEMPTED_EXIT = 75


class Preempted(Exception):
    """A run that stopped on a signal with its state saved; `resume=auto` continues it.

    The CLI prints the message as one line and exits with PREEMPTED_EXIT.
    """


class Finished(Exception):
    """A training command given a run directory whose run has ended (results.json written
    for these epochs): nothing is done and nothing in it is touched.

    The CLI prints the message as one line and exits 0 (a requeued job is done too).
    """
