"""Triton kernels of the MoE family: the router's top-k (``_route_kernel``) and the weighted
sum of each token's expert outputs (``_combine_kernel``)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _route_kernel(Z, W, IDS, T, E, szt, sze, swt, sit,
                  TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                  INT64: tl.constexpr):
    """BLOCK_T tokens a program: scores of E experts (softmax or sigmoid of the logits Z, in
    float32), the TOP_K largest (ties to the lowest index), renormalized to sum 1 when RENORM.
    W (T, TOP_K) float32 weights, IDS (T, TOP_K) int32 experts, best first."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if INT64:
        t = t.to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    tmask = t < T
    emask = e < E
    z = tl.load(Z + t[:, None] * szt + e[None, :] * sze, mask=tmask[:, None] & emask[None, :],
                other=float("-inf")).to(tl.float32)
    z = tl.where(tmask[:, None], z, 0.0)  # rows past T: finite (never stored)
    if SIGMOID:
        p = 1.0 / (1.0 + tl.exp2(-z * LOG2E))
    else:
        m = tl.max(z, 1)
        p = tl.exp2((z - m[:, None]) * LOG2E)
        p = p / tl.sum(tl.where(emask[None, :], p, 0.0), 1)[:, None]
    q = tl.where(emask[None, :], p, -1.0)  # scores are >= 0: padding never wins
    kk = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    idxs = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(q, 1)
        # the lowest index holding the max (clamped: a row of NaN may find none)
        idx = tl.minimum(tl.min(tl.where(q == best[:, None], e[None, :], BLOCK_E), 1), E - 1)
        vals = tl.where(kk[None, :] == j, best[:, None], vals)
        idxs = tl.where(kk[None, :] == j, idx[:, None], idxs)
        q = tl.where(e[None, :] == idx[:, None], -2.0, q)
    if RENORM:
        vals = vals / tl.sum(tl.where(kk[None, :] < TOP_K, vals, 0.0), 1)[:, None]
    # max ignores NaN on the GPU: a row with a NaN score gets NaN weights, not the padding's
    nan_row = tl.max(tl.where((p != p) & emask[None, :], 1, 0), 1) > 0
    vals = tl.where(nan_row[:, None], float("nan"), vals)
    omask = tmask[:, None] & (kk[None, :] < TOP_K)
    tl.store(W + t[:, None] * swt + kk[None, :], vals, mask=omask)
    tl.store(IDS + t[:, None] * sit + kk[None, :], idxs, mask=omask)


@triton.jit
def _combine_kernel(Y, W, INV, O, T, H, R, syr, syh, swt, swk, sit, sik, sot, soh,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                    INT64: tl.constexpr):
    """O[t] = sum_j W[t, j] * Y[INV[t, j]] for a (BLOCK_T, BLOCK_H) tile, j = 0..TOP_K-1 in
    order, in float32. INV is clamped to Y's R rows: no value reads outside Y."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if INT64:
        t = t.to(tl.int64)
    tmask = t < T
    mask = tmask[:, None] & (h < H)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        r = tl.load(INV + t * sit + j * sik, mask=tmask, other=0)
        r = tl.minimum(tl.maximum(r, 0), R - 1)
        if INT64:
            r = r.to(tl.int64)
        w = tl.load(W + t * swt + j * swk, mask=tmask, other=0.0)
        y = tl.load(Y + r[:, None] * syr + h[None, :] * syh, mask=mask, other=0.0)
        acc += w[:, None] * y.to(tl.float32)
    tl.store(O + t[:, None] * sot + h[None, :] * soh, acc.to(O.dtype.element_ty), mask=mask)
