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
its previous checkpoint, and a symbolic link where one is written is refused, never written
through (core/files.py). A run directory also keeps the checkpoint before the latest
(`checkpoint_prev.pth`), for when the latest cannot be read.

Reading: every file the user names or a run reads back comes through `load_checkpoint`
(or `read_file`), without running code and within bounds set by the file's own size:
- only a regular file is read (a FIFO would hang the command, a device never end);
- a .safetensors file holds nothing but tensors (the safetensors library reads it);
- a .pth file is a pickle, and unpickling can call any function the file names. Before
  torch reads one, its pickle is read without running it (core/pickle_scan.py): a file
  naming anything beyond torch's weights-only allowlist and SAFE_GLOBALS is refused,
  naming every such global (torch itself names only the first it meets, and none in a
  pickle protocol it does not read). So is a zip whose records claim more than
  ALLOC_FACTOR times the file plus ALLOC_SLACK once inflated (a zip bomb), a pickle
  larger than PICKLE_MAX, or one that calls bytearray or a tensor class for more memory
  than that bound. torch then reads it with weights_only=True: tensors, plain Python
  values and SAFE_GLOBALS: argparse.Namespace (DINO's and DeiT's checkpoints hold one)
  and, under numpy's names, validating stand-ins for the numpy values this project's
  checkpoints held before they stored everything as tensors and plain values (numeric
  arrays and scalars rebuilt from the file's own bytes; numpy's own ndarray and dtype
  are never called: `np.ndarray(shape, np.dtype('O'), buffer)` would make an array of
  pointers the file chose). What it read is refused when it nests deeper than
  MAX_NESTING or its tensors span more than the bound (a stride of 0 repeats four bytes
  a billion times), and a project checkpoint's `config` is read as plain data
  (core/plain_config.py: no interpolation resolved, depth bounded).
A refused file is one line naming it and what it asks for, before any work, unless the
user trusts it: `weights_trust=true` (the CLI enters `trusting`) loads it as
torch.load(weights_only=False) does (the size bounds still hold).
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import math
import os
import pickle
import random
import re
import stat
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from resmlp.core import pickle_scan
from resmlp.core.errors import RunFailed, UserError
from resmlp.core.files import refuse_link
from resmlp.core.plain_config import plain_config, read_config_yaml

FORMAT = "resmlp-ssl"
NOT_A_CHECKPOINT = ("a checkpoint is a file torch.save wrote: a run's checkpoint.pth, an official DINO "
                    "checkpoint, a timm or DeiT state_dict; or a .safetensors file; a file cut short, e.g. by a "
                    "full disk, cannot be read")
CHECKPOINT_NAME = "checkpoint.pth"
PREVIOUS_NAME = "checkpoint_prev.pth"
# The config key that loads a file asking for more than SAFE_GLOBALS (configs/defaults.yaml).
TRUST_KEY = "weights_trust"


# What a load may allocate: ALLOC_FACTOR times the file plus ALLOC_SLACK (a checkpoint's
# tensors are its bytes; the slack: its pickle's Python objects, a tied weight's second view).
ALLOC_FACTOR, ALLOC_SLACK = 2, 64 << 20
# A checkpoint's pickle holds names, numbers and tensor shapes, the tensors are beside it.
PICKLE_MAX = 64 << 20
# A state dict nests two levels, an optimizer's state four: far deeper is no checkpoint.
MAX_NESTING = 100
# What the numpy stand-ins refused while torch read a file (the line names it).
_refused_numpy = contextvars.ContextVar("resmlp_refused_numpy", default=None)
# numpy's type codes of numbers: bool, signed and unsigned integers, floats, complex numbers.
_NUMERIC = re.compile(r"[<>|=]?(b1|[iu][1248]|f(2|4|8|16)|c(8|16|32))")


def _refuse(what: str):
    """A numpy value no weights file needs: the load stops here, naming it."""
    _refused_numpy.set(what)
    raise pickle.UnpicklingError(f"refused {what}")


class _Dtype:
    """numpy.dtype as a weights-only load builds it: a number's type code only (numpy's
    pickles call numpy.dtype('f8', False, True), then set its byte order)."""

    def __new__(cls, code=None, align=False, copy=False):
        if not (isinstance(code, str) and _NUMERIC.fullmatch(code)):
            _refuse(f"numpy.dtype({code!r}) (a numpy value in a weights file is a number; an object dtype "
                    "holds pointers)")
        self = super().__new__(cls)
        self.dtype = np.dtype(code)
        return self

    def __setstate__(self, state):
        if not (isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4)
                and state[1] in ("<", ">", "|", "=") and state[2:8] == (None, None, None, -1, -1, 0)
                and state[8:] in ((), (None,))):
            _refuse(f"numpy.dtype's state {str(state)[:80]} (a number's dtype has a byte order and nothing else)")
        if state[1] in "<>":
            self.dtype = self.dtype.newbyteorder(state[1])


