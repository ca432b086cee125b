"""`python -m campaign.starts --out FOLDER [--keep FILE] [--then KEY=VALUE ...] -- <python arguments>`:
one command started twice, as the campaign's `default_command` stage runs the default command
and then its resume (training.py, DefaultStage). No torch import.

Each start is a process of its own with an Inductor cache of its own, empty at its start
(FOLDER/inductor/start1, .../start2): what the second finds compiled is only what the run
itself saved (its compile cache, core/compile_cache.py), as on the next machine a requeued
job lands on. The second start adds the keys after --then (a longer run: it continues the
first's). After each start that ends well, FILE (a run's results.json, which the next start
rewrites) is copied to FOLDER/start<N>_<its name>. Each start's output follows a line
`[starts] start N of 2: <command>`. A SIGTERM goes to the start under way (a trainer saves
and exits 75) and no start follows it; a start that fails ends it too. The exit code is the
last start's.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

MARK = "[starts] start {n} of {total}: {command}"   # training.py reads it back (START)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m campaign.starts --out FOLDER [--keep FILE] [--then KEY=VALUE ...] -- "
                         "<arguments>")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m campaign.starts")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--then", nargs="*", default=[])
    args = parser.parse_args(argv[:cut])
    commands = [[sys.executable, *argv[cut + 1:]], [sys.executable, *argv[cut + 1:], *args.then]]
    args.out.mkdir(parents=True, exist_ok=True)
    running: dict = {"proc": None, "stop": False}

    def forward(signum, frame):
        running["stop"] = True
        if running["proc"] is not None and running["proc"].poll() is None:
            running["proc"].send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, forward)
    rc = 0
    for n, command in enumerate(commands, 1):
        if running["stop"]:
            break
        cache = args.out / "inductor" / f"start{n}"
        shutil.rmtree(cache, ignore_errors=True)
        print(MARK.format(n=n, total=len(commands), command=shlex.join(["python", *command[1:]])), flush=True)
        running["proc"] = subprocess.Popen(command, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
        rc = running["proc"].wait()
        if rc == 0 and args.keep is not None and args.keep.is_file():   # what this start wrote
            shutil.copyfile(args.keep, args.out / f"start{n}_{args.keep.name}")
        if rc != 0 or running["stop"]:
            break
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
