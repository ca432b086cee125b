"""The files commands write beside their results (knn.json, an export's card, a report's
table and figures): written atomically so that a reader never sees half a file, JSON of
plain values; a history (evaluations.jsonl) appended to without following a link
(core/files.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from resmlp.core.checkpoint import atomic_write
from resmlp.core.files import open_nofollow


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
    return write_text(path, json.dumps(json_safe(obj), indent=2) + "\n", what="the results")


def append_json_line(path: Path, obj) -> Path:
    """obj as one JSON line at the end of `path` (a history no write replaces): one write of
    the whole line, so that lines of two commands do not interleave."""
    line = json.dumps(json_safe(obj)) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open_nofollow(path, "a") as fh:
        fh.write(line)
    return Path(path)


def write_figure(fig, path: Path, **savefig) -> Path:
    """A matplotlib figure saved atomically, in the format its suffix names."""
    with atomic_write(path, what="the figure") as fh:
        fig.savefig(fh, format=Path(path).suffix.lstrip(".") or "png", **savefig)
    return Path(path)


def write_text(path: Path, text: str, what: str = "the report") -> Path:
    """Atomic write of a text file (a figure's table, a report in Markdown)."""
    with atomic_write(path, "w", what=f"{what} ({Path(path).name})") as fh:
        fh.write(text)
    return Path(path)
