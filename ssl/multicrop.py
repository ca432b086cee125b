"""Student and teacher: backbone + DINO head over a list of crops of several resolutions.

Crops of one resolution go through the backbone as one batch (as in DINO's
MultiCropWrapper); the head then sees every crop's pooled feature at once. For a
ResMLP the smaller local crops only pass when the backbone's `grid_adapt` is
`interpolate` or `subgrid`; with `resize` they arrive at the global size already.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from resmlp.core.errors import UserError


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
        return head_forward(self.head, torch.cat(features))


def head_forward(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lightly's DINOProjectionHead.forward with the last layer in fp32.

    The MLP runs under whatever autocast is active; the L2 normalization and the
    weight-normed prototype layer run with autocast off, so the logits that the
    loss's softmax sharpens by 1/0.04 carry fp32, not bf16, rounding. Any other head
    is called as it is."""
    if not (hasattr(head, "layers") and hasattr(head, "last_layer")):
        return head(x)
    z = head.layers(x)
    with torch.autocast(x.device.type, enabled=False):
        return head.last_layer(F.normalize(z.float(), dim=-1, p=2))


def build_head(in_dim: int, dino_cfg) -> nn.Module:
    """lightly's DINO head: 3-layer MLP, bottleneck, L2-normalized weight-normed last layer."""
    import warnings

    from lightly.models.modules import DINOProjectionHead
    with warnings.catch_warnings():  # lightly still uses torch's old weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        return DINOProjectionHead(in_dim, dino_cfg.hidden_dim, dino_cfg.bottleneck_dim, dino_cfg.out_dim,
                                  batch_norm=False, freeze_last_layer=dino_cfg.freeze_last_layer,
                                  norm_last_layer=dino_cfg.norm_last_layer)


def build_networks(cfg, device):
    """Student and teacher: same backbone + head; the teacher is a separate build that
    loads the student's weights (lightly's weight-normed head cannot be deep-copied)."""
    from resmlp.models.from_config import build_model
    student_backbone = build_model(cfg.model, num_classes=0)
    teacher_cfg = OmegaConf.merge(cfg.model, {"drop_path_rate": 0.0})
    teacher_backbone = build_model(teacher_cfg, num_classes=0)
    if cfg.dino.local_crops in ("interpolate", "subgrid"):
        if not hasattr(student_backbone, "grid_adapt"):
            raise UserError(f"dino.local_crops={cfg.dino.local_crops} needs a ResMLP backbone; "
                            f"use resize or none for {cfg.model.name}")
        student_backbone.grid_adapt = cfg.dino.local_crops
    dim = student_backbone.num_features
    student = MultiCropNet(student_backbone, build_head(dim, cfg.dino)).to(device)
    teacher = MultiCropNet(teacher_backbone, build_head(dim, cfg.dino)).to(device)
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad_(False)
    return student, teacher
