"""The paper's figures for a checkpoint: `bash run.sh viz <ckpt | run dir | timm:<name>>`.

cross_patch.png (paper Fig. 2 / B.1): for every block, the rows of its cross-patch
  matrix A (N x N over the h x w patch grid) that belong to the central c x c patches,
  each row drawn as an h x w image at the place of its patch: one panel per layer.
  Each small image is scaled to its own max |w| (red > 0, blue < 0), so the shape of
  every row is visible whatever its magnitude. c = viz.central, by default 6 on grids
  of 12 x 12 or more (the paper: 6 of 14), else half the grid side (4 of 8).
sparsity.png (paper Fig. 3 / B.2): per layer, the fraction of weights with |w| below
  viz.threshold (5%) of their matrix's max |w|: for A, and for the channel MLP (the
  paper's "MLP: D->4D->D", fc1 and fc2 weights pooled, each thresholded against its
  own max); fc1 and fc2 separately are in viz.json. Weights only, no biases.
curves.png: training curves from the run dir's log.jsonl, when there is one: loss and
  lr over iterations (lines with "iteration"/"loss"/"lr"), k-NN top-1 (and linear
  top-1) over epochs (lines with "epoch" and "knn_top1" / "linear_top1"). Missing keys
  and unreadable lines are skipped.
neighbours.png (eval/neighbours.py): viz.queries seeded test images spread over the
  classes, each with its viz.k (`k=`, 5) nearest training images under the k-NN
  evaluator's own search, on the k-NN command's features (its cache); indices and
  similarities in viz.json.
patch_pca.png (eval/patch_pca.py): for viz.pca_images of those test images, the patch
  tokens before pooling on their first 3 principal components as RGB at the patch grid,
  and the first component thresholded (viz.pca_threshold); at viz.pca_size px (null: the
  data's size), any size the backbone takes.
embedding.png (eval/embedding.py): a t-SNE map of the features of viz.embedding_images
  seeded test images, coloured by class; coordinates in viz.json.
On images without labels (data=folder) the query split is the folder's images: the
neighbours are searched among its other images and drawn without label frames, the patch
map shows its images, and the embedding places a grid of thumbnails at the map's
positions (viz.embedding_grid cells a side).
viz.json: the numbers behind the figures. Everything goes to cfg.out, else
<run dir>/viz/ (beside a foreign checkpoint file: <its folder>/viz/; timm:<name>:
runs/eval/<name>/viz/).

Figures are drawn with matplotlib's Agg canvas directly (no pyplot state, no display).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from resmlp.core.errors import UserError
from resmlp.core.files import read_regular
from resmlp.core.report import write_figure
from resmlp.eval.figure import new_figure

WEIGHT_FIGURES = ("cross_patch", "sparsity", "curves")
FEATURE_FIGURES = ("neighbours", "patch_pca", "embedding")
FIGURES = WEIGHT_FIGURES + FEATURE_FIGURES
THRESHOLD = 0.05


@dataclass
class FeatureInputs:
    """What the feature figures need besides the backbone: the data and, for the
    neighbours, the k-NN's features of both splits (eval.command.split_features)."""
    data_cfg: object
    features: dict | None = None     # {'train': split_features(...), 'test': ...}
    k: int = 5
    queries: int = 8
    pca_images: int = 4
    pca_size: int | None = None
    pca_threshold: float = 0.5
    seed: int = 0
    backend: str = "auto"
    device: object = None
    embedding_images: int = 2000
    embedding_grid: int = 16


# --------------------------------------------------------------------------- weights

def as_resmlp(model: nn.Module, info: dict) -> nn.Module:
    """This project's ResMLP for `model`: itself, or a timm resmlp converted (same weights)."""
    from resmlp.models import ResMLP
    if isinstance(model, ResMLP):
        return model
    from resmlp.models.load import resmlp_from_state_dict
    try:
        return resmlp_from_state_dict(model.state_dict(), str(info.get("spec")))[0]
    except UserError:
        raise UserError(f"{info.get('spec')} ({type(model).__name__}) is not a ResMLP: the viz figures "
                        "need a ResMLP (this project's, or a timm/official resmlp state_dict)") from None


