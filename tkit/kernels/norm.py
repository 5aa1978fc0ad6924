"""RMSNorm (optionally fused with the residual add) and LayerNorm, forward and backward.

Math, per row h of length N (float32 inside, rounded once on store; w = weight, b = bias):

    rms_norm     rstd = 1 / sqrt(mean(h^2) + eps)            y = h * rstd * w
    layer_norm   mu = mean(h), rstd = 1 / sqrt(mean((h - mu)^2) + eps)
                                                            y = (h - mu) * rstd * w + b
    residual     h = x + residual, rounded to x's dtype and stored; y is the norm of that
                 stored h (what the next layer's residual stream holds), both in one pass.

The variance never takes E[x^2] - E[x]^2 (which cancels): a row held in registers takes its
mean first and then the mean of squared deviations (two-pass); a row walked in chunks keeps a
Welford mean and M2 in each lane, and the lanes are combined with the exact parallel form
(mean = sum(c m) / N, then M2 = sum(q + c (m - mean)^2)); the split path combines its chunks'
moments with Chan's rule.

Backward (xhat = (h - mu) * rstd, mu = 0 for RMSNorm; g = dy * w):

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))       (no mean(g) term for RMSNorm)
    dw = sum over rows of dy * xhat,  db = sum over rows of dy
    with the residual form, the gradient of h adds dh (h is an output too), and x and
    residual both receive dx.

Cost model: forward reads M*N (+ M*N residual) + N, writes M*N (+ M*N h); backward reads h, dy
(+ dh), writes dx, plus the small dw/db partials. A few FLOPs per element: memory-bound at any N.

Kernels:

* ``_norm_fwd_kernel``: short rows in registers (ROWS rows a program, ``SINGLE``); from the
  lengths in ``LOOP_SHAPES`` (RMSNorm 4096 columns, the residual form 2048, LayerNorm 16384)
  the "loop" path: one program per row, walking its chunks twice (per-lane moments, then
  normalize; the second read mostly hits L2), one launch. H200, bf16, 256 MiB input (runs q
  and r of 2026-11-30), N=65536 / 131072 / 262144: rms_norm 3.62 / 3.24 / 2.84 TB/s
  (torch.compile 2.72 / 2.59 / 2.57), layer_norm 3.10 / 2.81 / 2.59 (compile 2.25 / 2.17 /
  2.05).
  ``OVERRIDE["norm_long"] = "split"`` selects the alternative: ``_norm_partial_kernel``
  computes each (row, chunk)'s moments (and writes h), ``_norm_apply_kernel`` combines a row's
  chunk moments and normalizes its chunk (softmax's split structure). It measured 0.57-0.67
  TB/s with 24 MiB row batches (16 launches at ~50 us of host time each) and 2.61-2.63 in one
  batch: the launches, not the partials' round trip (8 floats a 16 KiB chunk), cost the time.
* ``_norm_bwd_kernel``: grid (G, chunks). Each of G programs walks a strided set of row tiles
  and accumulates its dw/db partial in float32 registers, writing one (G, N) partial row;
  ``_col_sum_kernel`` then reduces the G partials (the Triton-tutorial / Liger pattern). Rows
  up to 32 KiB compute their statistics in registers; longer rows take them from
  ``_norm_bwd_stats_kernel`` (one program a row, looping over chunks). G is one program an SM
  and each program loads its next row tile before reducing the current one (``PREFETCH``):
  a program holding a whole 8 KiB row fills an SM's register file, so nothing else hides its
  load latency. H200, M=16384 x N=8192 bf16: rms_norm 2.32 -> 3.81 TB/s, layer_norm
  2.28 -> 3.38 (54% -> 90% and 80% of the copy ceiling).

When autograd will need them, the forward also stores each row's (mean, rstd) (8 bytes a
row, float32): the backward then reduces once a row instead of two (RMSNorm) or three
(LayerNorm) times. Each reduction of a row held by a whole program is a chain of shuffles, a
shared-memory round trip and barriers that no other program on the SM overlaps (one program
fills the register file), so the chain's length, not the bytes, is what the backward's time
beyond the copy is made of. Without saved statistics (``_norm_bwd_impl(stats=None)``) the
backward recomputes them, pairing independent sums in each round.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _launch as L
from tkit.kernels import _plan as P
from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels.softmax import OVERRIDE, _row_offsets, as_rows, row_batch, row_config

#: Largest row a program holds in registers (ptxas for sm_90a on tkit's launches, bf16):
#: 64 KiB forward (32768 columns over 32 warps: 62-63 registers, no spills) and 32 KiB
#: backward (16384 columns over 32 warps: 64 registers, no spills; it also holds w and the
#: dw/db partials).
FWD_SINGLE_MAX_BYTES = 64 * 1024
BWD_SINGLE_MAX_BYTES = 32 * 1024
#: Plain RMSNorm took the chunked "loop" path for rows over 32 KiB before ``LOOP_SHAPES`` (still
#: the rule in the interpreter and under a ``norm_fwd_single_bytes`` override).
RMS_FWD_SINGLE_MAX_BYTES = 32 * 1024
#: The forward's loop path on the GPU: (largest N, chunk, warps, style) rows, first match
#: wins; chunk 0 = the row held in registers (``row_config``). The loop path walks a row twice,
#: the second walk from L2, with per-lane accumulators and, up to 16 chunks, the first walk
#: unrolled with all its loads issued up front. It beat a row held in registers from 4096
#: columns for RMSNorm, 2048 for the residual form and 16384 for LayerNorm: its programs hold
#: far fewer registers (30-60 against 120+), so several share an SM and hide each other's
#: latency. H200, 256 MiB bf16, 2026-11-30, medians of 3 interleaved rounds (TB/s, loop shape
#: against the row in registers): rms_norm N=4096 4.16 (c4k w8) / 3.98, N=16384 4.10 (c8k w16)
#: / 3.92, N=32768 4.08 (c16k w32) / loop c16k w16 4.06, N=65536 3.68 (c32k w32) / 3.43 (c16k
#: w16); layer_norm N=16384 3.84 (c2k w16) / 3.76, N=32768 3.65 (c8k w32) / 3.05 (c16k w16),
#: N=65536 3.12 / 2.70; residual N=4096 4.14 (c2k w8) / 3.94, N=8192 4.20 (c8k w32) / 4.02,
#: N=16384 4.11 (c16k w32) / 3.98, N=65536 3.93 / 3.60. torch.compile generates the same
#: structure (inductor's looped reduction, R0_BLOCK 2048-32768).
#:
#: style (``LOOP_STYLES``): "chan", LayerNorm's lanes combined by one Chan reduce (else two
#: sums); "fwd", the second walk in column order (else last chunk first); "s2", the second walk
#: unrolled at compile time when the first is. The last two let the compiler see a fixed-shape
#: row, as in torch.compile's kernels (constant N: both walks unrolled), and issue the second
#: walk's loads ahead. Same run, 5 interleaved rounds (2026-11-30, git fd398cf), TB/s:
#: layer_norm N=16384 c4k w16 chan fwd s2 3.996 against c2k w16 sum2 rev 3.796 (torch.compile
#: 3.941); N=32768 c8k w32 sum2 fwd s2 3.775 / 3.656; N=65536 c16k w32 chan fwd s2 3.314 /
#: c8k w32 3.086; rms_norm N=16384 fwd s2 4.120 / 4.064, N=32768 4.104 / 4.087. Longer rows
#: (no unrolled walk) and the residual form measured no better in any style.
LOOP_SHAPES = {
    "rms_norm": ((2048, 0, 0, ""), (4096, 4096, 8, ""), (16384, 8192, 16, "fwd s2"),
                 (32768, 16384, 32, "fwd s2"), (None, 32768, 32, "")),
    "rms_norm_residual": ((1024, 0, 0, ""), (4096, 2048, 8, ""), (8192, 8192, 32, ""),
                          (None, 16384, 32, "")),
    "layer_norm": ((8192, 0, 0, ""), (16384, 4096, 16, "chan fwd s2"),
                   (32768, 8192, 32, "fwd s2"), (65536, 16384, 32, "chan fwd s2"),
                   (None, 8192, 32, "")),
}
LOOP_STYLES = ("chan", "fwd", "s2")
assert all(set(row[3].split()) <= set(LOOP_STYLES) for rows in LOOP_SHAPES.values()
           for row in rows), "LOOP_SHAPES: unknown style"


def _loop_shape(N: int, is_rms: bool, has_res: bool) -> tuple[int, int, str]:
    """(chunk, warps, style) of the forward for rows of N columns on the GPU; chunk 0: one row
    (or several) in registers."""
    table = LOOP_SHAPES["layer_norm" if not is_rms else
                        "rms_norm_residual" if has_res else "rms_norm"]
    for max_n, chunk, warps, style in table:
        if max_n is None or N <= max_n:
            return chunk, warps, style
    raise AssertionError("LOOP_SHAPES ends with a catch-all row")


def _loop_flags(N: int, is_rms: bool, has_res: bool) -> dict:
    """CHAN / REV2 / STATIC2 of the loop path for rows of N columns: ``LOOP_SHAPES``' style on
    the GPU (none in the interpreter), each overridable (``norm_chan``, ``norm_rev2``,
    ``norm_static2``)."""
    style = "" if _env.INTERPRET else _loop_shape(N, is_rms, has_res)[2].split()
    return dict(CHAN=OVERRIDE.get("norm_chan", "chan" in style),
                REV2=OVERRIDE.get("norm_rev2", "fwd" not in style),
                STATIC2=OVERRIDE.get("norm_static2", "s2" in style))


#: Row tiles from this size take the persistent forward (``_fwd_persist``); 0 = never. Measured
#: on the H200 (2026-11-30, 256 MiB bf16, forced on / off, same run): slower everywhere it
#: applies: rms_norm N=4096 3.04 / 3.94 TB/s, N=8192 3.73 / 4.02, N=16384 3.81 / 3.91;
#: layer_norm N=8192 3.07 / 3.98, N=16384 3.70 / 3.74, N=32768 2.01 / 3.18; residual N=32768
#: 3.04 / 4.00. (The backward walks tiles because it accumulates dw/db partials a program, and
#: there the prefetch paid; the forward has no such need, and one program a tile ran faster.)
FWD_PERSIST_BYTES = 0


#: L2 policy of the forward's single-tile loads. "evict_first" (read once) measured slower in
#: every config on the H200 (2026-11-30, M=16384 x N=8192 bf16, best config each way):
#: rms_norm 3.89 -> 4.05 TB/s without it, layer_norm 3.82 -> 4.02, residual 3.90 -> 3.97.
_fwd_evict = ""


def _chunk() -> int:
    return OVERRIDE.get("norm_chunk", 4096 if _env.INTERPRET else 8192)


def _fwd_loop_chunk() -> int:
    """Chunk of the forward's "loop" path: 16384 columns (16 warps, 32 values a thread). H200,
    256 MiB bf16, 2026-11-30: rms_norm N=65536 / 131072 / 262144 3.13 / 2.83 / 2.66 TB/s
    against 3.01 / 2.73 / 2.63 with 8192; layer_norm 2.86 / 2.66 / 2.58 against 2.67 / 2.48 /
    2.16."""
    return OVERRIDE.get("norm_chunk", 4096 if _env.INTERPRET else 16384)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
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
def _load_xr(x_ptr, r_ptr, tile, cols, cmask, M, sxm, sxn, srm, srn, ROWS: tl.constexpr,
             INT64: tl.constexpr, HAS_RES: tl.constexpr):
    """Row tile ``tile`` of x (and the residual) in their own dtype, zeros outside the matrix
    (r is x's tile again without HAS_RES, unused)."""
    rows, rmask = _row_offsets(tile, M, ROWS, INT64)
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxn, mask=mask, other=0.0)
    r = x
    if HAS_RES:
        r = tl.load(r_ptr + rows[:, None] * srm + cols[None, :] * srn, mask=mask, other=0.0)
    return x, r


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
    EVICT: tl.constexpr, SAVE_STATS: tl.constexpr, PERSIST: tl.constexpr,
    NCHUNK: tl.constexpr = 0, EVEN: tl.constexpr = False, CHAN: tl.constexpr = False,
    REV2: tl.constexpr = True, STATIC2: tl.constexpr = False,
):
    """y = norm(h) * w (+ b) for ROWS rows a program.

    x_ptr, r_ptr: input and residual rows (row strides sxm/srm, column strides sxn/srn; r_ptr
    unused without HAS_RES); h_ptr: x + residual output (row stride shm, contiguous columns);
    w_ptr, b_ptr: weight and bias (N,); y_ptr: output, row stride sym. SINGLE: the whole row
    fits one BLOCK_N tile; otherwise ROWS is 1 and the row is walked in BLOCK_N chunks twice.
    EVICT: the L2 policy of the single-tile loads ("" for none, or "evict_first").
    SAVE_STATS: store (mean, rstd) of each row to stats_ptr, float32 (M, 2) (mean 0 for
    RMSNorm), for the backward. PERSIST (SINGLE only): the programs walk row tiles g, g + G,
    ... and load the next tile before reducing the current one, as the backward does (a
    program that fills an SM's register file has nothing else to hide its load latency).
    NCHUNK (loop path): the number of BLOCK_N chunks of a row when the first walk is unrolled
    at compile time, 0 for a run-time loop (long rows). EVEN (loop path, ROWS = 1): N is a
    multiple of BLOCK_N, so the loads and stores need no mask and no predicate register (a
    thread has 7, and one held by each predicated load capped the loads in flight).
    CHAN (loop path, LayerNorm): the lanes' (count, mean, M2) are combined by one three-value
    reduction with Chan's pairwise update instead of two sums (the mean, then the squared
    deviations from it). REV2 (loop path): the second walk goes last chunk first. STATIC2
    (loop path with NCHUNK): the second walk is unrolled at compile time as well.
    """
    if SINGLE and PERSIST:
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        g = tl.program_id(0)
        G = tl.num_programs(0)
        x_next, r_next = _load_xr(x_ptr, r_ptr, g, cols, cmask, M, sxm, sxn, srm, srn, ROWS,
                                  INT64, HAS_RES)
        for tile in range(g, tl.cdiv(M, ROWS), G):
            rows, rmask = _row_offsets(tile, M, ROWS, INT64)
            xt, rt = x_next, r_next
            x_next, r_next = _load_xr(x_ptr, r_ptr, tile + G, cols, cmask, M, sxm, sxn, srm,
                                      srn, ROWS, INT64, HAS_RES)
            h = xt.to(tl.float32)
            if HAS_RES:
                hs = (h + rt.to(tl.float32)).to(h_ptr.dtype.element_ty)
                tl.store(h_ptr + rows[:, None] * shm + cols[None, :], hs,
                         mask=rmask[:, None] & cmask[None, :])
                h = hs.to(tl.float32)
            _fwd_rows(h, rows, rmask, cols, cmask, w_ptr, b_ptr, y_ptr, stats_ptr, N, sym, eps,
                      IS_RMS, HAS_BIAS, SAVE_STATS)
    elif SINGLE:
        rows, rmask = _row_offsets(tl.program_id(0), M, ROWS, INT64)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        h = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, sxm, sxn, srm, srn, shm,
                    HAS_RES, True, EVICT)
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
def _norm_partial_kernel(
    x_ptr, r_ptr, h_ptr, p1_ptr, p2_ptr, row0, N, sxm, sxn, srm, srn, shm, NCHUNK,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, CHUNK: tl.constexpr, INT64: tl.constexpr,
):
    """Pass 1 of the split forward for long rows: one (row, chunk) a program, chunks of a row
    adjacent. Writes h = x + residual for the chunk (HAS_RES) and the chunk's moments:
    p2 = sum h^2 (RMSNorm), or p1 = chunk mean and p2 = sum (h - p1)^2 (LayerNorm), float32
    (M, NCHUNK) at row ``row0 + local row``."""
    pid = tl.program_id(0)
    row = pid // NCHUNK
    c = pid % NCHUNK
    if INT64:
        row = row.to(tl.int64)
    grow = row + row0
    rows = tl.full((1,), 0, row.dtype) + grow
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = (cols < N)[None, :]
    h = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, sxm, sxn, srm, srn, shm, HAS_RES, True,
                "evict_last")
    if IS_RMS:
        tl.store(p2_ptr + grow * NCHUNK + c + tl.arange(0, 1), tl.sum(h * h, axis=1))
    else:
        nc = tl.minimum(N - c * CHUNK, CHUNK).to(tl.float32)
        mc = tl.sum(h, axis=1) / nc
        d = tl.where(mask, h - mc[:, None], 0.0)
        tl.store(p1_ptr + grow * NCHUNK + c + tl.arange(0, 1), mc)
        tl.store(p2_ptr + grow * NCHUNK + c + tl.arange(0, 1), tl.sum(d * d, axis=1))


