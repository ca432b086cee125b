"""Image folders: `root/train/<class>/...` and `root/val/<class>/...` (the test split is val/).

Rules, each broken one is a UserError naming what to fix:
- data.root must be set and exist, and hold train/ (and val/ for the test split);
- classes are the sub-folders of train/ (sorted; hidden ones skipped); val/ must have
  exactly the same ones (the error names the extra and the missing ones);
- images are files with an extension in images.IMG_EXTENSIONS, found at any depth in a
  class folder by folder.scan_folder (symlinks followed once); other files (README.txt,
  .DS_Store, a photo without its extension, files outside the class folders) are skipped
  and counted in the dataset's `skipped`, which `run.sh data` names;
- every class folder needs at least one image (an empty one is named);
- an unreadable (corrupt, truncated) image is named when it is loaded. With
  data.skip_corrupt=true every image is opened once when the dataset is built and the
  unreadable ones are left out (`unreadable`; a printed line says how many); with data.check=true
  the same scan runs and any unreadable image stops the build.

ImageNet is this layout too (val/ sorted into the 1000 class folders, as DINO expects).
"""
from __future__ import annotations

import os

from resmlp.core.errors import UserError
from resmlp.data.folder import HIDDEN, ImageFiles, Skipped, scan_folder, screen, serve_encoded  # noqa: F401
from resmlp.data.images import IMG_EXTENSIONS, is_image_file
from resmlp.data.paths import user_root

SPLIT_DIRS = {"train": "train", "test": "val"}
_LAYOUT = "expected <root>/train/<class>/<image> and <root>/val/<class>/<image>"
LOOSE = "files outside the class folders (not read)"


def class_folders(split_dir: str) -> list[str]:
    """Sorted names of the (non-hidden) sub-folders of `split_dir`."""
    return sorted(e.name for e in os.scandir(split_dir)
                  if not e.name.startswith(".") and e.is_dir(follow_symlinks=True))


def split_dir(data_cfg, split: str, key: str = "data.root") -> str:
    """The folder of one split, after checking root and layout; the errors name `key`, the
    config key the user gave the root as (eval.root for the DINO run's labeled set)."""
    name = data_cfg.name
    root = user_root(data_cfg, key)
    if root is None:
        raise UserError(f"{key} is not set: data.name={name} needs {key}=<folder>; {_LAYOUT}")
    if not os.path.isdir(root):
        raise UserError(f"{key}={root} does not exist; {_LAYOUT}")
    if split not in SPLIT_DIRS:
        raise UserError(f"data.name={name} has splits train and test (val/), not {split!r}")
    train = os.path.join(root, "train")
    if not os.path.isdir(train):
        raise UserError(f"{key}={root} has no train/ folder; {_LAYOUT}{_no_train_hint(root, key)}")
    folder = os.path.join(root, SPLIT_DIRS[split])
    if not os.path.isdir(folder):
        raise UserError(f"{key}={root} has no {SPLIT_DIRS[split]}/ folder for the {split} split; {_LAYOUT}")
    return folder


def _no_train_hint(root: str, key: str) -> str:
    """What a root without train/ most likely is: one split of a labeled set, or images
    without labels (the first image found, at any depth, ends the look)."""
    parent = os.path.dirname(root)
    if os.path.basename(root) in SPLIT_DIRS.values() and os.path.isdir(os.path.join(parent, "train")):
        return f"; {root} is a split folder itself: pass {key}={parent}"
    found = next((f for _, _, files in os.walk(root, followlinks=True) for f in files if is_image_file(f)), None)
    if found is None:
        return ""
    if key == "data.root":
        return "; it holds images without class folders: data=folder reads those (DINO needs no labels)"
    return f"; it holds images without class folders: {key} needs a labeled set to score the k-NN"


def train_classes(data_cfg, key: str = "data.root") -> list[str]:
    """Class names: the class folders of root/train/ (cheap: one directory listing)."""
    train = split_dir(data_cfg, "train", key)
    classes = class_folders(train)
    if not classes:
        loose = [f for f in os.listdir(train) if is_image_file(f)]
        extra = f" ({len(loose)} images lie directly in it: move them into class folders)" if loose else ""
        unlabeled = "; data=folder reads images without labels" if key == "data.root" else ""
        raise UserError(f"{train} has no class folders{extra}; {_LAYOUT}{unlabeled}")
    return classes


def check_layout(data_cfg, key: str) -> None:
    """train/ with class folders and val/ under the root, checked before any work, the
    errors naming `key`."""
    train_classes(data_cfg, key)
    split_dir(data_cfg, "test", key)


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


def scan(folder: str, classes: list[str]) -> tuple[list[tuple[str, int]], Skipped]:
    """([(path, label)] of every image under folder/<class>/, what was skipped), checking the
    folder rules. Files lying directly in the split folder are skipped and counted too."""
    check_classes(folder, classes)
    skipped = Skipped()
    for e in sorted(os.scandir(folder), key=lambda e: e.name):
        if e.name.startswith("."):
            skipped.add(HIDDEN, e.path)
        elif not e.is_dir():
            skipped.add(LOOSE, e.path)
    scans = [scan_folder(os.path.join(folder, c)) for c in classes]
    per_class = [s.paths for s in scans]
    for s in scans:
        skipped.merge(s.skipped)
    if not any(per_class):
        raise UserError(f"no images under {folder} (looked for {' '.join(IMG_EXTENSIONS)} in its "
                        f"{len(classes)} class folders; skipped {skipped.total()} other entries); {_LAYOUT}")
    check_nonempty(folder, classes, per_class)
    return [(p, label) for label, paths in enumerate(per_class) for p in paths], skipped


def check_nonempty(folder: str, classes: list[str], per_class: list[list]) -> None:
    empty = [c for c, paths in zip(classes, per_class) if not paths]
    if empty:
        shown = ", ".join(os.path.join(folder, c) for c in empty[:5])
        more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
        raise UserError(f"empty class folder {shown}{more}: it holds no images; "
                        f"add images or remove the folder")


class ImageFolder(ImageFiles):
    """One split of an image-folder dataset, yielding (transform(RGB PIL image), int label):
    folder.ImageFiles with `classes` the class folders, `root` the split folder."""

    def __init__(self, folder: str, classes: list[str], transform=None,
                 skip_corrupt: bool = False, check: bool = False):
        samples, skipped = scan(folder, list(classes))
        bad = screen([p for p, _ in samples], folder, skip_corrupt, check)
        if bad:
            drop = {p for p, _ in bad}
            samples = [s for s in samples if s[0] not in drop]
            per_class = [[p for p, y in samples if y == i] for i in range(len(classes))]
            check_nonempty(folder, list(classes), per_class)
        super().__init__([p for p, _ in samples], [y for _, y in samples], classes, transform, folder,
                         skipped, bad)
        self.root = folder


def build(data_cfg, split: str, transform=None) -> ImageFolder:
    classes = train_classes(data_cfg)
    folder = split_dir(data_cfg, split)
    return ImageFolder(folder, classes, transform,
                       skip_corrupt=bool(data_cfg.skip_corrupt),
                       check=bool(data_cfg.check))
