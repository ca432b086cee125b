"""CIFAR-10, CIFAR-100 and STL-10 through torchvision's dataset classes.

Files are read from `data.root` when set, else from the cache `data_dir()` (paths.py),
in torchvision's layout (<root>/cifar-10-batches-py/, <root>/cifar-100-python/,
<root>/stl10_binary/). When they are not there and `data.download` is true,
torchvision downloads them (online machines only); otherwise, or when that fails, a
UserError says to set data.root or go online.

Splits: cifar10/cifar100 train (50,000) and test (10,000); stl10 train (5,000),
test (8,000) and unlabeled (100,000, label -1). Images are RGB already (32x32 or 96x96);
they still pass through images.to_rgb, the one rule.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from resmlp.core.errors import UserError
from resmlp.data.images import to_rgb
from resmlp.data.paths import data_dir, main_process_first, user_root

# name -> (torchvision class name, folder inside root, pretty name, splits)
SETS = {
    "cifar10": ("CIFAR10", "cifar-10-batches-py", "CIFAR-10", ("train", "test")),
    "cifar100": ("CIFAR100", "cifar-100-python", "CIFAR-100", ("train", "test")),
    "stl10": ("STL10", "stl10_binary", "STL-10", ("train", "test", "unlabeled")),
}


class TorchvisionImages(torch.utils.data.Dataset):
    """Wraps a torchvision dataset: yields (transform(RGB PIL image), int label).

    Attributes: `classes`, `targets` (int64 array; -1 for STL-10's unlabeled split),
    `source`, `base` (the torchvision dataset, built without a transform).
    """

    def __init__(self, base, classes, targets, source: str, transform=None):
        self.base = base
        self.classes = list(classes)
        self.targets = np.asarray(targets, dtype=np.int64)
        self.source = source
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        img, _ = self.base[index]
        img = to_rgb(img)
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.targets[index])


def _make(cls, root: str, split: str, download: bool):
    if cls.__name__ == "STL10":
        return cls(root, split=split, download=download)
    return cls(root, train=(split == "train"), download=download)


def build(data_cfg, split: str, transform=None) -> TorchvisionImages:
    import torchvision

    name = data_cfg.name
    cls_name, folder, pretty, splits = SETS[name]
    if split not in splits:
        raise UserError(f"{pretty} has splits {', '.join(splits)}, not {split!r}")
    cls = getattr(torchvision.datasets, cls_name)
    given = user_root(data_cfg)
    root = given or data_dir()
    try:
        base = _make(cls, root, split, download=False)
    except RuntimeError:
        base = None
    why = "data.download=false"
    if base is None and data_cfg.download:
        try:
            os.makedirs(root, exist_ok=True)
            with main_process_first():
                base = _make(cls, root, split, download=True)
        except Exception as e:  # offline: URLError, RuntimeError, ...
            why = "download failed: " + " ".join(f"{type(e).__name__}: {e}".split())[:200]
    if base is None:
        raise UserError(
            f"{pretty} not found in {os.path.join(root, folder)} ({why}); set data.root=<folder "
            f"holding {folder}/> or run once on an online machine with data.download=true")
    targets = base.labels if cls_name == "STL10" else base.targets
    return TorchvisionImages(base, base.classes, targets, os.path.join(root, folder), transform)
