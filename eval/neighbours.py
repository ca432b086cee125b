"""What the k-NN evaluator sees: a few test images, each with its k nearest training images.

The neighbours come from the evaluator itself (eval/knn_search.py: query_neighbours, i.e.
knn_search's exact, canonically ordered search over L2-normalised features), on the
features the caller already has: the `viz` command's (eval/features.py, the k-NN
command's cache) or the DINO trainer's online k-NN. This module only picks the queries
and draws:

neighbours.png: one row per query: the query (blue frame, its class), then its k
  nearest training images, nearest first, framed green where the label matches the
  query's and red where it does not (the neighbour's class is then printed above it),
  with the cosine similarity printed below. What is shown is the eval transform's
  image, the crop the features were computed from. On images without labels
  (data=folder) the queries are images of the set itself, their neighbours are searched
  among its other images (the query left out), and every frame is grey: no label to match.
"""
from __future__ import annotations

import numpy as np
import torch

MATCH, MISMATCH, QUERY, UNLABELED = "#1a9641", "#d7191c", "#2b83ba", "#9e9e9e"


def pick_queries(labels, n: int, seed: int = 0) -> list[int]:
    """n test indices spread over the classes, the same for the same labels and seed.

    The classes take turns in a seeded order, each giving a seeded random image of its
    own, so that n >= the number of classes shows every class; without labels (all
    negative, e.g. an unlabeled split) a seeded random choice. Sorted by (label, index),
    so the rows of a grid go class by class.
    """
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.int64).reshape(-1)
    g = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(labels.numel(), generator=g)
    classes = labels[labels >= 0].unique()
    if classes.numel() == 0:
        picks = order[:n].tolist()
    else:
        classes = classes[torch.randperm(classes.numel(), generator=g)]
        members = [order[labels[order] == c] for c in classes]
        picks, rank = [], 0
        while len(picks) < n and rank < max(m.numel() for m in members):
            picks += [int(m[rank]) for m in members if rank < m.numel()][:n - len(picks)]
            rank += 1
    return sorted(picks, key=lambda i: (int(labels[i]), i))


def _without_self(sims: torch.Tensor, idx: torch.Tensor, queries, k: int):
    """Each row's neighbours with the query itself left out (bank and queries are one set),
    the first k of the rest, in the search's order."""
    keep = idx != torch.as_tensor(queries, dtype=idx.dtype).view(-1, 1)
    keep &= keep.cumsum(1) <= k          # a row without the query drops its last instead
    return sims[keep].view(-1, k), idx[keep].view(-1, k)


def neighbours(train_features, train_labels, test_features, test_labels, queries, k: int = 5,
               backend: str = "auto", device=None, same_set: bool = False) -> dict:
    """The evaluator's k nearest training images of the test images at `queries`.

    Returns {'k', 'queries', 'query_labels', 'indices' (train indices, nearest first),
    'similarities' (cosine), 'labels' (the neighbours'), 'match' (label == query's),
    'match_rate'}, plain lists (viz.json's 'neighbours'); labels, match and match_rate
    are None for images without labels. same_set: the queries index the bank itself
    (test_features is train_features), and each query is left out of its own neighbours.
    """
    from resmlp.eval.knn_search import query_neighbours
    n_bank = len(train_features)
    search = min(k + 1, n_bank) if same_set else k
    sims, idx = query_neighbours(train_features, test_features, queries, search, backend, device)
    if same_set:
        k = search - 1 if search <= k else k
        sims, idx = _without_self(sims, idx, queries, k)
    ytr = torch.as_tensor(np.asarray(train_labels)).long().reshape(-1)
    yq = torch.as_tensor(np.asarray(test_labels)).long().reshape(-1)[torch.as_tensor(queries)]
    out = {"k": int(idx.shape[1]), "queries": [int(q) for q in queries], "query_labels": yq.tolist(),
           "indices": idx.tolist(), "similarities": [[round(float(s), 6) for s in row] for row in sims]}
    if not bool((ytr >= 0).any()):
        return {**out, "query_labels": None, "labels": None, "match": None, "match_rate": None}
    ynb = ytr[idx]
    match = ynb == yq[:, None]
    return {**out, "labels": ynb.tolist(), "match": match.tolist(), "match_rate": float(match.float().mean())}


def shown_images(dataset, indices, mean, std) -> list[np.ndarray]:
    """(H, W, 3) float images in [0, 1] of dataset[i] under its eval transform (un-normalised)."""
    m = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    out = []
    for i in indices:
        x = torch.as_tensor(dataset[int(i)][0]).float()
        out.append((x * s + m).clamp(0, 1).permute(1, 2, 0).numpy())
    return out


def _hex_rgb(color: str) -> np.ndarray:
    from matplotlib.colors import to_rgb
    return np.array(to_rgb(color))


