"""`fold_affine`: an inference copy of a ResMLP with its Aff and LayerScale parameters
merged into the neighbouring linear layers (the paper: "Aff has no inference cost")."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from resmlp.models.resmlp import Affine, CrossPatchConv, CrossPatchLinear, FusedResMLPBlock, Grid, ResMLP, ResMLPBlock

def _split_norm(norm: nn.Module) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """norm = affine(normalize(x)) -> (normalize module, alpha, beta)."""
    if isinstance(norm, Affine):
        return nn.Identity(), norm.alpha.detach(), norm.beta.detach()
    assert isinstance(norm, nn.LayerNorm) and norm.elementwise_affine
    return (nn.LayerNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=False),
            norm.weight.detach(), norm.bias.detach())


def _fold_in_affine(linear: nn.Linear, alpha: torch.Tensor, beta: torch.Tensor) -> None:
    """linear(alpha * x + beta) == linear'(x)."""
    w, b = linear.weight.detach(), linear.bias.detach()
    linear.bias.data = b + w @ beta
    linear.weight.data = w * alpha


def _fold_out_scale(layer: nn.Module, gamma: torch.Tensor) -> None:
    """gamma * layer(x) == layer'(x) for a linear or conv layer (gamma per output)."""
    shape = (-1,) + (1,) * (layer.weight.dim() - 1)
    layer.weight.data = layer.weight.detach() * gamma.reshape(shape)
    layer.bias.data = layer.bias.detach() * gamma


class FoldedCrossPatchLinear(nn.Module):
    """norm1's affine, the cross-patch linear and ls1 merged:

        g * (A @ (alpha * x + beta) + a) = (A @ x) * s + rowsum(A) (x) t + a (x) g
        with s = g * alpha, t = g * beta per channel, rowsum(A) and a per token.

    A mixes tokens while alpha/beta/g act on channels, so the affine cannot move inside A;
    the (N x D) constant term is rebuilt from A's row sums each call (not stored), which
    keeps grid adaptation working: `linear` is the original, still adaptable, layer.
    """

    def __init__(self, linear: CrossPatchLinear, alpha: torch.Tensor, beta: torch.Tensor,
                 gamma: torch.Tensor):
        super().__init__()
        self.linear = linear
        self.scale = nn.Parameter(gamma * alpha)
        self.shift = nn.Parameter(gamma * beta)
        self.gamma = nn.Parameter(gamma.clone())

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        w, b = self.linear.weights_for(grid)
        const = w.sum(dim=1, keepdim=True) * self.shift + b.unsqueeze(-1) * self.gamma
        return torch.addcmul(const, torch.matmul(w, x), self.scale)


@torch.no_grad()
def fold_affine(model: ResMLP) -> ResMLP:
    """An eval-mode inference copy of `model` with the Aff / LayerScale parameters merged
    into neighbouring linear layers. Exact up to float rounding; `model` is unchanged.

    Per block: norm2's affine goes into fc1 and ls2 into fc2 (exact). norm1 and ls1
    become FoldedCrossPatchLinear (linear cross-patch; the affine acts on channels, A on
    tokens, so a per-channel scale and a rank-2 constant remain), or ls1 goes into the
    last conv (conv variants; norm1 stays: zero padding breaks an exact fold of its
    beta); the MLP cross-patch variant keeps both. LayerNorm keeps its normalisation and
    loses only its affine. With average pooling and a linear head the final norm goes into
    the head (forward_features then returns tokens before it); with class_mlp the pool's
    last norm goes into the head. pooled_block_features refuses folded models.
    """
    folded = copy.deepcopy(model).eval()
    folded.make_batch_major()  # the plain blocks below take (B, N, D) tokens
    for blk in folded.blocks:
        if isinstance(blk, FusedResMLPBlock):
            # the same parameters under the plain forward: here the folding is done once, for good
            blk.__class__ = ResMLPBlock
        normalize, alpha, beta = _split_norm(blk.norm2)
        _fold_in_affine(blk.mlp.fc1, alpha, beta)
        _fold_out_scale(blk.mlp.fc2, blk.ls2.detach())
        blk.norm2 = normalize
        blk.register_parameter('ls2', None)

        cp = blk.cross_patch
        if isinstance(cp, CrossPatchLinear):
            normalize, alpha, beta = _split_norm(blk.norm1)
            blk.cross_patch = FoldedCrossPatchLinear(cp, alpha, beta, blk.ls1.detach())
            blk.norm1 = normalize
            blk.register_parameter('ls1', None)
        elif isinstance(cp, CrossPatchConv):
            _fold_out_scale(cp.last_conv, blk.ls1.detach())
            blk.register_parameter('ls1', None)

    if isinstance(folded.head, nn.Linear):
        if folded.pool is None:
            normalize, alpha, beta = _split_norm(folded.norm)
            folded.norm = normalize
        else:
            normalize, alpha, beta = _split_norm(folded.pool.norm)
            folded.pool.norm = normalize
        _fold_in_affine(folded.head, alpha, beta)
    folded.folded = True
    return folded

