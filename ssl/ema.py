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


@torch.no_grad()
def update_teacher_by(teacher: nn.Module, student: nn.Module, weight: torch.Tensor) -> None:
    """The same average with the student's weight 1 - momentum as a 0-dim tensor on the
    device (a CUDA graph reads it anew at each replay): teacher += weight * (student - teacher).

    Written out because torch's multi-tensor lerp takes its weight as a number only (a
    tensor would be read on the host, a sync the graph cannot hold)."""
    t = list(teacher.parameters())
    s = list(student.parameters())
    if len(t) != len(s):
        raise RuntimeError("teacher and student have different parameter lists")
    step = torch._foreach_sub(s, t)
    torch._foreach_mul_(step, weight)
    torch._foreach_add_(t, step)
