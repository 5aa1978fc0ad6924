"""The GEMM family's Triton code (``@triton.jit`` only, and the autotuned wrappers): the
pointer, persistent TMA, split-K and grouped kernels with their shared tile helpers."""

from __future__ import annotations

import triton
import triton.language as tl

from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels._numerics import interpreter_operand as _interpreter_operand
from tkit.kernels.elementwise._kernels import _activation
from tkit.kernels.matmul.config import _prune, _ptr_configs, _tma_configs


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M rows of tiles are walked column by column, so that programs
    running at the same time share A rows and B columns in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
              res_ptr, stride_rm, stride_rn,
              SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
              ACT: tl.constexpr, HAS_RES: tl.constexpr):
    """Float32 epilogue on one tile: scales (0 none, 1 per-tensor, 2 per-row / per-column),
    bias along N, activation, residual. ``res_ptr`` already points at this batch's residual."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SCALE_A == 1:
        acc = acc * tl.load(sa_ptr).to(tl.float32)
    elif SCALE_A == 2:
        acc = acc * tl.load(sa_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    if SCALE_B == 1:
        acc = acc * tl.load(sb_ptr).to(tl.float32)
    elif SCALE_B == 2:
        acc = acc * tl.load(sb_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    acc = _activation(acc, ACT)
    if HAS_RES:
        r_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
        r = tl.load(r_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        acc = acc + r.to(tl.float32)
    return acc


@triton.jit
def _tma_tiles(a_desc, b_desc, off_m, off_n, off_k, A_TRANS: tl.constexpr,
               B_TRANS: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) tile of a and (BLOCK_K, BLOCK_N) tile of b at (off_m, off_k) and
    (off_k, off_n) through their TMA descriptors, read transposed where the operand is."""
    if A_TRANS:
        a = a_desc.load([off_k, off_m]).T
    else:
        a = a_desc.load([off_m, off_k])
    if B_TRANS:
        b = b_desc.load([off_n, off_k]).T
    else:
        b = b_desc.load([off_k, off_n])
    return a, b


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if _INTERPRET:
        # the interpreter multiplies bfloat16 operands as raw 16-bit integers and reads an fp8
        # NaN as 480: hand it float32 operands (exact products, as the tensor cores compute)
        a = _interpreter_operand(a)
        b = _interpreter_operand(b)
    if a.dtype.is_fp8():
        # Hopper's fp8 tensor cores keep about 14 bits of a running sum that stays inside the
        # MMA chain, so over K = 8192 the error grew past one bf16 rounding of the result;
        # each BLOCK_K step starts a fresh MMA sum, added to acc in float32 (256 deep at the
        # TMA kernel's fp8 tiles, half the drains of DeepSeek-V3's 128; config.py says why)
        acc += tl.dot(a, b)
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn, stride_rb, stride_rm, stride_rn, stride_bias,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    HAS_RES: tl.constexpr, IEEE: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Pointer-based GEMM, one output tile per program; program_id(1) is the batch index.

    a_ptr (B, M, K), b_ptr (B, K, N), c_ptr (B, M, N) with any strides (stride_*b may be 0 for
    a broadcast operand); sa_ptr / sb_ptr float32 scales (per-tensor, per-row of a, per-column
    of b); bias_ptr (N,) with stride_bias; res_ptr (B, M, N) residual. Unused pointers are
    dummies, switched off by the constexpr flags.
    """
    pid = tl.program_id(0)
    pid_b = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    if INT64:
        pid_b = pid_b.to(tl.int64)
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows / columns past the edge read a valid row (modulo) instead of masking every load;
    # they are masked on the store. No multiple_of / max_contiguous hints on them: a tile that
    # wraps restarts at 0 mid-tile, so a vector after the wrap starts at N's remainder, and a
    # 16-byte load claimed aligned there faults (misaligned address) when N is not a multiple
    # of the vector. Triton proves the contiguity it can from M's and N's divisibility.
    offs_am = offs_m % M
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = (a_ptr + pid_b * stride_ab + offs_am[:, None] * stride_am
              + offs_k[None, :] * stride_ak)
    b_ptrs = (b_ptr + pid_b * stride_bb + offs_k[:, None] * stride_bk
              + offs_bn[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _dot(a, b, acc, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
                    res_ptr + pid_b * stride_rb, stride_rm, stride_rn,
                    SCALE_A, SCALE_B, HAS_BIAS, ACT, HAS_RES)
    c_ptrs = c_ptr + pid_b * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


_matmul_autotuned = triton.autotune(
    configs=_ptr_configs(), key=["M", "N", "K"], prune_configs_by={"early_config_prune": _prune},
)(_matmul_kernel)


@triton.jit
def _matmul_tma_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr,
    M, N, K,
    stride_a, stride_b, stride_cm, stride_rm, stride_rn, stride_bias,
    A_TRANS: tl.constexpr, B_TRANS: tl.constexpr,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    HAS_RES: tl.constexpr, IEEE: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False,
    RES_TMA: tl.constexpr = False,
):
    """Persistent TMA GEMM for 2-D problems: NUM_SMS programs walk the tiles in grouped order.

    a_ptr: (M, K) with row stride ``stride_a``, or when A_TRANS its column-major storage, i.e.
    the (K, M) matrix a.T with row stride ``stride_a``. b_ptr: (K, N) row stride ``stride_b``,
    or when B_TRANS the (N, K) matrix b.T (the layout of an nn.Linear weight). c_ptr: (M, N)
    contiguous rows of stride ``stride_cm``. Scales, bias and residual as in ``_matmul_kernel``.
    TMA needs 16-byte aligned bases and row strides, which the launcher checks. RES_TMA: the
    residual is a row-major (M, N) tensor of row stride ``stride_rm`` read through a TMA
    descriptor (one bulk copy per half-tile instead of 32 four-byte loads per thread in the
    accumulator's layout, each a half-used 32-byte sector); the launcher then passes
    HAS_RES=False.
    """
    dtype = c_ptr.dtype.element_ty
    if A_TRANS:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if B_TRANS:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    if EPI_SUBTILE:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // 2])
    else:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    if RES_TMA:
        if EPI_SUBTILE:
            r_desc = tl.make_tensor_descriptor(res_ptr, shape=[M, N], strides=[stride_rm, 1],
                                               block_shape=[BLOCK_M, BLOCK_N // 2])
        else:
            r_desc = tl.make_tensor_descriptor(res_ptr, shape=[M, N], strides=[stride_rm, 1],
                                               block_shape=[BLOCK_M, BLOCK_N])
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    tile_id_c = start_pid - NUM_SMS  # the epilogue's own tile counter (flattening moves it)
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN,
                            warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a, b = _tma_tiles(a_desc, b_desc, off_m, off_n, off_k, A_TRANS, B_TRANS)
            acc = _dot(a, b, acc, IEEE)
        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_pid(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        if EPI_SUBTILE:
            acc = tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2))
            acc = tl.permute(acc, (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            offs_n0 = off_n + tl.arange(0, BLOCK_N // 2)
            acc0 = _epilogue(acc0, offs_m, offs_n0, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
                             res_ptr, stride_rm, stride_rn,
                             SCALE_A, SCALE_B, HAS_BIAS, ACT, HAS_RES)
            if RES_TMA:
                acc0 = acc0 + r_desc.load([off_m, off_n]).to(tl.float32)
            c_desc.store([off_m, off_n], acc0.to(dtype))
            offs_n1 = offs_n0 + BLOCK_N // 2
            acc1 = _epilogue(acc1, offs_m, offs_n1, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
                             res_ptr, stride_rm, stride_rn,
                             SCALE_A, SCALE_B, HAS_BIAS, ACT, HAS_RES)
            if RES_TMA:
                acc1 = acc1 + r_desc.load([off_m, off_n + BLOCK_N // 2]).to(tl.float32)
            c_desc.store([off_m, off_n + BLOCK_N // 2], acc1.to(dtype))
        else:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc = _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
                            res_ptr, stride_rm, stride_rn,
                            SCALE_A, SCALE_B, HAS_BIAS, ACT, HAS_RES)
            if RES_TMA:
                acc = acc + r_desc.load([off_m, off_n]).to(tl.float32)
            c_desc.store([off_m, off_n], acc.to(dtype))


_matmul_tma_autotuned = triton.autotune(
    configs=_tma_configs(), key=["M", "N", "K", "A_TRANS", "B_TRANS"],
    prune_configs_by={"early_config_prune": _prune},
)(_matmul_tma_kernel)


@triton.jit
def _splitk_slice(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  IEEE: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's K-slice of its (BLOCK_M, BLOCK_N) tile, in float32: program_id(0) walks
    N, program_id(1) M, program_id(2) the K split. Returns (acc, offs_m, offs_n)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = offs_m % M
    offs_bn = offs_n % N  # no alignment hints: see _matmul_kernel
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * tiles_per_split
    k_end = tl.minimum(k_begin + tiles_per_split, k_tiles)
    offs_k = k_begin * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(k_begin, k_end, num_stages=NUM_STAGES):
        k_left = K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] - k_begin * BLOCK_K < k_left, other=0.0)
        # the weight is read once: do not let it push the activations out of L2
        b = tl.load(b_ptrs, mask=offs_k[:, None] - k_begin * BLOCK_K < k_left, other=0.0,
                    eviction_policy="evict_first")
        acc = _dot(a, b, acc, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, offs_m, offs_n


@triton.jit
def _matmul_splitk_kernel(
    a_ptr, b_ptr, ws_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    IEEE: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One K-slice of one (BLOCK_M, BLOCK_N) tile, written as float32 to ws[split, M, N].

    a_ptr (M, K), b_ptr (K, N), any strides. program_id(0) walks N (the long dimension: one
    program per weight slab), program_id(1) M, program_id(2) the K split. A split whose K range
    is empty writes zeros, so the workspace needs no initialization.
    """
    acc, offs_m, offs_n = _splitk_slice(
        a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
        IEEE, SPLIT_K, NUM_STAGES, BLOCK_M, BLOCK_N, BLOCK_K)
    pid_k = tl.program_id(2)
    ws_ptrs = ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(ws_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _matmul_splitk_tma_kernel(
    a_desc, b_desc, ws_ptr, M, N, K,
    B_TRANS: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``_matmul_splitk_kernel`` with its tiles brought by TMA: host descriptors over a (M, K)
    row-major ([BLOCK_M, BLOCK_K] boxes) and b (K, N) ([BLOCK_K, BLOCK_N] boxes), or with
    B_TRANS b's (N, K) storage ([BLOCK_N, BLOCK_K] boxes: an nn.Linear weight). Rows, columns
    and K past the edges read zeros; the partial is written as ``_matmul_splitk_kernel``'s
    (float32 ws[split, M, N], an empty K range writing zeros)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * per_split
    k_end = tl.minimum(k_begin + per_split, k_tiles)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(k_begin, k_end, num_stages=NUM_STAGES):
        a = a_desc.load([off_m, kt * BLOCK_K])
        if B_TRANS:
            b = b_desc.load([off_n, kt * BLOCK_K]).T
        else:
            b = b_desc.load([kt * BLOCK_K, off_n])
        acc = _dot(a, b, acc, IEEE)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    ws_ptrs = ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(ws_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _matmul_splitk_fused_kernel(
    a_ptr, b_ptr, ws_ptr, cnt_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
    stride_bias,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    HAS_RES: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Split-K in one launch: ``_matmul_splitk_kernel``'s K-slice, then the program that
    finishes a tile last (a per-tile arrival counter) sums the SPLIT_K partials in split order
    (deterministic: the same order whoever arrives last), applies the epilogue and writes c.

    ws_ptr float32 (SPLIT_K, M, N); cnt_ptr int32, one zeroed counter per (pid_m, pid_n) tile,
    left at zero again by the last program; c_ptr and the epilogue pointers as in
    ``_splitk_reduce_kernel``.
    """
    acc, offs_m, offs_n = _splitk_slice(
        a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
        IEEE, SPLIT_K, NUM_STAGES, BLOCK_M, BLOCK_N, BLOCK_K)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(tile_ptrs + pid_k * M * N, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is stored before the (releasing) arrival
    cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(tile_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        total = _epilogue(total, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
                          res_ptr, stride_rm, stride_rn, SCALE_A, SCALE_B, HAS_BIAS, ACT, HAS_RES)
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt, 0)  # ready for the next launch


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N,
    stride_cm, stride_cn, stride_rm, stride_rn, stride_bias,
    SPLIT_K: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """c = epilogue(sum over s of ws[s]) in a fixed order (deterministic). ws_ptr is float32
    (SPLIT_K, M, N) contiguous; the rest as in ``_matmul_kernel``."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0)
    acc = _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
                    res_ptr, stride_rm, stride_rn, SCALE_A, SCALE_B, HAS_BIAS, ACT, HAS_RES)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_matmul_kernel(
    a_ptr, b_ptr, c_ptr, off_ptr, T, G, N, K,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cm, stride_cn,
    IEEE: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[rows of group g] = a[rows of group g] @ b[g], every group in one launch.

    a_ptr (T, K) and c_ptr (T, N); b_ptr (G, K, N) any strides; off_ptr int32/int64 (G+1,).
    The rows of group g are [bound(g), bound(g+1)) where bound(j) is the largest of off[0..j]
    clamped to [0, T]: for valid offsets (non-decreasing, 0 to T) exactly off[g]:off[g+1],
    and whatever the offsets hold, groups stay inside a and c and never overlap. Rows before
    bound(0) or from bound(G) on belong to no group and are written as zeros (so no value of
    the offsets leaves memory unwritten or reads outside a tensor).

    program_id(0) enumerates M tiles back to back: the leading rows of no group, every group,
    the trailing rows of no group (the grid is an upper bound, cdiv(T, BLOCK_M) + G + 2, since
    the group sizes are on the device); a program past the last tile returns. program_id(1)
    walks N. Row offsets are 64-bit; INT64 makes the K and N offsets 64-bit too.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # find this tile's rows: a scan over G scalars (cheap next to a tile of K work)
    s = tl.minimum(tl.maximum(tl.load(off_ptr).to(tl.int64), 0), T)
    t = tl.cdiv(s, BLOCK_M)
    hit = pid_m < t
    row0 = tl.where(hit, pid_m.to(tl.int64) * BLOCK_M, 0)
    row_end = tl.where(hit, s, 0)
    gap = hit.to(tl.int32)  # a tile of rows in no group: zeros
    group = pid_m * 0
    tile_start = t
    for g in range(G):
        e = tl.minimum(tl.maximum(tl.load(off_ptr + g + 1).to(tl.int64), s), T)
        t = tl.cdiv(e - s, BLOCK_M)
        hit = (pid_m >= tile_start) & (pid_m < tile_start + t)
        row0 = tl.where(hit, s + (pid_m - tile_start) * BLOCK_M, row0)
        row_end = tl.where(hit, e, row_end)
        group = tl.where(hit, g, group)
        gap = tl.where(hit, 0, gap)
        tile_start += t
        s = e
    t = tl.cdiv(T - s, BLOCK_M)
    hit = (pid_m >= tile_start) & (pid_m < tile_start + t)
    row0 = tl.where(hit, s + (pid_m - tile_start) * BLOCK_M, row0)
    row_end = tl.where(hit, T, row_end)
    gap = tl.where(hit, 1, gap)
    if row0 < row_end:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        if INT64:
            offs_n = offs_n.to(tl.int64)
            offs_k = offs_k.to(tl.int64)
        mask_m = offs_m < row_end
        offs_bn = offs_n % N  # no alignment hints: see _matmul_kernel
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = (b_ptr + group.to(tl.int64) * stride_bg + offs_k[:, None] * stride_bk
                  + offs_bn[None, :] * stride_bn)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K) * (1 - gap)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = _dot(a, b, acc, IEEE)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_n[None, :] < N))


@triton.jit
def _max_combine(x, y):
    return tl.maximum(x, y)


@triton.jit
def _grouped_segments(off_ptr, T, G, BLOCK_M: tl.constexpr, SEG_BLOCK: tl.constexpr):
    """The row segments of a grouped problem as vectors over s < SEG_BLOCK (>= G + 2):
    segment 0 is the rows before the first group, segment g + 1 group g, segment G + 1 the rows
    after the last group, the rest empty. Returns (start, end, first_tile) per segment (rows
    [start, end), its BLOCK_M-row tiles numbered from first_tile) and the total tile count.
    bound(j) is the largest of off[0..j] clamped to [0, T], so whatever the offsets hold the
    segments are ordered, disjoint and inside [0, T)."""
    s = tl.arange(0, SEG_BLOCK)
    lo = tl.load(off_ptr + tl.maximum(s - 1, 0), mask=(s >= 1) & (s <= G + 1), other=0)
    lo = tl.minimum(tl.maximum(lo.to(tl.int64), 0), T).to(tl.int32)
    lo = tl.where(s > G + 1, T, lo)
    hi = tl.load(off_ptr + s, mask=s <= G, other=0)
    hi = tl.minimum(tl.maximum(hi.to(tl.int64), 0), T).to(tl.int32)
    hi = tl.where(s > G, T, hi)
    start = tl.associative_scan(lo, 0, _max_combine)
    end = tl.associative_scan(hi, 0, _max_combine)
    tiles = tl.cdiv(end - start, BLOCK_M)
    last = tl.cumsum(tiles, 0)
    return start, end, last - tiles, tl.sum(tiles, 0)


@triton.jit
def _grouped_tile(mt, s, start, end, first, BLOCK_M: tl.constexpr):
    """Global row-tile ``mt`` of :func:`_grouped_segments`' numbering: its first row, its
    segment's end and the segment's index (the last non-empty segment whose tiles start at or
    before mt). Three reductions over the segments (the segment's first tile and first row
    packed into one int64 sum)."""
    seg = tl.max(tl.where((first <= mt) & (end > start), s, 0), 0)
    pick = s == seg
    packed = tl.sum(tl.where(pick, (first.to(tl.int64) << 32) | start.to(tl.int64), 0), 0)
    row0 = (packed & 0xFFFFFFFF).to(tl.int32) + (mt - (packed >> 32).to(tl.int32)) * BLOCK_M
    row_end = tl.sum(tl.where(pick, end, 0), 0)
    return row0, row_end, seg


@triton.jit
def _grouped_matmul_tma_kernel(
    a_desc, b_desc, c_desc, c_ptr, off_ptr, T, G, N, K, stride_cm, stride_cn,
    B_TRANS: tl.constexpr, IEEE: tl.constexpr, NUM_SMS: tl.constexpr,
    SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """:func:`_grouped_matmul_kernel` as a persistent TMA GEMM: NUM_SMS programs walk every
    group's tiles in one grouped order.

    The row tiles of all segments (the rows before the first group, each group, the rows
    after the last; :func:`_grouped_segments`) are numbered back to back into one virtual M
    axis of ``total`` tiles, which the programs walk with the N tiles in grouped order
    (``_tile_pid``), as ``_matmul_tma_kernel`` walks one problem's. The descriptors are made
    on the host: ``a_desc`` over a (T, K), row-major, [BLOCK_M, BLOCK_K] boxes; ``b_desc``
    over the G stacked weights as one 2-D matrix, (G K, N) whose rows g K .. g K + K - 1 are
    b[g] ([BLOCK_K, BLOCK_N] boxes), or with B_TRANS (G N, K) whose rows g N .. are b[g].T
    (an nn.Linear stack; [BLOCK_N, BLOCK_K] boxes); ``c_desc`` over the (T, N) output,
    [BLOCK_M, BLOCK_N // 2] boxes (TMA_STORE only). A tile's rows past its group's end read
    the next group's rows of a (or zeros past T) and are not stored; b's rows past a group's
    K (only with B_TRANS, where they are the columns past N) land in columns that are not
    stored either, so the launcher requires K % BLOCK_K == 0 without B_TRANS. A tile whose
    rows all belong to its group is stored by TMA in two half-tiles with TMA_STORE; a tile
    at a group's end through pointers (``c_ptr``), masked to the group (64-bit row offsets),
    since it may not write the next group's rows."""
    dtype = c_ptr.dtype.element_ty
    s = tl.arange(0, SEG_BLOCK)
    start, end, first, total = _grouped_segments(off_ptr, T, G, BLOCK_M, SEG_BLOCK)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    start_pid = tl.program_id(0)
    num_tiles = total * num_pid_n
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        mt, pid_n = _tile_pid(tile_id, total, num_pid_n, GROUP_M)
        off_m, row_end, seg = _grouped_tile(mt, s, start, end, first, BLOCK_M)
        off_n = pid_n * BLOCK_N
        # b's rows of this tile's group (clamped for the segments of no group, 0 and G + 1,
        # whose tiles exist only for invalid offsets: computed, then zeroed, so that every
        # tile runs the same K loop, which the flattened pipeline wants)
        g = tl.minimum(tl.maximum(seg - 1, 0), G - 1)
        live = (seg >= 1) & (seg <= G)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            if B_TRANS:
                b = b_desc.load([g * N + off_n, off_k]).T
            else:
                b = b_desc.load([g * K + off_k, off_n])
            acc = _dot(a, b, acc, IEEE)
        acc = tl.where(live, acc, 0.0)
        if TMA_STORE and off_m + BLOCK_M <= row_end:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)),
                                             (0, 2, 1)))
            c_desc.store([off_m, off_n], acc0.to(dtype))
            c_desc.store([off_m, off_n + BLOCK_N // 2], acc1.to(dtype))
        else:
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            c_ptrs = (c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm
                      + offs_n[None, :] * stride_cn)
            tl.store(c_ptrs, acc.to(dtype),
                     mask=(offs_m < row_end)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, g_ptr, db_ptr, off_ptr, T, G, K, N,
    stride_am, stride_ak, stride_gm, stride_gn, stride_dg, stride_dk, stride_dn,
    IEEE: tl.constexpr, INT64: tl.constexpr, G_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """db[g] = a[rows of g].T @ grad[rows of g]: the weight gradient of grouped_matmul.

    a_ptr (T, K), g_ptr (T, N) output gradient, db_ptr (G, K, N) float32; the rows of group g
    as in :func:`_grouped_matmul_kernel` (the running maximum of the clamped offsets, read
    here as one vector of G_BLOCK >= G + 1 entries). program_id(0) is the group,
    program_id(1) one (BLOCK_K, BLOCK_N) tile of db[g]. Rows are reduced in BLOCK_R steps,
    in order (deterministic); an empty group writes zeros.
    """
    grp = tl.program_id(0)
    pid = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_k = (pid // num_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        offs_k = offs_k.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    idx = tl.arange(0, G_BLOCK)
    bounds = tl.load(off_ptr + idx, mask=idx <= G, other=0).to(tl.int64)
    bounds = tl.minimum(tl.maximum(bounds, 0), T)
    s = tl.max(tl.where(idx <= grp, bounds, 0), 0)
    e = tl.max(tl.where(idx <= grp + 1, bounds, 0), 0)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(s, e, BLOCK_R):
        rows = r0 + offs_r
        mr = rows < e
        at = tl.load(a_ptr + rows[None, :] * stride_am + offs_k[:, None] * stride_ak,
                     mask=mr[None, :] & (offs_k[:, None] < K), other=0.0)
        gt = tl.load(g_ptr + rows[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                     mask=mr[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = _dot(at, gt, acc, IEEE)
    d_ptrs = (db_ptr + grp.to(tl.int64) * stride_dg + offs_k[:, None] * stride_dk
              + offs_n[None, :] * stride_dn)
    tl.store(d_ptrs, acc, mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))




# --------------------------------------------------------------------------------------------
# matmul_glu: the gated up-projection, act(a @ b_gate + bias_gate) * (a @ b_up + bias_up)
# --------------------------------------------------------------------------------------------
@triton.jit
def _glu_epilogue(g, u, offs_n, N, bias_ptr, stride_bias, HAS_BIAS: tl.constexpr,
                  ACT: tl.constexpr):
    """``act(g + bias[n]) * (u + bias[N + n])`` in float32 for the columns ``offs_n`` < N."""
    if HAS_BIAS:
        mask_n = offs_n < N
        bg = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0)
        bu = tl.load(bias_ptr + (offs_n + N) * stride_bias, mask=mask_n, other=0.0)
        g = g + bg.to(tl.float32)[None, :]
        u = u + bu.to(tl.float32)[None, :]
    return _activation(g, ACT) * u


@triton.jit
def _matmul_glu_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_up, stride_cm, stride_cn, stride_bias,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c (M, N) = act(a @ b[:, :N] + bias[:N]) * (a @ b[:, N:] + bias[N:]), one (BLOCK_M,
    BLOCK_N) output tile per program in grouped order: two float32 accumulators, the gate's
    over columns [n, n + BLOCK_N) of b and the up's over [N + n, ...).

    a_ptr (M, K), b_ptr (K, 2N) (a merged gate/up nn.Linear weight ``w.t()``: gate columns
    first), c_ptr (M, N), any strides; bias_ptr (2N,) with stride_bias (a dummy without
    HAS_BIAS); stride_up = N * stride_bn, the up half's offset in b."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    if INT64:
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = offs_m % M  # wrapped, masked on the store (no alignment hints: _matmul_kernel)
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
    g_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        bg = tl.load(g_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        bu = tl.load(g_ptrs + stride_up, mask=offs_k[:, None] < k_left, other=0.0)
        acc_g = _dot(a, bg, acc_g, IEEE)
        acc_u = _dot(a, bu, acc_u, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_bk
    y = _glu_epilogue(acc_g, acc_u, offs_n, N, bias_ptr, stride_bias, HAS_BIAS, ACT)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _splitk_glu_reduce_kernel(
    ws_ptr, c_ptr, bias_ptr, M, N, stride_cm, stride_cn, stride_bias,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """c (M, N) = act(g + bias[:N]) * (u + bias[N:]) where g and u are the sums over s of the
    split-K partials ws[s, :, :N] and ws[s, :, N:] (ws_ptr float32 (SPLIT_K, M, 2N)
    contiguous, summed in a fixed order: deterministic)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = ws_ptr + offs_m[:, None] * (2 * N) + offs_n[None, :]
    g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        g += tl.load(ptrs + s * M * 2 * N, mask=mask, other=0.0)
        u += tl.load(ptrs + s * M * 2 * N + N, mask=mask, other=0.0)
    y = _glu_epilogue(g, u, offs_n, N, bias_ptr, stride_bias, HAS_BIAS, ACT)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=mask)
