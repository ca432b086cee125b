"""`run.sh data`: print what a dataset holds, and with data.check=true, open every image.

Prints the splits and their sizes, the classes with per-split counts (or that the images
have no labels: data=folder), how images are stored (size, channels) and what the models
get (RGB, img_size, normalization), where the files were found, what the scan skipped
(counted by reason, the first ones named: files without an image extension, hidden ones,
links to folders already scanned, ...), and what data.subset picks. With data.check=true every image file is
opened and decoded and the unreadable ones are listed; any unreadable file is then a
UserError unless data.skip_corrupt=true (then they are the ones training skips).
With data.preview=N the DINO views of N training images are drawn by the trainer's data
path and written to crops.png and crops.json in the run folder (preview.py).
"""
from __future__ import annotations

import collections

import numpy as np
from PIL import Image

from resmlp.core.errors import UserError
from resmlp.data.datasets import LABELED, build_dataset, dataset_info, dataset_splits
from resmlp.data.folder import ImageFiles
from resmlp.data.images import find_unreadable
from resmlp.data.subset import make_subset
from resmlp.data.torchvision_sets import TorchvisionImages
from resmlp.data.transforms import build_eval_transform, mean_std

MAX_CLASS_ROWS = 100
SAMPLED_FILES = 64
_MODE_NAMES = {"L": "1 channel (gray)", "1": "1 channel (1-bit)", "P": "1 channel (palette)",
               "RGB": "3 channels (RGB)", "RGBA": "4 channels (RGBA)", "LA": "2 channels (gray+alpha)",
               "CMYK": "4 channels (CMYK)", "I;16": "1 channel (16-bit gray)", "I": "1 channel (32-bit gray)",
               "F": "1 channel (float gray)"}


def _with(data_cfg, **changes):
    try:
        from omegaconf import DictConfig, OmegaConf
        if isinstance(data_cfg, DictConfig):
            return OmegaConf.merge(data_cfg, changes)
    except ImportError:
        pass
    return type(data_cfg)({**data_cfg, **changes})


def _format_from_files(paths: list[str]) -> str:
    pick = [paths[int(i)] for i in np.linspace(0, len(paths) - 1, min(SAMPLED_FILES, len(paths)))]
    sizes, modes = collections.Counter(), collections.Counter()
    for p in pick:
        try:
            with Image.open(p) as im:  # header only, no decoding
                sizes[im.size] += 1
                modes[im.mode] += 1
        except Exception:
            modes["unreadable"] += 1
    if not sizes:
        return "no readable file among the sampled ones"
    (w, h), _ = sizes.most_common(1)[0]
    ws, hs = [s[0] for s in sizes.elements()], [s[1] for s in sizes.elements()]
    mode_text = ", ".join(f"{_MODE_NAMES.get(m, m)} x{n}" for m, n in modes.most_common())
    return (f"{len(pick)} sampled files: most common {w}x{h}, width {min(ws)}-{max(ws)}, "
            f"height {min(hs)}-{max(hs)}; {mode_text} -> converted to RGB")


def stored_format(ds) -> str:
    """How the images of `ds` are stored, e.g. '28x28, 1 channel (gray) -> converted to RGB'."""
    while hasattr(ds, "indices") and hasattr(ds, "base"):
        ds = ds.base
    if hasattr(ds, "images"):  # Fashion-MNIST: one uint8 array (N, H, W)
        _, h, w = ds.images.shape
        return f"{w}x{h}, 1 channel (gray) -> converted to RGB"
    if isinstance(ds, TorchvisionImages):
        shape = ds.base.data.shape  # CIFAR (N, H, W, 3), STL-10 (N, 3, H, W)
        h, w = (shape[1], shape[2]) if shape[-1] == 3 else (shape[2], shape[3])
        return f"{w}x{h}, 3 channels (RGB)"
    if isinstance(ds, ImageFiles):
        return _format_from_files([p for p, _ in ds.samples])
    return "unknown"


def _counts(ds, n_classes: int) -> np.ndarray:
    t = np.asarray(ds.targets, dtype=np.int64)
    return np.bincount(t[t >= 0], minlength=n_classes)


def _print_classes(classes: list[str], table: dict[str, np.ndarray]) -> None:
    splits = list(table)
    print(f"classes: {len(classes)}")
    if len(classes) <= MAX_CLASS_ROWS:
        width = max(len("name"), max(len(c) for c in classes))
        print(f"  {'idx':>4}  {'name':<{width}}  " + "  ".join(f"{s:>12}" for s in splits))
        for i, c in enumerate(classes):
            print(f"  {i:>4}  {c:<{width}}  " + "  ".join(f"{int(table[s][i]):>12}" for s in splits))
        return
    for s in splits:
        c = table[s]
        small = np.argsort(c, kind="stable")[:5]
        print(f"  {s}: per class min {c.min()}, median {int(np.median(c))}, max {c.max()}; "
              f"smallest: " + ", ".join(f"{classes[i]} ({c[i]})" for i in small))
    print(f"  (first classes: {', '.join(classes[:10])}, ...)")


