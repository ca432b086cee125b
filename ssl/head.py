"""The DINO head: lightly's DINOProjectionHead, with its prototype layer run in fp32.

3-layer MLP (hidden_dim, GELU) -> bottleneck -> L2 normalization -> weight-normed linear
layer to out_dim prototypes without bias; with norm_last_layer its weight norm is fixed to
1, and during the first `freeze_last_layer` epochs that layer gets no update (DINO's
defaults; the step calls `cancel_last_layer_gradients`).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F


def build_head(in_dim: int, dino_cfg) -> nn.Module:
    """lightly's DINO head for `in_dim` backbone features, sized by the `dino:` section."""
    from lightly.models.modules import DINOProjectionHead
    with warnings.catch_warnings():  # lightly still uses torch's old weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        return DINOProjectionHead(in_dim, dino_cfg.hidden_dim, dino_cfg.bottleneck_dim, dino_cfg.out_dim,
                                  batch_norm=False, freeze_last_layer=dino_cfg.freeze_last_layer,
                                  norm_last_layer=dino_cfg.norm_last_layer)


def head_forward(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lightly's DINOProjectionHead.forward with the last layer in fp32.

    The MLP runs under whatever autocast is active; the L2 normalization and the
    weight-normed prototype layer run with autocast off, so the logits that the
    loss's softmax sharpens by 1 / teacher_temp carry fp32, not bf16, rounding. Any
    other head is called as it is."""
    if not (hasattr(head, "layers") and hasattr(head, "last_layer")):
        return head(x)
    z = head.layers(x)
    with torch.autocast(x.device.type, enabled=False):
        return head.last_layer(F.normalize(z.float(), dim=-1, p=2))
