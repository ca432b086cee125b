"""Student and teacher: backbone + DINO head over a list of crops of several resolutions.

Crops of one resolution go through the backbone as one batch (as in DINO's
MultiCropWrapper); the head then sees every crop's pooled feature at once. For a
ResMLP the smaller local crops only pass when the backbone's `grid_adapt` is
`interpolate` or `subgrid`, which the crop plan (resmlp.data.crop_plan) names; with
`resize` they arrive at the global size already.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from omegaconf import OmegaConf

from resmlp.core.errors import UserError
from resmlp.ssl.head import build_head, head_forward


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


def build_networks(cfg, plan, device):
    """Student and teacher for the crops of `plan` (a resmlp.data.crop_plan.CropPlan): same
    backbone + head; the teacher is a separate build that loads the student's weights
    (lightly's weight-normed head cannot be deep-copied)."""
    from resmlp.models.from_config import build_model
    student_backbone = build_model(cfg.model, num_classes=0)
    teacher_cfg = OmegaConf.merge(cfg.model, {"drop_path_rate": 0.0})
    teacher_backbone = build_model(teacher_cfg, num_classes=0)
    if plan.grid_adapt != "none":
        if not hasattr(student_backbone, "grid_adapt"):
            raise UserError(f"dino.local_crops={plan.strategy} needs a ResMLP backbone; "
                            f"use resize or none for {cfg.model.name}")
        student_backbone.grid_adapt = plan.grid_adapt
    dim = student_backbone.num_features
    student = MultiCropNet(student_backbone, build_head(dim, cfg.dino)).to(device)
    teacher = MultiCropNet(teacher_backbone, build_head(dim, cfg.dino)).to(device)
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad_(False)
    return student, teacher