def _print_skipped(datasets: dict) -> None:
    """What the scans did not take, per split: counted by reason, the first ones named."""
    for split, ds in datasets.items():
        skipped = getattr(ds, "skipped", None)
        if skipped is None:
            continue
        if not skipped.total():
            print(f"skipped in {split}: nothing (every entry under {ds.source} is an image)")
            continue
        print(f"skipped in {split}: {skipped.total()} entries under {ds.source} not read as images:")
        for line in skipped.lines():
            print(f"  {line}")


def _check(data_cfg, datasets: dict) -> None:
    folders = {s: ds for s, ds in datasets.items() if isinstance(ds, ImageFiles)}
    if not folders:
        print("check: images are decoded arrays held in memory; there are no files to open")
        return
    bad = []
    for split, ds in folders.items():
        print(f"check: opening all {len(ds)} images of {split} ({ds.source}) ...", flush=True)
        bad += find_unreadable([p for p, _ in ds.samples])
    if not bad:
        skipped = sum(ds.skipped.total() for ds in folders.values())
        print(f"check: all {sum(len(ds) for ds in folders.values())} images are readable"
              + (f"; {skipped} other entries were not read (skipped, listed above)" if skipped else ""))
        return
    print(f"check: {len(bad)} unreadable image(s):")
    for path, reason in bad:
        print(f"  {path}: {reason}")
    if data_cfg.skip_corrupt:
        print(f"check: data.skip_corrupt=true: training and evaluation skip these {len(bad)} file(s)")
        return
    raise UserError(f"{len(bad)} unreadable image(s), listed above; fix or delete them, "
                    f"or set data.skip_corrupt=true to skip them")


def results_dir(cfg):
    """The run folder data.preview=N draws into; None without a preview (nothing is written)."""
    from resmlp.core.run_folder import run_dir
    return run_dir(cfg) if cfg.data.preview else None


def run(cfg) -> int:
    data_cfg = cfg.data
    raw_cfg = _with(data_cfg, check=False, skip_corrupt=False, subset=None)
    splits = dataset_splits(data_cfg)
    datasets = {s: build_dataset(raw_cfg, s) for s in splits}
    first = next(iter(datasets.values()))
    classes = list(first.classes)
    mean, std = mean_std(data_cfg)
    size = data_cfg.img_size
    labeled = dataset_info(data_cfg).labeled
    print(f"dataset: {data_cfg.name}")
    for s, ds in datasets.items():
        print(f"  {s}: {len(ds)} images{'' if labeled else ' without labels'}, from {ds.source}")
    print(f"stored images: {stored_format(first)}")
    build_eval_transform(data_cfg)  # validates img_size, crop_ratio, mean, std
    resize = int(round(size / float(data_cfg.crop_ratio)))
    print(f"model input: RGB {size}x{size}; eval: resize {resize} (bicubic) + center crop {size}")
    print(f"normalization: mean [{', '.join(f'{m:.4f}' for m in mean)}], "
          f"std [{', '.join(f'{v:.4f}' for v in std)}]")
    table = {s: _counts(ds, len(classes)) for s, ds in datasets.items()
             if (np.asarray(ds.targets) >= 0).any()}
    n = data_cfg.subset
    if n is not None:
        for s in ("train", "unlabeled"):
            if s in datasets:
                sub = make_subset(datasets[s], n)
                print(f"subset: data.subset={n} keeps {len(sub)} of the {len(datasets[s])} {s} images")
                if s in table:
                    table[f"{s} subset"] = _counts(sub, len(classes))
    if labeled:
        _print_classes(classes, table)
    else:
        print(f"labels: none; DINO trains on these images, and its k-NN and linear probe read a labeled set "
              f"named with eval.data=<{'|'.join(LABELED)}> eval.root=DIR")
    _print_skipped(datasets)
    if data_cfg.check:
        _check(data_cfg, datasets)
    elif any(isinstance(ds, ImageFiles) for ds in datasets.values()):
        print("corrupt: not checked (data.check=true opens every image and lists the unreadable ones)")
    n = data_cfg.preview
    if n:
        from resmlp.data.preview import run_preview
        from resmlp.data.crop_plan import crop_plan
        out = run_preview(cfg, n)
        print(f"preview: the DINO views ({crop_plan(cfg).label()} px) of {n} training images drawn as "
              f"`run.sh dino` draws them: {out['png']}, {out['json']}")
    return 0
