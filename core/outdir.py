"""The folder a command writes into, checked before any work (core/cli.py check_writes):
what may be there, where it may not be, and paths the file system cannot take.

`out=` may name a new folder, an empty one, or one this project wrote: it holds a record
that only this project writes there (`own_record`: a run's config.yaml, checkpoint or
lock, a command's report, an export's card), or run dirs that do (compare's folder). Any
other folder is refused, naming what it holds, unless the user passes `out_ok=true`: a
run would replace its config.yaml and results.json and append to its log.jsonl. No
output goes inside `data.root` (an image folder would read the run dir as a class, and
every later command on the data set with it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from resmlp.core.errors import UserError
from resmlp.core.files import RECORD_MAX_BYTES  # past it a file is not a record of ours (not read whole to find out)
# How many entries of a folder are looked at for a record (a data set's millions are not).
SCAN_ENTRIES = 1000
# Where data sets' files are (dino's eval.root: its k-NN's labeled set): no output goes inside.
DATA_ROOTS = ("data.root", "eval.root")


def shown(path, width: int = 80) -> str:
    """A path cut in the middle to fit one line of a message."""
    text = str(path)
    return text if len(text) <= width else f"{text[:width // 2 - 2]}...{text[-(width // 2 - 1):]}"


def length_problem(path) -> str | None:
    """Why the file system cannot take `path` (a name longer than its NAME_MAX bytes, the
    whole longer than PATH_MAX), else None; asked before any call that would fail on it."""
    full = os.path.abspath(os.path.expanduser(str(path)))
    existing = full
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:  # exists() is False on any OSError
        existing = os.path.dirname(existing)
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in Path(full).parts:
        if len(os.fsencode(part)) > name_max:
            return (f"the name {shown(part, 40)} in it is {len(os.fsencode(part))} bytes long, more than the "
                    f"{name_max} the file system takes")
    if len(os.fsencode(full)) >= path_max:
        return f"it is {len(os.fsencode(full))} bytes long, more than the {path_max - 1} the file system takes"
    return None


def input_key(spec) -> str | None:
    """Weights named on the command line as a run's config.yaml keeps them (core.weights:
    WeightsSpec.key), None for none: two specs of the same weights give the same key."""
    from resmlp.core.weights import WeightsSpec
    return None if spec is None else WeightsSpec.parse(spec).key


def input_name(spec) -> str:
    """A short name for the weights `spec` names, for a folder's name (WeightsSpec.name)."""
    from resmlp.core.weights import WeightsSpec
    return WeightsSpec.parse(spec).name


def beside(directory) -> Path:
    """The first of <directory>_2, _3, ... that does not exist: where another run of the
    same command goes."""
    d = Path(directory)
    i = 2
    while (d.parent / f"{d.name}_{i}").exists():
        i += 1
    return d.parent / f"{d.name}_{i}"


