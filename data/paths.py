"""Where datasets live on disk when `data.root` does not say.

`data_dir()` is the one download/cache folder: `$RESMLP_DATA_DIR` when set, else
`~/.cache/resmlp/datasets`. torchvision-backed data sets (Fashion-MNIST's download,
CIFAR-10/100, STL-10) are stored under it in torchvision's own layout.
"""
from __future__ import annotations

import contextlib
import os

from resmlp.core.errors import UserError

DATA_DIR_ENV = "RESMLP_DATA_DIR"


def data_dir() -> str:
    """The download/cache folder (not created here)."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "resmlp", "datasets")


def user_root(data_cfg) -> str | None:
    """`data.root` with `~` expanded, or None when it is not set. It names a folder: a file
    there is an error that says so (every data set reads its root through here)."""
    root = data_cfg.get("root", None)
    if root is None or str(root) == "":
        return None
    path = os.path.abspath(os.path.expanduser(str(root)))
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"data.root={path} is a file, not a folder: name the folder that holds the data set")
    return path


@contextlib.contextmanager
def main_process_first():
    """Let rank 0 run the body (a download) before the other ranks run it.

    Under torch.distributed the other ranks wait at a barrier until rank 0 is done, then
    run the body themselves (they find the files rank 0 wrote). Every rank must enter
    it, so use it only where all ranks take the same path (a download that is needed).
    """
    from resmlp.core import dist

    if dist.is_dist() and not dist.is_main():
        dist.barrier()
    try:
        yield
    finally:
        if dist.is_dist() and dist.is_main():
            dist.barrier()
