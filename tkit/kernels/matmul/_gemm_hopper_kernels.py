"""The Gluon kernel of the 16-bit GEMM for Hopper (sm_90a), launched by ``gemm_hopper.py``;
the math is :func:`tkit.matmul`'s (``out = a @ b + bias + residual``, float32 accumulation,
one rounding).

Why Gluon: the Triton persistent TMA kernel (``_kernels._matmul_tma_kernel``) issues its
loads, waits and wgmmas from the same warps, about 87 SASS instructions a warp a 64-deep K
step where cuBLAS's warp-specialized kernels spend a fraction of that; at M = 512 its tiles
took 10-16% longer than cuBLAS's at the same tile count (docs/NOTES.md). Here a producer warp
only issues TMA copies and two consumer warpgroups only wait and issue wgmma.

Schedule. Persistent CTAs walk the output tiles (BLOCK_M = 128 rows, BLOCK_N = 128, 192 or
256 columns, matmul's grouped order). ``gl.warp_specialize`` splits a CTA into two consumer
warpgroups (4 warps each, 64 rows of the tile each) and a 1-warp TMA producer. The producer
walks the same tiles and, per 64-deep K step, loads the a tile [BLOCK_M, 64] and the b tile
(b K-major: the [BLOCK_N, 64] tile of the (N, K) weight) into a ring of STAGES slots, one
"ready" mbarrier a slot (the TMA's transaction count) and one "empty" mbarrier a slot (count
2: each consumer arrives once the wgmma that read the slot has retired). Each consumer, per K
step: wait ready, issue the wgmma m64 x BLOCK_N x 64 on its 64 rows asynchronously into the
accumulator, ``wgmma.wait_group 1`` (the previous step's wgmma has retired, this one runs
on), release the previous step's slot. One accumulator chain is in flight across the loop's
back edge; it is the wgmma's own accumulator, so nothing copies it (unlike a separate sum:
docs/NOTES.md, the block-scaled kernel). The producer runs up to STAGES steps ahead, into the
next tile while the consumers run this one's epilogue.

Epilogue, per consumer warpgroup (its 64 rows): bias in float32; the residual (row-major,
the output's dtype) read by TMA into the output staging buffer during the tile's first K
step and loaded from there in the accumulator's layout; then the output dtype through that
shared-memory tile and a TMA store, waited for only before the buffer is reused, so the
store overlaps the next tile's K loop. With ``OVERLAP`` the sums are first rounded to output
values in registers, then the next tile's first K step is issued, and the shared-memory
writes and the TMA store run under its wgmma (the tensor cores are otherwise idle from the
last wgmma's retirement to the next tile's first issue); the CTA's last tile is peeled off
the tile loop, because a wgmma issued inside a branch (``if there is a next tile``) makes
ptxas serialize every wgmma of the kernel. Edges: TMA zero-fills operands past M, N and K;
the stores clip.

Gated tiles (``GATED``, ``tkit.matmul_glu``): an output tile of W columns is computed as its
gate sums (rows [off_n, off_n + W) of the merged (2N, K) weight) and its up sums (rows
N + off_n on), both loaded each K step through one descriptor; either into the two halves
of one [2W, 64] slot, read by one m64 x 2W wgmma into one accumulator that the epilogue
splits in registers (GATED 2), or into two rings and two accumulators (GATED 1). The
epilogue computes act(gate + bias) * (up + bias) in float32 and stores the one [64, W]
part. The gate's last partial tile reads up rows past N: those output columns are clipped
by the store. Their overlap (OVERLAP 2, narrow tiles: both tiles' sums fit the registers)
issues the next tile's first K step before the epilogue's math, which then runs under its
wgmma (the activation is MUFU-bound: two operations an element).
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
from tkit.kernels.matmul._fp8_block_hopper_kernels import _tile_pid

WG_M = gl.constexpr(64)  # rows of one consumer warpgroup


@gluon.jit
def _producer(a_desc, b_desc, b2_desc, a_ring, b_ring, b2_ring, ready, empty, M, N, K,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              GATED: gl.constexpr):
    """The TMA partition (one warp): every K step of every tile of this CTA into the ring.
    A slot is refilled once both consumers released its previous use. GATED: b_desc is over
    the (2N, K) storage of a merged gate/up weight and each step loads the gate rows
    [off_n, off_n + W) and the up rows [N + off_n, ...) of it (N the output width), into the
    two rings (1) or the two halves of one [2W, BLOCK_K] slot (2)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BN0: gl.constexpr = b_desc.block_type.shape[0]
    TWO: gl.constexpr = BLOCK_N > BN0
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_steps = gl.cdiv(K, BLOCK_K)
    if GATED:
        nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    elif TWO:
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                + b2_desc.block_type.nbytes)
    else:
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    slot = 0
    phase = 1  # a fresh mbarrier reads as if the phase before phase 0 had completed
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_steps):
            mbarrier.wait(empty.index(slot), phase)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            tma_load(a_desc, [off_m, kk * BLOCK_K], bar, a_ring.index(slot))
            if GATED == 1:
                tma_load(b_desc, [off_n, kk * BLOCK_K], bar, b_ring.index(slot))
                tma_load(b_desc, [N + off_n, kk * BLOCK_K], bar, b2_ring.index(slot))
            elif GATED == 2:
                tma_load(b_desc, [off_n, kk * BLOCK_K], bar,
                         b_ring.index(slot).slice(0, BN0, 0))
                tma_load(b_desc, [N + off_n, kk * BLOCK_K], bar,
                         b_ring.index(slot).slice(BN0, BN0, 0))
            else:
                tma_load(b_desc, [off_n, kk * BLOCK_K], bar, b_ring.index(slot))
                if TWO:
                    tma_load(b2_desc, [off_n + BN0, kk * BLOCK_K], bar, b2_ring.index(slot))
            slot += 1
            if slot == STAGES:
                slot = 0
                phase ^= 1