def cross_patch_matrices(model: nn.Module) -> list[torch.Tensor]:
    """A (N x N) of every block, or a UserError if the blocks have no linear cross-patch layer."""
    from resmlp.models import CrossPatchLinear
    mats = []
    for i, blk in enumerate(model.blocks):
        cp = blk.cross_patch
        if not isinstance(cp, CrossPatchLinear):
            kind = getattr(model, "cross_patch_kind", type(cp).__name__)
            raise UserError(f"block {i} has cross_patch={kind}, not the linear patch-interaction matrix A "
                            "the paper's figure shows; use viz.figures=[sparsity,curves] for this model")
        mats.append(cp.weight.detach().float().cpu())
    return mats


def small_fraction(w: torch.Tensor, threshold: float = THRESHOLD) -> tuple[int, int]:
    """(number of entries with |w| < threshold * max|w|, number of entries)."""
    a = w.detach().abs().float()
    m = a.max()
    if m == 0:
        return a.numel(), a.numel()
    return int((a < threshold * m).sum()), a.numel()


def sparsity(model: nn.Module, threshold: float = THRESHOLD) -> dict:
    """Per-layer fractions of "small" weights: {'A', 'mlp', 'fc1', 'fc2'} -> lists (A: None
    where a block has no linear cross-patch layer)."""
    from resmlp.models import CrossPatchLinear
    out = {"A": [], "mlp": [], "fc1": [], "fc2": []}
    for blk in model.blocks:
        cp = blk.cross_patch
        if isinstance(cp, CrossPatchLinear):
            s, n = small_fraction(cp.weight, threshold)
            out["A"].append(s / n)
        else:
            out["A"].append(None)
        s1, n1 = small_fraction(blk.mlp.fc1.weight, threshold)
        s2, n2 = small_fraction(blk.mlp.fc2.weight, threshold)
        out["fc1"].append(s1 / n1)
        out["fc2"].append(s2 / n2)
        out["mlp"].append((s1 + s2) / (n1 + n2))
    return out


