"""The DINO head: lightly's DINOProjectionHead, with its prototype layer run in fp32.

3-layer MLP (hidden_dim, GELU) -> bottleneck -> L2 normalization -> weight-normed linear
layer to out_dim prototypes without bias; with norm_last_layer its weight norm is fixed to
1, and during the first `freeze_last_layer` epochs that layer gets no update (DINO's
defaults; the step calls `cancel_last_layer_gradients`).

`dino.bottleneck_norm=none` is DINO's head as published (the default); `batchnorm`
standardizes the bottleneck over the global batch before the L2 normalization
(`BatchStandardize`), a departure that only the budgets whose runs chose it use. Why:
docs/dino_learning.md.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from resmlp.core import dist
from resmlp.core.config import check_choice




class BatchStandardize(nn.Module):
    """Each bottleneck unit standardized over the global batch (every process's rows), with
    no affine and no running statistics, so a head has the same weights and checkpoint keys
    with it and without it, and behaves the same in train and eval mode.

    Why it is there: a ResMLP has no normalization layer that mixes images, and its student
    can make its predictions flat by growing a bottleneck component that every image shares;
    after the L2 normalization that component drowns the image-dependent part, the EMA
    teacher inherits it, the centering removes it, and what is left is a uniform target.
    Subtracting the batch mean closes that way out (docs/dino_learning.md)."""

    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in fp32 at least
        moments = torch.stack([x32.sum(0), (x32 * x32).sum(0)])
        rows = x.shape[0] * dist.world_size()  # every process holds a batch of the same size
        if dist.is_dist():
            # the differentiable all-reduce: each process's gradient then includes the other
            # processes' share of the statistics, as one process with the whole batch would
            from torch.distributed.nn.functional import all_reduce
            moments = all_reduce(moments)
        mean = moments[0] / rows
        var = (moments[1] / rows - mean * mean).clamp_min(0)
        # left in fp32: the L2 normalization and the prototypes after it run in fp32 anyway
        return (x32 - mean) * torch.rsqrt(var + self.eps)


def build_head(in_dim: int, dino_cfg) -> nn.Module:
    """lightly's DINO head for `in_dim` backbone features, sized by the `dino:` section,
    with `BatchStandardize` after the bottleneck when dino.bottleneck_norm=batchnorm."""
    from lightly.models.modules import DINOProjectionHead
    norm = dino_cfg.get("bottleneck_norm", "none")
    check_choice("dino.bottleneck_norm", norm)  # a config built in code, not by load_config
    with warnings.catch_warnings():  # lightly still uses torch's old weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        head = DINOProjectionHead(in_dim, dino_cfg.hidden_dim, dino_cfg.bottleneck_dim, dino_cfg.out_dim,
                                  batch_norm=False, freeze_last_layer=dino_cfg.freeze_last_layer,
                                  norm_last_layer=dino_cfg.norm_last_layer)
    if norm == "batchnorm":
        head.layers.append(BatchStandardize())
        # The standardization takes away any shift, so the bias before it gets a gradient of
        # rounding noise only, which AdamW would turn into steps of full size: keep it as it is.
        [m for m in head.layers if isinstance(m, nn.Linear)][-1].bias.requires_grad_(False)
    return head


def head_forward(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lightly's DINOProjectionHead.forward with the last layer in fp32.

    The MLP runs under whatever autocast is active; the L2 normalization and the
    weight-normed prototype layer run with autocast off, so the logits that the
    loss's softmax sharpens by 1 / teacher_temp carry fp32, not bf16, rounding. Any
    other head is called as it is."""
    if not (hasattr(head, "layers") and hasattr(head, "last_layer")):
        return head(x)
    z = head.layers(x)
    with torch.autocast(x.device.type, enabled=False):
        return head.last_layer(F.normalize(z.float(), dim=-1, p=2))
