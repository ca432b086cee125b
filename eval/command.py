"""The runtime the knn / linear / viz commands share, as the trainers share core.engine.Run:
joining (and always leaving) the process group, the backbone to evaluate, the features of
a split, where results go, and the report they write.

Results go to cfg.out when set, else beside the checkpoint (a run dir: into it), else
(timm:<name>) to runs/eval/<name>/. Each command writes <out>/<command>.json: its
results, what was evaluated, the wall time and the resolved config.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from resmlp.core import dist
from resmlp.core.checkpoint import check_writable, resolve_checkpoint_path
from resmlp.core.config import to_dict
from resmlp.core.errors import UserError
from resmlp.core.report import write_json
from resmlp.eval.features import default_cache_dir, features_for
from resmlp.models.load import describe, load_backbone


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
    if cfg.out:
        return Path(cfg.out)
    if info.get("path"):
        base = Path(info["path"]).parent
    else:
        base = Path("runs") / "eval" / re.sub(r"[^A-Za-z0-9_.-]+", "_", str(info.get("model", "model")))
    return base / sub if sub else base


def results_dir(cfg, sub: str | None = None) -> Path:
    """output_dir before anything is loaded: where this command's reports will go."""
    spec = str(cfg.checkpoint or "")
    if spec.startswith("timm:"):
        info = {"model": spec[len("timm:"):].partition("?")[0]}
    else:
        info = {"path": str(resolve_checkpoint_path(spec))} if spec else {}
    return output_dir(cfg, info, sub)


def open_backbone(cfg, sub_dir: str | None = None, device: str | None = None) -> Backbone:
    """Join torchrun if any; load cfg.checkpoint (network features.key) onto this process's
    device (or `device`)."""
    if not cfg.checkpoint:
        raise UserError("no checkpoint given: pass a checkpoint file, a run dir or timm:<name>")
    dev = dist.setup(cfg.device) if device is None else torch.device(device)
    model, info = load_backbone(cfg.checkpoint, key=cfg.features.key, device=dev,
                                pretrained=bool(cfg.features.pretrained), img_size=cfg.data.img_size)
    amp = dist.amp_dtype(cfg.precision, dev)
    log(f"backbone: {describe(info)}")
    return Backbone(model, info, dev, amp, output_dir(cfg, info, sub_dir))


def eval_command(body, sub_dir: str | None = None, device: str | None = None):
    """The CLI entry `run(cfg)` of an evaluator `body(cfg, backbone) -> report or None`.

    Opens the backbone (joining torchrun's process group), runs the body, and on rank 0
    writes the report to <out>/<command>.json with the checkpoint summary, the wall time
    and the resolved config; the process group is left on any exit."""
    def run(cfg) -> int:
        started = time.time()
        try:
            bb = open_backbone(cfg, sub_dir, device)
            report = body(cfg, bb)
            if dist.is_main() and report is not None:
                path = write_json(bb.out_dir / f"{cfg.command}.json", {
                    **report, "checkpoint": checkpoint_summary(bb.info),
                    "wall_time_s": round(time.time() - started, 1), "config": to_dict(cfg)})
                log(f"wrote {path}")
            dist.barrier()
        finally:
            dist.cleanup()
        return 0
    return run


def split_features(cfg, bb: Backbone, split: str, n_last_blocks: int = 1) -> dict:
    """features_for one split with the command's config (cache dir, batch, workers); an
    unwritable cache dir fails before the extraction, not after it."""
    cache_dir = cfg.features.cache_dir or default_cache_dir(bb.info, cfg.out)
    if cfg.features.cache and dist.is_main():
        check_writable(cache_dir, "the feature cache",
                       "set features.cache_dir=<a directory you can write>, or features.cache=false")
    return features_for(
        bb.model, bb.info, cfg.data, split, device=bb.device,
        batch_size=int(cfg.features.batch_size), num_workers=int(cfg.num_workers),
        n_last_blocks=n_last_blocks, cache_dir=cache_dir,
        use_cache=bool(cfg.features.cache), amp_dtype=bb.amp_dtype, log=log)


def checkpoint_summary(info: dict) -> dict:
    return {k: info.get(k) for k in ("spec", "source", "model", "key", "epoch", "weights_hash", "arch")}
