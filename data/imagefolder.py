"""Image folders: `root/train/<class>/...` and `root/val/<class>/...` (the test split is val/).

Rules, each broken one is a UserError naming what to fix:
- data.root must be set and exist, and hold train/ (and val/ for the test split);
- classes are the sub-folders of train/ (sorted; hidden ones skipped); val/ must have
  exactly the same ones (the error names the extra and the missing ones);
- images are files with an extension in images.IMG_EXTENSIONS, found recursively in a
  class folder (symlinks followed); other files (README.txt, .DS_Store, ...) are ignored;
- every class folder needs at least one image (an empty one is named);
- an unreadable (corrupt, truncated) image is named when it is loaded. With
  data.skip_corrupt=true every image is opened once when the dataset is built and the
  unreadable ones are left out (a printed line says how many); with data.check=true
  the same scan runs and any unreadable image stops the build.

ImageNet is this layout too (val/ sorted into the 1000 class folders, as DINO expects).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from resmlp.core import dist
from resmlp.core.errors import UserError
from resmlp.data.decode import read_encoded
from resmlp.data.images import IMG_EXTENSIONS, find_unreadable, is_image_file, load_rgb
from resmlp.data.paths import user_root

SPLIT_DIRS = {"train": "train", "test": "val"}
_LAYOUT = "expected <root>/train/<class>/<image> and <root>/val/<class>/<image>"


def class_folders(split_dir: str) -> list[str]:
    """Sorted names of the (non-hidden) sub-folders of `split_dir`."""
    return sorted(e.name for e in os.scandir(split_dir)
                  if not e.name.startswith(".") and e.is_dir(follow_symlinks=True))


def images_under(folder: str) -> list[str]:
    """Sorted paths of all image files below `folder`, recursively."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if is_image_file(f))
    return found


def split_dir(data_cfg, split: str) -> str:
    """The folder of one split, after checking root and layout."""
    name = data_cfg.get("name", "imagefolder")
    root = user_root(data_cfg)
    if root is None:
        raise UserError(f"data.root is not set: data.name={name} needs data.root=<folder>; {_LAYOUT}")
    if not os.path.isdir(root):
        raise UserError(f"data.root={root} does not exist; {_LAYOUT}")
    if split not in SPLIT_DIRS:
        raise UserError(f"data.name={name} has splits train and test (val/), not {split!r}")
    train = os.path.join(root, "train")
    if not os.path.isdir(train):
        raise UserError(f"data.root={root} has no train/ folder; {_LAYOUT}")
    folder = os.path.join(root, SPLIT_DIRS[split])
    if not os.path.isdir(folder):
        raise UserError(f"data.root={root} has no {SPLIT_DIRS[split]}/ folder for the {split} split; {_LAYOUT}")
    return folder


def train_classes(data_cfg) -> list[str]:
    """Class names: the class folders of root/train/ (cheap: one directory listing)."""
    train = split_dir(data_cfg, "train")
    classes = class_folders(train)
    if not classes:
        loose = [f for f in os.listdir(train) if is_image_file(f)]
        extra = f" ({len(loose)} images lie directly in it: move them into class folders)" if loose else ""
        raise UserError(f"{train} has no class folders{extra}; {_LAYOUT}")
    return classes


def check_classes(folder: str, classes: list[str]) -> None:
    """folder holds exactly the class folders of train/ (one listing, no image read)."""
    present = class_folders(folder)
    if present != classes:
        extra = sorted(set(present) - set(classes))
        missing = sorted(set(classes) - set(present))
        parts = []
        if extra:
            parts.append(f"extra class folders {extra} not in train/")
        if missing:
            parts.append(f"missing class folders {missing} that train/ has")
        raise UserError(f"{folder} does not have the classes of train/: {'; '.join(parts)}; "
                        f"make both hold the same class folders")


def scan(folder: str, classes: list[str]) -> list[tuple[str, int]]:
    """[(path, label)] of every image under folder/<class>/, checking the folder rules."""
    check_classes(folder, classes)
    per_class = [images_under(os.path.join(folder, c)) for c in classes]
    if not any(per_class):
        raise UserError(f"no images under {folder} (looked for {' '.join(IMG_EXTENSIONS)} in its "
                        f"{len(classes)} class folders); {_LAYOUT}")
    check_nonempty(folder, classes, per_class)
    return [(p, label) for label, paths in enumerate(per_class) for p in paths]


