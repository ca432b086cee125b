"""Per-iteration schedules (lr, weight decay, EMA momentum, teacher temperature), as arrays.

Arrays indexed by the global iteration make resume trivial and let every schedule be
logged exactly as used.
"""
from __future__ import annotations

import numpy as np


def cosine_schedule(base: float, final: float, epochs: int, iters_per_epoch: int,
                    warmup_epochs: float = 0, warmup_start: float = 0.0) -> np.ndarray:
    """Linear warm-up from `warmup_start` to `base`, then a cosine from `base` to `final`."""
    total = max(1, int(epochs * iters_per_epoch))
    warmup = min(total, int(round(warmup_epochs * iters_per_epoch)))
    ramp = np.linspace(warmup_start, base, warmup, endpoint=False) if warmup else np.zeros(0)
    steps = np.arange(total - warmup)
    cosine = final + 0.5 * (base - final) * (1 + np.cos(np.pi * steps / max(1, len(steps))))
    return np.concatenate([ramp, cosine])


def linear_warmup_then_constant(start: float, end: float, warmup_epochs: int, epochs: int,
                                iters_per_epoch: int) -> np.ndarray:
    """DINO's teacher temperature: linear from start to end over the warm-up epochs, then flat."""
    total = max(1, epochs * iters_per_epoch)
    warmup = min(total, warmup_epochs * iters_per_epoch)
    return np.concatenate([np.linspace(start, end, warmup, endpoint=False),
                           np.full(total - warmup, end)])
