"""The attention family's Triton code (``@triton.jit`` only, and the autotuned wrappers): the
forward, the backward's delta, dK/dV and dQ kernels and their shared tile helpers."""

from __future__ import annotations

import triton
import triton.language as tl

from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels._numerics import interpreter_operand as _interpreter_operand
from tkit.kernels.attention.config import (
    _TUNE_KEY,
    _bwd_configs,
    _bwd_smem,
    _fwd_configs,
    _fwd_smem,
    _prune,
)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, acc=None, input_precision: tl.constexpr = None):
    """``tl.dot``; under the interpreter on float32 copies of bfloat16 / fp8 operands (see
    :mod:`tkit.kernels._numerics`)."""
    if _INTERPRET:
        a = _interpreter_operand(a)
        b = _interpreter_operand(b)
    return tl.dot(a, b, acc, input_precision=input_precision)


@triton.jit
def _varlen_span(CU, b, total, CU_BLOCK: tl.constexpr):
    """[start, end) of sequence ``b``: bound(j) is the largest of CU[0..j] clamped to
    [0, total], sequence b is [bound(b), bound(b+1)). For valid cu_seqlens (non-decreasing, 0 to
    total) that is CU[b]:CU[b+1]; whatever CU holds, sequences stay inside the tensors and never
    overlap. CU is read in CU_BLOCK chunks, up to entry b + 1 only."""
    start = b * 0
    end = b * 0
    for c0 in range(0, b + 2, CU_BLOCK):
        idx = c0 + tl.arange(0, CU_BLOCK)
        c = tl.load(CU + idx, mask=idx <= b + 1, other=0)
        c = tl.minimum(tl.maximum(c, 0), total)
        start = tl.maximum(start, tl.max(tl.where(idx <= b, c, 0), 0))
        end = tl.maximum(end, tl.max(c, 0))
    return start, end


@triton.jit
def _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, VARLEN: tl.constexpr,
                CU_BLOCK: tl.constexpr):
    """(first token, length, end) of sequence ``b`` for queries, then for keys. Varlen: the
    span of :func:`_varlen_span`, its length cut to seqlen_q / seqlen_k (max_seqlen_q/k, which
    size the grid): tokens past the cut belong to no sequence."""
    if VARLEN:
        q_start, q_end = _varlen_span(CU_Q, b, total_q, CU_BLOCK)
        k_start, k_end = _varlen_span(CU_K, b, total_k, CU_BLOCK)
        q_len = tl.minimum(q_end - q_start, seqlen_q)
        k_len = tl.minimum(k_end - k_start, seqlen_k)
    else:
        q_start = 0
        q_len = seqlen_q
        q_end = seqlen_q
        k_start = 0
        k_len = seqlen_k
        k_end = seqlen_k
    return q_start, q_len, q_end, k_start, k_len, k_end


