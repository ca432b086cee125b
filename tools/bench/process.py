"""How the bench starts a process of its own (`python -m bench.<module> ...`): the torchrun
row's job, compile_cost.py's fresh processes, the k-NN baseline's process. The child gets
tools/ on its import path, so that it finds this package however the bench was started
(run.sh, pytest, `python -m bench` from tools/)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent


def module_argv(module: str, *args, python: str = sys.executable) -> list[str]:
    """`python -m bench.<module> args...`."""
    return [python, "-m", f"bench.{module}", *map(str, args)]


def child_env(**more: str) -> dict:
    """This process's environment with tools/ first on PYTHONPATH, and `more`."""
    path = os.pathsep.join([str(TOOLS), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **more}
