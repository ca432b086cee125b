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
def clip_per_parameter(parameters, max_norm: float) -> None:
    """DINO's clipping: each parameter's gradient norm is clipped on its own to max_norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or max_norm <= 0:
        return
    norms = torch._foreach_norm(grads)
    scales = [torch.clamp(max_norm / (n + 1e-6), max=1.0) for n in norms]
    torch._foreach_mul_(grads, scales)
