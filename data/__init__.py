"""Data: datasets, transforms and loaders shared by every command.

Datasets yield (transform(RGB PIL image), int label) and have .classes, .targets and
.source; every image becomes 3-channel RGB (see images.py). The modules:

- datasets.py       build_dataset, train_split_for_ssl, num_classes, class_names
- fashion_mnist.py, imagefolder.py, torchvision_sets.py   one per source of files
- folder.py         finding image files (every image folder's scan); data=folder, images
                    without labels, scanned once per run dir (FileLists)
- subset.py         data.subset: deterministic class-balanced subsets
- transforms.py     eval and linear-probe transforms, mean/std
- multicrop.py      DINO multi-crop per image (the dino.augment=workers path)
- decode.py         fast decoding in the workers: whole images for the device path
                    (gpu_augment.py), uint8 tensors for the eval transforms
- loader.py         build_loader, set_epoch, ShardSampler, worker error unwrapping
- inspect.py        `run.sh data`; preview.py: `run.sh data data.preview=N`
"""
from resmlp.data.datasets import (build_dataset, class_names, dataset_splits, num_classes,
                                  train_split_for_ssl)
from resmlp.data.loader import ShardSampler, build_loader, set_epoch, worker_error_message
from resmlp.data.multicrop import MultiCropTransform, ViewSpec, build_multicrop_transform
from resmlp.data.transforms import build_eval_transform, build_linear_train_transform, mean_std

__all__ = [
    "build_dataset", "class_names", "dataset_splits", "num_classes", "train_split_for_ssl",
    "ShardSampler", "build_loader", "set_epoch", "worker_error_message",
    "MultiCropTransform", "ViewSpec", "build_multicrop_transform",
    "build_eval_transform", "build_linear_train_transform", "mean_std",
]
