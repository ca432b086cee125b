"""Frozen-backbone feature extraction, shared by k-NN and the linear probe, cached on disk.

extract_features runs the backbone once over a loader (no_grad, bf16 autocast on GPU)
and returns float32 CPU features with their labels, in dataset order.

Distributed: each rank runs its shard of the eval loader (resmlp.data.build_loader
shards eval sets across ranks without padding); features, labels and the dataset
indices the rank's sampler visited are concatenated over ranks with
core.dist.all_gather_cat, then put back in dataset order by those indices (any
sharding scheme works, contiguous or strided; a padded duplicate is dropped). Every
rank gets the full result.

Cache: features_for() keys a file on everything that changes the features (see
cache_key): the weights' hash (not the file's path: the same weights from another
format hit the same entry), the dataset (name, root, data=folder's file list, subset), the split, the eval
transform (its repr plus img_size, crop_ratio, mean, std), n_last_blocks and the
autocast dtype. Files: <cache_dir>/<split>-<key hash>.pt holding features, labels,
classes and the key itself. cache_dir: `features.cache_dir` if set, else the
`features/` folder of the checkpoint's run dir (this project's checkpoints), else (timm:
models and foreign files, whose folders we do not write into) `<out>/features` when out=
is given, else the user's cache folder, $XDG_CACHE_HOME/resmlp/features or
~/.cache/resmlp/features (never the installed tree). The next k-NN or linear run on the
same checkpoint and data reuses them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn as nn

from resmlp.core import dist, preempt
from resmlp.core.checkpoint import atomic_write, read_file
from resmlp.core.compiling import uncompiled
from resmlp.core.errors import UserError
from resmlp.eval import memory

CACHE_VERSION = 1


# --------------------------------------------------------------------------- extraction

def default_amp_dtype(device) -> torch.dtype:
    """precision=auto's (core.dist.amp_dtype): bf16 on a GPU that has it, else fp16 (features
    are stored in float32 anyway), float32 on the CPU."""
    return dist.amp_dtype("auto", device)


def forward_features(model: nn.Module, x: torch.Tensor, n_last_blocks: int = 1) -> torch.Tensor:
    """Pooled features (B, D), or the concatenation of the last n blocks' pooled
    features (B, n * D) as in DINO's linear probe (ResMLP's pooled_block_features)."""
    if n_last_blocks == 1:
        out = model(x)
    else:
        if not hasattr(model, "pooled_block_features"):
            raise UserError(f"n_last_blocks={n_last_blocks} needs a ResMLP of this project "
                            f"(pooled_block_features); {type(model).__name__} has only its "
                            "final features: use n_last_blocks=1")
        out = torch.cat(model.pooled_block_features(x, n_last_blocks), dim=-1)
    if out.dim() != 2:
        raise UserError(f"the backbone returns {tuple(out.shape)}, not pooled (batch, dim) features; "
                        "build it with num_classes=0")
    return out


def _sampler_indices(loader) -> torch.Tensor | None:
    """Dataset indices this rank's loader visits, in order, if the sampler is deterministic."""
    sampler = getattr(loader, "sampler", None)
    if sampler is None or isinstance(sampler, torch.utils.data.RandomSampler):
        return None
    if getattr(sampler, "shuffle", False):
        return None
    try:
        return torch.as_tensor(list(iter(sampler)), dtype=torch.int64)
    except TypeError:
        return None


@torch.no_grad()
def feature_width(model: nn.Module, image: torch.Tensor, device, n_last_blocks: int = 1) -> int:
    """The width of `model`'s features on images such as `image` (C, H, W, eval-transformed):
    its num_features (a backbone's, timm's convention) times n_last_blocks, else the forward
    of that image (the raw pixels)."""
    width = getattr(model, "num_features", None)
    if isinstance(width, int) and width > 0:
        return width * n_last_blocks
    was_training = model.training
    model.eval()
    try:
        x = image.unsqueeze(0).to(device)
        with uncompiled():  # one image would cost a compiled model a compilation of its own
            return int(forward_features(model, x, n_last_blocks).shape[1])
    finally:
        model.train(was_training)


