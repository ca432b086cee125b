"""The fused forward of a ResMLP block (`model.fused=true`): the plain block's function and
parameters with fewer passes over the activations. resmlp.py's FusedResMLPBlock runs it.

On tokens X (B, N, D), with A, a the cross-patch weight and bias for the input's grid
(after grid adaptation) and drop() timm's per-sample drop path:

    plain:  Z = X + drop(ls1 * (A @ Aff1(X) + a))
            Y = Z + drop(ls2 * fc2(GELU(fc1(Aff2(Z)))))

    fused:  Z = X + drop(s * (A @ X) + c)          s = ls1 * alpha1               (D)
                                                   c = ls1 * (rowsum(A) beta1 + a)  (N x D)
            Y = Z + drop(fc2'(GELU(fc1'(Z))))      fc1' = W1 diag(alpha2), W1 beta2 + b1
                                                   fc2' = diag(ls2) W2, ls2 * b2

Aff1 acts on channels and A on tokens, so Aff1 cannot move into A; it moves through it:
A @ (alpha * X + beta) = alpha * (A @ X) + rowsum(A) beta. The folded weights are
recomputed from the trainable parameters on every call (products of D x 4D weights,
nothing next to the activations), so autograd gives each parameter the gradient the plain
block gives it, and the state dict, checkpoints and exports are the plain block's.
With LayerNorm the normalisation stays a pass of its own and only its affine is folded.
The cross-patch MLP and conv variants keep norm1 (an affine does not pass exactly through
a GELU or a zero-padded conv): their LayerScale, drop path and residual add are one addcmul.

GEMM epilogues, where torch has an exact one and a pass is saved:
- The residual add: `torch.addmm(residual, h, W2'^T)` when the residual and the GEMM share
  a dtype (no autocast), there is no drop path, the norm is the Affine and the cross-patch
  layer linear. fc2's bias then rides on the residual written by the first half's pointwise
  pass (c + ls2 * b2, free), and Aff2's shift takes it back off before fc1. Under autocast
  the residual stream stays float32, as in the plain block: an addmm would round it to bf16.
- GELU: `torch._addmm_activation(..., use_gelu=True)` is exact (erf) GELU on the CPU only:
  on CUDA both the cuBLASLt epilogue and its fallback are the tanh approximation, and it
  has no autograd formula. So it runs on the CPU where no gradient is needed (the teacher,
  evaluation); elsewhere F.linear then F.gelu, which Inductor fuses into one pass.

Drop path draws its masks as timm's DropPath does (one bernoulli_ per branch on a (B, 1, 1)
tensor of the branch's dtype, in the same order), so a fused and a plain block give the
same result from the same generator state.

Token-major layout (`block.options.token_major`, the model's `token_major`): tokens arrive as
(N, B, D), so the cross-patch linear is one GEMM over every image, A @ X.view(N, B*D),
and its backward two (A^T dP, dP X^T), where the (B, N, D) layout makes matmul copy X
to (B*D, N) and back. c broadcasts over B, the drop-path masks over N and D (the same
draws, viewed (1, B, 1)); the channel MLP acts per token and takes either layout. The
cross-patch MLP and conv ablations work on (B, N, D) and see a transposed view.

Triton kernels (`block.options.kernels == 'triton'`, models/kernels/): the linear cross-patch, its
scale s, bias c, drop-path mask and residual add in one kernel, whose backward also sums
ds, dc and dA; fc1 with the exact GELU in its epilogue and fc2's input gradient with
GELU's derivative and fc1's bias gradient in its own. The folded weights are computed here
as on the torch path, so autograd carries the kernels' gradients back to the parameters.

bf16 residual stream (`block.options.residual_dtype == 'bf16'`, under autocast only): the block's
input, its first half's output and its output are bfloat16, where the plain block's type
promotion (fp32 parameters c, s, ls2) makes them float32 and the GEMMs read a bf16 copy.
s, c, the second branch and the masks (drawn as before) are cast to bf16 before the adds,
so that the stream's reads and writes, and their gradients', are half the bytes; with the
stream in the GEMMs' dtype, fc2's addmm carries the residual again (the teacher's path).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath

from resmlp.core.config import check_choice
from resmlp.models.kernels import load as load_kernels


@dataclasses.dataclass(frozen=True)
class FusedOptions:
    """How the fused blocks run, not what they compute: the same parameters and function
    under any of them, so that a model built from saved weights for evaluation takes none
    (models/load.py). Each is a `model.<name>` key (configs/defaults.yaml holds the run's
    values and their limits); a field's default is the plain blocks' way, which a block
    built in code takes. A block holds them as `block.options` (resmlp.py's
    FusedResMLPBlock, built through `block_layer`); `plain` in a field's metadata says why
    the plain blocks cannot do otherwise.

    token_major: (N, B, D) tokens, so that the cross-patch linear is one GEMM over all
      images with no transposes (the model's patch embedding then writes that layout).
    kernels='triton': the cross-patch and channel MLP in the Triton kernels of
      models/kernels/ (CUDA; the CPU only under Triton's interpreter).
    residual_dtype='bf16': the residual stream in bfloat16 under autocast (float32
      otherwise, as the plain blocks' type promotion makes it).
    """
    token_major: bool = dataclasses.field(default=False, metadata={"plain": "the plain blocks are batch-major"})
    kernels: str = dataclasses.field(default='torch', metadata={"plain": "the kernels are the fused block's"})
    residual_dtype: str = dataclasses.field(default='fp32',
                                            metadata={"plain": "the plain blocks keep the stream in float32"})

    def __post_init__(self):
        for name in ('kernels', 'residual_dtype'):
            check_choice(f'model.{name}', getattr(self, name))   # their words: limits in configs/

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names: the `model.` keys a model built for evaluation leaves out."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def unlike_plain(self) -> list[tuple[str, object, str]]:
        """(name, value, why the plain blocks cannot) for each option away from its default."""
        return [(f.name, getattr(self, f.name), f.metadata["plain"]) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]


def _drop_prob(block: nn.Module) -> float:
    dp = block.drop_path
    return dp.drop_prob if isinstance(dp, DropPath) and dp.training else 0.0


def _token_major(block: nn.Module) -> bool:
    return block.options.token_major


def _batch_size(block: nn.Module, x: torch.Tensor) -> int:
    return x.shape[1] if _token_major(block) else x.shape[0]


def _drop_mask(block: nn.Module, batch: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """timm's drop_path mask for a branch of `dtype` (None when it draws none): the same
    generator call, so the same samples are dropped; shaped to broadcast over the block's layout."""
    p = _drop_prob(block)
    if p == 0.0:
        return None
    keep = 1.0 - p
    mask = torch.empty((batch, 1, 1), dtype=dtype, device=device).bernoulli_(keep)
    if keep > 0.0 and block.drop_path.scale_by_keep:
        mask.div_(keep)
    return mask.view(1, batch, 1) if _token_major(block) else mask


def _affine_of(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per channel: an Affine's alpha and beta, a LayerNorm's weight and bias."""
    if isinstance(norm, nn.LayerNorm):
        return norm.weight, norm.bias
    return norm.alpha, norm.beta


def _normalize(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What is left of the norm once its affine is folded: LayerNorm's normalisation, or nothing."""
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(x, norm.normalized_shape, None, None, norm.eps)
    return x


def _triton(block: nn.Module):
    """The Triton operators' module where the block runs them (model.kernels=triton), else None."""
    return load_kernels() if block.options.kernels == 'triton' else None


def _gemm_dtype(weight: torch.Tensor, x: torch.Tensor) -> torch.dtype:
    """The dtype of a torch GEMM's output on these operands: autocast's where it is on."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(weight.dtype, x.dtype)


def _linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad)
    if x.device.type == 'cpu' and not needs_grad and x.dtype == weight.dtype:  # (a bf16 stream: autocast's linear)
        out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.gelu(F.linear(x, weight, bias))


def _stream_dtype(block: nn.Module, x: torch.Tensor) -> Optional[torch.dtype]:
    """bfloat16 where the block keeps its residual stream in it (model.residual_dtype=bf16,
    under autocast); None: the plain block's type promotion (float32 under autocast)."""
    if block.options.residual_dtype == 'bf16' and torch.is_autocast_enabled(x.device.type):
        return torch.bfloat16
    return None


def _as(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    return t if t is None or dtype is None else t.to(dtype)


def _cross_patch_half(block: nn.Module, x: torch.Tensor, grid, carried: Optional[torch.Tensor],
                      stream: Optional[torch.dtype]) -> torch.Tensor:
    """Z = X + drop(ls1 * cross_patch(norm1(X))), plus `carried` (D) when given (linear only);
    stream: the residual stream's dtype where it is not the promoted one (_stream_dtype)."""
    cp, ls1 = block.cross_patch, block.ls1
    batch, token_major = _batch_size(block, x), _token_major(block)
    if not hasattr(cp, 'weights_for'):  # MLP / conv variants: norm1 stays
        u = block.norm1(x)
        y = cp(u.transpose(0, 1), grid).transpose(0, 1) if token_major else cp(u, grid)
        mask = _drop_mask(block, batch, torch.promote_types(y.dtype, ls1.dtype), x.device)
        return torch.addcmul(x, _as(y, stream), _as(ls1 if mask is None else ls1 * mask, stream))
    a, a_bias = cp.weights_for(grid)
    alpha, beta = _affine_of(block.norm1)
    u = _normalize(block.norm1, x)
    # elementwise products, not torch.outer: autocast would round these to bf16
    c = a.sum(dim=1, keepdim=True) * (ls1 * beta) + a_bias.unsqueeze(1) * ls1
    if carried is not None:
        c = c + carried
    ops = _triton(block)
    if ops is not None:  # the GEMM, its epilogue and the residual add in one kernel
        mask = _drop_mask(block, batch, torch.promote_types(_gemm_dtype(a, u), ls1.dtype), x.device)
        u = u if isinstance(block.norm1, nn.LayerNorm) else None
        return ops.cross_patch_residual(a, x, u, _as(ls1 * alpha, stream), c, mask, token_major)
    p = torch.mm(a, u.reshape(u.shape[0], -1)).view(u.shape) if token_major else torch.matmul(a, u)
    if token_major:
        c = c.unsqueeze(1)  # (N, 1, D): the same for every image
    t = torch.addcmul(_as(c, stream), _as(p, stream), _as(ls1 * alpha, stream))
    mask = _drop_mask(block, batch, torch.promote_types(p.dtype, ls1.dtype), x.device)
    return x + t if mask is None else torch.addcmul(x, t, _as(mask, stream))


def fused_block_forward(block: nn.Module, x: torch.Tensor, grid) -> torch.Tensor:
    """ResMLPBlock.forward's result from the block's own parameters, folded (module docstring)."""
    fc1, fc2, ls2 = block.mlp.fc1, block.mlp.fc2, block.ls2
    alpha2, beta2 = _affine_of(block.norm2)
    w2, b2 = fc2.weight * ls2.unsqueeze(1), fc2.bias * ls2
    ops, stream = _triton(block), _stream_dtype(block, x)
    x = _as(x, stream)
    autocast = torch.is_autocast_enabled(x.device.type)
    # the residual rides in fc2's addmm where it has the GEMM's dtype
    same_dtype = not autocast or stream == torch.get_autocast_dtype(x.device.type)
    carry = (ops is None and _drop_prob(block) == 0.0 and same_dtype
             and not isinstance(block.norm2, nn.LayerNorm) and hasattr(block.cross_patch, 'weights_for'))
    z = x if block.cross_patch is None else _cross_patch_half(block, x, grid, b2 if carry else None, stream)
    if carry:  # z holds Z + b2: Aff2(Z) = alpha2 * z + (beta2 - alpha2 * b2)
        beta2 = beta2 - alpha2 * b2
    w1 = fc1.weight * alpha2
    b1 = fc1.bias + (fc1.weight * beta2).sum(dim=1)
    if ops is not None:  # GELU and its derivative in the GEMMs' epilogues
        g = ops.gelu_mlp_forward(_normalize(block.norm2, z), w1, b1, w2, b2)
    else:
        h = _linear_gelu(_normalize(block.norm2, z), w1, b1)
        if carry:
            return torch.addmm(z.reshape(-1, z.shape[-1]), h.reshape(-1, h.shape[-1]), w2.t()).view_as(z)
        g = F.linear(h, w2, b2)
    mask = _drop_mask(block, _batch_size(block, x), torch.promote_types(g.dtype, ls2.dtype), x.device)
    g = _as(g, stream)
    return z + g if mask is None else torch.addcmul(z, g, _as(mask, stream))


def describe(block: nn.Module) -> str:
    """What the fused forward folds in this block (its repr)."""
    ln = isinstance(block.norm2, nn.LayerNorm)
    aff1, aff2 = ("norm1's affine", "norm2's affine") if ln else ('Aff1', 'Aff2')
    parts = [f'{aff2} -> fc1', 'ls2 -> fc2']
    if hasattr(block.cross_patch, 'weights_for'):
        parts.append(f'{aff1} + ls1 through the cross-patch linear')
    elif block.cross_patch is not None:
        parts.append('norm1 kept, ls1 + residual in one addcmul')
    return ('fused: ' + ', '.join(parts) + ('; LayerNorm normalises in a pass of its own' if ln else '')
            + ('; tokens (N, B, D)' if _token_major(block) else '')
            + ('; Triton kernels' if block.options.kernels == 'triton' else '')
            + ('; bf16 residual stream under autocast' if block.options.residual_dtype == 'bf16' else ''))
