"""Softmax's Triton kernels (forward and backward; rows in registers, the loop path, the split
path). The math and the paths are described in ``tkit.kernels.reductions``."""

from __future__ import annotations

import triton
import triton.language as tl

from tkit.kernels.reductions._rows import _row_offsets


@triton.jit
def _softmax_fwd_kernel(
    x_ptr, y_ptr, M, N, sxm, sxn, sym,
    LOG: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, INT64: tl.constexpr,
):
    """y[r, :] = softmax(x[r, :]) for ROWS rows a program, whole rows in registers.

    x_ptr: input rows, row stride sxm, column stride sxn (1 in the common case; Triton then
    specializes it and loads 16-byte vectors); y_ptr: output, row stride sym, columns contiguous.
    The loads take no L2 hint ("evict_first" measured slower; docs/NOTES.md).
    """
    rows, rmask = _row_offsets(tl.program_id(0), M, ROWS, INT64)
    cols = tl.arange(0, BLOCK_N)
    mask = rmask[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxn, mask=mask,
                other=-float("inf")).to(tl.float32)
    # rows past M hold only -inf: a finite max and a sum of 1 keep them free of NaN and of
    # division by zero (never stored, but numpy warns in the interpreter); a real row of -inf
    # keeps its NaN
    m = tl.where(rmask, tl.max(x, axis=1), 0.0)
    z = x - m[:, None]
    e = tl.exp(z)
    s = tl.where(rmask, tl.sum(e, axis=1), 1.0)
    if LOG:
        y = z - tl.log(s)[:, None]
    else:
        y = e * (1.0 / s)[:, None]
    tl.store(y_ptr + rows[:, None] * sym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_loop_kernel(
    x_ptr, y_ptr, N, sxm, sxn, sym,
    LOG: tl.constexpr, BLOCK_N: tl.constexpr, INT64: tl.constexpr,
):
    """Long rows, one program a row: online softmax over BLOCK_N chunks (running max m and
    sum s = sum exp(x - m), rescaled by exp(m_old - m_new) when the max grows), then a second
    walk, last chunk first (the likeliest to still be in L2), that writes the output.

    x_ptr: input, row stride sxm, column stride sxn; y_ptr: output, row stride sym.
    A row of only -inf (or one holding +inf) gives NaN everywhere, as the fused kernel does.
    """
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    LOG2E: tl.constexpr = 1.4426950408889634
    m = tl.full((1,), float("-inf"), tl.float32)
    s = tl.zeros((1,), tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + row * sxm + cols[None, :] * sxn, mask=(cols < N)[None, :],
                    other=-float("inf"), eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # while every value so far is -inf, subtract 0 (exp(-inf - -inf) would be NaN)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2((m - m_use) * LOG2E) + tl.sum(tl.exp2((x - m_use[:, None]) * LOG2E),
                                                      axis=1)
        m = m_new
    if LOG:
        log_s = tl.log(s)
    else:
        inv = 1.0 / s
    last = (tl.cdiv(N, BLOCK_N) - 1) * BLOCK_N
    for i in range(0, N, BLOCK_N):
        start = last - i
        cols = start + tl.arange(0, BLOCK_N)
        cmask = (cols < N)[None, :]
        x = tl.load(x_ptr + row * sxm + cols[None, :] * sxn, mask=cmask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if LOG:
            y = (x - m[:, None]) - log_s[:, None]  # as the fused kernel rounds it
        else:
            y = tl.exp2((x - m[:, None]) * LOG2E) * inv[:, None]
        tl.store(y_ptr + row * sym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _softmax_bwd_kernel(
    y_ptr, dy_ptr, dx_ptr, M, N, sym, syn, sdym, sdyn, sdxm,
    LOG: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, INT64: tl.constexpr,
):
    """dx[r, :] from the forward output y and its gradient dy, whole rows in registers.

    y_ptr, dy_ptr: strided rows (row strides sym/sdym, column strides syn/sdyn);
    dx_ptr: output, row stride sdxm, columns contiguous.
    """
    rows, rmask = _row_offsets(tl.program_id(0), M, ROWS, INT64)
    cols = tl.arange(0, BLOCK_N)
    mask = rmask[:, None] & (cols < N)[None, :]
    y = tl.load(y_ptr + rows[:, None] * sym + cols[None, :] * syn, mask=mask,
                other=0.0, eviction_policy="evict_first").to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * sdym + cols[None, :] * sdyn, mask=mask,
                 other=0.0, eviction_policy="evict_first").to(tl.float32)
    if LOG:
        dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
    else:
        dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + rows[:, None] * sdxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _split_partial_kernel(
    a_ptr, b_ptr, p1_ptr, p2_ptr, row0, N, sam, san, sbm, sbn, NCHUNK,
    BACKWARD: tl.constexpr, LOG: tl.constexpr, CHUNK: tl.constexpr, INT64: tl.constexpr,
):
    """Pass 1 of the split path: one (row, chunk) partial a program, chunks of a row adjacent.

    Forward: a_ptr = x; p1[row, c] = max of the chunk, p2[row, c] = sum exp(x - p1).
    Backward: a_ptr = y, b_ptr = dy; p2[row, c] = sum dy*y (softmax) or sum dy (log_softmax);
    p1 unused. Partials are float32, NCHUNK per row, at row index ``row0 + local row`` (row0:
    the first row of the launch, 0 since all rows go in one launch; docs/NOTES.md).
    """
    pid = tl.program_id(0)
    row = pid // NCHUNK
    c = pid % NCHUNK
    if INT64:
        row = row.to(tl.int64)
    grow = row + row0
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    if BACKWARD:
        y = tl.load(a_ptr + grow * sam + cols * san, mask=mask, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        dy = tl.load(b_ptr + grow * sbm + cols * sbn, mask=mask, other=0.0,
                     eviction_policy="evict_last").to(tl.float32)
        if LOG:
            part = tl.sum(dy, axis=0)
        else:
            part = tl.sum(dy * y, axis=0)
        tl.store(p2_ptr + grow * NCHUNK + c, part)
    else:
        x = tl.load(a_ptr + grow * sam + cols * san, mask=mask, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - m), axis=0)
        s = tl.where(m == -float("inf"), 0.0, s)  # an all -inf chunk adds nothing
        tl.store(p1_ptr + grow * NCHUNK + c, m)
        tl.store(p2_ptr + grow * NCHUNK + c, s)


@triton.jit
def _split_apply_kernel(
    a_ptr, b_ptr, out_ptr, p1_ptr, p2_ptr, row0, N, sam, san, sbm, sbn, som, NCHUNK,
    BACKWARD: tl.constexpr, LOG: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
    INT64: tl.constexpr,
):
    """Pass 2 of the split path: combine the row's NCHUNK partials, write one chunk of output.

    Forward (online-softmax combine): m = max_c p1, s = sum_c p2 * exp(p1 - m).
    Backward: the row sum is sum_c p2. out_ptr: output rows, row stride som, contiguous columns.
    Programs run in the reverse order of pass 1's: the first rereads are of the chunks pass 1
    read last, the likeliest to still be in L2 (in pass 1's order every reread of an input
    larger than the L2 would miss).
    """
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    row = pid // NCHUNK
    c = pid % NCHUNK
    if INT64:
        row = row.to(tl.int64)
    grow = row + row0
    cc = tl.arange(0, BLOCK_C)
    cmask = cc < NCHUNK
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    if BACKWARD:
        total = tl.sum(tl.load(p2_ptr + grow * NCHUNK + cc, mask=cmask, other=0.0), axis=0)
        y = tl.load(a_ptr + grow * sam + cols * san, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(b_ptr + grow * sbm + cols * sbn, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        if LOG:
            out = dy - tl.exp(y) * total
        else:
            out = y * (dy - total)
    else:
        pm = tl.load(p1_ptr + grow * NCHUNK + cc, mask=cmask, other=-float("inf"))
        ps = tl.load(p2_ptr + grow * NCHUNK + cc, mask=cmask, other=0.0)
        m = tl.max(pm, axis=0)
        s = tl.sum(tl.where(pm == -float("inf"), 0.0, ps * tl.exp(pm - m)), axis=0)
        x = tl.load(a_ptr + grow * sam + cols * san, mask=mask, other=-float("inf"),
                    eviction_policy="evict_first").to(tl.float32)
        if LOG:
            out = x - m - tl.log(s)
        else:
            out = tl.exp(x - m) / s
    tl.store(out_ptr + grow * som + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