@torch.no_grad()
def extract_features(model: nn.Module, loader, device, amp_dtype: torch.dtype | None = None,
                     n_last_blocks: int = 1, desc: str = "features") -> tuple[torch.Tensor, torch.Tensor]:
    """(features float32 (N, D) CPU, labels int64 (N,) CPU) of the whole dataset.

    model: in eval mode on `device`, returning pooled features (num_classes=0).
    amp_dtype: autocast dtype on CUDA; None = precision=auto's (default_amp_dtype).
    Under torchrun every rank passes its own shard's loader and gets the whole set back,
    in dataset order (see the module docstring).
    """
    device = torch.device(device)
    amp_dtype = default_amp_dtype(device) if amp_dtype is None else amp_dtype
    use_amp = device.type == "cuda" and amp_dtype != torch.float32
    was_training = model.training
    model.eval()
    show = dist.is_main() and sys.stderr.isatty()
    try:
        from tqdm import tqdm
        batches = tqdm(loader, desc=desc, disable=not show, leave=False, dynamic_ncols=True)
    except ImportError:
        batches = loader
    said = Progress(desc, _images_in(loader), enabled=dist.is_main() and not show)
    feats, labels = [], []
    for batch in batches:
        preempt.stop_between_batches()  # a trainer's stop signal need not wait for the whole extraction
        said.batch(len(batch[0]))
        x, y = batch[0], batch[1]
        x = x.to(device, non_blocking=True)
        # a model the trainer compiled runs eager here: an extraction's batch sizes (its last,
        # partial one) would each cost a compilation, for one pass over the data
        with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp), uncompiled():
            try:
                f = forward_features(model, x, n_last_blocks)
            except (RuntimeError, ValueError) as e:
                if feats:  # it worked on earlier batches: not a shape problem
                    raise
                _shape_error(model, x, e)
        feats.append(f.float())
        labels.append(torch.as_tensor(y).to(device).long().reshape(-1))
    model.train(was_training)
    dim = feats[0].shape[1] if feats else _feature_dim(model, n_last_blocks)
    f = torch.cat(feats) if feats else torch.zeros(0, dim, device=device)
    y = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=device)
    if dist.world_size() == 1:
        return f.cpu(), y.cpu()
    idx = _sampler_indices(loader)
    if idx is not None and idx.numel() != f.shape[0]:
        idx = None
    f, y = dist.all_gather_cat(f).cpu(), dist.all_gather_cat(y).cpu()
    have_idx = torch.tensor([int(idx is not None)], device=device)
    if dist.is_dist():  # every rank must agree to reorder, or none does
        torch.distributed.all_reduce(have_idx, op=torch.distributed.ReduceOp.MIN)
    if int(have_idx.item()):
        idx = dist.all_gather_cat(idx.to(device)).cpu()
        order = torch.argsort(idx, stable=True)
        idx, f, y = idx[order], f[order], y[order]
        keep = torch.ones_like(idx, dtype=torch.bool)
        keep[1:] = idx[1:] != idx[:-1]     # padded duplicates (DistributedSampler-style)
        f, y = f[keep], y[keep]
    return f, y


# Without a terminal's bar, an extraction says where it is at least this often (seconds): a
# long one (a k-NN at init over a large bank on a CPU) still shows progress in a log.
PROGRESS_S = 20.0


class Progress:
    """extract_features' line every PROGRESS_S seconds where no bar shows (a log file)."""

    def __init__(self, desc: str, total: int | None, enabled: bool, clock=time.monotonic):
        self.desc, self.total, self.enabled, self.clock = desc, total, enabled, clock
        self.started = self.said = clock()
        self.done = 0

    def batch(self, n: int) -> None:
        """Before a batch of n images: a line when PROGRESS_S has passed since the last."""
        now = self.clock()
        if self.enabled and now - self.said >= PROGRESS_S:
            of = f"/{self.total}" if self.total else ""
            print(f"{self.desc}: {self.done}{of} images ({now - self.started:.0f} s)", flush=True)
            self.said = now
        self.done += n