class _Array:
    """numpy.ndarray as a weights-only load sees it: never called (np.ndarray(shape, dtype,
    buffer) lays an array over any bytes, an object array over pointers). An array is
    rebuilt only as numpy pickles one, by _reconstruct and then its state: numbers of a
    _Dtype, from exactly as many bytes of the file as they take."""

    def __new__(cls, *args, **kwargs):
        if args or kwargs:
            _refuse("numpy.ndarray(...) (an array over bytes or pointers the file chooses)")
        return super().__new__(cls)

    def __setstate__(self, state):
        version, shape, dtype, fortran, data = state if isinstance(state, tuple) and len(state) == 5 else (None,) * 5
        ok = (version == 1 and isinstance(shape, tuple) and len(shape) <= 32
              and all(type(n) is int and n >= 0 for n in shape) and isinstance(dtype, _Dtype)
              and type(fortran) is bool and isinstance(data, bytes))
        if not ok or len(data) != math.prod(shape) * dtype.dtype.itemsize:
            nbytes = len(data) if isinstance(data, bytes) else type(data).__name__
            _refuse(f"numpy.ndarray's state (shape {str(shape)[:40]}, {nbytes} bytes; an array's numbers are its "
                    "bytes, as many as its shape takes)")
        self.array = np.frombuffer(data, dtype.dtype).reshape(shape, order="F" if fortran else "C").copy()


def _reconstruct(cls=None, shape=None, typecode=None):
    """numpy's _reconstruct as numpy pickles call it: an empty array its state then fills."""
    if cls is not _Array or shape != (0,) or typecode != b"b":
        _refuse(f"numpy's multiarray._reconstruct({str(shape)[:40]}, {str(typecode)[:20]}) (numpy pickles an "
                "array as an empty one and its bytes)")
    return _Array()


def _scalar(dtype=None, data=None):
    """numpy's scalar(dtype, bytes): a number of a _Dtype from exactly its bytes."""
    if not (isinstance(dtype, _Dtype) and isinstance(data, bytes) and len(data) == dtype.dtype.itemsize):
        _refuse(f"numpy's multiarray.scalar({str(data)[:40]}) (a numpy number is its dtype and its bytes)")
    return np.frombuffer(data, dtype.dtype)[0]


def _numpy_globals() -> list:
    """The stand-ins, under the names a checkpoint of this project written before its RNG
    state and learning rates were stored as tensors and plain values asks numpy for: an
    ndarray of uint32 (numpy's RNG key) and float64 scalars (the schedules' learning rate
    and weight decay). numpy 2 pickles its functions as numpy._core.multiarray.*, numpy 1
    as numpy.core.multiarray.*: both names."""
    return [(_Dtype, "numpy.dtype"), (_Array, "numpy.ndarray"),
            *((f, f"numpy.{core}.multiarray.{name}") for f, name in ((_reconstruct, "_reconstruct"),
                                                                      (_scalar, "scalar"))
              for core in ("_core", "core"))]


# The classes and functions beyond torch's own that a weights-only load may call: none runs
# code of the file's choosing or makes anything but numbers.
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
    `path` is first renamed to it (after the new file is complete on disk). A symbolic link
    at `path` or `previous` is refused in one line (core/files.py): the rename would replace
    it, but a link where a command writes is someone else's doing, named before any write.

    A write the file system refuses (a full disk, a quota, a read-only mount) removes the
    temp file and becomes a RunFailed naming `what`, the path and the cause, then `then`
    (what to do): the file there before is untouched."""
    path = Path(path)
    refuse_link(path)
    if previous is not None:
        refuse_link(previous)
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


def _regular_size(path: Path) -> int:
    """The size of `path`, a regular file (links followed: the user may name weights by
    one); one line for anything else, before it is opened (a FIFO would block the open)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "folder" if stat.S_ISDIR(st.st_mode) else "FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "socket or other special file"
        raise UserError(f"{path} is a {kind}, not a file: weights are read from a regular file ({NOT_A_CHECKPOINT})")
    return st.st_size


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
    _regular_size(path)
    return path