def _small(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size <= RECORD_MAX_BYTES
    except OSError:
        return False


def _json(path: Path):
    try:
        return json.loads(path.read_text()) if _small(path) else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _run_config(path: Path, commands) -> bool:
    """A config.yaml a command of ours saved (its resolved config names the command)."""
    from resmlp.core.plain_config import read_config_yaml
    if not _small(path):
        return False
    try:
        saved = read_config_yaml(path)
    except UserError:
        return False
    return saved.get("command") in commands


def _our_checkpoint(path: Path) -> bool:
    """A checkpoint core/checkpoint.py saved: its pickle (torch's zip format) holds our
    format tag. The pickle alone is read, not unpickled; the tensors are not read."""
    import zipfile
    from resmlp.core.checkpoint import FORMAT
    try:
        with zipfile.ZipFile(path) as z:
            pickle = next((i for i in z.infolist() if i.filename.endswith("/data.pkl")), None)
            return pickle is not None and pickle.file_size <= 64 * RECORD_MAX_BYTES and \
                FORMAT.encode() in z.read(pickle)
    except (OSError, zipfile.BadZipFile):
        return False


def own_record(path: Path, commands) -> bool:
    """Whether `path` is a file only this project writes into an output folder: a run's
    config.yaml, checkpoint.pth or run.lock, a command's report (<command>.json,
    data.preview's crops.json), an export's card."""
    name = path.name
    if name == "config.yaml":
        return _run_config(path, commands)
    if name in ("checkpoint.pth", "checkpoint_prev.pth"):
        return path.is_file() and _our_checkpoint(path)
    if not name.endswith(".json") and name != "run.lock":
        return False
    record = _json(path)
    if not isinstance(record, dict):
        return False
    if name == "run.lock":
        return {"host", "pid"} <= record.keys()
    if name[:-len(".json")] in (*commands, "crops"):
        return True
    return {"format", "architecture", "source"} <= record.keys()  # eval/export.py's card


def foreign_entries(directory, commands) -> list[str]:
    """The entries of an existing folder this project did not write; [] for a folder that
    is missing, empty or ours (it holds a record of ours, or run dirs that do)."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        return []
    named = ("config.yaml", "checkpoint.pth", "run.lock", "crops.json", *(f"{c}.json" for c in commands))
    if any(own_record(d / name, commands) for name in named):
        return []
    names = []
    with os.scandir(d) as entries:
        for i, entry in enumerate(entries):
            if i == SCAN_ENTRIES:
                break
            path = Path(entry.path)
            if (entry.name.endswith(".json") and own_record(path, commands)) or \
                    (entry.is_dir() and _run_config(path / "config.yaml", commands)):
                return []
            names.append(entry.name + ("/" if entry.is_dir() else ""))
    return sorted(names)


def inside(path, root) -> bool:
    """Whether `path` is `root` or under it (links followed, missing tails allowed)."""
    p, r = Path(path).expanduser().resolve(), Path(root).expanduser().resolve()
    return p == r or r in p.parents


def data_root_around(path, cfg) -> str | None:
    """`key=value` of the data root (DATA_ROOTS) that `path` lies inside, if any."""
    from omegaconf import OmegaConf
    for key in DATA_ROOTS:
        root = OmegaConf.select(cfg, key, default=None)
        if root and not length_problem(root) and inside(path, root):
            return f"{key}={root}"
    return None


def check_out_dir(directory, cfg, commands, what: str) -> None:
    """UserError, before anything is made, when the folder `what` goes to (`directory`) is a
    path the file system cannot take, lies inside a data root, or (out= given) holds files
    of something else and out_ok is not true."""
    problem = length_problem(directory)
    if problem:
        raise UserError(f"cannot write {what} to {shown(directory)}: {problem}; choose a shorter out=")
    around = data_root_around(directory, cfg)
    if around:
        where = f"out={directory}" if cfg.out else f"{directory} (the default for {what}; pass out=)"
        raise UserError(f"{where} is inside {around}: the outputs would become part of the data set (an image "
                        "folder takes every folder in it for a class); choose an out= outside it")
    if not cfg.out or cfg.out_ok:
        return
    foreign = foreign_entries(directory, commands)
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"out={directory} holds files this project did not write ({listed}); choose a new or empty "
                        "folder for out=, or pass out_ok=true to write into it anyway (a file of the same name as "
                        "one it writes is replaced)")


# The cache folders a user may name: what they hold is written there, never into a data set.
CACHE_KEYS = ("features.cache_dir", "compile_cache_dir")


def check_cache_dir(cfg) -> None:
    """Each cache folder given (CACHE_KEYS): a path the file system takes, outside the data roots."""
    from omegaconf import OmegaConf
    for key in CACHE_KEYS:
        cache = OmegaConf.select(cfg, key, default=None)
        if not cache:
            continue
        problem = length_problem(cache)
        if problem:
            raise UserError(f"{key}={shown(cache)}: {problem}; choose a shorter one")
        around = data_root_around(cache, cfg)
        if around:
            raise UserError(f"{key}={cache} is inside {around}: the cache would become part of the data "
                            "set; choose a folder outside it")