def _images_in(loader) -> int | None:
    sampler = getattr(loader, "sampler", None)  # this process's share of the dataset
    if sampler is not None and hasattr(sampler, "__len__"):
        return len(sampler)
    if isinstance(loader, list):  # online_knn's cached batches
        return sum(len(b[0]) for b in loader)
    return None


def _shape_error(model: nn.Module, x: torch.Tensor, e: Exception):
    """The first batch failed: almost always images the backbone was not built for."""
    built = getattr(model, "img_size", None)
    pe = getattr(getattr(model, "patch_embed", None), "proj", None) or getattr(
        getattr(model, "stem", None), "proj", None)
    chans = getattr(pe, "in_channels", None)
    want = f" (it takes {built[0]}x{built[1]} px" if isinstance(built, (tuple, list)) else " ("
    want += f", {chans} channels)" if chans else ")"
    first = (str(e).splitlines() or [type(e).__name__])[0][:160]
    raise UserError(f"the backbone cannot take the data's {x.shape[-2]}x{x.shape[-1]} px "
                    f"{x.shape[1]}-channel images{want if want != ' ()' else ''}: {first}; "
                    "set data.img_size to the size the checkpoint was trained at") from None


def _feature_dim(model: nn.Module, n_last_blocks: int) -> int:
    return int(getattr(model, "num_features", 0)) * n_last_blocks


# --------------------------------------------------------------------------- cache

def _get(cfg, key: str, default=None):
    try:
        v = cfg.get(key, default)
    except Exception:  # noqa: BLE001 - struct DictConfig without the key
        v = default
    if hasattr(v, "_content"):  # ListConfig / DictConfig -> plain
        from omegaconf import OmegaConf
        v = OmegaConf.to_container(v, resolve=True)
    return v


