"""One live run per run directory: `<run dir>/run.lock` names the process that holds it.

Two runs writing the same checkpoint would each silently undo the other's work, so a run
takes the lock before it writes anything and a second run on the directory stops with
one line naming the holder. A lock whose holder is gone (a killed run) is taken over
with a warning. "Gone" is decided where it can be: on the same host, by the holder's
pid and start time; on another host, only a requeued Slurm job recognises the lock of
its own earlier life (the same SLURM_JOB_ID). Any other host's lock counts as live:
its message says which file to delete if that run is dead.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from resmlp.core.errors import UserError
from resmlp.core.files import read_regular

LOCK_NAME = "run.lock"

_held: set["RunLock"] = set()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), counted after "pid (comm)"


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    now = _start_time(pid)
    return started is None or now is None or now == started


def this_process() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


class RunLock:
    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_NAME

    def holder(self) -> dict | None:
        """The holder's record; {} for a file that cannot be read; None without a lock."""
        try:
            record = json.loads(read_regular(self.path))  # a FIFO put there is not waited on
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def state(self, holder: dict) -> str:
        """'ours' (this process), 'live' or 'stale'."""
        me = this_process()
        if holder.get("host") == me["host"]:
            if holder.get("pid") == me["pid"] and holder.get("started") == me["started"]:
                return "ours"
            pid = holder.get("pid")
            return "live" if isinstance(pid, int) and _alive(pid, holder.get("started")) else "stale"
        if not holder.get("host") or (holder.get("slurm_job") and holder.get("slurm_job") == me["slurm_job"]):
            return "stale"
        return "live"

    def problem(self) -> str | None:
        """Why this process may not run here (a live run holds the directory), or None."""
        holder = self.holder()
        if holder is None or self.state(holder) != "live":
            return None
        where = f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
        dead_hint = ("" if holder.get("host") == socket.gethostname()
                     else f"; if that run is dead, delete {self.path}")
        return (f"{self.path.parent} is in use by a running run ({where}): wait for it to end, or use "
                f"out=<another dir>{dead_hint}")

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when it took over a stale one. UserError when a
        live run holds it."""
        warning = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is None:
                    continue  # released in between
                problem = self.problem()
                if problem:
                    raise UserError(problem) from None
                if self.state(holder) == "stale":
                    warning = (f"warning: {self.path} was left by a run that is gone (pid {holder.get('pid')} on "
                               f"{holder.get('host')}, since {holder.get('since')}); taking it over")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(this_process(), f)
            _held.add(self)
            return warning
        raise UserError(f"could not take {self.path}: another run is starting on {self.path.parent}; "
                        "use out=<another dir>")

    def release(self) -> None:
        if self not in _held:
            return
        _held.discard(self)
        holder = self.holder()
        if holder is not None and self.state(holder) == "ours":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def release_all() -> None:
    """Release every lock this process holds (the CLI's last step, on any exit)."""
    for lock in list(_held):
        lock.release()
