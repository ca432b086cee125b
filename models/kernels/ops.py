"""The fused block's calls into the kernels (models/fused.py, model.kernels=triton): the
operators take tensors of one precision, as the torch path's GEMMs see them under autocast,
and these calls cast what the torch path's autocast would."""
from __future__ import annotations

from typing import Optional

import torch

from resmlp.models.kernels.common import DOT_BF16, DOT_FP16, check_device, dot_mode
from resmlp.models.kernels.cross_patch import _forward_kernel, cross_patch
from resmlp.models.kernels.gelu_mlp import gelu_mlp

_AMP = {DOT_BF16: torch.bfloat16, DOT_FP16: torch.float16}


def cross_patch_residual(a: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], s: torch.Tensor,
                         c: torch.Tensor, mask: Optional[torch.Tensor], token_major: bool) -> torch.Tensor:
    """x + mask * (s * (a @ u) + c) over the token axis (u: x where None); tokens (N, B, D)
    if token_major else (B, N, D), c (N, D), mask broadcastable to one value per image. The
    result has the dtype of x and s promoted, as the torch path's."""
    check_device(_forward_kernel, x)
    dot = dot_mode(x.device)
    return cross_patch(a, x.contiguous(), None if u is None else u.contiguous(), s, c.to(s.dtype).contiguous(),
                       None if mask is None else mask.reshape(-1), 0 if token_major else 1, dot)


def gelu_mlp_forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                     b2: torch.Tensor) -> torch.Tensor:
    """fc2(GELU(fc1(x))) per token, x (..., D), weights as nn.Linear's; under autocast in its dtype."""
    check_device(_forward_kernel, x)
    dot = dot_mode(x.device)
    dtype = _AMP.get(dot, torch.promote_types(x.dtype, w1.dtype))
    rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    g, _, _ = gelu_mlp(rows, *(t.to(dtype).contiguous() for t in (w1, b1, w2, b2)), dot)
    return g.view(*x.shape[:-1], g.shape[-1])
