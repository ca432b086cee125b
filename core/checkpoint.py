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

from resmlp.core.errors import RunFailed, UserError

FORMAT = "resmlp-ssl"
NOT_A_CHECKPOINT = ("a checkpoint is a file torch.save wrote: a run's checkpoint.pth, an official DINO "
                    "checkpoint, a timm or DeiT state_dict; a file cut short, e.g. by a full disk, cannot be read")
CHECKPOINT_NAME = "checkpoint.pth"
PREVIOUS_NAME = "checkpoint_prev.pth"


class _Recorder:
    """A file that remembers the OSError a write or flush raised: torch.save turns a full
    disk into a RuntimeError about stream positions, which names neither cause nor file."""

    def __init__(self, f):
        self._f, self.error = f, None

    def write(self, data):
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        try:
            return self._f.flush()
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name):
        return getattr(self._f, name)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", previous: str | os.PathLike | None = None,
                 what: str = "the file", then: str = "free some space or choose another out=, then run again"):
    """Open a temp file beside `path`; on success it replaces `path` in one rename, so a
    reader (or a run killed mid-write) never sees half a file. With `previous`, the old
    `path` is first renamed to it (after the new file is complete on disk).

    A write the file system refuses (a full disk, a quota, a read-only mount) removes the
    temp file and becomes a RunFailed naming `what`, the path and the cause, then `then`
    (what to do): the file there before is untouched."""
    path = Path(path)
    tmp, f = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        with os.fdopen(fd, mode) as raw:
            f = _Recorder(raw)
            yield f
            f.flush()
            os.fsync(raw.fileno())
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        cause = e if isinstance(e, OSError) else getattr(f, "error", None)
        if cause is None:
            raise
        raise RunFailed(f"cannot write {what} {path}: {cause.strerror or cause}; "
                        f"{'the one before is intact' if path.exists() else 'nothing was written'}: {then}") from None


def save_checkpoint(path: str | os.PathLike, state: dict, previous: str | os.PathLike | None = None) -> Path:
    """Write `state` (plus the format tag) to `path` atomically; with `previous`, the
    checkpoint it replaces is kept there."""
    with atomic_write(path, previous=previous, what="the checkpoint",
                      then="free some space, then run the same command again (resume=auto continues from "
                           "the last checkpoint)") as f:
        torch.save({"format": FORMAT, **state}, f)
    return Path(path)


def writable_problem(directory: str | os.PathLike) -> str | None:
    """None if files can be written in `directory` (made if missing), else why not. Tried
    rather than inferred from permission bits (root passes those, /proc refuses anyway);
    what the try creates is removed again, so a refused command leaves nothing behind."""
    d = Path(directory).expanduser().absolute()
    missing = []
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    if not d.is_dir():
        return f"{d} is an existing file, not a directory"
    made = []
    try:
        for m in reversed(missing):
            m.mkdir()
            made.append(m)
        fd, probe = tempfile.mkstemp(dir=made[-1] if made else d, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}"
    finally:
        for m in reversed(made):
            with contextlib.suppress(OSError):
                m.rmdir()
    return None


def check_writable(directory: str | os.PathLike, what: str, fix: str) -> None:
    """UserError (one line: what cannot be written where, and `fix`) unless
    writable_problem(directory) finds none."""
    problem = writable_problem(directory)
    if problem:
        raise UserError(f"cannot write {what} to {directory} ({problem}); {fix}")


def resolve_checkpoint_path(spec: str | os.PathLike,
                            alternatives: str = "a checkpoint file or a run directory") -> Path:
    """A checkpoint file, or a run directory holding checkpoint.pth; `alternatives`: what a
    missing one's message says to pass instead (resmlp.core.weights: timm's weights too)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / CHECKPOINT_NAME
        if not path.exists():
            raise UserError(f"{spec} is a directory without {CHECKPOINT_NAME}; "
                            "pass a run directory of this project or a checkpoint file")
    if not path.exists():
        raise UserError(f"checkpoint {spec} does not exist; pass {alternatives}")
    if path.is_dir():  # a run dir whose checkpoint.pth is itself a folder
        raise UserError(f"{path} is a folder, not a checkpoint file; pass a checkpoint file or a run directory "
                        f"whose {CHECKPOINT_NAME} is one")
    return path


def load_checkpoint(spec: str | os.PathLike, map_location="cpu") -> dict:
    """Load any torch checkpoint file (ours, DINO's, timm's, a bare state_dict)."""
    path = resolve_checkpoint_path(spec)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - mmap reads only zip files: try the legacy format too
        try:
            obj = torch.load(path, map_location=map_location, weights_only=False)
        except Exception:  # noqa: BLE001 - a text file, random bytes, a file cut short
            raise UserError(f"{path} is not a checkpoint: torch cannot read it ({NOT_A_CHECKPOINT})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not a checkpoint ({NOT_A_CHECKPOINT})")
    return obj


def saved_config(checkpoint: str | os.PathLike) -> dict | None:
    """The config a project checkpoint or run dir was trained with, if any."""
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
