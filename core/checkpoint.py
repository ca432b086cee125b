"""Checkpoints every command writes and reads the same way.

A project checkpoint is one torch file (`<run dir>/checkpoint.pth`) holding a dict:
    format     "resmlp-ssl"
    command    "dino" | "supervised" | "distill" | "finetune" | ...
    config     the resolved config as a plain dict (to rebuild the model and check resume)
    student / teacher   (DINO) state_dicts with keys "backbone.*" and "head.*"
    model      (supervised paths) the classifier's state_dict
    epoch, iteration, optimizer, scaler, rng, ...   (what resume needs)
The `teacher`/`student` layout is the official DINO one, not its keys: the head is
lightly's (head.layers.*, not DINO's head.mlp.*) and no key carries DDP's `module.`.
resmlp.models.load reads official DINO checkpoints as well as ours. Writes are atomic (temp file + rename): a run killed mid-write keeps
its previous checkpoint. A run directory also keeps the checkpoint before the latest
(`checkpoint_prev.pth`), for when the latest cannot be read.
"""
from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from resmlp.core.errors import UserError

FORMAT = "resmlp-ssl"
CHECKPOINT_NAME = "checkpoint.pth"
PREVIOUS_NAME = "checkpoint_prev.pth"


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", previous: str | os.PathLike | None = None):
    """Open a temp file beside `path`; on success it replaces `path` in one rename, so a
    reader (or a run killed mid-write) never sees half a file. With `previous`, the old
    `path` is first renamed to it (after the new file is complete on disk)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_checkpoint(path: str | os.PathLike, state: dict, previous: str | os.PathLike | None = None) -> Path:
    """Write `state` (plus the format tag) to `path` atomically; with `previous`, the
    checkpoint it replaces is kept there."""
    with atomic_write(path, previous=previous) as f:
        torch.save({"format": FORMAT, **state}, f)
    return Path(path)


def resolve_checkpoint_path(spec: str | os.PathLike) -> Path:
    """A checkpoint file, or a run directory holding checkpoint.pth."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / CHECKPOINT_NAME
        if not path.exists():
            raise UserError(f"{spec} is a directory without {CHECKPOINT_NAME}; "
                            "pass a run directory of this project or a checkpoint file")
    if not path.exists():
        raise UserError(f"checkpoint {spec} does not exist; pass a checkpoint file, a run directory "
                        "or timm:<model name>")
    return path


def load_checkpoint(spec: str | os.PathLike, map_location="cpu") -> dict:
    """Load any torch checkpoint file (ours, DINO's, timm's, a bare state_dict)."""
    path = resolve_checkpoint_path(spec)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
    except Exception as e:  # a truncated file, a text file, ...: not a checkpoint
        try:
            obj = torch.load(path, map_location=map_location, weights_only=False)
        except Exception:
            raise UserError(f"{path} is not a readable torch checkpoint ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:120]})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not a checkpoint dict or state_dict")
    return obj


def saved_config(checkpoint: str) -> dict | None:
    """The config a project checkpoint or run dir was trained with, if any."""
    if checkpoint.startswith("timm:"):
        return None
    path = Path(checkpoint).expanduser()
    if path.is_dir() and (path / "config.yaml").exists():
        from omegaconf import OmegaConf
        return OmegaConf.to_container(OmegaConf.load(path / "config.yaml"))
    ckpt = load_checkpoint(path)
    cfg = ckpt.get("config")
    return cfg if isinstance(cfg, dict) else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
