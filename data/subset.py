"""`data.subset=N`: a deterministic, class-balanced subset of N images of a training split.

The pick depends only on the labels, N and SUBSET_SEED (not on the run's seed), so
every run, process and machine gets the same N images. Quotas are as equal as the
classes allow: each class gets N // C or N // C + 1 images, and a class with fewer
images than its share gives all of them and the rest is spread over the others.
Unlabeled data (all labels < 0, STL-10's unlabeled split) gets a uniform random pick.
Indices are kept in dataset order.
"""
from __future__ import annotations

import numpy as np
import torch

from resmlp.core.errors import UserError

SUBSET_SEED = 0


def quotas(counts: np.ndarray, n: int) -> np.ndarray:
    """Images per class summing to n, as equal as possible, never above a class's count."""
    q = np.zeros(len(counts), dtype=np.int64)
    order = np.argsort(counts, kind="stable")  # smallest classes first: they may cap
    remaining, left = n, len(counts)
    for k in order:
        share = remaining // left
        q[k] = min(int(counts[k]), share)
        remaining -= q[k]
        left -= 1
    # remainders end up in the largest classes; hand out any still left one at a time
    for k in order[::-1]:
        if remaining == 0:
            break
        take = min(int(counts[k] - q[k]), remaining)
        q[k] += take
        remaining -= take
    return q


def balanced_subset_indices(targets, n: int, num_classes: int, seed: int = SUBSET_SEED) -> np.ndarray:
    """Sorted indices of a class-balanced subset of `n` items with labels `targets`."""
    targets = np.asarray(targets, dtype=np.int64)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise UserError(f"data.subset={n!r} must be a positive number of images (or null for all)")
    if n > len(targets):
        raise UserError(f"data.subset={n} is larger than the {len(targets)} images of the split; "
                        f"use data.subset={len(targets)} or less, or data.subset=null for all of them")
    rng = np.random.default_rng(seed)
    if len(targets) and (targets < 0).all():
        return np.sort(rng.choice(len(targets), size=n, replace=False))
    if n < num_classes:
        raise UserError(f"data.subset={n} is smaller than the {num_classes} classes; "
                        f"use at least one image per class (data.subset={num_classes} or more)")
    counts = np.bincount(targets[targets >= 0], minlength=num_classes)
    picked = []
    for k, q in enumerate(quotas(counts, n)):
        members = np.flatnonzero(targets == k)
        picked.append(members[rng.permutation(len(members))[:q]])
    return np.sort(np.concatenate(picked))


class SubsetDataset(torch.utils.data.Dataset):
    """`base` restricted to `indices`, keeping `classes`, `targets` and `source`."""

    def __init__(self, base, indices):
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.classes = base.classes
        self.targets = np.asarray(base.targets, dtype=np.int64)[self.indices]
        self.source = f"{base.source} (subset of {len(self.indices)} of {len(base)} images)"

    @property
    def transform(self):
        return self.base.transform

    @transform.setter
    def transform(self, value):
        self.base.transform = value

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.base[int(self.indices[index])]


def make_subset(dataset, n: int, seed: int = SUBSET_SEED) -> SubsetDataset:
    return SubsetDataset(dataset, balanced_subset_indices(dataset.targets, n, len(dataset.classes), seed))
