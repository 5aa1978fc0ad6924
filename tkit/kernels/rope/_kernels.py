"""RoPE's Triton code (``@triton.jit`` only): the rotation kernel, with the optional pass-through
copy and the fused KV-cache append (and fp8 quantization) of ``rope_append_kv``."""

from __future__ import annotations

import triton
import triton.language as tl

from tkit.kernels._numerics import round_to, to_fp8_saturated


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _rot_offsets(base, d_stride, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 IS_NEOX: tl.constexpr):
    """Offsets of the rotated pairs of a (BLOCK_T, BLOCK_H) set of head rows starting at
    ``base``: neox (a, b) = (x[i], x[HALF + i]), each (T, H, BLOCK_HALF); GPT-J one
    (T, H, 2 * BLOCK_HALF) run x[0 .. 2 * HALF) (returned twice), split into pairs in
    registers (a load of (HALF, 2) offsets compiled to 4-byte accesses on sm_90; a contiguous
    run reshaped after the load gives 16-byte ones)."""
    if IS_NEOX:
        i = tl.arange(0, BLOCK_HALF)
        oa = base[:, :, None] + (i * d_stride)[None, None, :]
        ob = base[:, :, None] + ((i + HALF) * d_stride)[None, None, :]
    else:
        d = tl.arange(0, 2 * BLOCK_HALF)
        oa = base[:, :, None] + (d * d_stride)[None, None, :]
        ob = oa
    return oa, ob


@triton.jit
def _rot_mask(m2, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    if IS_NEOX:
        m3 = m2[:, :, None] & (tl.arange(0, BLOCK_HALF) < HALF)[None, None, :]
    else:
        m3 = m2[:, :, None] & (tl.arange(0, 2 * BLOCK_HALF) < 2 * HALF)[None, None, :]
    return m3


@triton.jit
def _load_rotate(X, base, d_stride, m2, cos, sin, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """The rotated pairs (a', b') in float32, (T, H, BLOCK_HALF) each; zeros where masked."""
    oa, ob = _rot_offsets(base, d_stride, HALF, BLOCK_HALF, IS_NEOX)
    m = _rot_mask(m2, HALF, BLOCK_HALF, IS_NEOX)
    if IS_NEOX:
        a = tl.load(X + oa, mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + ob, mask=m, other=0.0).to(tl.float32)
    else:
        x = tl.load(X + oa, mask=m, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], BLOCK_HALF, 2)))
    c = cos[:, None, :]
    s = sin[:, None, :]
    # the roundings spelled out (one product rounded, the other fused): left to the compiler,
    # the contraction of a * c - b * s followed each kernel's code, and rope_append_kv's float32
    # outputs differed from rope's in the last bit on the H200 (GPT-J pairs, head dim 48)
    return tl.fma(a, c, -(b * s)), tl.fma(b, c, a * s)


@triton.jit
def _load_pair(X, base, d_stride, m2, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
               IS_NEOX: tl.constexpr):
    """The raw pairs of _load_rotate (X's dtype; GPT-J: the run x[0:R] twice), loaded only."""
    oa, ob = _rot_offsets(base, d_stride, HALF, BLOCK_HALF, IS_NEOX)
    m = _rot_mask(m2, HALF, BLOCK_HALF, IS_NEOX)
    a = tl.load(X + oa, mask=m, other=0.0)
    b = a
    if IS_NEOX:
        b = tl.load(X + ob, mask=m, other=0.0)
    return a, b


@triton.jit
def _rotate(a, b, cos, sin, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """(a', b') in float32 from _load_pair's values, as _load_rotate computes them."""
    if IS_NEOX:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    else:
        x = a.to(tl.float32)
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], BLOCK_HALF, 2)))
    c = cos[:, None, :]
    s = sin[:, None, :]
    return tl.fma(a, c, -(b * s)), tl.fma(b, c, a * s)


