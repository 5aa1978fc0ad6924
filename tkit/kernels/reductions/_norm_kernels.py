"""The norms' Triton kernels: RMSNorm (optionally fused with the residual add) and LayerNorm,
forward and backward. The math and the paths are described in ``tkit.kernels.reductions``."""

from __future__ import annotations

import triton
import triton.language as tl

from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels.reductions._rows import _row_offsets


@triton.jit
def _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, sxm, sxn, srm, srn, shm,
            HAS_RES: tl.constexpr, STORE_H: tl.constexpr, EVICT: tl.constexpr):
    """One (rows x cols) tile of h in float32: x, or x + residual rounded to h's dtype (stored
    when STORE_H). EVICT is the L2 policy of the data a later walk reads again: x's loads, or
    with HAS_RES the store of h ("evict_last" in the loop path's first walk); x and the
    residual are then read once and take no hint (an "evict_first" hint measured slower)."""
    if HAS_RES:
        x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxn, mask=mask,
                    other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows[:, None] * srm + cols[None, :] * srn, mask=mask,
                    other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        if STORE_H:
            if EVICT == "evict_last":
                tl.store(h_ptr + rows[:, None] * shm + cols[None, :], h, mask=mask,
                         eviction_policy="evict_last")
            else:
                tl.store(h_ptr + rows[:, None] * shm + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    else:
        x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxn, mask=mask, other=0.0,
                    eviction_policy=EVICT).to(tl.float32)
    return x


@triton.jit
def _square(d):
    """d * d rounded on its own, never contracted into the add that consumes it.

    A row reduced within one warp leaves a copy of its sum in every lane of the row, and those
    copies must be bitwise equal: the saved statistics are stored through a layout conversion
    in which every such lane writes the same shared-memory word (the store of the owner lane
    alone reaches global memory). A plain ``d * d`` lets the compiler fuse the square into
    the butterfly's first add, ``fma(d_i, d_i, shfl(d_j * d_j))``, which lane i and lane j
    round differently: racecheck then sees two lanes write one word with different values,
    and which copy is saved is a race. With the square rounded first, every butterfly step is
    ``a + b`` in one lane and ``b + a`` in its partner, equal bit for bit. An explicit
    rounding mode is what keeps both LLVM and ptxas from contracting a multiply; libdevice's
    ``mul_rn`` would also flush subnormal squares to zero. (The interpreter runs no PTX and
    never contracts.)"""
    if _INTERPRET:
        return d * d
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $1;", "=r,r", [d], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _centered_rstd(h, mask, N, eps, IS_RMS: tl.constexpr):
    """Rows held whole in registers: (d, mean, rstd) with d = h (RMSNorm, mean 0) or
    h - mean(h) (LayerNorm, zero outside ``mask``), rstd = 1 / sqrt(mean(d^2) + eps): the
    two-pass variance."""
    if IS_RMS:
        d = h
        mean = tl.zeros((h.shape[0],), dtype=tl.float32)
    else:
        mean = tl.sum(h, axis=1) / N
        d = tl.where(mask, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(_square(d), axis=1) / N + eps)
    return d, mean, rstd


@triton.jit
def _scale_store(d, rstd, rows, cols, cmask, mask, w_ptr, b_ptr, y_ptr, sym,
                 HAS_BIAS: tl.constexpr):
    """y = d * rstd * w (+ b) for a (rows x cols) tile of centered values d, stored in y's
    dtype."""
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * sym + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _fwd_rows(h, rows, rmask, cols, cmask, w_ptr, b_ptr, y_ptr, stats_ptr, N, sym, eps,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_STATS: tl.constexpr):
    """Normalize a tile of whole rows held in registers (float32) and store y (and stats)."""
    mask = rmask[:, None] & cmask[None, :]
    d, mean, rstd = _centered_rstd(h, mask, N, eps, IS_RMS)
    if SAVE_STATS:
        tl.store(stats_ptr + rows * 2, mean, mask=rmask)
        tl.store(stats_ptr + rows * 2 + 1, rstd, mask=rmask)
    _scale_store(d, rstd, rows, cols, cmask, mask, w_ptr, b_ptr, y_ptr, sym, HAS_BIAS)