@triton.jit
def _zero_rows(X, sxs, sxd, L, sls, start, end, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, HAS_L: tl.constexpr):
    """X[start:end] = 0 (rows of stride ``sxs``) and, with HAS_L, L[start:end] = -inf."""
    offs_d = tl.arange(0, BLOCK_D)
    for r0 in range(start, end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < end
        tl.store(X + rows[:, None] * sxs + offs_d[None, :] * sxd,
                 tl.zeros([BLOCK_M, BLOCK_D], dtype=X.dtype.element_ty),
                 mask=rmask[:, None] & (offs_d < HEAD_DIM)[None, :])
        if HAS_L:
            tl.store(L + rows * sls, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=rmask)


@triton.jit
def _zero_outside(X, sxs, sxd, L, sls, b, n_seq, start, length, end, total,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  HAS_L: tl.constexpr):
    """Varlen rows that belong to no sequence (possible only with invalid cu_seqlens or
    max_seqlen) get defined values: zeros (and lse -inf, as a row with no visible key). One
    program per (sequence, head) calls this: it covers its sequence's tokens past the cut to
    max_seqlen, and the first / last sequence the tokens before / after every sequence."""
    _zero_rows(X, sxs, sxd, L, sls, start + length, end, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_L)
    if b == 0:
        _zero_rows(X, sxs, sxd, L, sls, 0, start, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_L)
    if b == n_seq - 1:
        _zero_rows(X, sxs, sxd, L, sls, end, total, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_L)


@triton.jit
def _scores(qk, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """Scores in base-2 units; with SOFTCAP also tanh(.) (for the backward's derivative)."""
    if SOFTCAP:
        x = qk * cap_scale
        # tanh without libdevice (the interpreter has none), accurate to float32 rounding:
        # (1 - e) / (1 + e) with e = exp(-2|x|) away from 0, its Taylor series near 0 (where
        # 1 - e would cancel; the first omitted term is < 2e-10 at |x| = 0.2)
        ax = tl.abs(x)
        e = tl.exp2(ax * -2.8853900817779268)
        t_big = (1.0 - e) / (1.0 + e)
        t_big = tl.where(x < 0.0, -t_big, t_big)
        x2 = x * x
        t_small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
            -0.05396825396825397 + x2 * 0.021869488536155203))))
        t = tl.where(ax < 0.2, t_small, t_big)
        s = t * qk_scale
    else:
        t = qk
        s = qk * qk_scale
    return s, t


@triton.jit
def _visible(rows, cols, q_len, k_len, shift, wl, wr,
             MASK_LO: tl.constexpr, MASK_HI: tl.constexpr):
    """Mask of visible (query row, key column) pairs; rows and cols broadcast against each
    other."""
    ok = (rows < q_len) & (cols < k_len)
    if MASK_HI:
        ok = ok & (cols <= rows + shift + wr)
    if MASK_LO:
        ok = ok & (cols >= rows + shift - wl)
    return ok