@triton.jit
def _store_rot(Y, base, d_stride, m2, ya, yb, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
               IS_NEOX: tl.constexpr):
    """Store the pairs (already in Y's dtype) where _load_rotate found them."""
    oa, ob = _rot_offsets(base, d_stride, HALF, BLOCK_HALF, IS_NEOX)
    m = _rot_mask(m2, HALF, BLOCK_HALF, IS_NEOX)
    if IS_NEOX:
        tl.store(Y + oa, ya, mask=m)
        tl.store(Y + ob, yb, mask=m)
    else:
        y = tl.reshape(tl.join(ya, yb), (ya.shape[0], ya.shape[1], 2 * BLOCK_HALF))
        tl.store(Y + oa, y, mask=m)


@triton.jit
def _pass_offsets(base, d_stride, m2, START: tl.constexpr, LEN: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    j = tl.arange(0, BLOCK_P)
    off = base[:, :, None] + ((START + j) * d_stride)[None, None, :]
    return off, m2[:, :, None] & (j < LEN)[None, None, :]


@triton.jit
def _quant_scale(amax, QUANT: tl.constexpr, XS, soff, m2):
    """The divisor of an fp8 cache write: the per-tensor scale (QUANT 1) or amax / 448 per
    (token, head), stored at the slot (QUANT 2), as ``tkit.append_kv`` does."""
    if QUANT == 1:
        sc = tl.zeros(amax.shape, tl.float32) + tl.load(XS)
    else:
        # IEEE division, as append_kv divides (``/`` compiles to the approximate div.full.f32,
        # and the two writers' scales differed in the last bit on the H200)
        sc = tl.where(amax > 0.0, tl.math.div_rn(amax, 448.0), 1.0)
        tl.store(XS + soff, sc, mask=m2)
    return sc


@triton.jit
def _to_cache(y, sc, XC, QUANT: tl.constexpr):
    """float32 ``y`` in the cache's dtype: rounded, or divided by the scale and saturated to
    +-448 (NaN kept) for an fp8 cache."""
    if QUANT == 0:
        out = round_to(y, XC.dtype.element_ty)
    else:
        if len(y.shape) == 4:
            r = tl.math.div_rn(y, sc[:, :, None, None])
        else:
            r = tl.math.div_rn(y, sc[:, :, None])
        out = to_fp8_saturated(r)
    return out


@triton.jit
def _absmax(y):
    """max |y| over a head row's values (the last one or two axes) -> (T, H)."""
    a = tl.abs(y)
    if len(y.shape) == 4:
        a = tl.max(a, 3)
    return tl.max(a, 2)


@triton.jit
def _k_to_cache(ya, yb, p, h, m2, valid, blk, row, KC, KS, kcn, kcp, kch, kcd, ksn, ksp, ksh,
                QUANT_K: tl.constexpr, ROT: tl.constexpr, PASS: tl.constexpr,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
                IS_NEOX: tl.constexpr):
    """Write a (T, H) tile of rotated k (ya, yb in float32; the pass-through part p) into the
    cache at the tokens' slots (block blk, row ``row``) where ``valid``."""
    h64 = h.to(tl.int64)
    cm2 = m2 & valid[:, None]
    cb = blk[:, None] * kcn + row[:, None] * kcp + h64[None, :] * kch
    sc = tl.zeros(m2.shape, tl.float32)
    if QUANT_K != 0:
        amax = tl.maximum(_absmax(ya), _absmax(yb))
        if PASS > 0:
            amax = tl.maximum(amax, _absmax(p.to(tl.float32)))
        soff = blk[:, None] * ksn + row[:, None] * ksp + h64[None, :] * ksh
        sc = _quant_scale(amax, QUANT_K, KS, soff, cm2)
    _store_rot(KC, cb, kcd, cm2, _to_cache(ya, sc, KC, QUANT_K),
               _to_cache(yb, sc, KC, QUANT_K), HALF, BLOCK_HALF, IS_NEOX)
    if PASS > 0:
        pc, pcm = _pass_offsets(cb, kcd, cm2, ROT, PASS, BLOCK_P)
        tl.store(KC + pc, _to_cache(p.to(tl.float32), sc, KC, QUANT_K), mask=pcm)


@triton.jit
def _v_to_cache(x, h64, cm2, vm, blk, row, VC, VS, vcn, vcp, vch, vcd, vsn, vsp, vsh,
                QUANT_V: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write a (T, H, BLOCK_D) tile of v (float32, mask vm) into its cache (or quantize it)
    at the tokens' slots (heads h64); cm2: the (T, H) rows written."""
    cb = blk[:, None] * vcn + row[:, None] * vcp + h64[None, :] * vch
    sc = tl.zeros(cm2.shape, tl.float32)
    if QUANT_V != 0:
        soff = blk[:, None] * vsn + row[:, None] * vsp + h64[None, :] * vsh
        sc = _quant_scale(_absmax(x), QUANT_V, VS, soff, cm2)
    vc, _vcm = _pass_offsets(cb, vcd, cm2, 0, HEAD_DIM, BLOCK_D)
    tl.store(VC + vc, _to_cache(x, sc, VC, QUANT_V), mask=vm)


@triton.jit
def _block_rows(tile, T, S, INT64: tl.constexpr, BLOCK_T: tl.constexpr):
    """Token block ``tile``'s tokens: (t, mask, batch index, sequence index)."""
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    if INT64:
        t = t.to(tl.int64)
    bi = t // S
    return t, t < T, bi, t - bi * S


@triton.jit
def _tokens_load(
    tile, Q, K, V, SLOT, T, S, HQ, HK,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, s_slot,
    HEAD_DIM: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr,
    COPY_PASS: tl.constexpr, APPEND: tl.constexpr, INT64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The loads of token block ``tile`` whose addresses need no loaded value: q's and k's
    pairs (all heads), their pass-through parts where copied, slots and v with the cache
    write; raw (the inputs' dtypes). Unused results are placeholders."""
    t, tmask, bi, si = _block_rows(tile, T, S, INT64, BLOCK_T)
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = HEAD_DIM - ROT
    hq = tl.arange(0, BLOCK_HQ)
    mq = tmask[:, None] & (hq < HQ)[None, :]
    xq = bi[:, None] * sqb + si[:, None] * sqs + hq[None, :] * sqh
    qa, qb = _load_pair(Q, xq, sqd, mq, HALF, BLOCK_HALF, IS_NEOX)
    hk = tl.arange(0, BLOCK_HK)
    mk = tmask[:, None] & (hk < HK)[None, :]
    xk = bi[:, None] * skb + si[:, None] * sks + hk[None, :] * skh
    ka, kb = _load_pair(K, xk, skd, mk, HALF, BLOCK_HALF, IS_NEOX)
    qp = qa
    kp = ka
    if COPY_PASS and PASS > 0:
        qpi, qpm = _pass_offsets(xq, sqd, mq, ROT, PASS, BLOCK_P)
        qp = tl.load(Q + qpi, mask=qpm)
    if PASS > 0 and (COPY_PASS or APPEND):
        kpi, kpm = _pass_offsets(xk, skd, mk, ROT, PASS, BLOCK_P)
        kp = tl.load(K + kpi, mask=kpm)
    slot = t
    v = qa
    if APPEND:
        slot = tl.load(SLOT + t * s_slot, mask=tmask, other=-1)
        # every row of the block's v; rows of skipped slots are not written
        xv = bi[:, None] * svb + si[:, None] * svs + hk[None, :] * svh
        vi, vm = _pass_offsets(xv, svd, mk, 0, HEAD_DIM, BLOCK_D)
        v = tl.load(V + vi, mask=vm, other=0.0)
    return qa, qb, ka, kb, qp, kp, slot, v


@triton.jit
def _tokens_pos(tile, POS, T, S, spb, sps, INT64: tl.constexpr, BLOCK_T: tl.constexpr):
    """Token block ``tile``'s positions, as loaded."""
    t, tmask, bi, si = _block_rows(tile, T, S, INT64, BLOCK_T)
    return tl.load(POS + bi * spb + si * sps, mask=tmask, other=0)


@triton.jit
def _tokens_table(tile, pos, CS, T, S, max_pos, scp, scd, ROT: tl.constexpr,
                  INT64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The cos and sin halves (float32) of the table rows at token block ``tile``'s
    positions ``pos``, clamped to the table."""
    t, tmask, bi, si = _block_rows(tile, T, S, INT64, BLOCK_T)
    HALF: tl.constexpr = ROT // 2
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # never outside the table
    if INT64:
        pos = pos.to(tl.int64)
    else:
        pos = pos.to(tl.int32)
    i = tl.arange(0, BLOCK_HALF)
    cmask = tmask[:, None] & (i < HALF)[None, :]
    crow = pos[:, None] * scp
    cos = tl.load(CS + crow + i[None, :] * scd, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(CS + crow + (i + HALF)[None, :] * scd, mask=cmask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _tokens_finish(
    tile, cos, sin, qa, qb, ka, kb, qp, kp, slot, v,
    QO, KO, KC, VC, KS, VS, T, S, HQ, HK, n_slots, page_size,
    sob, sos, soh, sod, skob, skos, skoh, skod,
    kcn, kcp, kch, kcd, vcn, vcp, vch, vcd, ksn, ksp, ksh, vsn, vsp, vsh,
    HEAD_DIM: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr,
    COPY_PASS: tl.constexpr, APPEND: tl.constexpr, QUANT_K: tl.constexpr,
    QUANT_V: tl.constexpr, INT64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The rest of token block ``tile`` given its table rows and _tokens_load's values: the
    rotation, the stores (and the cache write)."""
    t, tmask, bi, si = _block_rows(tile, T, S, INT64, BLOCK_T)
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = HEAD_DIM - ROT
    hq = tl.arange(0, BLOCK_HQ)
    mq = tmask[:, None] & (hq < HQ)[None, :]
    ya, yb = _rotate(qa, qb, cos, sin, BLOCK_HALF, IS_NEOX)
    oq = bi[:, None] * sob + si[:, None] * sos + hq[None, :] * soh
    _store_rot(QO, oq, sod, mq, round_to(ya, QO.dtype.element_ty),
               round_to(yb, QO.dtype.element_ty), HALF, BLOCK_HALF, IS_NEOX)
    if COPY_PASS and PASS > 0:
        po, pm = _pass_offsets(oq, sod, mq, ROT, PASS, BLOCK_P)
        tl.store(QO + po, qp, mask=pm)
    hk = tl.arange(0, BLOCK_HK)
    mk = tmask[:, None] & (hk < HK)[None, :]
    ya, yb = _rotate(ka, kb, cos, sin, BLOCK_HALF, IS_NEOX)
    ok = bi[:, None] * skob + si[:, None] * skos + hk[None, :] * skoh
    _store_rot(KO, ok, skod, mk, round_to(ya, KO.dtype.element_ty),
               round_to(yb, KO.dtype.element_ty), HALF, BLOCK_HALF, IS_NEOX)
    if COPY_PASS and PASS > 0:
        po, pm = _pass_offsets(ok, skod, mk, ROT, PASS, BLOCK_P)
        tl.store(KO + po, kp, mask=pm)
    if APPEND:
        slot = slot.to(tl.int64)
        valid = tmask & (slot >= 0) & (slot < n_slots)
        slot = tl.where(valid, slot, 0)
        blk = slot // page_size
        row = slot - blk * page_size
        _k_to_cache(ya, yb, kp, hk, mk, valid, blk, row, KC, KS, kcn, kcp, kch, kcd, ksn, ksp,
                    ksh, QUANT_K, ROT, PASS, HALF, BLOCK_HALF, BLOCK_P, IS_NEOX)
        cmk = mk & valid[:, None]
        vm = cmk[:, :, None] & (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, None, :]
        _v_to_cache(v.to(tl.float32), hk.to(tl.int64), cmk, vm, blk, row, VC, VS, vcn, vcp,
                    vch, vcd, vsn, vsp, vsh, QUANT_V, HEAD_DIM, BLOCK_D)


@triton.jit
def _rope_kernel(
    Q, K, V, QO, KO, POS, CS, KC, VC, KS, VS, SLOT,
    T, S, HQ, HK, max_pos, n_slots, page_size,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
    sob, sos, soh, sod, skob, skos, skoh, skod,
    spb, sps, scp, scd, s_slot,
    kcn, kcp, kch, kcd, vcn, vcp, vch, vcd,
    ksn, ksp, ksh, vsn, vsp, vsh,
    HEAD_DIM: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr,
    COPY_PASS: tl.constexpr, APPEND: tl.constexpr, QUANT_K: tl.constexpr,
    QUANT_V: tl.constexpr, INT64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    HEADS_AT_ONCE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    PERSISTENT: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Rotate BLOCK_T tokens of q (Q -> QO) and k (K -> KO) and, with APPEND, write the rotated
    k and v (V) into the caches KC / VC at slot SLOT[t].

    Token t is (b, s) = (t // S, t % S): q is addressed as b * sqb + s * sqs + h * sqh +
    d * sqd (S = tokens and sqb = 0 for a (tokens, heads, dim) tensor), likewise k, v, the
    outputs (so*, sko*) and the positions (spb, sps). CS: the (max_pos, ROT) cos/sin table
    (row stride scp, column stride scd). QO/KO may be Q/K themselves (in place); COPY_PASS
    copies x[ROT:HEAD_DIM] to the outputs (out of place). Caches (blocks, page, heads, dim)
    with strides kc*/vc*; QUANT_K/QUANT_V 0 (same dtype), 1 (fp8, per-tensor scale KS/VS) or 2
    (fp8, per-(block, row, head) scales with strides ks*/vs*, computed and stored here).

    HEADS_AT_ONCE: a token block's heads in one tile (_tokens_load, _tokens_finish) instead
    of BLOCK_H-head tiles walked in turn; PERSISTENT: programs loop over the token blocks
    (grid-stride), the next blocks' loads in flight during the current one's: STAGES-deep
    through shared memory (Triton's pipeliner) or, with PREFETCH, one block ahead in
    registers.
    """
    if HEADS_AT_ONCE:
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        stop = tl.cdiv(T, BLOCK_T)
        if not PERSISTENT:
            pos = _tokens_pos(pid, POS, T, S, spb, sps, INT64, BLOCK_T)
            qa, qb, ka, kb, qp, kp, slot, v = _tokens_load(
                pid, Q, K, V, SLOT, T, S, HQ, HK,
                sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, s_slot,
                HEAD_DIM, ROT, IS_NEOX, COPY_PASS, APPEND, INT64,
                BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_P, BLOCK_D)
            cos, sin = _tokens_table(
                pid, pos, CS, T, S, max_pos, scp, scd,
                ROT, INT64, BLOCK_T, BLOCK_HALF)
            _tokens_finish(
                pid, cos, sin, qa, qb, ka, kb, qp, kp, slot, v,
                QO, KO, KC, VC, KS, VS, T, S, HQ, HK, n_slots, page_size,
                sob, sos, soh, sod, skob, skos, skoh, skod,
                kcn, kcp, kch, kcd, vcn, vcp, vch, vcd, ksn, ksp, ksh, vsn, vsp, vsh,
                HEAD_DIM, ROT, IS_NEOX, COPY_PASS, APPEND, QUANT_K, QUANT_V, INT64,
                BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_P, BLOCK_D)
        elif PREFETCH:
            # by hand, one block ahead: the next block's q, k (and v) loads and its table rows
            # (its positions loaded a block earlier still) are issued before this block's
            # stores; loads past the last block are masked off
            pos = _tokens_pos(pid, POS, T, S, spb, sps, INT64, BLOCK_T)
            qa, qb, ka, kb, qp, kp, slot, v = _tokens_load(
                pid, Q, K, V, SLOT, T, S, HQ, HK,
                sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, s_slot,
                HEAD_DIM, ROT, IS_NEOX, COPY_PASS, APPEND, INT64,
                BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_P, BLOCK_D)
            cos, sin = _tokens_table(
                pid, pos, CS, T, S, max_pos, scp, scd,
                ROT, INT64, BLOCK_T, BLOCK_HALF)
            pos = _tokens_pos(pid + step, POS, T, S, spb, sps, INT64, BLOCK_T)
            for tile in range(pid, stop, step):
                n_pos = _tokens_pos(tile + 2 * step, POS, T, S, spb, sps, INT64, BLOCK_T)
                n_qa, n_qb, n_ka, n_kb, n_qp, n_kp, n_slot, n_v = _tokens_load(
                    tile + step, Q, K, V, SLOT, T, S, HQ, HK,
                    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, s_slot,
                    HEAD_DIM, ROT, IS_NEOX, COPY_PASS, APPEND, INT64,
                    BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_P, BLOCK_D)
                n_cos, n_sin = _tokens_table(
                    tile + step, pos, CS, T, S, max_pos, scp, scd,
                    ROT, INT64, BLOCK_T, BLOCK_HALF)
                _tokens_finish(
                    tile, cos, sin, qa, qb, ka, kb, qp, kp, slot, v,
                    QO, KO, KC, VC, KS, VS, T, S, HQ, HK, n_slots, page_size,
                    sob, sos, soh, sod, skob, skos, skoh, skod,
                    kcn, kcp, kch, kcd, vcn, vcp, vch, vcd, ksn, ksp, ksh, vsn, vsp, vsh,
                    HEAD_DIM, ROT, IS_NEOX, COPY_PASS, APPEND, QUANT_K, QUANT_V, INT64,
                    BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_P, BLOCK_D)
                pos = n_pos
                qa = n_qa
                qb = n_qb
                ka = n_ka
                kb = n_kb
                qp = n_qp
                kp = n_kp
                slot = n_slot
                v = n_v
                cos = n_cos
                sin = n_sin
        else:
            for tile in tl.range(pid, stop, step, num_stages=STAGES):
                pos = _tokens_pos(tile, POS, T, S, spb, sps, INT64, BLOCK_T)
                qa, qb, ka, kb, qp, kp, slot, v = _tokens_load(
                    tile, Q, K, V, SLOT, T, S, HQ, HK,
                    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, s_slot,
                    HEAD_DIM, ROT, IS_NEOX, COPY_PASS, APPEND, INT64,
                    BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_P, BLOCK_D)
                cos, sin = _tokens_table(
                    tile, pos, CS, T, S, max_pos, scp, scd,
                    ROT, INT64, BLOCK_T, BLOCK_HALF)
                _tokens_finish(
                    tile, cos, sin, qa, qb, ka, kb, qp, kp, slot, v,
                    QO, KO, KC, VC, KS, VS, T, S, HQ, HK, n_slots, page_size,
                    sob, sos, soh, sod, skob, skos, skoh, skod,
                    kcn, kcp, kch, kcd, vcn, vcp, vch, vcd, ksn, ksp, ksh, vsn, vsp, vsh,
                    HEAD_DIM, ROT, IS_NEOX, COPY_PASS, APPEND, QUANT_K, QUANT_V, INT64,
                    BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_P, BLOCK_D)
    else:
        pid = tl.program_id(0)
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        if INT64:
            t = t.to(tl.int64)
        tmask = t < T
        bi = t // S
        si = t - bi * S
        pos = tl.load(POS + bi * spb + si * sps, mask=tmask, other=0)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # never outside the table
        if INT64:
            pos = pos.to(tl.int64)
        else:
            pos = pos.to(tl.int32)
        HALF: tl.constexpr = ROT // 2
        PASS: tl.constexpr = HEAD_DIM - ROT
        i = tl.arange(0, BLOCK_HALF)
        cmask = tmask[:, None] & (i < HALF)[None, :]
        crow = pos[:, None] * scp
        cos = tl.load(CS + crow + i[None, :] * scd, mask=cmask, other=0.0).to(tl.float32)
        sin = tl.load(CS + crow + (i + HALF)[None, :] * scd, mask=cmask, other=0.0).to(tl.float32)
        hr = tl.arange(0, BLOCK_H)

        # q
        for h0 in range(0, HQ, BLOCK_H):
            h = h0 + hr
            m2 = tmask[:, None] & (h < HQ)[None, :]
            xb = bi[:, None] * sqb + si[:, None] * sqs + h[None, :] * sqh
            ob = bi[:, None] * sob + si[:, None] * sos + h[None, :] * soh
            ya, yb = _load_rotate(Q, xb, sqd, m2, cos, sin, HALF, BLOCK_HALF, IS_NEOX)
            _store_rot(QO, ob, sod, m2, round_to(ya, QO.dtype.element_ty),
                       round_to(yb, QO.dtype.element_ty), HALF, BLOCK_HALF, IS_NEOX)
            if COPY_PASS and PASS > 0:
                pi, pm = _pass_offsets(xb, sqd, m2, ROT, PASS, BLOCK_P)
                po, _pm = _pass_offsets(ob, sod, m2, ROT, PASS, BLOCK_P)
                tl.store(QO + po, tl.load(Q + pi, mask=pm), mask=pm)

        if APPEND:
            slot = tl.load(SLOT + t * s_slot, mask=tmask, other=-1).to(tl.int64)
            valid = tmask & (slot >= 0) & (slot < n_slots)
            slot = tl.where(valid, slot, 0)
            blk = slot // page_size
            row = slot - blk * page_size
        # k
        for h0 in range(0, HK, BLOCK_H):
            h = h0 + hr
            m2 = tmask[:, None] & (h < HK)[None, :]
            xb = bi[:, None] * skb + si[:, None] * sks + h[None, :] * skh
            ob = bi[:, None] * skob + si[:, None] * skos + h[None, :] * skoh
            ya, yb = _load_rotate(K, xb, skd, m2, cos, sin, HALF, BLOCK_HALF, IS_NEOX)
            _store_rot(KO, ob, skod, m2, round_to(ya, KO.dtype.element_ty),
                       round_to(yb, KO.dtype.element_ty), HALF, BLOCK_HALF, IS_NEOX)
            p = ya  # the pass-through part of k (PASS > 0) for the cache write
            if PASS > 0:
                pi, pm = _pass_offsets(xb, skd, m2, ROT, PASS, BLOCK_P)
                if COPY_PASS or APPEND:
                    p = tl.load(K + pi, mask=pm)
                if COPY_PASS:
                    po, _pm = _pass_offsets(ob, skod, m2, ROT, PASS, BLOCK_P)
                    tl.store(KO + po, p, mask=pm)
            if APPEND:
                _k_to_cache(ya, yb, p, h, m2, valid, blk, row, KC, KS, kcn, kcp, kch, kcd, ksn, ksp,
                            ksh, QUANT_K, ROT, PASS, HALF, BLOCK_HALF, BLOCK_P, IS_NEOX)
        # v: copied (or quantized) into its cache
        if APPEND:
            for h0 in range(0, HK, BLOCK_H):
                h = h0 + hr
                m2 = tmask[:, None] & (h < HK)[None, :]
                h64 = h.to(tl.int64)
                cm2 = m2 & valid[:, None]
                xb = bi[:, None] * svb + si[:, None] * svs + h[None, :] * svh
                vi, vm = _pass_offsets(xb, svd, cm2, 0, HEAD_DIM, BLOCK_D)
                x = tl.load(V + vi, mask=vm, other=0.0).to(tl.float32)
                _v_to_cache(x, h64, cm2, vm, blk, row, VC, VS, vcn, vcp, vch, vcd, vsn, vsp, vsh,
                            QUANT_V, HEAD_DIM, BLOCK_D)