@gluon.jit
def _mma_step(a_ring, b_ring, b2_ring, slot, acc, acc2, WG: gl.constexpr, TWO: gl.constexpr,
              USE_ACC: gl.constexpr):
    """Issue one K step's wgmma (two with the second column part) on this warpgroup's rows,
    asynchronously."""
    a_s = a_ring.index(slot).slice(WG * WG_M, WG_M, 0)
    acc = warpgroup_mma(a_s, b_ring.index(slot).permute((1, 0)), acc, use_acc=USE_ACC,
                        is_async=True)
    if TWO:
        acc2 = warpgroup_mma(a_s, b2_ring.index(slot).permute((1, 0)), acc2, use_acc=USE_ACC,
                             is_async=True)
    return acc, acc2


@gluon.jit
def _load_residual(r_desc, r2_desc, r_bar, c_buf, c2_buf, row0, off_n, BN0: gl.constexpr,
                   TWO: gl.constexpr):
    """The residual's tile (each column part) into the staging buffers by TMA, once the last
    tile's stores have read them; ``r_bar`` completes when it has landed."""
    tma.store_wait(0)
    cta_barrier()
    if TWO:
        mbarrier.expect(r_bar, r_desc.block_type.nbytes + r2_desc.block_type.nbytes)
        tma_load(r_desc, [row0, off_n], r_bar, c_buf)
        tma_load(r2_desc, [row0, off_n + BN0], r_bar, c2_buf)
    else:
        mbarrier.expect(r_bar, r_desc.block_type.nbytes)
        tma_load(r_desc, [row0, off_n], r_bar, c_buf)


@gluon.jit
def _mma_wait(acc, acc2, TWO: gl.constexpr, STEPS: gl.constexpr):
    """Wait until at most STEPS K steps' wgmmas are in flight (one commit group a part)."""
    if TWO:
        acc, acc2 = warpgroup_mma_wait(2 * STEPS, deps=(acc, acc2))
    else:
        acc = warpgroup_mma_wait(STEPS, deps=(acc,))
    return acc, acc2


