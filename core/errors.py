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


def causes(error: BaseException | None) -> list[BaseException]:
    """`error` and what it was raised from or while handling (__cause__, __context__), in order."""
    seen: list[BaseException] = []
    while error is not None and all(error is not e for e in seen):
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def out_of_memory(error: BaseException) -> str | None:
    """The first line of torch's allocation failure (CUDA's OutOfMemoryError, or the CPU
    allocator's RuntimeError) where `error` is one or was raised from one (a CUDA graph's
    capture_end fails with a CUDA error of its own after an out of memory inside the
    capture), None for any other error. By name and text: the CLI does not import torch
    before it has to."""
    for e in causes(error):
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in text:
            return text
    return None


def raised_in(error: BaseException) -> tuple[str, ...]:
    """The parts of the path of the file whose code raised `error` (its innermost frame)."""
    import traceback
    from pathlib import Path
    frames = traceback.extract_tb(error.__traceback__)
    return Path(frames[-1].filename).parts if frames else ()
