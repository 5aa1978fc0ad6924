"""The decode family's Gluon kernel for Hopper (sm_90): fp8 paged caches, warp-specialized.

Same math, conventions and outputs as ``_decode_split_kernel`` with ``QK_WG`` (the fp8 wgmma
scores, keys as M, the query split in hi and lo e4m3 parts, P @ V by mma.sync on V's float16
quarters), one split. What differs is who moves the bytes: a 1-warp loader partition issues a
TMA copy of each page's K and V rows of the program's kv head into a ring of STAGES 128-key
slots (and cp.async of the per-token scales), one mbarrier a slot, and the 4-warp consumer
(the default partition) only waits on the slot's barrier, computes, and hands the slot back
(an "empty" mbarrier). The consumer issues no address arithmetic, no load of the cache and
no cp.async wait; the loader runs ahead by the ring's depth whatever the consumer is doing.

Scope (``hopper.supported``): sm_90, float8_e4m3fn caches, paged with pages of 64 keys or
more (a power of 2), head dim 128, 16-bit queries, at most 8 packed (query, head) rows a kv
head, no window or softcap, one split. The launcher makes the TMA descriptors on the device
(no host work per call), over the cache as (blocks, page, heads, head dim)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tkit.kernels._gluon import cta_barrier, tma_load

TILE = gl.constexpr(128)  # keys a ring slot (the wgmma's M: two m64 halves)


@gluon.jit
def _inline_fp8_words_to_f16(w):
    """int32 words of 4 e4m3 values (little-endian, consecutive head-dim positions) as four
    float16 tensors like ``w``: e_r holds position 4 * word + r. Two words a call (pack 2):
    the same byte of both words gathered (prmt) and converted by one
    ``cvt.rn.f16x2.e4m3x2``, so a register holds the pair (key k, key k + 1) of a position,
    the pair an mma.sync B operand register holds."""
    return gl.inline_asm_elementwise(
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
        "=r,=r,=r,=r,r,r", [w], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=2)


@gluon.jit
def _table_entries(BTb, t, max_pages, sbtn, PAGE: gl.constexpr, BOX: gl.constexpr):
    """The raw block-table entries of tile t's pages (the second one's only when a tile
    spans two pages; pages past the table clamped to its last column)."""
    pg = gl.minimum((t * TILE) // PAGE, max_pages - 1)
    b0 = gl.load(BTb + pg * sbtn)
    if TILE // BOX == 2:
        b1 = gl.load(BTb + gl.minimum(pg + 1, max_pages - 1) * sbtn)
    else:
        b1 = b0
    return b0, b1


@gluon.jit
def _loader(K, V, KS, VS, BTb, kbuf, vbuf, ksbuf, vsbuf, ready, sready, empty, hk, n_tiles,
            n_blocks, n_kv_heads, max_pages, skn, skp, skh, svn, svp, svh, sksn, sksp, sksh,
            svsn, svsp, svsh, sbtn,
            HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr,
            STAGES: gl.constexpr, SCALE_K: gl.constexpr, SCALE_V: gl.constexpr):
    """The loader partition (one warp): for tile t, once the consumer has released its slot,
    TMA the K and V rows of the tile's pages (one box of BOX = min(PAGE, TILE) rows, two at
    pages of 64 keys) onto the slot's ``ready`` barrier, and cp.async the tile's per-token
    scales onto ``sready``."""
    NLOAD: gl.constexpr = TILE // BOX
    # a head's rows of the cache as one 2-D tensor (block * PAGE + row, head dim): the
    # launcher checks that a block's stride is PAGE rows
    kv_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                   rank=2)
    k_desc = tma.make_tensor_descriptor(K + hk.to(gl.int64) * skh,
                                        shape=[n_blocks * PAGE, HEAD_DIM], strides=[skp, 1],
                                        block_shape=[BOX, HEAD_DIM], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V + hk.to(gl.int64) * svh,
                                        shape=[n_blocks * PAGE, HEAD_DIM], strides=[svp, 1],
                                        block_shape=[BOX, HEAD_DIM], layout=kv_layout)
    sc_layout: gl.constexpr = gl.BlockedLayout([TILE // 32], [32], [1], [0])
    keys0 = gl.arange(0, TILE, layout=sc_layout)
    KSh = KS + hk.to(gl.int64) * sksh
    VSh = VS + hk.to(gl.int64) * svsh
    # a tile's block-table entries are loaded one tile ahead (used by the next trip), so that
    # their latency is spent while the loop waits for a free slot, not between the slot's
    # release and its copies
    nb0, nb1 = _table_entries(BTb, 0, max_pages, sbtn, PAGE, BOX)
    for t in range(n_tiles):
        blk0 = gl.minimum(gl.maximum(nb0, 0), n_blocks - 1)
        blk1 = gl.minimum(gl.maximum(nb1, 0), n_blocks - 1)
        nb0, nb1 = _table_entries(BTb, t + 1, max_pages, sbtn, PAGE, BOX)
        slot = t % STAGES
        # a fresh mbarrier reads as if the phase before phase 0 had completed
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * TILE * HEAD_DIM)
        row0 = blk0 * PAGE + (t * TILE) % PAGE
        tma_load(k_desc, [row0, 0], bar, kbuf.index(slot).slice(0, BOX))
        tma_load(v_desc, [row0, 0], bar, vbuf.index(slot).slice(0, BOX))
        if NLOAD == 2:  # pages of 64 keys: the second page of the tile
            tma_load(k_desc, [blk1 * PAGE, 0], bar, kbuf.index(slot).slice(BOX, BOX))
            tma_load(v_desc, [blk1 * PAGE, 0], bar, vbuf.index(slot).slice(BOX, BOX))
        if SCALE_K == 2 or SCALE_V == 2:
            if NLOAD == 2:
                blk = gl.where(keys0 < BOX, blk0, blk1).to(gl.int64)
            else:
                blk = gl.full([TILE], 0, gl.int64, sc_layout) + blk0.to(gl.int64)
            row = (t * TILE + keys0) % PAGE
            if SCALE_K == 2:
                async_copy.async_copy_global_to_shared(ksbuf.index(slot),
                                                       KSh + blk * sksn + row * sksp)
            if SCALE_V == 2:
                async_copy.async_copy_global_to_shared(vsbuf.index(slot),
                                                       VSh + blk * svsn + row * svsp)
            async_copy.mbarrier_arrive(sready.index(slot), increment_count=False)


@gluon.jit
def _pairs(x):
    """[..., R] -> [..., 2R]: each element twice in a row (a score row's hi and lo columns)."""
    shape: gl.constexpr = x.shape[:-1] + [2 * x.shape[-1]]
    return gl.reshape(gl.join(x, x), shape)


@gluon.jit
def _tile(t, st, n_tiles, acc0, acc1, acc2, acc3, l8, m8, q2t, qsc, kbuf, vbuf, ksbuf, vsbuf,
          ready, sready, empty, L, seqlen_q, GROUP,
          s_layout: gl.constexpr, o_layout: gl.constexpr, w_layout: gl.constexpr,
          HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, SCALE_K: gl.constexpr,
          SCALE_V: gl.constexpr, MASKED: gl.constexpr):
    """One 128-key tile for the consumer, whose raw scores ``st`` (S^T = K q2^T, fp8 wgmma,
    keys as M, a row's hi and lo parts in adjacent columns) are in registers: the next tile's
    scores are issued first and run on the tensor cores under this tile's softmax (along the
    keys, one value a row) and O += P V (mma.sync over V's four float16 quarters, P^T's rows
    each twice: the mma's M of 16); then they are waited for and the slot is released.
    Returns the accumulators, the softmax state and the next tile's raw scores."""
    N2: gl.constexpr = q2t.shape[1]
    ROWS: gl.constexpr = N2 // 2
    slot = t % STAGES
    phase = (t // STAGES) & 1
    # ---- the next tile's scores, in flight from here (the last tile re-reads its own slot:
    # the result is not used, and the slot is released only after the wait below)
    has_next = t + 1 < n_tiles
    nslot = (t + has_next.to(gl.int32)) % STAGES
    mbarrier.wait(ready.index(nslot), ((t + 1) // STAGES) & 1, pred=has_next)
    kn = kbuf.index(nslot)
    tok = warpgroup_mma(kn, q2t, gl.zeros([TILE, N2], gl.float32, s_layout), use_acc=False,
                        is_async=True)
    if SCALE_K == 2 or SCALE_V == 2:
        mbarrier.wait(sready.index(slot), phase)
    # ---- this tile's softmax: hi + lo of each row, then along the keys
    st = st * gl.expand_dims(qsc, 0)
    if SCALE_K == 2:
        ks = ksbuf.index(slot).load(gl.SliceLayout(1, s_layout))
        st = st * gl.expand_dims(ks, 1)
    hi, lo = gl.split(gl.reshape(st, [TILE, ROWS, 2]))
    s = hi + lo  # [keys, rows]
    if MASKED:  # keys past each row's last visible key (causal, bottom-right)
        keys = t * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, s.type.layout))
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s.type.layout))
        last = gl.minimum(L - seqlen_q + rows // GROUP, L - 1)
        s = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(last, 0), s, float("-inf"))
    m_new = gl.maximum(m8, gl.max(s, 0))
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s - gl.expand_dims(m_use, 0))
    alpha = gl.exp2(m8 - m_use)
    l8 = l8 * gl.expand_dims(alpha, 0) + p
    if SCALE_V == 2:
        vs = vsbuf.index(slot).load(gl.SliceLayout(1, p.type.layout))
        p = p * gl.expand_dims(vs, 1)
    pt = gl.convert_layout(gl.permute(_pairs(p.to(gl.float16)), (1, 0)),
                           gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    # ---- O += P V: V as int32 words, 4 head-dim positions a word (the 128-byte swizzle moves
    # the same 16-byte chunks whatever the element width)
    words_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                      element_bitwidth=32, rank=2)
    vw = vbuf.index(slot)._reinterpret(gl.int32, [TILE, HEAD_DIM // 4],
                                       words_layout).load(w_layout)
    v0, v1, v2, v3 = _inline_fp8_words_to_f16(vw)
    if MASKED:  # keys past the sequence: P is 0 there, but their bytes may be NaNs
        kv_ok = gl.expand_dims(
            t * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, w_layout)) < L, 1)
        v0 = gl.where(kv_ok, v0, 0.0)
        v1 = gl.where(kv_ok, v1, 0.0)
        v2 = gl.where(kv_ok, v2, 0.0)
        v3 = gl.where(kv_ok, v3, 0.0)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=o_layout, k_width=2)
    a_rows = gl.expand_dims(gl.convert_layout(_pairs(alpha), gl.SliceLayout(1, o_layout)), 1)
    acc0 = mma_v2(pt, gl.convert_layout(v0, b_layout), acc0 * a_rows)
    acc1 = mma_v2(pt, gl.convert_layout(v1, b_layout), acc1 * a_rows)
    acc2 = mma_v2(pt, gl.convert_layout(v2, b_layout), acc2 * a_rows)
    acc3 = mma_v2(pt, gl.convert_layout(v3, b_layout), acc3 * a_rows)
    st = warpgroup_mma_wait(0, deps=(tok, kn, q2t))[0]
    mbarrier.arrive(empty.index(slot), count=1)
    return acc0, acc1, acc2, acc3, l8, m_new, st