@triton.jit
def _loop_mask(rmask, cols, N, EVEN: tl.constexpr):
    """The (ROWS, BLOCK_N) mask of one chunk of the loop path; all true (folded away by the
    compiler) when EVEN says every chunk is full and the one row of the program exists."""
    if EVEN:
        return tl.full((rmask.shape[0], cols.shape[0]), True, tl.int1)
    return rmask[:, None] & (cols < N)[None, :]


@triton.jit
def _lane_update(h, mask, k, lane_mean, lane_m2, IS_RMS: tl.constexpr):
    """One chunk into the loop path's per-lane accumulators: the sum of h^2 (RMSNorm), or
    Welford's running mean and M2 of the k values a lane has seen (LayerNorm; ``mask``: lanes
    past the row end keep their state)."""
    if IS_RMS:
        lane_m2 += h * h
    else:
        delta = h - lane_mean
        lane_mean = tl.where(mask, lane_mean + delta * (1.0 / k), lane_mean)
        lane_m2 = tl.where(mask, lane_m2 + delta * (h - lane_mean), lane_m2)
    return lane_mean, lane_m2


@triton.jit
def _chan_combine(m1, q1, n1, m2, q2, n2):
    """Chan et al.'s pairwise combine of two (mean, M2, count) summaries; empty ones (count
    0) add nothing."""
    d = m2 - m1
    n = n1 + n2
    f = tl.where(n == 0.0, 0.0, n2 / n)
    return m1 + d * f, q1 + q2 + d * d * n1 * f, n


