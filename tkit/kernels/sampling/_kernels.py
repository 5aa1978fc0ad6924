"""Sampling's Triton code (``@triton.jit`` only): the order-preserving float keys, the Philox
uniforms and Gumbel noise, the threshold search over a row, and the sample and
speculative-acceptance kernels."""

from __future__ import annotations

import triton
import triton.language as tl

#: the int32 key below every float's key (key(-inf) = -2139095041)
KEY_MIN = tl.constexpr(-(2**31))
#: the int32 key above every float's key
KEY_MAX = tl.constexpr(2**31 - 1)
# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _key(v):
    """float32 -> int32 with the same order (negative floats: all bits but the sign flipped)."""
    b = v.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _val(k):
    """The inverse of :func:`_key`."""
    b = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _to_uniform(r):
    """uint32 -> float32 strictly inside (0, 1), 24 bits: ((r >> 9) + 0.5) * 2**-23, exact."""
    return ((r >> 9).to(tl.int32).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def _uniform(seed, stream, purpose, idx):
    """u for the elements ``idx`` (int32 >= 0): Philox counter (idx // 4, stream, purpose, 0),
    output word idx % 4. Gathers (candidates, single draws) use this form."""
    q = (idx >> 2).to(tl.uint32)
    zero = q * 0
    r0, r1, r2, r3 = tl.philox(seed, q, zero + stream, zero + purpose, zero)
    o = idx & 3
    r = tl.where(o == 0, r0, tl.where(o == 1, r1, tl.where(o == 2, r2, r3)))
    return _to_uniform(r)


@triton.jit
def _uniform_block(seed, stream, purpose, start, BLOCK: tl.constexpr):
    """u for the contiguous elements start .. start + BLOCK - 1 (start a multiple of 4): one
    Philox call per four elements, its words interleaved back into element order."""
    q = ((start >> 2) + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    zero = q * 0
    r0, r1, r2, r3 = tl.philox(seed, q, zero + stream, zero + purpose, zero)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])
    return _to_uniform(r)


@triton.jit
def _gumbel(u):
    return -tl.log(-tl.log(u))


@triton.jit
def _load_x(xrow, start, V, sxv, BLOCK: tl.constexpr):
    """The logits of elements start .. start + BLOCK - 1 as stored (-inf past V).

    The passes below load block i + 1 before they reduce block i: Triton does not pipeline
    these loops (their bodies end in block-wide reductions), so each block's load latency
    (HBM on the first pass, L2 after) was otherwise paid in full, in series, once a block."""
    cols = start + tl.arange(0, BLOCK)
    return tl.load(xrow + cols.to(tl.int64) * sxv, mask=cols < V, other=-float("inf"))


@triton.jit
def _z(x, start, inv_t, BLOCK: tl.constexpr):
    """(columns, z = x / T in float32) of a block loaded by _load_x."""
    return start + tl.arange(0, BLOCK), x.to(tl.float32) * inv_t


@triton.jit
def _max_pass(xrow, V, sxv, inv_t, BLOCK: tl.constexpr):
    """(max of z, index of its first occurrence)."""
    m = tl.full([], -float("inf"), tl.float32)
    am = tl.full([], 0, tl.int32)
    x_next = _load_x(xrow, 0, V, sxv, BLOCK)
    for start in range(0, V, BLOCK):
        cols, z = _z(x_next, start, inv_t, BLOCK)
        x_next = _load_x(xrow, start + BLOCK, V, sxv, BLOCK)
        bm = tl.max(z, axis=0)
        bi = tl.argmax(z, axis=0)
        am = tl.where(bm > m, start + bi, am)
        m = tl.maximum(m, bm)
    return m, am


@triton.jit
def _count_pass(xrow, V, sxv, inv_t, m, pk, MASS: tl.constexpr, NP: tl.constexpr,
                BLOCK: tl.constexpr):
    """Per pivot key: how many z have key >= it, and (MASS) the sum of their exp(z - m)."""
    cnt = tl.zeros([NP], tl.int32)
    mass = tl.zeros([NP], tl.float32)
    x_next = _load_x(xrow, 0, V, sxv, BLOCK)
    for start in range(0, V, BLOCK):
        cols, z = _z(x_next, start, inv_t, BLOCK)
        x_next = _load_x(xrow, start + BLOCK, V, sxv, BLOCK)
        ge = _key(z)[None, :] >= pk[:, None]
        cnt += tl.sum(ge.to(tl.int32), axis=1)
        if MASS:
            e = tl.exp(z - m)
            mass += tl.sum(tl.where(ge, e[None, :], 0.0), axis=1)
    return cnt, mass


