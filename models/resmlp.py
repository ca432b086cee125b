"""ResMLP: residual MLPs with a cross-patch linear layer (Touvron et al., 2021).

Paper: "ResMLP: Feedforward networks for image classification with data-efficient
training", https://arxiv.org/abs/2105.03404. Written from the paper's Algorithm 1 and
text; state_dicts of timm's `resmlp_*_224` and of the official facebookresearch/deit
`resmlp_models.py` load through `convert_state_dict` / `load_pretrained` (convert.py);
the inference copy with every Aff folded away is `fold_affine` (fold.py), and the training
block that folds them on every step is FusedResMLPBlock (`fused=True`, fused.py).

Layout of one block on tokens X of shape (B, N, D), N = h * w patches:

    Z = X + ls1 * drop_path(A @ Aff1(X) + a)       # A: N x N, shared by all channels
    Y = Z + ls2 * drop_path(fc2(GELU(fc1(Aff2(Z)))))

Everything here keeps tokens as (B, N, D) with the (h, w) patch grid passed alongside,
so that the cross-patch layer can be adapted to an input whose grid differs from the
one it was built for (DINO's 96 px local crops: 6x6 patches for a 14x14 model). The fused
blocks may instead keep them token-major, (N, B, D) (`token_major=True`, fused.py): the
patch embedding writes that layout and the model's outputs are (B, N, D) views of it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Mapping, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath, trunc_normal_
from torch.utils.checkpoint import checkpoint

from resmlp.core.errors import UserError
from resmlp.models import fused
from resmlp.models.fused import FusedOptions

Grid = tuple[int, int]

POOLINGS = ('avg', 'class_mlp')
NORMS = ('affine', 'layernorm')
CROSS_PATCHES = ('linear', 'mlp', 'conv3x3', 'dwconv3x3', 'dwsep3x3', 'none')
GRID_ADAPTS = ('none', 'interpolate', 'subgrid')

# The cross-patch "MLP" ablation (Table 3, linear -> MLP) uses the same structure as
# the channel MLP, N -> 4N -> N over the token axis: with 4x it lands on the paper's
# 18.6M parameters and 4.3 GFLOPs for S12 (1x would give 15.8M).
CROSS_PATCH_MLP_RATIO = 4
CLASS_MLP_DEPTH = 2  # CaiT's class-attention stage has 2 layers; the paper keeps 2.


def _check_choice(what: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise UserError(f"unknown {what} {value!r}; valid: {', '.join(choices)}")
    return value


def _grid_str(grid: Grid) -> str:
    return f'{grid[0]}x{grid[1]}'


# ---------------------------------------------------------------------------------------
# Small layers
# ---------------------------------------------------------------------------------------

class Affine(nn.Module):
    """Aff(x) = alpha * x + beta per channel: the paper's statistics-free "norm".

    alpha and beta are 1-D ([dim], as in the official code, not timm's [1, 1, dim]) so
    that the usual "no weight decay on 1-D parameters" rule already exempts them.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.beta, self.alpha, x)


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == 'affine':
        return Affine(dim)
    # eps as in timm/official LayerNorm variants of these models
    return nn.LayerNorm(dim, eps=1e-6)


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> linear projection (a conv with kernel = stride = patch).
    Tokens (B, N, D), or (N, B, D) with token_major: the same one copy out of the conv's
    (B, D, h, w) either way."""

    def __init__(self, patch_size: int, in_chans: int, dim: int, token_major: bool = False):
        super().__init__()
        self.patch_size = patch_size
        self.token_major = token_major
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def grid_for(self, height: int, width: int) -> Grid:
        p = self.patch_size
        if height % p or width % p:
            # a conv would silently drop the border; a crop that is not a multiple of the
            # patch size is almost always a data-pipeline mistake
            raise ValueError(f'input {height}x{width} is not a multiple of the patch size {p}')
        return height // p, width // p

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        grid = self.grid_for(x.shape[-2], x.shape[-1])
        # contiguous: every block then gets tokens of one memory layout, so one compiled
        # block serves the whole depth (core/compiling.py; a layout is part of its guards)
        tokens = self.proj(x).flatten(2)
        tokens = tokens.permute(2, 0, 1) if self.token_major else tokens.transpose(1, 2)
        return tokens.contiguous(), grid


class ChannelMLP(nn.Module):
    """Per-patch MLP d -> hidden -> d with GELU (the paper's B and C)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


# ---------------------------------------------------------------------------------------
# Patch-grid adaptation of weights that act on the token axis
# ---------------------------------------------------------------------------------------

def _resample_matrix(src: Grid, dst: Grid, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(h'*w', h*w) matrix R that resamples an image on the src grid to the dst grid.

    Antialiased bicubic: when shrinking 14x14 -> 6x6 each new value is a local average of
    the old ones, so that (after the callers' h*w / h'*w' rescale) sums over the axis are
    kept even for the very local, conv-like rows that trained A matrices have.
    Built by resampling the identity basis and applied as a matmul, because autograd and
    torch.compile then only see a matmul: the antialiased interpolate's own backward has
    no meta kernel in torch 2.x and breaks compiled training.
    """
    n = src[0] * src[1]
    basis = torch.eye(n, device=device, dtype=torch.float32).reshape(n, 1, src[0], src[1])
    r = F.interpolate(basis, size=dst, mode='bicubic', align_corners=False, antialias=True)
    return r.reshape(n, dst[0] * dst[1]).t().to(dtype)


def _resample_token_axis(t: torch.Tensor, src: Grid, dst: Grid) -> torch.Tensor:
    """Resample the last axis of `t` (h*w values on the src grid) to the dst grid."""
    return t @ _resample_matrix(src, dst, t.device, t.dtype).t()


def _subgrid_index(src: Grid, dst: Grid, device: torch.device) -> torch.Tensor:
    """Flat token indices of the centered dst sub-grid of the src grid."""
    top, left = (src[0] - dst[0]) // 2, (src[1] - dst[1]) // 2
    rows = torch.arange(top, top + dst[0], device=device)
    cols = torch.arange(left, left + dst[1], device=device)
    return (rows[:, None] * src[1] + cols[None, :]).reshape(-1)


def _check_adaptable(mode: str, built: Grid, grid: Grid) -> None:
    if mode == 'none':
        raise ValueError(
            f"input grid {_grid_str(grid)} does not match the model's {_grid_str(built)} patch grid; "
            'set grid_adapt=interpolate or subgrid')
    if mode == 'subgrid' and (grid[0] > built[0] or grid[1] > built[1]):
        raise ValueError(
            f"grid_adapt=subgrid needs an input grid no larger than the model's {_grid_str(built)} "
            f'patch grid, got {_grid_str(grid)}; use grid_adapt=interpolate')


def adapt_token_mixing(weight: torch.Tensor, bias: torch.Tensor, built: Grid, grid: Grid,
                       mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of an N x N token-mixing linear layer for another patch grid.

    interpolate: view the weight as (h, w, h, w), resample both the output and the input
      grid axes, and multiply by (h*w) / (h'*w'): a row of the built layer sums h*w
      inputs, a new row only h'*w', so the rescale keeps row sums (the response to a
      constant input) unchanged. The bias is an image over output positions: resampled,
      not rescaled.
    subgrid: the rows and columns of the centered h' x w' sub-grid, unscaled (the crop is
      treated as a window of the built grid at the same patch scale).
    Built from the live parameters on every call, so gradients reach them and an EMA
    teacher never sees stale weights.
    """
    if grid == built:
        return weight, bias
    _check_adaptable(mode, built, grid)
    if mode == 'subgrid':
        idx = _subgrid_index(built, grid, weight.device)
        return weight.index_select(0, idx).index_select(1, idx), bias.index_select(0, idx)
    r = _resample_matrix(built, grid, weight.device, weight.dtype)  # (N', N)
    scale = (built[0] * built[1]) / (grid[0] * grid[1])
    # resample the output (rows) and the input (columns) grid axes of A
    return (r @ weight @ r.t()) * scale, r @ bias


# ---------------------------------------------------------------------------------------
# Cross-patch sublayers: (B, N, D) tokens + (h, w) grid -> (B, N, D)
# ---------------------------------------------------------------------------------------

class CrossPatchLinear(nn.Module):
    """The paper's A: one N x N linear layer over patches, shared by all channels."""

    supports_grid_adapt = True

    def __init__(self, grid: Grid, grid_adapt: str = 'none'):
        super().__init__()
        n = grid[0] * grid[1]
        self.grid = grid
        self.grid_adapt = grid_adapt
        self.weight = nn.Parameter(torch.empty(n, n))
        self.bias = nn.Parameter(torch.zeros(n))
        trunc_normal_(self.weight, std=0.02)

    def weights_for(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        return adapt_token_mixing(self.weight, self.bias, self.grid, grid, self.grid_adapt)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        w, b = self.weights_for(grid)
        # (N, N) @ (B, N, D) mixes tokens; the bias is cast because under autocast the
        # product is bf16/fp16 while the parameter stays fp32 (and would promote)
        y = torch.matmul(w, x)
        return y + b.to(y.dtype).unsqueeze(-1)


class CrossPatchMLP(nn.Module):
    """Ablation "linear -> MLP": N -> 4N -> N with GELU over the token axis."""

    def __init__(self, grid: Grid, ratio: int = CROSS_PATCH_MLP_RATIO):
        super().__init__()
        n = grid[0] * grid[1]
        self.grid = grid
        self.fc1 = nn.Linear(n, n * ratio)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(n * ratio, n)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        if grid != self.grid:
            raise ValueError(
                f"input grid {_grid_str(grid)} does not match the model's {_grid_str(self.grid)} "
                'patch grid; cross_patch=mlp cannot adapt to another grid')
        return self.fc2(self.act(self.fc1(x.transpose(1, 2)))).transpose(1, 2)


class CrossPatchConv(nn.Module):
    """Ablations "linear -> 3x3 conv" on the (h, w) token grid: full, depth-wise, or
    depth-separable (depth-wise then point-wise). Works on any grid."""

    def __init__(self, dim: int, kind: str):
        super().__init__()
        self.kind = kind
        groups = dim if kind in ('dwconv3x3', 'dwsep3x3') else 1
        self.conv = nn.Conv2d(dim, dim, 3, padding=1, groups=groups)
        self.pointwise = nn.Conv2d(dim, dim, 1) if kind == 'dwsep3x3' else None

    @property
    def last_conv(self) -> nn.Conv2d:
        return self.pointwise if self.pointwise is not None else self.conv

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        b, n, d = x.shape
        y = self.conv(x.transpose(1, 2).reshape(b, d, grid[0], grid[1]))
        if self.pointwise is not None:
            y = self.pointwise(y)
        return y.flatten(2).transpose(1, 2)


def make_cross_patch(kind: str, dim: int, grid: Grid, grid_adapt: str) -> Optional[nn.Module]:
    if kind == 'linear':
        return CrossPatchLinear(grid, grid_adapt)
    if kind == 'mlp':
        return CrossPatchMLP(grid)
    if kind == 'none':
        return None
    return CrossPatchConv(dim, kind)


# ---------------------------------------------------------------------------------------
# Block
# ---------------------------------------------------------------------------------------

class ResMLPBlock(nn.Module):
    """Cross-patch sublayer then channel MLP, each pre-Aff, LayerScale'd and residual.

    ls1 / ls2 are the paper's post-Aff: per-channel scales without a beta (as in the
    official code). With cross_patch='none' the first sublayer does not exist.
    """

    token_major = False   # the tokens it takes are (B, N, D)

    def __init__(self, dim: int, grid: Grid, mlp_ratio: float, init_values: float,
                 drop_path: float, norm: str, cross_patch: str, grid_adapt: str):
        super().__init__()
        self.cross_patch = make_cross_patch(cross_patch, dim, grid, grid_adapt)
        if self.cross_patch is None:
            self.norm1 = None
            self.register_parameter('ls1', None)
        else:
            self.norm1 = make_norm(norm, dim)
            self.ls1 = nn.Parameter(torch.full((dim,), float(init_values)))
        self.norm2 = make_norm(norm, dim)
        self.mlp = ChannelMLP(dim, int(dim * mlp_ratio))
        self.ls2 = nn.Parameter(torch.full((dim,), float(init_values)))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        if self.cross_patch is not None:
            y = self.cross_patch(self.norm1(x), grid)
            # ls1 is None after fold_affine has merged it into the cross-patch layer
            x = x + self.drop_path(y if self.ls1 is None else y * self.ls1)
        y = self.mlp(self.norm2(x))
        return x + self.drop_path(y if self.ls2 is None else y * self.ls2)


class FusedResMLPBlock(ResMLPBlock):
    """ResMLPBlock with the same parameters and state-dict keys, whose forward folds the
    Affs and LayerScales into the neighbouring weights on every call (models/fused.py has
    the algebra): the same function with fewer passes over the activations, for training.
    `options` (FusedOptions): how it runs; token_major: its tokens are (N, B, D) rather
    than (B, N, D), which the model's patch embedding then writes.
    """

    def __init__(self, *args, options: FusedOptions | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = options if options is not None else FusedOptions()

    @property
    def token_major(self) -> bool:
        return self.options.token_major

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        return fused.fused_block_forward(self, x, grid)

    def extra_repr(self) -> str:
        return fused.describe(self)


# ---------------------------------------------------------------------------------------
# Class-MLP pooling
# ---------------------------------------------------------------------------------------

class ClassMLPLayer(nn.Module):
    """CaiT's class-attention layer with the attention replaced by a linear layer.

    Only the class token is updated; the patch tokens are read, not changed:
        c = c + ls1 * (m @ Aff1([c; patches]) + m0)   # m: N+1 weights shared by channels
        c = c + ls2 * MLP(Aff2(c))
    """

    supports_grid_adapt = True

    def __init__(self, dim: int, grid: Grid, mlp_ratio: float, init_values: float,
                 norm: str, grid_adapt: str):
        super().__init__()
        self.grid = grid
        self.grid_adapt = grid_adapt
        self.norm1 = make_norm(norm, dim)
        # column 0 weighs the class token, columns 1.. the patches
        self.mix = nn.Linear(grid[0] * grid[1] + 1, 1)
        self.ls1 = nn.Parameter(torch.full((dim,), float(init_values)))
        self.norm2 = make_norm(norm, dim)
        self.mlp = ChannelMLP(dim, int(dim * mlp_ratio))
        self.ls2 = nn.Parameter(torch.full((dim,), float(init_values)))

    def mix_weight_for(self, grid: Grid) -> torch.Tensor:
        w = self.mix.weight
        if grid == self.grid:
            return w
        _check_adaptable(self.grid_adapt, self.grid, grid)
        cls_w, patch_w = w[:, :1], w[:, 1:]
        if self.grid_adapt == 'subgrid':
            patch_w = patch_w.index_select(1, _subgrid_index(self.grid, grid, w.device))
        else:  # same row-sum rule as adapt_token_mixing
            scale = (self.grid[0] * self.grid[1]) / (grid[0] * grid[1])
            patch_w = _resample_token_axis(patch_w, self.grid, grid) * scale
        return torch.cat([cls_w, patch_w], dim=1)

    def forward(self, cls: torch.Tensor, patches: torch.Tensor, grid: Grid) -> torch.Tensor:
        u = self.norm1(torch.cat([cls, patches], dim=1))
        mixed = torch.matmul(self.mix_weight_for(grid), u)
        mixed = mixed + self.mix.bias.to(mixed.dtype).unsqueeze(-1)
        cls = cls + self.ls1 * mixed
        return cls + self.ls2 * self.mlp(self.norm2(cls))


class ClassMLPPool(nn.Module):
    """Class-MLP pooling (paper Sec. 2): a learned class token updated by 2 ClassMLPLayers
    from the (final-normed) patch tokens, then an Aff. Returns (B, D).

    Adds 2,369,292 parameters to S12: 17,720,164 in all at 224 px / 1000 classes (paper:
    17.7M), and ~2.4M MACs (FLOPs stay at 3.0G).
    """

    def __init__(self, dim: int, grid: Grid, mlp_ratio: float, init_values: float,
                 norm: str, grid_adapt: str, depth: int = CLASS_MLP_DEPTH):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        trunc_normal_(self.cls_token, std=0.02)
        self.layers = nn.ModuleList(
            ClassMLPLayer(dim, grid, mlp_ratio, init_values, norm, grid_adapt) for _ in range(depth))
        self.norm = make_norm(norm, dim)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        # a copy, not an expand(): a view of a parameter made under no_grad has
        # requires_grad but no grad_fn, which trips module hooks (FlopCounterMode)
        cls = self.cls_token.repeat(x.shape[0], 1, 1)
        for layer in self.layers:
            cls = layer(cls, x, grid)
        return self.norm(cls[:, 0])


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------

class ResMLP(nn.Module):
    """ResMLP image model: patch embedding, `depth` residual blocks, final Aff, pooling, head.

    forward_features(x) -> (B, N, D) tokens after the final norm.
    forward_head(tokens) -> (B, num_classes) logits, or (B, D) with pre_logits=True or
      num_classes=0 (head = Identity).
    grid_adapt ('none' | 'interpolate' | 'subgrid') says what to do with an input whose
      patch grid differs from the built one; it is a runtime attribute (`model.grid_adapt
      = 'subgrid'`) that reaches every cross-patch layer. Conv cross-patch variants take
      any grid; the MLP variant none but its own.
    block_layer: the blocks' class, as timm's models take it: ResMLPBlock, or FusedResMLPBlock
      with its FusedOptions (`block_layer(fused=True, ...)`: the same parameters and function,
      Aff and LayerScale folded into the next weights on every forward, models/fused.py).
      Token-major blocks take (N, B, D) tokens from the patch embedding to the final norm;
      forward_features then returns a (B, N, D) view of them.
    """

    def __init__(self, img_size: int | Sequence[int] = 224, patch_size: int = 16, in_chans: int = 3,
                 num_classes: int = 1000, dim: int = 384, depth: int = 12, mlp_ratio: float = 4.0,
                 init_values: float = 0.1, drop_path_rate: float = 0.0, pooling: str = 'avg',
                 norm: str = 'affine', cross_patch: str = 'linear', grid_adapt: str = 'none',
                 block_layer=ResMLPBlock):
        super().__init__()
        img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.img_size = img_size
        self.patch_size = patch_size
        self.num_classes = num_classes
        self.num_features = dim
        self.pooling = _check_choice('pooling', pooling, POOLINGS)
        self.norm_kind = _check_choice('norm', norm, NORMS)
        self.cross_patch_kind = _check_choice('cross_patch', cross_patch, CROSS_PATCHES)
        _check_choice('grid_adapt', grid_adapt, GRID_ADAPTS)
        self.grad_checkpointing = False
        self.folded = False

        self.patch_embed = PatchEmbed(patch_size, in_chans, dim)
        grid = self.patch_embed.grid_for(*img_size)
        self._grid = grid
        # Constant stochastic depth over blocks, as in the official ResMLP and timm code
        # (DINO's ViT ramps it linearly; ResMLP never did).
        self.blocks = nn.ModuleList(
            block_layer(dim, grid, mlp_ratio, init_values, drop_path_rate, norm, cross_patch, grid_adapt)
            for _ in range(depth))
        self.patch_embed.token_major = any(b.token_major for b in self.blocks)   # the layout the blocks take
        self.norm = make_norm(norm, dim)
        self.pool = (ClassMLPPool(dim, grid, mlp_ratio, init_values, norm, grid_adapt)
                     if pooling == 'class_mlp' else None)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        self._grid_adapt = grid_adapt
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        # official ResMLP init: truncated normal 0.02 for every linear, zero biases;
        # convs keep PyTorch's default
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    # -- properties ---------------------------------------------------------------------

    @property
    def grid_size(self) -> Grid:
        """The patch grid (h, w) the token-axis weights were built for."""
        return self._grid

    @property
    def num_patches(self) -> int:
        return self._grid[0] * self._grid[1]

    @property
    def grid_adapt(self) -> str:
        return self._grid_adapt

    @grid_adapt.setter
    def grid_adapt(self, mode: str) -> None:
        self._grid_adapt = _check_choice('grid_adapt', mode, GRID_ADAPTS)
        for m in self.modules():
            if getattr(m, 'supports_grid_adapt', False):
                m.grid_adapt = mode

    @property
    def fused(self) -> bool:
        """Whether the blocks are FusedResMLPBlocks (block_layer(fused=True))."""
        return any(isinstance(b, FusedResMLPBlock) for b in self.blocks)

    @property
    def token_major(self) -> bool:
        """Whether the blocks' tokens are (N, B, D): set by the patch embedding's layout."""
        return self.patch_embed.token_major

    def make_batch_major(self) -> None:
        """Tokens (B, N, D) from here on, for blocks that take only that layout (fold_affine's)."""
        self.patch_embed.token_major = False
        for blk in self.blocks:
            if isinstance(blk, FusedResMLPBlock):
                blk.options = dataclasses.replace(blk.options, token_major=False)

    def _batch_major(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks' tokens as (B, N, D): a view, no copy, of token-major ones."""
        return x.transpose(0, 1) if self.token_major else x

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Names of parameters that should get no weight decay: Aff / LayerNorm, LayerScale
        and the class token (besides biases). Needed because timm-shaped checkpoints or
        other rules may not see them as 1-D."""
        names = set()
        for mod_name, m in self.named_modules():
            prefix = f'{mod_name}.' if mod_name else ''
            if isinstance(m, (Affine, nn.LayerNorm)):
                names.update(prefix + n for n, _ in m.named_parameters(recurse=False))
            for n in ('ls1', 'ls2', 'cls_token'):
                if getattr(m, n, None) is not None and isinstance(getattr(m, n), nn.Parameter):
                    names.add(prefix + n)
        return names

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """New head with `num_classes` outputs (0: Identity, forward returns pooled features)."""
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            self._init_weights(self.head)

    # -- forward ------------------------------------------------------------------------

    def _run_blocks(self, x: torch.Tensor, grid: Grid, keep_last: int = 0) -> tuple[torch.Tensor, list]:
        kept = []
        first_kept = len(self.blocks) - keep_last
        for i, blk in enumerate(self.blocks):
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, grid, use_reentrant=False)
            else:
                x = blk(x, grid)
            if i >= first_kept:
                kept.append(x)
        return x, kept

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> tokens (B, H/p * W/p, D) after the final norm.

        On a fold_affine() copy the final Aff may have moved into the head: tokens are
        then returned before it.
        """
        x, grid = self.patch_embed(x)
        x, _ = self._run_blocks(x, grid)
        # the norm is per channel: on token-major tokens it runs before the view, which the
        # pooling then reads in place (a mean over N reads either layout)
        return self._batch_major(self.norm(x))

    def _grid_of_tokens(self, n: int) -> Grid:
        if n == self.num_patches:
            return self._grid
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f'cannot tell the patch grid of {n} tokens; pass grid=(h, w) to forward_head')
        return side, side

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False,
                     grid: Optional[Grid] = None) -> torch.Tensor:
        """Tokens (B, N, D) -> pooled (B, D) if pre_logits, else head(pooled).

        `grid` matters only for class_mlp pooling on a non-square grid other than the
        built one; otherwise it is inferred from N.
        """
        if self.pool is None:
            x = x.mean(dim=1)
        else:
            x = self.pool(x, grid if grid is not None else self._grid_of_tokens(x.shape[1]))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.patch_embed.grid_for(x.shape[-2], x.shape[-1])
        return self.forward_head(self.forward_features(x), grid=grid)

    def pooled_block_features(self, x: torch.Tensor, n: int = 1) -> list[torch.Tensor]:
        """Average-pooled tokens of each of the last `n` blocks, oldest first: n tensors (B, D).

        Each block's output goes through the model's final norm before pooling (as DINO's
        ViT probe normalises every intermediate layer), so the last entry equals
        forward_head(forward_features(x), pre_logits=True) for avg pooling. Concatenate
        them for a DINO-style linear probe. Always average pooling, even with class_mlp.
        """
        if not 1 <= n <= len(self.blocks):
            raise ValueError(f'n must be between 1 and depth={len(self.blocks)}, got {n}')
        if self.folded:
            raise ValueError('pooled_block_features needs the final norm, which fold_affine removed; '
                             'use the unfolded model')
        x, grid = self.patch_embed(x)
        _, kept = self._run_blocks(x, grid, keep_last=n)
        return [self._batch_major(self.norm(t)).mean(dim=1) for t in kept]


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------

# Architecture per name; init_values is the official per-depth LayerScale init
# (timm's own resmlp_12_224 uses 1e-4: these are the train-from-scratch values).
ARCHS: dict[str, dict] = {
    'resmlp_s12': dict(dim=384, depth=12, patch_size=16, init_values=0.1),
    'resmlp_s24': dict(dim=384, depth=24, patch_size=16, init_values=1e-5),
    'resmlp_s36': dict(dim=384, depth=36, patch_size=16, init_values=1e-6),
    'resmlp_b24': dict(dim=768, depth=24, patch_size=16, init_values=1e-6),
}

_INT_KEYS = ('patch_size', 'in_chans', 'num_classes', 'dim', 'depth')
_FLOAT_KEYS = ('drop_path_rate', 'init_values', 'mlp_ratio')
_CHOICE_KEYS = {'pooling': POOLINGS, 'norm': NORMS, 'cross_patch': CROSS_PATCHES,
                'grid_adapt': GRID_ADAPTS}
# How the fused blocks run (FusedOptions, whose words are their limits in configs/):
# block_layer's keys with `fused`
FUSED_OPTIONS = FusedOptions.names()
_BOOL_KEYS = ('fused', 'token_major')
OVERRIDE_KEYS = ('img_size',) + _INT_KEYS + _FLOAT_KEYS + tuple(_CHOICE_KEYS) + ('fused', *FUSED_OPTIONS)


def _as_int(key: str, v) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and re.fullmatch(r'\s*-?\d+\s*', v):
        return int(v)
    raise UserError(f'model.{key} must be an integer, got {v!r}')


def _as_float(key: str, v) -> float:
    # YAML 1.1 reads "1e-5" (no dot) as a string; accept it
    try:
        if isinstance(v, bool):
            raise ValueError
        return float(v)
    except (TypeError, ValueError):
        raise UserError(f'model.{key} must be a number, got {v!r}') from None


def _check_overrides(overrides: Mapping) -> dict:
    out = {}
    for key, v in overrides.items():
        if key not in OVERRIDE_KEYS:
            raise UserError(f"unknown model option {key!r}; valid: {', '.join(OVERRIDE_KEYS)}")
        if key == 'img_size':
            if isinstance(v, (list, tuple)):
                if len(v) != 2:
                    raise UserError(f'model.img_size must be an integer or [height, width], got {v!r}')
                v = (_as_int(key, v[0]), _as_int(key, v[1]))
            else:
                v = _as_int(key, v)
        elif key in _INT_KEYS:
            v = _as_int(key, v)
            if v < (0 if key == 'num_classes' else 1):
                raise UserError(f'model.{key} must be positive, got {v}')
        elif key in _FLOAT_KEYS:
            v = _as_float(key, v)
        elif key in _BOOL_KEYS:
            if not isinstance(v, bool):
                raise UserError(f'model.{key} must be true or false, got {v!r}')
        elif key in _CHOICE_KEYS:
            v = _check_choice(f'model.{key}', v, _CHOICE_KEYS[key])
        out[key] = v  # a fused option's word: FusedOptions checks it
    return out


def block_layer(fused: bool = False, **options):
    """The blocks' class for model.fused and the fused blocks' options (FusedOptions,
    each a model.<name> key): ResMLPBlock, or FusedResMLPBlock with them (ResMLP's
    block_layer). An option away from the plain blocks' way without fused is a UserError."""
    opts = FusedOptions(**options)
    if fused:
        return functools.partial(FusedResMLPBlock, options=opts)
    for name, value, why in opts.unlike_plain():
        shown = str(value).lower() if isinstance(value, bool) else value
        raise UserError(f'model.{name}={shown} needs model.fused=true ({why})')
    return ResMLPBlock


def create_resmlp(name: str, **overrides) -> ResMLP:
    """Build a named ResMLP; see resmlp.models.create_model."""
    if name not in ARCHS:
        raise UserError(f"unknown model {name!r}; valid: {', '.join(ARCHS)}")
    kwargs = dict(ARCHS[name])
    kwargs.update(_check_overrides(overrides))
    img = kwargs.get('img_size', 224)
    hw = (img, img) if isinstance(img, int) else img
    p = kwargs['patch_size']
    if p <= 0 or hw[0] % p or hw[1] % p:
        raise UserError(f'model.img_size {hw[0]}x{hw[1]} is not a multiple of model.patch_size {p}')
    blocks = block_layer(**{k: kwargs.pop(k) for k in ('fused', *FUSED_OPTIONS) if k in kwargs})
    return ResMLP(**kwargs, block_layer=blocks)
