"""Token sampling from logits (temperature, min-p, top-k, top-p) and speculative-decoding
acceptance, without sorting, without host syncs, reproducible from per-row seeds.

Math of :func:`sample`, per row of logits x (length V), in this order (vLLM v1's: min-p is a
logits processor applied before top-k and top-p; each filter renormalizes):

    z = x / T                                  T <= 0 (or top_k == 1): the row is argmax(x)
    min-p   keep z_i >= max(z) + log(min_p)    (p_i >= min_p * p_max; scale-free)
    top-k   of what min-p kept, keep z_i >= the k-th largest of them
    top-p   of what top-k kept (mass renormalized), keep z_i >= tau_p, the largest value v with
            sum_{kept j, z_j >= v} exp(z_j) >= top_p * sum_{kept j} exp(z_j)
    token   argmax over the kept i of z_i + g_i,  g_i = -log(-log(u_i))   (Gumbel-max)

Every filter is a threshold on z, so the kept set is {i : z_i >= tau} for one tau, and ties at
a threshold are all kept (sort-based samplers keep an arbitrary subset of them). Disabled per
row: top_k <= 0 or >= V, top_p >= 1, min_p <= 0. Tokens below max(z) - SPAN (40) are never
kept: the Gumbel noise spans less than 20, so they can never win the argmax, and their share
of any top-p mass is below V * exp(-40), far under float32 rounding.

Randomness: u_i comes from Philox-4x32-10 (``tl.philox``, counter-based) keyed by the row's
seed, with counter (i // 4, stream, purpose, 0) and output word i % 4, as a 24-bit uniform
strictly inside (0, 1): ``u = ((r >> 9) + 0.5) * 2**-23``. Nothing depends on the launch
configuration (block sizes, pivots, paths), so the same seed gives the same token, and
:func:`philox_uniform` (torch, int64 arithmetic) reproduces every u: the spec's reference
draws the same noise and must give the same ids. A scalar seed uses stream = row; a per-row
seed tensor uses stream 0 (a request keeps its draws wherever it sits in the batch).

Algorithm (one program per row, passes over the row; after the first read the 33 MB of a
128 x 128256 bf16 batch sit in the H200's 60 MB L2):

1. Pass 1: max of z and its first index (the argmax rows are done).
2. Threshold search, no sort: keys of float32 values as order-preserving int32
   (``_key``). ``lo`` is a valid lower bound of the final threshold, ``hi`` an upper one; each
   pass counts (and, for top-p, sums exp(z - max) over) the elements above ``PIVOTS`` pivots
   spread evenly in value over (lo, hi), clamped to distinct keys, and moves lo/hi to the
   nearest valid/invalid pivot: the interval shrinks (PIVOTS + 1)-fold a pass in value and
   never stalls in keys. Top-k runs on counts (valid: count >= k), then top-p on masses
   (valid: mass >= top_p * mass at its start, measured by the first pass's pivot at lo).
   FlashInfer's sorting-free samplers search pivots the same way (theirs by rejection).
3. As soon as at most ``CAP`` elements are >= lo, one pass compacts them (value, index) into a
   per-row scratch row (``cumsum`` of the mask gives each its slot) and the rest is exact in
   registers: k-th largest from pairwise counts, the top-p threshold from pairwise masses,
   then Gumbel-max over the kept candidates. With top_k = 50 and CAP = 256 this happens after
   a few passes whatever the distribution; top-p alone on a flat distribution may keep more
   than CAP tokens: the search then runs to the exact threshold (it stops when lo and hi
   bracket one element, or are adjacent keys) and a last streaming pass takes the Gumbel-max
   over {z >= tau}, skipping blocks with no kept token.
4. Temperature / min-p alone need no search: pass 1, then the streaming Gumbel-max pass (one
   Philox call gives four tokens' noise).

Speculative acceptance (:func:`speculative_accept`), per row with draft tokens t_0..t_{k-1}:
accept t_i while u_i < p_target(t_i) / p_draft(t_i) (always when p_target >= p_draft); at the
first rejection j draw from normalize(max(0, p_target[j] - p_draft[j])) (the target row j if
that is all zero, which rounding alone can cause); if all k are accepted draw a bonus token
from p_target[k]. Draws from a probability row use the exponential race argmax_i q_i / E_i,
E_i = -log(u_i) (Gumbel-max on log q without the log). The output distribution is the
target's (Leviathan et al. 2023, Chen et al. 2023). One program per row: the k acceptance
tests are gathers, then one pass over the row j (residual, or bonus).

Cost model: sample reads the logits once from HBM (B * V * itemsize bytes, 32.8 MB at
128 x 128256 bf16: 8 us at 4 TB/s); the search passes re-read from L2; speculative_accept
reads two probability rows (draft and target) per sequence plus the gathers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env
from tkit.kernels import _common as C

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SEED_DTYPES = (torch.int64, torch.int32)
#: the int32 key below every float's key (key(-inf) = -2139095041)
KEY_MIN = tl.constexpr(-(2**31))
#: Philox stream purposes: sample's noise, speculative acceptance tests, speculative resampling
PURPOSE_SAMPLE, PURPOSE_ACCEPT, PURPOSE_RESAMPLE = 0, 1, 2


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SampleConfig:
    """Launch parameters of the sampling kernels (none changes a result).

    block: elements of a row per loop step (a power of 2 >= 16).
    num_warps: of the one-program-per-row kernels.
    pivots: pivots per search pass (a power of 2): more cut passes, cost compares.
    cap: candidates compacted for the exact in-register finish (a power of 2 >= 16).
    cap_chunk: columns of the pairwise [cap, cap_chunk] comparisons.
    span: z below max(z) - span is never kept (see the module docstring).
    max_iters: bound on search passes (the key interval closes within ~32 / log2(pivots+1)).
    """

    block: int = 4096
    num_warps: int = 16
    pivots: int = 4
    cap: int = 256
    cap_chunk: int = 32
    span: float = 40.0
    max_iters: int = 48

    @classmethod
    def for_device(cls, vocab: int) -> SampleConfig:
        """Defaults, not measured yet (no GPU run of these kernels so far): 4096-element steps
        over 16 warps (8 values a thread: 16-byte loads of bf16 in flight, the [4, 4096]
        pivot compares at 32 a thread), CAP 256 (top_k = 50 with room for the search to stop
        early). The interpreter pays per program and per step, tests want several blocks and
        both finishes on small vocabularies: 16-element steps, CAP 16."""
        if _env.INTERPRET:
            return cls(block=16, num_warps=4, cap=16, cap_chunk=16)
        return cls()


_OVERRIDES = C.ConfigOverrides(SampleConfig)


def sample_config(**overrides):
    """Override fields of :class:`SampleConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(vocab: int) -> SampleConfig:
    cfg = SampleConfig.for_device(vocab)
    cfg = _OVERRIDES.apply(cfg)
    for name in ("block", "pivots", "cap", "cap_chunk"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"SampleConfig.{name} must be a power of 2, got {v}")
    if cfg.block < 4:
        raise ValueError(f"SampleConfig.block must be >= 4, got {cfg.block}")
    return cfg


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
def _load_z(xrow, start, V, sxv, inv_t, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    x = tl.load(xrow + cols.to(tl.int64) * sxv, mask=cols < V, other=-float("inf"))
    return cols, x.to(tl.float32) * inv_t


@triton.jit
def _max_pass(xrow, V, sxv, inv_t, BLOCK: tl.constexpr):
    """(max of z, index of its first occurrence)."""
    m = tl.full([], -float("inf"), tl.float32)
    am = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols, z = _load_z(xrow, start, V, sxv, inv_t, BLOCK)
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
    for start in range(0, V, BLOCK):
        cols, z = _load_z(xrow, start, V, sxv, inv_t, BLOCK)
        ge = _key(z)[None, :] >= pk[:, None]
        cnt += tl.sum(ge.to(tl.int32), axis=1)
        if MASS:
            e = tl.exp(z - m)
            mass += tl.sum(tl.where(ge, e[None, :], 0.0), axis=1)
    return cnt, mass


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
        lo_v = _val(lo_key)
        hi_v = _val(hi_key)
        frac = tl.where(first, j.to(tl.float32) / NP, (j + 1).to(tl.float32) / (NP + 1))
        pk = _key(lo_v + (hi_v - lo_v) * frac)
        pk = tl.minimum(tl.maximum(pk, lo_key + 1), hi_key - 1)
        pk = tl.where(first & (j == 0), lo_key, pk)
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
def _compact(xrow, V, sxv, inv_t, lo_key, CV, CI, CAP, BLOCK: tl.constexpr):
    """Write (z, index) of every element with key >= lo_key, in index order, to CV/CI."""
    n = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols, z = _load_z(xrow, start, V, sxv, inv_t, BLOCK)
        keep = _key(z) >= lo_key
        pos = n + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        ok = keep & (pos < CAP)
        tl.store(CV + pos, z, mask=ok)
        tl.store(CI + pos, cols, mask=ok)
        n += tl.sum(keep.to(tl.int32), axis=0)
    return tl.minimum(n, CAP)


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
    for start in range(0, V, BLOCK):
        cols, z = _load_z(xrow, start, V, sxv, inv_t, BLOCK)
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
    k_on = (K_MODE > 0) & (kk > 0) & (kk < V)
    p_on = (P_MODE > 0) & (p < 1.0)
    mp_on = (MINP_MODE > 0) & (mp > 0.0)

    greedy = t <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    m, am = _max_pass(xrow, V, sxv, inv_t, BLOCK)
    greedy = greedy | (k_on & (kk == 1)) | (m == -float("inf"))
    tok = am
    if greedy == 0:
        lo = m - span
        if MINP_MODE > 0:
            lo = tl.where(mp_on, tl.maximum(lo, m + tl.log(tl.where(mp_on, mp, 1.0))), lo)
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
    tl.store(OUT + row64, tok.to(tl.int64))


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
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cm = cols < V
        c64 = cols.to(tl.int64)
        q_t = tl.load(tp_row + c64 * stpv, mask=cm, other=0.0).to(tl.float32)
        # the scalar condition broadcast by a comparison: triton 3.9's interpreter makes an
        # int32 mask of a block & scalar and refuses it
        q_d = tl.load(dp_row + c64 * sdpv, mask=cm & (cols * 0 + j < K),
                      other=0.0).to(tl.float32)
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


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _mode(x) -> int:
    return 0 if x is None else (2 if isinstance(x, torch.Tensor) else 1)


def _sample_impl(logits, temperature, top_k, top_p, min_p, seeds, t_val, k_val, p_val,
                 minp_val, seed_val) -> torch.Tensor:
    b, v = logits.shape
    out = C.empty((b,), torch.int64, logits.device)
    if b == 0:
        return out
    cfg = current_config(v)
    cv = torch.empty((b, cfg.cap), dtype=torch.float32, device=logits.device)
    ci = torch.empty((b, cfg.cap), dtype=torch.int32, device=logits.device)
    dummy = logits

    def ptr(t):
        return t if t is not None else dummy

    def stride(t):
        return t.stride(0) if t is not None else 0

    C.launch(_sample_kernel, (b,), X=logits, OUT=out, T=ptr(temperature), K=ptr(top_k),
             P=ptr(top_p), MINP=ptr(min_p), SEEDS=ptr(seeds), CV=cv, CI=ci, V=v,
             sxb=logits.stride(0), sxv=logits.stride(1), st=stride(temperature),
             sk=stride(top_k), sp=stride(top_p), smp=stride(min_p), ss=stride(seeds),
             t_val=t_val, k_val=k_val, p_val=p_val, minp_val=minp_val, seed_val=seed_val,
             span=cfg.span, max_iters=cfg.max_iters,
             T_MODE=2 if temperature is not None else 1,
             K_MODE=2 if top_k is not None else (1 if k_val >= 0 else 0),
             P_MODE=2 if top_p is not None else (1 if p_val >= 0 else 0),
             MINP_MODE=2 if min_p is not None else (1 if minp_val >= 0 else 0),
             SEED_MODE=2 if seeds is not None else 1,
             BLOCK=cfg.block, NP=cfg.pivots, CAP=cfg.cap, JB=min(cfg.cap_chunk, cfg.cap),
             num_warps=cfg.num_warps)
    return out


def _spec_impl(draft_token_ids, draft_probs, target_probs, seeds, seed_val):
    b, k = draft_token_ids.shape
    v = draft_probs.shape[-1]
    dev = draft_probs.device
    ids = C.empty((b, k + 1), torch.int64, dev)
    nacc = C.empty((b,), torch.int32, dev)
    if b == 0:
        return ids, nacc
    cfg = current_config(v)
    C.launch(_spec_accept_kernel, (b,), DT=draft_token_ids, DP=draft_probs, TP=target_probs,
             OUT=ids, NACC=nacc, SEEDS=seeds if seeds is not None else draft_probs, K=k, V=v,
             sdtb=draft_token_ids.stride(0), sdtk=draft_token_ids.stride(1),
             sdpb=draft_probs.stride(0), sdpk=draft_probs.stride(1),
             sdpv=draft_probs.stride(2), stpb=target_probs.stride(0),
             stpk=target_probs.stride(1), stpv=target_probs.stride(2), sob=ids.stride(0),
             sok=ids.stride(1), ss=seeds.stride(0) if seeds is not None else 0,
             seed_val=seed_val, SEED_MODE=2 if seeds is not None else 1,
             BLOCK_K=max(2, C.next_power_of_2(k + 1)), BLOCK=cfg.block,
             num_warps=min(cfg.num_warps, 8))
    return ids, nacc


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("tkit::sample", mutates_args=())
def _sample_op(logits: torch.Tensor, temperature: Optional[torch.Tensor],  # noqa: UP045
               top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],  # noqa: UP045
               min_p: Optional[torch.Tensor], seeds: Optional[torch.Tensor],  # noqa: UP045
               t_val: float, k_val: int, p_val: float, minp_val: float,
               seed_val: int) -> torch.Tensor:
    return _sample_impl(logits, temperature, top_k, top_p, min_p, seeds, t_val, k_val, p_val,
                        minp_val, seed_val)


@_sample_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, t_val, k_val, p_val, minp_val,
      seed_val):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op("tkit::speculative_accept", mutates_args=())
def _spec_op(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor,
             target_probs: torch.Tensor, seeds: Optional[torch.Tensor],  # noqa: UP045
             seed_val: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _spec_impl(draft_token_ids, draft_probs, target_probs, seeds, seed_val)


@_spec_op.register_fake
def _(draft_token_ids, draft_probs, target_probs, seeds, seed_val):
    b, k = draft_token_ids.shape
    return (draft_probs.new_empty((b, k + 1), dtype=torch.int64),
            draft_probs.new_empty((b,), dtype=torch.int32))


# --------------------------------------------------------------------------------------------
# Validation and public API
# --------------------------------------------------------------------------------------------
def _values_checked(t: torch.Tensor) -> bool:
    from tkit.kernels import _offsets

    return _offsets.values_checked(t)


def _option(x, name, batch, device, dtypes, kind):
    """(tensor or None, scalar) for one per-row option; the scalar is -1 when not given
    (the kernel compiles the option out) and ignored when a tensor is given."""
    if x is None:
        return None, -1
    if isinstance(x, torch.Tensor):
        C.check_tensor(x, name, dtypes, ndim=1)
        C.check_same_device(logits=device, **{name: x})
        if x.shape[0] != batch:
            raise ValueError(f"{name} must have one value per row ({batch}), got shape "
                             f"{tuple(x.shape)}")
        return x, 0
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a {kind}, a ({batch},) tensor or None, got "
                        f"{type(x).__name__}")
    if kind == "int" and not isinstance(x, int):
        raise TypeError(f"{name} must be an int (or a ({batch},) integer tensor), got {x!r}")
    return None, x


def _seeds(seed, batch, logits, like="logits"):
    """(per-row seed tensor or None, scalar seed); ``logits`` gives the device (named
    ``like`` in errors)."""
    if seed is None:
        # per-row seeds from torch's generator on the device: no sync, capturable in a graph
        gen = torch.randint(0, 2**62, (batch,), dtype=torch.int64, device=logits.device)
        return gen, 0
    if isinstance(seed, torch.Tensor):
        C.check_tensor(seed, "seed", SEED_DTYPES, ndim=1)
        C.check_same_device(**{like: logits}, seed=seed)
        if seed.shape[0] != batch:
            raise ValueError(f"seed must be an int or have one value per row ({batch}), got "
                             f"shape {tuple(seed.shape)}")
        return seed, 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, a ({batch},) int64 tensor or None, got "
                        f"{type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return None, seed


def sample(logits, *, temperature=None, top_k=None, top_p=None, min_p=None, seed=None):
    """Sample one token id per row of ``logits``; see the module docstring for the math.

    Parameters
    ----------
    logits : Tensor (batch, vocab), float32, float16 or bfloat16, any strides.
    temperature : float or Tensor (batch,), optional
        z = logits / temperature; 0 (or <= 0 in a tensor) means argmax. Default 1.
    top_k : int or integer Tensor (batch,), optional
        Keep the k largest; 1 means argmax; <= 0 or >= vocab (in a tensor) disables it.
    top_p : float or Tensor (batch,), optional
        Nucleus: the smallest set of largest tokens holding at least this share of the
        probability left by top-k; 1 (or more, in a tensor) disables it.
    min_p : float or Tensor (batch,), optional
        Keep tokens whose probability is at least min_p times the largest one's; 0 disables.
    seed : int or int64 Tensor (batch,), optional
        An int seeds the batch (row r draws stream r); a tensor seeds each row on its own
        (stream 0: the same seed and logits give the same token in any row). None draws
        per-row seeds from torch's generator on the logits' device.

    Scalars are checked here; per-row tensors are checked where that costs no device sync
    (host tensors, TKIT_CHECK=1) and are otherwise taken as documented (out-of-range values
    clamp or disable). Nothing reads device values: the call is capturable in a CUDA graph.

    Returns
    -------
    Tensor (batch,) int64.
    """
    C.check_tensor(logits, "logits", LOGIT_DTYPES, ndim=2)
    b, v = logits.shape
    if v == 0 and b > 0:
        raise ValueError("logits must have at least one column (vocab >= 1)")
    t, t_val = _option(temperature, "temperature", b, logits, LOGIT_DTYPES, "float")
    k, k_val = _option(top_k, "top_k", b, logits, (torch.int32, torch.int64), "int")
    p, p_val = _option(top_p, "top_p", b, logits, LOGIT_DTYPES, "float")
    mp, mp_val = _option(min_p, "min_p", b, logits, LOGIT_DTYPES, "float")
    if t is None and temperature is not None and t_val < 0:
        raise ValueError(f"temperature must be >= 0, got {t_val}")
    if k is None and top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if p is None and top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if mp is None and min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    for name, x, lo, hi in (("temperature", t, 0.0, float("inf")), ("top_p", p, 0.0, 1.0),
                            ("min_p", mp, 0.0, 1.0)):
        if x is not None and _values_checked(x):
            bad = ~((x >= lo) & (x <= hi))
            if name == "top_p":
                bad = bad | (x == 0)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise ValueError(f"{name}[{i}] = {x[i].item()} is outside its range")
    seeds, seed_val = _seeds(seed, b, logits)
    # scalars: -1 = not given (compiled out), 0 = given as a tensor; temperature defaults to 1
    t_val = 1.0 if temperature is None or t is not None else float(t_val)
    args = (logits, t, k, p, mp, seeds, t_val, int(k_val), float(p_val), float(mp_val),
            int(seed_val))
    if C.use_direct_path(logits):
        return _sample_impl(*args)
    return _sample_op(*args)


def speculative_accept(draft_token_ids, draft_probs, target_probs, *, seed=None):
    """Chain rejection sampling of speculative decoding (see the module docstring).

    Parameters
    ----------
    draft_token_ids : int64 or int32 Tensor (batch, k), the draft model's tokens.
    draft_probs : Tensor (batch, k, vocab), the draft's probabilities at each of them.
    target_probs : Tensor (batch, k + 1, vocab), the target's (its last row for the bonus).
        float32, float16 or bfloat16 probability rows (each summing to 1), any strides.
    seed : int or int64 Tensor (batch,), optional; as in :func:`sample`.

    Returns
    -------
    accepted_ids : int64 Tensor (batch, k + 1): the accepted draft tokens, then the resampled
        (or bonus) token, then -1.
    num_accepted : int32 Tensor (batch,): accepted draft tokens (0..k); the row holds
        num_accepted + 1 tokens.
    """
    C.check_tensor(draft_token_ids, "draft_token_ids", (torch.int64, torch.int32), ndim=2)
    C.check_tensor(draft_probs, "draft_probs", PROB_DTYPES, ndim=3)
    C.check_tensor(target_probs, "target_probs", PROB_DTYPES, ndim=3)
    C.check_same_device(draft_token_ids=draft_token_ids, draft_probs=draft_probs,
                        target_probs=target_probs)
    b, k = draft_token_ids.shape
    if tuple(draft_probs.shape[:2]) != (b, k):
        raise ValueError(f"draft_probs must be (batch, k, vocab) = ({b}, {k}, vocab) for "
                         f"draft_token_ids of shape {(b, k)}, got {tuple(draft_probs.shape)}")
    v = draft_probs.shape[2]
    if tuple(target_probs.shape) != (b, k + 1, v):
        raise ValueError(f"target_probs must be (batch, k + 1, vocab) = {(b, k + 1, v)}, got "
                         f"{tuple(target_probs.shape)}")
    if k < 1 or v < 1:
        raise ValueError(f"draft_token_ids needs k >= 1 and draft_probs vocab >= 1, got k={k}, "
                         f"vocab={v}")
    if draft_probs.dtype != target_probs.dtype:
        raise TypeError(f"draft_probs ({C.dtype_name(draft_probs.dtype)}) and target_probs "
                        f"({C.dtype_name(target_probs.dtype)}) must have the same dtype")
    if _values_checked(draft_token_ids):
        bad = (draft_token_ids < 0) | (draft_token_ids >= v)
        if bool(bad.any()):
            i, j = bad.nonzero()[0].tolist()
            raise ValueError(f"draft_token_ids[{i}, {j}] = {int(draft_token_ids[i, j])} is "
                             f"outside [0, vocab = {v})")
    seeds, seed_val = _seeds(seed, b, draft_probs, "draft_probs")
    if C.use_direct_path(draft_probs, target_probs):
        return _spec_impl(draft_token_ids, draft_probs, target_probs, seeds, seed_val)
    return _spec_op(draft_token_ids, draft_probs, target_probs, seeds, seed_val)


def cost(logits, **kw):
    """Bytes of one :func:`sample`: the logits read once (plus the ids written)."""
    from tkit._cost import Cost

    return Cost(logits.numel() * logits.element_size() + 8 * logits.shape[0], 0.0)


def cost_speculative(draft_token_ids, draft_probs, target_probs, **kw):
    """Bytes of one :func:`speculative_accept`: per row one draft and one target probability
    row read (the residual's, or the bonus row's), the gathers and the outputs."""
    from tkit._cost import Cost

    b, k = draft_token_ids.shape
    v = draft_probs.shape[-1]
    item = draft_probs.element_size()
    return Cost(b * (2 * v * item + k * (8 + 2 * item) + 8 * (k + 1) + 4), 0.0)


# --------------------------------------------------------------------------------------------
# The counter-based RNG in torch (references and tests)
# --------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit words of a * b for a uint32 constant and a tensor of uint32 in int64,
    without int64 overflow (16-bit halves of a)."""
    t_lo = (a & 0xFFFF) * b
    t_hi = (a >> 16) * b
    w = ((t_hi & 0xFFFF) << 16) + t_lo
    return (t_hi >> 16) + (w >> 32), w & _M32


def philox_uniform(seed: torch.Tensor, stream, purpose: int, idx: torch.Tensor) -> torch.Tensor:
    """The kernels' u for elements ``idx`` (int64 tensor), float64, bit-for-bit: Philox-4x32-10
    as ``tl.philox`` computes it, counter (idx // 4, stream, purpose, 0), key (seed low, high
    32 bits), word idx % 4, then ((r >> 9) + 0.5) * 2**-23. ``seed``/``stream`` broadcast
    against ``idx`` (int64 tensors or ints)."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=idx.device)
    stream = torch.as_tensor(stream, dtype=torch.int64, device=idx.device)
    k0 = seed & _M32
    k1 = (seed >> 32) & _M32
    c0 = (idx >> 2) & _M32
    c1 = (stream & _M32) + torch.zeros_like(c0)
    c2 = torch.full_like(c0, purpose & _M32)
    c3 = torch.zeros_like(c0)
    k0 = k0 + torch.zeros_like(c0)
    k1 = k1 + torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mulhilo(0xCD9E8D57, c2)
        hi_a, lo_a = _mulhilo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    o = idx & 3
    r = torch.where(o == 0, c0, torch.where(o == 1, c1, torch.where(o == 2, c2, c3)))
    return ((r >> 9).to(torch.float64) + 0.5) * 2.0**-23
