"""Dynamic quantization's Triton code (``@triton.jit`` only): one kernel for per-token /
per-group fp8 and int8 scales, with the fused RMSNorm and SiLU-and-mul producers."""

from __future__ import annotations

import triton
import triton.language as tl

from tkit.kernels._numerics import fp8_keep_nan, round_to, saturate_fp8


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile(rows, rmask, c, K, NG, G: tl.constexpr, BLOCK_G: tl.constexpr,
          CHUNK_NG: tl.constexpr):
    """Column offsets (1, CHUNK_NG, BLOCK_G), group indices (CHUNK_NG,) and the tile's mask
    (ROWS, CHUNK_NG, BLOCK_G) of chunk ``c``."""
    grp = c * CHUNK_NG + tl.arange(0, CHUNK_NG)
    j = tl.arange(0, BLOCK_G)
    cols = grp[:, None] * G + j[None, :]
    cmask = (grp < NG)[:, None] & (j < G)[None, :] & (cols < K)
    return cols[None, :, :], grp, rmask[:, None, None] & cmask[None, :, :]


@triton.jit
def _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk, shm,
            OP: tl.constexpr, HAS_RES: tl.constexpr, STORE_H: tl.constexpr,
            FROM_H: tl.constexpr):
    """(v, h) of a tile in float32: v the values to quantize before RMSNorm's rstd (h * w
    for RMSNorm), h the normalized input (RMSNorm only; v otherwise). FROM_H: read h back
    (the second walk of the residual form)."""
    r2 = rows[:, None, None]
    if FROM_H:
        h = tl.load(H + r2 * shm + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(X + r2 * sxm + cols * sxk, mask=mask, other=0.0)
        if OP == "silu_mul":
            a = x.to(tl.float32)
            b = tl.load(B + r2 * sbm + cols * sbk, mask=mask, other=0.0).to(tl.float32)
            h = a * tl.sigmoid(a) * b
        elif HAS_RES:
            r = tl.load(R + r2 * srm + cols * srk, mask=mask, other=0.0)
            hs = round_to(x.to(tl.float32) + r.to(tl.float32), H.dtype.element_ty)
            if STORE_H:
                tl.store(H + r2 * shm + cols, hs, mask=mask)
            h = hs.to(tl.float32)
        else:
            h = x.to(tl.float32)
    if OP == "rms":
        v = h * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        v = h
    return v, h


@triton.jit
def _abs_nonan(v):
    return tl.where(v == v, tl.abs(v), 0.0)


@triton.jit
def _quant_store(y, amax, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB,
                 NG, PER_ROW: tl.constexpr, OUT: tl.constexpr, UB_MODE: tl.constexpr):
    """Scale, cast and store a tile of float32 values ``y``; ``amax`` is the row's (per
    token, (ROWS,)) or None-like (per group: taken here over the tile's last axis)."""
    if PER_ROW:
        a = amax[:, None]
    else:
        a = tl.max(_abs_nonan(y), 2)
    if UB_MODE == 1:
        a = tl.minimum(a, ub)
    elif UB_MODE == 2:
        a = tl.minimum(a, tl.load(UB).to(tl.float32))
    if OUT == "fp8":
        sc = tl.maximum(a / 448.0, 1.0 / (448.0 * 512.0))
    else:
        sc = tl.where(a > 0.0, a / 127.0, 1.0)
    # a per-row scale is stored by every chunk of a walked row: the same 4 bytes
    if PER_ROW:
        tl.store(S + rows * ssm, tl.max(sc, 1), mask=rmask)
    else:
        smask = rmask[:, None] & (grp < NG)[None, :]
        tl.store(S + rows[:, None] * ssm + grp[None, :] * ssg, sc, mask=smask)
    if OUT == "fp8":
        r = saturate_fp8(y / sc[:, :, None])
        q = fp8_keep_nan(r)
    else:
        # IEEE division, as torch divides two tensors: the quotient decides a round-half-even
        # tie, and the GPU's approximate division moved values across ties (-63 for -64)
        r = tl.math.div_rn(y, sc[:, :, None])
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        # round half to even: exact in float32 for |r| < 2**22 (IEEE add, no reassociation)
        r = (r + 12582912.0) - 12582912.0
        q = r.to(tl.int8)
    tl.store(Y + rows[:, None, None] * sym + cols, q, mask=mask)


@triton.jit
def _quant_kernel(
    X, B, R, W, Y, S, H, UB,
    M, K, NG, NCHUNK, sxm, sxk, sbm, sbk, srm, srk, sym, ssm, ssg, shm, eps, ub,
    OP: tl.constexpr, HAS_RES: tl.constexpr, OUT: tl.constexpr, PER_ROW: tl.constexpr,
    UB_MODE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK_NG: tl.constexpr,
    ROWS: tl.constexpr, SINGLE: tl.constexpr, INT64: tl.constexpr,
):
    """Quantize ROWS rows (x, or silu(x) * b, or RMSNorm(x [+ r]) * w) of K columns to Y
    (fp8 e4m3fn or int8) with float32 scales S: per row (PER_ROW, S + row * ssm) or per
    group of G columns (S + row * ssm + group * ssg). H: x + r (HAS_RES), row stride shm.
    UB_MODE: no upper bound on amax (0), the scalar ``ub`` (1) or the one-element tensor UB
    (2). SINGLE: the row is one tile of CHUNK_NG x G columns; otherwise NCHUNK chunks, which
    are grid axis 1 when no row statistic is needed and walked by the program otherwise."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    if INT64:
        rows = rows.to(tl.int64)
    rmask = rows < M
    IS_RMS: tl.constexpr = OP == "rms"
    if SINGLE:
        cols, grp, mask = _tile(rows, rmask, 0, K, NG, G, BLOCK_G, CHUNK_NG)
        v, h = _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk, shm,
                       OP, HAS_RES, True, False)
        if IS_RMS:
            rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(h * h, 2), 1) / K + eps)
            v = v * rstd[:, None, None]
        amax = tl.max(tl.max(_abs_nonan(v), 2), 1)
        _quant_store(v, amax, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB, NG,
                     PER_ROW, OUT, UB_MODE)
    elif not PER_ROW and not IS_RMS:
        # per group with no row statistic: each chunk is a program of its own
        c = tl.program_id(1)
        cols, grp, mask = _tile(rows, rmask, c, K, NG, G, BLOCK_G, CHUNK_NG)
        v, h = _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk, shm,
                       OP, HAS_RES, True, False)
        _quant_store(v, v, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB, NG,
                     PER_ROW, OUT, UB_MODE)
    else:
        # first walk: the row's sum of squares (RMSNorm) and amax of v (per token)
        ss = tl.zeros((ROWS,), tl.float32)
        amax = tl.zeros((ROWS,), tl.float32)
        for c in range(0, NCHUNK):
            cols, grp, mask = _tile(rows, rmask, c, K, NG, G, BLOCK_G, CHUNK_NG)
            v, h = _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk,
                           shm, OP, HAS_RES, True, False)
            if IS_RMS:
                ss += tl.sum(tl.sum(h * h, 2), 1)
            amax = tl.maximum(amax, tl.max(tl.max(_abs_nonan(v), 2), 1))
        if IS_RMS:
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            amax = amax * rstd
        tl.debug_barrier()  # h written above is read back below
        # second walk: last chunk first (the likeliest to still be in L2)
        for i in range(0, NCHUNK):
            c = NCHUNK - 1 - i
            cols, grp, mask = _tile(rows, rmask, c, K, NG, G, BLOCK_G, CHUNK_NG)
            v, h = _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk,
                           shm, OP, HAS_RES, False, HAS_RES)
            if IS_RMS:
                v = v * rstd[:, None, None]
            _quant_store(v, amax, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB,
                         NG, PER_ROW, OUT, UB_MODE)


