"""Patch features as colours: the PCA picture DINOv2 made its signature, for any backbone.

ResMLP has no attention to draw, but it has what the picture needs: one token per patch
before the pooling (ResMLP.forward_features: the tokens after the final norm, whose mean
is the pooled feature the k-NN and the linear probe read). For a few images:

1. the patch tokens of all of them, pooled into one (images x patches, dim) matrix;
2. its first three principal components (torch.linalg.svd of the centred matrix), so the
   same colour means the same feature direction in every image;
3. each patch's projection on them, min-max scaled over all shown patches, as RGB at the
   patch grid beside its image;
4. the first component alone, min-max scaled the same way and thresholded, as DINOv2 uses
   it to separate object from background. A component's sign is arbitrary: the first is
   oriented so that the patches on the image border (usually background) score lower on
   average, the others so that their largest loading is positive.

Any image size the backbone takes: the grid comes from the input (a ResMLP built for
another grid runs with grid_adapt=interpolate when it has no adaptation of its own);
timm ViTs drop their class/register tokens, convnets give their last feature map's
positions as the patches.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn as nn

from resmlp.core.errors import UserError

N_COMPONENTS = 3


def _grid(model: nn.Module, height: int, width: int, n: int) -> tuple[int, int]:
    """The (h, w) patch grid of n tokens from a height x width input."""
    pe = getattr(model, "patch_embed", None) or getattr(model, "stem", None)
    grid = None
    if hasattr(pe, "grid_for"):                      # this project's ResMLP
        grid = tuple(pe.grid_for(height, width))
    elif hasattr(pe, "dynamic_feat_size"):           # timm's PatchEmbed
        grid = tuple(pe.dynamic_feat_size((height, width)))
    elif isinstance(getattr(pe, "patch_size", None), (int, tuple, list)):
        p = pe.patch_size if isinstance(pe.patch_size, (tuple, list)) else (pe.patch_size,) * 2
        grid = (height // p[0], width // p[1])
    if grid is None or grid[0] * grid[1] != n:
        side = int(round(n ** 0.5))
        if side * side != n or height != width:
            raise UserError(f"cannot tell the patch grid of {type(model).__name__}'s {n} tokens for a "
                            f"{height}x{width} image; the patch map needs a patch-token backbone")
        grid = (side, side)
    return int(grid[0]), int(grid[1])


@contextlib.contextmanager
def _takes_grid(model: nn.Module, grid: tuple[int, int]):
    """A ResMLP built for another grid and without an adaptation of its own runs with
    grid_adapt=interpolate for the duration (the built grid itself needs none)."""
    built = getattr(model, "grid_size", None)
    adapt = getattr(model, "grid_adapt", None)
    change = adapt == "none" and grid is not None and built is not None and tuple(built) != tuple(grid)
    if change:
        model.grid_adapt = "interpolate"
    try:
        yield "interpolate" if change else adapt
    finally:
        if change:
            model.grid_adapt = adapt


@torch.no_grad()
def patch_tokens(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], str | None]:
    """(tokens (B, h*w, D) float32 on the CPU, grid (h, w), grid_adapt used or None) of the
    backbone's patches before pooling, for images (B, 3, H, W) of any size it takes."""
    if not hasattr(model, "forward_features"):
        raise UserError(f"{type(model).__name__} has no forward_features: no patch tokens to draw")
    height, width = images.shape[-2:]
    dev = next(model.parameters()).device
    pe = getattr(model, "patch_embed", None)
    guess = None
    try:
        guess = pe.grid_for(height, width) if hasattr(pe, "grid_for") else None
        with _takes_grid(model, guess) as adapt:
            out = model.forward_features(images.to(dev))
    except (RuntimeError, ValueError, AssertionError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"the backbone cannot take {height}x{width} px images for the patch map: {first}; "
                        "set viz.pca_size to a size it takes") from None
    if out.dim() == 4:   # a convnet's (B, C, h, w) map: its positions are the patches
        return out.flatten(2).transpose(1, 2).float().cpu(), tuple(out.shape[-2:]), None
    if out.dim() != 3:
        raise UserError(f"{type(model).__name__}.forward_features gives shape {tuple(out.shape)}, "
                        "not patch tokens")
    out = out[:, int(getattr(model, "num_prefix_tokens", 0) or 0):]   # class / register tokens are no patches
    return out.float().cpu(), _grid(model, height, width, out.shape[1]), adapt if guess else None


