"""Repeated augmentation (Hoffer et al. 2020; DeiT's RASampler) on the resumable sampler.

timm's RepeatAugSampler does not fit here: our loader seeds each sample's augmentation
from (seed, epoch, index) so that a resumed run sees the same images, and three copies
of one index in one epoch would get three identical augmentations. This sampler
therefore yields keys that the loader's SeededTransform reads as (epoch * R + r, index):
copy r of an image gets its own augmentation, still a function of (seed, epoch, index).

As in DeiT, every image of a shuffled order is repeated R times, the copies are dealt
out to the ranks in turn (R ranks see R views of one image), and an epoch keeps the
number of iterations of a plain epoch, so it covers about 1/R of the distinct images.
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from resmlp.core.preempt import shield_worker
from resmlp.data.resumable import EpochSampler, SeededTransform


class RepeatAugSampler(EpochSampler):
    def __init__(self, n: int, batch_size: int, repeats: int = 3, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None):
        super().__init__(n, batch_size, seed=seed, shuffle=True, rank=rank, world_size=world_size)
        self.repeats = int(repeats)

    def keys(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g)
        used = self.batches_per_epoch * self.batch_size * self.world_size
        index = order.repeat_interleave(self.repeats)[:used]
        copy = torch.arange(self.repeats).repeat(self.n)[:used]
        keys = (self.epoch * self.repeats + copy) * self.n + index
        return keys[self.rank::self.world_size][self.start_batch * self.batch_size:].tolist()

    def __iter__(self):
        return iter(self.keys())


def build_repeat_aug_loader(dataset, transform, batch_size: int, repeats: int, seed: int, num_workers: int,
                            pin_memory: bool = False) -> tuple[DataLoader, RepeatAugSampler]:
    """build_train_loader's loader with the repeated-augmentation sampler."""
    sampler = RepeatAugSampler(len(dataset), batch_size, repeats, seed=seed)
    loader = DataLoader(SeededTransform(dataset, transform, seed), batch_size=batch_size, sampler=sampler,
                        num_workers=num_workers, pin_memory=pin_memory, drop_last=True,
                        persistent_workers=num_workers > 0, prefetch_factor=4 if num_workers > 0 else None,
                        worker_init_fn=shield_worker if num_workers > 0 else None)
    return loader, sampler
