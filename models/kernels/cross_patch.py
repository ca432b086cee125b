"""The cross-patch half of a fused block in three kernels (models/fused.py has the algebra):

    Z[n, b, d] = X[n, b, d] + m[b] * (s[d] * (A @ U)[n, b, d] + c[n, d])

A (N x N) the grid-adapted cross-patch weight, U the GEMM's input (X, or LayerNorm's
normalised X), s = ls1 * alpha1, c = ls1 * (rowsum(A) beta1 + a), m the drop-path mask.
Tokens are (N, B, D) or (B, N, D): the kernels address them by strides, and a column tile
is BB images x BD channels of one token, so a reduction over images stays inside a tile.

Backward, with dT = m * dZ (the gradient of s * P + c, P = A @ U):
  dgrad  G = A^T dT; dU = s * G (+ dZ where U is X: the residual's gradient, in the same
         epilogue); ds[d] = sum_{k,b} U[k,b,d] G[k,b,d], the identity that spares P
         (= sum_{n,b} dT P); dc[n,d] = sum_b dT[n,b,d] while dT streams through.
  wgrad  dA = sum_{b,d} (s * dT)[n,b,d] U[k,b,d], split over chunks of (b, d).
The per-tile sums are written as partials and added by torch in a fixed order: the same
result on every run (no atomics).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from resmlp.models.kernels.common import NUM_STAGES, NUM_WARPS, SPLIT_PROGRAMS, cast, launcher, mma, register, tile


@triton.jit
def _columns(pid_b, pid_d, B, D, sb, BB: tl.constexpr, BD: tl.constexpr):
    """A tile's BB x BD columns: image b, channel d, their offset b * sb + d, and which exist."""
    j = tl.arange(0, BB * BD)
    b = pid_b * BB + j // BD
    d = pid_d * BD + j % BD
    return b, d, b * sb + d, (b < B) & (d < D)


