"""The JSON files commands write (knn.json, an export's card, ...): plain values, written
atomically so that a reader never sees half a file."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from resmlp.core.checkpoint import atomic_write


def json_safe(obj):
    """Plain JSON values: tensors -> numbers, paths -> str, NaN -> null."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return json_safe(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return json_safe(obj.item())
        except (TypeError, ValueError):
            pass
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def write_json(path: Path, obj) -> Path:
    """Atomic write of obj as indented JSON."""
    with atomic_write(path, "w", what=f"the results ({Path(path).name})") as fh:
        json.dump(json_safe(obj), fh, indent=2)
        fh.write("\n")
    return Path(path)


def append_json_line(path: Path, obj) -> Path:
    """obj as one JSON line at the end of `path` (a history no write replaces): one write of
    the whole line, so that lines of two commands do not interleave."""
    line = json.dumps(json_safe(obj)) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(line)
    return Path(path)
