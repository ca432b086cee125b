"""The teacher follows the student by an exponential moving average of the weights."""
from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def update_teacher(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """teacher = momentum * teacher + (1 - momentum) * student, for every parameter.

    One fused multi-tensor op instead of a Python loop over ~100 tensors. Parameters
    that get no gradient (the head's fixed weight norm) are averaged too, as in DINO.
    """
    t = list(teacher.parameters())
    s = list(student.parameters())
    if len(t) != len(s):
        raise RuntimeError("teacher and student have different parameter lists")
    torch._foreach_lerp_(t, s, 1.0 - momentum)
