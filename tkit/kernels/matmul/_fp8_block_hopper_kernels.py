"""The Gluon kernel of the block-scaled FP8 GEMM for Hopper (sm_90a), launched by
``fp8_block_hopper.py``; the math is :mod:`tkit.kernels.matmul.fp8_block`'s (DeepSeek-V3's
1x128 scales of a, 128x128 scales of b, each 128-deep group's MMA sum promoted into a float32
accumulator with ``sa[:, None] * sb``).

Why Gluon: Triton 3.6 waits for every wgmma whose result the loop reads (``wgmma.wait_group
0`` after each dot), so each 128-deep promotion drained the tensor cores, and the CTA-wide
barrier before each TMA refill kept the two warpgroups in step (docs/NOTES.md, "Block-scaled
fp8 GEMM"). Here the waits are written out.

Schedule. Persistent CTAs walk the output tiles (BLOCK_M = 128 rows, BLOCK_N = 128 or 64
columns, 256 with the rescale schedule below, the grouped order of matmul's kernels).
``gl.warp_specialize`` splits a CTA into two consumer warpgroups (4 warps each, 64 rows of
the tile each) and a 1-warp TMA producer. The producer walks the same tiles and, per 128-deep
K group, loads the a tile [BLOCK_M, 128] and the b tile [BLOCK_N, 128] (b K-major: wgmma
reads fp8 operands only K-major) into a ring of STAGES slots, one "ready" mbarrier a slot
(the TMA's transaction count) and one "empty" mbarrier a slot (count 2: each consumer
arrives once it has retired the wgmma that read the slot). In the promote schedule each
consumer runs the K groups of a tile two at a time:

    wait ready(g), ready(g + 1)   D0 = A_g B_g, D1 = A_g+1 B_g+1   issued async, fresh sums
    wgmma.wait_group 1            D0 is ready; D1 still runs
    arrive empty(g)               the slot goes back to the producer
    acc += D0 * (sa[rows, g] * sb[g, n-block])                    64 FFMA a thread
    wgmma.wait_group 0; arrive empty(g + 1); acc += D1 * (...)

so half the promotions run under this warpgroup's own MMAs. Consumer 1 runs a tile's first
group alone (issue, wait_group 0, promote), which puts its pairs a group out of step with
consumer 0's: the promotion a warpgroup cannot hide then runs under the other's MMAs (the two
are only coupled through the ring). Nothing is in flight across the loop's back edge: a sum
carried there in flight is copied by the loop's phi and ptxas then serializes every wgmma of
the kernel (C7514; docs/NOTES.md). Registers a consumer thread: the accumulator and the two
sums, 64 each at BLOCK_N = 128. The scales of the next step's groups are loaded (plain loads,
2 a thread for sa, a scalar for sb) during this step; their product follows the loads at
once, so the warps wait for them there (taking it at the promotion, with two register sets
so that no copy at the back edge waits either, measured slower). Measured alternatives that
lost are in docs/NOTES.md (one group at a time, three consumer warpgroups, split-K with a
reduction launch and inside this one, each tile's K groups rotated).

The rescale schedule (``RESCALE``; ``_consumer_rescale``) keeps one accumulator that the
wgmmas add into across all of K, in units of the current group's scales: with
c_g = sa[row, g] * sb[g, n-block], after group g it holds sum_(j <= g) S_j c_j / c_g, and
before group g + 1 it is multiplied by c_g / c_(g+1) (a row's ratio of sa times the column
block's ratio of sb; a 256-column tile spans two blocks of b, each with its ratio); after the
last group by c_last. No sum beside the accumulator, so a consumer holds 64 x 256 (128
registers) and the tile is 128 x 256 (at 128 x 128 it measured behind the promote schedule).
Per group: wait ready, issue 4 m64n256k32 wgmmas into the accumulator, load the scales of two
groups ahead and compute the next ratios under them, ``wait_group 0``, release the slot,
rescale (one FMUL an element), next group. A warpgroup cannot overlap its own rescale with
its MMAs; with ``PINGPONG`` the two consumers issue in turn (two mbarriers), so each one's
rescale runs under the other's MMAs.

Its numerics: a zero scale keeps the ratio 1 (the unit stays the last nonzero scale), exact
when the zero scale comes with zero codes (what quantizers produce); a zero scale over
nonzero codes is not supported (that group would be added in the previous unit). The
accumulator holds partial products divided by the current scale, so float32 range limits how
far the scales of a row (or of a column block) may fall along K: with group sums of fp8
codes below 2^25, a ratio up to ~1e28 between an earlier and a later group's scale stays
finite at K = 16384.
One float32 rounding a group, as the promotion's FFMA. Unlike the promote schedule, the
running sum stays inside the fp8 MMA over all of K (Hopper keeps about 13-14 bits of it at
each k32 step, docs/NOTES.md): the numerics of torch._scaled_mm's use_fast_accum=True,
several times the promote schedule's error (float32 outputs at K = 1024: 2e-3 of max |ref|).

Epilogue, per consumer warpgroup (its 64 rows): bias, activation, residual in float32, then
the output dtype through a shared-memory tile and a TMA store; that store is waited for only
before the next tile's epilogue reuses the buffer, so it overlaps the next tile's K loop.
With ``SHARED_OUT`` (the rescale schedule's 256 columns: two 32 KB staging tiles leave room
for 3 ring slots, one for 4) the consumers share one staging tile, taken in turn (consumer 0,
consumer 1, next tile): each waits for its TMA store to have read the tile and hands it on
through an mbarrier.
Edges: TMA zero-fills the operands past M, N, K (their sums are 0 whatever the scale); the
scale rows past M are clamped to row M - 1, the store clips at M and N.
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

# the Gluon names that moved between Triton versions
from tkit.kernels._gluon import cta_barrier, tma_load, tma_store

GROUP_K = gl.constexpr(128)  # the scale group along K
WG_M = gl.constexpr(64)  # rows of one consumer warpgroup


@gluon.jit
def _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """matmul's grouped tile order (``_kernels._tile_pid``)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr):
    """The TMA partition (one warp): every K group of every tile of this CTA into the ring.
    Slot i % STAGES gets the i-th group once every consumer has released its previous use."""
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_groups = gl.cdiv(K, GROUP_K)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    i = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for g in range(k_groups):
            slot = i % STAGES
            # a fresh mbarrier reads as if the phase before phase 0 had completed: the first
            # STAGES waits (parity 1) return at once
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            tma_load(a_desc, [off_m, g * GROUP_K], bar, a_ring.index(slot))
            tma_load(b_desc, [off_n, g * GROUP_K], bar, b_ring.index(slot))
            i += 1


