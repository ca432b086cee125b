"""The DINO head: lightly's DINOProjectionHead, with its prototype layer run in fp32 (or,
with dino.head_precision, TF32 or bf16 operands summed in fp32).

3-layer MLP (hidden_dim, GELU) -> bottleneck -> L2 normalization -> weight-normed linear
layer to out_dim prototypes without bias; with norm_last_layer its weight norm is fixed to
1, and during the first `freeze_last_layer` epochs that layer gets no update (DINO's
defaults; the step calls `cancel_last_layer_gradients`).

`dino.bottleneck_norm=none` is DINO's head as published (the default); `batchnorm`
standardizes the bottleneck over the global batch before the L2 normalization
(`BatchStandardize`), a departure that only the budgets whose runs chose it use. Why:
docs/dino_learning.md.

`dino.head_precision` says how the prototype layer multiplies (`head_forward`): fp32 (the
default: no TF32, float32_matmul_precision left at torch's "highest"), tf32 (on CUDA its
operands rounded to TF32's 10-bit mantissa, as fp16 autocast rounds them in DINO's own
main_dino.py, but with fp32 sums and logits; on a CPU, which has no TF32, fp32) or bf16
(operands in bf16, products summed and returned in fp32), forward and backward
(`prototype_mm`). tests/test_head.py compares them with fp32 and with DINO as published
(fp16 autocast, logits rounded to fp16): TF32 departs from fp32 no more than that in the
loss's gradients, bf16 within the test's bound of it.
"""
from __future__ import annotations

import contextlib
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
    norm = dino_cfg.bottleneck_norm
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


def head_forward(head: nn.Module, x: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """lightly's DINOProjectionHead.forward with the last layer in fp32 sums.

    The MLP runs under whatever autocast is active; the L2 normalization and the
    weight-normed prototype layer run with autocast off, so the logits that the loss's
    softmax sharpens by 1 / teacher_temp carry fp32, not bf16, rounding; `precision`
    (dino.head_precision) is what the layer's operands are rounded to first (module
    docstring). Any other head is called as it is."""
    if not (hasattr(head, "layers") and hasattr(head, "last_layer")):
        return head(x)
    z = head.layers(x)
    with torch.autocast(x.device.type, enabled=False):
        z = F.normalize(z.float(), dim=-1, p=2)
        if precision == "fp32":
            return head.last_layer(z)
        return prototype_mm(z, prototype_weights(head.last_layer).t(), precision)


def prototype_weights(last: nn.Module) -> torch.Tensor:
    """The prototype layer's weight as its forward computes it: g v / |v| from torch's
    weight norm (lightly's), else the layer's weight."""
    from torch.nn.utils.weight_norm import WeightNorm
    for hook in last._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):
            return hook.compute_weight(last)
    return last.weight


@contextlib.contextmanager
def _tf32():
    """CUDA's fp32 matmuls in TF32 for the block, torch's setting put back after it."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


@torch.library.custom_op("resmlp::prototype_mm", mutates_args=())
def prototype_mm(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """a @ b (fp32) with the operands in `precision` and the products summed in fp32: tf32
    (CUDA's TF32 matmul; fp32 elsewhere) or bf16 (cuBLAS's bf16 GEMM with fp32 output; on
    a CPU the bf16-rounded operands multiplied in fp32, whose products of 8-bit mantissas
    are exact: the same sums). An op of its own so that compiled code and CUDA graphs call
    it as it is, with the setting it needs; its backward multiplies in the same precision."""
    if precision == "bf16":
        a, b = a.bfloat16(), b.bfloat16()
        if a.is_cuda:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a.float(), b.float())
    if precision == "tf32" and a.is_cuda:
        with _tf32():
            return torch.mm(a, b)
    return torch.mm(a, b)


@prototype_mm.register_fake
def _(a, b, precision):
    return a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32)


def _save(ctx, inputs, output):
    a, b, ctx.precision = inputs
    ctx.save_for_backward(a, b)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    da = prototype_mm(grad, b.t(), ctx.precision) if ctx.needs_input_grad[0] else None
    db = prototype_mm(a.t(), grad, ctx.precision) if ctx.needs_input_grad[1] else None
    return da, db, None


prototype_mm.register_autograd(_backward, setup_context=_save)