@gluon.jit
def _epilogue_values(y, c_buf, bias_ptr, col0, N, stride_bias, OUT_DTYPE: gl.constexpr,
                     HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr):
    """One column part's output values in registers: bias in float32, the residual (already in
    ``c_buf``, read there by TMA), rounded once to the output dtype."""
    layout: gl.constexpr = y.type.layout
    W: gl.constexpr = y.type.shape[1]
    if HAS_BIAS:
        cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
        bias = gl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
        y = y + gl.expand_dims(bias.to(gl.float32), 0)
    if HAS_RES:
        y = y + c_buf.load(layout).to(gl.float32)
    y = y.to(OUT_DTYPE)
    # a side-effecting identity on the packed 16-bit values: the rounding happens here, before
    # any wgmma issued after this call (the compiler would otherwise sink it to the stores and
    # keep the float32 sums alive beside the next tile's accumulator)
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=y.dtype,
                                     is_pure=False, pack=2)


@gluon.jit
def _glu_act(x, ACT: gl.constexpr):
    """The gate's activation in float32, as ``tkit.kernels.elementwise._kernels._activation``
    computes it (the Triton kernels' epilogue)."""
    if ACT == "silu":
        # x / (1 + 2^(-x log2 e)) with the approximate exp2 and reciprocal and denormals
        # flushed: two MUFU operations an element and nothing else but three FMUL/FADD (the
        # library forms add range fixups: 14 instructions an element); MUFU throughput bounds
        # this epilogue
        y = gl.inline_asm_elementwise(
            "{ .reg .f32 e; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; "
            "add.f32 e, e, 0f3F800000; rcp.approx.ftz.f32 e, e; mul.f32 $0, $1, e; }",
            "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)
    elif ACT == "gelu":
        y = 0.5 * x * (1.0 + gl.erf(x * 0.7071067811865476))
    else:  # gelu_tanh: 0.5 * (1 + tanh(u)) = sigmoid(2u), from exp(-2|u|) <= 1 (no overflow)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = gl.exp(-2.0 * gl.abs(u))
        r = 1.0 / (1.0 + e)
        y = x * gl.where(u >= 0.0, r, e * r)
    return y


@gluon.jit
def _copy_f32(x):
    """``x`` in other registers (a side-effecting move the compilers keep)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype,
                                     is_pure=False, pack=1)


@gluon.jit
def _halves(y):
    """A [rows, W] accumulator-layout tensor as its two column halves, each in the layout of a
    W / 2 wide accumulator: column bit W / 2 is a register bit of the layout, so this only
    renames registers (``assert_trivial``)."""
    R: gl.constexpr = y.type.shape[0]
    W: gl.constexpr = y.type.shape[1]
    half: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, W // 2, 16])
    lo, hi = gl.split(gl.permute(gl.reshape(y, [R, 2, W // 2]), (0, 2, 1)))
    return (gl.convert_layout(lo, half, assert_trivial=True),
            gl.convert_layout(hi, half, assert_trivial=True))


@gluon.jit
def _glu_values(acc, acc2, bias_ptr, off_n, N, stride_bias, OUT_DTYPE: gl.constexpr,
                HAS_BIAS: gl.constexpr, ACT: gl.constexpr, GATED: gl.constexpr):
    """A gated tile's output values in registers: ``act(gate + bias[:N]) * (up + bias[N:])``
    in float32, rounded once. The gate and up sums are the two accumulators (GATED 1) or the
    column halves of one (2); bias_ptr (2N,) with stride_bias."""
    if GATED == 2:
        g, u = _halves(acc)
    else:
        g = acc
        u = acc2
    layout: gl.constexpr = g.type.layout
    W: gl.constexpr = g.type.shape[1]
    if HAS_BIAS:
        cols = off_n + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
        ok = cols < N
        bg = gl.load(bias_ptr + cols * stride_bias, mask=ok, other=0.0)
        bu = gl.load(bias_ptr + (N + cols) * stride_bias, mask=ok, other=0.0)
        g = g + gl.expand_dims(bg.to(gl.float32), 0)
        u = u + gl.expand_dims(bu.to(gl.float32), 0)
    y = (_glu_act(g, ACT) * u).to(OUT_DTYPE)
    # pinned here, as in _epilogue_values
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=y.dtype,
                                     is_pure=False, pack=2)


@gluon.jit
def _epilogue_store(y, c_desc, c_buf, row0, col0):
    """One column part's values through ``c_buf`` (made free by the caller) and a TMA store,
    waited for only before the buffer's next use."""
    c_buf.store(y)
    fence_async_shared()
    cta_barrier()
    tma_store(c_desc, [row0, col0], c_buf)


@gluon.jit
def _k_step(a_ring, b_ring, b2_ring, ready, empty, slot, phase, prev, acc, acc2,
            WG: gl.constexpr, TWO: gl.constexpr, STAGES: gl.constexpr, FIRST: gl.constexpr):
    """One K step: issue its wgmma asynchronously and retire the one before (``wait_group
    1``: this one runs on). FIRST: a tile's first step, on fresh sums (use_acc=False) with
    nothing else in flight, so the wait returns at once (it makes the sums tensors again);
    a later step gives the previous step's slot back to the producer."""
    mbarrier.wait(ready.index(slot), phase)
    acc, acc2 = _mma_step(a_ring, b_ring, b2_ring, slot, acc, acc2, WG, TWO, not FIRST)
    acc, acc2 = _mma_wait(acc, acc2, TWO, 1)
    if not FIRST:
        mbarrier.arrive(empty.index(prev), count=1)
    prev = slot
    slot += 1
    if slot == STAGES:
        slot = 0
        phase ^= 1
    return acc, acc2, slot, phase, prev


@gluon.jit
def _tile_mainloop(a_ring, b_ring, b2_ring, ready, empty, r_desc, r2_desc, r_bar, c_buf,
                   c2_buf, slot, phase, prev, acc, acc2, row0, off_n, k_steps,
                   WG: gl.constexpr, TWO: gl.constexpr, HAS_RES: gl.constexpr,
                   OVERLAP: gl.constexpr, STAGES: gl.constexpr):
    """A tile's K steps after its first (issued already), the residual's TMA load under them,
    and the drain: returns the finished sums with every slot of the tile released."""
    BN0: gl.constexpr = b_ring.shape[1]
    k0 = 1
    if HAS_RES:
        if OVERLAP:
            # the last tile's stores were issued just before this tile's first step: one more
            # step runs before the residual waits for them to have read the buffers
            if k_steps > 1:
                acc, acc2, slot, phase, prev = _k_step(a_ring, b_ring, b2_ring, ready, empty,
                                                       slot, phase, prev, acc, acc2, WG, TWO,
                                                       STAGES, False)
                k0 = 2
        _load_residual(r_desc, r2_desc, r_bar, c_buf, c2_buf, row0, off_n, BN0, TWO)
    for _ in range(k0, k_steps):
        acc, acc2, slot, phase, prev = _k_step(a_ring, b_ring, b2_ring, ready, empty, slot,
                                               phase, prev, acc, acc2, WG, TWO, STAGES, False)
    acc, acc2 = _mma_wait(acc, acc2, TWO, 0)
    mbarrier.arrive(empty.index(prev), count=1)
    return acc, acc2, slot, phase, prev


@gluon.jit
def _tile_values(acc, acc2, c_buf, c2_buf, r_bar, r_phase, bias_ptr, off_n, N, stride_bias,
                 OUT_DTYPE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                 TWO: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr):
    """The tile's output values in registers (each column part); the residual's wait."""
    BN0: gl.constexpr = acc.type.shape[1]
    if GATED:
        y = _glu_values(acc, acc2, bias_ptr, off_n, N, stride_bias, OUT_DTYPE, HAS_BIAS, ACT,
                        GATED)
        y2 = y  # (one output part)
    else:
        if HAS_RES:
            mbarrier.wait(r_bar, r_phase)
            r_phase ^= 1
        y = _epilogue_values(acc, c_buf, bias_ptr, off_n, N, stride_bias, OUT_DTYPE, HAS_BIAS,
                             HAS_RES)
        y2 = y  # (one part: unused)
        if TWO:
            y2 = _epilogue_values(acc2, c2_buf, bias_ptr, off_n + BN0, N, stride_bias,
                                  OUT_DTYPE, HAS_BIAS, HAS_RES)
    return y, y2, r_phase


@gluon.jit
def _tile_store(y, y2, c_desc, c2_desc, c_buf, c2_buf, row0, off_n, HAS_RES: gl.constexpr,
                TWO: gl.constexpr):
    """The tile's output values through the staging buffers and TMA stores."""
    if HAS_RES:
        cta_barrier()  # every thread has read the residual before the buffers are rewritten
    else:
        tma.store_wait(0)  # the previous tile's stores have read the buffers
        cta_barrier()
    _epilogue_store(y, c_desc, c_buf, row0, off_n)
    if TWO:
        _epilogue_store(y2, c2_desc, c2_buf, row0, off_n + y.type.shape[1])


@gluon.jit
def _consumer(WG: gl.constexpr, a_ring, b_ring, b2_ring, ready, empty, c_desc, c2_desc,
              c_buf, c2_buf, r_desc, r2_desc, r_bar, bias_ptr, M, N, K, stride_bias,
              HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, BLOCK_N: gl.constexpr,
              OVERLAP: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              GATED: gl.constexpr, ACT: gl.constexpr):
    """Consumer warpgroup WG: rows WG * 64 + [0, 64) of every tile of this CTA, columns in
    one part of BN0 or two (BN0, then BLOCK_N - BN0), each its own accumulator. OVERLAP: the
    next tile's first K step is issued once the sums are in registers as output values, so
    its wgmma runs under this tile's shared-memory stores; the CTA's last tile is peeled off
    the loop, so that no branch decides whether a wgmma is in flight (ptxas then serializes
    every wgmma of the kernel). OVERLAP 2 (gated tiles): the next tile's first K step is
    issued before the epilogue's math instead, into fresh sums. GATED: output tiles BLOCK_N
    wide computed as their gate and up sums, in two accumulators of BLOCK_N (1) or one of
    2 * BLOCK_N (2), stored as one part."""
    BLOCK_M: gl.constexpr = a_ring.shape[1]
    BLOCK_K: gl.constexpr = a_ring.shape[2]
    BN0: gl.constexpr = b_ring.shape[1]
    STORE2: gl.constexpr = BLOCK_N > BN0  # a second output part (192 = 128 + 64)
    TWO: gl.constexpr = STORE2 or GATED == 1  # a second accumulator
    if GATED == 1:
        BN1: gl.constexpr = BN0
    elif STORE2:
        BN1: gl.constexpr = BLOCK_N - BN0
    else:
        BN1: gl.constexpr = 8  # a stand-in sum, never used
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BN0, 16])
    acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BN1, 16])
    out_dtype: gl.constexpr = c_desc.dtype
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_steps = gl.cdiv(K, BLOCK_K)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    acc = gl.zeros([WG_M, BN0], gl.float32, acc_layout)
    acc2 = gl.zeros([WG_M, BN1], gl.float32, acc2_layout)
    slot = 0
    phase = 0
    prev = 0
    r_phase = 0
    if OVERLAP:
        if pid < num_tiles:  # (the launch makes at most one CTA a tile)
            acc, acc2, slot, phase, prev = _k_step(a_ring, b_ring, b2_ring, ready, empty, slot,
                                                   phase, prev, acc, acc2, WG, TWO, STAGES,
                                                   True)
            tile_id = pid
            for _ in range(1, gl.cdiv(num_tiles - pid, nprog)):
                pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
                row0 = pid_m * BLOCK_M + WG * WG_M
                off_n = pid_n * BLOCK_N
                acc, acc2, slot, phase, prev = _tile_mainloop(
                    a_ring, b_ring, b2_ring, ready, empty, r_desc, r2_desc, r_bar, c_buf,
                    c2_buf, slot, phase, prev, acc, acc2, row0, off_n, k_steps, WG, TWO,
                    HAS_RES, OVERLAP, STAGES)
                if OVERLAP == 2:
                    # the next tile's first step into fresh sums, then this tile's epilogue
                    # math under its wgmma (both tiles' sums live: narrow tiles only)
                    acc = _copy_f32(acc)
                    acc2 = _copy_f32(acc2)
                    nacc, nacc2, slot, phase, prev = _k_step(
                        a_ring, b_ring, b2_ring, ready, empty, slot, phase, prev,
                        gl.zeros([WG_M, BN0], gl.float32, acc_layout),
                        gl.zeros([WG_M, BN1], gl.float32, acc2_layout), WG, TWO, STAGES, True)
                    y, y2, r_phase = _tile_values(acc, acc2, c_buf, c2_buf, r_bar, r_phase,
                                                  bias_ptr, off_n, N, stride_bias, out_dtype,
                                                  HAS_BIAS, HAS_RES, TWO, GATED, ACT)
                    acc = nacc
                    acc2 = nacc2
                else:
                    y, y2, r_phase = _tile_values(acc, acc2, c_buf, c2_buf, r_bar, r_phase,
                                                  bias_ptr, off_n, N, stride_bias, out_dtype,
                                                  HAS_BIAS, HAS_RES, TWO, GATED, ACT)
                    # the next tile's first step, under this one's stores
                    acc, acc2, slot, phase, prev = _k_step(a_ring, b_ring, b2_ring, ready,
                                                           empty, slot, phase, prev, acc, acc2,
                                                           WG, TWO, STAGES, True)
                _tile_store(y, y2, c_desc, c2_desc, c_buf, c2_buf, row0, off_n, HAS_RES, STORE2)
                tile_id += nprog
            pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
            row0 = pid_m * BLOCK_M + WG * WG_M
            off_n = pid_n * BLOCK_N
            acc, acc2, slot, phase, prev = _tile_mainloop(
                a_ring, b_ring, b2_ring, ready, empty, r_desc, r2_desc, r_bar, c_buf, c2_buf,
                slot, phase, prev, acc, acc2, row0, off_n, k_steps, WG, TWO, HAS_RES, OVERLAP,
                STAGES)
            y, y2, r_phase = _tile_values(acc, acc2, c_buf, c2_buf, r_bar, r_phase, bias_ptr,
                                          off_n, N, stride_bias, out_dtype, HAS_BIAS, HAS_RES,
                                          TWO, GATED, ACT)
            _tile_store(y, y2, c_desc, c2_desc, c_buf, c2_buf, row0, off_n, HAS_RES, STORE2)
    else:
        for tile_id in range(pid, num_tiles, nprog):
            pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
            row0 = pid_m * BLOCK_M + WG * WG_M
            off_n = pid_n * BLOCK_N
            acc, acc2, slot, phase, prev = _k_step(a_ring, b_ring, b2_ring, ready, empty, slot,
                                                   phase, prev, acc, acc2, WG, TWO, STAGES,
                                                   True)
            acc, acc2, slot, phase, prev = _tile_mainloop(
                a_ring, b_ring, b2_ring, ready, empty, r_desc, r2_desc, r_bar, c_buf, c2_buf,
                slot, phase, prev, acc, acc2, row0, off_n, k_steps, WG, TWO, HAS_RES, OVERLAP,
                STAGES)
            y, y2, r_phase = _tile_values(acc, acc2, c_buf, c2_buf, r_bar, r_phase, bias_ptr,
                                          off_n, N, stride_bias, out_dtype, HAS_BIAS, HAS_RES,
                                          TWO, GATED, ACT)
            _tile_store(y, y2, c_desc, c2_desc, c_buf, c2_buf, row0, off_n, HAS_RES, STORE2)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["M", "N", "K", "stride_bias"])