@gluon.jit
def _scales(sa_rows, sb_col, g, k_last, stride_sak, stride_sbk):
    """sa[rows, g] * sb[g, n-block] (g clamped to the last group: a prefetch past the tile's
    last group is never used)."""
    g = gl.minimum(g, k_last)
    return gl.load(sa_rows + g * stride_sak) * gl.load(sb_col + g * stride_sbk)


@gluon.jit
def _issue(a_ring, b_ring, ready, i, d, WG: gl.constexpr, STAGES: gl.constexpr):
    """Wait for the i-th ring slot and issue its 128-deep MMA sum, asynchronously: a fresh
    sum (use_acc=False; ``d``, zeros, only gives its type and layout)."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    a_s = a_ring.index(slot).slice(WG * WG_M, WG_M, 0)
    b_s = b_ring.index(slot).permute((1, 0))
    return warpgroup_mma(a_s, b_s, d, use_acc=False, is_async=True)


@gluon.jit
def _retire(tok, a_ring, b_ring, empty, i, acc, s, WG: gl.constexpr, STAGES: gl.constexpr,
            PENDING: gl.constexpr):
    """Wait until at most PENDING wgmma groups are in flight (the i-th group's sum ``tok`` is
    then complete), hand its slot back and promote it: acc += d * s[:, None]. Returns
    (acc, d)."""
    slot = i % STAGES
    a_s = a_ring.index(slot).slice(WG * WG_M, WG_M, 0)
    b_s = b_ring.index(slot).permute((1, 0))
    d = warpgroup_mma_wait(PENDING, deps=(tok, a_s, b_s))[0]
    mbarrier.arrive(empty.index(slot), count=1)
    return acc + d * gl.expand_dims(s, 1), d


@gluon.jit
def _activation(x, ACT: gl.constexpr):
    """The activations of ``elementwise._kernels._activation``, same formulas."""
    if ACT == "silu":
        y = x / (1.0 + gl.exp(-x))
    elif ACT == "gelu":
        y = 0.5 * x * (1.0 + gl.erf(x * 0.7071067811865476))
    elif ACT == "gelu_tanh":
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = gl.exp(-2.0 * gl.abs(u))
        r = 1.0 / (1.0 + e)
        y = x * gl.where(u >= 0.0, r, e * r)
    elif ACT == "relu":
        y = gl.where(x < 0.0, 0.0, x)
    else:
        y = x
    return y


@gluon.jit
def _issue_acc(a_ring, b_ring, ready, i, acc, WG: gl.constexpr, STAGES: gl.constexpr,
               USE_ACC: gl.constexpr):
    """Wait for the i-th ring slot and issue its 128-deep MMA into ``acc`` (USE_ACC) or a
    fresh sum, asynchronously."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    a_s = a_ring.index(slot).slice(WG * WG_M, WG_M, 0)
    b_s = b_ring.index(slot).permute((1, 0))
    return warpgroup_mma(a_s, b_s, acc, use_acc=USE_ACC, is_async=True)


