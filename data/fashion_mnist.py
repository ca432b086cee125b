"""Fashion-MNIST from its four idx files: 60,000 train / 10,000 test, 28x28 gray, 10 classes.

Where the files are looked for, first hit wins (every place may hold the four files
`{train,t10k}-{images-idx3,labels-idx1}-ubyte`, gzipped or not, directly or under
`FashionMNIST/raw/` as torchvision lays them out):

1. `data.root`, when set (and nowhere else: a wrong root is an error, not a fallback);
2. the folders in `search_dirs()`: the download cache `data_dir()` (see paths.py), then
   Debian's package folder /usr/share/datasets/fashion-mnist/ (`apt-get install
   dataset-fashion-mnist`). `$RESMLP_FMNIST_SEARCH` (folders joined by ":") replaces
   this list, e.g. to point tests at an empty place;
3. a torchvision download into `data_dir()` when `data.download` is true (only works on
   an online machine; a failure is reported, not raised).

Local folders are searched before the download is tried, so an offline machine never
waits on the network when the files are already on disk (they are the same files).
Nothing found: a UserError listing the three ways to get the data. There is no
fallback to random or synthetic data.

Images stay in memory as one uint8 array (N, 28, 28) per split (47 MB for train, read
once per process and shared by forked loader workers); `__getitem__` makes the PIL
image and converts it to RGB (the rule in images.py).
"""
from __future__ import annotations

import functools
import gzip
import os

import numpy as np
import torch
from PIL import Image

from resmlp.core.errors import UserError
from resmlp.data.paths import data_dir, main_process_first, user_root

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SIZES = {"train": 60000, "test": 10000}
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
SEARCH_ENV = "RESMLP_FMNIST_SEARCH"
_TV_SUBDIR = os.path.join("FashionMNIST", "raw")


def search_dirs() -> list[str]:
    """Folders searched when data.root is not set: `$RESMLP_FMNIST_SEARCH` or [cache, Debian]."""
    env = os.environ.get(SEARCH_ENV)
    if env is not None:
        return [os.path.expanduser(p) for p in env.split(os.pathsep) if p]
    return [data_dir(), DEBIAN_DIR]


def _file(folder: str, stem: str) -> str | None:
    for name in (stem, stem + ".gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def find_idx_dir(folder: str) -> str | None:
    """The folder holding all four idx files: `folder` or `folder/FashionMNIST/raw`, else None."""
    stems = [s for pair in FILES.values() for s in pair]
    for d in (folder, os.path.join(folder, _TV_SUBDIR)):
        if all(_file(d, s) for s in stems):
            return d
    return None


def read_idx(path: str) -> np.ndarray:
    """Read an idx file (gzipped or not) of unsigned bytes into an array of its shape."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0:2] != b"\x00\x00" or raw[2] != 0x08:
        raise UserError(f"{path} is not an idx file of unsigned bytes; replace it with the original file")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    if len(raw) - offset != int(np.prod(shape)):
        raise UserError(f"{path} is truncated: header says {shape}, file holds "
                        f"{len(raw) - offset} bytes; replace it with the original file")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape)


@functools.lru_cache(maxsize=4)
def load_split(folder: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 28, 28], labels int64 [N]) of one split from an idx folder (cached)."""
    img_stem, lbl_stem = FILES[split]
    img_path, lbl_path = _file(folder, img_stem), _file(folder, lbl_stem)
    images, labels = read_idx(img_path), read_idx(lbl_path).astype(np.int64)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise UserError(f"{img_path} and {lbl_path} do not match (images {images.shape}, "
                        f"labels {labels.shape}); replace them with the original files")
    if labels.size and (labels.min() < 0 or labels.max() >= len(CLASSES)):
        raise UserError(f"{lbl_path} holds labels outside 0..9; replace it with the original file")
    return images, labels


def _describe(folder: str) -> str:
    if os.path.realpath(folder).startswith(os.path.realpath(DEBIAN_DIR)):
        return f"{folder} (Debian package dataset-fashion-mnist)"
    return folder


def _download(target: str) -> str:
    """Fetch with torchvision into `target`; '' on success, else why it failed (one line)."""
    import torchvision

    try:
        with main_process_first():
            for train in (True, False):
                torchvision.datasets.FashionMNIST(target, train=train, download=True)
    except Exception as e:  # offline: URLError / RuntimeError from torchvision
        return " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return ""


def locate(data_cfg, key: str = "data.root") -> tuple[str, str]:
    """(folder holding the four idx files, description of where they were found). `key`:
    the config key the user gave the root as (eval.root for the DINO run's labeled set)."""
    root = user_root(data_cfg, key)
    if root is not None:
        found = find_idx_dir(root)
        if found is None:
            raise UserError(
                f"{key}={root} holds no Fashion-MNIST: expected the four files "
                f"train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
                f"t10k-labels-idx1-ubyte (.gz or not) in it or in its FashionMNIST/raw/; "
                f"fix {key} or unset it to search {', '.join(search_dirs())}")
        return found, found
    looked = search_dirs()
    for folder in looked:
        found = find_idx_dir(folder)
        if found is not None:
            return found, _describe(found)
    tried = "data.download=false"
    if data_cfg.download:
        target = data_dir()
        failure = _download(target)
        found = find_idx_dir(target)
        if found is not None:
            return found, f"{found} (downloaded by torchvision)"
        tried = f"download into {target} failed: {failure or 'files missing afterwards'}"
    raise UserError(
        f"Fashion-MNIST not found (searched {', '.join(looked) or 'nothing'}; {tried}). "
        f"Get it one of three ways: set data.root=<folder with the four idx files>, "
        f"run once on an online machine with data.download=true (it is saved under {data_dir()}), "
        f"or `apt-get install dataset-fashion-mnist` (installs {DEBIAN_DIR})")


class FashionMNIST(torch.utils.data.Dataset):
    """One split of Fashion-MNIST, yielding (transform(RGB PIL image), int label).

    Attributes: `classes` (10 names), `targets` (int64 array), `images` (uint8
    [N, 28, 28]), `source` (where the files were found).
    """

    def __init__(self, folder: str, split: str, transform=None, source: str | None = None):
        if split not in FILES:
            raise UserError(f"Fashion-MNIST has splits train and test, not {split!r}")
        self.images, self.targets = load_split(folder, split)
        self.classes = list(CLASSES)
        self.split = split
        self.transform = transform
        self.source = source or folder

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        img = Image.fromarray(self.images[index]).convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.targets[index])


def build(data_cfg, split: str, transform=None) -> FashionMNIST:
    folder, source = locate(data_cfg)
    return FashionMNIST(folder, split, transform, source)
