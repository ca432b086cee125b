"""A map of the features: `viz`'s embedding.png, a 2-D t-SNE (scikit-learn) of the evaluation
features of a seeded sample of images.

- the sample: `viz.embedding_images` images of the split the other feature figures query
  (a labeled set's test split, else the folder's images), a seeded pick (`seed=`) without
  replacement, in index order;
- the map: the pooled features L2-normalised (the cosine geometry the k-NN searches), then
  scikit-learn's exact-gradient-free Barnes-Hut t-SNE, PCA initialisation, its automatic
  learning rate, perplexity 30 (fewer where the sample is small: a third of the points),
  random_state = the seed: the same checkpoint, data and seed give the same map;
- the picture: each point coloured by its class where the set has labels; where it has
  none, the points beside a grid of thumbnails placed at the map's positions: the map cut
  into `viz.embedding_grid` x `viz.embedding_grid` cells, each showing the image whose point
  lies nearest the cell's centre (an empty cell stays blank).
viz.json's "embedding" holds the sampled indices, their labels, the coordinates and the
thumbnail cells.
"""
from __future__ import annotations

import numpy as np
import torch

PERPLEXITY = 30.0
MIN_POINTS = 5    # t-SNE needs a perplexity below the number of points; fewer make no map


def sample(n_total: int, n: int, seed: int = 0) -> np.ndarray:
    """Sorted indices of a seeded pick of min(n, n_total) of range(n_total)."""
    g = torch.Generator().manual_seed(int(seed))
    return np.sort(torch.randperm(n_total, generator=g)[:min(int(n), n_total)].numpy())


def tsne(features, seed: int = 0) -> tuple[np.ndarray, float]:
    """((n, 2) t-SNE coordinates of the L2-normalised features, the perplexity used)."""
    from sklearn.manifold import TSNE
    x = torch.nn.functional.normalize(torch.as_tensor(features).float(), dim=1).numpy().astype(np.float64)
    perplexity = float(min(PERPLEXITY, max(1.0, (len(x) - 1) / 3)))
    xy = TSNE(n_components=2, perplexity=perplexity, init="pca", learning_rate="auto",
              random_state=int(seed)).fit_transform(x)
    return xy, perplexity


def thumbnail_cells(xy: np.ndarray, grid: int) -> list[tuple[int, int, int]]:
    """[(row, column, point)] for every cell of a grid x grid cut of the map's bounding box
    that holds a point: the point nearest the cell's centre. Row 0 is the top (largest y)."""
    lo, hi = xy.min(0), xy.max(0)
    unit = (xy - lo) / np.where(hi > lo, hi - lo, 1.0)
    col = np.minimum((unit[:, 0] * grid).astype(int), grid - 1)
    row = np.minimum(((1.0 - unit[:, 1]) * grid).astype(int), grid - 1)
    centre = np.stack([(col + 0.5) / grid, 1.0 - (row + 0.5) / grid], 1)
    dist = ((unit - centre) ** 2).sum(1)
    cell = row * grid + col
    order = np.lexsort((np.arange(len(xy)), dist, cell))   # per cell: nearest first, then lower index
    first = np.ones(len(order), dtype=bool)
    first[1:] = cell[order[1:]] != cell[order[:-1]]
    return [(int(row[i]), int(col[i]), int(i)) for i in order[first]]


def mosaic(cells, images: list[np.ndarray], grid: int, side: int) -> np.ndarray:
    """(grid * side, grid * side, 3) picture with images[k] (H, W, 3 in [0, 1]) in cells[k]."""
    out = np.ones((grid * side, grid * side, 3), dtype=np.float32)
    inner = side - 2   # a white pixel between neighbouring thumbnails
    for (r, c, _), img in zip(cells, images):
        t = torch.as_tensor(img).permute(2, 0, 1)[None].float()
        t = torch.nn.functional.interpolate(t, size=(inner, inner), mode="area")[0].permute(1, 2, 0)
        out[r * side + 1:r * side + 1 + inner, c * side + 1:c * side + 1 + inner] = t.clamp(0, 1).numpy()
    return out


def draw(xy: np.ndarray, labels, class_names, picture: np.ndarray | None, title: str, dpi: int = 150):
    """The figure: the points (coloured by class where `labels` are given), and beside them
    the thumbnail `picture` when there is one."""
    import matplotlib
    from resmlp.eval.figure import new_figure, wrap
    panels = 1 + (picture is not None)
    fig = new_figure(6.2 * panels + (1.4 if labels is not None else 0), 6.4, dpi)
    ax = fig.add_subplot(1, panels, 1)
    if labels is not None:
        labels = np.asarray(labels)
        classes = np.unique(labels)
        cmap = matplotlib.colormaps["tab10" if len(classes) <= 10 else "tab20" if len(classes) <= 20 else "turbo"]
        for k, y in enumerate(classes):
            at = labels == y
            color = cmap(k % cmap.N) if len(classes) <= 20 else cmap(k / max(1, len(classes) - 1))
            name = class_names[y] if 0 <= y < len(class_names) else str(y)
            ax.scatter(xy[at, 0], xy[at, 1], s=4, color=color, label=name, linewidths=0)
        if len(classes) <= 20:
            ax.legend(fontsize=7, markerscale=3, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    else:
        ax.scatter(xy[:, 0], xy[:, 1], s=4, color="#555555", linewidths=0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title("t-SNE of the features" + (", coloured by class" if labels is not None else ""), fontsize=8)
    if picture is not None:
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.imshow(picture, interpolation="nearest")
        ax2.set_axis_off()
        ax2.set_title("the image nearest each cell's centre, at its place on the map", fontsize=8)
    fig.suptitle(wrap(title, 70 * panels), fontsize=8)
    fig.tight_layout()
    return fig


def embedding_figure(features, labels, dataset, data_cfg, class_names, n: int, seed: int, grid: int,
                     title: str, dpi: int = 150):
    """(Figure or None, viz.json's entry) for `features` (N, D) of `dataset`'s images; labels
    None (or all negative) draws the thumbnails. None when fewer than MIN_POINTS images."""
    from resmlp.data import mean_std
    from resmlp.eval.neighbours import shown_images
    idx = sample(len(features), n, seed)
    has_labels = labels is not None and bool((np.asarray(labels) >= 0).any())
    ys = np.asarray(labels)[idx] if has_labels else None
    entry = {"method": "t-SNE (scikit-learn) of L2-normalised features", "seed": int(seed),
             "images": [int(i) for i in idx], "labels": ys.tolist() if ys is not None else None}
    if len(idx) < MIN_POINTS:
        entry["note"] = f"{len(idx)} images: too few for a map (at least {MIN_POINTS})"
        return None, entry
    xy, perplexity = tsne(torch.as_tensor(features)[torch.as_tensor(idx)], seed)
    entry.update(perplexity=perplexity, xy=[[round(float(a), 4), round(float(b), 4)] for a, b in xy])
    picture = None
    if not has_labels:
        cells = thumbnail_cells(xy, grid)
        images = shown_images(dataset, [int(idx[p]) for _, _, p in cells], *mean_std(data_cfg))
        picture = mosaic(cells, images, grid, max(16, min(64, 768 // grid)))
        entry["thumbnails"] = {"grid": grid, "cells": [[r, c, int(idx[p])] for r, c, p in cells],
                               "cell": "[row from the top, column, image index]: the image nearest the cell's centre"}
    header = f"{title}\n{len(idx)} images (seed {seed}), perplexity {perplexity:.3g}"
    return draw(xy, ys, list(class_names or []), picture, header, dpi), entry