def fit_pca(x: torch.Tensor, n: int = N_COMPONENTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean (D,), components (c, D) with orthonormal rows, explained variance ratio (c,)),
    c = min(n, rows, D), in float64; each component's largest loading positive."""
    x = x.double()
    mean = x.mean(0)
    _, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
    c = min(n, vh.shape[0])
    comps = vh[:c].clone()
    comps *= torch.sign(comps.gather(1, comps.abs().argmax(1, keepdim=True)))
    var = s.square()
    ratio = var[:c] / var.sum() if var.sum() > 0 else torch.zeros(c, dtype=torch.float64)
    return mean, comps, ratio


def _minmax(v: torch.Tensor) -> torch.Tensor:
    lo, hi = v.min(), v.max()
    return (v - lo) / (hi - lo) if hi > lo else torch.zeros_like(v)


def border(grid: tuple[int, int]) -> torch.Tensor:
    """(h*w,) bool: the patches on the edge of the grid."""
    h, w = grid
    m = torch.zeros(h, w, dtype=torch.bool)
    m[0], m[-1], m[:, 0], m[:, -1] = True, True, True, True
    return m.reshape(-1)


def patch_pca(model: nn.Module, images: torch.Tensor, threshold: float = 0.5) -> dict:
    """The patch map of `images` (B, 3, H, W): {'grid', 'grid_adapt', 'rgb' (B, h, w, 3) in
    [0, 1], 'pc1' (B, h, w) in [0, 1], 'mask' (B, h, w) bool (pc1 > threshold), 'mean',
    'components' (c, D), 'explained_variance_ratio' (c,)}."""
    if not 0 < threshold < 1:
        raise UserError(f"viz.pca_threshold={threshold} must be between 0 and 1 (of the first "
                        "component's range)")
    tokens, grid, adapt = patch_tokens(model, images)
    b, n, d = tokens.shape
    flat = tokens.reshape(b * n, d)
    mean, comps, ratio = fit_pca(flat)
    proj = (flat.double() - mean) @ comps.T                     # (B*N, c)
    edge = border(grid).repeat(b)
    if edge.any() and not edge.all() and proj[edge, 0].mean() > proj[~edge, 0].mean():
        comps[0], proj[:, 0] = -comps[0], -proj[:, 0]
    rgb = torch.zeros(b * n, N_COMPONENTS, dtype=torch.float64)
    for j in range(comps.shape[0]):
        rgb[:, j] = _minmax(proj[:, j])
    pc1 = _minmax(proj[:, 0])
    h, w = grid
    return {"grid": (h, w), "grid_adapt": adapt, "rgb": rgb.reshape(b, h, w, N_COMPONENTS).numpy(),
            "pc1": pc1.reshape(b, h, w).numpy(), "mask": (pc1 > threshold).reshape(b, h, w).numpy(),
            "threshold": threshold, "mean": mean, "components": comps, "explained_variance_ratio": ratio}


def draw_patch_pca(res: dict, shown: list[np.ndarray], titles: list[str], title: str, dpi: int = 150):
    """Rows of image | first 3 components as RGB | image outside the thresholded first
    component faded: a matplotlib Figure (Agg canvas)."""
    from resmlp.eval.figure import new_figure, wrap
    b = len(shown)
    h, w = res["grid"]
    fig = new_figure(6.3, 2.1 * b + 0.5, dpi)
    fig.set_layout_engine("constrained", w_pad=0.02, h_pad=0.02)
    heads = ("image (as the backbone sees it)", f"patches: PC1-3 as RGB ({h}x{w})",
             f"PC1 > {res['threshold']:g} of its range")
    for r in range(b):
        img = shown[r]
        extent = (0, img.shape[1], img.shape[0], 0)
        fade = np.zeros((h, w, 4))
        fade[..., :3] = 1.0
        fade[..., 3] = np.where(res["mask"][r], 0.0, 0.8)
        panels = [(img, None), (res["rgb"][r], None), (img, fade)]
        for c, (base, over) in enumerate(panels):
            ax = fig.add_subplot(b, 3, 3 * r + c + 1)
            ax.imshow(base, interpolation="nearest", extent=extent)
            if over is not None:
                ax.imshow(over, interpolation="nearest", extent=extent)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(heads[c], fontsize=7)
            if c == 0:
                ax.set_ylabel(titles[r], fontsize=7)
    fig.suptitle(wrap(title, 100), fontsize=7)
    return fig
