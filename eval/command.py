"""The runtime the knn / linear / viz commands share, as the trainers share core.run.Run:
joining (and always leaving) the process group, the backbone to evaluate, the features of
a split, where results go, and the report they write.

Results go to cfg.out when set, else beside the checkpoint (a run dir: into it), else
(timm:<name>) to runs/eval/<name>/. Each command writes <out>/<command>.json: its
results, what was evaluated, the wall time and the resolved config; it is the last result
of its kind. Every result is also appended to <out>/evaluations.jsonl (HISTORY), which no
command rewrites: a knn with other settings keeps the one before it. The folder may be a
run of someone else's: a link at any of these names (or at a folder of viz's under <out>,
or at the run's features/) is refused before the features are computed (core/files.py). viz's figures, files
that would replace each other, go to viz/<result_name>/ (viz/epoch<N>/<result_name>/ for
the checkpoint of a run still training) unless out= names their folder.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from resmlp.core import dist
from resmlp.core.checkpoint import check_writable
from resmlp.core.config import to_dict
from resmlp.core.errors import UserError
from resmlp.core.files import refuse_link
from resmlp.core.report import append_json_line, write_json
from resmlp.core.weights import ANY, WeightsSpec
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


# Every evaluation's report, one JSON line each, appended beside <command>.json.
HISTORY = "evaluations.jsonl"


def base_dir(cfg, info: dict) -> Path:
    """cfg.out, else the checkpoint's folder (its run dir), else runs/eval/<timm name>."""
    if cfg.out:
        return Path(cfg.out)
    if info.get("path"):
        return Path(info["path"]).parent
    return Path("runs") / "eval" / re.sub(r"[^A-Za-z0-9_.-]+", "_", str(info.get("model", "model")))


def result_name(cfg) -> str:
    """The name of one evaluation's result: the labeled set (data.name, and the folder's
    name when data.root is set) and a hash of every setting that changes what it computes
    (core.run_folder.RUNTIME_KEYS aside), e.g. imagefolder-labeled-1f3a9c0e."""
    from resmlp.core.run_folder import settings_of
    from resmlp.core.outdir import input_name
    digest = hashlib.sha256(json.dumps(settings_of(to_dict(cfg)), sort_keys=True, default=str).encode()).hexdigest()[:8]
    root = f"-{input_name(cfg.data.root)}" if cfg.data.get("root") else ""
    return f"{cfg.data.name}{root}-{digest}"


def unfinished_epoch(info: dict) -> int | None:
    """The checkpoint's epoch when it is a training run's that has not ended (its run dir has
    no results.json yet), else None."""
    run = info.get("run_dir")
    if not run or info.get("epoch") is None or (Path(run) / "results.json").exists():
        return None
    return int(info["epoch"])


def output_dir(cfg, info: dict, sub: str | None = None) -> Path:
    """base_dir; for a command whose files are folders (`sub`, viz's figures), its folder
    there named by result_name, under epoch<N>/ for a run still training. out= given: that
    folder, as named."""
    base = base_dir(cfg, info)
    if cfg.out or not sub:
        return base
    epoch = unfinished_epoch(info)
    return base / sub / (f"epoch{epoch}" if epoch is not None else "") / result_name(cfg)


def results_dir(cfg, sub: str | None = None) -> Path:
    """Before anything is loaded: the folder this command's reports go under (what the CLI
    tries to write into before any work)."""
    info = {}
    if cfg.checkpoint:
        spec = WeightsSpec.parse(cfg.checkpoint)
        info = {"model": spec.timm_name} if spec.is_timm else {"path": str(spec.file)}
    base = base_dir(cfg, info)
    return base / sub if sub and not cfg.out else base


