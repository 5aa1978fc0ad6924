"""The Gluon kernels of the FlashAttention forward for Hopper (sm_90), with the QK^T and PV
wgmmas overlapped with the softmax (launched by ``hopper.py``).

Same math, conventions and outputs as :mod:`tkit.kernels.attention` (its ``_fwd_impl``):
``S = scale * Q K^T`` in base 2 (``qk_scale = scale * log2(e)``, exp2), bottom-right causal
alignment when ``seqlen_q != seqlen_k``, a row with no visible key gives O = 0 and lse = -inf,
lse in natural log, float32 (batch, heads, seqlen_q). Scope (:func:`supported`): sm_90, 16-bit
inputs in the (batch, seqlen, heads, head_dim) layout with TMA-compatible strides, head_dim 64,
128 or 256, GQA/MQA, causal or not; no window, softcap or varlen (those stay on the Triton kernel).

Why a second kernel: Triton 3.6 issues the QK^T wgmma of a key block, waits for it to complete
(``wgmma.wait_group 0``) and only then runs the exponentials, so the tensor cores idle during
the softmax; its pipeliner cannot make that dot asynchronous because its result is used in the
same iteration. Here the schedule is written out by hand. Per CTA, BLOCK_M = 128 query rows in
two warpgroups (num_warps = 8, warps along M: each warpgroup owns 64 rows and issues its own
wgmmas); per key block j, in program order:

    wait K_j (mbarrier)         S_j = Q K_j^T        issued async (A = Q from shared memory)
    wait V_{j-1} (mbarrier)     O  += P_{j-1} V_{j-1} issued async (A = P from registers)
    wgmma.wait_group 1          S_j is ready, PV_{j-1} may still run
    softmax of S_j              row max, exp2, row sum: overlaps PV_{j-1} on the tensor cores
    wait Q's (completed) mbarrier: a basic-block boundary that keeps ptxas from hoisting
                                the next wait above the exponentials
    wgmma.wait_group 0          O is ready
    O *= alpha_j;  P_j = bf16(p_j) in the wgmma A-operand register layout
    CTA barrier, then TMA refill of K's slot of block j with block j+STAGES and of V's slot
    of block j-1 with block j-1+STAGES

K and V tiles stream through two rings of STAGES shared-memory slots (one mbarrier per tile for
K and one for V); Q is loaded once by TMA and reused as the staging buffer of the output's TMA
store. A slot is refilled only after both warpgroups have passed the wait that retires the last
wgmma reading it (the CTA barrier: the TMA is issued by one thread, while each warpgroup only
knows about its own wgmmas). K's last reader is S_j, V's is PV_j one block later, so the K ring
runs a block ahead of the V ring: refilled together (a slot freed once PV had read it), a block's
K would be issued only one block before its scores at STAGES = 2 (the 64 KB tiles of D=256),
its load latency in the open each block; apart, every load has a whole block to land (D=256:
0.77-0.83x cuDNN together, 0.90-1.06x apart; docs/NOTES.md).

Causal key ranges as in _kernels.py: the key blocks fully visible to every row of the query
block run without mask arithmetic, then the diagonal blocks (and the ragged end of the keys)
with it. TMA zero-fills rows past seqlen_k (and seqlen_q), so the masked scores are the only
place where the ragged end matters. Tile order: the L2 sections of
:func:`tkit.kernels.attention.fwd_head_group` and, when causal, the last query blocks first.

Warp-specialized variant (config ``WS=True``, :func:`_attn_fwd_hopper_ws_kernel`): the same
per-block math, but the CTA is split with ``gl.warp_specialize`` into three partitions:
consumer warpgroup 0 (the default partition, 4 warps), consumer warpgroup 1 (4 warps) and a
1-warp loader. Each consumer owns 64 query rows with its own half of Q (its own TMA tile) and
runs the schedule above on them, through its own epilogue. The loader issues every TMA (Q, then
K and V of each key block) and refills a ring slot once both consumers have arrived on the
slot's "empty" mbarrier (count 2: one arrive per warpgroup; K's after the wgmma.wait_group that
retires the block's scores, V's after the one that retires its PV). Nothing in the key loop
synchronizes the two warpgroups any more: the barriers left there are Triton's, each over one
warpgroup's 128 threads (``bar.sync id, 128``, all inserted by Triton; under 3.6 three a block:
one at the loop head, ahead of the mbarrier waits, one ahead of each arrive, which one thread
issues for the warpgroup; 3.9 places two), so the two softmaxes can drift apart and one
warpgroup's wgmmas run under the other's exponentials. Registers: the loader's warpgroup is cut
to 24 a thread and each consumer warpgroup gets 240 (launch cap WS_MAXNREG = 168 for 3
warpgroups). That cap also means one CTA an SM at D=64, where the non-WS kernel (108 to 167
registers a thread) holds two wherever its shared memory allows; a config can lower the cap and
the consumers' share (``CONSUMER_REGS``, the ``WS_TWO_CTA_*`` registers of hopper_config) to
hold two there as well.

Persistent variant (config ``PERSISTENT=True``, :func:`_attn_fwd_hopper_persistent_kernel`):
the warp-specialized kernel with at most one CTA an SM, each taking tiles (in the per-tile
grid's order) from a per-launch counter until none is left. Why: with one CTA an SM, a
per-tile CTA starts with the tensor cores idle (Q and the first K and V blocks in flight, the
first block's scores without a PV under them) and ends the same way (the epilogue's
normalisation and store); at short tiles (B32 x 512 causal: 2.5 key blocks a tile) that was a
third of the time. Here the loader runs into the next tile's K, V and Q while the consumers
finish the current one, and a tile's output store runs under the next tile's first block. The
ring numbering and its mbarrier phases run on across tiles; two Q buffers alternate (the next
tile's Q lands while the current one's buffer holds its output), so the ring is shallower than
the per-tile kernel's at the same shared memory, which is why long tiles stay there.
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

# the Gluon names that moved between Triton versions (tkit/kernels/_gluon.py)
from tkit.kernels._gluon import cta_barrier, tma_load, tma_store
from tkit.kernels.attention.hopper_config import WS_CONSUMER_REGS, WS_LOADER_REGS


# --------------------------------------------------------------------------------------------
# Shared memory
# --------------------------------------------------------------------------------------------
# This module has no ``from __future__ import annotations``: Triton 3.6 checks an aggregate's
# fields with isinstance against the annotations themselves, which must be classes.
@aggregate
class SharedBuffers:
    """A CTA's shared memory, as both kernels use it: ``q`` the Q tile (the two consumer
    halves in the warp-specialized kernel; later the output's staging buffer), ``k`` and ``v``
    the rings of STAGES key / value tiles, ``q_bar`` Q's mbarrier and ``k_bars`` / ``v_bars``
    one mbarrier a K / V slot. The warp-specialized kernel's "empty" barriers (one a slot,
    which the one-partition kernel has no use for) travel beside it."""

    q: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    k_bars: gl.shared_memory_descriptor
    v_bars: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q, k, v, q_bar, k_bars, v_bars):
        self.q = q
        self.k = k
        self.v = v
        self.q_bar = q_bar
        self.k_bars = k_bars
        self.v_bars = v_bars


@gluon.jit
def _allocate(q_desc, k_desc, v_desc, STAGES: gl.constexpr, WS: gl.constexpr,
              Q_BUFFERS: gl.constexpr = 1):
    """The SharedBuffers of one CTA, every mbarrier initialized (count 1) and fenced. WS: the Q
    buffer holds two tiles (one a consumer warpgroup) and the slots' "empty" barriers (count 2:
    one arrive per consumer warpgroup) come back too, as ``(buffers, empty_bars)``.
    Q_BUFFERS 2 (the persistent kernel): two such Q buffers (halves 2i, 2i + 1) and ``q_bar``
    two mbarriers, one each."""
    dtype: gl.constexpr = q_desc.dtype
    if WS:
        q = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS] + q_desc.block_type.shape,
                                      q_desc.layout)
    else:
        q = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if Q_BUFFERS == 1:
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    else:
        q_bar = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if WS:
        # K's slots first, then V's
        empty_bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1],
                                               mbarrier.MBarrierLayout())
    if Q_BUFFERS == 1:
        mbarrier.init(q_bar, count=1)
    else:
        for i in gl.static_range(Q_BUFFERS):
            mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        if WS:
            mbarrier.init(empty_bars.index(i), count=2)
            mbarrier.init(empty_bars.index(STAGES + i), count=2)
    fence_async_shared()
    smem = SharedBuffers(q, k, v, q_bar, k_bars, v_bars)
    if WS:
        return smem, empty_bars
    else:
        return smem


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _wgmma_acc_layout(num_warps, n):
    """The register layout of a wgmma accumulator n columns wide (S: BLOCK_N, O: HEAD_DIM), the
    warps stacked along the rows (each warpgroup owns 64 of them)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 16])