@triton.jit
def _norm_fwd_kernel(
    x_ptr, r_ptr, h_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, M, N, sxm, sxn, srm, srn, shm, sym,
    eps, IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, INT64: tl.constexpr,
    SAVE_STATS: tl.constexpr,
    NCHUNK: tl.constexpr = 0, EVEN: tl.constexpr = False, CHAN: tl.constexpr = False,
    REV2: tl.constexpr = True, STATIC2: tl.constexpr = False,
):
    """y = norm(h) * w (+ b) for ROWS rows a program.

    x_ptr, r_ptr: input and residual rows (row strides sxm/srm, column strides sxn/srn; r_ptr
    unused without HAS_RES); h_ptr: x + residual output (row stride shm, contiguous columns);
    w_ptr, b_ptr: weight and bias (N,); y_ptr: output, row stride sym. SINGLE: the whole row
    fits one BLOCK_N tile; otherwise ROWS is 1 and the row is walked in BLOCK_N chunks twice.
    SAVE_STATS: store (mean, rstd) of each row to stats_ptr, float32 (M, 2) (mean 0 for
    RMSNorm), for the backward.
    NCHUNK (loop path): the number of BLOCK_N chunks of a row when the first walk is unrolled
    at compile time, 0 for a run-time loop (long rows). EVEN (loop path, ROWS = 1): N is a
    multiple of BLOCK_N, so the loads and stores need no mask and no predicate register (a
    thread has 7, and one held by each predicated load capped the loads in flight).
    CHAN (loop path, LayerNorm): the lanes' (count, mean, M2) are combined by one three-value
    reduction with Chan's pairwise update instead of two sums (the mean, then the squared
    deviations from it). REV2 (loop path): the second walk goes last chunk first. STATIC2
    (loop path with NCHUNK): the second walk is unrolled at compile time as well.
    """
    if SINGLE:
        rows, rmask = _row_offsets(tl.program_id(0), M, ROWS, INT64)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        h = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, sxm, sxn, srm, srn, shm,
                    HAS_RES, True, "")
        _fwd_rows(h, rows, rmask, cols, cmask, w_ptr, b_ptr, y_ptr, stats_ptr, N, sym, eps,
                  IS_RMS, HAS_BIAS, SAVE_STATS)
    else:
        rows, rmask = _row_offsets(tl.program_id(0), M, ROWS, INT64)
        # per-lane accumulators, reduced across the program once after the walk (a
        # cross-warp reduction a chunk costs a shared-memory round trip and barriers each
        # time): RMSNorm sums h^2 a lane; LayerNorm runs Welford's update a lane, every full
        # lane having seen k values after chunk k (only the last chunk is partial)
        lane_mean = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        lane_m2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        if NCHUNK > 0:
            # the chunk count known at compile time: the walk is unrolled and every chunk's
            # load can be issued before the first update (all of a row in flight at once)
            for c in tl.static_range(NCHUNK):
                cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = _loop_mask(rmask, cols, N, EVEN)
                h = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, sxm, sxn, srm, srn, shm,
                            HAS_RES, True, "evict_last")
                lane_mean, lane_m2 = _lane_update(h, mask, c + 1, lane_mean, lane_m2, IS_RMS)
        else:
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = _loop_mask(rmask, cols, N, EVEN)
                h = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, sxm, sxn, srm, srn, shm,
                            HAS_RES, True, "evict_last")
                lane_mean, lane_m2 = _lane_update(h, mask, start // BLOCK_N + 1, lane_mean,
                                                  lane_m2, IS_RMS)
        if IS_RMS:
            mean = tl.zeros((ROWS,), dtype=tl.float32)
            m2 = tl.sum(lane_m2, axis=1)
        else:
            # combine the lanes (count c, mean m, M2 q), exactly
            lane = tl.arange(0, BLOCK_N)
            nfull = N // BLOCK_N
            cnt = (nfull + (lane < N - nfull * BLOCK_N).to(tl.int32)).to(tl.float32)
            if CHAN and EVEN:
                # pairwise (Chan et al.), one reduction of three values. Every lane has seen
                # c = N / BLOCK_N values, and Chan's update depends on the counts' ratios
                # alone, M2 scaling with c: so the lanes enter with count 1 and M2 / c, and
                # the result's M2 is scaled back by c. Constant counts let the compiler fold
                # the thread-local part of the combine (its divisions) away.
                c_lane = (N // BLOCK_N).to(tl.float32)
                mean, m2, _n = tl.reduce(
                    (lane_mean, lane_m2 * (1.0 / c_lane),
                     tl.full((ROWS, BLOCK_N), 1.0, tl.float32)), 1, _chan_combine)
                m2 = m2 * c_lane
            elif CHAN:
                mean, m2, _n = tl.reduce(
                    (lane_mean, lane_m2, tl.broadcast_to(cnt[None, :], (ROWS, BLOCK_N))), 1,
                    _chan_combine)
            else:
                # mean = sum(c m) / N, then M2 = sum(q + c (m - mean)^2): two reductions
                mean = tl.sum(lane_mean * cnt[None, :], axis=1) / N
                dm = lane_mean - mean[:, None]
                m2 = tl.sum(lane_m2 + cnt[None, :] * dm * dm, axis=1)
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        if SAVE_STATS:
            tl.store(stats_ptr + rows * 2, mean, mask=rmask)
            tl.store(stats_ptr + rows * 2 + 1, rstd, mask=rmask)
        tl.debug_barrier()  # h written above is read back below
        # REV2: the second walk goes last chunk first, the chunks read last being the
        # likeliest to still be in L2 (in the same order it rereads the oldest first).
        # STATIC2: unrolled at compile time too, so that its loads can be issued ahead
        if STATIC2 and NCHUNK > 0:
            for c in tl.static_range(NCHUNK):
                start = ((NCHUNK - 1 - c) if REV2 else c) * BLOCK_N
                _second_chunk(start, rows, rmask, mean, rstd, x_ptr, h_ptr, w_ptr, b_ptr,
                              y_ptr, N, sxm, sxn, shm, sym, IS_RMS, HAS_RES, HAS_BIAS, BLOCK_N,
                              EVEN)
        else:
            last = (tl.cdiv(N, BLOCK_N) - 1) * BLOCK_N
            for i in range(0, N, BLOCK_N):
                if REV2:
                    start = last - i
                else:
                    start = i
                _second_chunk(start, rows, rmask, mean, rstd, x_ptr, h_ptr, w_ptr, b_ptr,
                              y_ptr, N, sxm, sxn, shm, sym, IS_RMS, HAS_RES, HAS_BIAS, BLOCK_N,
                              EVEN)


@triton.jit
def _second_chunk(start, rows, rmask, mean, rstd, x_ptr, h_ptr, w_ptr, b_ptr, y_ptr, N, sxm,
                  sxn, shm, sym, IS_RMS: tl.constexpr, HAS_RES: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """One chunk of the loop path's second walk: h reread (from L2, most of it), centered
    (LayerNorm), scaled and stored."""
    cols = start + tl.arange(0, BLOCK_N)
    mask = _loop_mask(rmask, cols, N, EVEN)
    cmask = cols < N
    if EVEN:
        cmask = tl.full((BLOCK_N,), True, tl.int1)
    if HAS_RES:
        h = tl.load(h_ptr + rows[:, None] * shm + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
    else:
        h = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxn, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
    if not IS_RMS:
        h = h - mean[:, None]
    _scale_store(h, rstd, rows, cols, cmask, mask, w_ptr, b_ptr, y_ptr, sym, HAS_BIAS)



@triton.jit
def _norm_bwd_stats_kernel(
    h_ptr, w_ptr, dy_ptr, stats_ptr, fs_ptr, N, shm, shn, sdym, sdyn, eps,
    IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr, INT64: tl.constexpr,
    HAS_FSTATS: tl.constexpr,
):
    """Per-row statistics for long rows: stats[row] = (mean, rstd, mean(g), mean(g * xhat)).

    h_ptr: the normalized input (row/column strides shm/shn); dy_ptr: output gradient
    (sdym/sdyn); w_ptr: weight (N,); stats_ptr: float32 (M, 4); fs_ptr: the forward's (M, 2)
    (mean, rstd) with HAS_FSTATS, which saves the first walk over the row.
    """
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, 0 if HAS_FSTATS else N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        h = tl.load(h_ptr + row * shm + cols * shn, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            m2 += tl.sum(h * h, axis=0)
        else:
            nc = tl.minimum(N - start, BLOCK_N).to(tl.float32)
            mc = tl.sum(h, axis=0) / nc
            dc = tl.where(mask, h - mc, 0.0)
            delta = mc - mean
            total = count + nc
            mean += delta * (nc / total)
            m2 += tl.sum(dc * dc, axis=0) + delta * delta * (count * nc / total)
            count = total
    if HAS_FSTATS:
        mean = tl.load(fs_ptr + row * 2)
        rstd = tl.load(fs_ptr + row * 2 + 1)
    else:
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
    s1 = 0.0
    s2 = 0.0
    last = (tl.cdiv(N, BLOCK_N) - 1) * BLOCK_N
    for i in range(0, N, BLOCK_N):  # last chunk first: the likeliest to still be in L2
        start = last - i
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        h = tl.load(h_ptr + row * shm + cols * shn, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * sdym + cols * sdyn, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g = dy * w
        s1 += tl.sum(g, axis=0)
        s2 += tl.sum(g * (h - mean) * rstd, axis=0)
    tl.store(stats_ptr + row * 4 + 0, mean)
    tl.store(stats_ptr + row * 4 + 1, rstd)
    tl.store(stats_ptr + row * 4 + 2, s1 / N)
    tl.store(stats_ptr + row * 4 + 3, s2 / N)


@triton.jit
def _load_h_dy(h_ptr, dy_ptr, fs_ptr, tile, cols, cmask, M, shm, shn, sdym, sdyn,
               ROWS: tl.constexpr, INT64: tl.constexpr, HAS_FSTATS: tl.constexpr):
    """Row tile ``tile`` of h and dy in their own dtype (zeros outside the matrix), and the
    forward's (mean, rstd) of its rows with HAS_FSTATS (zeros otherwise)."""
    rows, rmask = _row_offsets(tile, M, ROWS, INT64)
    mask = rmask[:, None] & cmask[None, :]
    h = tl.load(h_ptr + rows[:, None] * shm + cols[None, :] * shn, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * sdym + cols[None, :] * sdyn, mask=mask, other=0.0)
    if HAS_FSTATS:
        mean = tl.load(fs_ptr + rows * 2, mask=rmask, other=0.0)
        rstd = tl.load(fs_ptr + rows * 2 + 1, mask=rmask, other=0.0)
    else:
        mean = tl.zeros((ROWS,), dtype=tl.float32)
        rstd = tl.zeros((ROWS,), dtype=tl.float32)
    return h, dy, mean, rstd


@triton.jit
def _norm_bwd_kernel(
    h_ptr, w_ptr, dy_ptr, dres_ptr, dx_ptr, dw_ptr, db_ptr, stats_ptr, fs_ptr,
    M, N, shm, shn, sdym, sdyn, sdrm, sdrn, sdxm, eps,
    IS_RMS: tl.constexpr, HAS_DRES: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, INT64: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_FSTATS: tl.constexpr,
):
    """dx for the row tiles g, g + G, g + 2G, ... (G = programs along axis 0) in the column
    chunk of axis 1, plus this program's dw/db partials.

    h_ptr: normalized input (strides shm/shn); dy_ptr, dres_ptr: gradients of y and of h
    (the latter only with HAS_DRES); dx_ptr: output, row stride sdxm; dw_ptr, db_ptr: float32
    (G, N) partials; stats_ptr: (M, 4) per-row statistics when not SINGLE; fs_ptr: the
    forward's (M, 2) (mean, rstd) with HAS_FSTATS (SINGLE only). PREFETCH: the loads of the
    next row tile are issued before this tile's reductions (software pipelining by hand: a
    program that holds a whole 8192-column row uses most of an SM's registers, so no second
    program hides its load latency).

    Reductions a row (SINGLE): with the forward's statistics one round, sum(g * d) (and
    sum(g) beside it for LayerNorm); without them, sum(h) (with sum(g)), then sum(d^2) (with
    sum(g * d)): mean(g * xhat) is taken as rstd * mean(g * d), so it needs no rstd first.
    Each round is a shuffle + shared-memory + barrier chain that nothing else on the SM hides.
    """
    g = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PREFETCH:
        h_next, dy_next, mean_next, rstd_next = _load_h_dy(
            h_ptr, dy_ptr, fs_ptr, g, cols, cmask, M, shm, shn, sdym, sdyn, ROWS, INT64,
            HAS_FSTATS)
    for tile in range(g, tl.cdiv(M, ROWS), G):
        rows, rmask = _row_offsets(tile, M, ROWS, INT64)
        mask = rmask[:, None] & cmask[None, :]
        if PREFETCH:
            h, dy, mean, rstd = h_next, dy_next, mean_next, rstd_next
            h_next, dy_next, mean_next, rstd_next = _load_h_dy(
                h_ptr, dy_ptr, fs_ptr, tile + G, cols, cmask, M, shm, shn, sdym, sdyn, ROWS,
                INT64, HAS_FSTATS)
        else:
            h, dy, mean, rstd = _load_h_dy(h_ptr, dy_ptr, fs_ptr, tile, cols, cmask, M, shm,
                                           shn, sdym, sdyn, ROWS, INT64, HAS_FSTATS)
        h = h.to(tl.float32)
        dy = dy.to(tl.float32)
        gy = dy * w[None, :]
        if SINGLE:
            if IS_RMS:
                d = h
            else:
                c1 = tl.sum(gy, axis=1) / N
                if not HAS_FSTATS:
                    mean = tl.sum(h, axis=1) / N
                d = tl.where(mask, h - mean[:, None], 0.0)
            if not HAS_FSTATS:
                rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
            gd = tl.sum(gy * d, axis=1) / N
            xhat = d * rstd[:, None]
            dx = gy - xhat * (gd * rstd)[:, None]
            if not IS_RMS:
                dx -= c1[:, None]
        else:
            st = stats_ptr + rows * 4
            mean = tl.load(st + 0, mask=rmask, other=0.0)
            rstd = tl.load(st + 1, mask=rmask, other=0.0)
            c1 = tl.load(st + 2, mask=rmask, other=0.0)
            c2 = tl.load(st + 3, mask=rmask, other=0.0)
            if IS_RMS:
                xhat = h * rstd[:, None]
                dx = gy - xhat * c2[:, None]
            else:
                xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
                dx = gy - c1[:, None] - xhat * c2[:, None]
        dx = dx * rstd[:, None]
        if HAS_DRES:
            dx += tl.load(dres_ptr + rows[:, None] * sdrm + cols[None, :] * sdrn, mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * sdxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    tl.store(dw_ptr + g * N + cols, dw, mask=cmask)
    if HAS_BIAS:
        tl.store(db_ptr + g * N + cols, db, mask=cmask)


@triton.jit
def _col_sum_kernel(part_ptr, out_ptr, G, N, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = sum_g part[g, n]: part_ptr is float32 (G, N) contiguous; out_ptr (N,)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32)
    for start in range(0, G, BLOCK_G):
        gs = start + tl.arange(0, BLOCK_G)
        acc += tl.load(part_ptr + gs[:, None] * N + cols[None, :],
                       mask=(gs < G)[:, None] & cmask[None, :], other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cmask)
