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

Reading: every file the user names or a run reads back comes through `load_checkpoint`,
without running code. A .pth file is a pickle, and unpickling can call any function the
file names; so torch reads it with weights_only=True: tensors, plain Python values and the
few classes in SAFE_GLOBALS (argparse.Namespace, which DINO's and DeiT's checkpoints hold,
and the numpy types this project's checkpoints held before they stored everything as tensors
and plain values). A .safetensors file holds nothing but tensors (the safetensors library).
A file that asks for anything else is refused before any work, naming what it asks for,
unless the user trusts it: `weights_trust=true` (the CLI enters `trusting`) loads it as
torch.load(weights_only=False) does.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import os
import pickle
import random
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from resmlp.core.errors import RunFailed, UserError

FORMAT = "resmlp-ssl"
NOT_A_CHECKPOINT = ("a checkpoint is a file torch.save wrote: a run's checkpoint.pth, an official DINO "
                    "checkpoint, a timm or DeiT state_dict; or a .safetensors file; a file cut short, e.g. by a "
                    "full disk, cannot be read")
CHECKPOINT_NAME = "checkpoint.pth"
PREVIOUS_NAME = "checkpoint_prev.pth"
# The config key that loads a file asking for more than SAFE_GLOBALS (configs/defaults.yaml).
TRUST_KEY = "weights_trust"


def _numpy_globals() -> list:
    """What a checkpoint of this project written before its RNG state and learning rates were
    stored as tensors and plain values asks numpy for: an ndarray of uint32 (numpy's RNG key)
    and float64 scalars (the schedules' learning rate and weight decay). numpy 2 pickles its
    functions as numpy._core.multiarray.*, numpy 1 as numpy.core.multiarray.*: both names."""
    try:
        from numpy._core import multiarray   # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1
        from numpy.core import multiarray
    named = [(f, f"numpy.{core}.multiarray.{f.__name__}") for f in (multiarray._reconstruct, multiarray.scalar)
             for core in ("_core", "core")]
    # unpickling an array or a scalar builds its dtype, an instance of the dtype's class (numpy >= 1.25)
    return [*named, np.ndarray, np.dtype, *{type(np.dtype(t)) for t in (np.uint32, np.float64)}]


# The classes and functions beyond torch's own that a weights-only load may call: none runs
# code of the file's choosing.
SAFE_GLOBALS = [argparse.Namespace, *_numpy_globals()]

_trusted = contextvars.ContextVar("resmlp_weights_trust", default=False)


@contextlib.contextmanager
def trusting(trust: bool = True):
    """Within it, load_checkpoint loads a file that asks for more than SAFE_GLOBALS as
    torch.load(weights_only=False) does: for files from a trusted source (weights_trust=true)."""
    token = _trusted.set(bool(trust))
    try:
        yield
    finally:
        _trusted.reset(token)


class UnsafeFile(UserError):
    """A file whose unpickling would call something that is not weights: refused, not taken
    for a damaged file (a run does not fall back to its previous checkpoint)."""


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
        torch.save(plain({"format": FORMAT, **state}), f)
    return Path(path)


def plain(obj):
    """`obj` with numpy's scalars as Python's and its arrays as lists, so that a weights-only
    load reads it back (a schedule's learning rate in an optimizer's state is a numpy float).
    What holds none is returned as it is (a state_dict keeps its class and _metadata)."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        changed = {k: new for k, v in obj.items() if (new := plain(v)) is not v}
        if not changed:
            return obj
        out = copy.copy(obj)
        out.update(changed)
        return out
    if type(obj) in (list, tuple):
        items = [plain(v) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    return obj


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


def load_checkpoint(spec: str | os.PathLike, map_location="cpu", trust: bool | None = None) -> dict:
    """Load any checkpoint file (ours, DINO's, DeiT's, timm's, a bare state_dict, a
    .safetensors file) without running code of its own; `trust` (default: the `trusting`
    context's) loads one that asks for more than SAFE_GLOBALS as torch.load(weights_only=False)."""
    path = resolve_checkpoint_path(spec)
    obj = read_file(path, map_location, _trusted.get() if trust is None else trust)
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not a checkpoint ({NOT_A_CHECKPOINT})")
    return obj


def read_file(path: str | os.PathLike, map_location="cpu", trust: bool = False):
    """What the file holds: a .safetensors file's tensors, or what torch.save pickled,
    memory-mapped where torch can (its zip format), read weights-only unless `trust`. A file
    that asks for more is an UnsafeFile naming what; one that cannot be read, a UserError."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if _is_safetensors(head, path):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(path, device=str(map_location))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{path} is not a checkpoint: safetensors cannot read it ({e})") from None
    mmap = head.startswith(b"PK\x03\x04")   # torch's zip format: mapped, read as tensors are used
    try:
        if trust:
            return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        asks = None if trust else _refused_globals(path, e, mmap)
        if asks:
            raise UnsafeFile(f"{path} is not a file of weights only: loading it would call {', '.join(asks)} "
                             "(a .pth file is a pickle, which can run code as it loads), so it was not loaded; "
                             f"if you trust where it came from, pass {TRUST_KEY}=true to load it as "
                             "torch.load(weights_only=False) does") from None
        raise UserError(f"{path} is not a checkpoint: torch cannot read it ({NOT_A_CHECKPOINT})") from None
    except Exception:  # noqa: BLE001 - a text file, random bytes, a file cut short
        raise UserError(f"{path} is not a checkpoint: torch cannot read it ({NOT_A_CHECKPOINT})") from None


def _is_safetensors(head: bytes, path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then the JSON header."""
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 8 + int.from_bytes(head[:8], "little") <= path.stat().st_size


# How torch's weights-only unpickler names what it refused, in the messages of the versions
# this project runs on: a global it does not allow (or whose module it blocks), an allowed
# class it may not build, a function it may not call.
_REFUSED = (re.compile(r"GLOBAL (\S+) (?:was not|whose module)"), re.compile(r"but got <class '([^']+)'>"),
            re.compile(r"unrecognized function (\S+)"))


def _refused_globals(path: Path, error: Exception, zipped: bool) -> list[str]:
    """The classes and functions beyond SAFE_GLOBALS a refused file asks for; [] when the
    error was another (a damaged pickle). torch lists every one a zip file names without
    running any; of a file in its older format, the message names the first."""
    found = []
    if zipped:
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                found = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001 - a damaged file: what the error says, if anything
            found = []
    for pattern in () if found else _REFUSED:
        found = pattern.findall(str(error))[:1]
        if found:
            break
    return found


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
    """Python's, numpy's and torch's (and CUDA's) random states as tensors and plain values,
    which a weights-only load reads back."""
    numpy = np.random.get_state(legacy=False)
    state = {"python": random.getstate(),
             "numpy": {"bit_generator": str(numpy["bit_generator"]),
                       "state": {"key": torch.from_numpy(numpy["state"]["key"].astype(np.int64)),
                                 "pos": int(numpy["state"]["pos"])},
                       "has_gauss": int(numpy["has_gauss"]), "gauss": float(numpy["gauss"])},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore rng_state()'s states, or those of a checkpoint written before numpy's was a
    tensor (numpy's own tuple, its key an ndarray)."""
    random.setstate(tuple(state["python"]))
    numpy = state["numpy"]
    if isinstance(numpy, dict):
        key = np.asarray(numpy["state"]["key"], dtype=np.int64).astype(np.uint32)
        numpy = {**numpy, "state": {**numpy["state"], "key": key}}
    np.random.set_state(numpy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