@triton.jit
def _pivots(lo_key, hi_key, first, NP: tl.constexpr):
    """NP pivot keys of a search pass, evenly spaced in value strictly inside (lo_key,
    hi_key); on the first pass pivot 0 is lo_key itself (is the start valid at all?)."""
    j = tl.arange(0, NP)
    lo_v = _val(lo_key)
    hi_v = _val(hi_key)
    frac = tl.where(first, j.to(tl.float32) / NP, (j + 1).to(tl.float32) / (NP + 1))
    pk = _key(lo_v + (hi_v - lo_v) * frac)
    pk = tl.minimum(tl.maximum(pk, lo_key + 1), hi_key - 1)
    return tl.where(first & (j == 0), lo_key, pk)


@triton.jit
def _search(xrow, V, sxv, inv_t, m, lo_key, hi_key, kk, p, CAP, max_iters,
            MASS: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Narrow [lo_key, hi_key) around a threshold (see the module docstring).

    Count mode (top-k): valid(v) = count(z >= v) >= kk. Mass mode (top-p): valid(v) =
    mass(z >= v) >= p * mass(z >= lo at the start). The first pass puts pivot 0 at lo itself:
    in count mode an invalid lo means fewer than kk elements are >= lo (top-k keeps them all).
    Stops when count(z >= lo) <= CAP (compact), or when {z >= lo} is the exact kept set.
    Returns (lo_key, count(z >= lo), total mass at the start).
    """
    j = tl.arange(0, NP)
    cnt_lo = tl.full([], 0, tl.int32)
    cnt_hi = tl.full([], 0, tl.int32)
    total = tl.full([], 0.0, tl.float32)
    it = tl.full([], 0, tl.int32)
    go = it == 0
    while go:
        first = it == 0
        pk = _pivots(lo_key, hi_key, first, NP)
        cnt, mass = _count_pass(xrow, V, sxv, inv_t, m, pk, MASS, NP, BLOCK)
        if MASS:
            total = tl.where(first, tl.sum(tl.where(j == 0, mass, 0.0), axis=0), total)
            valid = mass >= p * total
        else:
            valid = cnt >= kk
        nv = tl.sum(valid.to(tl.int32), axis=0)
        cnt_lo = tl.where(first, tl.sum(tl.where(j == 0, cnt, 0), axis=0), cnt_lo)
        sel_lo = j == nv - 1
        sel_hi = j == nv
        lo_key = tl.where(nv > 0, tl.sum(tl.where(sel_lo, pk, 0), axis=0), lo_key)
        cnt_lo = tl.where(nv > 0, tl.sum(tl.where(sel_lo, cnt, 0), axis=0), cnt_lo)
        hi_key = tl.where(nv < NP, tl.sum(tl.where(sel_hi, pk, 0), axis=0), hi_key)
        cnt_hi = tl.where(nv < NP, tl.sum(tl.where(sel_hi, cnt, 0), axis=0), cnt_hi)
        if MASS:
            exact = cnt_lo - cnt_hi <= 1
        else:
            exact = cnt_lo == kk
        # (hi_key - lo_key can overflow int32 when lo < 0 < hi)
        exact = exact | (hi_key - 1 <= lo_key) | (first & (nv == 0))
        it += 1
        go = (cnt_lo > CAP) & (exact == 0) & (it < max_iters)
    return lo_key, cnt_lo, total


@triton.jit
def _compact_cols(xrow, c0, c1, sxv, inv_t, lo_key, CV, CI, CAP, BLOCK: tl.constexpr,
                  WITH_Z: tl.constexpr):
    """Write (z (WITH_Z), index) of every column c0 <= i < c1 with key >= lo_key, in index
    order, to the first CAP slots of CV/CI; returns how many there are (more than CAP: some
    unwritten)."""
    n = tl.full([], 0, tl.int32)
    x_next = _load_x(xrow, c0, c1, sxv, BLOCK)
    for start in range(c0, c1, BLOCK):
        cols, z = _z(x_next, start, inv_t, BLOCK)
        x_next = _load_x(xrow, start + BLOCK, c1, sxv, BLOCK)
        keep = _key(z) >= lo_key
        pos = n + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        ok = keep & (pos < CAP)
        if WITH_Z:
            tl.store(CV + pos, z, mask=ok)
        tl.store(CI + pos, cols, mask=ok)
        n += tl.sum(keep.to(tl.int32), axis=0)
    return n


@triton.jit
def _compact(xrow, V, sxv, inv_t, lo_key, CV, CI, CAP, BLOCK: tl.constexpr):
    """Write (z, index) of every element with key >= lo_key, in index order, to CV/CI."""
    return tl.minimum(_compact_cols(xrow, 0, V, sxv, inv_t, lo_key, CV, CI, CAP, BLOCK, True),
                      CAP)


@triton.jit
def _finish_candidates(CV, CI, n, m, kk, k_on, p, p_on, total_in, have_total, seed, stream,
                       CAP: tl.constexpr, JB: tl.constexpr):
    """Exact top-k / top-p over the n compacted candidates, then their Gumbel-max."""
    ii = tl.arange(0, CAP)
    ok = ii < n
    c = tl.load(CV + ii, mask=ok, other=-float("inf"))
    ci = tl.load(CI + ii, mask=ok, other=0)
    ck = _key(c)
    e = tl.exp(c - m)
    cntge = tl.zeros([CAP], tl.int32)
    massge = tl.zeros([CAP], tl.float32)
    for jb in range(0, n, JB):
        jj = jb + tl.arange(0, JB)
        okj = jj < n
        cj = tl.load(CV + jj, mask=okj, other=-float("inf"))
        ge = (_key(cj)[None, :] >= ck[:, None]) & okj[None, :]
        cntge += tl.sum(ge.to(tl.int32), axis=1)
        massge += tl.sum(tl.where(ge, tl.exp(cj - m)[None, :], 0.0), axis=1)
    tau_k = tl.max(tl.where(ok & (cntge >= kk), ck, KEY_MIN), axis=0)
    tau_k = tl.where(k_on, tau_k, KEY_MIN)
    in_k = ok & (ck >= tau_k)
    total = tl.where(have_total, total_in, tl.sum(tl.where(in_k, e, 0.0), axis=0))
    tau_p = tl.max(tl.where(in_k & (massge >= p * total), ck, KEY_MIN), axis=0)
    tau_p = tl.where(p_on, tau_p, KEY_MIN)
    keep = in_k & (ck >= tau_p)
    u = _uniform(seed, stream, 0, ci)
    score = tl.where(keep, c + _gumbel(u), -float("inf"))
    w = tl.argmax(score, axis=0)
    return tl.sum(tl.where(ii == w, ci, 0), axis=0)


@triton.jit
def _stream_final(xrow, V, sxv, inv_t, tau_key, fallback, seed, stream, BLOCK: tl.constexpr):
    """Gumbel-max over {z : key(z) >= tau_key} in one pass; blocks with none are skipped."""
    best = tl.full([], -float("inf"), tl.float32)
    tok = fallback
    x_next = _load_x(xrow, 0, V, sxv, BLOCK)
    for start in range(0, V, BLOCK):
        cols, z = _z(x_next, start, inv_t, BLOCK)
        x_next = _load_x(xrow, start + BLOCK, V, sxv, BLOCK)
        keep = _key(z) >= tau_key
        if tl.max(keep.to(tl.int32), axis=0) > 0:
            u = _uniform_block(seed, stream, 0, start, BLOCK)
            sc = tl.where(keep, z + _gumbel(u), -float("inf"))
            bm = tl.max(sc, axis=0)
            bi = tl.argmax(sc, axis=0)
            tok = tl.where(bm > best, start + bi, tok)
            best = tl.maximum(best, bm)
    return tok


@triton.jit
def _row_options(row, row64, T, K, P, MINP, SEEDS, V, st, sk, sp, smp, ss,
                 t_val, k_val, p_val, minp_val, seed_val,
                 T_MODE: tl.constexpr, K_MODE: tl.constexpr, P_MODE: tl.constexpr,
                 MINP_MODE: tl.constexpr, SEED_MODE: tl.constexpr):
    """A row's (temperature, top_k clamped to [0, V], top_p, min_p, seed, stream): per-row
    tensors (mode 2) or the scalars (mode 1); mode 0 = not given."""
    t = t_val
    if T_MODE == 2:
        t = tl.load(T + row64 * st).to(tl.float32)
    kk = tl.full([], 0, tl.int32)
    if K_MODE == 1:
        kk = tl.minimum(kk + k_val, V).to(tl.int32)
    if K_MODE == 2:
        kk = tl.minimum(tl.maximum(tl.load(K + row64 * sk), 0), V).to(tl.int32)
    p = p_val
    if P_MODE == 2:
        p = tl.load(P + row64 * sp).to(tl.float32)
    mp = minp_val
    if MINP_MODE == 2:
        mp = tl.load(MINP + row64 * smp).to(tl.float32)
    if SEED_MODE == 2:
        seed = tl.load(SEEDS + row64 * ss).to(tl.int64)
        stream = 0
    else:
        seed = tl.full([], 0, tl.int64) + seed_val
        stream = row
    return t, kk, p, mp, seed, stream


@triton.jit
def _inv_temperature(t):
    """(argmax row, 1 / T): T <= 0 rows are argmax and keep z = x."""
    greedy = t <= 0.0
    return greedy, tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))


@triton.jit
def _sample_row(xrow, row64, V, sxv, CV, CI, t, kk, p, mp, seed, stream, span, max_iters,
                K_MODE: tl.constexpr, P_MODE: tl.constexpr, MINP_MODE: tl.constexpr,
                BLOCK: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, JB: tl.constexpr):
    """The sampled token of one row by passes over it (module docstring, steps 1-4)."""
    k_on = (K_MODE > 0) & (kk > 0) & (kk < V)
    p_on = (P_MODE > 0) & (p < 1.0)
    mp_on = (MINP_MODE > 0) & (mp > 0.0)

    greedy, inv_t = _inv_temperature(t)
    m, am = _max_pass(xrow, V, sxv, inv_t, BLOCK)
    greedy = greedy | (k_on & (kk == 1)) | (m == -float("inf"))
    tok = am
    if greedy == 0:
        lo = _lower_bound(m, mp, mp_on, span, MINP_MODE)
        lo_key = _key(lo)
        hi_key = _key(m) + 1
        cnt_lo = tl.full([], CAP + 1, tl.int32)
        total = tl.full([], 0.0, tl.float32)
        have_total = cnt_lo < 0
        searched = have_total
        if K_MODE > 0:
            if k_on:
                lo_key, cnt_lo, total = _search(xrow, V, sxv, inv_t, m, lo_key, hi_key, kk, p,
                                                CAP, max_iters, False, NP, BLOCK)
                searched = cnt_lo >= 0
        if P_MODE > 0:
            if p_on & (cnt_lo > CAP):
                lo_key, cnt_lo, total = _search(xrow, V, sxv, inv_t, m, lo_key, hi_key, kk, p,
                                                CAP, max_iters, True, NP, BLOCK)
                have_total = cnt_lo >= 0
                searched = have_total
        if searched & (cnt_lo <= CAP):
            cv = CV + row64 * CAP
            ci = CI + row64 * CAP
            n = _compact(xrow, V, sxv, inv_t, lo_key, cv, ci, CAP, BLOCK)
            tl.debug_barrier()
            tok = _finish_candidates(cv, ci, n, m, kk, k_on, p, p_on, total, have_total, seed,
                                     stream, CAP, JB)
        else:
            tok = _stream_final(xrow, V, sxv, inv_t, lo_key, am, seed, stream, BLOCK)
    return tok


@triton.jit
def _lower_bound(m, mp, mp_on, span, MINP_MODE: tl.constexpr):
    """The least z any filter may keep: max(m - span, m + log(min_p))."""
    lo = m - span
    if MINP_MODE > 0:
        lo = tl.where(mp_on, tl.maximum(lo, m + tl.log(tl.where(mp_on, mp, 1.0))), lo)
    return lo


@triton.jit
def _sample_kernel(
    X, OUT, T, K, P, MINP, SEEDS, CV, CI,
    V, sxb, sxv, st, sk, sp, smp, ss,
    t_val, k_val, p_val, minp_val, seed_val, span, max_iters,
    T_MODE: tl.constexpr, K_MODE: tl.constexpr, P_MODE: tl.constexpr,
    MINP_MODE: tl.constexpr, SEED_MODE: tl.constexpr,
    BLOCK: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, JB: tl.constexpr,
):
    """One program a row: OUT[row] = the sampled token id (int64).

    X: logits (B, V), strides sxb / sxv. T, K, P, MINP: per-row options (mode 2, strides
    st/sk/sp/smp) or the scalars t_val, k_val, p_val, minp_val (mode 1); mode 0 = not given
    (compiled out). SEEDS: per-row int64 seeds (SEED_MODE 2, stream 0) or seed_val (SEED_MODE
    1, stream = row). CV, CI: (B, CAP) float32 / int32 scratch for the compacted candidates.
    """
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    xrow = X + row64 * sxb
    t, kk, p, mp, seed, stream = _row_options(row, row64, T, K, P, MINP, SEEDS, V, st, sk, sp,
                                              smp, ss, t_val, k_val, p_val, minp_val,
                                              seed_val, T_MODE, K_MODE, P_MODE, MINP_MODE,
                                              SEED_MODE)
    tok = _sample_row(xrow, row64, V, sxv, CV, CI, t, kk, p, mp, seed, stream, span,
                      max_iters, K_MODE, P_MODE, MINP_MODE, BLOCK, NP, CAP, JB)
    tl.store(OUT + row64, tok.to(tl.int64))


# --------------------------------------------------------------------------------------------
# Split rows (top-k <= CAP): chunk programs, then one merge program a row
# --------------------------------------------------------------------------------------------
@triton.jit
def _count_ge(key, pk, NP: tl.constexpr):
    """count(key >= pk[j]) for each of the NP pivots, over a 1-D block of at most 65535 keys.

    A [NP, N] comparison tile would be held whole in registers (N * NP / threads each): one
    1-D sum per pair of pivots instead, the pair's two counts packed in the 16-bit halves of
    an int32 (neither half carries: each count is <= N)."""
    j = tl.arange(0, NP)
    cnt = tl.zeros([NP], tl.int32)
    for jj in tl.static_range(0, NP, 2):
        pa = tl.sum(tl.where(j == jj, pk, 0), axis=0)
        pb = tl.sum(tl.where(j == jj + 1, pk, 0), axis=0)
        s = tl.sum((key >= pa).to(tl.int32) + ((key >= pb).to(tl.int32) << 16), axis=0)
        cnt = tl.where(j == jj, s & 0xFFFF, tl.where(j == jj + 1, (s >> 16) & 0xFFFF, cnt))
    return cnt


@triton.jit
def _search_keys(key, lo_key, hi_key, kk, floor, CAP, max_iters, NP: tl.constexpr):
    """:func:`_search` in count mode over keys held in registers (no pass re-reads memory):
    narrow lo_key until count(key >= lo_key) <= CAP and lo_key >= floor, or until
    {key >= lo_key} is exactly the top kk (count == kk, ties: lo and hi adjacent keys), lo
    staying valid (count >= kk; an invalid first pivot at lo itself means fewer than kk keys
    are >= lo: all are kept). Returns (lo_key, count(key >= lo_key))."""
    j = tl.arange(0, NP)
    cnt_lo = tl.full([], 0, tl.int32)
    it = tl.full([], 0, tl.int32)
    go = it == 0
    while go:
        first = it == 0
        pk = _pivots(lo_key, hi_key, first, NP)
        cnt = _count_ge(key, pk, NP)
        valid = cnt >= kk
        nv = tl.sum(valid.to(tl.int32), axis=0)
        cnt_lo = tl.where(first, tl.sum(tl.where(j == 0, cnt, 0), axis=0), cnt_lo)
        sel_lo = j == nv - 1
        lo_key = tl.where(nv > 0, tl.sum(tl.where(sel_lo, pk, 0), axis=0), lo_key)
        cnt_lo = tl.where(nv > 0, tl.sum(tl.where(sel_lo, cnt, 0), axis=0), cnt_lo)
        hi_key = tl.where(nv < NP, tl.sum(tl.where(j == nv, pk, 0), axis=0), hi_key)
        # (hi_key - lo_key can overflow int32 when lo < 0 < hi)
        exact = (cnt_lo == kk) | (hi_key - 1 <= lo_key) | (first & (nv == 0))
        it += 1
        go = ((cnt_lo > CAP) | (lo_key < floor)) & (exact == 0) & (it < max_iters)
    return lo_key, cnt_lo


@triton.jit
def _chunk_kernel(
    X, T, CC, CS,
    V, NCH, sxb, sxv, st, t_val, k_val, span, max_iters,
    T_MODE: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, NP: tl.constexpr,
    CAP: tl.constexpr,
):
    """Program (row, c) = pid // NCH, pid % NCH: columns c * CHUNK .. + CHUNK - 1 of a row,
    loaded once. Writes the chunk's candidates for the row's top k_val (2 <= k_val <= CAP)
    and its statistics.

    Candidates: with t = the chunk's own threshold (:func:`_search_keys` from
    max(z_chunk) - span; valid: at least k_val of the chunk's z are >= t, or t is that lower
    bound and fewer are), every z >= t, in column order: every element of the row's top k is
    >= its chunk's k-th largest, hence here. Ties can leave more than CAP elements >= t (t is
    then the chunk's k-th largest and fewer than k_val are above it): the chunk writes the
    ones > t and reports g = t + 1 (every key >= g is written; KEY_MAX: not even those fit,
    only after max_iters). Otherwise g = KEY_MIN.

    CC (B, NCH, CAP) int32: the candidates' columns (the merge gathers their logits back);
    CS (B, NCH, 4) int32: the chunk's max(z) (float32 bits), its first argmax column, the
    candidates written, g. Argmax rows (T <= 0) write only the statistics.
    """
    pid = tl.program_id(0)
    row = pid // NCH
    c = pid - row * NCH
    row64 = row.to(tl.int64)
    t = t_val
    if T_MODE == 2:
        t = tl.load(T + row64 * st).to(tl.float32)
    greedy, inv_t = _inv_temperature(t)
    start = c * CHUNK
    xrow = X + row64 * sxb
    z = _load_x(xrow, start, V, sxv, CHUNK).to(tl.float32) * inv_t
    mc = tl.max(z, axis=0)
    ac = start + tl.argmax(z, axis=0)
    n = tl.full([], 0, tl.int32)
    g = tl.full([], KEY_MIN, tl.int32)
    if (greedy == 0) & (mc > -float("inf")) & (k_val > 1):
        lo_key, cnt = _search_keys(_key(z), _key(mc - span), _key(mc) + 1, k_val, KEY_MIN,
                                   CAP, max_iters, NP)
        # ties: the keys above the tie only (fewer than k_val) and g = their threshold
        over = cnt > CAP
        thr = tl.where(over, lo_key + 1, lo_key)
        # the chunk again (from L1 / L2) in SUB-column steps: a whole chunk of scattered
        # stores holds a 64-bit address per element and column in registers
        base = (row64 * NCH + c) * CAP
        n = _compact_cols(xrow, start, tl.minimum(start + CHUNK, V), sxv, inv_t, thr,
                          CC + base, CC + base, CAP, SUB, False)
        g = tl.where(over, tl.where(n <= CAP, thr, KEY_MAX), KEY_MIN)
        n = tl.minimum(n, CAP)
    f = tl.arange(0, 4)
    stat = tl.where(f == 0, mc.to(tl.int32, bitcast=True),
                    tl.where(f == 1, ac, tl.where(f == 2, n, g)))
    tl.store(CS + (row64 * NCH + c) * 4 + f, stat)


@triton.jit
def _merge_kernel(
    X, OUT, T, K, P, MINP, SEEDS, CV, CI, CC, CS,
    V, NCH, sxb, sxv, st, sk, sp, smp, ss,
    t_val, k_val, p_val, minp_val, seed_val, span, max_iters,
    T_MODE: tl.constexpr, K_MODE: tl.constexpr, P_MODE: tl.constexpr,
    MINP_MODE: tl.constexpr, SEED_MODE: tl.constexpr,
    BLOCK: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, JB: tl.constexpr,
    NCHP: tl.constexpr,
):
    """One program a row after :func:`_chunk_kernel`: OUT[row] = the token _sample_kernel
    draws (arguments as there; CC, CS the chunks' output, NCHP = NCH rounded up to a power
    of 2).

    m and its first column from the chunks' statistics (argmax rows end here). The chunks'
    candidates M, in column order, go through :func:`_search_keys` from the row's lower
    bound (span, min-p): when it stops at lo with count(M >= lo) <= CAP and every chunk
    complete above lo (g <= lo), M holds every z >= lo of the row, and lo <= the row's top-k
    threshold (lo is valid on a subset of the row). Those candidates, compacted to CV / CI in
    column order, get the same :func:`_finish_candidates` as in _sample_kernel: the same kept
    set, the same noise, the same token. Otherwise (more than CAP tokens tied at the k-th
    value, or a chunk's ties at or above lo) the row runs _sample_kernel's passes."""
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    xrow = X + row64 * sxb
    t, kk, p, mp, seed, stream = _row_options(row, row64, T, K, P, MINP, SEEDS, V, st, sk, sp,
                                              smp, ss, t_val, k_val, p_val, minp_val,
                                              seed_val, T_MODE, K_MODE, P_MODE, MINP_MODE,
                                              SEED_MODE)
    ch = tl.arange(0, NCHP)
    okc = ch < NCH
    srow = CS + row64 * NCH * 4
    mc = tl.load(srow + ch * 4, mask=okc, other=0).to(tl.float32, bitcast=True)
    mc = tl.where(okc, mc, -float("inf"))
    ac = tl.load(srow + ch * 4 + 1, mask=okc, other=0)
    g = tl.max(tl.load(srow + ch * 4 + 3, mask=okc, other=KEY_MIN), axis=0)
    m = tl.max(mc, axis=0)
    # the first column holding the row's max (0 in an all -inf row, as _max_pass)
    am = tl.min(tl.where(mc == m, ac, V), axis=0)
    am = tl.where(m == -float("inf"), 0, am)
    greedy, inv_t = _inv_temperature(t)
    k_on = (kk > 0) & (kk < V)
    greedy = greedy | (k_on & (kk == 1)) | (m == -float("inf"))
    tok = am
    if greedy == 0:
        p_on = (P_MODE > 0) & (p < 1.0)
        mp_on = (MINP_MODE > 0) & (mp > 0.0)
        lo_key = _key(_lower_bound(m, mp, mp_on, span, MINP_MODE))
        idx = tl.arange(0, NCHP * CAP)
        cidx = idx // CAP
        nc = tl.load(srow + cidx * 4 + 2, mask=cidx < NCH, other=0)
        ok = (cidx < NCH) & (idx - cidx * CAP < nc)
        crow = row64 * NCH * CAP
        cols = tl.load(CC + crow + idx, mask=ok, other=0)
        # z as the chunk computed it, gathered back from the logits (in L2 by now)
        x = tl.load(xrow + cols.to(tl.int64) * sxv, mask=ok, other=-float("inf"))
        z = x.to(tl.float32) * inv_t
        key = _key(z)
        lo_key, cnt = _search_keys(key, lo_key, _key(m) + 1, kk, g, CAP, max_iters, NP)
        if (cnt <= CAP) & (g <= lo_key):
            keep = ok & (key >= lo_key)
            pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
            cv = CV + row64 * CAP
            ci = CI + row64 * CAP
            tl.store(cv + pos, z, mask=keep)
            tl.store(ci + pos, cols, mask=keep)
            tl.debug_barrier()
            total = tl.full([], 0.0, tl.float32)
            tok = _finish_candidates(cv, ci, cnt, m, kk, k_on, p, p_on, total, total < 0.0,
                                     seed, stream, CAP, JB)
        else:
            tok = _sample_row(xrow, row64, V, sxv, CV, CI, t, kk, p, mp, seed, stream, span,
                              max_iters, K_MODE, P_MODE, MINP_MODE, BLOCK, NP, CAP, JB)
    tl.store(OUT + row64, tok.to(tl.int64))


@triton.jit
def _load_probs(tp_row, dp_row, start, j, K, V, stpv, sdpv, BLOCK: tl.constexpr):
    """Target and draft probabilities of elements start .. start + BLOCK - 1 (0 past V; the
    draft's 0 when j = K, every draft token accepted)."""
    cols = start + tl.arange(0, BLOCK)
    cm = cols < V
    c64 = cols.to(tl.int64)
    q_t = tl.load(tp_row + c64 * stpv, mask=cm, other=0.0)
    # the scalar condition broadcast by a comparison: triton 3.9's interpreter makes an int32
    # mask of a block & scalar and refuses it
    q_d = tl.load(dp_row + c64 * sdpv, mask=cm & (cols * 0 + j < K), other=0.0)
    return q_t, q_d


@triton.jit
def _spec_accept_kernel(
    DT, DP, TP, OUT, NACC, SEEDS,
    K, V, sdtb, sdtk, sdpb, sdpk, sdpv, stpb, stpk, stpv, sob, sok, ss, seed_val,
    SEED_MODE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program a row: chain rejection sampling (see the module docstring).

    DT: draft ids (B, K); DP: draft probs (B, K, V); TP: target probs (B, K + 1, V) (strides
    named by dimension). OUT: (B, K + 1) int64, -1 after the last token; NACC: (B,) int32.
    """
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    if SEED_MODE == 2:
        seed = tl.load(SEEDS + row64 * ss).to(tl.int64)
        stream = 0
    else:
        seed = tl.full([], 0, tl.int64) + seed_val
        stream = row
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    tok = tl.load(DT + row64 * sdtb + ks * sdtk, mask=kmask, other=0)
    tok = tl.minimum(tl.maximum(tok, 0), V - 1).to(tl.int64)  # memory safety; checked on host
    pd = tl.load(DP + row64 * sdpb + ks * sdpk + tok * sdpv, mask=kmask, other=1.0)
    pt = tl.load(TP + row64 * stpb + ks * stpk + tok * stpv, mask=kmask, other=0.0)
    pd = pd.to(tl.float32)
    pt = pt.to(tl.float32)
    u = _uniform(seed, stream, 1, ks)
    accept = (pt >= pd) | (u * pd < pt)
    j = tl.min(tl.where(kmask & (accept == 0), ks, K), axis=0)  # first rejection, K if none
    j64 = j.to(tl.int64)
    tp_row = TP + row64 * stpb + j64 * stpk
    dp_row = DP + row64 * sdpb + tl.minimum(j64, K - 1) * sdpk
    best_r = tl.full([], 0.0, tl.float32)
    tok_r = tl.full([], 0, tl.int32)
    best_t = tl.full([], 0.0, tl.float32)
    tok_t = tl.full([], 0, tl.int32)
    # block i + 1's probabilities are loaded before block i is reduced (as in _load_x)
    qt_next, qd_next = _load_probs(tp_row, dp_row, 0, j, K, V, stpv, sdpv, BLOCK)
    for start in range(0, V, BLOCK):
        q_t = qt_next.to(tl.float32)
        q_d = qd_next.to(tl.float32)
        qt_next, qd_next = _load_probs(tp_row, dp_row, start + BLOCK, j, K, V, stpv, sdpv,
                                       BLOCK)
        q_r = tl.maximum(q_t - q_d, 0.0)
        inv_e = 1.0 / -tl.log(_uniform_block(seed, stream, 2 + j, start, BLOCK))
        s_r = q_r * inv_e
        s_t = q_t * inv_e
        bm = tl.max(s_r, axis=0)
        tok_r = tl.where(bm > best_r, start + tl.argmax(s_r, axis=0), tok_r)
        best_r = tl.maximum(best_r, bm)
        bm = tl.max(s_t, axis=0)
        tok_t = tl.where(bm > best_t, start + tl.argmax(s_t, axis=0), tok_t)
        best_t = tl.maximum(best_t, bm)
    new = tl.where(best_r > 0.0, tok_r, tok_t).to(tl.int64)
    pos = tl.arange(0, BLOCK_K)
    out = tl.where(pos < j, tl.load(DT + row64 * sdtb + pos * sdtk, mask=pos < j, other=0),
                   tl.where(pos == j, new, -1))
    tl.store(OUT + row64 * sob + pos * sok, out.to(tl.int64), mask=pos < K + 1)
    tl.store(NACC + row64, j)


