"""Dynamic quantization's Triton code (``@triton.jit`` only): one kernel for per-token /
per-group fp8 and int8 scales, with the fused RMSNorm and SiLU-and-mul producers."""

from __future__ import annotations

import triton
import triton.language as tl

from tkit.kernels._numerics import INTERPRET, round_to, to_fp8_saturated


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
def _silu(a):
    """``a * tl.sigmoid(a)``, the same bits. tl.sigmoid is ``1 / (1 + exp(0 - a))`` and its exp
    ``ex2.approx.f32((0 - a) * log2e)``, which scales inputs below -126 to keep subnormal
    results (a compare and two predicated multiplies an element): 1 + e is 1 for every such
    e, so ``ex2.approx.ftz.f32`` (one MUFU) gives the same sum; ``a * -log2e`` is ``(0 - a) *
    log2e`` exactly (one instruction fewer). The division stays ``/`` (div.full.f32): its
    scaling of a divisor above 2**126 keeps the subnormal sigmoid of a < -87, which matters
    after the multiply by a."""
    if INTERPRET:
        s = tl.sigmoid(a)
    else:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f",
                                      [a * -1.4426950408889634], dtype=tl.float32,
                                      is_pure=True, pack=1)
        s = 1.0 / (1.0 + e)
    return a * s


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
            h = _silu(a) * b
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
def _amax(v):
    """max |v| over the last axis of a (ROWS, groups, G) tile, NaN taken as 0: the value of
    ``tl.max(_abs_nonan(v), 2)``. Compiled, tl.max and tl.maximum are PTX max.f32, which
    returns the other operand for a NaN: the max of |v| skips NaN, only an all-NaN group gives
    NaN, and the maximum with 0 makes that 0. One FMNMX an element instead of a NaN test, a
    select and the FMNMX. numpy's maximum propagates NaN: the interpreter takes the select."""
    if INTERPRET:
        a = tl.max(_abs_nonan(v), 2)
    else:
        a = tl.maximum(tl.max(tl.abs(v), 2), 0.0)
    return a


@triton.jit
def _quant_store(y, amax, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB,
                 NG, PER_ROW: tl.constexpr, OUT: tl.constexpr, UB_MODE: tl.constexpr):
    """Scale, cast and store a tile of float32 values ``y``; ``amax`` is the row's (per
    token, (ROWS,)) or None-like (per group: taken here over the tile's last axis)."""
    if PER_ROW:
        a = amax[:, None]
    else:
        a = _amax(y)
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
        if INTERPRET:
            r = y / sc[:, :, None]
        else:
            # y / sc is PTX div.full.f32: y * rcp(sc) after scaling both by a power of 2 when
            # |sc| is outside [2**-126, 2**126] (3 FMULs an element, 2 of them predicated).
            # An fp8 scale is >= 1 / (448 * 512) and <= FLT_MAX / 448, or +inf (an inf in the
            # row), where both forms give +-0 or NaN: 1.0 / sc is rcp(sc) exactly, computed
            # once a scale, and y * (1.0 / sc) the same product, one FMUL an element
            r = y * (1.0 / sc)[:, :, None]
        q = to_fp8_saturated(r)
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
        amax = tl.max(_amax(v), 1)
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
            amax = tl.maximum(amax, tl.max(_amax(v), 1))
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