def default_central(grid: tuple[int, int]) -> int:
    side = min(grid)
    return 6 if side >= 12 else max(1, side // 2)


def central_rows(a: torch.Tensor, grid: tuple[int, int], c: int) -> np.ndarray:
    """(c, c, h, w): row of A of each of the central c x c patches, as an h x w image."""
    h, w = grid
    top, left = (h - c) // 2, (w - c) // 2
    out = np.zeros((c, c, h, w), dtype=np.float32)
    for i in range(c):
        for j in range(c):
            out[i, j] = a[(top + i) * w + (left + j)].reshape(h, w).numpy()
    return out


def mosaic(rows: np.ndarray) -> np.ndarray:
    """(c, c, h, w) -> one image with 1-pixel NaN gaps; each tile scaled to max |w| = 1."""
    c, _, h, w = rows.shape
    img = np.full((c * (h + 1) - 1, c * (w + 1) - 1), np.nan, dtype=np.float32)
    for i in range(c):
        for j in range(c):
            tile = rows[i, j]
            m = np.abs(tile).max()
            img[i * (h + 1):i * (h + 1) + h, j * (w + 1):j * (w + 1) + w] = tile / m if m > 0 else tile
    return img


# --------------------------------------------------------------------------- log.jsonl

# A run's log.jsonl is a line per log_every iterations: far less than this.
LOG_MAX_BYTES = 1 << 28


def read_log(path: Path) -> tuple[list[dict], int]:
    """JSON object lines of a log.jsonl, and how many lines could not be read."""
    rows, bad = [], 0
    for line in read_regular(path, LOG_MAX_BYTES).decode(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad += 1
    return rows, bad


def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def curve_series(rows: list[dict]) -> dict:
    """{'loss': [(x, y)], 'lr': ..., 'knn_top1': [(epoch, y)], 'linear_top1': ..., 'x': label}.

    Training values are plotted over "iteration" when the log has it (lines without it
    are then left out rather than mixed in on another scale), else over "epoch"; eval
    values over "epoch". Sorted by x; keys with no points are left out.
    """
    by_iter = any(_num(r.get("iteration")) is not None for r in rows)
    xkey = "iteration" if by_iter else "epoch"
    series: dict[str, list] = {"loss": [], "lr": [], "knn_top1": [], "linear_top1": []}
    for r in rows:
        x_tr, x_ep = _num(r.get(xkey)), _num(r.get("epoch"))
        for key in ("loss", "lr"):
            y = _num(r.get(key))
            if y is not None and x_tr is not None:
                series[key].append((x_tr, y))
        for key in ("knn_top1", "linear_top1"):
            y = _num(r.get(key))
            if y is not None and x_ep is not None:
                series[key].append((x_ep, y))
    out = {k: sorted(v) for k, v in series.items() if v}
    if out:
        out["x"] = xkey
    return out


# --------------------------------------------------------------------------- drawing

def draw_cross_patch(mats: list[torch.Tensor], grid: tuple[int, int], c: int, path: Path,
                     title: str, dpi: int = 150) -> None:
    import matplotlib
    n = len(mats)
    ncols = min(n, 6)
    nrows = math.ceil(n / ncols)
    fig = new_figure(max(2.2 * ncols, 6.0), 2.35 * nrows + 0.7)
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="white")
    for i, a in enumerate(mats):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.imshow(mosaic(central_rows(a, grid, c)), cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
        ax.set_title(f"layer {i + 1}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_figure(fig, path, dpi=dpi)


def draw_sparsity(sp: dict, path: Path, title: str, threshold: float, dpi: int = 150) -> None:
    fig = new_figure(5.5, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    layers = np.arange(1, len(sp["mlp"]) + 1)
    if any(v is not None for v in sp["A"]):
        ax.plot(layers, [np.nan if v is None else 100 * v for v in sp["A"]], "o-", label="Linear: N->N (A)")
    ax.plot(layers, [100 * v for v in sp["mlp"]], "s-", label="MLP: D->4D->D (fc1+fc2)")
    ax.plot(layers, [100 * v for v in sp["fc1"]], ":", color="gray", label="fc1 / fc2 alone")
    ax.plot(layers, [100 * v for v in sp["fc2"]], ":", color="gray")
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel(f'% of "small" components (|w| < {100 * threshold:g}% of max)')
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(fig, path, dpi=dpi)


def draw_curves(series: dict, path: Path, title: str, dpi: int = 150) -> None:
    panels = [k for k in ("loss", "lr") if k in series]
    evals = [k for k in ("knn_top1", "linear_top1") if k in series]
    n = len(panels) + (1 if evals else 0)
    fig = new_figure(4.2 * n, 3.4)
    for i, key in enumerate(panels):
        ax = fig.add_subplot(1, n, i + 1)
        x, y = zip(*series[key])
        ax.plot(x, y, lw=1)
        ax.set_xlabel(series["x"])
        ax.set_ylabel(key)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.grid(alpha=0.3)
    if evals:
        ax = fig.add_subplot(1, n, n)
        for key in evals:
            x, y = zip(*series[key])
            ax.plot(x, y, "o-", label=key.replace("_top1", " top-1"))
        ax.set_xlabel("epoch")
        ax.set_ylabel("accuracy (%)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_figure(fig, path, dpi=dpi)


# --------------------------------------------------------------------------- command

def find_log(info: dict) -> Path | None:
    """log.jsonl in the checkpoint's run dir (or beside a checkpoint file)."""
    for d in (info.get("run_dir"), Path(info["path"]).parent if info.get("path") else None):
        if d and (Path(d) / "log.jsonl").is_file():
            return Path(d) / "log.jsonl"
    return None


def _figures(value) -> list[str]:
    from resmlp.core.config import as_list
    figs = [str(f) for f in as_list(value)]
    bad = [f for f in figs if f not in FIGURES]
    if bad or not figs:
        raise UserError(f"viz.figures={value!r}: choose among {', '.join(FIGURES)}")
    return figs


def weight_inputs(model: nn.Module, info: dict, figures, central=None, threshold: float = THRESHOLD):
    """(the ResMLP whose weights are drawn, its A matrices or None, the central c or None),
    or the UserError that stops the weight figures: checked before any feature is extracted."""
    if not 0 < threshold < 1:
        raise UserError(f"viz.threshold={threshold} must be between 0 and 1 (the paper uses 0.05)")
    if any(f in figures for f in ("cross_patch", "sparsity")):
        model = as_resmlp(model, info)
    if "cross_patch" not in figures:
        return model, None, None
    mats = cross_patch_matrices(model)
    grid = tuple(model.grid_size)
    c = default_central(grid) if central is None else int(central)
    if not 1 <= c <= min(grid):
        raise UserError(f"viz.central={central} must be between 1 and {min(grid)} "
                        f"(the {grid[0]}x{grid[1]} patch grid)")
    return model, mats, c


def make_figures(model: nn.Module, info: dict, out_dir: Path, figures=WEIGHT_FIGURES, central=None,
                 threshold: float = THRESHOLD, dpi: int = 150, log=print,
                 inputs: FeatureInputs | None = None) -> dict:
    """Draw the requested figures of `model` into out_dir; return viz.json's content.
    The feature figures (neighbours, patch_pca) need `inputs`."""
    from resmlp.models.load import describe, model_label

    if any(f in FEATURE_FIGURES for f in figures) and inputs is None:
        raise UserError(f"viz.figures={list(figures)}: {', '.join(FEATURE_FIGURES)} need the data "
                        "and features (FeatureInputs)")
    backbone = model   # the feature figures read the backbone as loaded (timm's too)
    model, mats, c = weight_inputs(model, info, figures, central, threshold)
    out_dir = Path(out_dir)
    label = f"{model_label(info)} ({info.get('source')}{', ' + info['key'] if info.get('key') else ''})"
    result: dict = {"loaded": describe(info), "files": [], "notes": []}
    out_dir.mkdir(parents=True, exist_ok=True)
    if "cross_patch" in figures:
        grid = tuple(model.grid_size)
        path = out_dir / "cross_patch.png"
        draw_cross_patch(mats, grid, c, path,
                         f"{label}\nrows of A for the central {c}x{c} patches, "
                         f"each as a {grid[0]}x{grid[1]} image (scaled to its max |w|)", dpi)
        result["cross_patch"] = {"grid": list(grid), "central": c, "layers": len(mats),
                                 "row_sum_mean": [float(a.sum(1).mean()) for a in mats],
                                 "self_weight_mean": [float(a.diagonal().mean()) for a in mats]}
        result["files"].append(path.name)
    if "sparsity" in figures:
        sp = sparsity(model, threshold)
        path = out_dir / "sparsity.png"
        draw_sparsity(sp, path, f"{label}: sparsity per layer", threshold, dpi)
        result["sparsity"] = {"threshold": threshold, **sp,
                              "definition": "fraction of weights with |w| < threshold * max|w| of "
                                            "their matrix; mlp pools fc1 and fc2 (each against its own max)"}
        result["files"].append(path.name)
    if "curves" in figures:
        log_path, rows = find_log(info), None
        if log_path is None:
            result["notes"].append("no log.jsonl beside the checkpoint: no training curves")
        else:
            try:
                rows, bad = read_log(log_path)
            except OSError as e:   # not a regular file (a FIFO is not waited on), or too large for a log
                result["notes"].append(f"{log_path} cannot be read ({e.strerror}): no training curves")
        if rows is not None:
            series = curve_series(rows)
            result["curves"] = {"log": str(log_path), "lines": len(rows), "unreadable_lines": bad,
                                **{k: {"points": len(v), "last": v[-1][1]} for k, v in series.items()
                                   if k != "x"}}
            if series:
                path = out_dir / "curves.png"
                draw_curves(series, path, f"{label}: training curves", dpi)
                result["files"].append(path.name)
            else:
                result["notes"].append(f"{log_path} has no loss / lr / knn_top1 values: no curves")
    if any(f in FEATURE_FIGURES for f in figures):
        result.update(feature_figures(backbone, inputs, out_dir, figures, label, dpi, result["files"]))
    result["files"].append("viz.json")
    if log:
        for note in result["notes"]:
            log(f"viz: {note}")
        log(f"viz: wrote {', '.join(result['files'])} to {out_dir}")
    return result


def query_split(data_cfg) -> str:
    """The split the feature figures query: the test split, or the only one of a set without
    labels (data=folder), whose images are then also the neighbours' bank."""
    from resmlp.data.datasets import dataset_info
    return "test" if dataset_info(data_cfg).labeled else "train"


def feature_splits(data_cfg, figures) -> list[str]:
    """The splits whose features the figures need (extracted once, the k-NN's cache)."""
    need = set()
    if "neighbours" in figures:
        need |= {"train", query_split(data_cfg)}
    if "embedding" in figures:
        need.add(query_split(data_cfg))
    return sorted(need, reverse=True)   # train first, as the knn command extracts


def feature_figures(backbone: nn.Module, inputs: FeatureInputs, out_dir: Path, figures, label: str,
                    dpi: int, files: list) -> dict:
    """neighbours.png, patch_pca.png and embedding.png (those of them in `figures`);
    viz.json's entries."""
    import resmlp.data as rdata

    data_cfg = inputs.data_cfg
    split = query_split(data_cfg)
    same_set = split == "train"     # no labels: the queries are images of the bank itself
    q = _Queries(rdata.build_dataset(data_cfg, split, transform=rdata.build_eval_transform(data_cfg)), split,
                 f"{data_cfg.name} test queries" if not same_set else f"{data_cfg.name} images (no labels)")

    def save(fig, name: str) -> None:
        write_figure(fig, out_dir / name, dpi=dpi)
        files.append(name)
    out = {}
    if "neighbours" in figures:
        out["neighbours"] = _neighbours(inputs, q, label, dpi, save)
    if "patch_pca" in figures:
        out["patch_pca"] = _patch_pca(backbone, inputs, q, label, dpi, save)
    if "embedding" in figures:
        out["embedding"] = _embedding(inputs, q, label, dpi, save)
    return out


@dataclass
class _Queries:
    """The images the figures show: `split` of the data set, titled `what`."""
    dataset: object
    split: str
    what: str

    @property
    def names(self) -> list:
        return list(getattr(self.dataset, "classes", None) or [])


def _neighbours(inputs: FeatureInputs, q: _Queries, label: str, dpi: int, save) -> dict:
    """neighbours.png: each query's nearest training images; its viz.json entry."""
    import resmlp.data as rdata
    from resmlp.eval.knn_search import backend_name
    from resmlp.eval.neighbours import neighbours_figure, pick_queries
    data_cfg, same_set = inputs.data_cfg, q.split == "train"
    tr, te = inputs.features["train"], inputs.features[q.split]
    train_set = q.dataset if same_set else rdata.build_dataset(data_cfg, "train",
                                                               transform=rdata.build_eval_transform(data_cfg))
    queries = pick_queries(te["labels"], inputs.queries, inputs.seed)
    fig, nb = neighbours_figure(tr["features"], tr["labels"], train_set, te["features"], te["labels"],
                                q.dataset, queries, data_cfg, q.names, f"{label}: {q.what}",
                                inputs.k, inputs.backend, inputs.device, dpi, same_set=same_set)
    save(fig, "neighbours.png")
    backend = backend_name(inputs.backend, inputs.device)
    return {"split": "train -> train, the query left out" if same_set else "test -> train",
            "seed": inputs.seed,
            "search": f"eval.knn_search.query_neighbours, backend {backend}",
            "train_cache": tr.get("cache"), "test_cache": te.get("cache"), **nb}


def _patch_pca(backbone: nn.Module, inputs: FeatureInputs, q: _Queries, label: str, dpi: int, save) -> dict:
    """patch_pca.png: the first principal components of a few images' patch tokens; its entry."""
    from omegaconf import OmegaConf

    import resmlp.data as rdata
    from resmlp.eval.neighbours import pick_queries, shown_images
    from resmlp.eval.patch_pca import draw_patch_pca, patch_pca
    data_cfg, test_set, names = inputs.data_cfg, q.dataset, q.names
    size = int(inputs.pca_size or data_cfg.img_size)
    pca_cfg = OmegaConf.merge(data_cfg, {"img_size": size}) if size != data_cfg.img_size else data_cfg
    pca_set = test_set if pca_cfg is data_cfg else rdata.build_dataset(
        pca_cfg, q.split, transform=rdata.build_eval_transform(pca_cfg))
    idx = pick_queries(test_set.targets, inputs.pca_images, inputs.seed)
    res = patch_pca(backbone, torch.stack([torch.as_tensor(pca_set[i][0]) for i in idx]), inputs.pca_threshold)
    shown = shown_images(pca_set, idx, *rdata.mean_std(pca_cfg))
    ys = [int(test_set.targets[i]) for i in idx]
    titles = [f"#{i}" + ("" if y < 0 else f" {names[y] if y < len(names) else y}") for i, y in zip(idx, ys)]
    h, w = res["grid"]
    adapt = f", grid_adapt={res['grid_adapt']}" if res["grid_adapt"] not in (None, "none") else ""
    save(draw_patch_pca(res, shown, titles, f"{label}: patch tokens before pooling at {size} px "
                        f"({h}x{w} patches{adapt}); PCA fitted over the {len(idx)} images' patches", dpi),
         "patch_pca.png")
    return {"images": idx, "labels": ys, "img_size": size, "grid": [h, w],
            "grid_adapt": res["grid_adapt"], "threshold": res["threshold"],
            "explained_variance_ratio": [float(r) for r in res["explained_variance_ratio"]],
            "foreground_fraction": [float(m.mean()) for m in res["mask"]],
            "orientation": "PC1: border patches score lower on average; PC2, PC3: "
                           "largest loading positive"}


def _embedding(inputs: FeatureInputs, q: _Queries, label: str, dpi: int, save) -> dict:
    """embedding.png: the queries' features laid out in 2-D (none when too few); its entry."""
    from resmlp.eval.embedding import embedding_figure
    te = inputs.features[q.split]
    fig, entry = embedding_figure(te["features"], te["labels"], q.dataset, inputs.data_cfg, q.names,
                                  inputs.embedding_images, inputs.seed, inputs.embedding_grid,
                                  f"{label}: {q.what}", dpi)
    if fig is not None:
        save(fig, "embedding.png")
    return {"split": q.split, "data": inputs.data_cfg.name, "cache": te.get("cache"), **entry}


def check_viz_config(v) -> None:
    """Bad viz values fail before the backbone is loaded or a feature extracted (the
    numbers' ranges: the limits of configs/method/viz.yaml)."""
    from resmlp.eval.knn import check_ks
    _figures(v.figures)
    if len(check_ks(v.k, 2**62, "viz.k")) != 1:
        raise UserError(f"k={v.k}: the neighbours grid takes one k (e.g. k=5)")


def viz_command(cfg, bb) -> dict | None:
    """bash run.sh viz <ckpt | run dir | timm:<name>> [k=5] [viz.central=4] [viz.figures=[...]]"""
    from resmlp.core import dist
    from resmlp.eval.command import split_features
    from resmlp.eval.knn import check_ks
    v = cfg.viz
    figures = _figures(v.figures)
    weight_inputs(bb.model, bb.info, figures, v.central, float(v.threshold))
    # every process extracts its shard, as for the knn command
    features = {split: split_features(cfg, bb, split) for split in feature_splits(cfg.data, figures)}
    if not dist.is_main():  # one process draws
        return None
    inputs = None
    if any(f in FEATURE_FIGURES for f in figures):
        # on a set without labels the bank is the queries' own set, one of them left out
        n_train = features["train"]["features"].shape[0] - (query_split(cfg.data) == "train") \
            if "neighbours" in figures else 2**62
        inputs = FeatureInputs(cfg.data, features, check_ks(v.k, n_train, "viz.k")[0], int(v.queries), int(v.pca_images),
                               v.pca_size, float(v.pca_threshold), int(cfg.seed), str(cfg.knn.backend), bb.device,
                               int(v.embedding_images), int(v.embedding_grid))
    return make_figures(bb.model, bb.info, bb.out_dir, figures, v.central, float(v.threshold), int(v.dpi),
                        inputs=inputs)


def results_dir(cfg) -> Path:
    from resmlp.eval.command import results_dir as under
    return under(cfg, "viz")


def run(cfg) -> int:
    from resmlp.eval.command import eval_command
    check_viz_config(cfg.viz)
    # on the CPU when only weights are drawn; the features want the command's device
    device = None if {"neighbours", "embedding"} & set(_figures(cfg.viz.figures)) else "cpu"
    return eval_command(viz_command, sub_dir="viz", device=device)(cfg)