@triton.jit
def _forward_kernel(A, U, X, S, C, M, Z, N, B, D, sn, sb,
                    HAS_MASK: tl.constexpr, DOT: tl.constexpr,
                    BM: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    b, d, cols, col_ok = _columns(tl.program_id(1), tl.program_id(2), B, D, sb, BB, BD)
    acc = tl.zeros((BM, BB * BD), dtype=tl.float32)
    for k0 in range(0, N, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(A + rows[:, None] * N + ks[None, :], mask=(rows[:, None] < N) & (ks[None, :] < N), other=0.0)
        u = tl.load(U + ks[:, None] * sn + cols[None, :], mask=(ks[:, None] < N) & col_ok[None, :], other=0.0)
        acc = mma(a, u, acc, DOT)
    ok = (rows[:, None] < N) & col_ok[None, :]
    s = tl.load(S + d, mask=d < D, other=0.0).to(tl.float32)
    t = acc * s[None, :] + tl.load(C + rows[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        t = t * tl.load(M + b, mask=b < B, other=0.0).to(tl.float32)[None, :]
    offs = rows[:, None] * sn + cols[None, :]
    z = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32) + t
    tl.store(Z + offs, cast(z, Z.dtype.element_ty), mask=ok)


@triton.jit
def _dgrad_kernel(A, DZ, U, S, M, DU, DS, DC, N, B, D, sn, sb,
                  ADD_DZ: tl.constexpr, HAS_MASK: tl.constexpr, DOT: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr, BD: tl.constexpr):
    pid_m, pid_b = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    b, d, cols, col_ok = _columns(pid_b, tl.program_id(2), B, D, sb, BB, BD)
    dd = tl.program_id(2) * BD + tl.arange(0, BD)
    if HAS_MASK:
        m = tl.load(M + b, mask=col_ok, other=0.0).to(tl.float32)
    else:
        m = tl.where(col_ok, 1.0, 0.0)
    acc = tl.zeros((BM, BB * BD), dtype=tl.float32)
    for k0 in range(0, N, BK):
        ks = k0 + tl.arange(0, BK)
        at = tl.load(A + ks[None, :] * N + rows[:, None], mask=(rows[:, None] < N) & (ks[None, :] < N), other=0.0)
        dt = tl.load(DZ + ks[:, None] * sn + cols[None, :], mask=(ks[:, None] < N) & col_ok[None, :],
                     other=0.0).to(tl.float32) * m[None, :]
        acc = mma(at, dt, acc, DOT)
        if pid_m == 0:  # dc: each token's sum over this tile's images, once per column tile
            dc = tl.sum(tl.reshape(dt, (BK, BB, BD)), axis=1)
            tl.store(DC + pid_b * N * D + ks[:, None] * D + dd[None, :], dc, mask=(ks[:, None] < N) & (dd[None, :] < D))
    ok = (rows[:, None] < N) & col_ok[None, :]
    offs = rows[:, None] * sn + cols[None, :]
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    ds = tl.sum(tl.sum(tl.reshape(u * acc, (BM, BB, BD)), axis=1), axis=0)
    tl.store(DS + (pid_m * tl.num_programs(1) + pid_b) * D + dd, ds, mask=dd < D)
    du = acc * tl.load(S + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    if ADD_DZ:
        du += tl.load(DZ + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(DU + offs, cast(du, DU.dtype.element_ty), mask=ok)


@triton.jit
def _wgrad_kernel(DZ, U, S, M, DA, N, B, D, sn, sb, CHUNKS, PER_SPLIT,
                  HAS_MASK: tl.constexpr, DOT: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    n_d = tl.cdiv(D, BD)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for i in range(0, PER_SPLIT):
        chunk = tl.program_id(2) * PER_SPLIT + i
        b, d, cols, col_ok = _columns(chunk // n_d, chunk % n_d, B, D, sb, BB, BD)
        col_ok = col_ok & (chunk < CHUNKS)
        scale = tl.load(S + d, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_MASK:
            scale = scale * tl.load(M + b, mask=col_ok, other=0.0).to(tl.float32)
        dp = tl.load(DZ + rows[:, None] * sn + cols[None, :], mask=(rows[:, None] < N) & col_ok[None, :],
                     other=0.0).to(tl.float32) * scale[None, :]
        ut = tl.load(U + ks[None, :] * sn + cols[:, None], mask=(ks[None, :] < N) & col_ok[:, None], other=0.0)
        acc = mma(dp, ut, acc, DOT)
    tl.store(DA + tl.program_id(2) * N * N + rows[:, None] * N + ks[None, :], acc,
             mask=(rows[:, None] < N) & (ks[None, :] < N))


def _layout(x: torch.Tensor, token_axis: int) -> tuple[int, int, int, int, int]:
    """(N, B, D, token stride, image stride) of contiguous tokens (N, B, D) or (B, N, D)."""
    n, b = x.shape[token_axis], x.shape[1 - token_axis]
    return n, b, x.shape[2], x.stride(token_axis), x.stride(1 - token_axis)


def _tiles(n: int, d: int) -> tuple[int, int, int, int]:
    """(BM, BK, BB, BD): a tile of BM tokens x (BB images x BD channels) = 128 columns."""
    bd = tile(d)
    return tile(n), tile(n, high=32), max(1, 128 // bd), bd


def _forward_fake(a: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], s: torch.Tensor, c: torch.Tensor,
                  mask: Optional[torch.Tensor], token_axis: int, dot: int) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, s.dtype), device=x.device)


@register("cross_patch", _forward_kernel, _forward_fake)
def cross_patch(a: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], s: torch.Tensor, c: torch.Tensor,
                mask: Optional[torch.Tensor], token_axis: int, dot: int) -> torch.Tensor:
    """Z (module docstring) on contiguous tokens x; u: the GEMM's input where it is not x;
    c (N, D); mask (B) or None; token_axis 0 for (N, B, D), 1 for (B, N, D); dot: common.DOT_*."""
    z = _forward_fake(a, x, u, s, c, mask, token_axis, dot)
    n, b, d, sn, sb = _layout(x, token_axis)
    bm, bk, bb, bd = _tiles(n, d)
    grid = (triton.cdiv(n, bm), triton.cdiv(b, bb), triton.cdiv(d, bd))
    launcher(_forward_kernel)[grid](a, x if u is None else u, x, s, c, x if mask is None else mask, z, n, b, d, sn, sb,
                                    HAS_MASK=mask is not None, DOT=dot, BM=bm, BK=bk, BB=bb, BD=bd,
                                    num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return z


def _backward_fake(dz: torch.Tensor, a: torch.Tensor, u: torch.Tensor, s: torch.Tensor, mask: Optional[torch.Tensor],
                   token_axis: int, dot: int, add_dz: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, _, d, _, _ = _layout(u, token_axis)
    f32 = dict(dtype=torch.float32, device=u.device)
    return torch.empty_like(u), torch.empty(d, **f32), torch.empty(n, d, **f32), torch.empty(n, n, **f32)


@register("cross_patch_backward", _dgrad_kernel, _backward_fake)
def cross_patch_backward(dz: torch.Tensor, a: torch.Tensor, u: torch.Tensor, s: torch.Tensor,
                         mask: Optional[torch.Tensor], token_axis: int, dot: int,
                         add_dz: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dU, plus dZ where add_dz; ds, dc, dA in float32) for the gradient dz of Z."""
    du, _, _, _ = _backward_fake(dz, a, u, s, mask, token_axis, dot, add_dz)
    n, b, d, sn, sb = _layout(u, token_axis)
    bm, bk, bb, bd = _tiles(n, d)
    grid = (triton.cdiv(n, bm), triton.cdiv(b, bb), triton.cdiv(d, bd))
    f32 = dict(dtype=torch.float32, device=u.device)
    ds_part = torch.empty(grid[0], grid[1], d, **f32)
    dc_part = torch.empty(grid[1], n, d, **f32)
    m = u if mask is None else mask
    launcher(_dgrad_kernel)[grid](a, dz, u, s, m, du, ds_part, dc_part, n, b, d, sn, sb,
                                  ADD_DZ=add_dz, HAS_MASK=mask is not None, DOT=dot, BM=bm, BK=bk, BB=bb, BD=bd,
                                  num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    side = tile(n)
    chunks = grid[1] * grid[2]
    splits = min(chunks, max(1, SPLIT_PROGRAMS // triton.cdiv(n, side) ** 2))
    per_split = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, per_split)
    da_part = torch.empty(splits, n, n, **f32)
    launcher(_wgrad_kernel)[(triton.cdiv(n, side), triton.cdiv(n, side), splits)](
        dz, u, s, m, da_part, n, b, d, sn, sb, chunks, per_split,
        HAS_MASK=mask is not None, DOT=dot, BN=side, BK=side, BB=bb, BD=bd, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return du, ds_part.sum(dim=(0, 1)), dc_part.sum(dim=0), da_part.sum(dim=0)


def _setup(ctx, inputs, output) -> None:
    a, x, u, s, c, mask, token_axis, dot = inputs
    ctx.save_for_backward(a, x if u is None else u, s, mask)
    ctx.add_dz, ctx.token_axis, ctx.dot = u is None, token_axis, dot
    ctx.dtypes = a.dtype, s.dtype, c.dtype


def _backward(ctx, dz):
    a, u, s, mask = ctx.saved_tensors
    du, ds, dc, da = cross_patch_backward(dz.contiguous(), a, u, s, mask, ctx.token_axis, ctx.dot, ctx.add_dz)
    a_dtype, s_dtype, c_dtype = ctx.dtypes
    dx, du = (du, None) if ctx.add_dz else (dz, du)
    return da.to(a_dtype), dx, du, ds.to(s_dtype), dc.to(c_dtype), None, None, None


cross_patch.register_autograd(_backward, setup_context=_setup)
