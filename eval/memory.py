"""The memory a feature bank may take, and every bank sized to it before it is built.

A bank is the features of one split held whole: the k-NN's training features and its
queries (the trainer's k-NN, the knn command), the linear probe's, and the CPU demo's
raw-pixel baseline, whose features are the images themselves (3 x img_size^2 floats each:
Fashion-MNIST's 70,000 images read at 224 px would hold 79 GB). Each is planned here from
its image count and feature width before an image is read, and then it

- fits the budget and is built whole;
- or is built smaller: the raw-pixel baseline at a smaller side (area-averaged), the
  trainer's k-NN bank as a class-balanced subset of the training split, each with one line
  that says so;
- or, where nothing smaller means the same thing (the knn and linear commands' features),
  is refused in one line that says what to set.

The budget: `features.memory_gb` when set, else BUDGET_FRACTION of the memory the machine
has available when the bank is planned (MemAvailable of /proc/meminfo, psutil elsewhere);
on a GPU also of its free memory, where extract_features gathers the bank before it comes
to the host. A bank is counted twice (PEAK): extract_features concatenates its batches,
and both are held until the concatenation is done.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from resmlp.core import dist

BUDGET_FRACTION = 0.5  # of the memory available: the rest is the run's own (its model, loader, images)
PEAK = 2               # the batches' features and their concatenation, both held for a moment
FLOAT_BYTES = 4        # banks are float32
MIN_PIXEL_SIDE = 8     # below this the raw-pixel baseline is no bar worth drawing


def gb(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GB"


def host_available() -> int | None:
    """Bytes of memory available to a new allocation on this machine, or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def budget_bytes(memory_gb=None, device=None) -> int | None:
    """The bytes a bank may take: memory_gb (features.memory_gb) when set, else
    BUDGET_FRACTION of the host's available memory and, extracting on a GPU, of its free
    memory; None when nothing says (no bank is then sized). Every rank must call it: rank
    0's budget is every rank's, so that all plan the same bank."""
    if memory_gb is not None:
        budget = int(float(memory_gb) * 2**30)
    else:
        have = [host_available()]
        if device is not None and torch.device(device).type == "cuda":
            have.append(torch.cuda.mem_get_info(torch.device(device))[0])
        known = [h for h in have if h is not None]
        budget = int(min(known) * BUDGET_FRACTION) if known else None
    return dist.broadcast_object(budget)


def bank_bytes(n_images: int, dim: int) -> int:
    """What building a bank of n_images x dim float32 features takes at its peak."""
    return int(n_images) * int(dim) * FLOAT_BYTES * PEAK


def where_budget(budget: int, memory_gb) -> str:
    return (f"features.memory_gb={memory_gb:g}" if memory_gb is not None else
            f"{BUDGET_FRACTION:g} of the memory available now; features.memory_gb sets it")


# --------------------------------------------------------------------------- the plans

@dataclass(frozen=True)
class PixelPlan:
    """The raw-pixel baseline: its side (None: skipped) and the line that says why it is
    not at the images' own side (None: it is)."""
    side: int | None
    img_size: int
    line: str | None

    def model(self) -> nn.Module | None:
        """The 'backbone' whose features are the pixels: flattened, area-averaged first to
        `side` where that is smaller; None when skipped."""
        if self.side is None:
            return None
        if self.side == self.img_size:
            return nn.Flatten()
        return nn.Sequential(nn.AdaptiveAvgPool2d(self.side), nn.Flatten())


def pixel_baseline(data_cfg, img_size: int, memory_gb=None, device=None) -> PixelPlan:
    """The raw-pixel baseline of the labeled set data_cfg (its training split as the bank,
    its test split as the queries), planned on this machine's budget. Every rank calls it."""
    from resmlp.data import build_dataset
    n = len(build_dataset(data_cfg, "train")) + len(build_dataset(data_cfg, "test"))
    return plan_pixels(n, int(img_size), budget_bytes(memory_gb, device), memory_gb)


def plan_pixels(n_images: int, img_size: int, budget: int | None, memory_gb=None, channels: int = 3) -> PixelPlan:
    """The largest side at most img_size whose raw pixels of n_images (the bank and the
    queries: both are held) fit the budget; MIN_PIXEL_SIDE at the least, else skipped."""
    full = bank_bytes(n_images, channels * img_size ** 2)
    if budget is None or full <= budget:
        return PixelPlan(img_size, img_size, None)
    side = min(img_size, math.isqrt(budget // (n_images * channels * FLOAT_BYTES * PEAK)))
    if side < MIN_PIXEL_SIDE:
        least = bank_bytes(n_images, channels * MIN_PIXEL_SIDE ** 2)
        return PixelPlan(None, img_size, f"raw-pixel baseline skipped: even at {MIN_PIXEL_SIDE} px its {n_images} "
                                         f"images would take {gb(least)}, over the budget of {gb(budget)} "
                                         f"({where_budget(budget, memory_gb)})")
    return PixelPlan(side, img_size, f"raw-pixel baseline at {side} px, area-averaged from {img_size} px: at "
                                     f"{img_size} px its {n_images} images would take {gb(full)}, over the budget "
                                     f"of {gb(budget)} ({where_budget(budget, memory_gb)})")


def plan_bank(n_train: int, n_test: int, dim: int, budget: int | None, memory_gb=None,
              least: int = 1) -> tuple[int, str | None]:
    """How many of n_train training images a k-NN bank of dim-wide features keeps beside
    its n_test queries within the budget: (n_train, None) when all fit, else (fewer, the
    line that says so). A UserError when not even `least` of them fit."""
    from resmlp.core.errors import UserError
    if budget is None or bank_bytes(n_train + n_test, dim) <= budget:
        return n_train, None
    keep = budget // (dim * FLOAT_BYTES * PEAK) - n_test
    what = (f"the k-NN's {n_train} training and {n_test} test features ({dim} wide) would take "
            f"{gb(bank_bytes(n_train + n_test, dim))}, over the budget of {gb(budget)} "
            f"({where_budget(budget, memory_gb)})")
    if keep < least:
        raise UserError(f"{what}; not even {least} training images fit beside the queries: set "
                        "features.memory_gb higher or run it on a machine with more memory")
    return int(keep), f"{what}: its bank is a class-balanced subset of {keep} of them"


def check_features(n_images: int, dim: int, budget: int | None, memory_gb=None, split: str = "train") -> None:
    """A UserError, before any image is read, when one split's features do not fit the
    budget (the knn and linear commands: a smaller bank would be another evaluation)."""
    from resmlp.core.errors import UserError
    need = bank_bytes(n_images, dim)
    if budget is None or need <= budget:
        return
    fit = budget // (dim * FLOAT_BYTES * PEAK)
    hint = f"data.subset={fit} (a class-balanced subset that fits), " if split == "train" and fit else ""
    raise UserError(f"the {split} features of {n_images} images ({dim} wide) would take {gb(need)}, over the "
                    f"budget of {gb(budget)} ({where_budget(budget, memory_gb)}): set {hint}features.memory_gb, or "
                    "run it on a machine with more memory")
