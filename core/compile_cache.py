"""Compilation paid once: what torch.compile made, saved after the first iterations and
loaded by the next start (a resume, a requeued job, another run of the same settings).

PyTorch keeps its compiled graphs in on-disk caches of its own (Inductor's FX graphs, with
their Triton kernels bundled on a GPU; AOTAutograd's forward and backward; any autotuning)
and can hand them over as one byte string: `torch.compiler.save_cache_artifacts()`, and
`load_cache_artifacts(bytes)` to put them back into a process's caches before it compiles
("Mega-Cache"). A start that loads them still traces its graphs with Dynamo, then finds each
compiled graph instead of lowering it and generating and building its kernels. (On a CPU the
C++ kernels are not bundled: they are built again from the cached code.)

Where: `compile_cache_dir`, else <run dir>/compile_cache/, so a resumed or requeued run reads
its own; runs that name one folder share it. Nothing else is read: not the weights a run
starts from (dino.init, checkpoint=), and a checkpoint holds no compile artifacts.

Which: the folder keeps one cache per key (`cache_key`: the device, torch, Triton, Python,
and every setting that shapes the compiled graphs), as <id>.bin (torch's bytes) and <id>.json
(the key, the bytes' sha256, what they hold and the user's signature), <id> a hash of the key.
A folder with caches of other keys only, or a cache that does not match its record (cut
short, damaged), is one line and a start that compiles as it would without a cache, then
saves its own. Among the caches this user saved, torch's own keys (the graph, its inputs,
Inductor's settings and version, the device) decide whether a loaded graph is used; this key
picks the file to read, and names why none fits.

Whose: a compile cache is code (torch unpickles its entries and runs their kernels), so only
a cache signed with the user's own secret, in files and a folder no one else can write, and
whose artifacts' keys all name files inside torch's caches, is handed to torch: anything
else is one line and a start that compiles afresh (core/cache_trust.py says how and why).

When: after the run's first log line (its step has compiled every graph by then), and after
a later log line only when torch recorded new compilations since (dino.init's head warm-up
compiles its frozen-backbone graphs first, the others when it ends): a flag read otherwise,
no I/O. Rank 0 writes (a temp file renamed into place: core.checkpoint.atomic_write); every
process of rank 0's key loads, since each fills its own on-disk caches; a process whose key
is not rank 0's (another kind of GPU) says so and compiles without a cache.

Never fatal: a save or load that fails in any way (torch raising, an unwritable folder, a
full disk, a damaged file) is one `warning:` line and the run goes on, uncached.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import stat
from pathlib import Path

import torch
from omegaconf import OmegaConf

from resmlp.core import dist
from resmlp.core.cache_trust import (SECRET_FIX, Refused, SecretRefused, artifact_keys, exposed, path_like,
                                     read_own, signature, signed_with, user_secret)
from resmlp.core.checkpoint import atomic_write
from resmlp.core.dist import cpu_model
from resmlp.core.errors import RunFailed

FOLDER_NAME = "compile_cache"   # in the run dir, where compile_cache_dir is null


def compiled_how(*nets) -> str | None:
    """How `nets` were compiled: "whole" (a network compiled as one: torch.compile of it, an
    OptimizedModule holding it as _orig_mod, or its nn.Module.compile), "regional" (modules
    inside it compiled in place, as core/compiling.py does), or None (nothing compiled).
    DDP's wrapper is looked through."""
    roots = [getattr(n, "module", n) for n in nets]
    if any(hasattr(n, "_orig_mod") or _compiled(n) for n in (*nets, *roots)):
        return "whole"
    if any(_compiled(m) for n in roots for m in n.modules()):
        return "regional"
    return None


