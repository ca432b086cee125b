"""`build_dataset(data_cfg, split)`: the one entry point from `data.name` to a torch Dataset.

Every dataset yields (transform(img), int label) where img is an RGB PIL image (the rule
in images.py; image folders give a transform that reads files their bytes instead,
decode.py), and has `.classes` (list of str), `.targets` (list or 1-D int array) and
`.source` (where its files were found).

| data.name     | splits                       | files (see its module)                    |
|---------------|------------------------------|-------------------------------------------|
| fashion_mnist | train, test                  | idx files: data.root, cache, Debian pkg   |
| imagefolder   | train, test (= val/)         | data.root/train/<class>/, data.root/val/  |
| imagenet      | train, test (= val/)         | as imagefolder (1000 class folders)       |
| cifar10       | train, test                  | torchvision: data.root or cache           |
| cifar100      | train, test                  | torchvision: data.root or cache           |
| stl10         | train, test, unlabeled       | torchvision: data.root or cache           |
| folder        | train (unlabeled)            | any image under data.root, or data.files  |

`data.subset=N` replaces the training splits (train, and STL-10's unlabeled) by a
deterministic, class-balanced subset of N images (subset.py; a seeded pick where there are
no labels); the test split stays whole.

`folder` has no labels: DINO trains on it, and its k-NN and linear probe read the labeled
set eval.data and eval.root name (resmlp.eval.judge resolves it); the commands that report
an accuracy refuse it (`require_classes`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from omegaconf import OmegaConf

from resmlp.core.config import choices, recipe_setting
from resmlp.core.errors import UserError
from resmlp.data import fashion_mnist, folder, imagefolder, torchvision_sets
from resmlp.data.decode import reads_files
from resmlp.data.folder import FileLists, serve_encoded
from resmlp.data.subset import make_subset


@dataclass(frozen=True)
class DatasetInfo:
    build: Callable           # (data_cfg, split, transform) -> Dataset
    splits: tuple             # split names it has
    num_classes: int | None   # known without touching files (None: count class folders)
    classes: tuple | None     # known names (None: read them)
    labeled: bool = True      # False: images without labels (DINO only)
    files: bool = False       # image files on disk (else decoded images in memory)


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")
STL10_CLASSES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck")

DATASETS: dict[str, DatasetInfo] = {
    "fashion_mnist": DatasetInfo(fashion_mnist.build, ("train", "test"), 10, tuple(fashion_mnist.CLASSES)),
    "imagefolder": DatasetInfo(imagefolder.build, ("train", "test"), None, None, files=True),
    "imagenet": DatasetInfo(imagefolder.build, ("train", "test"), None, None, files=True),
    "cifar10": DatasetInfo(torchvision_sets.build, ("train", "test"), 10, CIFAR10_CLASSES),
    "cifar100": DatasetInfo(torchvision_sets.build, ("train", "test"), 100, None),
    "stl10": DatasetInfo(torchvision_sets.build, ("train", "test", "unlabeled"), 10, STL10_CLASSES),
    "folder": DatasetInfo(folder.build, ("train",), 0, (), labeled=False, files=True),
}
LABELED = tuple(name for name in choices("eval.data") if name is not None)  # the sets with labels (each `labeled`)

SUBSET_SPLITS = ("train", "unlabeled")


def dataset_info(data_cfg) -> DatasetInfo:
    name = data_cfg.name
    if name not in DATASETS:
        raise UserError(f"data.name={name} is not a dataset; choose one of {', '.join(DATASETS)}")
    return DATASETS[name]


def dataset_splits(data_cfg) -> tuple:
    """The split names `data.name` has, e.g. ('train', 'test')."""
    return dataset_info(data_cfg).splits


def train_split_for_ssl(data_cfg) -> str:
    """The split self-supervised pretraining (DINO) reads: 'unlabeled' for stl10, else 'train'."""
    return "unlabeled" if "unlabeled" in dataset_splits(data_cfg) else "train"


def build_dataset(data_cfg, split: str, transform=None, lists: FileLists | None = None):
    """The `split` ('train' | 'test' | 'unlabeled' for stl10) of `data.name`, subset applied.

    `transform` is applied to the RGB PIL image, or, for a transform that reads files
    (resmlp.data.decode), to the file's bytes. `lists`: a run's FileLists, which scans a
    folder (data=folder) once per run dir. A missing or broken dataset is a UserError.
    """
    info = dataset_info(data_cfg)
    if info.build is folder.build:
        dataset = folder.build(data_cfg, split, transform, lists)
    elif split not in info.splits:
        raise UserError(f"data.name={data_cfg.name} has splits {', '.join(info.splits)}, not {split!r}")
    else:
        dataset = info.build(data_cfg, split, transform)
    if reads_files(transform):
        serve_encoded(dataset)
    n = data_cfg.subset
    if n is not None and split in SUBSET_SPLITS:
        dataset = make_subset(dataset, n)
    return dataset


def fit_demo_subset(cfg, lists: FileLists | None = None) -> str | None:
    """The CPU demo (cfg.demo) takes data.subset training images, or all of them where the
    training split holds fewer: then data.subset becomes null (the config a run saves says
    what it used) and the note that says so is returned. Call it before the run dir's config
    is compared or saved. `lists`: the run's FileLists (data=folder: no second scan)."""
    n = cfg.data.subset
    if not cfg.demo or n is None:
        return None
    have = len(build_dataset(OmegaConf.merge(cfg.data, {"subset": None}), "train", lists=lists))
    if have >= int(n):
        return None
    # the demo's own size, which a user who set no subset never asked for
    recipe = recipe_setting(cfg, "data.subset")
    asked = f"the {n} the recipe {recipe} asks for" if recipe else f"the data.subset={n} asked for"
    cfg.data.subset = None
    return f"the CPU demo takes all {have} images of the training split, fewer than {asked}"