@gluon.jit
def _store_quarter(O, acc, inv_l, o_row_off, row_ok, r: gl.constexpr, sod,
                   o_layout: gl.constexpr):
    cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_layout)) * 4 + r
    ptrs = O + gl.expand_dims(o_row_off, 1) + gl.expand_dims(cols.to(gl.int64) * sod, 0)
    out = acc * gl.expand_dims(inv_l, 1)
    gl.store(ptrs, out.to(O.dtype.element_ty), mask=gl.expand_dims(row_ok, 1))


@gluon.jit
def _q_split(Q, KS, q2buf, b64, hk, n_rows, GROUP, qk_scale, sqb, sqs, sqh, sqd,
             s_layout: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr,
             SCALE_K: gl.constexpr):
    """The query rows split in hi and lo e4m3 parts (column 2r + part) into ``q2buf``, once;
    returns the wgmma's B operand (q2^T) and each column's power of two times the score
    scale (the K scale folded in when per tensor)."""
    N2: gl.constexpr = 2 * ROWS
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    c2 = gl.arange(0, N2, layout=gl.SliceLayout(1, q_layout))
    r2 = c2 // 2
    q_off = (b64 * sqb + (r2 // GROUP).to(gl.int64) * sqs
             + (hk * GROUP + r2 % GROUP).to(gl.int64) * sqh)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    x = gl.load(Q + gl.expand_dims(q_off, 1) + gl.expand_dims(offs_d.to(gl.int64) * sqd, 0),
                mask=gl.expand_dims(r2 < n_rows, 1), other=0.0).to(gl.float32)
    a = _pow2_scale(gl.max(gl.abs(x), 1))
    hi = (x * gl.expand_dims(1.0 / a, 1)).to(gl.float8e4nv)
    rem = x - hi.to(gl.float32) * gl.expand_dims(a, 1)
    bsc = _pow2_scale(gl.max(gl.abs(rem), 1))
    lo = (rem * gl.expand_dims(1.0 / bsc, 1)).to(gl.float8e4nv)
    q2buf.store(gl.where(gl.expand_dims(c2 % 2 == 1, 1), lo, hi))
    fence_async_shared()
    cta_barrier()  # every warp's rows are in before the wgmmas read them
    qsc = gl.convert_layout(gl.where(c2 % 2 == 1, bsc, a), gl.SliceLayout(0, s_layout))
    if SCALE_K == 1:
        qk_scale = qk_scale * gl.load(KS)
    return q2buf.permute((1, 0)), qsc * qk_scale


@gluon.jit
def _consumer(Q, O, LSE, KS, VS, kbuf, vbuf, ksbuf, vsbuf, q2buf, ready, sready, empty, b64,
              hk, L, seqlen_q, GROUP, n_tiles, qk_scale, sqb, sqs, sqh, sqd, sob, sos, soh,
              sod, slb, slh, sls,
              HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BOX: gl.constexpr,
              STAGES: gl.constexpr, SCALE_K: gl.constexpr, SCALE_V: gl.constexpr):
    """The default partition (one warpgroup): the query's hi / lo parts into shared memory,
    every tile of the sequence, then O and lse of the packed rows."""
    N2: gl.constexpr = 2 * ROWS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, N2, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4],
                                                       instr_shape=[16, 8])
    # the words of V in the B-operand order of o_layout (pairs of consecutive keys a thread)
    w_layout: gl.constexpr = gl.BlockedLayout([2, 1], [4, 8], [1, 4], [0, 1])

    n_rows = seqlen_q * GROUP
    q2t, qsc = _q_split(Q, KS, q2buf, b64, hk, n_rows, GROUP, qk_scale, sqb, sqs, sqh, sqd,
                        s_layout, HEAD_DIM, ROWS, SCALE_K)

    # tiles every row sees whole: keys < L - seqlen_q + 1
    n_full = gl.minimum(gl.maximum(L - seqlen_q + 1, 0) // TILE, n_tiles)

    # the softmax state, one value a row (the layout of a score tile's hi + lo)
    hi0, lo0 = gl.split(gl.reshape(gl.zeros([TILE, N2], gl.float32, s_layout),
                                   [TILE, ROWS, 2]))
    l8 = gl.zeros_like(hi0)
    m8 = gl.full_like(gl.max(lo0, 0), float("-inf"))
    acc0 = gl.zeros([N2, HEAD_DIM // 4], gl.float32, o_layout)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    # the first tile's scores (nothing to wait for when the sequence is empty)
    mbarrier.wait(ready.index(0), 0, pred=n_tiles > 0)
    k0 = kbuf.index(0)
    tok = warpgroup_mma(k0, q2t, gl.zeros([TILE, N2], gl.float32, s_layout), use_acc=False,
                        is_async=True)
    st = warpgroup_mma_wait(0, deps=(tok, k0, q2t))[0]
    for t in range(0, n_full):
        acc0, acc1, acc2, acc3, l8, m8, st = _tile(
            t, st, n_tiles, acc0, acc1, acc2, acc3, l8, m8, q2t, qsc, kbuf, vbuf, ksbuf, vsbuf,
            ready, sready, empty, L, seqlen_q, GROUP, s_layout, o_layout, w_layout, HEAD_DIM,
            STAGES, SCALE_K, SCALE_V, False)
    for t in range(n_full, n_tiles):
        acc0, acc1, acc2, acc3, l8, m8, st = _tile(
            t, st, n_tiles, acc0, acc1, acc2, acc3, l8, m8, q2t, qsc, kbuf, vbuf, ksbuf, vsbuf,
            ready, sready, empty, L, seqlen_q, GROUP, s_layout, o_layout, w_layout, HEAD_DIM,
            STAGES, SCALE_K, SCALE_V, True)

    # ---- O / l and lse: row r in score column r, in accumulator rows 2r and 2r + 1
    l_i = gl.sum(l8, 0)
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    lse = gl.where(empty_row, float("-inf"), (m8 + gl.log2(l_safe)) * 0.6931471805599453)
    r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(0, l8.type.layout))
    l_off = (b64 * slb + (hk * GROUP + r_s % GROUP).to(gl.int64) * slh
             + (r_s // GROUP).to(gl.int64) * sls)
    gl.store(LSE + l_off, lse, mask=r_s < n_rows)
    inv_l = gl.convert_layout(_pairs(1.0 / l_safe), gl.SliceLayout(1, o_layout))
    if SCALE_V == 1:
        inv_l = inv_l * gl.load(VS)
    co = gl.arange(0, N2, layout=gl.SliceLayout(1, o_layout))
    r_o = co // 2
    ok_o = (co % 2 == 0) & (r_o < n_rows)
    o_row = (b64 * sob + (r_o // GROUP).to(gl.int64) * sos
             + (hk * GROUP + r_o % GROUP).to(gl.int64) * soh)
    _store_quarter(O, acc0, inv_l, o_row, ok_o, 0, sod, o_layout)
    _store_quarter(O, acc1, inv_l, o_row, ok_o, 1, sod, o_layout)
    _store_quarter(O, acc2, inv_l, o_row, ok_o, 2, sod, o_layout)
    _store_quarter(O, acc3, inv_l, o_row, ok_o, 3, sod, o_layout)


@gluon.jit
def _tile_w(t, st, n_tiles, acc0, acc1, acc2, acc3, l4, m4, q2t, qsc, kbuf, vbuf, ksbuf, vsbuf,
            ready, sready, empty, L, seqlen_q, GROUP,
            s_layout: gl.constexpr, o_layout: gl.constexpr, w_layout: gl.constexpr,
            HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, SCALE_K: gl.constexpr,
            SCALE_V: gl.constexpr, MASKED: gl.constexpr, EARLY: gl.constexpr = True):
    """:func:`_tile` with a softmax state per warp: the wgmma gives warp w the keys
    64 i + 16 w + r (i < 2, r < 16) of each tile, and each warp keeps its own running max,
    sums and P V over its keys (a batched mma.sync, the warps on the batch), so nothing in
    the loop crosses warps but the wgmma; the warps' states are merged once, after the loop."""
    N2: gl.constexpr = q2t.shape[1]
    ROWS: gl.constexpr = N2 // 2
    HW: gl.constexpr = HEAD_DIM // 4
    slot = t % STAGES
    phase = (t // STAGES) & 1
    if EARLY:  # the next tile's scores in flight under this tile's work (two slots held)
        has_next = t + 1 < n_tiles
        nslot = (t + has_next.to(gl.int32)) % STAGES
        mbarrier.wait(ready.index(nslot), ((t + 1) // STAGES) & 1, pred=has_next)
        kn = kbuf.index(nslot)
        tok = warpgroup_mma(kn, q2t, gl.zeros([TILE, N2], gl.float32, s_layout),
                            use_acc=False, is_async=True)
    else:  # this tile's scores, waited at once (one slot held)
        mbarrier.wait(ready.index(slot), phase)
        kt = kbuf.index(slot)
        tok = warpgroup_mma(kt, q2t, gl.zeros([TILE, N2], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        st = warpgroup_mma_wait(0, deps=(tok, kt, q2t))[0]
    if SCALE_K == 2 or SCALE_V == 2:
        mbarrier.wait(sready.index(slot), phase)
    st = st * gl.expand_dims(qsc, 0)
    if SCALE_K == 2:
        ks = ksbuf.index(slot).load(gl.SliceLayout(1, s_layout))
        st = st * gl.expand_dims(ks, 1)
    hi, lo = gl.split(gl.reshape(st, [TILE, ROWS, 2]))
    s = hi + lo  # [keys, rows]
    if MASKED:
        keys = t * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, s.type.layout))
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s.type.layout))
        last = gl.minimum(L - seqlen_q + rows // GROUP, L - 1)
        s = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(last, 0), s, float("-inf"))
    s4 = gl.reshape(s, [2, 4, 16, ROWS])  # (m64 half, warp, key of the warp's 16, row)
    m_new = gl.maximum(m4, gl.max(gl.max(s4, 2), 0))  # [warp, row]
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p4 = gl.exp2(s4 - gl.expand_dims(gl.expand_dims(m_use, 0), 2))
    alpha = gl.exp2(m4 - m_use)
    l4 = l4 * gl.expand_dims(gl.expand_dims(alpha, 0), 2) + p4
    if SCALE_V == 2:
        vs = vsbuf.index(slot).load(gl.SliceLayout(1, s.type.layout))
        p2 = gl.convert_layout(gl.reshape(p4, [TILE, ROWS]), s.type.layout)
        p4 = gl.reshape(p2 * gl.expand_dims(vs, 1), [2, 4, 16, ROWS])
    # each warp's P^T: [warp, 2 ROWS, 32 keys], key 16 i + r
    pt = gl.reshape(gl.permute(_pairs(p4.to(gl.float16)), (1, 3, 0, 2)), [4, N2, 32])
    pt = gl.convert_layout(pt, gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                   k_width=2))
    words_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                      element_bitwidth=32, rank=4)
    vw = vbuf.index(slot)._reinterpret(gl.int32, [2, 4, 16, HW], words_layout).load(w_layout)
    v0, v1, v2, v3 = _inline_fp8_words_to_f16(vw)
    if MASKED:  # keys past the sequence: P is 0 there, but their bytes may be NaNs
        v0 = gl.where(v0 == v0, v0, 0.0)
        v1 = gl.where(v1 == v1, v1, 0.0)
        v2 = gl.where(v2 == v2, v2, 0.0)
        v3 = gl.where(v3 == v3, v3, 0.0)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=o_layout, k_width=2)
    a_rows = gl.expand_dims(gl.convert_layout(_pairs(alpha), gl.SliceLayout(2, o_layout)), 2)
    acc0 = mma_v2(pt, gl.convert_layout(
        gl.reshape(gl.permute(v0, (1, 0, 2, 3)), [4, 32, HW]), b_layout), acc0 * a_rows)
    acc1 = mma_v2(pt, gl.convert_layout(
        gl.reshape(gl.permute(v1, (1, 0, 2, 3)), [4, 32, HW]), b_layout), acc1 * a_rows)
    acc2 = mma_v2(pt, gl.convert_layout(
        gl.reshape(gl.permute(v2, (1, 0, 2, 3)), [4, 32, HW]), b_layout), acc2 * a_rows)
    acc3 = mma_v2(pt, gl.convert_layout(
        gl.reshape(gl.permute(v3, (1, 0, 2, 3)), [4, 32, HW]), b_layout), acc3 * a_rows)
    if EARLY:
        st = warpgroup_mma_wait(0, deps=(tok, kn, q2t))[0]
    mbarrier.arrive(empty.index(slot), count=1)
    return acc0, acc1, acc2, acc3, l4, m_new, st


@gluon.jit
def _consumer_w(Q, O, LSE, KS, VS, kbuf, vbuf, ksbuf, vsbuf, q2buf, ready, sready, empty, b64,
                hk, L, seqlen_q, GROUP, n_tiles, qk_scale, sqb, sqs, sqh, sqd, sob, sos, soh,
                sod, slb, slh, sls,
                HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
                SCALE_K: gl.constexpr, SCALE_V: gl.constexpr, EARLY: gl.constexpr):
    """:func:`_consumer` over :func:`_tile_w`: a softmax state and P V per warp."""
    N2: gl.constexpr = 2 * ROWS
    HW: gl.constexpr = HEAD_DIM // 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, N2, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1],
                                                       instr_shape=[1, 16, 8])
    # the words of V: warp w holds its keys' words in the B-operand order of o_layout
    w_layout: gl.constexpr = gl.BlockedLayout([1, 1, 2, 1], [1, 1, 4, 8], [1, 4, 1, 1],
                                              [2, 3, 1, 0])
    n_rows = seqlen_q * GROUP
    q2t, qsc = _q_split(Q, KS, q2buf, b64, hk, n_rows, GROUP, qk_scale, sqb, sqs, sqh, sqd,
                        s_layout, HEAD_DIM, ROWS, SCALE_K)
    n_full = gl.minimum(gl.maximum(L - seqlen_q + 1, 0) // TILE, n_tiles)

    hi0, lo0 = gl.split(gl.reshape(gl.zeros([TILE, N2], gl.float32, s_layout),
                                   [TILE, ROWS, 2]))
    l4 = gl.reshape(gl.zeros_like(hi0), [2, 4, 16, ROWS])
    m4 = gl.full_like(gl.max(gl.max(gl.reshape(lo0, [2, 4, 16, ROWS]), 2), 0), float("-inf"))
    acc0 = gl.zeros([4, N2, HW], gl.float32, o_layout)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    if EARLY:
        mbarrier.wait(ready.index(0), 0, pred=n_tiles > 0)
        k0 = kbuf.index(0)
        tok = warpgroup_mma(k0, q2t, gl.zeros([TILE, N2], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        st = warpgroup_mma_wait(0, deps=(tok, k0, q2t))[0]
    else:
        st = gl.zeros([TILE, N2], gl.float32, s_layout)
    for t in range(0, n_full):
        acc0, acc1, acc2, acc3, l4, m4, st = _tile_w(
            t, st, n_tiles, acc0, acc1, acc2, acc3, l4, m4, q2t, qsc, kbuf, vbuf, ksbuf, vsbuf,
            ready, sready, empty, L, seqlen_q, GROUP, s_layout, o_layout, w_layout, HEAD_DIM,
            STAGES, SCALE_K, SCALE_V, False, EARLY)
    for t in range(n_full, n_tiles):
        acc0, acc1, acc2, acc3, l4, m4, st = _tile_w(
            t, st, n_tiles, acc0, acc1, acc2, acc3, l4, m4, q2t, qsc, kbuf, vbuf, ksbuf, vsbuf,
            ready, sready, empty, L, seqlen_q, GROUP, s_layout, o_layout, w_layout, HEAD_DIM,
            STAGES, SCALE_K, SCALE_V, True, EARLY)

    # ---- the warps' states merged: max over warps, each warp's sums and O rescaled to it
    m = gl.max(m4, 0)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    sc = gl.exp2(m4 - gl.expand_dims(m_safe, 0))  # [warp, row]; 0 for a warp that saw none
    l_i = gl.sum(gl.sum(gl.sum(l4, 2), 0) * sc, 0)
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    lse = gl.where(empty_row, float("-inf"), (m + gl.log2(l_safe)) * 0.6931471805599453)
    r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(0, sc.type.layout))
    l_off = (b64 * slb + (hk * GROUP + r_s % GROUP).to(gl.int64) * slh
             + (r_s // GROUP).to(gl.int64) * sls)
    gl.store(LSE + l_off, lse, mask=r_s < n_rows)
    sc3 = gl.expand_dims(gl.convert_layout(_pairs(sc), gl.SliceLayout(2, o_layout)), 2)
    out_layout: gl.constexpr = gl.SliceLayout(0, o_layout)
    inv_l = gl.convert_layout(_pairs(1.0 / l_safe), gl.SliceLayout(1, out_layout))
    if SCALE_V == 1:
        inv_l = inv_l * gl.load(VS)
    co = gl.arange(0, N2, layout=gl.SliceLayout(1, out_layout))
    r_o = co // 2
    ok_o = (co % 2 == 0) & (r_o < n_rows)
    o_row = (b64 * sob + (r_o // GROUP).to(gl.int64) * sos
             + (hk * GROUP + r_o % GROUP).to(gl.int64) * soh)
    _store_quarter(O, gl.sum(acc0 * sc3, 0), inv_l, o_row, ok_o, 0, sod, out_layout)
    _store_quarter(O, gl.sum(acc1 * sc3, 0), inv_l, o_row, ok_o, 1, sod, out_layout)
    _store_quarter(O, gl.sum(acc2 * sc3, 0), inv_l, o_row, ok_o, 2, sod, out_layout)
    _store_quarter(O, gl.sum(acc3 * sc3, 0), inv_l, o_row, ok_o, 3, sod, out_layout)


@gluon.jit
def _pow2_scale(amax):
    """2^(floor(log2 amax) - 7) for finite amax > 0 (amax / scale in [128, 256)), within
    float32's normal range; 1 for 0."""
    e = ((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 7
    e = gl.minimum(gl.maximum(e, 1), 254)
    s = (e << 23).to(gl.float32, bitcast=True)
    return gl.where(amax > 0.0, s, 1.0)


@gluon.jit(do_not_specialize=["sqb", "sqs", "sqh", "skn", "skp", "skh", "svn", "svp", "svh",
                              "sksn", "sksp", "sksh", "svsn", "svsp", "svsh", "s_len", "sbtb",
                              "sbtn", "sob", "sos", "soh", "slb", "slh", "sls", "seqlen_q",
                              "n_blocks", "max_pages", "n_kv_heads", "GROUP"])
def _decode_fp8_ws_kernel(
    Q, K, V, KS, VS, SEQLENS, BT, O, LSE,
    sqb, sqs, sqh, sqd, skn, skp, skh, svn, svp, svh,
    sksn, sksp, sksh, svsn, svsp, svsh, s_len, sbtb, sbtn,
    sob, sos, soh, sod, slb, slh, sls,
    seqlen_q, n_blocks, max_pages, n_kv_heads, GROUP, qk_scale,
    HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr,
    STAGES: gl.constexpr, SCALE_K: gl.constexpr, SCALE_V: gl.constexpr,
    PER_WARP: gl.constexpr = False, EARLY: gl.constexpr = True,
):
    """One program: the (at most ROWS) packed rows of one (sequence, kv head), all its keys.
    Grid (heads_kv, batch). Q (batch, seqlen_q, heads_q, head_dim) strides ``sq*``; K, V the
    paged fp8 caches (blocks, PAGE, heads_kv, head_dim) strides ``sk*`` / ``sv*`` (head dim
    contiguous); KS, VS: per-tensor scales (SCALE_* = 1, 0-d) or per (block, row, head)
    (SCALE_* = 2, strides ``sks*`` / ``svs*``); SEQLENS (batch,) int32; BT the block table
    (``sbtb``, ``sbtn``), ``max_pages`` its columns; O like Q; LSE (batch, heads_q, seqlen_q).
    ``qk_scale`` = softmax scale * log2(e). Launched with num_warps = 4 (the consumer);
    the loader is a 1-warp partition."""
    hk = gl.program_id(0)
    b = gl.program_id(1)
    b64 = b.to(gl.int64)
    L = gl.load(SEQLENS + b64 * s_len)
    L = gl.minimum(gl.maximum(L, 0), max_pages * PAGE)
    n_tiles = (L + TILE - 1) // TILE
    N2: gl.constexpr = 2 * ROWS

    q2_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                   rank=2)
    sc_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    ring_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                     element_bitwidth=8, rank=2)
    kbuf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TILE, HEAD_DIM], ring_layout)
    vbuf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TILE, HEAD_DIM], ring_layout)
    ksbuf = gl.allocate_shared_memory(gl.float32, [STAGES, TILE], sc_layout)
    vsbuf = gl.allocate_shared_memory(gl.float32, [STAGES, TILE], sc_layout)
    q2buf = gl.allocate_shared_memory(gl.float8e4nv, [N2, HEAD_DIM], q2_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(sready.index(i), count=32)  # one cp.async arrive a loader thread
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()

    BTb = BT + b64 * sbtb
    if PER_WARP:
        gl.warp_specialize([
            (_consumer_w, (Q, O, LSE, KS, VS, kbuf, vbuf, ksbuf, vsbuf, q2buf, ready, sready,
                           empty, b64, hk, L, seqlen_q, GROUP, n_tiles, qk_scale, sqb, sqs, sqh,
                           sqd, sob, sos, soh, sod, slb, slh, sls, HEAD_DIM, ROWS, STAGES,
                           SCALE_K, SCALE_V, EARLY)),
            (_loader, (K, V, KS, VS, BTb, kbuf, vbuf, ksbuf, vsbuf, ready, sready, empty, hk,
                       n_tiles, n_blocks, n_kv_heads, max_pages, skn, skp, skh, svn, svp, svh,
                       sksn, sksp, sksh, svsn, svsp, svsh, sbtn, HEAD_DIM, PAGE, BOX, STAGES,
                       SCALE_K, SCALE_V)),
        ], [1], [48])
    else:
        gl.warp_specialize([
            (_consumer, (Q, O, LSE, KS, VS, kbuf, vbuf, ksbuf, vsbuf, q2buf, ready, sready,
                         empty, b64, hk, L, seqlen_q, GROUP, n_tiles, qk_scale, sqb, sqs, sqh,
                         sqd, sob, sos, soh, sod, slb, slh, sls, HEAD_DIM, ROWS, BOX, STAGES,
                         SCALE_K, SCALE_V)),
            (_loader, (K, V, KS, VS, BTb, kbuf, vbuf, ksbuf, vsbuf, ready, sready, empty, hk,
                       n_tiles, n_blocks, n_kv_heads, max_pages, skn, skp, skh, svn, svp, svh,
                       sksn, sksp, sksh, svsn, svsp, svsh, sbtn, HEAD_DIM, PAGE, BOX, STAGES,
                       SCALE_K, SCALE_V)),
        ], [1], [48])
