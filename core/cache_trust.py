"""Why a compile cache is loaded only where its user wrote it (core/compile_cache.py).

A compile cache is code: loading one unpickles torch's compiled graphs, runs their kernels,
and writes files into torch's cache folders at paths the artifacts' keys name. So a run
loads only a cache that the same user saved, on this machine or on another one that sees
the same secret (a requeued job on another node of a cluster), and checks it before
torch sees a byte:

- The user's secret: 32 random bytes, in hex, in a file only that user can read:
  $RESMLP_CACHE_SECRET names it (for a cluster whose home folder the nodes do not share),
  else <$XDG_CACHE_HOME, or ~/.cache>/resmlp/compile_cache.secret. The first save makes it,
  mode 0600, complete in a temp file that is then hard-linked to its name: of two processes
  making it at once, the second link fails and both read the first's. A link, a file of
  another owner, or one others may read or write is refused: whoever can read it can sign.
- The signature: HMAC-SHA256 under that secret of the cache's key and its bytes' sha256,
  kept in the record (<id>.json). A cache without one that verifies is not loaded.
- The files: the folder (a link to a folder is followed: it may point at scratch space)
  must be the user's and writable by no one else, since whoever can write to it can swap
  files; the record and the bytes are opened without following links and must be the
  user's regular files, writable by no one else.
- The artifacts' keys, read from torch's index without building any artifact: each must
  name a file inside torch's cache folders: not absolute, no `..`, no path separator.
  Autotune's keys are torch's two-part `<kernel folder>/<name>.best_config`: one `/`,
  each part held to the same rule.
"""
from __future__ import annotations

import base64
import binascii
import errno
import functools
import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
import time
from pathlib import Path

SECRET_ENV = "RESMLP_CACHE_SECRET"
SECRET_NAME = "compile_cache.secret"
_SECRET_BYTES = 32
_TWO_PART_KINDS = ("autotune",)   # torch's AutotuneCacheArtifact keys: <kernel folder>/<name>
_FORMAT = 1                       # the version of torch's AppendingByteSerializer layout read here


class Refused(Exception):
    """A file, folder or artifact the cache does not trust: the message says which and why."""


class SecretRefused(Refused):
    """A secret file that others could read or replace: nothing is loaded or signed with it."""


SECRET_FIX = f"make it yours alone (chmod 600), remove it to get a new one, or name another file in {SECRET_ENV}"


def secret_path() -> Path:
    named = os.environ.get(SECRET_ENV)
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "resmlp" / SECRET_NAME


def user_secret(create: bool) -> bytes | None:
    """The user's secret; None where there is none yet and `create` is false (nothing this
    user saved can then be found). Refused: a secret file others could read or replace."""
    path = secret_path()
    for _ in range(40):   # a secret another process is writing (no hard links there): a moment
        try:
            found = _read_secret(path)
        except FileNotFoundError:
            if not create:
                return None
            try:
                _make_secret(path)
            except OSError as e:   # a read-only home folder, say: the fix is another file
                raise SecretRefused(f"the secret {path} cannot be made ({e.strerror or e})") from None
            continue
        if found is not None:
            return found
        time.sleep(0.05)
    raise _no_secret(path)


def _read_secret(path: Path) -> bytes | None:
    """The secret in `path`, or None while it is still being written."""
    try:
        text = _read_checked(path, 4 * _SECRET_BYTES, functools.partial(exposed, private=True),
                             lambda why: SecretRefused(f"the secret {why}"))
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise SecretRefused(f"the secret {path} cannot be read ({e.strerror or e})") from None
    text = text.strip()
    if len(text) < 2 * _SECRET_BYTES:
        return None
    try:
        return bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise _no_secret(path) from None


def _no_secret(path: Path) -> SecretRefused:
    return SecretRefused(f"the secret {path} holds no secret (it should hold {2 * _SECRET_BYTES} hex digits)")


