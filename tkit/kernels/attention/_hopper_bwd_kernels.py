"""The Gluon kernels of the FlashAttention backward for Hopper (sm_90), launched by
``hopper.py``'s :func:`backward`.

Same math and conventions as the Triton backward of :mod:`tkit.kernels.attention._kernels`
(``_attn_bwd_dkdv_kernel`` / ``_attn_bwd_dq_kernel``): P = exp2(qk_scale * Q K^T - lse2),
dS = P * (dP - delta) with dP = dO V^T, dV = P^T dO, dK = scale * dS^T Q, dQ = scale * dS K,
where lse2 = lse * log2(e) and delta = rowsum(dO * O) come from ``_attn_bwd_prep_kernel`` in
rows padded to a multiple of 128 (+inf and 0 past seqlen_q); bottom-right causal
alignment when seqlen_q != seqlen_k. Scope (``hopper_config.bwd_supported``): sm_90, 16-bit
inputs in the (batch, seqlen, heads, head_dim) layout with TMA-compatible strides, head_dim 64
or 128, GQA/MQA, causal or not; no window, softcap or varlen.

Why Gluon: in the Triton dK/dV kernel, Triton 3.6 empties the wgmma queue three times a block
(`wgmma.wait_group 0` after S^T, after dV and dP^T, after dK; `tkit ir flash_attention_train
--arch sm_90 --launch 2 --stage ptx`), so the exponentials and dS run with the tensor cores
idle, and Q comes in transposed through pointer loads. Here each wgmma is issued
asynchronously and waited for only where its result is needed, and every tile arrives by TMA
into a ring of shared-memory slots.

dK/dV (:func:`_attn_bwd_dkdv_hopper_kernel`): a CTA of two warpgroups owns BLOCK_N = 128 keys
of one (batch, key/value head) (each warpgroup 64 of them: the wgmma M of 128 is split over
the 8 warps), K and V resident in shared memory, and streams the BLOCK_M = 64 query blocks of
the GROUP query heads that share them (Q, dO and their lse2 and delta rows by TMA through a
ring of STAGES slots: the rows are read from shared memory where they are used, so they hold no
registers across the wgmmas). Per query block, in program order:

    wait Q_j, dO_j          S^T = K Q_j^T, dP^T = V dO_j^T       both issued async
    wgmma.wait_group 1      S^T ready, dP^T may still run
    P^T = exp2(S^T * qk_scale - lse_j)          (masked on the causal diagonal)
                            dV += P^T dO_j        issued async (A = P^T from registers)
    wgmma.wait_group 1      dP^T ready, dV may still run
    dS^T = P^T * (dP^T - delta_j)
                            dK += dS^T Q_j        issued async (A = dS^T from registers)
    wgmma.wait_group 0      then a CTA barrier and the TMA refill of the slot

dQ (:func:`_attn_bwd_dq_hopper_kernel`): the forward's shape: BLOCK_M = 128 query rows of one
(batch, query head) (two warpgroups), Q and dO resident, K and V streamed in BLOCK_N-key
blocks; per block S = Q K^T and dP = dO V^T issued together, P and dS as above, dQ += dS K
with dS from registers.

The ragged ends need no mask: TMA zero-fills rows past seqlen_q / seqlen_k, a padded query row
has lse2 = +inf (so P = 0) and a zero dO row, and a zero key row adds nothing to dQ (its dK and
dV rows are never stored: the TMA store clips them). Rows that see no key (lse = -inf, causal
with seqlen_q > seqlen_k) lie only in masked blocks, where the mask selects 0 before any use.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from tkit.kernels._gluon import cta_barrier, tma_load, tma_store
from tkit.kernels.attention._hopper_kernels import _wgmma_acc_layout


# --------------------------------------------------------------------------------------------
# dK, dV
# --------------------------------------------------------------------------------------------
@gluon.jit
def _issue_qdo(q_desc, do_desc, rows_desc, ring, t, n_m, m_lo, b, hk, GROUP, H, PQ, n_total,
               BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """After a CTA barrier, TMA of step t's Q and dO tiles (query head hk * GROUP + t // n_m,
    rows m_lo + (t % n_m) * BLOCK_M) and their lse2 / delta rows into ring slot t % STAGES,
    each on its own mbarrier (two copies completing on one mbarrier would make Triton put a
    CTA barrier between them: see QRing); skipped past the last step."""
    pred = t < n_total
    slot = t % STAGES
    g = t // gl.maximum(n_m, 1)
    m0 = m_lo + (t - g * n_m) * BLOCK_M
    h = hk * GROUP + g
    qb = ring.q_bars.index(slot)
    dob = ring.do_bars.index(slot)
    rb = ring.row_bars.index(slot)
    mbarrier.expect(qb, q_desc.block_type.nbytes, pred=pred)
    mbarrier.expect(dob, do_desc.block_type.nbytes, pred=pred)
    mbarrier.expect(rb, rows_desc.block_type.nbytes, pred=pred)
    cta_barrier()  # both warpgroups are past the slot's readers
    tma_load(q_desc, [b, m0, h, 0], qb, ring.q.index(slot), pred=pred)
    tma_load(do_desc, [b, m0, h, 0], dob, ring.do.index(slot), pred=pred)
    # a query block's lse2 row then its delta row (the prep kernel's layout)
    tma_load(rows_desc, [2 * ((b * H + h) * PQ + m0)], rb, ring.rows.index(slot), pred=pred)


@gluon.jit
def _dkdv_step(g, i, dk, dv, k_op, v_op, ring, n_m, m_lo, shift, keys, qk_scale,
               s_layout: gl.constexpr, a_layout: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
               MASKED: gl.constexpr):
    """Query block i of query head hk * GROUP + g (ring step t = g * n_m + i) of the dK/dV
    kernel; returns (dk, dv) with every wgmma of the step retired."""
    t = g * n_m + i
    slot = t % STAGES
    phase = (t // STAGES) & 1
    q_j = ring.q.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do_j = ring.do.index(slot).reshape([BLOCK_M, HEAD_DIM])
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    mbarrier.wait(ring.q_bars.index(slot), phase)
    st_tok = warpgroup_mma(k_op, q_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(ring.do_bars.index(slot), phase)
    dpt_tok = warpgroup_mma(v_op, do_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    # lse2 = lse * log2(e), +inf for a query row past the end (its P^T column is 0; its Q and
    # dO rows are zero)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    mbarrier.wait(ring.row_bars.index(slot), phase)
    row = ring.rows.index(slot)
    lse = row.slice(0, BLOCK_M).load(col_layout)
    st = warpgroup_mma_wait(1, deps=(st_tok, k_op, q_j))[0]
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
    if MASKED:  # key j is visible from query row i when j <= i + shift
        cols = m_lo + i * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_layout)
        ok = gl.expand_dims(keys, 1) <= gl.expand_dims(cols + shift, 0)
        pt = gl.where(ok, pt, 0.0)
    p16 = gl.convert_layout(pt.to(q_j.dtype), a_layout)
    dv_tok = warpgroup_mma(p16, do_j, dv, is_async=True)
    delta = row.slice(BLOCK_M, BLOCK_M).load(col_layout)
    dpt = warpgroup_mma_wait(1, deps=(dpt_tok, v_op, do_j))[0]
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    ds16 = gl.convert_layout(dst.to(q_j.dtype), a_layout)
    dk_tok = warpgroup_mma(ds16, q_j, dk, is_async=True)
    done = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p16, ds16, q_j, do_j))
    return done[1], done[0]


@aggregate
class QRing:
    """The dK/dV kernel's ring of STAGES slots: Q and dO tiles, their lse2 and delta rows (one
    buffer of 2 x BLOCK_M), and an mbarrier a copy, each kind in its own allocation (Triton's
    barrier analysis tracks an allocation as a whole: two mbarriers of one allocation, used one
    after the other, get a CTA barrier between them)."""

    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    rows: gl.shared_memory_descriptor
    q_bars: gl.shared_memory_descriptor
    do_bars: gl.shared_memory_descriptor
    row_bars: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q, do, rows, q_bars, do_bars, row_bars):
        self.q = q
        self.do = do
        self.rows = rows
        self.q_bars = q_bars
        self.do_bars = do_bars
        self.row_bars = row_bars


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "HK", "GROUP", "PQ"])
def _attn_bwd_dkdv_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, rows_desc,
    seqlen_q, seqlen_k, HK, GROUP, PQ, sm_scale, qk_scale,
    CAUSAL: gl.constexpr, STAGES: gl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, key/value head), summed over the GROUP query
    heads that share it. Grid (batch * HK, key blocks): all heads of a key block before the
    next block, the first (causal: the longest) first.

    q_desc, do_desc: TMA descriptors over (batch, seqlen_q, heads, head_dim), block
    [1, BLOCK_M, 1, head_dim]; k_desc, v_desc, dk_desc, dv_desc: over (batch, seqlen_k, kv
    heads, head_dim), block [1, BLOCK_N, 1, head_dim]; rows_desc: 1-D over the prep kernel's
    rows (each query block of each head: its 64 lse2 then its 64 delta values), block
    [2 * BLOCK_M]."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_acc_layout(gl.num_warps(), BLOCK_M)
    o_layout: gl.constexpr = _wgmma_acc_layout(gl.num_warps(), HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    pid_bh = gl.program_id(0)
    b = pid_bh // HK
    hk = pid_bh % HK
    H = HK * GROUP
    n0 = gl.program_id(1) * BLOCK_N
    shift = seqlen_k - seqlen_q

    # ---- query blocks: [m_lo, full_lo) on the causal diagonal (masked), [full_lo, m_hi) not
    if CAUSAL:
        m_lo = (gl.maximum(n0 - shift, 0) // BLOCK_M) * BLOCK_M
        full_lo = gl.minimum(gl.maximum(n0 + BLOCK_N - 1 - shift + BLOCK_M - 1, 0) // BLOCK_M
                             * BLOCK_M, gl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M)
        full_lo = gl.maximum(full_lo, m_lo)
    else:
        m_lo = 0
        full_lo = 0
    m_hi = gl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    n_m = gl.maximum(m_hi - m_lo, 0) // BLOCK_M
    n_masked = (full_lo - m_lo) // BLOCK_M
    n_total = GROUP * n_m

    # ---- shared memory: K and V (later dK and dV's staging), the ring, mbarriers
    k_s = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    ring = QRing(
        gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout),
        gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout),
        gl.allocate_shared_memory(gl.float32, [STAGES, 2 * BLOCK_M], rows_desc.layout),
        gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()))
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(k_bar, count=1)
    mbarrier.init(v_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ring.q_bars.index(i), count=1)
        mbarrier.init(ring.do_bars.index(i), count=1)
        mbarrier.init(ring.row_bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(k_bar, k_desc.block_type.nbytes)
    mbarrier.expect(v_bar, v_desc.block_type.nbytes)
    cta_barrier()
    tma_load(k_desc, [b, n0, hk, 0], k_bar, k_s)
    tma_load(v_desc, [b, n0, hk, 0], v_bar, v_s)
    for i in gl.static_range(STAGES):
        _issue_qdo(q_desc, do_desc, rows_desc, ring, i, n_m, m_lo, b, hk, GROUP, H, PQ,
                   n_total, BLOCK_M, STAGES)

    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, o_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, o_layout)
    k_op = k_s.reshape([BLOCK_N, HEAD_DIM])
    v_op = v_s.reshape([BLOCK_N, HEAD_DIM])
    mbarrier.wait(k_bar, 0)
    mbarrier.wait(v_bar, 0)

    for g in range(GROUP):
        for w in range(n_masked):
            dk, dv = _dkdv_step(g, w, dk, dv, k_op, v_op, ring, n_m, m_lo, shift, keys,
                                qk_scale, s_layout, a_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                                STAGES, True)
            _issue_qdo(q_desc, do_desc, rows_desc, ring, g * n_m + w + STAGES, n_m, m_lo, b,
                       hk, GROUP, H, PQ, n_total, BLOCK_M, STAGES)
        for u in range(n_masked, n_m):
            dk, dv = _dkdv_step(g, u, dk, dv, k_op, v_op, ring, n_m, m_lo, shift, keys,
                                qk_scale, s_layout, a_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                                STAGES, False)
            _issue_qdo(q_desc, do_desc, rows_desc, ring, g * n_m + u + STAGES, n_m, m_lo, b,
                       hk, GROUP, H, PQ, n_total, BLOCK_M, STAGES)

    # ---- dK (scaled) and dV through K's and V's buffers and TMA stores
    cta_barrier()  # every wgmma reading K and V has retired in both warpgroups
    k_op.store((dk * sm_scale).to(dtype))
    v_op.store(dv.to(dtype))
    fence_async_shared()
    cta_barrier()
    tma_store(dk_desc, [b, n0, hk, 0], k_s)
    tma_store(dv_desc, [b, n0, hk, 0], v_s)
    tma.store_wait(0)
    mbarrier.invalidate(k_bar)
    mbarrier.invalidate(v_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ring.q_bars.index(i))
        mbarrier.invalidate(ring.do_bars.index(i))
        mbarrier.invalidate(ring.row_bars.index(i))


# --------------------------------------------------------------------------------------------
# dQ
# --------------------------------------------------------------------------------------------
@gluon.jit
def _issue_kv(k_desc, v_desc, k_s, v_s, k_bars, v_bars, j, b, hk, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """After a CTA barrier, TMA of key block j's K and V into ring slot j % STAGES, each on
    its own mbarrier (from two allocations: see QRing); skipped past the last block."""
    pred = j < n_tiles
    slot = j % STAGES
    kb = k_bars.index(slot)
    vb = v_bars.index(slot)
    mbarrier.expect(kb, k_desc.block_type.nbytes, pred=pred)
    mbarrier.expect(vb, v_desc.block_type.nbytes, pred=pred)
    cta_barrier()  # both warpgroups are past the slot's readers
    tma_load(k_desc, [b, j * BLOCK_N, hk, 0], kb, k_s.index(slot), pred=pred)
    tma_load(v_desc, [b, j * BLOCK_N, hk, 0], vb, v_s.index(slot), pred=pred)


@gluon.jit
def _dq_step(j, dq, q_op, do_op, k_s, v_s, k_bars, v_bars, lse, delta, rows, shift,
             qk_scale, s_layout: gl.constexpr, a_layout: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
             MASKED: gl.constexpr):
    """Key block j of the dQ kernel; returns dq with every wgmma of the step retired."""
    slot = j % STAGES
    k_j = k_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
    v_j = v_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q_op, k_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_bars.index(slot), (j // STAGES) & 1)
    dp_tok = warpgroup_mma(do_op, v_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, q_op, k_j))[0]
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
    if MASKED:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = gl.expand_dims(cols, 0) <= gl.expand_dims(rows + shift, 1)
        p = gl.where(ok, p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp_tok, do_op, v_j))[0]
    ds = p * (dp - gl.expand_dims(delta, 1))
    ds16 = gl.convert_layout(ds.to(k_j.dtype), a_layout)
    dq_tok = warpgroup_mma(ds16, k_j, dq, is_async=True)
    return warpgroup_mma_wait(0, deps=(dq_tok, ds16, k_j))[0]


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "H", "GROUP", "PQ"])
def _attn_bwd_dq_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, ROWS,
    seqlen_q, seqlen_k, H, GROUP, PQ, sm_scale, qk_scale,
    CAUSAL: gl.constexpr, STAGES: gl.constexpr,
):
    """One program: dQ of BLOCK_M query rows of one (batch, query head). Grid (batch * H,
    query blocks), causal: the last (longest) query blocks first. Descriptors: q_desc,
    do_desc, dq_desc block [1, BLOCK_M, 1, head_dim]; k_desc, v_desc [1, BLOCK_N, 1,
    head_dim]; ROWS: the prep kernel's rows; the rest as in
    :func:`_attn_bwd_dkdv_hopper_kernel`."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_acc_layout(gl.num_warps(), BLOCK_N)
    o_layout: gl.constexpr = _wgmma_acc_layout(gl.num_warps(), HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    pid_bh = gl.program_id(0)
    pid_m = gl.program_id(1)
    if CAUSAL:
        pid_m = gl.num_programs(1) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    shift = seqlen_k - seqlen_q

    # ---- key blocks: [0, n_full) fully visible, [n_full, n_tiles) masked
    if CAUSAL:
        hi = gl.minimum(gl.maximum(m0 + BLOCK_M + shift, 0), seqlen_k)
        full_end = gl.minimum(gl.maximum(m0 + shift + 1, 0), seqlen_k)
    else:
        hi = seqlen_k
        full_end = seqlen_k
    n_tiles = gl.cdiv(hi, BLOCK_N)
    n_full = full_end // BLOCK_N

    q_s = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(do_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    mbarrier.expect(do_bar, do_desc.block_type.nbytes)
    cta_barrier()
    tma_load(q_desc, [b, m0, h, 0], q_bar, q_s)
    tma_load(do_desc, [b, m0, h, 0], do_bar, do_s)
    for i in gl.static_range(STAGES):
        _issue_kv(k_desc, v_desc, k_s, v_s, k_bars, v_bars, i, b, hk, n_tiles, BLOCK_N, STAGES)

    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    # the prep kernel's rows: each 64-row block's lse2 then its delta; PQ is a multiple of
    # BLOCK_M, so no mask
    row_off = pid_bh.to(gl.int64) * (2 * PQ) + (rows // 64) * 128 + rows % 64
    lse = gl.load(ROWS + row_off)
    delta = gl.load(ROWS + row_off + 64)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    q_op = q_s.reshape([BLOCK_M, HEAD_DIM])
    do_op = do_s.reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(do_bar, 0)

    for j in range(0, n_full):
        dq = _dq_step(j, dq, q_op, do_op, k_s, v_s, k_bars, v_bars, lse, delta, rows, shift,
                      qk_scale, s_layout, a_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, False)
        _issue_kv(k_desc, v_desc, k_s, v_s, k_bars, v_bars, j + STAGES, b, hk, n_tiles,
                  BLOCK_N, STAGES)
    for j in range(n_full, n_tiles):
        dq = _dq_step(j, dq, q_op, do_op, k_s, v_s, k_bars, v_bars, lse, delta, rows, shift,
                      qk_scale, s_layout, a_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)
        _issue_kv(k_desc, v_desc, k_s, v_s, k_bars, v_bars, j + STAGES, b, hk, n_tiles,
                  BLOCK_N, STAGES)

    # ---- dQ (scaled) through Q's buffer and a TMA store
    cta_barrier()
    q_op.store((dq * sm_scale).to(dtype))
    fence_async_shared()
    cta_barrier()
    tma_store(dq_desc, [b, m0, h, 0], q_s)
    tma.store_wait(0)
    mbarrier.invalidate(q_bar)
    mbarrier.invalidate(do_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