def draw_neighbours(nb: dict, query_images, neighbour_images, class_names, title: str, dpi: int = 150):
    """The grid as a matplotlib Figure (Agg canvas); neighbour_images: one list of k per query.

    One mosaic image with the frames painted in, and text at its pixel positions: a few
    artists instead of an axes per image (a grid draws in well under a second).
    """
    from resmlp.eval.figure import new_figure, wrap
    n, k = len(nb["queries"]), nb["k"]
    names = list(class_names or [])
    labeled = nb["match"] is not None

    def name(y: int) -> str:
        return names[y] if 0 <= y < len(names) else str(y)

    def frame(r: int, c: int) -> str:
        return (MATCH if nb["match"][r][c] else MISMATCH) if labeled else UNLABELED

    s = query_images[0].shape[0]                 # the eval transform's square crop
    b = max(1, round(s / 14))                    # frame width
    cell, gap, sep, text = s + 2 * b, max(1, s // 10), s // 3, max(2, round(0.14 * s))
    x0 = [0] + [cell + sep + c * (cell + gap) for c in range(k)]
    width = x0[-1] + cell
    height = n * (cell + 2 * text)
    mosaic = np.ones((height, width, 3))
    fig = new_figure(width / s * 0.95, height / s * 0.95 + 0.45, dpi)
    ax = fig.add_axes((0, 0, 1, height / s * 0.95 / (height / s * 0.95 + 0.45)))
    for r in range(n):
        y = r * (cell + 2 * text) + text
        row = [(query_images[r], QUERY)] + [(neighbour_images[r][c], frame(r, c)) for c in range(k)]
        for c, (img, color) in enumerate(row):
            mosaic[y:y + cell, x0[c]:x0[c] + cell] = _hex_rgb(color)
            mosaic[y + b:y + b + s, x0[c] + b:x0[c] + b + s] = img[..., :3]
        ax.text(x0[0] + cell / 2, y - 1, f"#{nb['queries'][r]}" + (f" {name(nb['query_labels'][r])}" if labeled
                                                                  else ""), ha="center", va="bottom", fontsize=6)
        for c in range(k):
            mid = x0[c + 1] + cell / 2
            ax.text(mid, y + cell + 1, f"{nb['similarities'][r][c]:.3f}", ha="center", va="top", fontsize=6)
            if labeled and not nb["match"][r][c]:
                ax.text(mid, y - 1, name(nb["labels"][r][c]), ha="center", va="bottom", fontsize=5,
                        color=MISMATCH)
    ax.imshow(mosaic, interpolation="nearest")
    ax.set_axis_off()
    fig.suptitle(wrap(title, 16 * (k + 1)), fontsize=7, y=0.995, va="top")
    return fig


def rgb_array(fig) -> np.ndarray:
    """(H, W, 3) uint8 pixels of an Agg figure (what TensorBoard's add_image takes)."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def neighbours_figure(train_features, train_labels, train_set, test_features, test_labels, test_set,
                      queries, data_cfg, class_names, title: str, k: int = 5, backend: str = "auto",
                      device=None, dpi: int = 150, same_set: bool = False):
    """(Figure, viz.json's entry): the neighbours of `queries` and the grid that shows them;
    same_set: queries and bank are one set (images without labels), the query left out."""
    from resmlp.data import mean_std
    nb = neighbours(train_features, train_labels, test_features, test_labels, queries, k, backend, device,
                    same_set)
    mean, std = mean_std(data_cfg)
    q_img = shown_images(test_set, queries, mean, std)
    flat = shown_images(train_set, [i for row in nb["indices"] for i in row], mean, std)
    nb_img = [flat[r * nb["k"]:(r + 1) * nb["k"]] for r in range(len(queries))]
    if nb["match"] is None:
        header = (f"{title}\n{nb['k']} nearest other images of the set (cosine of L2-normalised features, the "
                  "k-NN's own search); no labels to compare")
    else:
        header = (f"{title}\n{nb['k']} nearest training images (cosine of L2-normalised features, the k-NN's "
                  f"own search); green: same label, red: another ({100 * nb['match_rate']:.0f}% same)")
    return draw_neighbours(nb, q_img, nb_img, class_names, header, dpi), nb


def online_grid(knn_result: dict, data_cfg, title: str, k: int = 5, n: int = 8, seed: int = 0,
                backend: str = "auto", dpi: int = 60) -> np.ndarray:
    """(H, W, 3) uint8 grid from online_knn(..., keep_features=True)'s result: the features
    and datasets that k-NN just used, no second extraction (the DINO trainer's TensorBoard)."""
    from resmlp.data import class_names as names_of
    (ftr, ytr), (fte, yte) = knn_result["features"]["train"], knn_result["features"]["test"]
    sets = knn_result["datasets"]
    queries = pick_queries(yte, n, seed)
    fig, _ = neighbours_figure(ftr, ytr, sets["train"], fte, yte, sets["test"], queries, data_cfg,
                               getattr(sets["test"], "classes", None) or names_of(data_cfg), title,
                               min(k, ftr.shape[0]), backend, dpi=dpi)
    return rgb_array(fig)
