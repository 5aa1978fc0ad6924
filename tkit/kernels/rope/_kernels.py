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
    """
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
        if PASS > 0:
            pi, pm = _pass_offsets(xb, skd, m2, ROT, PASS, BLOCK_P)
            if COPY_PASS or APPEND:
                p = tl.load(K + pi, mask=pm)
            if COPY_PASS:
                po, _pm = _pass_offsets(ob, skod, m2, ROT, PASS, BLOCK_P)
                tl.store(KO + po, p, mask=pm)
        if APPEND:
            h64 = h.to(tl.int64)
            cm2 = m2 & valid[:, None]
            cb = blk[:, None] * kcn + row[:, None] * kcp + h64[None, :] * kch
            sc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
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
            cb = blk[:, None] * vcn + row[:, None] * vcp + h64[None, :] * vch
            sc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
            if QUANT_V != 0:
                soff = blk[:, None] * vsn + row[:, None] * vsp + h64[None, :] * vsh
                sc = _quant_scale(_absmax(x), QUANT_V, VS, soff, cm2)
            vc, _vcm = _pass_offsets(cb, vcd, cm2, 0, HEAD_DIM, BLOCK_D)
            tl.store(VC + vc, _to_cache(x, sc, VC, QUANT_V), mask=vm)