def load_checkpoint(spec: str | os.PathLike, map_location="cpu") -> dict:
    """Load any checkpoint file (ours, DINO's, DeiT's, timm's, a bare state_dict, a
    .safetensors file) without running code of its own; within `trusting`, one that asks for
    more than SAFE_GLOBALS as torch.load(weights_only=False) does. A project checkpoint's
    `config` comes back as plain data (core/plain_config.py)."""
    path = resolve_checkpoint_path(spec)
    obj = read_file(path, map_location, _trusted.get())
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not a checkpoint ({NOT_A_CHECKPOINT})")
    if obj.get("format") == FORMAT and "config" in obj:
        obj["config"] = plain_config(obj["config"], str(path))
    return obj


def run_config(checkpoint: dict) -> dict | None:
    """The config a project checkpoint (load_checkpoint's) holds, as plain data; None for
    any other file (whatever its `config` holds is not ours to read)."""
    config = checkpoint.get("config") if checkpoint.get("format") == FORMAT else None
    return config if isinstance(config, dict) else None


def read_file(path: str | os.PathLike, map_location="cpu", trust: bool = False):
    """What the file holds: a .safetensors file's tensors, or what torch.save pickled,
    memory-mapped where torch can (its zip format), read weights-only unless `trust`,
    within the bounds the module's docstring lists. A file that asks for more is an
    UnsafeFile naming what; one that cannot be read or breaks a bound, a UserError."""
    path = Path(path)
    size = _regular_size(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if _is_safetensors(head, size):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(path, device=str(map_location))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{path} is not a checkpoint: safetensors cannot read it ({e})") from None
    zipped = head.startswith(b"PK\x03\x04")   # torch's zip format: mapped, read as tensors are used
    pickled = _pickle_of(path, size, zipped) if zipped or not trust else b""
    if not trust:
        _check_pickle(path, size, pickled, zipped)
    token = _refused_numpy.set(None)
    try:
        if trust:
            return torch.load(path, map_location=map_location, weights_only=False, mmap=zipped)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            obj = torch.load(path, map_location=map_location, weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        asks = None if trust else _refused_numpy.get() or _refused_globals(e)
        if asks:
            raise UnsafeFile(_unsafe(path, [asks] if isinstance(asks, str) else asks)) from None
        raise UserError(f"{path} is not a checkpoint: torch cannot read it ({NOT_A_CHECKPOINT})") from None
    except Exception:  # noqa: BLE001 - a text file, random bytes, a file cut short
        raise UserError(f"{path} is not a checkpoint: torch cannot read it ({NOT_A_CHECKPOINT})") from None
    finally:
        _refused_numpy.reset(token)
    return _settled(obj, path, size)


def _unsafe(path: Path, asks: list[str]) -> str:
    return (f"{path} is not a file of weights only: loading it would call {', '.join(asks)} (a .pth file is a "
            "pickle, which can run code as it loads), so it was not loaded; if you trust where it came from, "
            f"pass {TRUST_KEY}=true to load it as torch.load(weights_only=False) does")


def _is_safetensors(head: bytes, size: int) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then the JSON header."""
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 8 + int.from_bytes(head[:8], "little") <= size


def _bound(size: int) -> int:
    return ALLOC_FACTOR * size + ALLOC_SLACK


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


def _too_much(path: Path, what: str, claimed: int, size: int) -> UserError:
    return UserError(f"{path} is not a checkpoint: {what} {_mb(claimed)} from a file of {_mb(size)}, more than the "
                     f"{ALLOC_FACTOR}x its size plus {_mb(ALLOC_SLACK)} a weights file is read into (its tensors "
                     "are its bytes); it was not loaded")


def _pickle_of(path: Path, size: int, zipped: bool) -> bytes:
    """The pickle torch would read: a zip's data.pkl record (in the folder of its first
    record, the name matched as torch's reader matches it, regardless of case), once its
    records are known to inflate to no more than the bound; else the file's first PICKLE_MAX
    bytes (torch's older format: pickles, then the tensors' bytes)."""
    if not zipped:
        with open(path, "rb") as f:
            return f.read(PICKLE_MAX)
    try:
        with zipfile.ZipFile(path) as z:
            records = z.infolist()
            total = sum(r.file_size for r in records)
            if total > _bound(size):
                raise _too_much(path, "its zip records inflate to", total, size)
            name = f"{records[0].filename.split('/')[0]}/data.pkl".lower() if records else ""
            pickles = [r for r in records if r.filename.lower() == name]
            if len(pickles) > 1:   # which one torch reads is not for the file to play with
                raise UserError(f"{path} is not a checkpoint: it holds {len(pickles)} records named {name}")
            if not pickles:
                return b""   # torch finds none either, and says so
            data = pickles[0]
            if data.file_size > PICKLE_MAX:
                raise UserError(f"{path} is not a checkpoint: its pickle is {_mb(data.file_size)}, more than the "
                                f"{_mb(PICKLE_MAX)} a weights file's names and shapes take")
            return z.read(data)
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError):
        return b""   # torch names what is wrong with it


def _allowed() -> set[str]:
    """The globals a weights-only load of torch's may name, SAFE_GLOBALS with them."""
    own = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    return set(torch._weights_only_unpickler._get_allowed_globals()) | own


def _allocates(name: str) -> int:
    """Bytes an element of what `name` makes with an int argument takes (0: nothing of a
    size its argument sets): bytearray, torch's storage and tensor classes."""
    if name == "builtins.bytearray":
        return 1
    obj = torch._weights_only_unpickler._get_allowed_globals().get(name)
    return 16 if isinstance(obj, type) and (issubclass(obj, torch.Tensor) or obj in torch._tensor_classes
                                            or "Storage" in obj.__name__) else 0


def _check_pickle(path: Path, size: int, data: bytes, zipped: bool) -> None:
    """Refuse, before torch reads it, a pickle that names a global a weights-only load may
    not call (UnsafeFile, naming all of them), or that calls for more memory than the bound."""
    found = pickle_scan.scan(data, pickles=1 if zipped else 5)
    allowed = _allowed()
    asks = [name for name in found.names if name not in allowed]
    if asks:
        raise UnsafeFile(_unsafe(path, asks))
    claimed = 0
    for name, args in found.calls:
        per = _allocates(name)
        if per and args and all(type(a) is int for a in args):
            claimed += per * math.prod(max(a, 0) for a in args)
    if claimed > _bound(size):
        raise _too_much(path, "its pickle asks for", claimed, size)


# How torch's weights-only unpickler names what it refused, in the messages of the versions
# this project runs on: a global it does not allow (or whose module it blocks), an allowed
# class it may not build, a function it may not call.
_REFUSED = (re.compile(r"GLOBAL (\S+) (?:was not|whose module)"), re.compile(r"but got <class '([^']+)'>"),
            re.compile(r"unrecognized function (\S+)"))


def _refused_globals(error: Exception) -> list[str]:
    """What torch's message says it refused, when the scan before it found nothing to
    refuse ([] when the error was another: a damaged pickle)."""
    for pattern in _REFUSED:
        found = pattern.findall(str(error))[:1]
        if found:
            return found
    return []


def _settled(obj, path: Path, size: int):
    """What a weights-only load read, the numpy stand-ins made numpy's values: refused when
    it nests deeper than MAX_NESTING or its tensors span more than the bound."""
    spanned = [0]
    seen: set[int] = set()

    def walk(x, depth: int):
        if depth > MAX_NESTING:
            raise UserError(f"{path} is not a checkpoint: what it holds is nested more than {MAX_NESTING} levels "
                            "deep (a state dict is two)")
        if isinstance(x, torch.Tensor | torch.UntypedStorage | torch.TypedStorage | bytearray):
            if id(x) not in seen:
                seen.add(id(x))
                spanned[0] += x.numel() * x.element_size() if isinstance(x, torch.Tensor) else \
                    x.nbytes() if not isinstance(x, bytearray) else len(x)
            return x
        if isinstance(x, _Array):
            if not hasattr(x, "array"):
                raise UserError(f"{path} is not a checkpoint: it holds a numpy array without its numbers")
            return x.array
        if isinstance(x, _Dtype):
            return x.dtype
        if isinstance(x, argparse.Namespace):
            for k, v in vars(x).items():
                setattr(x, k, walk(v, depth + 1))
            return x
        if isinstance(x, dict):
            changed = {k: new for k, v in x.items() if (new := walk(v, depth + 1)) is not v}
            if changed:
                x.update(changed)
            return x
        if isinstance(x, (list, tuple, set, frozenset)):
            items = [walk(v, depth + 1) for v in x]
            if all(a is b for a, b in zip(items, x)):
                return x
            if isinstance(x, list):
                x[:] = items
                return x
            return type(x)(items)
        return x

    obj = walk(obj, 0)
    if spanned[0] > _bound(size):
        raise _too_much(path, "its tensors span", spanned[0], size)
    return obj


def saved_config(checkpoint: str | os.PathLike) -> dict | None:
    """The config a project checkpoint or run dir was trained with, if any, as plain data
    (core/plain_config.py)."""
    path = Path(checkpoint).expanduser()
    if path.is_dir() and (path / "config.yaml").exists():
        return read_config_yaml(path / "config.yaml")
    return run_config(load_checkpoint(path))


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
