"""Few labels: banks of n training images per class, drawn several times (DINOv2's
`--n-per-class-list` and `--n-tries`), for the k-NN and the linear probe.

For each try t, one seeded permutation of the whole training split (numpy's generator
seeded with (seed, t)) is walked in order and the first n images of each class are kept:
the pick is class-balanced, the same for the same labels, seed and try, different between
tries, and nested over n (a try's 1-per-class pick lies inside its 5-per-class pick), so
that the rows of a table differ by the number of labels, not by the luck of the draw.
A class with fewer than n images gives all it has, and the report says so.

Evaluators run once per pick on features extracted once, and report the mean and the
sample standard deviation (ddof 1; null for one try) over the tries.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from resmlp.core.config import as_list


def sizes(per_class) -> list[int]:
    """knn.few_labels / linear.few_labels as a sorted list (empty: null, the whole bank,
    which a null inside the list also means); the values' range is the key's limit in the YAML."""
    return sorted({int(v) for v in as_list(per_class) if v is not None}) if per_class is not None else []


def picks(labels, n: int, tries: int, seed: int) -> list[torch.Tensor]:
    """`tries` class-balanced picks of n indices per class (sorted indices into labels)."""
    y = np.asarray(torch.as_tensor(labels).reshape(-1).cpu())
    out = []
    for t in range(tries):
        order = np.random.default_rng([int(seed), t]).permutation(y.size)
        by_class = order[np.argsort(y[order], kind="stable")]        # classes in turn, each in the try's order
        starts = np.searchsorted(y[by_class], np.unique(y))
        rank = np.arange(y.size) - np.repeat(starts, np.diff(np.append(starts, y.size)))
        out.append(torch.from_numpy(np.sort(by_class[rank < n])))
    return out


def short_classes(labels, n: int, names=None) -> str | None:
    """Which classes hold fewer than n images (their picks hold all they have), or None."""
    y = torch.as_tensor(labels).reshape(-1)
    counts = torch.bincount(y)
    short = [(int(c), int(counts[c])) for c in y.unique().tolist() if counts[c] < n]
    if not short:
        return None
    shown = ", ".join(f"{names[c] if names and c < len(names) else c} ({m})" for c, m in short[:5])
    more = f" and {len(short) - 5} more" if len(short) > 5 else ""
    return f"n={n}: {len(short)} classes hold fewer than {n} images, their picks all they have: {shown}{more}"


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def summary(tries: list[dict], keys=("top1", "top5")) -> dict:
    """{key: mean, key_std: std} over the tries' dicts, with the tries themselves."""
    out = {}
    for key in keys:
        out[key], out[f"{key}_std"] = mean_std([t[key] for t in tries])
    out["tries"] = tries
    return out


def cell(r: dict, key: str) -> str:
    """'mean ± std' of a summary's key (just the mean for one try)."""
    std = r.get(f"{key}_std")
    return f"{r[key]:6.2f}" + (f" ± {std:5.2f}" if std is not None else " " * 8)   # 14 characters
