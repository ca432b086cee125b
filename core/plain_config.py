"""A saved config read as plain data: a run folder's config.yaml, a checkpoint's `config`.

Whoever wrote the folder or the file wrote these, so they are data, checked before any
use: mappings with string keys, lists, and strings, numbers, booleans and nulls, nested
no deeper than MAX_DEPTH, with no more than MAX_VALUES values in all (a YAML file of
aliases names one list a million times in a few lines). This project saves its configs
resolved, so a saved value never holds an OmegaConf interpolation: a `${...}` in one
(`${oc.env:SECRET}` would be read from the reader's environment, then written into its
results) is refused, never resolved. config.yaml is read only when it is a regular file
of at most RECORD_MAX_BYTES (a FIFO would hang the command), by YAML's safe loader. Anything else
is one line naming the file and the key.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from resmlp.core.errors import UserError
from resmlp.core.files import RECORD_MAX_BYTES, read_regular

# Deeper than any config of this project (sections hold keys, a few hold one more level).
MAX_DEPTH = 16
MAX_VALUES = 100_000
_LEAVES = (str, bool, int, float, type(None))


def plain_config(value, where: str) -> dict:
    """A copy of `value` (a saved config) made of plain data, or a UserError naming `where`
    and the first key that is not."""
    if not isinstance(value, dict):
        raise UserError(f"{where}: its saved config is a {type(value).__name__}, not a mapping of keys; "
                        "it was not written by this project")
    budget = [MAX_VALUES]
    return _copy(value, where, "", 0, budget)


def _copy(value, where: str, key: str, depth: int, budget: list):
    budget[0] -= 1
    if budget[0] < 0:
        raise UserError(f"{where}: its saved config holds more than {MAX_VALUES} values; a config of this project "
                        "holds a few hundred")
    if isinstance(value, _LEAVES):
        if isinstance(value, str) and "${" in value:
            raise UserError(f"{where}: its saved config holds an interpolation at {key or 'the top'} ({value[:60]!r}); "
                            "this project saves its configs resolved, and a saved value is read as it is, never "
                            "resolved: remove it")
        return value
    if depth >= MAX_DEPTH:
        raise UserError(f"{where}: its saved config is nested deeper than {MAX_DEPTH} levels (at {key}); a config "
                        "of this project is a few levels deep")
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise UserError(f"{where}: its saved config has a key that is not text ({type(bad).__name__}) "
                            f"under {key or 'the top'}")
        return {k: _copy(v, where, f"{key}.{k}" if key else k, depth + 1, budget) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v, where, f"{key}[{i}]", depth + 1, budget) for i, v in enumerate(value)]
    raise UserError(f"{where}: its saved config holds a {type(value).__name__} at {key or 'the top'}; a saved "
                    "config holds text, numbers, booleans, nulls, lists and mappings")


def read_config_yaml(path: str | os.PathLike) -> dict:
    """A run folder's config.yaml as plain data (plain_config); one line when it is not a
    regular file of at most RECORD_MAX_BYTES, or not YAML."""
    try:
        text = read_regular(path)
    except OSError as e:
        raise UserError(f"cannot read {path} as a saved config ({e.strerror}): a run folder's config.yaml is a "
                        f"regular file of at most {RECORD_MAX_BYTES} bytes") from None
    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"{path} cannot be read as a saved config ({why})") from None
    return plain_config(data, str(Path(path)))
