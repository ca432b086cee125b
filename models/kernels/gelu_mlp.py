"""The channel MLP with GELU in GEMM epilogues (models/fused.py folds Aff2 and ls2 into the
weights it is given):

    forward   U = X W1^T + b1, H = GELU(U) in one kernel (U kept for the backward), then
              G = H W2^T + b2 (cuBLAS: its own bias epilogue)
    backward  dU = (dG W2) * GELU'(U) in one kernel, with db1 = sum over rows of dU as
              per-tile partials; dX, dW1, dW2, db2 by torch (cuBLAS GEMMs)

GELU is the exact one, 0.5 u (1 + erf(u / sqrt 2)), as nn.GELU and timm's ResMLP: cuBLASLt's
GELU epilogues and torch._addmm_activation on CUDA are the tanh approximation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resmlp.models.kernels.common import NUM_STAGES, NUM_WARPS, cast, launcher, mma, register, tile


@triton.jit
def _cdf(u):
    return 0.5 * (1.0 + tl.erf(u * 0.7071067811865476))


@triton.jit
def _rows_times(X, W, rows, hs, M, K, HID, swk, swh, DOT: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr,
                BK: tl.constexpr):
    """The (BM, BH) tile of X (M, K) @ W, W[k, h] at W + k * swk + h * swh, in float32."""
    acc = tl.zeros((BM, BH), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(W + ks[:, None] * swk + hs[None, :] * swh, mask=(ks[:, None] < K) & (hs[None, :] < HID), other=0.0)
        acc = mma(x, w, acc, DOT)
    return acc


@triton.jit
def _fc1_gelu_kernel(X, W, BIAS, U, H, M, K, HID, DOT: tl.constexpr,
                     BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    acc = _rows_times(X, W, rows, hs, M, K, HID, 1, K, DOT, BM, BH, BK)  # W (HID, K): fc1.weight
    ok = (rows[:, None] < M) & (hs[None, :] < HID)
    offs = rows[:, None] * HID + hs[None, :]
    u = cast(acc + tl.load(BIAS + hs, mask=hs < HID, other=0.0).to(tl.float32)[None, :], U.dtype.element_ty)
    tl.store(U + offs, u, mask=ok)
    u = u.to(tl.float32)  # GELU of the stored value, as the backward sees it
    tl.store(H + offs, cast(u * _cdf(u), H.dtype.element_ty), mask=ok)


@triton.jit
def _fc2_dgrad_kernel(DG, W, U, DU, DB, M, K, HID, DOT: tl.constexpr,
                      BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    acc = _rows_times(DG, W, rows, hs, M, K, HID, HID, 1, DOT, BM, BH, BK)  # W (K, HID): fc2.weight
    ok = (rows[:, None] < M) & (hs[None, :] < HID)
    offs = rows[:, None] * HID + hs[None, :]
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    du = acc * (_cdf(u) + u * tl.exp(-0.5 * u * u) * 0.3989422804014327)
    tl.store(DU + offs, cast(du, DU.dtype.element_ty), mask=ok)
    tl.store(DB + tl.program_id(0) * HID + hs, tl.sum(du, axis=0), mask=hs < HID)


def _tiles(m: int, k: int, hid: int) -> tuple[int, int, int]:
    return tile(m, high=64), tile(hid, high=64), tile(k, high=32)


def _forward_fake(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                  dot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, hid = x.shape[0], w1.shape[0]
    u = torch.empty(m, hid, dtype=x.dtype, device=x.device)
    return torch.empty(m, w2.shape[0], dtype=x.dtype, device=x.device), u, torch.empty_like(u)


@register("gelu_mlp", _fc1_gelu_kernel, _forward_fake)
def gelu_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
             dot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G, U, H) for rows x (M, D) and nn.Linear-shaped weights, all of one dtype."""
    _, u, h = _forward_fake(x, w1, b1, w2, b2, dot)
    m, k = x.shape
    hid = w1.shape[0]
    bm, bh, bk = _tiles(m, k, hid)
    launcher(_fc1_gelu_kernel)[(triton.cdiv(m, bm), triton.cdiv(hid, bh))](
        x, w1, b1, u, h, m, k, hid, DOT=dot, BM=bm, BH=bh, BK=bk, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return torch.addmm(b2, h, w2.t()), u, h


def _dgrad_fake(dg: torch.Tensor, w2: torch.Tensor, u: torch.Tensor, dot: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(u), torch.empty(u.shape[1], dtype=torch.float32, device=u.device)


@register("gelu_mlp_dgrad", _fc2_dgrad_kernel, _dgrad_fake)
def gelu_mlp_dgrad(dg: torch.Tensor, w2: torch.Tensor, u: torch.Tensor, dot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dU, db1 in float32) for the gradient dg of G."""
    du, _ = _dgrad_fake(dg, w2, u, dot)
    m, hid = u.shape
    k = dg.shape[1]
    bm, bh, bk = _tiles(m, k, hid)
    db_part = torch.empty(triton.cdiv(m, bm), hid, dtype=torch.float32, device=u.device)
    launcher(_fc2_dgrad_kernel)[(triton.cdiv(m, bm), triton.cdiv(hid, bh))](
        dg, w2, u, du, db_part, m, k, hid, DOT=dot, BM=bm, BH=bh, BK=bk, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return du, db_part.sum(dim=0)


def _setup(ctx, inputs, output) -> None:
    x, w1, b1, w2, b2, dot = inputs
    _, u, h = output
    ctx.save_for_backward(x, w1, w2, u, h)
    ctx.dot, ctx.b1_dtype = dot, b1.dtype
    ctx.mark_non_differentiable(u, h)
    ctx.set_materialize_grads(False)


def _backward(ctx, dg, _du, _dh):
    x, w1, w2, u, h = ctx.saved_tensors
    dg = dg.contiguous()
    du, db1 = gelu_mlp_dgrad(dg, w2, u, ctx.dot)
    return du @ w1, du.t() @ x, db1.to(ctx.b1_dtype), dg.t() @ h, dg.sum(dim=0), None


gelu_mlp.register_autograd(_backward, setup_context=_setup)
