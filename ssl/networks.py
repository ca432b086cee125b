"""Student and teacher: backbone + DINO head over a list of crops of several resolutions.

Crops of one resolution go through the backbone as one batch (as in DINO's
MultiCropWrapper); the head then sees every crop's pooled feature at once. For a
ResMLP the smaller local crops only pass when the backbone's `grid_adapt` is
`interpolate` or `subgrid`, which the crop plan (resmlp.data.crop_plan) names; with
`resize` they arrive at the global size already.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from omegaconf import OmegaConf

from resmlp.core.config import check_choice
from resmlp.core.errors import UserError
from resmlp.ssl.head import build_head, head_forward


class MultiCropNet(nn.Module):
    """`head_precision`: dino.head_precision (ssl/head.py). `compile_head` makes the head's
    call a compiled region of its own (compile=true; the blocks are compiled apart)."""

    def __init__(self, backbone: nn.Module, head: nn.Module, head_precision: str = "fp32"):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.head_precision = head_precision
        self.head_forward = head_forward

    def compile_head(self, on: bool = True) -> None:
        """The head's call compiled as a region (on) or eager again (a run falling back)."""
        from resmlp.core.compiling import compiled
        self.head_forward = compiled(head_forward) if on else head_forward

    def forward(self, crops: list[torch.Tensor], global_features: bool = False):
        """The head's outputs of every crop, in the crops' order; with global_features,
        also the pooled backbone features of the first two crops (the global views), for
        a loss on them (KoLeo)."""
        features, start = [], 0
        while start < len(crops):
            end = start
            while end < len(crops) and crops[end].shape[-1] == crops[start].shape[-1]:
                end += 1
            features.append(self.backbone(torch.cat(crops[start:end])))
            start = end
        out = self.head_forward(self.head, torch.cat(features), self.head_precision)
        if global_features:
            return out, features[0][:2 * crops[0].shape[0]]
        return out


@dataclass
class DinoHooks:
    """The DINO trainer's extension points for studies (studies/), passed to
    `resmlp.ssl.train.train(cfg, hooks)`; each is called where noted, and None changes
    nothing. They let a study try a variant of the method without editing the package or
    replacing its functions at run time.

    backbone(model_cfg) -> nn.Module: builds each backbone (student, and teacher with
        drop_path_rate 0) in place of models.from_config.build_model.
    head(head, dino_cfg) -> nn.Module: receives each head as built (student and teacher
        alike) and returns the head to use.
    views(views, cfg): once the data path (data.crop_plan.DinoViews) is built.
    step(step, cfg): once the step (ssl.step.DinoStep) is built, before any iteration.
    """
    backbone: Callable | None = None
    head: Callable | None = None
    views: Callable | None = None
    step: Callable | None = None


def build_networks(cfg, plan, device, hooks: DinoHooks | None = None, start=None):
    """Student and teacher for the crops of `plan` (a resmlp.data.crop_plan.CropPlan): same
    backbone + head; the teacher is a separate build that loads the student's weights
    (lightly's weight-normed head cannot be deep-copied). `start` (ssl.init.Start): the
    weights dino.init gives the backbone (and the head, where it gives one)."""
    from resmlp.models.from_config import build_model
    hooks = hooks or DinoHooks()
    backbone = hooks.backbone or (lambda model_cfg: build_model(model_cfg, num_classes=0))
    student_backbone = backbone(cfg.model)
    teacher_backbone = backbone(OmegaConf.merge(cfg.model, {"drop_path_rate": 0.0}))
    if plan.grid_adapt != "none":
        if not hasattr(student_backbone, "grid_adapt"):
            raise UserError(f"dino.local_crops={plan.strategy} needs a ResMLP backbone; "
                            f"use resize or none for {cfg.model.name}")
        student_backbone.grid_adapt = plan.grid_adapt
    dim = student_backbone.num_features
    head = hooks.head or (lambda h, dino_cfg: h)
    precision = cfg.dino.head_precision
    check_choice("dino.head_precision", precision)   # a config built in code, not by load_config
    student = MultiCropNet(student_backbone, head(build_head(dim, cfg.dino), cfg.dino), precision)
    if start is not None and start.backbone is not None:
        student.backbone.load_state_dict(start.backbone)
        if start.head is not None:
            student.head.load_state_dict(start.head)
    student = student.to(device)
    teacher = MultiCropNet(teacher_backbone, head(build_head(dim, cfg.dino), cfg.dino), precision).to(device)
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad_(False)
    return student, teacher