def _make_secret(path: Path) -> None:
    """A new secret at `path`, unless another process makes one first (then theirs stays)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = (secrets.token_hex(_SECRET_BYTES) + "\n").encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")   # mode 0600
    try:
        _write_synced(fd, text)
        try:
            os.link(tmp, path)   # whole or absent: never overwrites another's
        except FileExistsError:
            pass
        except OSError:   # a file system without hard links: created exclusively, then filled
            try:
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                return
            _write_synced(out, text)
    finally:
        os.unlink(tmp)


def _write_synced(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def exposed(st: os.stat_result, folder: bool = False, private: bool = False) -> str | None:
    """Why a cache file (or `folder`) with this stat is not the user's alone to write (a
    `private` one: to read or write), or None."""
    if folder and not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if not folder and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & (0o077 if private else 0o022):
        return f"is {'readable or writable' if private else 'writable'} by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def read_own(path: Path, limit: int) -> bytes:
    """A cache file's bytes, opened without following a link: the user's own regular file,
    writable by no one else (Refused otherwise), of at most `limit` bytes (ValueError)."""
    data = _read_checked(path, limit + 1, exposed, Refused)
    if len(data) > limit:
        raise ValueError(f"{path.name} holds more than the {limit} bytes expected")
    return data


def _read_checked(path: Path, limit: int, judge, refusal) -> bytes:
    """Up to `limit` bytes of `path`, opened without following a link or waiting on a pipe,
    where `judge` finds nothing wrong in its stat: `refusal(why)` otherwise. OSError where
    it cannot be read (FileNotFoundError: absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno != errno.ELOOP:   # O_NOFOLLOW's answer to a link
            raise
        raise refusal(f"{path} is a link") from None
    with os.fdopen(fd, "rb") as f:
        why = judge(os.fstat(f.fileno()))
        if why:
            raise refusal(f"{path} {why}")
        return f.read(limit)


def signature(secret: bytes, key, sha256) -> str:
    """HMAC-SHA256 under `secret` of a cache's key and the sha256 of its bytes."""
    message = json.dumps({"key": key, "sha256": sha256}, sort_keys=True).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def signed_with(secret: bytes, record: dict) -> bool:
    """Whether `record` (a cache's <id>.json) carries the signature `secret` gives its key
    and sha256."""
    theirs = record.get("signature")
    return isinstance(theirs, str) and hmac.compare_digest(
        theirs, signature(secret, record.get("key"), record.get("sha256")))


class _Reader:
    """Bounded reads of torch's length-prefixed layout: a cut or inflated length is a ValueError."""

    def __init__(self, data: bytes, start: int):
        self.data, self.pos = memoryview(data), start

    def left(self) -> int:
        return len(self.data) - self.pos

    def u64(self) -> int:
        return int.from_bytes(self.chunk(8), "big")

    def chunk(self, size: int) -> bytes:
        if size > self.left():
            raise ValueError("torch's artifacts are cut short")
        self.pos += size
        return bytes(self.data[self.pos - size:self.pos])

    def text(self) -> str:
        try:
            return base64.b64decode(self.chunk(self.u64()), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise ValueError("a name in torch's artifacts is not text") from None


def artifact_keys(data: bytes) -> list[tuple[str, str]]:
    """(kind, key) of every artifact in torch's bytes, read from their index without making
    or loading any artifact. The layout is torch.utils._appending_byte_serializer's (a
    checksum, a version, then per kind its name and count, and per artifact its key and its
    content, each prefixed by its length) as torch.compiler._cache writes it."""
    reader = _Reader(data, start=4)   # after the checksum: the signature covers the bytes
    version = reader.u64()
    if version != _FORMAT:
        raise ValueError(f"torch's artifacts are in format {version}, not the {_FORMAT} read here")
    found = []
    while reader.left():
        kind, count = reader.text(), reader.u64()
        if count > reader.left() // 16:   # each artifact holds two lengths at least
            raise ValueError("torch's artifacts are cut short")
        for _ in range(count):
            key = reader.text()
            reader.chunk(reader.u64())   # its content: not read here
            found.append((kind, key))
    return found


def path_like(kind: str, key: str) -> bool:
    """Whether an artifact's key could name a file outside torch's cache folder."""
    parts = key.split("/", 1) if kind in _TWO_PART_KINDS else [key]
    return any(p in ("", ".") or ".." in p or "/" in p or "\\" in p or "\0" in p or os.path.isabs(p)
               for p in parts)
