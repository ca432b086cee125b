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
    """DINO's clipping: each parameter's gradient norm is clipped on its own to max_norm.

    The same arithmetic as DINO's per-parameter loop, in a handful of kernels and with no
    read on the host: the norms are stacked once, every scale min(1, max_norm / (norm +
    1e-6)) is computed together, then spread to one full-size factor per gradient so that
    the multiply takes torch's fused multi-tensor path (it needs equal shapes pairwise; a
    0-dim factor per gradient would fall back to one kernel per parameter)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or max_norm <= 0:
        return
    norms = torch.stack(torch._foreach_norm(grads))
    scales = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    spread = torch.cat([s.expand(g.numel()) for s, g in zip(scales.unbind(0), grads)])
    factors = [f.view(g.shape) for f, g in zip(spread.split([g.numel() for g in grads]), grads)]
    torch._foreach_mul_(grads, factors)