def check_nonempty(folder: str, classes: list[str], per_class: list[list]) -> None:
    empty = [c for c, paths in zip(classes, per_class) if not paths]
    if empty:
        shown = ", ".join(os.path.join(folder, c) for c in empty[:5])
        more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
        raise UserError(f"empty class folder {shown}{more}: it holds no images; "
                        f"add images or remove the folder")


def _scan_unreadable(paths: list[str]) -> list[tuple[str, str]]:
    """find_unreadable, run by rank 0 only and shared with the other ranks when distributed."""
    bad = find_unreadable(paths) if dist.is_main() else None
    return dist.broadcast_object(bad)


class ImageFolder(torch.utils.data.Dataset):
    """One split of an image-folder dataset, yielding (transform(RGB PIL image), int label).

    Attributes: `classes` (folder names), `class_to_idx`, `targets` (int64 array),
    `samples` [(path, label)], `skipped` [(path, reason)] (unreadable files left out),
    `source` (the split folder). Paths are kept in one numpy bytes array, not a list of
    Python strings, so forked loader workers share them instead of copying them page by
    page (a list of 1.28M strings is touched by refcounting and the GC).
    """

    def __init__(self, folder: str, classes: list[str], transform=None,
                 skip_corrupt: bool = False, check: bool = False):
        self.root = folder
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.transform = transform
        samples = scan(folder, self.classes)
        self.skipped: list[tuple[str, str]] = []
        if skip_corrupt or check:
            if dist.is_main():
                print(f"data: opening all {len(samples)} images under {folder} "
                      f"to find unreadable ones", flush=True)
            bad = _scan_unreadable([p for p, _ in samples])
            if bad and not skip_corrupt:
                path, reason = bad[0]
                raise UserError(
                    f"{len(bad)} unreadable image(s) under {folder}, the first {path} ({reason}); "
                    f"fix or delete them or set data.skip_corrupt=true "
                    f"(`run.sh data data.check=true` lists them all)")
            if bad:
                drop = {p for p, _ in bad}
                samples = [s for s in samples if s[0] not in drop]
                self.skipped = bad
                per_class = [[p for p, y in samples if y == i] for i in range(len(self.classes))]
                check_nonempty(folder, self.classes, per_class)
            if skip_corrupt and dist.is_main():
                print(f"data: skipped {len(bad)} unreadable image(s) under {folder} "
                      f"(data.skip_corrupt=true)", flush=True)
        self._paths = np.array([os.fsencode(p) for p, _ in samples], dtype=bytes)
        # True: yield the files' bytes (decode.EncodedImage) for a transform that decodes
        # them itself (serve_encoded); False: decoded RGB PIL images.
        self.encoded = False
        self.targets = np.array([y for _, y in samples], dtype=np.int64)
        self.source = folder

    @property
    def samples(self) -> list[tuple[str, int]]:
        return [(os.fsdecode(p), int(y)) for p, y in zip(self._paths, self.targets)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        path = os.fsdecode(self._paths[index])
        # UserError naming the file when it cannot be read (for encoded: when decoded)
        img = read_encoded(path) if self.encoded else load_rgb(path)
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.targets[index])


def build(data_cfg, split: str, transform=None) -> ImageFolder:
    classes = train_classes(data_cfg)
    folder = split_dir(data_cfg, split)
    return ImageFolder(folder, classes, transform,
                       skip_corrupt=bool(data_cfg.get("skip_corrupt", False)),
                       check=bool(data_cfg.get("check", False)))


def serve_encoded(dataset) -> bool:
    """Make the file dataset under `dataset` (through subset wrappers) yield EncodedImage
    instead of PIL images. False when there are no files (in-memory datasets)."""
    seen = 0
    while not isinstance(dataset, ImageFolder) and seen < 8:
        inner = getattr(dataset, "base", None) or getattr(dataset, "dataset", None)
        if inner is None:
            return False
        dataset, seen = inner, seen + 1
    if not isinstance(dataset, ImageFolder):
        return False
    dataset.encoded = True
    return True
