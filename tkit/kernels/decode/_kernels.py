"""The decode family's Triton code (``@triton.jit`` only): the split-KV decode kernel over a
paged or dense cache, the combine and merge kernels, and the KV append."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels._numerics import interpreter_operand as _interpreter_operand
from tkit.kernels._numerics import to_fp8_saturated as _to_fp8_saturated


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, acc=None, input_precision: tl.constexpr = None):
    """``tl.dot``; under the interpreter on float32 copies of bfloat16 / fp8 operands."""
    if _INTERPRET:
        a = _interpreter_operand(a)
        b = _interpreter_operand(b)
    return tl.dot(a, b, acc, input_precision=input_precision)


@triton.jit
def _softcap(qk, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """Scores in base-2 units (softcap: cap * log2e * tanh(qk * scale / cap))."""
    if SOFTCAP:
        x = qk * cap_scale
        # tanh without libdevice (the interpreter has none); series near 0 (as in attention)
        ax = tl.abs(x)
        e = tl.exp2(ax * -2.8853900817779268)
        t_big = (1.0 - e) / (1.0 + e)
        t_big = tl.where(x < 0.0, -t_big, t_big)
        x2 = x * x
        t_small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
            -0.05396825396825397 + x2 * 0.021869488536155203))))
        s = tl.where(ax < 0.2, t_small, t_big) * qk_scale
    else:
        s = qk * qk_scale
    return s


@triton.jit
def _key_rows(BT, start_n, cols, L, b64, n_blocks, sbtn,
              PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(block index, row in block) of key positions ``cols`` (any shape; clamped to [0, L - 1]),
    as int64; BLOCK_N keys from ``start_n`` in all. Paged: the block comes from the block
    table (row BT of it), clamped to [0, n_blocks - 1]; dense: the block is the sequence,
    the row the position."""
    c = tl.minimum(cols, L - 1)
    if PAGED:
        if PAGE_SIZE >= BLOCK_N:  # the whole tile is in one page: one table entry
            blk = tl.load(BT + (start_n // PAGE_SIZE) * sbtn)
            blk = tl.minimum(tl.maximum(blk, 0), n_blocks - 1).to(tl.int64)
            blk = tl.broadcast_to(blk, c.shape)
        else:
            blk = tl.load(BT + (c // PAGE_SIZE) * sbtn)
            blk = tl.minimum(tl.maximum(blk, 0), n_blocks - 1).to(tl.int64)
        row = (c % PAGE_SIZE).to(tl.int64)
    else:
        blk = tl.broadcast_to(b64, c.shape)
        row = c.to(tl.int64)
    return blk, row


@triton.jit
def _decode_tile(acc, l_i, m_i, q, K, V, KS, VS, BT, start_n, L, qpos, offs_n, offs_d,
                  b64, n_blocks, shift, wl, wr, qk_scale, cap_scale,
                  skn, skp, skd, svn, svp, svd, sksn, sksp, svsn, svsp, sbtn,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
                  MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                  SCALE_K: tl.constexpr, SCALE_V: tl.constexpr, PREC: tl.constexpr):
    """One sub-tile of SUB_N keys from ``start_n``: the online-softmax update."""
    dmask = offs_d < HEAD_DIM
    cols = start_n + offs_n
    blk, row = _key_rows(BT, start_n, cols, L, b64, n_blocks, sbtn, PAGE_SIZE, PAGED,
                         SUB_N)
    k_ptrs = K + (blk * skn + row * skp)[:, None] + offs_d[None, :] * skd
    if HEAD_DIM == BLOCK_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=dmask[None, :], other=0.0)
    if k.dtype != q.dtype:  # fp8 cache: to the query's dtype (float16 for bf16 queries)
        k = k.to(q.dtype)
    qk = _dot(q, tl.trans(k), input_precision=PREC)
    if SCALE_K == 2:  # per token and head
        ks = tl.load(KS + blk * sksn + row * sksp)
        qk = qk * ks[None, :]
    s = _softcap(qk, qk_scale, cap_scale, SOFTCAP)
    if MASKED:
        ok = (cols < L)[None, :]
        if MASK_HI:
            ok = ok & (cols[None, :] <= qpos[:, None] + shift + wr)
        if MASK_LO:
            ok = ok & (cols[None, :] >= qpos[:, None] + shift - wl)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row that has seen no visible key keeps m = -inf: subtract 0 instead
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v_ptrs = V + (blk * svn + row * svp)[:, None] + offs_d[None, :] * svd
    if HEAD_DIM == BLOCK_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=dmask[None, :], other=0.0)
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    if SCALE_V == 2:
        vs = tl.load(VS + blk * svsn + row * svsp)
        p = p * vs[None, :]
    acc = _dot(p.to(q.dtype), v, acc, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def _decode_tiles(acc, l_i, m_i, q, K, V, KS, VS, BT, start, end, L, qpos, offs_n, offs_d,
                  b64, n_blocks, shift, wl, wr, qk_scale, cap_scale,
                  skn, skp, skd, svn, svp, svd, sksn, sksp, svsn, svsp, sbtn,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  SUB_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
                  MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                  SCALE_K: tl.constexpr, SCALE_V: tl.constexpr, PREC: tl.constexpr):
    """Online softmax over the key tiles [start, end) (multiples of BLOCK_N); MASKED tiles
    evaluate visibility, the others are fully visible to every row. A tile is taken in
    BLOCK_N // SUB_N sub-tiles of SUB_N keys (``offs_n`` is SUB_N long): the loads of a whole
    tile are issued together (the pipeline streams tiles), but only one sub-tile's converted
    operands are live in registers at a time (fp8 caches: see DecodeConfig)."""
    for start_t in range(start, end, BLOCK_N):
        for j in tl.static_range(BLOCK_N // SUB_N):
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, K, V, KS, VS, BT, start_t + j * SUB_N, L, qpos, offs_n,
                offs_d, b64, n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, skd,
                svn, svp, svd, sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, SUB_N,
                PAGE_SIZE, PAGED, MASKED, MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V, PREC)
    return acc, l_i, m_i


@triton.jit
def _row_ptrs(A, B, BT, start_n, L, offs_n, cols, b64, n_blocks, sbtn, sn, sp, sn2, sp2,
              PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, SUB_N: tl.constexpr,
              MASKED: tl.constexpr, SAME: tl.constexpr, COLS: tl.constexpr):
    """Pointers to the rows of key positions ``start_n + offs_n`` in two caches A and B
    strided (block, row) = (sn, sp) and (sn2, sp2) (SAME: B strided as A), at columns
    ``cols`` (COLS: (SUB_N, len(cols)) pointers; else one a row). A fully visible tile (not
    MASKED) whose keys share a block (dense, or pages of SUB_N keys or more: tiles start at
    multiples of SUB_N) needs neither clamps nor a table read per key: one 64-bit base
    pointer a tile and the same 32-bit offsets from it every tile (the launcher guarantees
    SUB_N row strides < 2**31), so an address costs one 64-bit add; every row is then below
    L, a row of the sequence. Else 64-bit offsets per key as :func:`_key_rows`
    (positions clamped to the sequence, blocks to the cache)."""
    if MASKED or (PAGED and PAGE_SIZE < SUB_N):
        blk, row = _key_rows(BT, start_n, start_n + offs_n, L, b64, n_blocks, sbtn, PAGE_SIZE,
                             PAGED, SUB_N)
        ra = A + (blk * sn + row * sp)
        rb = B + (blk * sn2 + row * sp2)
        if COLS:
            pa = ra[:, None] + cols[None, :]
            pb = rb[:, None] + cols[None, :]
        else:
            pa = ra
            pb = rb
    else:
        if PAGED:  # start_n >= 0: unsigned division and remainder by the power of 2
            u = tl.cast(start_n, tl.uint32)
            blk = tl.load(BT + (u // PAGE_SIZE).to(tl.int32) * sbtn)
            blk = tl.minimum(tl.maximum(blk, 0), n_blocks - 1).to(tl.int64)
            if PAGE_SIZE == SUB_N:  # a tile is a page
                ta = A + blk * sn
                tb = B + blk * sn2
            else:
                r0 = (u % PAGE_SIZE).to(tl.int64)
                ta = A + (blk * sn + r0 * sp)
                tb = B + (blk * sn2 + r0 * sp2)
        else:
            r0 = tl.cast(start_n, tl.int64)
            ta = A + (b64 * sn + r0 * sp)
            tb = B + (b64 * sn2 + r0 * sp2)
        if COLS:
            rel = (offs_n * sp)[:, None] + cols[None, :]
            pa = ta + rel
            if SAME:
                pb = tb + rel
            else:
                pb = tb + ((offs_n * sp2)[:, None] + cols[None, :])
        else:
            pa = ta + offs_n * sp
            if SAME:
                pb = tb + offs_n * sp
            else:
                pb = tb + offs_n * sp2
    return pa, pb


@triton.jit
def _decode_tile_words(acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, K, V, KS, VS, BT,
                       start_n, L, qpos, offs_n, b64, n_blocks, shift, wl, wr, qk_scale,
                       cap_scale, skn, skp, svn, svp, sksn, sksp, svsn, svsp, sbtn,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
                       MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                       SCALE_K: tl.constexpr, SCALE_V: tl.constexpr, PREC: tl.constexpr,
                       SAME_STRIDES: tl.constexpr):
    """:func:`_decode_tile` for fp8 caches read as int32 words of 4 values (the software
    pipeline streams the words through shared memory): each word becomes four float16
    quarters (:func:`_fp8_words_to_f16`) in whatever layout the dots ask of the shared-memory
    read, so V's operand is gathered a 32-bit word (4 head-dim positions) at a time, never a
    byte. S = sum_r q_r k_r^T; O's quarters acc_r accumulate apart and are interleaved once
    after the loop by the caller (:func:`_interleave4`).
    Strides ``sk*`` / ``sv*`` are in words (the launcher divides)."""
    cols = start_n + offs_n
    offs_w = tl.arange(0, BLOCK_D // 4)
    wmask = (offs_w < HEAD_DIM // 4)[None, :]
    if SAME_STRIDES:  # one offset computation for K and V (and for their scales)
        svn = skn
        svp = skp
        svsn = sksn
        svsp = sksp
    k_ptrs, v_ptrs = _row_ptrs(K, V, BT, start_n, L, offs_n, offs_w, b64, n_blocks, sbtn, skn,
                               skp, svn, svp, PAGE_SIZE, PAGED, SUB_N, MASKED, SAME_STRIDES,
                               True)
    kw = _masked_load(k_ptrs, wmask, HEAD_DIM != BLOCK_D)
    k0, k1, k2, k3 = _fp8_words_to_f16(kw)
    qk = _dot(q0, tl.trans(k0.to(q0.dtype)), input_precision=PREC)
    qk = _dot(q1, tl.trans(k1.to(q0.dtype)), qk, input_precision=PREC)
    qk = _dot(q2, tl.trans(k2.to(q0.dtype)), qk, input_precision=PREC)
    qk = _dot(q3, tl.trans(k3.to(q0.dtype)), qk, input_precision=PREC)
    if SCALE_K == 2 or SCALE_V == 2:
        ks_ptrs, vs_ptrs = _row_ptrs(KS, VS, BT, start_n, L, offs_n, offs_n, b64, n_blocks,
                                     sbtn, sksn, sksp, svsn, svsp, PAGE_SIZE, PAGED, SUB_N,
                                     MASKED, SAME_STRIDES, False)
    if SCALE_K == 2:
        ks = tl.load(ks_ptrs)
    else:
        ks = tl.zeros([SUB_N], dtype=tl.float32)
    if SCALE_K == 2 and not SOFTCAP:  # the score scale folded into K's (one multiply a score)
        p, alpha, l_i, m_new = _online_softmax(qk, l_i, m_i, ks * qk_scale, cols, L, qpos,
                                               shift, wl, wr, 1.0, cap_scale, MASKED, MASK_LO,
                                               MASK_HI, SOFTCAP, SCALE_K)
    else:
        p, alpha, l_i, m_new = _online_softmax(qk, l_i, m_i, ks, cols, L, qpos, shift, wl, wr,
                                               qk_scale, cap_scale, MASKED, MASK_LO, MASK_HI,
                                               SOFTCAP, SCALE_K)
    if SCALE_V == 2:
        p = p * tl.load(vs_ptrs)[None, :]
    p = p.to(q0.dtype)
    vw = _masked_load(v_ptrs, wmask, HEAD_DIM != BLOCK_D)
    v0, v1, v2, v3 = _fp8_words_to_f16(vw)
    acc0 = _dot(p, v0.to(q0.dtype), acc0 * alpha[:, None], input_precision=PREC)
    acc1 = _dot(p, v1.to(q0.dtype), acc1 * alpha[:, None], input_precision=PREC)
    acc2 = _dot(p, v2.to(q0.dtype), acc2 * alpha[:, None], input_precision=PREC)
    acc3 = _dot(p, v3.to(q0.dtype), acc3 * alpha[:, None], input_precision=PREC)
    return acc0, acc1, acc2, acc3, l_i, m_new


@triton.jit
def _decode_tiles_words(acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, K, V, KS, VS, BT,
                        start, end, L, qpos, offs_n, b64, n_blocks, shift, wl, wr, qk_scale,
                        cap_scale, skn, skp, svn, svp, sksn, sksp, svsn, svsp, sbtn,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        SUB_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                        MASKED: tl.constexpr, MASK_LO: tl.constexpr, MASK_HI: tl.constexpr,
                        SOFTCAP: tl.constexpr, SCALE_K: tl.constexpr, SCALE_V: tl.constexpr,
                        PREC: tl.constexpr, SAME_STRIDES: tl.constexpr):
    """:func:`_decode_tiles` over :func:`_decode_tile_words`."""
    for start_t in range(start, end, BLOCK_N):
        for j in tl.static_range(BLOCK_N // SUB_N):
            acc0, acc1, acc2, acc3, l_i, m_i = _decode_tile_words(
                acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, K, V, KS, VS, BT,
                start_t + j * SUB_N, L, qpos, offs_n, b64, n_blocks, shift, wl, wr, qk_scale,
                cap_scale, skn, skp, svn, svp, sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D,
                SUB_N, PAGE_SIZE, PAGED, MASKED, MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V,
                PREC, SAME_STRIDES)
    return acc0, acc1, acc2, acc3, l_i, m_i


@triton.jit
def _q_split_fp8(Q, q_off2, offs_d, row_ok2, lo_row, sqd, HEAD_DIM: tl.constexpr):
    """The query rows as one fp8 e4m3 operand of twice the rows: row 2r + 0 holds
    q_hi = e4m3(q_r / a_r), row 2r + 1 holds q_lo = e4m3((q_r - q_hi a_r) / b_r), with
    per-row powers of two a_r, b_r that put each part's largest magnitude in [128, 256)
    (division exact, no overflow). ``q_off2`` / ``row_ok2`` are the offsets and validity of
    row r repeated for both parts, ``lo_row`` says which rows are the lo parts. Returns the
    operand and each row's power of two (a_r or b_r), float32: S = sum_j scale_j S_j recovers
    q k^T to ~8 significant bits of q (e4m3 has 4; the residual of the hi part is below 2^-4
    of the element, the lo part keeps 4 bits of it), bfloat16's precision."""
    x = tl.load(Q + q_off2[:, None] + offs_d[None, :] * sqd,
                mask=row_ok2[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    x = x.to(tl.float32)
    a = _pow2_scale(tl.max(tl.abs(x), 1))
    hi = _to_fp8_saturated(x * (1.0 / a)[:, None])
    if _INTERPRET:
        hi_f = _interpreter_operand(hi)
    else:
        hi_f = hi.to(tl.float32)
    r = x - hi_f * a[:, None]  # exact: hi is x rounded to 4 bits at the same power of two
    b = _pow2_scale(tl.max(tl.abs(r), 1))
    lo = _to_fp8_saturated(r * (1.0 / b)[:, None])
    q2 = tl.where(lo_row[:, None], lo, hi)
    return q2, tl.where(lo_row, b, a)


@triton.jit
def _pow2_scale(amax):
    """2^(floor(log2 amax) - 7) for finite amax > 0 (amax / scale in [128, 256)), within
    float32's normal range; 1 for 0 (the row is zero whatever the scale)."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 7  # biased exponent - 7
    e = tl.minimum(tl.maximum(e, 1), 254)
    s = (e << 23).to(tl.float32, bitcast=True)
    return tl.where(amax > 0.0, s, 1.0)


@triton.jit
def _decode_tile_wg(acc0, acc1, acc2, acc3, l_i, m_i, q2t, qsc, K, V, KS, VS, BT,
                    start_n, L, qpos, offs_n, offs_d, b64, n_blocks, shift, wl, wr, qk_scale,
                    cap_scale, skn, skp, svn, svp, sksn, sksp, svsn, svsp, sbtn,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    SUB_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                    MASKED: tl.constexpr, MASK_LO: tl.constexpr, MASK_HI: tl.constexpr,
                    SOFTCAP: tl.constexpr, SCALE_K: tl.constexpr, SCALE_V: tl.constexpr):
    """:func:`_decode_tile_words` with the scores computed transposed by an fp8 MMA:
    S^T = K q2^T, keys as M (so that a tile of 64 keys and 4 warps is one warpgroup's
    ``wgmma m64nNk32 .e4m3.e4m3`` reading K from shared memory as loaded, K-major, without a
    conversion), N = 2 BLOCK_M: q's hi and lo parts (:func:`_q_split_fp8`) in adjacent
    columns, summed with their powers of two ``qsc`` in the thread that holds both. The
    softmax runs along axis 0 (keys), whose max is a reduction across the warps each tile;
    ``l_i`` is [keys, rows]: each key's share of the denominators, summed once after the loop
    (no second reduction a tile). P^T is transposed into P @ V as the word path does it
    (V as float16 quarters). ``K`` is the fp8 cache (strides in bytes), ``V`` its int32 words
    (strides in words)."""
    cols = start_n + offs_n
    offs_w = tl.arange(0, BLOCK_D // 4)
    if PAGED and not MASKED and SUB_N == 2 * PAGE_SIZE:
        # two pages a tile: two table reads and a select of their base pointers a key, not a
        # table read and a 64-bit product a key
        pg = (tl.cast(start_n, tl.uint32) // PAGE_SIZE).to(tl.int32)
        blk0 = tl.minimum(tl.maximum(tl.load(BT + pg * sbtn), 0), n_blocks - 1).to(tl.int64)
        blk1 = tl.minimum(tl.maximum(tl.load(BT + (pg + 1) * sbtn), 0), n_blocks - 1)
        blk1 = blk1.to(tl.int64)
        k_rows, v_rows = _two_page_rows(K, V, blk0, blk1, offs_n, skn, skp, svn, svp,
                                        PAGE_SIZE)
        if SCALE_K == 2 or SCALE_V == 2:
            ks_ptrs, vs_ptrs = _two_page_rows(KS, VS, blk0, blk1, offs_n, sksn, sksp, svsn,
                                              svsp, PAGE_SIZE)
    else:
        k_rows, v_rows = _row_ptrs(K, V, BT, start_n, L, offs_n, offs_n, b64, n_blocks, sbtn,
                                   skn, skp, svn, svp, PAGE_SIZE, PAGED, SUB_N, MASKED, False,
                                   False)
        if SCALE_K == 2 or SCALE_V == 2:
            ks_ptrs, vs_ptrs = _row_ptrs(KS, VS, BT, start_n, L, offs_n, offs_n, b64,
                                         n_blocks, sbtn, sksn, sksp, svsn, svsp, PAGE_SIZE,
                                         PAGED, SUB_N, MASKED, False, False)
    k = tl.load(k_rows[:, None] + offs_d[None, :])
    st = _dot(k, q2t)  # [SUB_N, 2 BLOCK_M] float32
    s_hi, s_lo = tl.split(tl.reshape(st * qsc[None, :], [SUB_N, BLOCK_M, 2]))
    qk = s_hi + s_lo  # [keys, rows]
    if SCALE_K == 2:
        ks = tl.load(ks_ptrs)
    if SCALE_K == 2 and not SOFTCAP:
        s = qk * (ks * qk_scale)[:, None]
    else:
        if SCALE_K == 2:
            qk = qk * ks[:, None]
        s = _softcap(qk, qk_scale, cap_scale, SOFTCAP)
    if MASKED:
        ok = (cols < L)[:, None]
        if MASK_HI:
            ok = ok & (cols[:, None] <= qpos[None, :] + shift + wr)
        if MASK_LO:
            ok = ok & (cols[:, None] >= qpos[None, :] + shift - wl)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[None, :])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha[None, :] + p  # the denominators summed over keys after the loop
    if SCALE_V == 2:
        p = p * tl.load(vs_ptrs)[:, None]
    pt = tl.trans(p).to(tl.float16)  # [rows, keys]
    vw = tl.load(v_rows[:, None] + offs_w[None, :])
    v0, v1, v2, v3 = _fp8_words_to_f16(vw)
    acc0 = _dot(pt, v0, acc0 * alpha[:, None])
    acc1 = _dot(pt, v1, acc1 * alpha[:, None])
    acc2 = _dot(pt, v2, acc2 * alpha[:, None])
    acc3 = _dot(pt, v3, acc3 * alpha[:, None])
    return acc0, acc1, acc2, acc3, l_i, m_new


@triton.jit
def _two_page_rows(A, B, blk0, blk1, offs_n, sn, sp, sn2, sp2, PAGE_SIZE: tl.constexpr):
    """Pointers to rows ``offs_n`` of a tile over two pages (blocks ``blk0``, ``blk1``) of
    caches A and B strided (block, row) = (sn, sp) and (sn2, sp2)."""
    second = offs_n >= PAGE_SIZE
    r = offs_n % PAGE_SIZE
    pa = tl.where(second, A + blk1 * sn, A + blk0 * sn) + r * sp
    pb = tl.where(second, B + blk1 * sn2, B + blk0 * sn2) + r * sp2
    return pa, pb


@triton.jit
def _decode_tiles_wg(acc0, acc1, acc2, acc3, l_i, m_i, q2t, qsc, K, V, KS, VS, BT, start, end,
                     L, qpos, offs_n, offs_d, b64, n_blocks, shift, wl, wr, qk_scale,
                     cap_scale, skn, skp, svn, svp, sksn, sksp, svsn, svsp, sbtn,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, SUB_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     PAGED: tl.constexpr, MASKED: tl.constexpr, MASK_LO: tl.constexpr,
                     MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr, SCALE_K: tl.constexpr,
                     SCALE_V: tl.constexpr):
    """:func:`_decode_tiles` over :func:`_decode_tile_wg`."""
    for start_t in range(start, end, BLOCK_N):
        for j in tl.static_range(BLOCK_N // SUB_N):
            acc0, acc1, acc2, acc3, l_i, m_i = _decode_tile_wg(
                acc0, acc1, acc2, acc3, l_i, m_i, q2t, qsc, K, V, KS, VS, BT,
                start_t + j * SUB_N, L, qpos, offs_n, offs_d, b64, n_blocks, shift, wl, wr,
                qk_scale, cap_scale, skn, skp, svn, svp, sksn, sksp, svsn, svsp, sbtn,
                HEAD_DIM, BLOCK_D, BLOCK_M, SUB_N, PAGE_SIZE, PAGED, MASKED, MASK_LO, MASK_HI,
                SOFTCAP, SCALE_K, SCALE_V)
    return acc0, acc1, acc2, acc3, l_i, m_i


@triton.jit
def _fp8_words_to_f16(w):
    """int32 words, each 4 fp8 e4m3 values of consecutive head-dim positions (little-endian),
    as four float16 tensors shaped like ``w``: e_r holds position 4 * word + r. The tile never
    lives as bytes (one 8-bit value in each 32-bit register) nor is read from shared memory a
    byte at a time, and no reshape follows (the quarters are dotted separately). On a GPU two
    words a call (pack 2): byte r of both words is gathered (prmt) so that one
    ``cvt.rn.f16x2.e4m3x2`` (exact, NaN kept) gives quarter r of both as one f16x2 register,
    the pair an MMA operand register holds when the words are consecutive along K (no
    repacking after the conversion)."""
    if _INTERPRET:  # the interpreter has no inline PTX: the same bytes, converted by Triton
        e0 = _interpreter_operand((w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True))
        e1 = _interpreter_operand(((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv,
                                                                     bitcast=True))
        e2 = _interpreter_operand(((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv,
                                                                      bitcast=True))
        e3 = _interpreter_operand(((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv,
                                                                      bitcast=True))
        e0 = e0.to(tl.float16)
        e1 = e1.to(tl.float16)
        e2 = e2.to(tl.float16)
        e3 = e3.to(tl.float16)
    else:
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1;
            .reg .b16 a0, a1, a2, a3;
            prmt.b32 t0, $4, $5, 0x5140;
            prmt.b32 t1, $4, $5, 0x7362;
            mov.b32 {a0, a1}, t0;
            mov.b32 {a2, a3}, t1;
            cvt.rn.f16x2.e4m3x2 $0, a0;
            cvt.rn.f16x2.e4m3x2 $1, a1;
            cvt.rn.f16x2.e4m3x2 $2, a2;
            cvt.rn.f16x2.e4m3x2 $3, a3;
            }""",
            "=r,=r,=r,=r,r,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=2)
    return e0, e1, e2, e3


@triton.jit
def _interleave4(x0, x1, x2, x3, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(ROWS, COLS) from four (ROWS, COLS // 4) quarters: column 4c + r is x_r's column c.
    tl.join stacks along a new last axis: y[., c, i, j] = x_(2i + j), column 4c + 2i + j."""
    y = tl.join(tl.join(x0, x2), tl.join(x1, x3))
    return tl.reshape(y, [ROWS, COLS])


@triton.jit
def _masked_load(ptrs, mask, ANY_MASK: tl.constexpr):
    """``tl.load(ptrs)``, masked (other 0) only where ANY_MASK says so."""
    if ANY_MASK:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _online_softmax(qk, l_i, m_i, ks, cols, L, qpos, shift, wl, wr, qk_scale, cap_scale,
                    MASKED: tl.constexpr, MASK_LO: tl.constexpr, MASK_HI: tl.constexpr,
                    SOFTCAP: tl.constexpr, SCALE_K: tl.constexpr):
    """P (unnormalized), the rescale of the accumulator, l and the new m, from the raw scores
    of one tile (as :func:`_decode_tile`)."""
    if SCALE_K == 2:
        qk = qk * ks[None, :]
    s = _softcap(qk, qk_scale, cap_scale, SOFTCAP)
    if MASKED:
        ok = (cols < L)[None, :]
        if MASK_HI:
            ok = ok & (cols[None, :] <= qpos[:, None] + shift + wr)
        if MASK_LO:
            ok = ok & (cols[None, :] >= qpos[:, None] + shift - wl)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def _q_part(Q, q_off, cols, row_ok, sqd, HEAD_DIM: tl.constexpr, CACHE_DTYPE: tl.constexpr):
    """Columns ``cols`` of the packed query rows, in the dtype that meets the cache (as q in
    :func:`_decode_split_kernel`: float16 for a bfloat16 query and an fp8 cache)."""
    x = tl.load(Q + q_off[:, None] + cols[None, :] * sqd,
                mask=row_ok[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
    if CACHE_DTYPE.is_fp8() and x.dtype == tl.bfloat16:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return x


@triton.jit
def _decode_split_kernel(
    Q, K, V, KS, VS, SEQLENS, BT, O, LSE,
    sqb, sqs, sqh, sqd, skn, skp, skh, skd, svn, svp, svh, svd,
    sksn, sksp, sksh, svsn, svsp, svsh, s_len, sbtb, sbtn,
    sob, sos, soh, sod, slb, slh, sls, sos_split, sls_split,
    seqlen_q, max_len, n_blocks, GROUP, num_splits, qk_scale, cap_scale, wl, wr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
    MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
    SCALE_K: tl.constexpr, SCALE_V: tl.constexpr, PREC: tl.constexpr,
    FP8_WORDS: tl.constexpr = False, SAME_STRIDES: tl.constexpr = False,
    QK_WG: tl.constexpr = False,
    OUT=None, LOUT=None, CNT=None, sfb=0, sfs=0, sfh=0, sfd=0, sgb=0, sgh=0, sgs=0,
    FUSED: tl.constexpr = False,
):
    """One program: the packed rows of one M tile of one (sequence, kv head), over split
    ``s`` of its keys. Grid (num_splits * M tiles, heads_kv, batch), M tiles fastest.

    Q: (batch, seqlen_q, heads_q, head_dim) strides ``sq*``; K, V: blocks x rows x heads x dim
    (dense: the block is the sequence) strides ``sk*`` / ``sv*``; KS, VS: per-tensor scale
    (SCALE_* = 1, a 0-d tensor) or per (block, row, head) (SCALE_* = 2, strides ``sks*`` /
    ``svs*``); SEQLENS (batch,) int32, or None (max_len keys each); BT: block table
    (``sbtb``, ``sbtn``), PAGED only.
    O, LSE: with one split the final output (O like Q, LSE (batch, heads_q, seqlen_q));
    with several, float32 partials whose split index has strides ``sos_split`` /
    ``sls_split`` and whose other strides follow the same (batch, query, head, dim) names.
    ``qk_scale`` = softmax scale * log2(e) (softcap: cap * log2(e); ``cap_scale`` = scale /
    cap); ``wl``, ``wr`` the window (used when MASK_LO / MASK_HI; causal is wr = 0).
    FP8_WORDS: fp8 caches whose head dim is contiguous, in 4-byte-aligned rows, read as int32
    words of 4 values (:func:`_decode_tiles_words`); SAME_STRIDES (with FP8_WORDS): V and its
    scales strided as K and its.
    FUSED (several splits): O, LSE are the partials and OUT, LOUT (strides ``sf*``, ``sg*``)
    the final output; CNT holds one int32 counter a (sequence, kv head, M tile), zero at the
    launch: the last of its splits to finish merges the partials (:func:`_merge_tile`) and
    puts the counter back to zero, so that no combine launch follows."""
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    n_m = tl.num_programs(0) // num_splits
    split = pid // n_m
    mb = pid % n_m
    b64 = b.to(tl.int64)
    if SEQLENS is None:  # every sequence holds max_len keys (flash_attention's few queries)
        L = max_len
    else:
        L = tl.load(SEQLENS + b64 * s_len)
        L = tl.minimum(tl.maximum(L, 0), max_len)
    shift = L - seqlen_q
    n_rows = seqlen_q * GROUP

    # packed rows: query position i = r // GROUP, head hk * GROUP + r % GROUP
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    qpos = rows // GROUP
    heads = (hk * GROUP + rows % GROUP).to(tl.int64)
    offs_n = tl.arange(0, SUB_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    q_off = b64 * sqb + qpos.to(tl.int64) * sqs + heads * sqh
    q = tl.load(Q + q_off[:, None] + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    if K.dtype.element_ty.is_fp8() and q.dtype == tl.bfloat16:
        # an fp8 cache meets a bfloat16 query in float16: e4m3 -> float16 is exact and one
        # conversion (F2FP) a pair, where bfloat16 took three instructions an element on sm_90
        # (e4m3x2 -> f16x2, then f16 -> f32 -> bf16); bfloat16's 8 bits of mantissa fit
        # float16's 11, magnitudes clamp to its range, and P in [0, 1] keeps 3 more bits
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    # the key range of this M tile: [lo, hi), fully visible to every row in [full_lo, full_hi)
    i_lo = (mb * BLOCK_M) // GROUP
    i_hi = (tl.minimum(mb * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
    lo = 0
    hi = L
    full_lo = 0
    full_end = L
    if MASK_LO:
        lo = (tl.maximum(i_lo + shift - wl, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(i_hi + shift - wl, 0)
        full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    if MASK_HI:
        hi = tl.minimum(L, tl.maximum(i_hi + shift + wr + 1, 0))
        full_end = tl.minimum(L, tl.maximum(i_lo + shift + wr + 1, 0))
    hi = tl.maximum(hi, lo)
    # this split's run of tiles
    n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
    per = (n_tiles + num_splits - 1) // num_splits
    t0 = tl.minimum(lo + split * per * BLOCK_N, hi)
    t1 = tl.minimum(t0 + per * BLOCK_N, hi)
    a = tl.minimum(tl.maximum(full_lo, t0), t1)
    full_hi = (full_end // BLOCK_N) * BLOCK_N
    c = tl.minimum(tl.maximum(full_hi, a), t1)

    KS += hk.to(tl.int64) * sksh
    VS += hk.to(tl.int64) * svsh
    Kh = K + hk.to(tl.int64) * skh
    Vh = V + hk.to(tl.int64) * svh
    BTb = BT + b64 * sbtb
    if SCALE_K == 1:  # per tensor: folded into the score scale
        ks0 = tl.load(KS)
        if SOFTCAP:
            cap_scale = cap_scale * ks0
        else:
            qk_scale = qk_scale * ks0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if QK_WG:  # fp8 scores transposed (keys as M), q split in hi and lo fp8 parts
        rows2 = tl.arange(0, 2 * BLOCK_M)
        r2 = mb * BLOCK_M + rows2 // 2
        q_off2 = (b64 * sqb + (r2 // GROUP).to(tl.int64) * sqs
                  + (hk * GROUP + r2 % GROUP).to(tl.int64) * sqh)
        q2, qsc = _q_split_fp8(Q, q_off2, offs_d, r2 < n_rows, rows2 % 2 == 1, sqd, HEAD_DIM)
        q2t = tl.trans(q2)
        acc0 = tl.zeros([BLOCK_M, BLOCK_D // 4], dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        Vw = Vh.to(tl.pointer_type(tl.int32))
        svn = svn // 4
        svp = svp // 4
        l_i = tl.zeros([SUB_N, BLOCK_M], dtype=tl.float32)
        acc0, acc1, acc2, acc3, l_i, m_i = _decode_tiles_wg(
            acc0, acc1, acc2, acc3, l_i, m_i, q2t, qsc, Kh, Vw, KS, VS, BTb, t0, a, L, qpos,
            offs_n, offs_d, b64, n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, svn,
            svp, sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SUB_N,
            PAGE_SIZE, PAGED, True, MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V)
        acc0, acc1, acc2, acc3, l_i, m_i = _decode_tiles_wg(
            acc0, acc1, acc2, acc3, l_i, m_i, q2t, qsc, Kh, Vw, KS, VS, BTb, a, c, L, qpos,
            offs_n, offs_d, b64, n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, svn,
            svp, sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SUB_N,
            PAGE_SIZE, PAGED, False, MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V)
        acc0, acc1, acc2, acc3, l_i, m_i = _decode_tiles_wg(
            acc0, acc1, acc2, acc3, l_i, m_i, q2t, qsc, Kh, Vw, KS, VS, BTb, c, t1, L, qpos,
            offs_n, offs_d, b64, n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, svn,
            svp, sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SUB_N,
            PAGE_SIZE, PAGED, True, MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V)
        acc = _interleave4(acc0, acc1, acc2, acc3, BLOCK_M, BLOCK_D)
        l_i = tl.sum(l_i, 0)
    elif FP8_WORDS:  # the word pipeline: q's quarters (columns 4c + r), O's quarters
        offs_c = tl.arange(0, BLOCK_D // 4) * 4
        q0 = _q_part(Q, q_off, offs_c, row_ok, sqd, HEAD_DIM, K.dtype.element_ty)
        q1 = _q_part(Q, q_off, offs_c + 1, row_ok, sqd, HEAD_DIM, K.dtype.element_ty)
        q2 = _q_part(Q, q_off, offs_c + 2, row_ok, sqd, HEAD_DIM, K.dtype.element_ty)
        q3 = _q_part(Q, q_off, offs_c + 3, row_ok, sqd, HEAD_DIM, K.dtype.element_ty)
        acc0 = tl.zeros([BLOCK_M, BLOCK_D // 4], dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        # int32 pointers and strides in words (multiples of 4 bytes: the launcher checks)
        Kw = Kh.to(tl.pointer_type(tl.int32))
        Vw = Vh.to(tl.pointer_type(tl.int32))
        skn = skn // 4
        skp = skp // 4
        svn = svn // 4
        svp = svp // 4
        acc0, acc1, acc2, acc3, l_i, m_i = _decode_tiles_words(
            acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, Kw, Vw, KS, VS, BTb, t0, a, L,
            qpos, offs_n, b64, n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, svn, svp,
            sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED,
            True, MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V, PREC, SAME_STRIDES)
        acc0, acc1, acc2, acc3, l_i, m_i = _decode_tiles_words(
            acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, Kw, Vw, KS, VS, BTb, a, c, L,
            qpos, offs_n, b64, n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, svn, svp,
            sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED,
            False, MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V, PREC, SAME_STRIDES)
        acc0, acc1, acc2, acc3, l_i, m_i = _decode_tiles_words(
            acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, Kw, Vw, KS, VS, BTb, c, t1, L,
            qpos, offs_n, b64, n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, svn, svp,
            sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED,
            True, MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V, PREC, SAME_STRIDES)
        acc = _interleave4(acc0, acc1, acc2, acc3, BLOCK_M, BLOCK_D)
    else:
        acc, l_i, m_i = _decode_tiles(
            acc, l_i, m_i, q, Kh, Vh, KS, VS, BTb, t0, a, L, qpos, offs_n, offs_d, b64,
            n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, skd, svn, svp, svd, sksn,
            sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED, True,
            MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V, PREC)
        acc, l_i, m_i = _decode_tiles(
            acc, l_i, m_i, q, Kh, Vh, KS, VS, BTb, a, c, L, qpos, offs_n, offs_d, b64,
            n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, skd, svn, svp, svd, sksn,
            sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED, False,
            MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V, PREC)
        acc, l_i, m_i = _decode_tiles(
            acc, l_i, m_i, q, Kh, Vh, KS, VS, BTb, c, t1, L, qpos, offs_n, offs_d, b64,
            n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, skd, svn, svp, svd, sksn,
            sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED, True,
            MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V, PREC)

    empty = l_i == 0.0  # no visible key in this split: O = 0, lse = -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if SCALE_V == 1:
        out = out * tl.load(VS)
    lse = tl.where(empty, float("-inf"),
                   (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    split64 = split.to(tl.int64)
    o_off = b64 * sob + qpos.to(tl.int64) * sos + heads * soh + split64 * sos_split
    tl.store(O + o_off[:, None] + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])
    l_off = b64 * slb + heads * slh + qpos.to(tl.int64) * sls + split64 * sls_split
    tl.store(LSE + l_off, lse, mask=row_ok)
    if FUSED:
        # every thread's partial stores come before the counter's release; the acquire of
        # the last split orders the others' partials before its loads (which skip L1)
        tl.debug_barrier()
        cnt = CNT + (b * tl.num_programs(1) + hk) * n_m + mb
        done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            o_off0 = o_off - split64 * sos_split
            l_off0 = l_off - split64 * sls_split
            _merge_tile(O, LSE, OUT, LOUT, o_off0, l_off0,
                        b64 * sfb + qpos.to(tl.int64) * sfs + heads * sfh,
                        b64 * sgb + heads * sgh + qpos.to(tl.int64) * sgs,
                        offs_d, row_ok, dmask, num_splits, sos_split, sls_split, sod, sfd,
                        BLOCK_M, BLOCK_D)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_tile(OP, LP, O, LSE, op_off, lp_off, o_off, l_off, offs_d, row_ok, dmask,
                num_splits, sop_split, slp_split, sopd, sod,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows of one M tile of O and LSE from the ``num_splits`` float32 partials at
    ``op_off`` / ``lp_off`` (split strides ``sop_split`` / ``slp_split``), as
    :func:`_merge_rows`: O = sum_s w_s O_s / sum_s w_s, w_s = exp(lse_s - max lse)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(num_splits):
        ls = tl.load(LP + lp_off + s * slp_split, mask=row_ok, other=float("-inf"),
                     cache_modifier=".cg")
        m = tl.maximum(m, ls)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tot = tl.zeros([BLOCK_M], tl.float32)
    mask = row_ok[:, None] & dmask[None, :]
    for s in range(num_splits):
        ls = tl.load(LP + lp_off + s * slp_split, mask=row_ok, other=float("-inf"),
                     cache_modifier=".cg")
        w = tl.exp(ls - m_use)
        tot += w
        o = tl.load(OP + (op_off + s * sop_split)[:, None] + offs_d[None, :] * sopd,
                    mask=mask, other=0.0, cache_modifier=".cg")
        acc += tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0)
    empty = tot == 0.0
    out = acc / tl.where(empty, 1.0, tot)[:, None]
    lse = tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, tot)))
    tl.store(O + o_off[:, None] + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=mask)
    tl.store(LSE + l_off, lse, mask=row_ok)


@triton.jit
def _merge_rows(OA, LA, OB, LB, O, LSE, n_parts, sa_part, sla_part,
                a_off, la_off, b_off, lb_off, o_off, l_off, sad, sbd, sod,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                TWO: tl.constexpr):
    """One output row from ``n_parts`` partial rows (stride ``sa_part`` / ``sla_part`` between
    parts of A) or, with TWO, from one row of A and one of B: O = sum_s w_s O_s / sum_s w_s
    with w_s = exp(lse_s - max lse), lse = max + log(sum w); all -inf gives O = 0, -inf."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    if TWO:
        la = tl.load(LA + la_off)
        lb = tl.load(LB + lb_off)
        m = tl.maximum(la, lb)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m_use)
        wb = tl.exp(lb - m_use)
        tot = wa + wb
        oa = tl.load(OA + a_off + offs_d * sad, mask=dmask, other=0.0).to(tl.float32)
        ob = tl.load(OB + b_off + offs_d * sbd, mask=dmask, other=0.0).to(tl.float32)
        # a part whose weight is 0 contributes nothing (even where its O is not finite)
        acc = tl.where(wa > 0.0, wa * oa, 0.0) + tl.where(wb > 0.0, wb * ob, 0.0)
    else:
        offs_s = tl.arange(0, BLOCK_S)
        m = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, n_parts, BLOCK_S):
            sidx = s0 + offs_s
            ls = tl.load(LA + la_off + sidx.to(tl.int64) * sla_part, mask=sidx < n_parts,
                         other=float("-inf"))
            m = tl.maximum(m, ls)
        m = tl.max(m, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BLOCK_D], tl.float32)
        tot_v = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, n_parts, BLOCK_S):
            sidx = s0 + offs_s
            smask = sidx < n_parts
            ls = tl.load(LA + la_off + sidx.to(tl.int64) * sla_part, mask=smask,
                         other=float("-inf"))
            w = tl.exp(ls - m_use)
            tot_v += w
            o = tl.load(OA + a_off + sidx.to(tl.int64)[:, None] * sa_part
                        + offs_d[None, :] * sad, mask=smask[:, None] & dmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0), 0)
        tot = tl.sum(tot_v, 0)
    empty = tot == 0.0
    out = acc / tl.where(empty, 1.0, tot)
    if TWO:  # log(e^la + e^lb) as torch.logaddexp forms it, to float32's rounding
        lse = tl.where(empty, float("-inf"), m_use + _log1p_exp_neg(tl.abs(la - lb)))
    else:
        lse = tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, tot)))
    tl.store(O + o_off + offs_d * sod, out.to(O.dtype.element_ty), mask=dmask)
    tl.store(LSE + l_off, lse)


@triton.jit
def _log1p_exp_neg(x):
    """log(1 + e^-x) for x >= 0 (+inf: 0) with libdevice's correctly rounded-ish exp and
    log1p: ``tl.exp`` / ``tl.log`` are the SFU's approximations (~2 ulp each, and log(1 + y)
    loses y's low bits), which put a merged lse several ulp off torch's."""
    if _INTERPRET:  # the interpreter has no libdevice; numpy's float32 functions instead
        r = tl.log(1.0 + tl.exp(-x))
    else:
        r = libdevice.log1p(libdevice.exp(-x))
    return r


@triton.jit
def _decode_combine_kernel(
    OP, LP, O, LSE, sopb, sops, soph, sopk, sopd, slpb, slph, slps, slpk,
    sob, sos, soh, sod, slb, slh, sls, H, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program: one (sequence, query, head) row of O and LSE from the ``num_splits``
    float32 partials. Grid (seqlen_q * heads_q, batch)."""
    pid = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    i = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    _merge_rows(OP, LP, OP, LP, O, LSE, num_splits, sopk, slpk,
                b64 * sopb + i * sops + h * soph, b64 * slpb + h * slph + i * slps, 0, 0,
                b64 * sob + i * sos + h * soh, b64 * slb + h * slh + i * sls,
                sopd, sopd, sod, HEAD_DIM, BLOCK_D, BLOCK_S, False)


@triton.jit
def _merge_states_kernel(
    OA, LA, OB, LB, O, LSE,
    sab, sas, sah, sad, slab, slah, slas, sbb, sbs, sbh, sbd, slbb, slbh, slbs,
    sob, sos, soh, sod, slb, slh, sls, H, S,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: one (batch, query, head) row of merge_attention_states. Grid
    (batch * seqlen * heads,): one axis, which takes up to 2^31 - 1 programs (a grid's second
    and third stop at 65535)."""
    pid = tl.program_id(0).to(tl.int64)
    b64 = pid // (S * H)
    rest = pid % (S * H)
    i = rest // H
    h = rest % H
    _merge_rows(OA, LA, OB, LB, O, LSE, 2, 0, 0,
                b64 * sab + i * sas + h * sah, b64 * slab + h * slah + i * slas,
                b64 * sbb + i * sbs + h * sbh, b64 * slbb + h * slbh + i * slbs,
                b64 * sob + i * sos + h * soh, b64 * slb + h * slh + i * sls,
                sad, sbd, sod, HEAD_DIM, BLOCK_D, 1, True)


@triton.jit
def _append_rows(X, XC, XS, t, tmask, blk, row, ok, heads, hmask, offs_d, sxt, sxh, sxd,
                 scn, scp, sch, scd, ssn, ssp, ssh,
                 HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """Tokens t's (BLOCK_T, heads, head_dim) of X written to rows ``row`` of blocks ``blk`` of
    the cache XC where ``ok`` (a valid slot). The load waits on no slot: it is masked by
    ``tmask`` (a token of the call), the stores by ``ok``. QUANT 1: fp8 with the per-tensor
    scale XS (x / scale, saturated to +-448); QUANT 2: fp8 with per-(block, row, head) scales
    amax / 448 computed here and stored to XS."""
    dmask = (offs_d < HEAD_DIM)[None, None, :]
    hm = hmask[None, :, None]
    h64 = heads.to(tl.int64)[None, :, None]
    d3 = offs_d[None, None, :]
    x = tl.load(X + t[:, None, None] * sxt + h64 * sxh + d3 * sxd,
                mask=tmask[:, None, None] & hm & dmask, other=0.0)
    smask = ok[:, None, None] & hm & dmask
    dst = XC + (blk * scn + row * scp)[:, None, None] + h64 * sch + d3 * scd
    if QUANT == 0:
        tl.store(dst, x.to(XC.dtype.element_ty), mask=smask)
    else:
        xf = x.to(tl.float32)
        if QUANT == 1:
            y = tl.math.div_rn(xf, tl.load(XS))
        else:
            amax = tl.max(tl.abs(xf), 2)
            sc = tl.where(amax > 0.0, tl.math.div_rn(amax, 448.0), 1.0)
            tl.store(XS + (blk * ssn + row * ssp)[:, None] + heads.to(tl.int64)[None, :] * ssh, sc,
                     mask=ok[:, None] & hmask[None, :])
            y = tl.math.div_rn(xf, sc[:, :, None])
        tl.store(dst, _to_fp8_saturated(y), mask=smask)


@triton.jit
def _append_kv_kernel(
    K, V, KC, VC, KS, VS, SLOT, T, n_slots, page_size,
    skt, skh, skd, svt, svh, svd,
    skcn, skcp, skch, skcd, svcn, svcp, svch, svcd,
    sksn, sksp, sksh, svsn, svsp, svsh, s_slot, HKV,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr, QUANT_K: tl.constexpr, QUANT_V: tl.constexpr,
):
    """One program: BLOCK_T tokens' keys and values (a block of heads) written to slots
    SLOT[t] of the caches (blocks x rows x heads x dim; slot = block * page_size + row), in
    one launch for both. A slot < 0 or >= n_slots is skipped. Grid (token blocks, head
    blocks)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    slot = tl.load(SLOT + t * s_slot, mask=tmask, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < n_slots)
    blk = slot // page_size
    row = slot % page_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = heads < HKV
    _append_rows(K, KC, KS, t, tmask, blk, row, ok, heads, hmask, offs_d, skt, skh, skd,
                 skcn, skcp, skch, skcd, sksn, sksp, sksh, HEAD_DIM, QUANT_K)
    _append_rows(V, VC, VS, t, tmask, blk, row, ok, heads, hmask, offs_d, svt, svh, svd,
                 svcn, svcp, svch, svcd, svsn, svsp, svsh, HEAD_DIM, QUANT_V)
