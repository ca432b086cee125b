"""Where datasets live on disk when `data.root` does not say.

`data_dir()` is the one download/cache folder: `$RESMLP_DATA_DIR` when set, else
`~/.cache/resmlp/datasets`. torchvision-backed data sets (Fashion-MNIST's download,
CIFAR-10/100, STL-10) are stored under it in torchvision's own layout.
"""
from __future__ import annotations

import contextlib
import os

from resmlp.core.errors import UserError
from resmlp.data.images import is_image_file

DATA_DIR_ENV = "RESMLP_DATA_DIR"


def data_dir() -> str:
    """The download/cache folder (not created here)."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "resmlp", "datasets")


def user_root(data_cfg, key: str = "data.root") -> str | None:
    """`data.root` with `~` expanded, or None when it is not set. It names a folder: a file
    there is an error that says so (every data set reads its root through here). `key`: the
    config key the user gave it as (eval.root for the DINO run's labeled set)."""
    root = data_cfg.root
    if root is None or str(root) == "":
        return None
    path = os.path.abspath(os.path.expanduser(str(root)))
    if os.path.exists(path) and not os.path.isdir(path):
        hint = ""
        if key == "data.root" and _lists_images(path):
            hint = (f"; a text file of image paths, one a line, is data.files={path}"
                    + ("" if data_cfg.get("name") == "folder" else " with data=folder"))
        raise UserError(f"{key}={path} is a file, not a folder: name the folder that holds the data set{hint}")
    return path


def _lists_images(path: str) -> bool:
    """Whether a file reads as a list of image paths (its first line names an image)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return False
    first = next((line.strip() for line in head.splitlines() if line.strip()), "")
    return is_image_file(first)


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