@triton.jit
def _norm_apply_kernel(
    x_ptr, h_ptr, w_ptr, b_ptr, y_ptr, p1_ptr, p2_ptr, stats_ptr, row0, N, sxm, sxn, shm, sym,
    eps, NCHUNK, IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, INT64: tl.constexpr,
    SAVE_STATS: tl.constexpr,
):
    """Pass 2 of the split forward: combine the row's chunk moments (LayerNorm: the parallel
    rule M2 = sum_c M2_c + n_c (mean_c - mean)^2), then normalize one chunk. The chunk is
    reread from h (HAS_RES) or x (in row batches when ``l2_batch_bytes`` is set). Programs run
    in the reverse order of pass 1's, so the first rereads are of the data pass 1 read last
    (the likeliest to still be in L2)."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    row = pid // NCHUNK
    c = pid % NCHUNK
    if INT64:
        row = row.to(tl.int64)
    grow = row + row0
    cc = tl.arange(0, BLOCK_C)
    cmask_c = cc < NCHUNK
    p2 = tl.load(p2_ptr + grow * NCHUNK + cc, mask=cmask_c, other=0.0)
    if IS_RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(p2, axis=0) / N + eps)
        mean = 0.0
    else:
        p1 = tl.load(p1_ptr + grow * NCHUNK + cc, mask=cmask_c, other=0.0)
        n_c = tl.where(cmask_c, tl.minimum(N - cc * CHUNK, CHUNK), 0).to(tl.float32)
        mean = tl.sum(n_c * p1, axis=0) / N
        dm = p1 - mean
        rstd = 1.0 / tl.sqrt(tl.sum(p2 + n_c * dm * dm, axis=0) / N + eps)
    if SAVE_STATS and c == 0:  # (mean, rstd) for the backward, once a row
        tl.store(stats_ptr + grow * 2, mean)
        tl.store(stats_ptr + grow * 2 + 1, rstd)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    if HAS_RES:
        h = tl.load(h_ptr + grow * shm + cols, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
    else:
        h = tl.load(x_ptr + grow * sxm + cols * sxn, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (h - mean) * rstd * w
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + grow * sym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


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


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _fwd_config(N: int, itemsize: int, is_rms: bool = True,
                has_res: bool = False) -> tuple[int, int, int, bool]:
    """(BLOCK_N, ROWS, num_warps, SINGLE): on the GPU, ``LOOP_SHAPES`` says whether a row is
    held in registers (see ``softmax.row_config``) or walked in chunks, and with which shape;
    in the interpreter (and under a ``norm_fwd_single_bytes`` override) rows up to 64 KiB
    (plain RMSNorm: 32 KiB) are held in registers, longer ones walked in chunks of
    ``_fwd_loop_chunk()`` columns.

    Measured departures from ``row_config`` (H200, M=16384 x N=8192 bf16):

    * LayerNorm takes two reductions a row (mean, then squared deviations), each a round trip
      through shared memory and a barrier across the program's warps: 8 warps ran at 3.79 TB/s,
      16 warps 3.53, 32 warps 2.73 (ptxas, sm_90a: 163 / 64 / 40 registers, so 8 warps is one
      program an SM and still the fastest). So LayerNorm keeps 32 values a thread (warps =
      elements / 1024, at least 8): N=8192 gets 8 warps and N=16384 16 warps (the same
      per-thread shape; 127 registers, one program an SM as with 32 warps, which measured
      2.44 there against rms_norm's 3.88).
    * The residual form (4 tensors a row) ran at 3.91 TB/s with 32 warps against 3.86 with 16.
    * Plain RMSNorm at 8 KiB rows (2026-11-30, without the eviction hint, see ``_fwd_evict``):
      two rows a program with 8 warps 4.04 TB/s, 4 warps 4.05, 16 warps 3.97; one row with
      16 warps 3.99, 8 warps 3.96. So rows of 8-16 KiB that ``row_config`` gives a program of
      their own are paired, at half the warps (the same values a thread).
    """
    if _env.INTERPRET or "norm_fwd_single_bytes" in OVERRIDE:
        single_max = FWD_SINGLE_MAX_BYTES if has_res else RMS_FWD_SINGLE_MAX_BYTES
        single = N * itemsize <= OVERRIDE.get("norm_fwd_single_bytes", single_max)
        chunk, loop_warps = _fwd_loop_chunk(), 16
    else:
        chunk, loop_warps, _style = _loop_shape(N, is_rms, has_res)
        single = chunk == 0
        chunk = OVERRIDE.get("norm_chunk", chunk)
    if single:
        block_n, rows, warps = row_config(N, itemsize)
        if not _env.INTERPRET and "num_warps" not in OVERRIDE:
            if not is_rms:
                warps = min(warps, max(8, (block_n * rows) // 1024))
            elif has_res and warps == 16 and rows == 1:
                warps = 32
            elif (not has_res and rows == 1 and "rows" not in OVERRIDE
                  and 8192 <= block_n * itemsize <= 16384):
                rows, warps = 2, max(4, warps // 2)
        return block_n, rows, warps, True
    if _env.INTERPRET:
        return chunk, 1, 4, False
    return chunk, 1, OVERRIDE.get("norm_loop_warps", loop_warps), False


#: The loop path's first walk is unrolled at compile time for rows of up to this many chunks
#: (``NCHUNK``; one build per chunk count) and up to ``STATIC_VALUES_MAX`` values a thread, so
#: that all of a row's loads are in flight before the first update, as in the code
#: torch.compile generates for fixed shapes. Longer rows loop.
STATIC_CHUNKS_MAX = 16
STATIC_VALUES_MAX = 64


def _static_chunks(N: int, block_n: int, single: bool, warps: int = 4) -> int:
    if single:
        return 0
    n = C.cdiv(N, block_n)
    if n * block_n > OVERRIDE.get("norm_static_values_max", STATIC_VALUES_MAX) * 32 * warps:
        return 0
    return n if n <= OVERRIDE.get("norm_static_chunks_max", STATIC_CHUNKS_MAX) else 0


def _fwd_persist(tile_bytes: int, warps: int) -> bool:
    """Persistent forward with the next tile prefetched (``PERSIST``): for tiles of at least
    ``norm_fwd_persist_bytes`` (default 16 KiB: one program a tile then fills an SM); a
    ``norm_fwd_persist`` override forces it on or off."""
    if _env.INTERPRET and "norm_fwd_persist" not in OVERRIDE:
        return False
    if "norm_fwd_persist" in OVERRIDE:
        return bool(OVERRIDE["norm_fwd_persist"])
    return tile_bytes >= OVERRIDE.get("norm_fwd_persist_bytes", FWD_PERSIST_BYTES) > 0


def _norm_fwd_split(x2, r2, h2, weight, bias, y2, stats, eps, is_rms):
    """Long rows, ``norm_long="split"``: (row, chunk) programs for the moments, then (row,
    chunk) programs that combine and normalize, in row batches (``softmax.row_batch``: one by
    default) (the same structure as softmax's split path)."""
    M, N = x2.shape
    chunk = _chunk()
    nchunk = C.cdiv(N, chunk)
    p1 = torch.empty((M, nchunk), dtype=torch.float32, device=x2.device)
    p2 = torch.empty((M, nchunk), dtype=torch.float32, device=x2.device)
    has_res = r2 is not None
    row_bytes = N * x2.element_size() * (3 if has_res else 1)
    batch = row_batch(M, row_bytes)
    int64 = C.needs_int64(x2, y2, p1) or (has_res and C.needs_int64(r2))
    warps = 4 if _env.INTERPRET else OVERRIDE.get("split_warps", max(4, min(32, chunk // 512)))
    r = r2 if has_res else x2
    for row0 in range(0, M, batch):
        grid = (min(batch, M - row0) * nchunk,)
        C.launch(_norm_partial_kernel, grid, x_ptr=x2, r_ptr=r, h_ptr=h2, p1_ptr=p1, p2_ptr=p2,
                 row0=row0, N=N, sxm=x2.stride(0), sxn=x2.stride(1), srm=r.stride(0),
                 srn=r.stride(1), shm=h2.stride(0), NCHUNK=nchunk, IS_RMS=is_rms,
                 HAS_RES=has_res, CHUNK=chunk, INT64=int64, num_warps=warps)
        C.launch(_norm_apply_kernel, grid, x_ptr=x2, h_ptr=h2, w_ptr=weight,
                 b_ptr=bias if bias is not None else weight, y_ptr=y2, p1_ptr=p1, p2_ptr=p2,
                 stats_ptr=stats if stats is not None else p1, row0=row0, N=N,
                 sxm=x2.stride(0), sxn=x2.stride(1), shm=h2.stride(0), sym=y2.stride(0),
                 eps=float(eps), NCHUNK=nchunk, IS_RMS=is_rms,
                 HAS_RES=has_res, HAS_BIAS=bias is not None, CHUNK=chunk,
                 BLOCK_C=C.next_power_of_2(nchunk), INT64=int64,
                 SAVE_STATS=stats is not None, num_warps=warps)


def _stats_shape(x: torch.Tensor, save_stats: bool) -> tuple[int, int]:
    return ((x.numel() // x.shape[-1] if x.shape[-1] else 0) if save_stats else 0, 2)


def _norm_fwd_impl(x, weight, bias, residual, eps, is_rms, save_stats=False):
    """Returns (y, h, stats); h is None without residual; stats is the float32 (rows, 2)
    (mean, rstd) of every row with ``save_stats`` (mean 0 for RMSNorm), else a (0, 2) tensor."""
    N = x.shape[-1]
    weight = weight.contiguous()  # (N,): a copy only for a strided weight
    bias = bias.contiguous() if bias is not None else None
    y = C.empty(x.shape, x.dtype, x.device)
    h = C.empty(x.shape, x.dtype, x.device) if residual is not None else None
    stats = torch.empty(_stats_shape(x, save_stats), dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y, h, stats
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else x2
    y2 = y.view(-1, N)
    h2 = h.view(-1, N) if h is not None else y2
    M = x2.shape[0]
    if OVERRIDE:  # experiments: planned afresh
        plan = _fwd_plan.__wrapped__(M, N, x.element_size(), is_rms, residual is not None,
                                     x.device, _env.INTERPRET)
    else:  # a model calls the same shapes over and over: plan once per shape
        plan = _fwd_plan(M, N, x.element_size(), is_rms, residual is not None, x.device,
                         _env.INTERPRET)
    if plan is None:
        _norm_fwd_split(x2, r2 if residual is not None else None, h2, weight, bias, y2,
                        stats if save_stats else None, eps, is_rms)
        return y, h, stats
    grid, consts = plan
    C.launch(_norm_fwd_kernel, grid, x_ptr=x2, r_ptr=r2, h_ptr=h2,
             w_ptr=weight, b_ptr=bias if bias is not None else weight, y_ptr=y2,
             stats_ptr=stats if save_stats else y2, M=M, N=N,
             sxm=x2.stride(0), sxn=x2.stride(1), srm=r2.stride(0), srn=r2.stride(1),
             shm=h2.stride(0), sym=y2.stride(0), eps=float(eps), IS_RMS=is_rms,
             HAS_RES=residual is not None, HAS_BIAS=bias is not None,
             INT64=C.needs_int64(x2, r2, y2), SAVE_STATS=save_stats, **consts)
    return y, h, stats


@functools.lru_cache(maxsize=1024)
def _fwd_plan(M, N, itemsize, is_rms, has_res, device, interpret):
    """(grid, the launch's shape-derived keywords) of the forward, or None for the split path.
    Cached per shape unless an OVERRIDE is active (the caller bypasses the cache then);
    ``interpret`` keys the cache only (tests switch ``_env.INTERPRET``)."""
    block_n, rows, warps, single = _fwd_config(N, itemsize, is_rms, has_res)
    if not single and OVERRIDE.get("norm_long", "loop") == "split":
        return None
    tiles = C.cdiv(M, rows)
    persist = single and _fwd_persist(N * itemsize * rows, warps)
    grid = (min(tiles, OVERRIDE.get("norm_fwd_programs", _sm_count(device))) if persist
            else tiles,)
    consts = dict(ROWS=rows, BLOCK_N=block_n, SINGLE=single,
                  EVICT=OVERRIDE.get("norm_evict", _fwd_evict), PERSIST=persist,
                  NCHUNK=_static_chunks(N, block_n, single, warps),
                  EVEN=not single and rows == 1 and N % block_n == 0,
                  **_loop_flags(N, is_rms, has_res), num_warps=warps)
    return grid, consts


def _norm_bwd_impl(h, weight, dy, dres, eps, is_rms, has_bias, stats=None):
    """Returns (dx, dweight, dbias); dbias has shape (0,) without bias. ``stats``: the
    forward's (rows, 2) (mean, rstd) (``_norm_fwd_impl(save_stats=True)``), or None (or a
    (0, 2) tensor) to recompute them."""
    N = h.shape[-1]
    weight = weight.contiguous()
    dx = C.empty(h.shape, h.dtype, h.device)
    dw = C.empty((N,), weight.dtype, h.device)
    db = C.empty((N,) if has_bias else (0,), weight.dtype, h.device)
    if h.numel() == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db
    h2, dy2, dx2 = as_rows(h), as_rows(dy), dx.view(-1, N)
    dr2 = as_rows(dres) if dres is not None else dy2
    M = h2.shape[0]
    itemsize = h.element_size()
    single = N * itemsize <= OVERRIDE.get("norm_bwd_single_bytes", BWD_SINGLE_MAX_BYTES)
    int64 = C.needs_int64(h2, dy2, dx2, dr2)
    fstats = stats is not None and stats.shape[0] == M and M > 0
    fstats = fstats and OVERRIDE.get("norm_bwd_fstats", True)
    # rows held in registers: the forward's statistics serve RMSNorm only. H200, M=16384 x
    # N=8192 bf16 (2026-11-30): rms_norm 3.87 TB/s with them, 3.82 without; layer_norm 2.66
    # with them against 3.43 recomputing (two rounds of paired sums) -- the same 128
    # registers and no spills in both builds, so the cause is in ptxas's schedule, not seen
    # in the SASS counts. The long-row path uses them for both (they save a walk over the row).
    fstats_single = fstats and (is_rms or OVERRIDE.get("norm_bwd_fstats") is True)
    fs = stats if fstats else dx2  # unused without fstats
    if single:
        block_n, rows, warps = row_config(N, itemsize)
        # the forward's warps (N=8192 bf16: 16 warps, 120-127 registers). Measured with
        # PREFETCH (H200, 2026-11-30): 16 warps 3.81 TB/s (rms_norm) and 3.38 (layer_norm)
        # against 3.76 and 2.09 with 32 warps; without PREFETCH 2.32 / 2.28
        warps = OVERRIDE.get("norm_bwd_warps", warps)
        nchunk = 1
        stats_bwd = dx2  # unused
    else:
        block_n, rows, warps = _chunk(), 1, (4 if _env.INTERPRET else 32)
        nchunk = C.cdiv(N, block_n)
        stats_bwd = torch.empty((M, 4), dtype=torch.float32, device=h.device)
        C.launch(_norm_bwd_stats_kernel, (M,), h_ptr=h2, w_ptr=weight, dy_ptr=dy2,
                 stats_ptr=stats_bwd, fs_ptr=fs, N=N, shm=h2.stride(0), shn=h2.stride(1),
                 sdym=dy2.stride(0), sdyn=dy2.stride(1), eps=float(eps), IS_RMS=is_rms,
                 BLOCK_N=block_n, INT64=int64, HAS_FSTATS=fstats,
                 num_warps=4 if _env.INTERPRET else 16)
    tiles = C.cdiv(M, rows)
    # each program writes one (N,) float32 partial row; one program an SM: at 8192 bf16
    # columns a program takes 120-127 registers x 512 threads, the whole register file, so a
    # second wave would only add a tail (measured, with PREFETCH: rms_norm 3.81 TB/s at
    # 1 x SMs against 3.67 at 2 x SMs; layer_norm 3.38 / 3.15)
    G = OVERRIDE.get("norm_bwd_programs", max(1, _sm_count(h.device) // nchunk))
    G = max(1, min(tiles, G))
    dw_part = torch.empty((G, N), dtype=torch.float32, device=h.device)
    db_part = torch.empty((G, N), dtype=torch.float32, device=h.device) if has_bias else dw_part
    C.launch(_norm_bwd_kernel, (G, nchunk), h_ptr=h2, w_ptr=weight, dy_ptr=dy2, dres_ptr=dr2,
             dx_ptr=dx2, dw_ptr=dw_part, db_ptr=db_part, stats_ptr=stats_bwd, fs_ptr=fs, M=M,
             N=N,
             shm=h2.stride(0), shn=h2.stride(1), sdym=dy2.stride(0), sdyn=dy2.stride(1),
             sdrm=dr2.stride(0), sdrn=dr2.stride(1), sdxm=dx2.stride(0), eps=float(eps),
             IS_RMS=is_rms, HAS_DRES=dres is not None, HAS_BIAS=has_bias, ROWS=rows,
             BLOCK_N=block_n, SINGLE=single, INT64=int64,
             PREFETCH=OVERRIDE.get("norm_bwd_prefetch", True),
             HAS_FSTATS=fstats_single and single, num_warps=warps)
    sum_block = 256 if not _env.INTERPRET else C.next_power_of_2(min(N, 4096))
    for part, out in ((dw_part, dw),) + (((db_part, db),) if has_bias else ()):
        C.launch(_col_sum_kernel, (C.cdiv(N, sum_block),), part_ptr=part, out_ptr=out,
                 G=G, N=N, BLOCK_G=min(32, C.next_power_of_2(G)), BLOCK_N=sum_block,
                 num_warps=4)
    return dx, dw, db


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
def _like(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _stats_like(x, save_stats):
    return x.new_empty(_stats_shape(x, save_stats), dtype=torch.float32)


# Each forward op also returns the rows' (mean, rstd) when ``save_stats`` (the public functions
# ask for them when autograd will need them): 8 bytes a row, which spare the backward its
# statistics reductions (LayerNorm: two of its three rounds of shuffles and barriers a row).
@torch.library.custom_op("tkit::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 save_stats: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, stats = _norm_fwd_impl(x, weight, None, None, eps, True, save_stats)
    return y, stats


@_rms_norm_op.register_fake
def _(x, weight, eps, save_stats=False):
    return _like(x), _stats_like(x, save_stats)


@torch.library.custom_op("tkit::rms_norm_residual", mutates_args=())
def _rms_norm_residual_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, save_stats: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_fwd_impl(x, weight, None, residual, eps, True, save_stats)


@_rms_norm_residual_op.register_fake
def _(x, residual, weight, eps, save_stats=False):
    return _like(x), _like(x), _stats_like(x, save_stats)


@torch.library.custom_op("tkit::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
                   eps: float, save_stats: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, stats = _norm_fwd_impl(x, weight, bias, None, eps, False, save_stats)
    return y, stats


@_layer_norm_op.register_fake
def _(x, weight, bias, eps, save_stats=False):
    return _like(x), _stats_like(x, save_stats)


@torch.library.custom_op("tkit::norm_backward", mutates_args=())
def _norm_bwd_op(h: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
                 dres: Optional[torch.Tensor], stats: Optional[torch.Tensor],  # noqa: UP045
                 eps: float, is_rms: bool,
                 has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_bwd_impl(h, weight, dy, dres, eps, is_rms, has_bias, stats)


@_norm_bwd_op.register_fake
def _(h, weight, dy, dres, stats, eps, is_rms, has_bias):
    N = h.shape[-1]
    return (_like(h), weight.new_empty((N,)), weight.new_empty((N,) if has_bias else (0,)))


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs[:3]
    ctx.eps = eps
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _dstats):
    x, weight, stats = ctx.saved_tensors
    dx, dw, _ = _norm_bwd_op(x, weight, dy, None, stats, ctx.eps, True, False)
    return dx, dw, None, None


_rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)


def _rms_res_setup(ctx, inputs, output):
    x, residual, weight, eps = inputs[:4]
    ctx.eps = eps
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(output[1], weight, output[2])


def _rms_res_backward(ctx, dy, dh, _dstats):
    h, weight, stats = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw, _ = _norm_bwd_op(h, weight, dy, dh, stats, ctx.eps, True, False)
    return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, None, None


_rms_norm_residual_op.register_autograd(_rms_res_backward, setup_context=_rms_res_setup)


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs[:4]
    ctx.eps = eps
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _ln_backward(ctx, dy, _dstats):
    x, weight, stats = ctx.saved_tensors
    dx, dw, db = _norm_bwd_op(x, weight, dy, None, stats, ctx.eps, False, ctx.has_bias)
    return dx, dw, (db if ctx.has_bias else None), None, None


_layer_norm_op.register_autograd(_ln_backward, setup_context=_ln_setup)


def _wants_stats(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _check_norm(x, weight, bias=None, residual=None, eps=0.0):
    C.check_tensor(x, "x", min_ndim=1)
    C.check_tensor(weight, "weight", ndim=1)
    N = x.shape[-1]
    if weight.shape[0] != N:
        raise ValueError(f"weight must have shape ({N},) to match x's last dimension, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        C.check_tensor(bias, "bias", ndim=1)
        if bias.shape != weight.shape:
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None:
        C.check_tensor(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, "
                             f"got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual has dtype {C.dtype_name(residual.dtype)} but x has "
                            f"{C.dtype_name(x.dtype)}; they must match")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    C.check_same_device(x=x, weight=weight, bias=bias, residual=residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``.

    Parameters
    ----------
    x : Tensor
        float32/float16/bfloat16 CUDA tensor, any leading shape; rows may be strided (any
        column stride works; leading dimensions that do not merge into one row stride are
        copied first).
    weight : Tensor
        (N,), any of the three float dtypes.
    eps : float
    residual : Tensor, optional
        Same shape and dtype as ``x``. When given, ``h = x + residual`` is computed and
        normalized in one pass, and ``(rms_norm(h), h)`` is returned: the fused add + norm of
        inference engines.

    Returns
    -------
    Tensor, or (Tensor, Tensor) with ``residual``
        In ``x``'s dtype, contiguous. Differentiable in x, residual and weight.
    """
    if (P.ON and type(x) is _T and (type(weight) is _T or type(weight) is _Param)
            and type(eps) is float and not OVERRIDE and not _compiling()):
        dev, stream = L._device_stream()
        if residual is None:
            if not (_grad_enabled() and (x.requires_grad or weight.requires_grad)):
                key = (eps, dev, x.shape, x.stride(), x.dtype, x.get_device(),
                       not x.data_ptr() & 15, weight.shape, weight.stride(), weight.dtype,
                       weight.get_device(), not weight.data_ptr() & 15)
                plan = _plans.get(key)
                if plan:
                    y = plan(stream, x, weight)
                    if y is not None:
                        return y
                elif plan is None:
                    P.stats["plan_miss"] += 1
                    with P.recording() as rec:
                        y = _rms_norm_slow(x, weight, eps, None)
                    P.store(_plans, key, rec, (x, weight), (y,))
                    return y
        elif type(residual) is _T and not (_grad_enabled() and (
                x.requires_grad or weight.requires_grad or residual.requires_grad)):
            key = (eps, dev, x.shape, x.stride(), x.dtype, x.get_device(),
                   not x.data_ptr() & 15, weight.shape, weight.stride(), weight.dtype,
                   weight.get_device(), not weight.data_ptr() & 15,
                   residual.shape, residual.stride(), residual.dtype, residual.get_device(),
                   not residual.data_ptr() & 15)
            plan = _plans.get(key)
            if plan:
                yh = plan(stream, x, weight, residual)
                if yh is not None:
                    return yh
            elif plan is None:
                P.stats["plan_miss"] += 1
                with P.recording() as rec:
                    yh = _rms_norm_slow(x, weight, eps, residual)
                P.store(_plans, key, rec, (x, weight, residual), yh)
                return yh
    return _rms_norm_slow(x, weight, eps, residual)


_T = torch.Tensor
_Param = torch.nn.Parameter
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
#: eager plans (tkit.kernels._plan); the keys hold all the ordinary path reads
_plans = P.new_cache()


def _rms_norm_slow(x, weight, eps, residual):
    _check_norm(x, weight, residual=residual, eps=eps)
    if residual is None:
        if C.use_direct_path(x, weight):
            return _norm_fwd_impl(x, weight, None, None, eps, True)[0]
        return _rms_norm_op(x, weight, float(eps), _wants_stats(x, weight))[0]
    if C.use_direct_path(x, weight, residual):
        return _norm_fwd_impl(x, weight, None, residual, eps, True)[:2]
    return _rms_norm_residual_op(x, residual, weight, float(eps),
                                 _wants_stats(x, weight, residual))[:2]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    The variance is the biased one (as ``torch.nn.functional.layer_norm``), computed two-pass on
    chip, or with per-lane Welford updates for rows walked in chunks (see the module docstring);
    never as E[x^2] - E[x]^2. ``bias`` may be None.
    Shapes, dtypes and layouts as :func:`rms_norm`.
    """
    _check_norm(x, weight, bias=bias, eps=eps)
    if C.use_direct_path(x, weight, bias):
        return _norm_fwd_impl(x, weight, bias, None, eps, False)[0]
    return _layer_norm_op(x, weight, bias, float(eps), _wants_stats(x, weight, bias))[0]


def cost(x: torch.Tensor, residual: bool = False, backward: bool = False, bias: bool = False):
    """Bytes and FLOPs of one call: rows read and written once, weight/bias once."""
    from tkit.registry import Cost

    n, N, e = x.numel(), x.shape[-1], x.element_size()
    if backward:
        tensors = 3 + (1 if residual else 0)  # h, dy (+ dh) read, dx written
    else:
        tensors = 2 + (2 if residual else 0)  # x (+ residual) read, y (+ h) written
    return Cost(tensors * n * e + (2 if bias else 1) * N * e, 6 * n)
