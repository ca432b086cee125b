"""What the knn / linear / viz commands share: config reading, the backbone, the features
of both splits, where results go, and writing them.

Results go to cfg.out when set, else beside the checkpoint (a run dir: into it), else
(timm:<name>) to runs/eval/<name>/.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from resmlp.core import dist
from resmlp.core.checkpoint import atomic_write
from resmlp.core.errors import UserError
from resmlp.eval.checkpoints import describe, load_backbone
from resmlp.eval.features import amp_dtype_from_precision, features_for


def select(cfg, key: str, default=None):
    """cfg value at a dotted key, or default when the key is absent or null."""
    from omegaconf import OmegaConf
    try:
        v = OmegaConf.select(cfg, key, default=default)
    except Exception:  # noqa: BLE001 - plain dicts
        v = cfg
        for part in key.split("."):
            if not isinstance(v, dict) or part not in v:
                return default
            v = v[part]
    return default if v is None else v


def log(msg: str) -> None:
    if dist.is_main():
        print(msg, flush=True)


@dataclass
class Backbone:
    model: nn.Module
    info: dict
    device: torch.device
    amp_dtype: torch.dtype
    out_dir: Path


def output_dir(cfg, info: dict, sub: str | None = None) -> Path:
    """cfg.out, else the checkpoint's folder (its run dir), else runs/eval/<timm name>."""
    out = select(cfg, "out")
    if out:
        return Path(out)
    if info.get("path"):
        base = Path(info["path"]).parent
    else:
        base = Path("runs") / "eval" / re.sub(r"[^A-Za-z0-9_.-]+", "_", str(info.get("model", "model")))
    return base / sub if sub else base


def open_backbone(cfg, sub_dir: str | None = None) -> Backbone:
    """Join torchrun if any, load cfg.checkpoint (network knn.key) onto this process's device."""
    spec = select(cfg, "checkpoint")
    if not spec:
        raise UserError("no checkpoint given: pass a checkpoint file, a run dir or timm:<name>")
    device = dist.setup(select(cfg, "device", "auto"))
    key = select(cfg, "knn.key", "teacher")
    model, info = load_backbone(spec, key=key, device=device,
                                pretrained=bool(select(cfg, "features.pretrained", True)),
                                img_size=select(cfg, "data.img_size"))
    amp = amp_dtype_from_precision(select(cfg, "precision", "auto"), device)
    log(f"backbone: {describe(info)}")
    return Backbone(model, info, device, amp, output_dir(cfg, info, sub_dir))


def split_features(cfg, bb: Backbone, split: str, n_last_blocks: int = 1) -> dict:
    """features_for one split with the command's config (cache dir, batch, workers)."""
    return features_for(
        bb.model, bb.info, cfg.data, split, device=bb.device,
        batch_size=int(select(cfg, "knn.batch_size", 256)),
        num_workers=int(select(cfg, "num_workers", 0)),
        n_last_blocks=n_last_blocks,
        cache_dir=select(cfg, "features.cache_dir"),
        use_cache=bool(select(cfg, "features.cache", True)),
        amp_dtype=bb.amp_dtype, log=log)


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
    with atomic_write(path, "w") as fh:
        json.dump(json_safe(obj), fh, indent=2)
        fh.write("\n")
    return Path(path)


def checkpoint_summary(info: dict) -> dict:
    return {k: info.get(k) for k in ("spec", "source", "model", "key", "epoch", "weights_hash", "arch")}
