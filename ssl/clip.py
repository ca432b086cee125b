"""DINO's gradient clipping: each parameter's gradient norm clipped on its own, which the
plain step (step.py) and the graphed one (graphed_step.py) both apply."""
from __future__ import annotations

import torch


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