def num_classes(data_cfg) -> int:
    """Number of classes; a constant, or one listing of root/train/ for image folders."""
    info = dataset_info(data_cfg)
    if info.num_classes is not None:
        return info.num_classes
    return len(imagefolder.train_classes(data_cfg))


def one_class_problem(data_cfg, what: str) -> str | None:
    """Why `what` (an accuracy) would mean nothing on this data set: one class scores 100%
    whatever the network does. None with two classes or more, and for a set without labels
    (labels_problem)."""
    if not dataset_info(data_cfg).labeled or num_classes(data_cfg) >= 2:
        return None
    names = class_names(data_cfg)
    where = f"data.root={data_cfg.get('root')}" if dataset_info(data_cfg).build is imagefolder.build else \
        f"data={data_cfg.name}"
    return (f"{where} has one class ({names[0] if names else '?'}): {what} over one class is 100% whatever the "
            "network learned; give the data set a folder per class, at least two (train/<class>/, val/<class>/)")


def labels_problem(data_cfg, what: str) -> str | None:
    """Why `what` (an accuracy) cannot be had from this data set: it has no labels. None
    for a labeled set."""
    if dataset_info(data_cfg).labeled:
        return None
    where = data_cfg.get("files", None) or data_cfg.root
    return (f"data={data_cfg.name} ({where}) holds images without labels: {what} needs a labeled set; name one "
            f"with data=<{'|'.join(LABELED)}> data.root=DIR (e.g. the eval.data and eval.root the DINO run was "
            "judged on)")


def require_classes(data_cfg, what: str) -> int:
    """num_classes, or a UserError where the set has no labels or one class makes `what`
    meaningless."""
    problem = labels_problem(data_cfg, what) or one_class_problem(data_cfg, what)
    if problem:
        raise UserError(problem)
    return num_classes(data_cfg)


def check_split_classes(data_cfg) -> None:
    """The test split has the training split's classes: an image folder's val/ holds the
    class folders of train/ (one listing each, no image read, so an evaluator refuses a
    mismatch before it extracts anything); the other data sets' classes are fixed."""
    if dataset_info(data_cfg).build is imagefolder.build:
        imagefolder.check_classes(imagefolder.split_dir(data_cfg, "test"), imagefolder.train_classes(data_cfg))


def class_names(data_cfg) -> list[str]:
    """Class names in label order (reads the folder listing or CIFAR-100's meta file)."""
    info = dataset_info(data_cfg)
    if info.classes is not None:
        return list(info.classes)
    if info.build is imagefolder.build:
        return imagefolder.train_classes(data_cfg)
    return list(build_dataset(data_cfg, "test").classes)