@triton.jit
def _key_ranges(m0, q_len, k_len, shift, wl, wr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK_LO: tl.constexpr, MASK_HI: tl.constexpr):
    """Key block ranges for query rows [m0, m0 + BLOCK_M): [lo, full_lo) partly visible,
    [full_lo, full_hi) fully visible to every row, [full_hi, hi) partly visible."""
    lo = 0
    hi = k_len
    if MASK_LO:
        lo = tl.maximum(m0 + shift - wl, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if MASK_HI:
        hi = tl.minimum(k_len, tl.maximum(m0 + BLOCK_M + shift + wr, 0))
    hi = tl.maximum(hi, lo)
    full_lo = lo
    if MASK_LO:
        full_lo = tl.maximum(m0 + BLOCK_M - 1 + shift - wl, 0)
        full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_end = k_len
    if MASK_HI:
        full_end = tl.minimum(k_len, tl.maximum(m0 + shift + wr + 1, 0))
    full_hi = (full_end // BLOCK_N) * BLOCK_N
    # rows past q_len are padding; a block with padded rows is only "fully visible" for the
    # columns, which is all the masks below need (padded rows are never stored)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(n0, q_len, k_len, shift, wl, wr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_LO: tl.constexpr, MASK_HI: tl.constexpr):
    """Query block ranges that see keys [n0, n0 + BLOCK_N): partly / fully / partly."""
    lo = 0
    hi = q_len
    if MASK_HI:
        lo = tl.maximum(n0 - shift - wr, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if MASK_LO:
        hi = tl.minimum(q_len, tl.maximum(n0 + BLOCK_N - shift + wl, 0))
    hi = tl.maximum(hi, lo)
    full_lo = lo
    if MASK_HI:
        full_lo = tl.maximum(n0 + BLOCK_N - 1 - shift - wr, 0)
        full_lo = ((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_end = q_len
    if MASK_LO:
        full_end = tl.minimum(q_len, tl.maximum(n0 - shift + wl + 1, 0))
    full_hi = (full_end // BLOCK_M) * BLOCK_M
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    if n0 + BLOCK_N > k_len:  # ragged last key block: every query block needs the key mask
        full_lo = hi
        full_hi = hi
    return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, sks, skd, svs, svd,
               start, end, offs_m, offs_n, offs_d, q_len, k_len, shift, wl, wr,
               qk_scale, cap_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, MASK_LO: tl.constexpr, MASK_HI: tl.constexpr,
               SOFTCAP: tl.constexpr, PREC: tl.constexpr, WARP_SPEC: tl.constexpr,
               USE_TMA: tl.constexpr):
    dmask = offs_d < HEAD_DIM
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPEC):
        cols = start_n + offs_n
        if USE_TMA:  # K, V are tensor descriptors: out-of-range rows/columns read as zeros
            kt = tl.trans(K.load([start_n, 0]))
        else:
            kt_ptrs = K + cols[None, :] * sks + offs_d[:, None] * skd
            if MASKED:
                kt = tl.load(kt_ptrs, mask=dmask[:, None] & (cols[None, :] < k_len), other=0.0)
            elif HEAD_DIM == BLOCK_D:
                kt = tl.load(kt_ptrs)
            else:
                kt = tl.load(kt_ptrs, mask=dmask[:, None], other=0.0)
        qk = _dot(q, kt, input_precision=PREC)
        if SOFTCAP:
            s, t = _scores(qk, qk_scale, cap_scale, SOFTCAP)
        else:
            # scale > 0 commutes with the row max: take the max of the raw scores and fold the
            # scale into the exponent's argument, one FMA a score (qk * scale - m) instead of a
            # multiply and a subtract
            s = qk
        if MASKED:
            ok = _visible(offs_m[:, None], cols[None, :], q_len, k_len, shift, wl, wr,
                          MASK_LO, MASK_HI)
            s = tl.where(ok, s, float("-inf"))
        if SOFTCAP:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MASKED:
            # a row that has seen no visible key yet keeps m = -inf: subtract 0 instead
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        if SOFTCAP:
            p = tl.exp2(s - m_use[:, None])
        else:
            p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = V.load([start_n, 0])
        else:
            v_ptrs = V + cols[:, None] * svs + offs_d[None, :] * svd
            if MASKED:
                v = tl.load(v_ptrs, mask=dmask[None, :] & (cols[:, None] < k_len), other=0.0)
            elif HEAD_DIM == BLOCK_D:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=dmask[None, :], other=0.0)
        acc = _dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod,
    slb, slh, sls,
    seqlen_q, seqlen_k, H, GROUP, HEAD_GROUP, qk_scale, cap_scale, wl, wr,
    total_q, total_k, n_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_LO: tl.constexpr,
    MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    WARP_SPEC: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CU_BLOCK: tl.constexpr = 1,
):
    """One program: BLOCK_M query rows of one (batch, query head).

    Q, K, V, O: (batch, seqlen, heads, head_dim) addressed through strides ``s?b, s?s, s?h,
    s?d`` (varlen: ``s?b`` = 0 and sequences start at CU_Q[b] / CU_K[b]); LSE: float32 at
    ``b*slb + h*slh + token*sls``. ``qk_scale`` = scale*log2(e) (softcap: cap*log2(e), and
    ``cap_scale`` = scale/cap); ``wl``/``wr`` the window's left/right extent (used only when
    MASK_LO/MASK_HI). ``seqlen_q``/``seqlen_k`` are the lengths (varlen: the maxima, unused).
    USE_TMA reads K and V through device-side tensor descriptors (TMA on Hopper; needs unit
    head-dim strides and 16-byte aligned rows); WARP_SPEC asks for warp specialization of the
    unmasked loop (Triton 3.6 leaves it a no-op on sm_90: the loop keeps the attribute and no
    partition is made).

    Tile order: the grid is (batch * heads, query blocks) and runs in launch order (axis 0
    fastest); that order is remapped to sections of HEAD_GROUP (batch, head) pairs, query
    blocks in the outer order and heads in the inner one inside a section, so the programs
    in flight share the K/V of a few heads in L2 (HEAD_GROUP >= batch * heads gives the
    plain order: every head of one query block, then the next block). With a causal mask the
    query blocks of a section run last-first, so the longest key ranges start first.
    """
    n_bh = tl.num_programs(0)
    n_m = tl.num_programs(1)
    tile = tl.program_id(1) * n_bh + tl.program_id(0)
    section = tile // (HEAD_GROUP * n_m)
    first_bh = section * HEAD_GROUP
    heads_here = tl.minimum(HEAD_GROUP, n_bh - first_bh)
    r = tile - first_bh * n_m
    pid_m = r // heads_here
    pid_bh = first_bh + r % heads_here
    if MASK_HI:  # causal: the longest key ranges (last query blocks) start first
        pid_m = n_m - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    q_start, q_len, q_end, k_start, k_len, k_end = _seq_bounds(
        CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, VARLEN, CU_BLOCK)
    if VARLEN:
        if pid_m == 0:
            h64 = h.to(tl.int64)
            _zero_outside(O + h64 * soh, sos, sod, LSE + h64 * slh, sls, b, n_seq, q_start,
                          q_len, q_end, total_q, HEAD_DIM, BLOCK_D, BLOCK_M, True)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    hk = h // GROUP
    b64 = b.to(tl.int64)
    Q += b64 * sqb + h.to(tl.int64) * sqh + q_start.to(tl.int64) * sqs
    K += b64 * skb + hk.to(tl.int64) * skh + k_start.to(tl.int64) * sks
    V += b64 * svb + hk.to(tl.int64) * svh + k_start.to(tl.int64) * svs
    O += b64 * sob + h.to(tl.int64) * soh + q_start.to(tl.int64) * sos
    LSE += b64 * slb + h.to(tl.int64) * slh + q_start.to(tl.int64) * sls
    shift = k_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if USE_TMA:
        K = tl.make_tensor_descriptor(K, shape=[k_len, HEAD_DIM], strides=[sks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[k_len, HEAD_DIM], strides=[svs, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
    bounds = _key_ranges(m0, q_len, k_len, shift, wl, wr, BLOCK_M, BLOCK_N, MASK_LO, MASK_HI)
    for seg in tl.static_range(3):  # partly visible, fully visible (unmasked), partly visible
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, sks, skd, svs, svd, bounds[seg],
                                   bounds[seg + 1], offs_m, offs_n, offs_d, q_len, k_len, shift,
                                   wl, wr, qk_scale, cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                                   seg != 1, MASK_LO, MASK_HI, SOFTCAP, PREC,
                                   WARP_SPEC and seg == 1, USE_TMA)
    empty = l_i == 0.0  # no visible key: O = 0, lse = -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    log_l = tl.log2(tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + log_l) * 0.6931471805599453)  # natural log
    tl.store(O + offs_m[:, None] * sos + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + offs_m * sls, lse, mask=offs_m < q_len)


_attn_fwd_autotuned = triton.autotune(
    configs=_fwd_configs(), key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune(_fwd_smem)},
)(_attn_fwd_kernel)


@triton.jit
def _attn_bwd_delta_kernel(
    O, DO, DELTA, CU_Q, sob, sos, soh, sod, sdb, sds, sdh, sdd, slb, slh, sls,
    seqlen_q, H, total_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, CU_BLOCK: tl.constexpr = 1,
):
    """delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] (float32, the LSE's layout).
    Grid (batch * heads, query tiles): batch x heads on the first axis (up to 2^31 - 1; the
    others stop at 65535), as the forward's."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_start, q_len, _, _, _, _ = _seq_bounds(CU_Q, CU_Q, b, seqlen_q, seqlen_q, total_q, total_q,
                                             VARLEN, CU_BLOCK)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    s64 = q_start.to(tl.int64)
    O += b64 * sob + h64 * soh + s64 * sos
    DO += b64 * sdb + h64 * sdh + s64 * sds
    DELTA += b64 * slb + h64 * slh + s64 * sls
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + offs_m[:, None] * sos + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * sds + offs_d[None, :] * sdd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + offs_m * sls, delta, mask=offs_m < q_len)


@triton.jit
def _attn_bwd_prep_kernel(
    O, DO, LSE, DLSE, ROWS, sob, sos, soh, sod, sdb, sds, sdh, sdd,
    seqlen_q, padded_q, H, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """The Gluon backward's row vectors: delta = rowsum(dO * O) (minus dlse when given) and
    lse2 = lse * log2(e), float32, for padded_q rows a head (a multiple of the kernels' query
    blocks), laid out (batch, heads, padded_q / BLOCK_M, 2, BLOCK_M) in ROWS: each block's
    lse2 then its delta, so that one TMA copy brings both; rows past seqlen_q get delta 0 and
    lse2 +inf (P = 0 there, no mask needed). LSE and DLSE: contiguous (batch, heads,
    seqlen_q). Grid (batch * heads, padded_q / BLOCK_M)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = offs_m < seqlen_q
    mask = rmask[:, None] & (offs_d[None, :] < HEAD_DIM)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    o = tl.load(O + b64 * sob + h64 * soh + offs_m[:, None] * sos + offs_d[None, :] * sod,
                mask=mask, other=0.0)
    do = tl.load(DO + b64 * sdb + h64 * sdh + offs_m[:, None] * sds + offs_d[None, :] * sdd,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = pid_bh.to(tl.int64) * seqlen_q + offs_m
    lse = tl.load(LSE + row, mask=rmask, other=0.0)
    if HAS_DLSE:  # d lse_i / d S_ij = P_ij: folds into delta
        delta -= tl.load(DLSE + row, mask=rmask, other=0.0)
    out = pid_bh.to(tl.int64) * (2 * padded_q) + tl.program_id(1) * (2 * BLOCK_M) \
        + tl.arange(0, BLOCK_M)
    tl.store(ROWS + out, tl.where(rmask, lse * 1.4426950408889634, float("inf")))
    tl.store(ROWS + out + BLOCK_M, delta)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqs, sqd, sds, sdd, sls,
                    start, end, offs_n, offs_mb, offs_d, q_len, k_len, shift, wl, wr,
                    qk_scale, cap_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                    MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                    PREC: tl.constexpr):
    dmask = offs_d < HEAD_DIM
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_mb
        rmask = rows < q_len
        qt = tl.load(Q + rows[None, :] * sqs + offs_d[:, None] * sqd,
                     mask=dmask[:, None] & rmask[None, :], other=0.0)
        do = tl.load(DO + rows[:, None] * sds + offs_d[None, :] * sdd,
                     mask=rmask[:, None] & dmask[None, :], other=0.0)
        lse = tl.load(LSE + rows * sls, mask=rmask, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + rows * sls, mask=rmask, other=0.0)
        qkt = _dot(k, qt, input_precision=PREC)  # (BLOCK_N, BLOCK_M)
        st, tt = _scores(qkt, qk_scale, cap_scale, SOFTCAP)
        pt = tl.exp2(st - lse[None, :])
        if MASKED:
            ok = _visible(rows[None, :], offs_n[:, None], q_len, k_len, shift, wl, wr,
                          MASK_LO, MASK_HI)
            pt = tl.where(ok, pt, 0.0)
        dv = _dot(pt.to(do.dtype), do, dv, input_precision=PREC)
        dpt = _dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk = _dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sds, sdh, sdd,
    sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, slb, slh, sls,
    seqlen_q, seqlen_k, HK, GROUP, sm_scale, qk_scale, cap_scale, wl, wr,
    total_q, total_k, n_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_LO: tl.constexpr,
    MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CU_BLOCK: tl.constexpr = 1,
):
    """One program: BLOCK_N keys of one (batch, key/value head), summed over the GROUP query
    heads that share it. DO: the output gradient (strides ``sd*``); DK, DV: outputs (strides
    ``sdk*``, ``sdv*``); LSE, DELTA: float32 rows (layout ``slb, slh, sls``); other arguments
    as in :func:`_attn_fwd_kernel`; ``sm_scale`` the softmax scale."""
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)  # causal: the first key blocks, the longest, start first
    b = pid_bh // HK
    hk = pid_bh % HK
    q_start, q_len, q_end, k_start, k_len, k_end = _seq_bounds(
        CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, VARLEN, CU_BLOCK)
    if VARLEN:
        if pid_n == 0:  # keys of no sequence get zero gradients
            hk64 = hk.to(tl.int64)
            _zero_outside(DK + hk64 * sdkh, sdks, sdkd, DK, 0, b, n_seq, k_start, k_len, k_end,
                          total_k, HEAD_DIM, BLOCK_D, BLOCK_N, False)
            _zero_outside(DV + hk64 * sdvh, sdvs, sdvd, DV, 0, b, n_seq, k_start, k_len, k_end,
                          total_k, HEAD_DIM, BLOCK_D, BLOCK_N, False)
    n0 = pid_n * BLOCK_N
    if n0 >= k_len:
        return
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    qs64 = q_start.to(tl.int64)
    ks64 = k_start.to(tl.int64)
    K += b64 * skb + hk64 * skh + ks64 * sks
    V += b64 * svb + hk64 * svh + ks64 * svs
    DK += b64 * sdkb + hk64 * sdkh + ks64 * sdks
    DV += b64 * sdvb + hk64 * sdvh + ks64 * sdvs
    shift = k_len - q_len
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + offs_n[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + offs_n[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_ranges(n0, q_len, k_len, shift, wl, wr,
                                             BLOCK_M, BLOCK_N, MASK_LO, MASK_HI)
    for g in range(0, GROUP):
        h64 = (hk * GROUP + g).to(tl.int64)
        Qh = Q + b64 * sqb + h64 * sqh + qs64 * sqs
        DOh = DO + b64 * sdb + h64 * sdh + qs64 * sds
        LSEh = LSE + b64 * slb + h64 * slh + qs64 * sls
        DELTAh = DELTA + b64 * slb + h64 * slh + qs64 * sls
        # three call sites, not the static_range walk of the other kernels: from one site the
        # last two ranges share a debug scope, the PTX loses the label between them and ptxas
        # numbers registers differently (same instructions; seen at D=128 and D=256)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sqd, sds, sdd, sls,
                                 lo, full_lo, offs_n, offs_mb, offs_d, q_len, k_len, shift,
                                 wl, wr, qk_scale, cap_scale, HEAD_DIM, BLOCK_M, True,
                                 MASK_LO, MASK_HI, SOFTCAP, PREC)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sqd, sds, sdd, sls,
                                 full_lo, full_hi, offs_n, offs_mb, offs_d, q_len, k_len, shift,
                                 wl, wr, qk_scale, cap_scale, HEAD_DIM, BLOCK_M, False,
                                 MASK_LO, MASK_HI, SOFTCAP, PREC)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sqd, sds, sdd, sls,
                                 full_hi, hi, offs_n, offs_mb, offs_d, q_len, k_len, shift,
                                 wl, wr, qk_scale, cap_scale, HEAD_DIM, BLOCK_M, True,
                                 MASK_LO, MASK_HI, SOFTCAP, PREC)
    dk = dk * sm_scale
    tl.store(DK + offs_n[:, None] * sdks + offs_d[None, :] * sdkd, dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + offs_n[:, None] * sdvs + offs_d[None, :] * sdvd, dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K, V, sks, skd, svs, svd,
                  start, end, offs_m, offs_nb, offs_d, q_len, k_len, shift, wl, wr,
                  qk_scale, cap_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                  PREC: tl.constexpr):
    dmask = offs_d < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_nb
        cmask = cols < k_len
        kt = tl.load(K + cols[None, :] * sks + offs_d[:, None] * skd,
                     mask=dmask[:, None] & cmask[None, :], other=0.0)
        vt = tl.load(V + cols[None, :] * svs + offs_d[:, None] * svd,
                     mask=dmask[:, None] & cmask[None, :], other=0.0)
        qk = _dot(q, kt, input_precision=PREC)
        s, t = _scores(qk, qk_scale, cap_scale, SOFTCAP)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            ok = _visible(offs_m[:, None], cols[None, :], q_len, k_len, shift, wl, wr,
                          MASK_LO, MASK_HI)
            p = tl.where(ok, p, 0.0)
        dp = _dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = _dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sds, sdh, sdd,
    sdqb, sdqs, sdqh, sdqd, slb, slh, sls,
    seqlen_q, seqlen_k, H, GROUP, sm_scale, qk_scale, cap_scale, wl, wr,
    total_q, total_k, n_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_LO: tl.constexpr,
    MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CU_BLOCK: tl.constexpr = 1,
):
    """One program: dQ for BLOCK_M query rows of one (batch, query head); DQ strides
    ``sdq*``; other arguments as in :func:`_attn_bwd_dkdv_kernel`."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    if MASK_HI:  # causal: the longest key ranges (last query blocks) start first
        pid_m = tl.num_programs(1) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    q_start, q_len, q_end, k_start, k_len, k_end = _seq_bounds(
        CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, VARLEN, CU_BLOCK)
    if VARLEN:
        if tl.program_id(1) == 0:  # queries of no sequence get zero gradients
            _zero_outside(DQ + h.to(tl.int64) * sdqh, sdqs, sdqd, DQ, 0, b, n_seq, q_start,
                          q_len, q_end, total_q, HEAD_DIM, BLOCK_D, BLOCK_M, False)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    hk = h // GROUP
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    qs64 = q_start.to(tl.int64)
    ks64 = k_start.to(tl.int64)
    Q += b64 * sqb + h64 * sqh + qs64 * sqs
    DO += b64 * sdb + h64 * sdh + qs64 * sds
    DQ += b64 * sdqb + h64 * sdqh + qs64 * sdqs
    LSE += b64 * slb + h64 * slh + qs64 * sls
    DELTA += b64 * slb + h64 * slh + qs64 * sls
    K += b64 * skb + hk64 * skh + ks64 * sks
    V += b64 * svb + hk64 * svh + ks64 * svs
    shift = k_len - q_len
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = offs_m < q_len
    mask = rmask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * sds + offs_d[None, :] * sdd, mask=mask, other=0.0)
    lse = tl.load(LSE + offs_m * sls, mask=rmask, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + offs_m * sls, mask=rmask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bounds = _key_ranges(m0, q_len, k_len, shift, wl, wr, BLOCK_M, BLOCK_N, MASK_LO, MASK_HI)
    for seg in tl.static_range(3):  # partly, fully (unmasked), partly visible
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, sks, skd, svs, svd, bounds[seg],
                           bounds[seg + 1], offs_m, offs_nb, offs_d, q_len, k_len, shift, wl,
                           wr, qk_scale, cap_scale, HEAD_DIM, BLOCK_N, seg != 1, MASK_LO,
                           MASK_HI, SOFTCAP, PREC)
    dq = dq * sm_scale
    tl.store(DQ + offs_m[:, None] * sdqs + offs_d[None, :] * sdqd, dq.to(DQ.dtype.element_ty),
             mask=mask)


_attn_bwd_dkdv_autotuned = triton.autotune(
    configs=_bwd_configs("dkdv"), key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune(_bwd_smem("dkdv"))},
)(_attn_bwd_dkdv_kernel)
_attn_bwd_dq_autotuned = triton.autotune(
    configs=_bwd_configs("dq"), key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune(_bwd_smem("dq"))},
)(_attn_bwd_dq_kernel)


