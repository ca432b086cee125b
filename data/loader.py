"""`build_loader`: a DataLoader with the sampler, seeding and worker settings every command uses.

batch_size is per process. Samplers:
- training: torch's DistributedSampler (shuffle, seed, drop_last), with the real world
  size under torch.distributed and as a world of one otherwise. Each rank reads a
  distinct shard of floor(N / world) images of one permutation seeded by seed + epoch.
- evaluation: ShardSampler, no shuffle and no padding duplicates: rank r reads the
  contiguous block [r * N // W, (r + 1) * N // W). So concatenating the ranks' outputs in
  rank order (core.dist.all_gather_cat) gives back the dataset order exactly.

`set_epoch(loader, epoch)` must be called before each epoch: it sets the sampler's epoch
(permutation = f(seed + epoch), so a resumed run sees the same order as an uninterrupted
one) and re-seeds the loader's generator from (seed, rank, epoch), which seeds the
worker processes' RNGs (augmentations) when they start. With persistent workers they
start once, so augmentations are seeded per run, not per epoch; without workers they
draw from the global torch RNG.

Errors in workers: a UserError raised in a worker (an unreadable image) comes back to
the main process from torch as UserError("Caught UserError in DataLoader worker process
N.\\nOriginal Traceback ...\\nresmlp.core.errors.UserError: <message>"). Iterating a loader
made here re-raises it as UserError(<message>): one line, the original message.
`worker_error_message(exc)` does that unwrapping for any exception.
"""
from __future__ import annotations

import re

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from resmlp.core import dist
from resmlp.core.errors import UserError
from resmlp.core.preempt import shield_worker

_WRAPPED = re.compile(r"^[\w.]*UserError: (.*)$")


def worker_error_message(exc: BaseException) -> str:
    """The original one-line message of an exception, unwrapping torch's worker wrapper."""
    text = str(exc)
    if text.startswith("Caught ") and "Original Traceback" in text:
        for line in reversed(text.splitlines()):
            m = _WRAPPED.match(line.strip())
            if m:
                return m.group(1)
    return text.splitlines()[0] if text else type(exc).__name__


class ShardSampler(Sampler):
    """Rank `rank` of `num_replicas` gets the contiguous block [r*N//W, (r+1)*N//W); no padding."""

    def __init__(self, dataset_len: int, num_replicas: int | None = None, rank: int | None = None):
        self.num_replicas = dist.world_size() if num_replicas is None else num_replicas
        self.rank = dist.rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} not in [0, {self.num_replicas})")
        self.start = self.rank * dataset_len // self.num_replicas
        self.stop = (self.rank + 1) * dataset_len // self.num_replicas

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start

    def set_epoch(self, epoch: int) -> None:  # same order every epoch
        pass


class Loader(DataLoader):
    """DataLoader whose iteration re-raises worker UserErrors with their one-line message."""

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed = seed

    def __iter__(self):
        it = super().__iter__()
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except UserError as e:
                self._stop_workers(it)
                raise UserError(worker_error_message(e)) from None
            yield batch

    def _stop_workers(self, it) -> None:
        """Shut the workers down now: left to the garbage collector, that waits 5 s per loader."""
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        if getattr(self, "_iterator", None) is it:
            self._iterator = None  # persistent workers: start fresh ones next time


def _generator_seed(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, dist.rank(), epoch]).generate_state(1, np.uint64)[0] >> 1)


def cap_workers(num_workers: int) -> int:
    """Loader worker processes, at most one per usable core: more only thrash."""
    return min(num_workers, dist.cpu_cores())


def build_loader(dataset, batch_size: int, train: bool, num_workers: int = 4, seed: int = 0,
                 collate_fn=None, drop_last: bool | None = None) -> Loader:
    """DataLoader over `dataset` for this process (batch_size per process; see module doc).

    train: shuffle and drop the last incomplete batch (drop_last defaults to train).
    num_workers: loader processes (0 loads in this process); persistent when > 0.
    pin_memory when CUDA is available. collate_fn: None is torch's default collate,
    which turns a multi-crop batch into a list of batched tensors.
    """
    if batch_size < 1:
        raise UserError(f"batch size per process must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise UserError(f"num_workers={num_workers} must be >= 0")
    num_workers = cap_workers(num_workers)
    drop_last = train if drop_last is None else drop_last
    world, rank = dist.world_size(), dist.rank()
    if train:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                     seed=seed, drop_last=True)
    else:
        sampler = ShardSampler(len(dataset), world, rank)
    if drop_last and len(sampler) < batch_size:
        raise UserError(f"batch size {batch_size} per process is larger than the {len(sampler)} "
                        f"images this process gets from the {len(dataset)} of the dataset; "
                        f"lower batch_size or use more data")
    generator = torch.Generator()
    generator.manual_seed(_generator_seed(seed, 0))
    return Loader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                  collate_fn=collate_fn, pin_memory=torch.cuda.is_available(), drop_last=drop_last,
                  persistent_workers=num_workers > 0, generator=generator, seed=seed,
                  worker_init_fn=shield_worker if num_workers > 0 else None)


def set_epoch(loader, epoch: int) -> None:
    """Seed this epoch's shuffle (sampler.set_epoch) and the worker seeds from (seed, rank, epoch)."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    gen = getattr(loader, "generator", None)
    if gen is not None:
        gen.manual_seed(_generator_seed(getattr(loader, "seed", 0), epoch))

