"""Training data order and augmentation that depend only on (seed, epoch, sample).

Two promises every trainer relies on:
- resume: a run stopped mid-epoch and resumed sees exactly the batches it would have seen;
- scale: N processes on a global batch see the same images and augmentations as one
  process on that batch (the sampler deals one shuffled order out to the ranks).
The sampler therefore yields `epoch * len(dataset) + index`, and `SeededTransform`
seeds the augmentation of each sample from (seed, epoch, index) inside whichever
worker process handles it.
"""
from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from resmlp.core import dist
from resmlp.core.preempt import shield_worker
from resmlp.data.decode import reads_files
from resmlp.data.imagefolder import serve_encoded
from resmlp.data.loader import cap_workers


class EpochSampler(Sampler[int]):
    """Shuffle per epoch from (seed, epoch); rank r takes positions r, r+W, r+2W, ...

    Drops the tail so every rank gets the same number of full batches, and can start
    at a batch offset (`set_epoch(epoch, start_batch)`) to resume mid-epoch.
    """

    def __init__(self, n: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None):
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.rank = dist.rank() if rank is None else rank
        self.world_size = dist.world_size() if world_size is None else world_size
        self.batches_per_epoch = n // (batch_size * self.world_size)
        if self.batches_per_epoch == 0:
            from resmlp.core.errors import UserError
            raise UserError(f"{n} training images are fewer than one global batch of "
                            f"{batch_size * self.world_size}; lower batch_size")
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        used = self.batches_per_epoch * self.batch_size * self.world_size
        mine = order[:used][self.rank::self.world_size]
        return mine[self.start_batch * self.batch_size:].tolist()

    def __iter__(self):
        offset = self.epoch * self.n
        return iter([offset + i for i in self.indices()])

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


class SeededTransform(Dataset):
    """Apply `transform` to `dataset[index]` with RNGs seeded from (seed, epoch, index)."""

    def __init__(self, dataset, transform, seed: int = 0):
        self.dataset, self.transform, self.seed = dataset, transform, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int):
        epoch, index = divmod(int(key), len(self.dataset))
        image, label = self.dataset[index]
        s = (self.seed * 1_000_003 + epoch) * 10_000_019 + index
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)
        return self.transform(image), label


class KeyedDataset(Dataset):
    """(transform(image), label, key) for keys `epoch * len + index` as EpochSampler yields
    them: for augmentation done later on whole batches (data/gpu_augment.py), which seeds
    each sample from its key."""

    def __init__(self, dataset, transform=None):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int):
        _, index = divmod(int(key), len(self.dataset))
        image, label = self.dataset[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, label, int(key)


def build_train_loader(dataset, transform, batch_size: int, seed: int, num_workers: int,
                       pin_memory: bool = False, keyed: bool = False,
                       collate_fn=None) -> tuple[DataLoader, EpochSampler]:
    """A loader over `SeededTransform(dataset)` (or `KeyedDataset` with keyed=True, for a
    batch augmentation stage); call `sampler.set_epoch(epoch, start_batch)` every epoch.
    A transform that reads files (resmlp.data.decode) gets the files' bytes."""
    sampler = EpochSampler(len(dataset), batch_size, seed=seed)
    num_workers = cap_workers(num_workers)
    if reads_files(transform):
        serve_encoded(dataset)
    wrapped = KeyedDataset(dataset, transform) if keyed else SeededTransform(dataset, transform, seed)
    loader = DataLoader(wrapped, batch_size=batch_size, collate_fn=collate_fn,
                        sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                        drop_last=True, persistent_workers=num_workers > 0,
                        prefetch_factor=4 if num_workers > 0 else None,
                        worker_init_fn=shield_worker if num_workers > 0 else None)
    return loader, sampler
