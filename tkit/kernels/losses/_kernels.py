"""Triton kernels of the losses family: cross-entropy over rows of logits with their gradient
in the same launch (``_ce_kernel``), and the backward's scaling of that gradient by the
upstream one (``_scale_rows_kernel``)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _ce_kernel(X, TGT, LOSS, G, GSCALE, N, V, sxn, sxv, stn, sgn, sgv, ignore_index, smoothing,
               z_coef, BLOCK_V: tl.constexpr, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr,
               HAS_GRAD: tl.constexpr, SCALED: tl.constexpr, INT64: tl.constexpr):
    """Rows pid, pid + programs, ... (a persistent grid of a few programs an SM). Pass 1
    over V in BLOCK_V chunks: the online max and sum of exponentials (lse), the target's
    logit, the row's sum (label smoothing). The row's loss (0 for an ignored target). Pass
    2 (HAS_GRAD): d loss_row / d logits, times the float32 scalar at GSCALE where SCALED (the
    mean's 1 / rows kept), written to G in G's dtype. Targets outside [0, V) that are not
    ``ignore_index`` are clamped (never read outside the row; the host checks them where it
    can)."""
    cols = tl.arange(0, BLOCK_V)
    gscale = 1.0
    if SCALED:
        gscale = tl.load(GSCALE)
    for r in range(tl.program_id(0), N, tl.num_programs(0)):
        row = r
        if INT64:
            row = r.to(tl.int64)
        t = tl.load(TGT + row * stn).to(tl.int32)
        ignored = t == ignore_index
        t = tl.minimum(tl.maximum(t, 0), V - 1)
        x_row = X + row * sxn
        x_t = tl.load(x_row + t * sxv).to(tl.float32)
        m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_V], dtype=tl.float32)
        sum_x = tl.zeros([BLOCK_V], dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            mask = c < V
            x = tl.load(x_row + c * sxv, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp2((m - m_use) * LOG2E) + tl.exp2((x - m_use) * LOG2E)
            m = m_new
            if SMOOTH:
                sum_x += tl.where(mask, x, 0.0)
        mx = tl.max(m, 0)
        # log sum exp(x - max) and the logits' distances to the max: no cancellation of the
        # max where the loss is small (a confident, right prediction)
        ls = tl.log2(tl.sum(s * tl.exp2((m - mx) * LOG2E), 0)) * LN2
        lse = mx + ls
        loss = ls + (mx - x_t)
        if SMOOTH:
            loss = (1.0 - smoothing) * loss + smoothing * (ls + (mx - tl.sum(sum_x, 0) / V))
        if ZLOSS:
            loss += z_coef * lse * lse
        tl.store(LOSS + row, tl.where(ignored, 0.0, loss))
        if HAS_GRAD:
            g_row = G + row * sgn
            keep = tl.where(ignored, 0.0, gscale)
            for v0 in range(0, V, BLOCK_V):
                c = v0 + cols
                mask = c < V
                x = tl.load(x_row + c * sxv, mask=mask, other=0.0).to(tl.float32)
                p = tl.exp2(((x - mx) - ls) * LOG2E) * keep
                hit = tl.where(c == t, 1.0, 0.0)
                if SMOOTH:
                    g = p - keep * ((1.0 - smoothing) * hit + smoothing / V)
                else:
                    g = p - keep * hit
                if ZLOSS:
                    # p - hit first, then z-loss's 2 z lse p: as p (1 + 2 z lse) - hit, the
                    # target's gradient of a confident row would cancel against 1 rounded
                    # with the z term (an ulp of 1 where the gradient is ~2 z lse)
                    g += p * (2.0 * z_coef * lse)
                tl.store(g_row + c * sgv, g.to(G.dtype.element_ty), mask=mask)


@triton.jit
def _scale_rows_kernel(G, S, V, sgn, sgv, ss, BLOCK: tl.constexpr, INT64: tl.constexpr):
    """G[row, :] *= S[row * ss] in place (ss = 0: one scalar), in float32, rounded once; a
    row whose factor is exactly 1 is neither read nor written (the usual upstream gradient of
    a loss: ``loss.backward()``'s 1), decided on the device, so no host sync."""
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    f = tl.load(S + row * ss).to(tl.float32)
    if f != 1.0:
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < V
        p = G + row * sgn + c * sgv
        g = tl.load(p, mask=mask).to(tl.float32)
        tl.store(p, (g * f).to(G.dtype.element_ty), mask=mask)