@gluon.jit
def _issue_kv(k_desc, v_desc, smem, k_tile, v_tile, b, hk, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V: gl.constexpr = True):
    """After a CTA barrier, TMA K of key block ``k_tile`` into K's ring slot k_tile % STAGES
    and (``V``) V of block ``v_tile`` into V's slot v_tile % STAGES, each skipped past the
    last block."""
    k_pred = k_tile < n_tiles
    kb = smem.k_bars.index(k_tile % STAGES)
    mbarrier.expect(kb, k_desc.block_type.nbytes, pred=k_pred)
    if V:
        v_pred = v_tile < n_tiles
        vb = smem.v_bars.index(v_tile % STAGES)
        mbarrier.expect(vb, v_desc.block_type.nbytes, pred=v_pred)
    cta_barrier()
    tma_load(k_desc, [b, k_tile * BLOCK_N, hk, 0], kb, smem.k.index(k_tile % STAGES),
             pred=k_pred)
    if V:
        tma_load(v_desc, [b, v_tile * BLOCK_N, hk, 0], vb, smem.v.index(v_tile % STAGES),
                 pred=v_pred)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, n0, rows, seqlen_k, shift,
                  s_layout: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                  MASKED: gl.constexpr):
    """Online softmax of one score tile (raw Q K^T, float32): returns p (unnormalised, float32),
    the new running max/sum and alpha = exp2(m_old - m_new), the accumulator's rescale."""
    if MASKED:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = gl.expand_dims(cols < seqlen_k, 0)
        if CAUSAL:
            ok = ok & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + shift, 1))
        s = gl.where(ok, s, float("-inf"))
    # scale > 0 commutes with the max: one FMA a score in the exponent's argument
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if MASKED:  # a row with no visible key so far keeps m = -inf: subtract 0 instead
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _overlapped_step(j, o, p, m_i, l_i, q_op, smem, qk_scale, rows, seqlen_k, shift, base,
                     q_bar, q_phase, s_layout: gl.constexpr, ROWS_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    """Key block j >= 1, the part both schedules share: S_j issued, PV_{j-1} issued, the
    softmax of S_j under PV_{j-1}, then PV_{j-1} retired. Returns (o, p_j unconverted, m, l,
    alpha, the ring slot of block j-1, now free of this warpgroup's readers). ``q_op``: this
    warpgroup's Q rows, [ROWS_M, HEAD_DIM], the QK^T wgmma's A operand. Block j is the ring's
    block ``base + j`` (the persistent kernel numbers its blocks across its tiles), ``q_bar``
    the mbarrier of this tile's Q, completed in phase ``q_phase``."""
    g = base + j
    slot = g % STAGES
    mbarrier.wait(smem.k_bars.index(slot), (g // STAGES) & 1)
    k_t = smem.k.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    s_zero = gl.zeros([ROWS_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_op, k_t, s_zero, use_acc=False, is_async=True)
    prev = g - 1
    pslot = prev % STAGES
    mbarrier.wait(smem.v_bars.index(pslot), (prev // STAGES) & 1)
    v_prev = smem.v.index(pslot).reshape([BLOCK_N, HEAD_DIM])
    o_tok = warpgroup_mma(p, v_prev, o, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, q_op, k_t))[0]
    p_new, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, j * BLOCK_N, rows, seqlen_k,
                                           shift, s_layout, BLOCK_N, CAUSAL, MASKED)
    # a basic-block boundary (a wait on Q's barrier, whose phase completed long ago): without
    # it ptxas schedules the wgmma.wait_group 0 below up into the softmax, before the
    # exponentials, and they no longer overlap the PV wgmma
    mbarrier.wait(q_bar, q_phase)
    o = warpgroup_mma_wait(0, deps=(o_tok, p, v_prev))[0]
    return o, p_new, m_i, l_i, alpha, pslot


@gluon.jit
def _rescale(o, p_new, alpha, o_layout: gl.constexpr, p_layout: gl.constexpr,
             dtype: gl.constexpr):
    """O *= alpha_j; P_j in the wgmma A-operand register layout."""
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return o, gl.convert_layout(p_new.to(dtype), p_layout)


@gluon.jit
def _block_step(j, o, p, m_i, l_i, q_op, smem, k_desc, v_desc, qk_scale, rows, seqlen_k, shift,
                b, hk, n_tiles,
                s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    """Key block j >= 1 of the one-partition kernel: the overlapped step, then the ring slots
    it freed refilled by TMA."""
    o, p_new, m_i, l_i, alpha, pslot = _overlapped_step(
        j, o, p, m_i, l_i, q_op, smem, qk_scale, rows, seqlen_k, shift, 0, smem.q_bar, 0,
        s_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASKED)
    o, p = _rescale(o, p_new, alpha, o_layout, p_layout, q_op.dtype)
    # refill once both warpgroups are past the wgmmas that read the slots (the CTA barrier
    # inside _issue_kv): K's slot of block j (S_j has retired) with block j + STAGES, V's of
    # block j - 1 with block j - 1 + STAGES
    _issue_kv(k_desc, v_desc, smem, j + STAGES, j - 1 + STAGES, b, hk, n_tiles, BLOCK_N, STAGES)
    return o, p, m_i, l_i


@gluon.jit
def _first_block(q_op, smem, m_i, l_i, qk_scale, rows, seqlen_k, shift, base, q_bar, q_phase,
                 s_layout: gl.constexpr, p_layout: gl.constexpr, ROWS_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """Key block 0 (the ring's block ``base``): S_0 and its softmax (masked: it may be a
    diagonal or ragged block), P_0 in the wgmma A-operand layout; Q's mbarrier ``q_bar`` is
    waited for in phase ``q_phase``."""
    mbarrier.wait(q_bar, q_phase)
    slot = base % STAGES
    mbarrier.wait(smem.k_bars.index(slot), (base // STAGES) & 1)
    k_t = smem.k.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    s_tok = warpgroup_mma(q_op, k_t, gl.zeros([ROWS_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, q_op, k_t))[0]
    p0, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, 0, rows, seqlen_k, shift,
                                        s_layout, BLOCK_N, CAUSAL, True)
    return gl.convert_layout(p0.to(q_op.dtype), p_layout), m_i, l_i


@gluon.jit
def _last_pv(o, p, smem, n_tiles, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr, base=0):
    """O += P V of the last key block (the ring's block ``base + n_tiles - 1``), waited
    for."""
    last = base + n_tiles - 1
    lslot = last % STAGES
    mbarrier.wait(smem.v_bars.index(lslot), (last // STAGES) & 1)
    v_last = smem.v.index(lslot).reshape([BLOCK_N, HEAD_DIM])
    o_tok = warpgroup_mma(p, v_last, o, is_async=True)
    return warpgroup_mma_wait(0, deps=(o_tok, p, v_last))[0]


@gluon.jit
def _epilogue(o, m_i, l_i, rows, out_smem, out_smem4, o_desc, LSE, slb, slh, b, h, row0,
              seqlen_q, o_layout: gl.constexpr, WAIT: gl.constexpr = True):
    """O / l stored through ``out_smem`` (the Q buffer, once every wgmma reading it has
    retired) and a TMA store at row ``row0``, waited for unless not ``WAIT``; lse in natural
    log (-inf for empty rows)."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    inv_l = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
    out = (o * gl.expand_dims(inv_l, 1)).to(out_smem.dtype)
    cta_barrier()  # every warp is past its last wait: the Q buffer is free
    out_smem.store(out)
    fence_async_shared()
    cta_barrier()
    tma_store(o_desc, [b, row0, h, 0], out_smem4)
    lse_ptrs = LSE + b.to(gl.int64) * slb + h.to(gl.int64) * slh + rows
    gl.store(lse_ptrs, lse, mask=rows < seqlen_q)
    if WAIT:
        tma.store_wait(0)


@gluon.jit
def _tile_origin(H, GROUP, HEAD_GROUP, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch, query head, key/value head, first query row) of this program (grid (batch *
    heads, query blocks)): :func:`_tile_coords` of its tile."""
    n_bh = gl.num_programs(0)
    return _tile_coords(gl.program_id(1) * n_bh + gl.program_id(0), n_bh, gl.num_programs(1),
                        H, GROUP, HEAD_GROUP, BLOCK_M, CAUSAL)


@gluon.jit
def _tile_coords(tile, n_bh, n_m, H, GROUP, HEAD_GROUP, BLOCK_M: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """(batch, query head, key/value head, first query row) of work tile ``tile`` of n_bh *
    n_m. Tile order: sections of HEAD_GROUP (batch, head) pairs; causal: the last query
    blocks first."""
    section = tile // (HEAD_GROUP * n_m)
    first_bh = section * HEAD_GROUP
    heads_here = gl.minimum(n_bh - first_bh, HEAD_GROUP)
    r = tile - first_bh * n_m
    pid_m = r // heads_here
    pid_bh = first_bh + r % heads_here
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    return b, h, h // GROUP, pid_m * BLOCK_M


# integer arguments are not specialized (no recompiles across sequence lengths or head counts;
# none of them feeds a vectorized address: memory goes through the TMA descriptors)
@gluon.jit(do_not_specialize=["slb", "slh", "seqlen_q", "seqlen_k", "H", "GROUP", "HEAD_GROUP"])
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, slb, slh,
    seqlen_q, seqlen_k, H, GROUP, HEAD_GROUP, qk_scale,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head).

    q_desc, o_desc: TMA descriptors over (batch, seqlen_q, heads, head_dim), block
    [1, BLOCK_M, 1, head_dim]; k_desc, v_desc: over (batch, seqlen_k, kv heads, head_dim),
    block [1, BLOCK_N, 1, head_dim]; LSE: float32 at ``b*slb + h*slh + row`` (rows contiguous).
    ``qk_scale`` = scale*log2(e); GROUP = query heads per key/value head; HEAD_GROUP the
    section size of the tile order (see _kernels.py's ``_attn_fwd_kernel``).
    """
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    s_layout: gl.constexpr = _wgmma_acc_layout(gl.num_warps(), BLOCK_N)
    o_layout: gl.constexpr = _wgmma_acc_layout(gl.num_warps(), HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    b, h, hk, m0 = _tile_origin(H, GROUP, HEAD_GROUP, BLOCK_M, CAUSAL)

    # ---- key ranges: [0, n_full) fully visible blocks, [n_full, n_tiles) masked ones
    shift = seqlen_k - seqlen_q
    if CAUSAL:
        hi = gl.minimum(gl.maximum(m0 + BLOCK_M + shift, 0), seqlen_k)
        full_end = gl.minimum(gl.maximum(m0 + shift + 1, 0), seqlen_k)
    else:
        hi = seqlen_k
        full_end = seqlen_k
    # at least one block: a query block that sees no key masks all of block 0 (O = 0,
    # lse = -inf come out of the same code)
    n_tiles = gl.maximum((hi + BLOCK_N - 1) // BLOCK_N, 1)
    n_full = full_end // BLOCK_N

    # ---- shared memory: Q (later the output's staging buffer), K/V rings, mbarriers
    smem = _allocate(q_desc, k_desc, v_desc, STAGES, False)
    q_op = smem.q.reshape([BLOCK_M, HEAD_DIM])
    mbarrier.expect(smem.q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [b, m0, h, 0], smem.q_bar, smem.q)
    for i in gl.static_range(STAGES):
        _issue_kv(k_desc, v_desc, smem, i, i, b, hk, n_tiles, BLOCK_N, STAGES)

    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    # ---- block 0: S_0 and its softmax (masked: it may be a diagonal or ragged block)
    p, m_i, l_i = _first_block(q_op, smem, m_i, l_i, qk_scale, rows, seqlen_k, shift, 0,
                               smem.q_bar, 0, s_layout, p_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                               STAGES, CAUSAL)
    # S_0 has retired in both warpgroups: K's slot 0 takes block STAGES
    _issue_kv(k_desc, v_desc, smem, STAGES, 0, b, hk, n_tiles, BLOCK_N, STAGES, False)

    # ---- blocks 1..: fully visible ones without masks, then the masked ones
    for j in range(1, n_full):
        o, p, m_i, l_i = _block_step(j, o, p, m_i, l_i, q_op, smem, k_desc, v_desc, qk_scale,
                                     rows, seqlen_k, shift, b, hk, n_tiles, s_layout, o_layout,
                                     p_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, False)
    for j in range(gl.maximum(n_full, 1), n_tiles):
        o, p, m_i, l_i = _block_step(j, o, p, m_i, l_i, q_op, smem, k_desc, v_desc, qk_scale,
                                     rows, seqlen_k, shift, b, hk, n_tiles, s_layout, o_layout,
                                     p_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, True)

    # ---- last PV, then O / l through the Q buffer and a TMA store; lse in natural log
    o = _last_pv(o, p, smem, n_tiles, BLOCK_N, HEAD_DIM, STAGES)
    _epilogue(o, m_i, l_i, rows, q_op, smem.q, o_desc, LSE, slb, slh, b, h, m0, seqlen_q,
              o_layout)
    mbarrier.invalidate(smem.q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(smem.k_bars.index(i))
        mbarrier.invalidate(smem.v_bars.index(i))


# --------------------------------------------------------------------------------------------
# Warp-specialized kernel (config WS=True)
# --------------------------------------------------------------------------------------------
@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, smem, empty_bars, b, h, hk, m0, n_tiles,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loader partition (one warp): both halves of Q, then K and V of every key block into
    the ring. Slot t % STAGES is refilled with block t once both consumer warpgroups have
    arrived on its empty barrier for block t - STAGES."""
    _load_tile(q_desc, k_desc, v_desc, smem, smem.q_bar, smem.q.index(0), smem.q.index(1),
               empty_bars, b, h, hk, m0, n_tiles, 0, BLOCK_N, STAGES)


@gluon.jit
def _load_tile(q_desc, k_desc, v_desc, smem, q_bar, q_lo, q_hi, empty_bars, b, h, hk, m0,
               n_tiles, base, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One tile's loads (the loader warp): both halves of Q into ``q_lo`` / ``q_hi`` on
    ``q_bar``, then K and V of its n_tiles key blocks, the ring's blocks ``base`` on: block g
    goes to slot g % STAGES once both consumer warpgroups have arrived on the slot's empty
    barrier for block g - STAGES: K's slot on barrier ``slot``, V's on ``STAGES + slot`` (K's
    is handed back a block earlier, once its scores have retired)."""
    HALF_M: gl.constexpr = q_desc.block_type.shape[1]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [b, m0, h, 0], q_bar, q_lo)
    tma_load(q_desc, [b, m0 + HALF_M, h, 0], q_bar, q_hi)
    for t in range(n_tiles):
        g = base + t
        slot = g % STAGES
        # a fresh mbarrier reads as if the phase before phase 0 had completed: the first
        # STAGES waits (parity 1) return at once
        mbarrier.wait(empty_bars.index(slot), ((g // STAGES) & 1) ^ 1)
        kb = smem.k_bars.index(slot)
        vb = smem.v_bars.index(slot)
        mbarrier.expect(kb, k_desc.block_type.nbytes)
        tma_load(k_desc, [b, t * BLOCK_N, hk, 0], kb, smem.k.index(slot))
        mbarrier.wait(empty_bars.index(STAGES + slot), ((g // STAGES) & 1) ^ 1)
        mbarrier.expect(vb, v_desc.block_type.nbytes)
        tma_load(v_desc, [b, t * BLOCK_N, hk, 0], vb, smem.v.index(slot))


@gluon.jit
def _ws_block_step(j, o, p, m_i, l_i, q_op, smem, empty_bars, qk_scale, rows, seqlen_k, shift,
                   base, q_bar, q_phase, s_layout: gl.constexpr, o_layout: gl.constexpr,
                   p_layout: gl.constexpr,
                   HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    """Key block j >= 1 for one consumer warpgroup: the overlapped step, then V's slot of
    block j-1 and K's of block j (S_j has retired) handed back to the loader by mbarrier
    arrives (no CTA barrier, no TMA here)."""
    o, p_new, m_i, l_i, alpha, pslot = _overlapped_step(
        j, o, p, m_i, l_i, q_op, smem, qk_scale, rows, seqlen_k, shift, base, q_bar, q_phase,
        s_layout, HALF_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASKED)
    # PV_{j-1} (the V slot's last reader in this warpgroup) and S_j have retired
    mbarrier.arrive(empty_bars.index(STAGES + pslot), count=1)
    mbarrier.arrive(empty_bars.index((base + j) % STAGES), count=1)
    o, p = _rescale(o, p_new, alpha, o_layout, p_layout, q_op.dtype)
    return o, p, m_i, l_i


@gluon.jit
def _ws_tile(WG: gl.constexpr, o_desc, smem, q4, q_bar, q_phase, empty_bars, q_free, release,
             LSE, slb, slh, b, h, m0, seqlen_q, seqlen_k, n_tiles, qk_scale, base,
             CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             PERSISTENT: gl.constexpr):
    """One consumer warpgroup's work on one tile: query rows m0 + WG*HALF_M + [0, HALF_M)
    (Q in ``q4``, its mbarrier ``q_bar`` completing in phase ``q_phase``) against the tile's
    n_tiles key blocks (the ring's blocks ``base`` on), then its own epilogue (output
    through ``q4`` and a TMA store, lse). PERSISTENT: the store is left in flight, and once
    this tile's first block is done the previous tile's store is waited for and its Q
    buffer handed back to the loader (``q_free``: its empty barrier; ``release``: whether
    there was a previous tile). No wgmma is issued under a branch (ptxas would serialize
    every wgmma of the kernel)."""
    HALF_M: gl.constexpr = o_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = o_desc.block_type.shape[3]
    s_layout: gl.constexpr = _wgmma_acc_layout(gl.num_warps(), BLOCK_N)
    o_layout: gl.constexpr = _wgmma_acc_layout(gl.num_warps(), HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    q_half = q4.reshape([HALF_M, HEAD_DIM])
    mh = m0 + WG * HALF_M
    # every warpgroup runs the CTA's n_tiles key blocks (it arrives on each slot once), but
    # leaves the mask arithmetic out of the blocks fully visible to its own first row
    shift = seqlen_k - seqlen_q
    if CAUSAL:
        full_end = gl.minimum(gl.maximum(mh + shift + 1, 0), seqlen_k)
    else:
        full_end = seqlen_k
    n_mine = n_tiles
    if PERSISTENT:
        if CAUSAL:
            # the key blocks this warpgroup's rows see: with 64-key blocks the tile's last lies
            # wholly above the first warpgroup's rows (it only hands that slot back)
            hi = gl.minimum(gl.maximum(mh + HALF_M + shift, 0), seqlen_k)
            n_mine = gl.minimum(gl.maximum((hi + BLOCK_N - 1) // BLOCK_N, 1), n_tiles)
    n_full = gl.minimum(full_end // BLOCK_N, n_mine)

    rows = mh + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))
    o = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)

    # ---- block 0 (masked)
    p, m_i, l_i = _first_block(q_half, smem, m_i, l_i, qk_scale, rows, seqlen_k, shift, base,
                               q_bar, q_phase, s_layout, p_layout, HALF_M, BLOCK_N, HEAD_DIM,
                               STAGES, CAUSAL)
    # S_0 has retired: K's slot of block 0 goes back
    mbarrier.arrive(empty_bars.index(base % STAGES), count=1)
    if PERSISTENT:
        if release:
            # the previous tile's output store has had block 0's time to read its buffer
            tma.store_wait(0)
            mbarrier.arrive(q_free, count=1)

    for j in range(1, n_full):
        o, p, m_i, l_i = _ws_block_step(j, o, p, m_i, l_i, q_half, smem, empty_bars, qk_scale,
                                        rows, seqlen_k, shift, base, q_bar, q_phase, s_layout,
                                        o_layout, p_layout, HALF_M, BLOCK_N, HEAD_DIM, STAGES,
                                        CAUSAL, False)
    for j in range(gl.maximum(n_full, 1), n_mine):
        o, p, m_i, l_i = _ws_block_step(j, o, p, m_i, l_i, q_half, smem, empty_bars, qk_scale,
                                        rows, seqlen_k, shift, base, q_bar, q_phase, s_layout,
                                        o_layout, p_layout, HALF_M, BLOCK_N, HEAD_DIM, STAGES,
                                        CAUSAL, True)

    # ---- last PV, then the epilogue through this warpgroup's half of the Q buffer (only its
    # own wgmmas read it)
    o = _last_pv(o, p, smem, n_mine, BLOCK_N, HEAD_DIM, STAGES, base)
    if PERSISTENT:  # the last block's V slot goes back to the loader too (the next tile's)
        mbarrier.arrive(empty_bars.index(STAGES + (base + n_mine - 1) % STAGES), count=1)
        # blocks above this warpgroup's rows: handed back unread, each slot once loaded (so
        # that the arrive counts toward this use of the slot, not the one before)
        for j in range(n_mine, n_tiles):
            g = base + j
            mbarrier.wait(smem.k_bars.index(g % STAGES), (g // STAGES) & 1)
            mbarrier.arrive(empty_bars.index(g % STAGES), count=1)
            mbarrier.wait(smem.v_bars.index(g % STAGES), (g // STAGES) & 1)
            mbarrier.arrive(empty_bars.index(STAGES + g % STAGES), count=1)
    _epilogue(o, m_i, l_i, rows, q_half, q4, o_desc, LSE, slb, slh, b, h, mh, seqlen_q,
              o_layout, not PERSISTENT)


@gluon.jit
def _ws_consumer(WG: gl.constexpr, o_desc, smem, empty_bars, LSE, slb, slh, b, h, m0, seqlen_q,
                 seqlen_k, n_tiles, qk_scale,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One consumer warpgroup (partition of 4 warps) of the one-tile kernel: :func:`_ws_tile`
    on its half of the CTA's tile (nothing waits for the last block's slot: the loader has
    issued its last block)."""
    _ws_tile(WG, o_desc, smem, smem.q.index(WG), smem.q_bar, 0, empty_bars, None, False, LSE,
             slb, slh, b, h, m0, seqlen_q, seqlen_k, n_tiles, qk_scale, 0, CAUSAL, BLOCK_N,
             STAGES, False)


@gluon.jit
def _key_blocks(m0, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr):
    """The key blocks a query block from row m0 walks (at least one: a query block that sees
    no key masks all of block 0, and O = 0, lse = -inf come out of the same code)."""
    if CAUSAL:
        hi = gl.minimum(gl.maximum(m0 + BLOCK_M + seqlen_k - seqlen_q, 0), seqlen_k)
    else:
        hi = seqlen_k
    return gl.maximum((hi + BLOCK_N - 1) // BLOCK_N, 1)


@gluon.jit(do_not_specialize=["slb", "slh", "seqlen_q", "seqlen_k", "H", "GROUP", "HEAD_GROUP"])
def _attn_fwd_hopper_ws_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, slb, slh,
    seqlen_q, seqlen_k, H, GROUP, HEAD_GROUP, qk_scale,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr = WS_CONSUMER_REGS,
):
    """As _attn_fwd_hopper_kernel (same arguments), warp-specialized: q_desc and o_desc have
    blocks of HALF_M = BLOCK_M / 2 rows, one per consumer warpgroup. Launched with
    num_warps = 4 (the default partition, consumer warpgroup 0); a second 4-warp partition is
    consumer warpgroup 1 and a 1-warp partition the loader."""
    HALF_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = 2 * HALF_M
    b, h, hk, m0 = _tile_origin(H, GROUP, HEAD_GROUP, BLOCK_M, CAUSAL)
    n_tiles = _key_blocks(m0, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)

    smem, empty_bars = _allocate(q_desc, k_desc, v_desc, STAGES, True)

    gl.warp_specialize([
        (_ws_consumer, (0, o_desc, smem, empty_bars, LSE, slb, slh, b, h, m0, seqlen_q, seqlen_k,
                        n_tiles, qk_scale, CAUSAL, BLOCK_N, STAGES)),
        (_ws_consumer, (1, o_desc, smem, empty_bars, LSE, slb, slh, b, h, m0, seqlen_q, seqlen_k,
                        n_tiles, qk_scale, CAUSAL, BLOCK_N, STAGES)),
        (_ws_producer, (q_desc, k_desc, v_desc, smem, empty_bars, b, h, hk, m0, n_tiles, BLOCK_N,
                        STAGES)),
    ], [4, 1], [CONSUMER_REGS, WS_LOADER_REGS])


# --------------------------------------------------------------------------------------------
# Persistent warp-specialized kernel (config PERSISTENT=True)
# --------------------------------------------------------------------------------------------
@gluon.jit
def _ps_producer(q_desc, k_desc, v_desc, smem, q_bars, q_empty, empty_bars, tile_ids, TILE_CNT,
                 n_bh, H, GROUP, HEAD_GROUP, seqlen_q, seqlen_k, CAUSAL: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loader of the persistent kernel: takes the next tile from the launch's counter
    (``TILE_CNT``, zeroed, one atomic add a tile: tiles go to whichever CTA is free, in the
    per-tile kernel's order), writes its number beside Q buffer ``it % 2`` once the
    consumers handed that buffer back, loads its Q (both halves) there, then K and V of its
    key blocks into the ring, numbered on across the tiles. Past the last tile it writes -1
    and completes the Q barrier without a copy: the consumers' signal to stop."""
    HALF_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = 2 * HALF_M
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    n_m = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    n_work = n_bh * n_m
    g = 0
    it = 0
    tile = gl.atomic_add(TILE_CNT, 1)
    while tile < n_work:
        b, h, hk, m0 = _tile_coords(tile, n_bh, n_m, H, GROUP, HEAD_GROUP, BLOCK_M, CAUSAL)
        n_tiles = _key_blocks(m0, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
        qs = it % 2
        mbarrier.wait(q_empty.index(qs), ((it // 2) & 1) ^ 1)
        tile_ids.index(qs).store(gl.full([1], tile, gl.int32, one))
        _load_tile(q_desc, k_desc, v_desc, smem, q_bars.index(qs), smem.q.index(2 * qs),
                   smem.q.index(2 * qs + 1), empty_bars, b, h, hk, m0, n_tiles, g, BLOCK_N,
                   STAGES)
        g += n_tiles
        it += 1
        tile = gl.atomic_add(TILE_CNT, 1)
    qs = it % 2
    mbarrier.wait(q_empty.index(qs), ((it // 2) & 1) ^ 1)
    tile_ids.index(qs).store(gl.full([1], -1, gl.int32, one))
    mbarrier.arrive(q_bars.index(qs), count=1)


@gluon.jit
def _ps_next_tile(tile_ids, q_bars, it):
    """The number of the CTA's tile ``it`` (-1: no more), once its Q has landed."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    qs = it % 2
    mbarrier.wait(q_bars.index(qs), (it // 2) & 1)
    return gl.max(tile_ids.index(qs).load(one), 0)


@gluon.jit
def _ps_consumer(WG: gl.constexpr, o_desc, smem, q_bars, q_empty, empty_bars, tile_ids, LSE,
                 slb, slh, n_bh, H, GROUP, HEAD_GROUP, seqlen_q, seqlen_k, qk_scale,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One consumer warpgroup of the persistent kernel: :func:`_ws_tile` on its half of each
    tile the loader hands over (its number beside its Q buffer), until the loader says there
    is none left; the Q buffers alternate between tiles."""
    HALF_M: gl.constexpr = o_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = 2 * HALF_M
    n_m = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    base = 0
    it = 0
    tile = _ps_next_tile(tile_ids, q_bars, 0)
    while tile >= 0:
        b, h, hk, m0 = _tile_coords(tile, n_bh, n_m, H, GROUP, HEAD_GROUP, BLOCK_M, CAUSAL)
        n_tiles = _key_blocks(m0, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
        qs = it % 2
        # (the first tile has no store before it: nothing to hand back)
        _ws_tile(WG, o_desc, smem, smem.q.index(2 * qs + WG), q_bars.index(qs), (it // 2) & 1,
                 empty_bars, q_empty.index(1 - qs), it > 0, LSE, slb, slh, b, h, m0, seqlen_q,
                 seqlen_k, n_tiles, qk_scale, base, CAUSAL, BLOCK_N, STAGES, True)
        base += n_tiles
        it += 1
        tile = _ps_next_tile(tile_ids, q_bars, it)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["slb", "slh", "seqlen_q", "seqlen_k", "H", "GROUP", "HEAD_GROUP",
                              "n_bh"])
def _attn_fwd_hopper_persistent_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, slb, slh,
    seqlen_q, seqlen_k, H, GROUP, HEAD_GROUP, qk_scale, n_bh, TILE_CNT,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr = WS_CONSUMER_REGS,
):
    """As _attn_fwd_hopper_ws_kernel (same arguments, and n_bh = batch * query heads), but
    persistent: a grid of at most one CTA an SM (two with the two-CTA registers) takes the
    n_bh * ceil(seqlen_q / BLOCK_M) tiles from a counter (``TILE_CNT``, int32, zero at the
    launch), in the per-tile kernel's order, so the loader fetches a tile's K, V and Q while
    the consumers finish the one before, and the output store runs under the next tile's
    first block. A static share of the tiles a CTA was up to 1.5x the mean work at causal
    shapes (the last query blocks first, in L2 sections: the per-tile grid's dispatch
    balances that, a fixed stride does not). Two Q buffers (each both halves) alternate
    between tiles, each with its "full" mbarrier, an "empty" one (count 2) that the
    consumers arrive on once the store from it has been read, and the number of its tile."""
    smem, empty_bars = _allocate(q_desc, k_desc, v_desc, STAGES, True, 2)
    q_bars = smem.q_bar
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for i in gl.static_range(2):
        mbarrier.init(q_empty.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_ps_consumer, (0, o_desc, smem, q_bars, q_empty, empty_bars, tile_ids, LSE, slb, slh,
                        n_bh, H, GROUP, HEAD_GROUP, seqlen_q, seqlen_k, qk_scale, CAUSAL,
                        BLOCK_N, STAGES)),
        (_ps_consumer, (1, o_desc, smem, q_bars, q_empty, empty_bars, tile_ids, LSE, slb, slh,
                        n_bh, H, GROUP, HEAD_GROUP, seqlen_q, seqlen_k, qk_scale, CAUSAL,
                        BLOCK_N, STAGES)),
        (_ps_producer, (q_desc, k_desc, v_desc, smem, q_bars, q_empty, empty_bars, tile_ids,
                        TILE_CNT, n_bh, H, GROUP, HEAD_GROUP, seqlen_q, seqlen_k, CAUSAL,
                        BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, WS_LOADER_REGS])
