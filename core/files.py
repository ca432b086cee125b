"""Writing in a folder a command was given (a run folder, out=, a checkpoint's folder):
never through a symbolic link.

Such a folder may come from someone else (a run shared on a cluster disk) and hold a link
where a command writes: log.jsonl -> a file of yours outside it. Writing through the link
would change that file. So a command writes a file in its folder either by rename (a temp
file beside it: core.checkpoint.atomic_write, which refuses a link at the name, and a
rename would replace the link, never follow it) or, for the logs that grow by appending,
opened here with O_NOFOLLOW and only if it is a regular file (open_nofollow). A link where
a command writes is one line naming it (refuse_link): the trainers look at every entry of
their run folder (refuse_links_in), the evaluators at the files and folders they write,
before any work.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from resmlp.core.errors import UserError

# How many entries of a run folder are looked at for a link (a run writes a few dozen).
SCAN_ENTRIES = 10_000
_FIX = "a command writes inside its folder, never through a link to elsewhere: remove the link, or choose another out="


def _refusal(link: Path) -> str:
    try:
        target = f" (to {os.readlink(link)})"
    except OSError:
        target = ""
    return f"{link} is a symbolic link{target}; {_FIX}"


def link_problem(path: str | os.PathLike, within: str | os.PathLike | None = None) -> str | None:
    """The line that refuses the first symbolic link among `path` and its folders below
    `within` (default: `path` alone; `within` itself may be a link, the user named it);
    None when there is none. A part that does not exist yet is no link."""
    path = Path(path)
    parts = [path]
    if within is not None:
        try:
            below = path.relative_to(within).parts
            parts = [Path(within).joinpath(*below[:i + 1]) for i in range(len(below))]
        except ValueError:   # not under `within`: the path alone
            pass
    for part in parts:
        if part.is_symlink():
            return _refusal(part)
    return None


def refuse_link(path: str | os.PathLike, within: str | os.PathLike | None = None) -> None:
    """UserError (link_problem's line) when `path`, or a folder of it below `within`, is a link."""
    problem = link_problem(path, within)
    if problem:
        raise UserError(problem)


def refuse_links_in(directory: str | os.PathLike) -> None:
    """UserError naming the first symbolic link among the entries of `directory` (a run
    folder, whose every entry the run may write); nothing when it does not exist yet."""
    try:
        with os.scandir(directory) as entries:
            for i, entry in enumerate(entries):
                if i == SCAN_ENTRIES:
                    return
                if entry.is_symlink():
                    raise UserError(_refusal(Path(entry.path)))
    except (FileNotFoundError, NotADirectoryError):
        return


def open_nofollow(path: str | os.PathLike, mode: str = "a", **kwargs):
    """open(path, mode) for writing ("w", "a", "wb", "ab"), refusing in one line a link at
    `path` (O_NOFOLLOW) and anything there but a regular file (a FIFO would block)."""
    if mode.rstrip("b") not in ("w", "a"):
        raise ValueError(f"open_nofollow writes, it does not open {mode!r}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_APPEND if mode.startswith("a") else 0
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(_refusal(Path(path))) from None
        if e.errno == errno.ENXIO:   # a FIFO nobody reads
            raise UserError(f"{path} is not a regular file; remove it, or choose another out=") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{path} is not a regular file; remove it, or choose another out=")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if mode.startswith("w"):
            os.ftruncate(fd, 0)   # after the checks: a refused file is left as it was
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


# Past this a record a command reads back from its folder (results.json, inputs.json,
# run.lock) is not one of this project's.
RECORD_MAX_BYTES = 1 << 20


def read_regular(path: str | os.PathLike, max_bytes: int = RECORD_MAX_BYTES) -> bytes:
    """The bytes of `path` when it is a regular file of at most `max_bytes`; OSError for
    anything else (a FIFO is not waited on, a device not read to its end)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            raise OSError(errno.EINVAL, f"not a regular file of at most {max_bytes} bytes", str(path))
        return f.read(max_bytes + 1)