def _compiled(module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


# The DINO keys that shape the compiled head and loss (compile by region compiles both)
HEAD_KEYS = ("out_dim", "hidden_dim", "bottleneck_dim", "bottleneck_norm", "norm_last_layer", "head_precision",
             "centering", "koleo_weight")


def cache_key(cfg, device: torch.device, precision: str, batch_per_process: int, world_size: int,
              compiled: str, graphs: bool, crops: str | None = None) -> dict:
    """What a cache is for: the machine and software that compiled it, and every setting the
    compiled graphs depend on (the network as built, the crops it sees, the batch per process,
    the precision, how it was compiled, CUDA graphs, the process count: a whole network under
    DDP is split at its gradient buckets). `crops`: the DINO crop plan's label (2x224+8x96);
    None where the command has one input size (model.img_size)."""
    return {"device": device_model(device), "torch": torch.__version__, "triton": _triton_version(),
            "python": platform.python_version(), "command": str(cfg.command),
            "model": OmegaConf.to_container(cfg.model, resolve=True), "crops": crops,
            "augment": OmegaConf.select(cfg, "dino.augment", default=None),
            "head": {k: OmegaConf.select(cfg, f"dino.{k}", default=None) for k in HEAD_KEYS},
            "batch_per_process": int(batch_per_process), "processes": int(world_size), "precision": precision,
            "compile": compiled, "graphs": bool(graphs)}


def device_model(device: torch.device) -> str:
    """The GPU's name, or "cpu: " and the CPU's model (Inductor's C++ targets its instruction set)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model()}"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None)


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_folder(cfg, run_dir) -> Path:
    """compile_cache_dir, else <run dir>/compile_cache."""
    named = cfg.get("compile_cache_dir")
    return Path(named).expanduser() if named else Path(run_dir) / FOLDER_NAME


def differences(theirs: dict, ours: dict) -> list[str]:
    """'field: theirs -> ours' for every field of two keys that differs, nested ones dotted."""
    from resmlp.core.run_folder import config_differences
    return config_differences(theirs, ours, keys=sorted(set(theirs) | set(ours)), skip=())


def _first_of(diffs: list[str]) -> str:
    """The first of a key's differences, and how many more."""
    return diffs[0] + (f" and {len(diffs) - 1} more" if len(diffs) > 1 else "")


def _held(info) -> set:
    """The (kind, key) of every artifact a torch CacheInfo lists."""
    return {(kind, k) for kind, keys in info.artifacts.items() for k in keys}


def _counts(info) -> dict:
    return {kind: len(keys) for kind, keys in sorted(info.artifacts.items()) if keys}


def _one_batch_per_kind(data: bytes) -> bytes:
    """torch's bytes with each kind of artifact in one batch. Every save_cache_artifacts call
    appends a batch per kind to what the process serialized before, and load_cache_artifacts
    keeps only the last batch of each kind (it makes a dict of them): a second save (after
    dino.init's warm-up) would load without what the first held. The artifacts as they are
    where this torch lacks the helpers (its format may differ too)."""
    try:
        from torch.compiler._cache import _deserialize_single_cache, _serialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer
    except ImportError:
        return data
    merged: dict = {}
    try:
        for kind, artifacts in AppendingByteSerializer.to_list(data, deserialize_fn=_deserialize_single_cache):
            merged.setdefault(kind, []).extend(artifacts)
        out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
        out.extend(merged.items())
        return out.to_bytes()
    except Exception:  # a torch whose helpers changed shape: its own bytes, as torch made them
        return data


@contextlib.contextmanager
def _torch_warnings_off(name: str):
    log = logging.getLogger(name)
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


def _new_compilations() -> bool:
    """Whether torch recorded cache artifacts since the last save_cache_artifacts (hits on
    loaded ones too); True where this torch does not say."""
    try:
        from torch.compiler._cache import CacheArtifactManager
        return bool(CacheArtifactManager.need_serialize())
    except (ImportError, AttributeError):
        return True


NOT_YOURS = "compile cache: not written by you on this account: ignored, compiling afresh"
RECORD_LIMIT = 2**20   # a record holds a key and a few numbers


class CompileCache:
    """One key's cache in `folder`: `load()` before the first compilation, `save()` after the
    log lines (see the module's docstring). `say` prints a line (the run's rank 0 print);
    `writer`: this process saves (rank 0). Neither ever ends the run: a cache that cannot be
    trusted, read or written is one line, and the run compiles as it would without one."""

    def __init__(self, folder, key: dict, say=print, writer: bool = True):
        self.folder, self.key, self.say, self.writer = Path(folder), key, say, writer
        self.id = key_id(key)
        self.bin, self.record = self.folder / f"{self.id}.bin", self.folder / f"{self.id}.json"
        self.held: set = set()      # the artifacts the file holds (loaded, or saved by this process)
        self.loaded: dict = {}      # what load() put into torch's caches: {kind: count}

    def load(self) -> dict:
        """Put this key's cache into torch's caches, if this user signed it; one line says
        what happened. Returns {kind of artifact: count} loaded (empty: none)."""
        try:
            return self._load()
        except Exception as e:  # a folder that cannot be looked at (a parent that is a file, no access)
            self.say(f"warning: compile cache: {self.folder} cannot be read ({_cause(e)}): compiling afresh")
            return {}

    def _load(self) -> dict:
        refused = self._folder_refused()
        if refused:
            self.say(refused)
            self.writer = False
            return {}
        if not os.path.lexists(self.record):
            self.say(self._none_here())
            return {}
        try:
            data = self._verified()
        except _NotYours:
            self.say(NOT_YOURS)
            return {}
        except SecretRefused as e:
            self.say(f"compile cache: {e}: nothing loaded or saved, compiling afresh; {SECRET_FIX}")
            self.writer = False
            return {}
        except Refused as e:
            self.say(f"compile cache: {e}: refused (a compile cache is code), compiling afresh; this run saves its "
                     "own in its place")
            return {}
        except Exception as e:  # whatever a damaged cache raises: one line, never the run's end
            self.say(f"warning: compile cache: {self.record} is unreadable or damaged ({_cause(e)}): ignored; "
                     "the first iteration compiles and replaces it")
            return {}
        try:
            with _torch_warnings_off("torch.compiler._cache"):  # its traceback of bytes it cannot read: our line says it
                info = torch.compiler.load_cache_artifacts(data)
            if info is None:
                raise ValueError("torch could not read its artifacts")
        except Exception as e:
            self.say(f"warning: compile cache: torch could not load {self.bin} ({_cause(e)}): ignored; the first "
                     "iteration compiles and replaces it")
            return {}
        self.held, self.loaded = _held(info), _counts(info)
        self.say(f"compile cache: loaded {sum(self.loaded.values())} compiled artifacts "
                 f"({', '.join(f'{k} {n}' for k, n in self.loaded.items())}) from {self.bin}")
        return self.loaded

    def _verified(self) -> bytes:
        """The cache's bytes, where this user signed them and every key names a file inside
        torch's caches: _NotYours (no secret, no signature, another's), Refused (a link,
        another's file, a path-like key) or another error (damage) otherwise."""
        record = json.loads(read_own(self.record, RECORD_LIMIT))
        if not isinstance(record, dict) or record.get("key") != self.key:
            raise ValueError("its key is not this run's")
        secret = user_secret(create=False)
        if secret is None or not signed_with(secret, record):
            raise _NotYours
        size = record.get("bytes")
        data = read_own(self.bin, size if isinstance(size, int) and size >= 0 else 0)
        if len(data) != size or hashlib.sha256(data).hexdigest() != record.get("sha256"):
            raise ValueError(f"{self.bin.name} holds {len(data)} bytes, not the {size} it was saved with, or other ones")
        _check_keys(data, self.bin)
        return data

    def _folder_refused(self, make: bool = False) -> str | None:
        """The line for a cache folder this user cannot trust (or None): a file, another's
        folder, one others can write to. `make`: create it first, writable by the user alone."""
        if make:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
        try:
            st = os.stat(self.folder)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return (f"compile cache: {self.folder} is not a folder: nothing read or saved there; "
                    "set compile_cache_dir to a folder")
        why = exposed(st, folder=True)
        return why and (f"compile cache: {self.folder} {why}: nothing read or saved there, compiling afresh; a compile "
                        "cache is code: set compile_cache_dir to a folder of yours that only you can write to")

    def _none_here(self) -> str:
        """The line for a folder without this key's cache: the nearest other key's differences,
        or that there is none yet."""
        others = []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else ():
            try:
                theirs = json.loads(read_own(path, RECORD_LIMIT)).get("key")
            except (OSError, ValueError, AttributeError, Refused):
                continue
            if isinstance(theirs, dict):
                others.append(differences(theirs, self.key))
        if not others:
            return f"compile cache: none in {self.folder} yet; the first iteration compiles, then saves it there"
        return (f"compile cache: {self.folder} holds caches for other settings only (the nearest: "
                f"{_first_of(min(others, key=len))}): "
                "ignored; the first iteration compiles, then saves one for these beside them")

    def save(self) -> bool:
        """Write what torch compiled, signed, where it holds artifacts the file does not
        (rank 0). Any failure (torch's, the disk's, the secret's) is one warning and no later
        save: the run goes on, and its next start compiles again. Returns whether it wrote."""
        if not self.writer or not _new_compilations():
            return False
        try:
            return self._save()
        except Exception as e:
            self.writer = False
            if isinstance(e, RunFailed):   # atomic_write's line: the file, the cause, what to do
                self.say(f"warning: {e} (the run goes on; its next start compiles again)")
            elif isinstance(e, Refused):
                fix = f"; {SECRET_FIX}" if isinstance(e, SecretRefused) else ""
                self.say(f"warning: compile cache: not saved: {e}{fix} (the run goes on; its next start compiles again)")
            else:
                self.say(f"warning: compile cache: not saved ({_cause(e)}): the run goes on; its next start "
                         "compiles again")
            return False

    def _save(self) -> bool:
        out = torch.compiler.save_cache_artifacts()
        if out is None:
            return False
        data, info = out
        held = _held(info)
        if held <= self.held:
            return False
        refused = self._folder_refused(make=True)
        if refused:
            self.say(refused)
            self.writer = False
            return False
        data = _one_batch_per_kind(data)
        _check_keys(data, "torch's new artifacts")   # what a later start would refuse is not saved
        digest = hashlib.sha256(data).hexdigest()
        record = {"key": self.key, "bytes": len(data), "sha256": digest, "artifacts": _counts(info),
                  "signature": signature(user_secret(create=True), self.key, digest)}
        then = "free some space or set compile_cache_dir to another folder"
        # the bytes first: a record names only bytes that are complete on disk. The folder is
        # this user's own (checked above): a link in a file's place goes, its target untouched,
        # and each file is a new one renamed over the old (atomic_write refuses links)
        for path in (self.bin, self.record):
            if path.is_symlink():
                path.unlink()
        with atomic_write(self.bin, what="the compile cache", then=then) as f:
            f.write(data)
        with atomic_write(self.record, "w", what="the compile cache's record", then=then) as f:
            json.dump(record, f, indent=1)
        self.held = held
        self.say(f"compile cache: saved {len(held)} compiled artifacts ({len(data) / 2**20:.1f} MiB) to {self.bin}")
        return True


class _NotYours(Exception):
    """A cache this user's secret did not sign."""


def _check_keys(data: bytes, where) -> None:
    """Refused where an artifact's key could name a file outside torch's caches."""
    for kind, key in artifact_keys(data):
        if path_like(kind, key):
            raise Refused(f"{where} holds an artifact whose key is a path ({kind}: {key!r})")


def _cause(e: BaseException) -> str:
    """An error's first line, with its type where its text alone would not say what it is."""
    text = getattr(e, "strerror", None) or next(iter(str(e).strip().splitlines()), "")
    if isinstance(e, (OSError, ValueError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class _Off:
    """The cache of a run that compiles nothing."""
    loaded: dict = {}

    def save(self) -> bool:
        return False


def open_compile_cache(cfg, run, nets, graphs: bool = False, crops: str | None = None):
    """The trainers' hook, after the step is built and before its first iteration: the
    cache of this run's key, loaded (a CompileCache), or one that does nothing where `nets`
    (the trained networks) are not compiled. `run`: the core.run.Run. Every process calls it
    (a sync point: rank 0's key goes to the others)."""
    compiled = compiled_how(*nets)
    if compiled is None:
        return _Off()
    precision = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[run.amp_dtype]
    key = cache_key(cfg, run.device, precision, run.batch_per_rank, run.world_size, compiled, graphs, crops)
    cache = CompileCache(cache_folder(cfg, run.dir), key, say=run.print, writer=run.is_main)
    leader = dist.broadcast_object(key)   # rank 0's: the only key anyone saves
    if key_id(leader) != cache.id:   # a process on another kind of GPU (or CPU) than rank 0's
        print(f"rank {run.rank}: compile cache: this process's key is not rank 0's "
              f"({_first_of(differences(leader, key))}), and rank 0 "
              "alone saves: this process compiles without a cache", flush=True)
        return cache
    cache.load()
    return cache