def open_backbone(cfg, sub_dir: str | None = None, device: str | None = None) -> Backbone:
    """Join torchrun if any; load cfg.checkpoint (network features.key) onto this process's
    device (or `device`)."""
    if not cfg.checkpoint:
        raise UserError(f"no checkpoint given: pass {ANY}")
    spec = WeightsSpec.parse(cfg.checkpoint)
    dev = dist.setup(cfg.device) if device is None else torch.device(device)
    model, info = load_backbone(spec, key=cfg.features.key, device=dev,
                                pretrained=bool(cfg.features.pretrained), img_size=cfg.data.img_size)
    amp = dist.amp_dtype(cfg.precision, dev)
    out_dir = output_dir(cfg, info, sub_dir)
    if dist.is_main():   # the folder may be a run of someone else's: no link where the report goes
        refuse_link(out_dir / f"{cfg.command}.json", within=base_dir(cfg, info))
        refuse_link(base_dir(cfg, info) / HISTORY)
    epoch = unfinished_epoch(info)
    if epoch is not None:
        log(f"note: {info['run_dir']} is still training (no results.json yet): this {cfg.command} is of its "
            f"epoch-{epoch} checkpoint" + (f", written to {out_dir}" if sub_dir else ""))
    log(f"backbone: {describe(info)}")
    return Backbone(model, info, dev, amp, out_dir)


def eval_command(body, sub_dir: str | None = None, device: str | None = None):
    """The CLI entry `run(cfg)` of an evaluator `body(cfg, backbone) -> report or None`.

    Opens the backbone (joining torchrun's process group), runs the body, and on rank 0
    writes the report to <out>/<command>.json with the checkpoint summary, the wall time
    and the resolved config; the process group is left on any exit."""
    def run(cfg) -> int:
        started = time.time()
        with dist.leaving():
            bb = open_backbone(cfg, sub_dir, device)
            report = body(cfg, bb)
            if dist.is_main() and report is not None:
                record = {**report, "checkpoint": checkpoint_summary(bb.info),
                          "wall_time_s": round(time.time() - started, 1), "config": to_dict(cfg)}
                path = write_json(bb.out_dir / f"{cfg.command}.json", record)
                log(f"wrote {path}")
                keep(cfg, bb, record)
        return 0
    return run


def keep(cfg, bb: Backbone, record: dict) -> None:
    """Append the evaluation to base_dir's HISTORY: its command, result_name, the folder its
    files went to, the checkpoint and settings, and its results (viz: the files it drew,
    whose numbers are in that folder's viz.json)."""
    results = {"files": record.get("files")} if cfg.command == "viz" else \
        {k: v for k, v in record.items() if k not in ("checkpoint", "config")}
    append_json_line(base_dir(cfg, bb.info) / HISTORY, {
        "command": cfg.command, "name": result_name(cfg), "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "dir": str(bb.out_dir), "checkpoint": record["checkpoint"], "results": results, "config": record["config"]})


def split_features(cfg, bb: Backbone, split: str, n_last_blocks: int = 1) -> dict:
    """features_for one split with the command's config (cache dir, batch, workers); an
    unwritable cache dir fails before the extraction, not after it."""
    cache_dir = cfg.features.cache_dir or default_cache_dir(bb.info, cfg.out)
    if cfg.features.cache and dist.is_main():
        if not cfg.features.cache_dir:   # the run's own features/, not a link to elsewhere
            refuse_link(cache_dir)
        check_writable(cache_dir, "the feature cache",
                       "set features.cache_dir=<a directory you can write>, or features.cache=false")
    return features_for(
        bb.model, bb.info, cfg.data, split, device=bb.device,
        batch_size=int(cfg.features.batch_size), num_workers=int(cfg.num_workers),
        n_last_blocks=n_last_blocks, cache_dir=cache_dir,
        use_cache=bool(cfg.features.cache), amp_dtype=bb.amp_dtype, log=log,
        memory_gb=cfg.features.get("memory_gb"))


def checkpoint_summary(info: dict) -> dict:
    return {k: info.get(k) for k in ("spec", "source", "model", "key", "epoch", "weights_hash", "arch")}
