"""Backbone + DINO head over a list of crops of several resolutions.

Crops of one resolution go through the backbone as one batch (as in DINO's
MultiCropWrapper); the head then sees every crop's pooled feature at once. For a
ResMLP the smaller local crops only pass when the backbone's `grid_adapt` is
`interpolate` or `subgrid`; with `resize` they arrive at the global size already.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class MultiCropNet(nn.Module):
    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, crops: list[torch.Tensor]) -> torch.Tensor:
        features, start = [], 0
        while start < len(crops):
            end = start
            while end < len(crops) and crops[end].shape[-1] == crops[start].shape[-1]:
                end += 1
            features.append(self.backbone(torch.cat(crops[start:end])))
            start = end
        return self.head(torch.cat(features))


def build_head(in_dim: int, dino_cfg) -> nn.Module:
    """lightly's DINO head: 3-layer MLP, bottleneck, L2-normalized weight-normed last layer."""
    import warnings

    from lightly.models.modules import DINOProjectionHead
    with warnings.catch_warnings():  # lightly still uses torch's old weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        return DINOProjectionHead(in_dim, dino_cfg.hidden_dim, dino_cfg.bottleneck_dim, dino_cfg.out_dim,
                                  batch_norm=False, freeze_last_layer=dino_cfg.freeze_last_layer,
                                  norm_last_layer=dino_cfg.norm_last_layer)