@gluon.jit
def _wait_acc(tok, a_ring, b_ring, empty, i, WG: gl.constexpr, STAGES: gl.constexpr):
    """Wait for every wgmma in flight (the i-th group's, ``tok``), hand its slot back;
    returns the accumulator."""
    slot = i % STAGES
    a_s = a_ring.index(slot).slice(WG * WG_M, WG_M, 0)
    b_s = b_ring.index(slot).permute((1, 0))
    acc = warpgroup_mma_wait(0, deps=(tok, a_s, b_s))[0]
    mbarrier.arrive(empty.index(slot), count=1)
    return acc


@gluon.jit
def _epilogue(acc, c_desc, c_buf, bias_ptr, res_ptr, rows, row0, off_n, M, N,
              stride_rm, stride_rn, stride_bias, HAS_BIAS: gl.constexpr, ACT: gl.constexpr,
              HAS_RES: gl.constexpr, col_layout: gl.constexpr):
    """A consumer's 64 rows of a tile: float32 bias / activation / residual, then the output
    dtype through ``c_buf`` and a TMA store (waited for only before the buffer's next use)."""
    out = _epilogue_values(acc, c_desc, bias_ptr, res_ptr, rows, off_n, M, N, stride_rm,
                           stride_rn, stride_bias, HAS_BIAS, ACT, HAS_RES, col_layout)
    tma.store_wait(0)  # the previous tile's store has read c_buf
    cta_barrier()
    c_buf.store(out)
    fence_async_shared()
    cta_barrier()
    tma_store(c_desc, [row0, off_n], c_buf)


@gluon.jit
def _epilogue_values(acc, c_desc, bias_ptr, res_ptr, rows, off_n, M, N, stride_rm, stride_rn,
                     stride_bias, HAS_BIAS: gl.constexpr, ACT: gl.constexpr,
                     HAS_RES: gl.constexpr, col_layout: gl.constexpr):
    """float32 bias / activation / residual on a consumer's 64 rows, in the output dtype."""
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    cols = off_n + gl.arange(0, BLOCK_N, layout=col_layout)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
        acc = acc + gl.expand_dims(bias.to(gl.float32), 0)
    acc = _activation(acc, ACT)
    if HAS_RES:
        r_ptrs = (res_ptr + gl.expand_dims(rows.to(gl.int64) * stride_rm, 1)
                  + gl.expand_dims(cols.to(gl.int64) * stride_rn, 0))
        r_mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
        acc = acc + gl.load(r_ptrs, mask=r_mask, other=0.0).to(gl.float32)
    return acc.to(c_desc.dtype)


