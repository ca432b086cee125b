"""The campaign's report folder: what a remote machine hands back whole.

The lent GPU machine returns at most 8 files of under 16 MiB each from its output folder,
none more than two folders down, named in letters, digits, '.', '_' and '-'. The report
is written flat, and every rule is enforced here rather than trusted: a text file over
the size cap keeps its first and last lines around a line that says how much was left
out. No torch import: the campaign's orchestrator uses this.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

MAX_FILES = 8
MAX_BYTES = 16 * 2**20 - 2**16      # under 16 MiB, with room for the marker line
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
MARKER = "summary.json"             # a folder holding it was written here before: its files may be replaced


class ReportError(ValueError):
    """The report folder cannot be written as asked (a programming or usage error)."""


def trim(data: bytes, max_bytes: int) -> bytes:
    """`data` itself, or its first quarter and last three quarters of `max_bytes`, cut at
    line ends, around one line that says how many bytes were left out."""
    if len(data) <= max_bytes:
        return data
    budget = max_bytes - 200
    head = data[:budget // 4]
    head = head[:head.rfind(b"\n") + 1]
    tail = data[len(data) - (budget - len(head)):]
    tail = tail[tail.find(b"\n") + 1:]
    gone = len(data) - len(head) - len(tail)
    return head + f"[... {gone} bytes left out here: over the report's size cap ...]\n".encode() + tail


def problem(folder: Path, names) -> str | None:
    """Why `folder` may not take a report of the files `names` (it holds what an earlier
    report did not write), or None."""
    if not folder.is_dir():
        return None
    ours = (folder / MARKER).exists()
    strangers = [p.name for p in folder.iterdir() if p.name not in names and not (ours and p.is_file())]
    if strangers:
        return (f"the report folder {folder} holds other things ({', '.join(sorted(strangers)[:4])}); "
                "name an empty folder")
    return None


def write_report(folder: Path, files: dict, max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES) -> list[Path]:
    """Write `files` ({name: a Path to copy, or bytes / str / a JSON-able dict}) flat into
    `folder`: sources that do not exist are left out, files of an earlier report that
    are not in this one are removed. Returns the paths written."""
    folder = Path(folder)
    bad = [n for n in files if not NAME.match(n)]
    if bad:
        raise ReportError(f"report file names must be letters, digits, '.', '_', '-': {bad}")
    if len(files) > max_files:
        raise ReportError(f"a report holds at most {max_files} files, not {len(files)}: {sorted(files)}")
    folder.mkdir(parents=True, exist_ok=True)
    why = problem(folder, files)
    if why:
        raise ReportError(why)
    present = [p for p in folder.iterdir()]
    for p in present:
        if p.is_file() and p.name not in files:
            p.unlink()
    written = []
    for name, source in files.items():
        if isinstance(source, Path):
            if not source.is_file():
                continue
            data = source.read_bytes()
        elif isinstance(source, dict):
            data = (json.dumps(source, indent=2, default=str) + "\n").encode()
        else:
            data = source.encode() if isinstance(source, str) else bytes(source)
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(trim(data, max_bytes))
        tmp.replace(folder / name)
        written.append(folder / name)
    return written