def _gemm_ws_kernel(
    a_desc, b_desc, b2_desc, c_desc, c2_desc, r_desc, r2_desc, bias_ptr, M, N, K, stride_bias,
    HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, BLOCK_N: gl.constexpr,
    OVERLAP: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, GATED: gl.constexpr = 0,
    ACT: gl.constexpr = "",
):
    """Persistent warp-specialized GEMM (module docstring); tiles 128 x BLOCK_N in one column
    part (BLOCK_N = BN0, the block width of b_desc) or two (BN0 + BN1, b2_desc's: 192 =
    128 + 64, since a Gluon tensor's dimensions are powers of 2). a_desc: over a (M, K), block
    [128, BLOCK_K]; b_desc / b2_desc: over b's K-major storage (N, K), blocks [BN0, BLOCK_K]
    / [BN1, BLOCK_K]; c_desc / c2_desc: over out (M, N), blocks [64, BN0] / [64, BN1];
    r_desc / r2_desc the same over the residual (HAS_RES: a row-major (M, N) tensor of the
    output's dtype). Descriptors a call does not use (the second part's with one, the
    residual's without) are None: Triton's launcher encodes every descriptor it is given, per
    call. bias_ptr (N,) with stride_bias.
    GATED (``tkit.matmul_glu``): b_desc over the (2N, K) storage of a merged gate/up weight,
    block [BLOCK_N, BLOCK_K], used for both halves; N the output width; out = act(gate +
    bias[:N]) * (up + bias[N:]) with c_desc's block [64, BLOCK_N]; the gate and up sums in
    two accumulators (1) or the halves of one 2 * BLOCK_N wide (2); no residual.
    Launched with num_warps = 4 (consumer warpgroup 0); the second consumer warpgroup is a
    4-warp partition, the producer a 1-warp one."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    CONSUMERS: gl.constexpr = 2
    gl.static_assert(BLOCK_M == CONSUMERS * WG_M, "BLOCK_M is 64 rows a consumer warpgroup")
    BN0: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    if GATED:
        gl.static_assert(BLOCK_N == BN0, "a gated tile is b's block wide")
        gl.static_assert(not HAS_RES, "a gated tile takes no residual")
    if BLOCK_N > BN0:
        gl.static_assert(BLOCK_N == BN0 + b2_desc.block_type.shape[0],
                         "BLOCK_N is one or two column parts")
    dtype: gl.constexpr = a_desc.dtype
    a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    if GATED == 2:  # gate rows in the slot's first half, up rows in its second
        b_ring = gl.allocate_shared_memory(dtype, [STAGES, 2 * BN0, BLOCK_K], b_desc.layout)
    else:
        b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape,
                                           b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS] + c_desc.block_type.shape,
                                       c_desc.layout)
    if GATED == 1:
        b2_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape,
                                            b_desc.layout)
    elif BLOCK_N > BN0:
        b2_ring = gl.allocate_shared_memory(dtype, [STAGES] + b2_desc.block_type.shape,
                                            b2_desc.layout)
    else:  # one part: the first part's ring stands in, unread
        b2_ring = b_ring
    if BLOCK_N > BN0:
        c2_bufs = gl.allocate_shared_memory(c2_desc.dtype,
                                            [CONSUMERS] + c2_desc.block_type.shape,
                                            c2_desc.layout)
    else:  # one part: the first part's buffers stand in, unread
        c2_bufs = c_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    r_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)
    for s in gl.static_range(CONSUMERS):
        mbarrier.init(r_bars.index(s), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (0, a_ring, b_ring, b2_ring, ready, empty, c_desc, c2_desc,
                     c_bufs.index(0), c2_bufs.index(0), r_desc, r2_desc, r_bars.index(0),
                     bias_ptr, M, N, K, stride_bias, HAS_BIAS, HAS_RES, BLOCK_N,
                     OVERLAP, STAGES, GROUP_M, GATED, ACT)),
        (_consumer, (1, a_ring, b_ring, b2_ring, ready, empty, c_desc, c2_desc,
                     c_bufs.index(1), c2_bufs.index(1), r_desc, r2_desc, r_bars.index(1),
                     bias_ptr, M, N, K, stride_bias, HAS_BIAS, HAS_RES, BLOCK_N,
                     OVERLAP, STAGES, GROUP_M, GATED, ACT)),
        (_producer, (a_desc, b_desc, b2_desc, a_ring, b_ring, b2_ring, ready, empty, M, N, K,
                     BLOCK_N, STAGES, GROUP_M, GATED)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