@gluon.jit
def _store_shared(out, c_desc, c_buf, c_free, k, row0, off_n):
    """``out`` through the one staging tile both consumers share (SHARED_OUT): the k-th
    use (2 x tile + consumer) waits for the (k - 1)-th use's TMA store to have read it (a
    fresh mbarrier passes the wait for phase -1), then waits for its own store's read and
    hands the tile on."""
    mbarrier.wait(c_free, (k & 1) ^ 1)
    c_buf.store(out)
    fence_async_shared()
    cta_barrier()
    tma_store(c_desc, [row0, off_n], c_buf)
    tma.store_wait(0)
    mbarrier.arrive(c_free, count=1)


@gluon.jit
def _consumer(WG: gl.constexpr, a_ring, b_ring, ready, empty, c_desc, c_buf,
              sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N, K,
              stride_sam, stride_sak, stride_sbk, stride_sbn, stride_rm, stride_rn, stride_bias,
              HAS_BIAS: gl.constexpr, ACT: gl.constexpr, HAS_RES: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr):
    """Consumer warpgroup WG: rows WG * 64 + [0, 64) of every tile of this CTA."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_groups = gl.cdiv(K, GROUP_K)
    k_last = k_groups - 1
    zero = gl.zeros([WG_M, BLOCK_N], gl.float32, acc_layout)
    base = 0  # ring index of the tile's first group
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M + WG * WG_M
        off_n = pid_n * BLOCK_N
        rows = row0 + gl.arange(0, WG_M, layout=row_layout)
        sa_rows = sa_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_sam
        sb_col = sb_ptr + (off_n // GROUP_K) * stride_sbn
        acc = zero
        # Two groups a step, the first group's sum promoted while the second's MMAs run.
        # Nothing is in flight across the loop's back edge: a sum carried there in flight is
        # copied by the loop's phi, and ptxas then serializes every wgmma of the kernel
        # (C7514). Each step starts from fresh sums (use_acc=False: no zeroing). Consumer 1
        # runs the tile's first group alone, so that its pairs (and the promotion it cannot
        # hide, after wait_group 0) fall a group after consumer 0's, under consumer 0's MMAs
        # (both would otherwise be released by the same ready barriers and expose their
        # second promotions at the same time).
        lead = WG  # 0 or 1; k_groups >= 1
        if WG == 1:
            s = _scales(sa_rows, sb_col, 0, k_last, stride_sak, stride_sbk)
            t0 = _issue(a_ring, b_ring, ready, base, zero, WG, STAGES)
            acc, _ = _retire(t0, a_ring, b_ring, empty, base, acc, s, WG, STAGES, 0)
        n_steps = (k_groups - lead) // 2
        s_0 = _scales(sa_rows, sb_col, lead, k_last, stride_sak, stride_sbk)
        s_1 = _scales(sa_rows, sb_col, lead + 1, k_last, stride_sak, stride_sbk)
        for step in range(n_steps):
            g = lead + 2 * step
            # the next step's scales, in flight during this step's MMAs
            n_0 = _scales(sa_rows, sb_col, g + 2, k_last, stride_sak, stride_sbk)
            n_1 = _scales(sa_rows, sb_col, g + 3, k_last, stride_sak, stride_sbk)
            i = base + g
            t0 = _issue(a_ring, b_ring, ready, i, zero, WG, STAGES)
            t1 = _issue(a_ring, b_ring, ready, i + 1, zero, WG, STAGES)
            acc, _ = _retire(t0, a_ring, b_ring, empty, i, acc, s_0, WG, STAGES, 1)
            acc, _ = _retire(t1, a_ring, b_ring, empty, i + 1, acc, s_1, WG, STAGES, 0)
            s_0 = n_0
            s_1 = n_1
        # a group left over (an odd count after the lead), alone
        for g in range(lead + 2 * n_steps, k_groups):
            s = _scales(sa_rows, sb_col, g, k_last, stride_sak, stride_sbk)
            t0 = _issue(a_ring, b_ring, ready, base + g, zero, WG, STAGES)
            acc, _ = _retire(t0, a_ring, b_ring, empty, base + g, acc, s, WG, STAGES, 0)
        base += k_groups

        _epilogue(acc, c_desc, c_buf, bias_ptr, res_ptr, rows, row0, off_n, M, N,
                  stride_rm, stride_rn, stride_bias, HAS_BIAS, ACT, HAS_RES, col_layout)
    tma.store_wait(0)


@gluon.jit
def _ratio(u, s):
    """The factor that moves an accumulator kept in units of ``u`` (the last nonzero scale)
    to units of the next group's scale ``s``, and the new unit: u / s, or 1 where s is 0 (a
    zero scale comes with zero codes, so that group adds nothing and the unit stays)."""
    nz = s != 0.0
    return gl.where(nz, u / s, 1.0), gl.where(nz, s, u)


@gluon.jit
def _group_scales(sa_rows, sb_0, sb_1, g, k_last, stride_sak, stride_sbk):
    """Group g's scales (g clamped to the last group: a prefetch past it is never used): of
    a for this warpgroup's rows, of b for the tile's two 128-column blocks."""
    g = gl.minimum(g, k_last)
    return (gl.load(sa_rows + g * stride_sak), gl.load(sb_0 + g * stride_sbk),
            gl.load(sb_1 + g * stride_sbk))


@gluon.jit
def _factor(f_a, f_b0, f_b1, cols):
    """The [64, 256] factor f_a[row] * (f_b0 for the tile's first 128 columns, f_b1 for the
    next): LLVM folds the select on the column (a thread's columns are known at compile time)
    to four products a thread."""
    f_b = gl.where(cols < GROUP_K, f_b0, f_b1)
    return gl.expand_dims(f_a, 1) * gl.expand_dims(f_b, 0)


@gluon.jit
def _issue_in_turn(a_ring, b_ring, ready, turn, i, acc, WG: gl.constexpr,
                   STAGES: gl.constexpr, USE_ACC: gl.constexpr, PINGPONG: gl.constexpr):
    """``_issue_acc``; PINGPONG: consumer 0 issues the i-th group once consumer 1 has issued
    the one before (``turn[1]``'s phase i: consumer 1 arrives once up front and after each
    issue), consumer 1 once consumer 0 has issued this one (``turn[0]``'s phase i), so that
    the tensor cores run the two warpgroups' groups alternately and each rescales under the
    other's MMAs. A parity wait tells a phase only from the one before; here neither barrier
    runs more than one phase ahead of its waiter (each side waits before it arrives)."""
    if PINGPONG:
        mbarrier.wait(turn.index(1 - WG), i & 1)
    tok = _issue_acc(a_ring, b_ring, ready, i, acc, WG, STAGES, USE_ACC)
    if PINGPONG:
        mbarrier.arrive(turn.index(WG), count=1)
    return tok


@gluon.jit
def _consumer_rescale(WG: gl.constexpr, a_ring, b_ring, ready, empty, turn, c_desc, c_buf,
                      c_free,
                      sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N, K,
                      stride_sam, stride_sak, stride_sbk, stride_sbn, stride_rm, stride_rn,
                      stride_bias,
                      HAS_BIAS: gl.constexpr, ACT: gl.constexpr, HAS_RES: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      GROUP_M: gl.constexpr, PINGPONG: gl.constexpr,
                      SHARED_OUT: gl.constexpr):
    """Consumer warpgroup WG of the rescale schedule: rows WG * 64 + [0, 64) of every tile
    of this CTA, one accumulator that the wgmmas accumulate into across all of K (module
    docstring)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    gl.static_assert(BLOCK_N == 2 * GROUP_K, "the rescale schedule's tiles are 256 wide")
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_groups = gl.cdiv(K, GROUP_K)
    k_last = k_groups - 1
    nb_last = gl.cdiv(N, GROUP_K) - 1
    zero = gl.zeros([WG_M, BLOCK_N], gl.float32, acc_layout)
    lcols = gl.arange(0, BLOCK_N, layout=col_layout)
    if PINGPONG:
        if WG == 1:
            mbarrier.arrive(turn.index(1), count=1)  # consumer 0 goes first
    base = 0  # ring index of the tile's first group
    k_out = WG  # this consumer's uses of a shared staging tile: 2 x tile + WG
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M + WG * WG_M
        off_n = pid_n * BLOCK_N
        rows = row0 + gl.arange(0, WG_M, layout=row_layout)
        sa_rows = sa_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_sam
        sb_0 = sb_ptr + (off_n // GROUP_K) * stride_sbn
        # (the second block past N's last one: its columns are TMA's zeros, any scale does)
        sb_1 = sb_ptr + gl.minimum(off_n // GROUP_K + 1, nb_last) * stride_sbn
        # The accumulator is kept in units of the current group's scales: u_a (per row) times
        # u_b0 / u_b1 (per 128-column block of b). Group 0 starts it (use_acc=False) ...
        u_a, u_b0, u_b1 = _group_scales(sa_rows, sb_0, sb_1, 0, k_last, stride_sak,
                                        stride_sbk)
        u_a = gl.where(u_a != 0.0, u_a, 1.0)
        u_b0 = gl.where(u_b0 != 0.0, u_b0, 1.0)
        u_b1 = gl.where(u_b1 != 0.0, u_b1, 1.0)
        tok = _issue_in_turn(a_ring, b_ring, ready, turn, base, zero, WG, STAGES, False,
                             PINGPONG)
        # ... the next group's factors are computed under its MMAs, from scales loaded a
        # group earlier (a global load's latency under a whole group) ...
        x_a, x_b0, x_b1 = _group_scales(sa_rows, sb_0, sb_1, 1, k_last, stride_sak,
                                        stride_sbk)
        r_a, n_a = _ratio(u_a, x_a)
        r_b0, n_b0 = _ratio(u_b0, x_b0)
        r_b1, n_b1 = _ratio(u_b1, x_b1)
        x_a, x_b0, x_b1 = _group_scales(sa_rows, sb_0, sb_1, 2, k_last, stride_sak,
                                        stride_sbk)
        acc = _wait_acc(tok, a_ring, b_ring, empty, base, WG, STAGES)
        for g in range(1, k_groups):
            # ... and once it has retired, acc *= c_(g-1) / c_g, then group g accumulates
            # into it. (The warpgroup cannot overlap this with its own MMAs; the other
            # consumer's fill the tensor cores meanwhile.)
            acc = acc * _factor(r_a, r_b0, r_b1, lcols)
            u_a = n_a
            u_b0 = n_b0
            u_b1 = n_b1
            tok = _issue_in_turn(a_ring, b_ring, ready, turn, base + g, acc, WG, STAGES,
                                 True, PINGPONG)
            r_a, n_a = _ratio(u_a, x_a)
            r_b0, n_b0 = _ratio(u_b0, x_b0)
            r_b1, n_b1 = _ratio(u_b1, x_b1)
            x_a, x_b0, x_b1 = _group_scales(sa_rows, sb_0, sb_1, g + 2, k_last, stride_sak,
                                            stride_sbk)
            acc = _wait_acc(tok, a_ring, b_ring, empty, base + g, WG, STAGES)
        # ... and after the last group, acc times its scales is the product
        acc = acc * _factor(u_a, u_b0, u_b1, lcols)
        base += k_groups
        if SHARED_OUT:
            out = _epilogue_values(acc, c_desc, bias_ptr, res_ptr, rows, off_n, M, N,
                                   stride_rm, stride_rn, stride_bias, HAS_BIAS, ACT, HAS_RES,
                                   col_layout)
            _store_shared(out, c_desc, c_buf, c_free, k_out, row0, off_n)
            k_out += 2
        else:
            _epilogue(acc, c_desc, c_buf, bias_ptr, res_ptr, rows, row0, off_n, M, N,
                      stride_rm, stride_rn, stride_bias, HAS_BIAS, ACT, HAS_RES, col_layout)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["M", "N", "K", "stride_sam", "stride_sak", "stride_sbk",
                              "stride_sbn", "stride_rm", "stride_rn", "stride_bias"])
def _fp8_block_ws_kernel(
    a_desc, b_desc, c_desc, sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N, K,
    stride_sam, stride_sak, stride_sbk, stride_sbn, stride_rm, stride_rn, stride_bias,
    HAS_BIAS: gl.constexpr, ACT: gl.constexpr, HAS_RES: gl.constexpr,
    STAGES: gl.constexpr, GROUP_M: gl.constexpr, RESCALE: gl.constexpr,
    PINGPONG: gl.constexpr, SHARED_OUT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """Persistent warp-specialized block-scaled GEMM (module docstring). a_desc: over a (M, K),
    block [BLOCK_M, 128]; b_desc: over b's K-major storage (N, K), block [BLOCK_N, 128]; c_desc:
    over out (M, N), block [64, BLOCK_N]. Launched with num_warps = 4 (consumer warpgroup 0);
    the second consumer warpgroup (a 4-warp partition) and the 1-warp producer."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    CONSUMERS: gl.constexpr = 2
    gl.static_assert(BLOCK_M == CONSUMERS * WG_M, "BLOCK_M is 64 rows a consumer warpgroup")
    dtype: gl.constexpr = a_desc.dtype
    a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    # (SHARED_OUT: one output staging tile for both consumers, taken in turn)
    OUT_BUFS: gl.constexpr = 1 if SHARED_OUT else CONSUMERS
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [OUT_BUFS] + c_desc.block_type.shape,
                                       c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)
    if SHARED_OUT:
        c_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(c_free, count=1)
    else:
        c_free = ready  # (unused)
    if PINGPONG:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(turn.index(s), count=1)
    else:
        turn = ready  # (unused)
    fence_async_shared()

    if RESCALE:
        gl.warp_specialize([
            (_consumer_rescale, (0, a_ring, b_ring, ready, empty, turn, c_desc, c_bufs.index(0),
                                 c_free,
                                 sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N, K, stride_sam,
                                 stride_sak, stride_sbk, stride_sbn, stride_rm, stride_rn,
                                 stride_bias, HAS_BIAS, ACT, HAS_RES, BLOCK_M, BLOCK_N, STAGES,
                                 GROUP_M, PINGPONG, SHARED_OUT)),
            (_consumer_rescale, (1, a_ring, b_ring, ready, empty, turn, c_desc,
                                 c_bufs.index(OUT_BUFS - 1), c_free,
                                 sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N, K, stride_sam,
                                 stride_sak, stride_sbk, stride_sbn, stride_rm, stride_rn,
                                 stride_bias, HAS_BIAS, ACT, HAS_RES, BLOCK_M, BLOCK_N, STAGES,
                                 GROUP_M, PINGPONG, SHARED_OUT)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K, BLOCK_M,
                         BLOCK_N, STAGES, GROUP_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, a_ring, b_ring, ready, empty, c_desc, c_bufs.index(0), sa_ptr,
                         sb_ptr, bias_ptr, res_ptr, M, N, K, stride_sam, stride_sak,
                         stride_sbk, stride_sbn, stride_rm, stride_rn, stride_bias, HAS_BIAS,
                         ACT, HAS_RES, BLOCK_M, BLOCK_N, STAGES, GROUP_M)),
            (_consumer, (1, a_ring, b_ring, ready, empty, c_desc, c_bufs.index(1), sa_ptr,
                         sb_ptr, bias_ptr, res_ptr, M, N, K, stride_sam, stride_sak,
                         stride_sbk, stride_sbn, stride_rm, stride_rn, stride_bias, HAS_BIAS,
                         ACT, HAS_RES, BLOCK_M, BLOCK_N, STAGES, GROUP_M)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K, BLOCK_M,
                         BLOCK_N, STAGES, GROUP_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
