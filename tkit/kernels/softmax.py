"""Softmax and log-softmax along one dimension, forward and backward, any row length.

Math, per row x of length N (computed in float32, rounded once on store):

    m = max_j x_j,   s = sum_j exp(x_j - m)
    softmax      y_i = exp(x_i - m) / s
    log_softmax  y_i = x_i - m - log(s)
    backward     softmax:      dx = y * (dy - sum_j dy_j y_j)
                 log_softmax:  dx = dy - exp(y) * sum_j dy_j

Rows holding -inf behave as in torch: -inf entries give 0 (softmax) or -inf (log_softmax); a
row of nothing but -inf gives NaN everywhere (m = -inf, so x - m is NaN), and so does a row
holding +inf.

Cost model: forward reads M*N and writes M*N elements (2*M*N*itemsize bytes), backward reads y
and dy and writes dx (3*M*N*itemsize). About 5 FLOPs per element against the H200's ~200
FLOP/byte balance point: memory-bound at every N, the ceiling is the copy bandwidth.

Two paths, picked by the row's size in bytes:

* **fused** (rows up to 64 KiB: 32768 bf16 columns; see ``FUSED_MAX_BYTES``): each program
  holds ROWS whole rows in registers, computes max, sum and output in one read. ROWS > 1 packs
  short rows so that a program still moves a few KiB.
* **split** (longer rows, tested to 1M columns): online softmax across programs. Pass 1: the
  program for (row, chunk) reduces its CHUNK columns to a partial (m_c, s_c) with
  s_c = sum exp(x - m_c). Pass 2: the program for (row, chunk) combines all partials of its row
  with the online-softmax rule  m = max_c m_c,  s = sum_c s_c * exp(m_c - m)  (a chunk of only
  -inf contributes 0), then rereads its chunk and writes the output. The reread costs a third
  pass over the input. By default all rows go in one batch (two launches): on the H200 at a
  256 MiB input, N=65536..262144 bf16, one batch ran at 2.33 TB/s and batches of 24 MB (so
  that the reread hits L2) at 0.54-1.2 TB/s, because every batch costs two launches of host
  time (~100 us a pair, measured on a 1x65536 row) against ~6 us of HBM time per 24 MB.
  ``OVERRIDE["l2_batch_bytes"]`` still selects row batches (tests use it).

The backward uses the same two paths with the row sum (sum dy*y or sum dy) in place of (m, s).
Index math is 64-bit when an offset can reach 2**31 (``INT64``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _launch as L
from tkit.kernels import _plan as P

#: Largest row held in registers by one program, in bytes: 32 KiB forward, 64 KiB backward
#: (32768 16-bit values over 32 warps: 58 / 64 registers, no spills, ptxas for sm_90a on the
#: launches tkit makes). Beyond that the long-row paths. The forward's limit was 64 KiB until
#: the loop path measured faster at N=32768 bf16 (H200, 256 MiB, 2026-11-30): 3.44 TB/s
#: against 2.95 for one row a program in registers (1024 threads x 58 registers fill an SM, so
#: nothing hides a program's latency).
FUSED_MAX_BYTES = 32 * 1024
FUSED_MAX_BYTES_BWD = 64 * 1024
#: Columns per program on the split path (16 KiB of bf16: a program of 16 warps, 16 values a
#: thread), and the row-batch size of the split paths: 0 = one batch (see the module
#: docstring: host launch time, not the L2, decides; 24 MiB batches measured 2-4x slower).
SPLIT_CHUNK = 8192
#: Forward rows past the fused limit: "loop" (one program a row, online softmax over chunks of
#: LOOP_CHUNK columns with 16 warps, then a second walk; ``_softmax_loop_kernel``) when there
#: are at least as many rows as SMs, else "split" (a row across programs, two launches). H200,
#: 256 MiB bf16 (2026-11-30): loop 3.31 / 2.90 / 2.63 TB/s at N=65536 / 131072 / 262144 against
#: 2.34 / 2.34 / 2.33 for split; at 128 rows of 1M columns split 2.31, loop 2.07 (128 programs
#: for 132 SMs).
LONG_FWD = "loop"
LOOP_CHUNK = 16384
#: L2 policy of the fused forward's loads. "evict_first" cost 1-5% (H200, 256 MiB bf16,
#: 2026-11-30, with / without): N=1024 3.99 / 4.10 TB/s, 4096 3.79 / 3.97, 8192 3.83 / 4.02,
#: 16384 3.79 / 3.85, as in the norms and elementwise kernels.
FUSED_EVICT = ""
L2_BATCH_BYTES = 0
MAX_BATCHES = 8

#: Settings the GPU script overrides to compare configurations side by side (keys: num_warps,
#: rows, fused_max_bytes, chunk, l2_batch_bytes). Empty in normal use.
OVERRIDE: dict = {}


# --------------------------------------------------------------------------------------------
# Heuristics (no autotuning: the kernels are memory-bound and one config per N is enough)
# --------------------------------------------------------------------------------------------
def row_config(N: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for the fused one-row-per-program kernels.

    How it was derived: a program should move at least ~4 KiB of input (short rows are packed
    ROWS to a program to reach that, so launch and reduction costs are amortized), and a thread
    should hold about 16 values of a tile (two to four 16-byte vectors in flight), which keeps
    every kernel of the family at or under 64 registers (ptxas, sm_90a: at N=8192 bf16, 16
    warps use 32-40 registers; 8 warps 53-63), so that two or more programs fit on an SM.
    Measured on the H200 at N=1024 bf16, 256 MiB (2026-11-30, grid of ROWS 1-16 x warps 2-8):
    2 rows x 4 warps (4 KiB, 16 values a thread) was the best or within 1% of it for rms_norm
    (4.08 TB/s), layer_norm (4.08), residual + rms_norm (4.11) and softmax (4.02), against
    3.96 / 3.83 / 3.95 / 3.93 for the 8 KiB rule used before (4 rows x 8 warps). The GPU
    scripts time the neighbours.
    """
    block_n = C.next_power_of_2(N)
    if _env.INTERPRET:
        # the interpreter pays per program: few, large programs
        rows = max(1, min(64, 8192 // block_n))
        return block_n, OVERRIDE.get("rows", rows), 4
    rows = max(1, min(64, (4096 // itemsize) // block_n))
    elems = rows * block_n
    warps = C.next_power_of_2(max(1, elems // 512))
    warps = max(4, min(32, warps))
    return block_n, OVERRIDE.get("rows", rows), OVERRIDE.get("num_warps", warps)


def row_batch(M: int, row_bytes: int) -> int:
    """Rows per batch of the split paths: all of them by default (``L2_BATCH_BYTES`` = 0);
    with a positive ``l2_batch_bytes`` override, about that many bytes of input (so that pass 2
    rereads a batch from L2), but at most ``max_batches`` batches, because every batch costs
    two launches of host time (~100 us a pair on the H200 machine)."""
    batch_bytes = OVERRIDE.get("l2_batch_bytes", L2_BATCH_BYTES)
    if batch_bytes <= 0:
        return M
    batch = max(1, batch_bytes // row_bytes)
    return max(batch, C.cdiv(M, OVERRIDE.get("max_batches", MAX_BATCHES)))


def fused_max_cols(itemsize: int, backward: bool = False) -> int:
    if backward:
        return OVERRIDE.get("fused_max_bytes_bwd", OVERRIDE.get("fused_max_bytes",
                                                                FUSED_MAX_BYTES_BWD)) // itemsize
    return OVERRIDE.get("fused_max_bytes", FUSED_MAX_BYTES) // itemsize


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_chunk() -> int:
    if _env.INTERPRET:
        return OVERRIDE.get("chunk", 4096)
    return OVERRIDE.get("chunk", SPLIT_CHUNK)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _row_offsets(pid, M, ROWS: tl.constexpr, INT64: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    if INT64:
        rows = rows.to(tl.int64)
    return rows, rows < M


@triton.jit
def _softmax_fwd_kernel(
    x_ptr, y_ptr, M, N, sxm, sxn, sym,
    LOG: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, INT64: tl.constexpr,
    EVICT: tl.constexpr,
):
    """y[r, :] = softmax(x[r, :]) for ROWS rows a program, whole rows in registers.

    x_ptr: input rows, row stride sxm, column stride sxn (1 in the common case; Triton then
    specializes it and loads 16-byte vectors); y_ptr: output, row stride sym, columns contiguous.
    EVICT: the loads' L2 policy ("" or "evict_first").
    """
    rows, rmask = _row_offsets(tl.program_id(0), M, ROWS, INT64)
    cols = tl.arange(0, BLOCK_N)
    mask = rmask[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxn, mask=mask,
                other=-float("inf"), eviction_policy=EVICT).to(tl.float32)
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
    p1 unused. Partials are float32, NCHUNK per row, at row index ``row0 + local row``.
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


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an (M, N) view over its last dimension (rows may be strided; the column stride is
    passed to the kernels). Leading dimensions that do not merge into one row stride are copied.
    """
    N = t.shape[-1]
    try:
        return t.view(-1, N)
    except RuntimeError:
        return t.reshape(-1, N)


def _split_launch(a2, b2, out2, backward, log):
    """The two-pass split path over (M, N) rows, in row batches sized for L2."""
    M, N = a2.shape
    chunk = split_chunk()
    nchunk = C.cdiv(N, chunk)
    dev = a2.device
    # per-chunk partials, written in full by the first pass before the second reads them:
    # scratch, so that an eager plan allocates them afresh instead of refusing the signature
    p1 = C.scratch((M, nchunk), torch.float32, dev)
    p2 = C.scratch((M, nchunk), torch.float32, dev)
    row_bytes = N * a2.element_size() * (2 if backward else 1)
    batch = row_batch(M, row_bytes)
    int64 = C.needs_int64(a2, out2, p1) or (b2 is not None and C.needs_int64(b2))
    b = b2 if b2 is not None else a2
    # 16 values a thread, as in row_config
    warps = 4 if _env.INTERPRET else OVERRIDE.get("split_warps", max(4, min(32, chunk // 512)))
    common = dict(a_ptr=a2, b_ptr=b, p1_ptr=p1, p2_ptr=p2, N=N, sam=a2.stride(0),
                  san=a2.stride(1), sbm=b.stride(0), sbn=b.stride(1), NCHUNK=nchunk,
                  BACKWARD=backward, LOG=log, CHUNK=chunk, INT64=int64)
    for row0 in range(0, M, batch):
        rows = min(batch, M - row0)
        grid = (rows * nchunk,)
        C.launch(_split_partial_kernel, grid, row0=row0, num_warps=warps, **common)
        C.launch(_split_apply_kernel, grid, row0=row0, out_ptr=out2, som=out2.stride(0),
                 BLOCK_C=C.next_power_of_2(nchunk), num_warps=warps, **common)


def _softmax_fwd_impl(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    last = dim % x.ndim == x.ndim - 1  # the usual case: no movedim views (a microsecond each)
    xm = x if last else x.movedim(dim, -1)
    out = C.empty(xm.shape, x.dtype, x.device)
    if out.numel() == 0:
        return out if last else out.movedim(-1, dim)
    x2, y2 = as_rows(xm), out.view(-1, xm.shape[-1])
    M, N = x2.shape
    if N > fused_max_cols(x.element_size()):
        default_long = LONG_FWD if M >= _sm_count(x.device) else "split"
        if OVERRIDE.get("softmax_long", default_long) == "loop":
            chunk = OVERRIDE.get("loop_chunk", 4096 if _env.INTERPRET else LOOP_CHUNK)
            C.launch(_softmax_loop_kernel, (M,), x_ptr=x2, y_ptr=y2, N=N, sxm=x2.stride(0),
                     sxn=x2.stride(1), sym=y2.stride(0), LOG=log, BLOCK_N=chunk,
                     INT64=C.needs_int64(x2, y2),
                     num_warps=4 if _env.INTERPRET else max(4, min(32, chunk // 1024)))
        else:
            _split_launch(x2, None, y2, backward=False, log=log)
    else:
        block_n, rows, warps = row_config(N, x.element_size())
        C.launch(_softmax_fwd_kernel, (C.cdiv(M, rows),), x_ptr=x2, y_ptr=y2, M=M, N=N,
                 sxm=x2.stride(0), sxn=x2.stride(1), sym=y2.stride(0), LOG=log, ROWS=rows,
                 BLOCK_N=block_n, INT64=C.needs_int64(x2, y2),
                 EVICT=OVERRIDE.get("softmax_evict", FUSED_EVICT), num_warps=warps)
    return out if last else out.movedim(-1, dim)


def _softmax_bwd_impl(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    ym, dym = y.movedim(dim, -1), dy.movedim(dim, -1)
    dx = C.empty(ym.shape, y.dtype, y.device)
    if dx.numel() == 0:
        return dx.movedim(-1, dim)
    y2, dy2, dx2 = as_rows(ym), as_rows(dym), dx.view(-1, ym.shape[-1])
    M, N = y2.shape
    if N > fused_max_cols(y.element_size(), backward=True):
        _split_launch(y2, dy2, dx2, backward=True, log=log)
    else:
        block_n, rows, warps = row_config(N, y.element_size())
        C.launch(_softmax_bwd_kernel, (C.cdiv(M, rows),), y_ptr=y2, dy_ptr=dy2, dx_ptr=dx2,
                 M=M, N=N, sym=y2.stride(0), syn=y2.stride(1), sdym=dy2.stride(0),
                 sdyn=dy2.stride(1), sdxm=dx2.stride(0), LOG=log, ROWS=rows, BLOCK_N=block_n,
                 INT64=C.needs_int64(y2, dy2, dx2), num_warps=warps)
    return dx.movedim(-1, dim)


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("tkit::softmax", mutates_args=())
def _softmax_op(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return _softmax_fwd_impl(x, dim, log)


@_softmax_op.register_fake
def _(x, dim, log):
    return torch.empty_like(x.movedim(dim, -1), memory_format=torch.contiguous_format).movedim(
        -1, dim)


@torch.library.custom_op("tkit::softmax_backward", mutates_args=())
def _softmax_bwd_op(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return _softmax_bwd_impl(y, dy, dim, log)


@_softmax_bwd_op.register_fake
def _(y, dy, dim, log):
    return torch.empty_like(y.movedim(dim, -1), memory_format=torch.contiguous_format).movedim(
        -1, dim)


def _softmax_setup(ctx, inputs, output):
    _, dim, log = inputs
    ctx.dim, ctx.log = dim, log
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return _softmax_bwd_op(y, grad.to(y.dtype), ctx.dim, ctx.log), None, None


_softmax_op.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _check(x, dim) -> int:
    C.check_tensor(x, "x", min_ndim=1)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim {dim} is out of range for x of shape {tuple(x.shape)}")
    return dim % x.ndim


def _softmax_slow(x, dim, log):
    dim = _check(x, dim)
    if C.use_direct_path(x):
        return _softmax_fwd_impl(x, dim, log)
    return _softmax_op(x, dim, log)


_T = torch.Tensor
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()


def _softmax(x, dim, log):
    # the eager plan (tkit.kernels._plan): the key holds all the ordinary path reads
    if (P.ON and type(x) is _T and type(dim) is int and not OVERRIDE and not _compiling()
            and not (_grad_enabled() and x.requires_grad)):
        dev, stream = L._device_stream()
        key = (log, dim, dev, x.shape, x.stride(), x.dtype, x.get_device(),
               not x.data_ptr() & 15)
        plan = _plans.get(key)
        if plan:
            y = plan(stream, x)
            if y is not None:
                return y
        elif plan is None:
            P.stats["plan_miss"] += 1
            with P.recording() as rec:
                y = _softmax_slow(x, dim, log)
            P.store(_plans, key, rec, (x,), (y,))
            return y
    return _softmax_slow(x, dim, log)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim``: ``exp(x - max) / sum(exp(x - max))``, computed in float32.

    Parameters
    ----------
    x : Tensor
        float32, float16 or bfloat16 CUDA tensor, at least 1-D, any strides.
    dim : int
        The reduced dimension. Rows of up to 64 KiB take one pass in registers; longer rows
        (tested up to 1M columns) take the split online-softmax path.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x``. Rows of only -inf (or holding +inf) give NaN, as torch.
    """
    return _softmax(x, dim, False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x - max - log(sum(exp(x - max)))`` along ``dim``; see :func:`softmax`."""
    return _softmax(x, dim, True)


def cost(x: torch.Tensor, dim: int = -1, backward: bool = False):
    """Bytes and FLOPs of one softmax (forward: read x, write y; backward: read y, dy, write dx)."""
    from tkit.registry import Cost

    n = x.numel()
    return Cost((3 if backward else 2) * n * x.element_size(), 5 * n)