def describe_transform(transform) -> str:
    """repr of a transform with object addresses removed (stable across runs)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(transform))


def cache_key(weights_hash: str, data_cfg, split: str, transform, n_last_blocks: int = 1,
              amp_dtype: torch.dtype | None = None) -> dict:
    """Everything that changes the features of one split."""
    root = _get(data_cfg, "root")
    return {
        "version": CACHE_VERSION,
        "weights": weights_hash,
        "data": _get(data_cfg, "name"),
        "root": str(Path(root).expanduser().resolve()) if root else None,
        "subset": _get(data_cfg, "subset"),
        "skip_corrupt": bool(_get(data_cfg, "skip_corrupt", False)),
        "split": split,
        "img_size": _get(data_cfg, "img_size"),
        "crop_ratio": _get(data_cfg, "crop_ratio"),
        "mean": _get(data_cfg, "mean"),
        "std": _get(data_cfg, "std"),
        "transform": describe_transform(transform),
        "n_last_blocks": int(n_last_blocks),
        "amp_dtype": str(amp_dtype).replace("torch.", "") if amp_dtype is not None else None,
        # data=folder's list of paths (only where given: the other sets' keys stay as they were)
        **({"files": str(Path(_get(data_cfg, "files")).expanduser().resolve())} if _get(data_cfg, "files") else {}),
    }


def key_digest(key: Mapping) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/resmlp/features, else ~/.cache/resmlp/features (the XDG base
    directory rules: a relative XDG_CACHE_HOME is ignored)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path("~/.cache").expanduser()
    return base / "resmlp" / "features"


def default_cache_dir(info: Mapping, out=None) -> Path:
    """<run dir>/features for this project's checkpoints, else <out>/features, else
    user_cache_dir()."""
    rd = info.get("run_dir")
    if rd:
        return Path(rd) / "features"
    return Path(out).expanduser() / "features" if out else user_cache_dir()


def cache_path(cache_dir, key: Mapping) -> Path:
    return Path(cache_dir) / f"{key['split']}-{key_digest(key)}.pt"


def _load_cached(path: Path, key: Mapping):
    try:
        obj = read_file(path)  # weights only, whatever weights_trust says: a cache is never trusted
    except Exception:  # noqa: BLE001 - a truncated or foreign file: extract again
        return None
    same = lambda a: json.dumps(a, sort_keys=True, default=str)  # noqa: E731
    if not isinstance(obj, dict) or same(obj.get("key")) != same(key):
        return None
    return obj


def features_for(model: nn.Module, info: Mapping, data_cfg, split: str, *, device="cpu",
                 batch_size: int = 256, num_workers: int = 0, n_last_blocks: int = 1,
                 cache_dir=None, use_cache: bool = True, amp_dtype: torch.dtype | None = None,
                 transform=None, log: Callable[[str], None] | None = print, memory_gb=None) -> dict:
    """Eval-transform features of one split of data_cfg, from the cache or extracted.
    cache_dir: default default_cache_dir(info).

    batch_size is global (each process extracts its shard: dist.share). transform: default
    resmlp.data.build_eval_transform. memory_gb: features.memory_gb; features that would pass
    the budget are refused in one line before any image is read (eval/memory.py).
    Returns {'features': (N, D) float32, 'labels': (N,) int64, 'classes': list,
    'num_classes': int, 'cache': path or None, 'cached': bool, 'key': dict}.
    """
    import resmlp.data as rdata

    device = torch.device(device)
    amp_dtype = default_amp_dtype(device) if amp_dtype is None else amp_dtype
    if transform is None:
        transform = rdata.build_eval_transform(data_cfg)
    key = cache_key(info["weights_hash"], data_cfg, split, transform, n_last_blocks, amp_dtype)
    path = cache_path(cache_dir if cache_dir else default_cache_dir(info), key) if use_cache else None

    hit = None
    if path is not None:
        found = dist.broadcast_object(bool(dist.is_main() and path.exists()))
        if found:
            hit = _load_cached(path, key)
    if hit is not None:
        if log:
            log(f"features: loaded from cache {path}")
        return {"features": hit["features"], "labels": hit["labels"], "classes": hit["classes"],
                "num_classes": hit["num_classes"], "cache": str(path), "cached": True, "key": key}

    dataset = rdata.build_dataset(data_cfg, split, transform=transform)
    if len(dataset) == 0:
        raise UserError(f"the {split} split of {key['data']} is empty; check data.root / data.subset")
    budget = memory.budget_bytes(memory_gb, device)
    if budget is not None:
        memory.check_features(len(dataset), feature_width(model, dataset[0][0], device, n_last_blocks), budget,
                              memory_gb, split)
    loader = rdata.build_loader(dataset, dist.share(batch_size), train=False, num_workers=num_workers, seed=0)
    feats, labels = extract_features(model, loader, device, amp_dtype, n_last_blocks, desc=f"{split} features")
    classes = list(getattr(dataset, "classes", []) or [])
    n_cls = len(classes) or int(rdata.num_classes(data_cfg))
    if path is not None:
        if dist.is_main():
            with atomic_write(path, what="the feature cache",
                              then="free some space, set features.cache_dir=<another directory>, or "
                                   "features.cache=false") as fh:
                torch.save({"features": feats, "labels": labels, "classes": classes,
                            "num_classes": n_cls, "key": key}, fh)
            if log:
                log(f"features: {split} {tuple(feats.shape)} extracted, cached in {path}")
        dist.barrier()
    elif log:
        log(f"features: {split} {tuple(feats.shape)} extracted (cache off)")
    return {"features": feats, "labels": labels, "classes": classes, "num_classes": n_cls,
            "cache": str(path) if path else None, "cached": False, "key": key}
