"""GEMM: ``out = act(scale_a * scale_b * (a @ b) + bias) + residual``, rounded once to out_dtype.

Math. ``a`` is (..., M, K), ``b`` is (..., K, N) (leading dims broadcast), accumulation is in
float32 whatever the inputs (fp16/bf16 on tensor cores; fp32 on tf32 tensor cores unless
``allow_tf32=False``; float8_e4m3fn on fp8 tensor cores). The epilogue, in float32, applies in
this order: per-tensor / per-row (M) ``scale_a`` and per-tensor / per-column (N) ``scale_b``,
``bias`` (N,), the activation (silu, gelu, gelu_tanh, relu), ``residual`` (broadcast to the
output), then one rounding to ``out_dtype``.

Cost model: FLOPs = 2*M*N*K per batch; bytes >= (M*K + K*N) * in_size + M*N * out_size.
Arithmetic intensity of the whole problem at 4096^3 bf16 is ~1365 FLOP/byte, far past the
H200's balance point (~990 TFLOP/s dense bf16 / 4.8 TB/s ~ 200 FLOP/byte): compute-bound.
What matters is the intensity of one *tile*: a BM x BN tile with K-step BK loads
(BM + BN) * BK * 2 bytes for 2 * BM * BN * BK FLOPs, i.e. BM*BN/(BM+BN) FLOP/byte from L2/HBM:
64 for 128x128, 85 for 128x256, 128 for 256x256. Tiles must be large for the operands to come
from shared memory fast enough, and L2 reuse across tiles (grouped ordering) makes up the rest.
At M <= 64 (decode) the problem flips: intensity ~ M FLOP/byte, memory-bound, and the goal is
streaming the K*N weight at copy bandwidth.

Four kernels:

* ``_matmul_tma_kernel`` (Hopper, sm_90): persistent (one program per SM walks tiles with a
  grouped, L2-friendly order), operands through device-side TMA tensor descriptors
  (``tl.make_tensor_descriptor``; a column-major operand is described as its transpose and
  transposed in shared memory, no copy), wgmma, ``tl.range(..., flatten=True)`` so that loads
  for the next tile are issued while the epilogue of this one runs, and an optional epilogue
  split into two half-tiles (less register pressure, two smaller TMA stores).
* ``_matmul_kernel`` (portable, sm_80 and any strides or batch): pointer-based tiles with
  grouped ordering; ``num_stages`` >= 3 becomes cp.async pipelining on sm_80 and later.
* ``_matmul_splitk_kernel`` + ``_splitk_reduce_kernel`` (M <= 64, large K*N): the K dimension
  is split across programs so that enough of them stream the weight at once; each writes a
  float32 partial tile, and a second kernel sums the partials in a fixed order (deterministic,
  no atomics) and applies the epilogue.
  ``_matmul_splitk_fused_kernel`` (config ``FUSED_REDUCE=True``, opt-in) does both in one
  launch: the last program to finish a tile (per-tile arrival counter) sums the partials in
  split order and applies the epilogue.
* ``_grouped_matmul_kernel``: many problems in one launch, rows of ``a`` split into groups by
  ``offsets`` (the MoE layout), one ``b`` per group.

Which one runs for a call is :func:`plan`'s decision; it returns the path and the reason, and
``tkit.ir`` shows the launched kernel. Configs are fixed per shape class by default
(:func:`tma_config`, :func:`ptr_config`, :func:`splitk_config`, each with its derivation);
``AUTOTUNE = True`` tunes the TMA and pointer kernels per shape over pruned config lists
instead; docs/NOTES.md has the H200 timings of the alternatives side by side.

Not here yet: a TMA path for batched operands (3-D descriptors; batched problems with a shared
weight are folded into M and do take it), a Hopper (TMA/wgmma) grouped kernel, and per-stream
counters that would let the one-launch split-K be the default.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _launch as L
from tkit.kernels import _offsets
from tkit.kernels import _plan as P
from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels._numerics import interpreter_operand as _interpreter_operand
from tkit.kernels.elementwise import _activation, _activation_grad, _sum_to

ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh", "relu")
#: Autotune the TMA and pointer kernels per (M, N, K) instead of taking the fixed per-shape-class
#: configs of :func:`tma_config` / :func:`ptr_config`. Off by default: every constexpr
#: combination (dtype, layout, epilogue flags) x every config is a compile (~2 s each for a
#: 128x256 tile), and every new M a tuning pass, which a serving loop with varying batch sizes
#: cannot afford. docs/NOTES.md has both measured, so that the fixed table follows the tuner.
AUTOTUNE = False
FP8 = torch.float8_e4m3fn
#: Read a row-major residual through a TMA descriptor in the TMA kernel's epilogue (RES_TMA);
#: False falls back to per-element pointer loads (kept for the GPU script's comparison).
RESIDUAL_TMA = True
_SKINNY_M = 64  # at or below this M the GEMM is weight-streaming (memory-bound): split-K path
_SKINNY_MIN_WEIGHT = 1 << 20  # K*N below this fits in L2 many times over: not worth splitting


# --------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------
def _ptr_configs():
    # The sm_80 set of Triton's matmul tutorial: 128x256 and 256x128 tiles (85 FLOP/byte per
    # tile) at 3 stages for large problems, 64-wide tiles with more stages for small ones.
    c = triton.Config
    configs = [
        c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        c({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=5, num_warps=4),
        c({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=5, num_warps=2),
    ]
    # the interpreter pays per program: few large tiles
    return C.interpreter_configs(
        configs, c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4))


def _tma_configs():
    # Hopper: 128x256x64 with 8 warps (two warpgroups of wgmma m64n256) at 3-4 stages is the
    # usual best for bf16 (a 128x256 tile is 85 FLOP/byte; 4 stages of (128+256)x64 bf16 are
    # 192 KB of the 228 KB shared memory). 128x128 tiles cover shapes with few 128x256 tiles.
    c = triton.Config
    configs = []
    for bm, bn, bk, stages, warps in [
        (128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4),
        (128, 128, 128, 3, 8), (64, 256, 64, 4, 4), (64, 128, 64, 4, 4),
    ]:
        for subtile in (True, False):
            configs.append(c({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                              "EPI_SUBTILE": subtile, "FLATTEN": True},
                             num_stages=stages, num_warps=warps))
    small = c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4, "EPI_SUBTILE": True,
               "FLATTEN": True}, num_warps=4)
    return C.interpreter_configs(configs, small)


def _prune(configs, named_args, **kwargs):
    """Per-shape-class pruning: a tile much taller (wider) than M (N) only wastes the tensor
    cores; fp32 operands take twice the shared memory, so BLOCK_K is halved; fp8 takes BK=128
    (a wgmma k-step is 32 bytes: 16 fp16 or 32 fp8 elements)."""
    if _env.INTERPRET:
        return configs
    M, N = named_args["M"], named_args["N"]
    elem = named_args["a_ptr"].element_size()
    out = []
    for cfg in configs:
        kw = dict(cfg.kwargs)
        if kw["BLOCK_M"] > 2 * max(C.next_power_of_2(M), 64) and kw["BLOCK_M"] > 64:
            continue
        if kw["BLOCK_N"] > 2 * max(C.next_power_of_2(N), 64) and kw["BLOCK_N"] > 64:
            continue
        if elem == 4:
            kw["BLOCK_K"] = max(16, kw["BLOCK_K"] // 2)
        elif elem == 1:
            kw["BLOCK_K"] = 128
        out.append(triton.Config(kw, num_stages=cfg.num_stages, num_warps=cfg.num_warps))
    # deduplicate (the fp8/fp32 rewrites can collide)
    seen, uniq = set(), []
    for cfg in out:
        key = (tuple(sorted(cfg.kwargs.items())), cfg.num_stages, cfg.num_warps)
        if key not in seen:
            seen.add(key)
            uniq.append(cfg)
    return uniq or configs[:1]


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
def _dot(a, b, acc, IEEE: tl.constexpr):
    if _INTERPRET:
        # the interpreter multiplies bfloat16 operands as raw 16-bit integers and reads an fp8
        # NaN as 480: hand it float32 operands (exact products, as the tensor cores compute)
        a = _interpreter_operand(a)
        b = _interpreter_operand(b)
    if a.dtype.is_fp8():
        # Hopper's fp8 tensor cores keep about 14 bits of a running sum that stays inside the
        # MMA chain, so over K = 8192 the error grew past one bf16 rounding of the result;
        # each BLOCK_K step (128 elements) starts a fresh MMA sum, added to acc in float32
        # (DeepSeek-V3's promotion interval).
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
            if A_TRANS:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_TRANS:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
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
# Planning: which kernel runs, and why
# --------------------------------------------------------------------------------------------
@dataclass
class MatmulPlan:
    """The kernel a call will launch (``path``: "tma", "ptr", "splitk", "empty"), the reason,
    and for split-K the configuration the heuristic picked."""

    path: str
    reason: str
    config: dict = field(default_factory=dict)


@functools.cache
def _device_info(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def _arch(device: torch.device) -> tuple[int, int]:
    """(compute capability major, SM count); the interpreter and meta tensors (tkit.ir compiles
    for sm_90) are treated as an sm_90 with a few SMs / 132 SMs."""
    if device.type == "cuda":
        return _device_info(device.index if device.index is not None else
                            torch.cuda.current_device())
    if device.type == "meta":
        return 9, 132
    return 0, 4


def _tma_ok(t: torch.Tensor) -> tuple[bool, bool]:
    """(ok, transposed): TMA takes a 2-D view whose last stride is 1 and whose other stride and
    base address are multiples of 16 bytes; a column-major view is described as its transpose."""
    es = t.element_size()
    s0, s1 = t.stride()
    rows, cols = t.shape
    if s1 == 1 or cols == 1:
        ok, trans, lead = True, False, s0 if rows > 1 else cols
    elif s0 == 1 or rows == 1:
        ok, trans, lead = True, True, s1 if cols > 1 else rows
    else:
        return False, False
    return ok and (lead * es) % 16 == 0 and _aligned16(t), trans


def _aligned16(t: torch.Tensor) -> bool:
    """Whether ``t``'s first element is 16-byte aligned. A meta tensor (tkit.ir) has no address:
    its storage is taken as aligned (as allocations are) and its view's offset decides."""
    if t.device.type == "meta":
        return (t.storage_offset() * t.element_size()) % 16 == 0
    return t.data_ptr() % 16 == 0


def _lead_stride(t: torch.Tensor, trans: bool) -> int:
    rows, cols = t.shape
    if trans:
        return t.stride(1) if cols > 1 else rows
    return t.stride(0) if rows > 1 else cols


def splitk_config(M: int, N: int, K: int, num_sms: int) -> dict:
    """The split-K heuristic for M <= 64.

    Derivation: the work is streaming K*N weight bytes; a program streams one BLOCK_N-wide slab
    of BLOCK_K-deep steps with NUM_STAGES - 1 loads in flight: at BLOCK_N=BLOCK_K=128 and 4
    stages that is ~100 KB per program, more than HBM latency needs (Little's law: 4.8 TB/s x
    ~1 us ~ 5 MB in flight, ~38 KB per SM). So about one program per SM is enough, and every
    program beyond that adds partial-sum traffic (SPLIT*M*N*4 bytes written and read back), a
    reduce launch, a longer tail and waves that do not fit at once. Measured on the H200, M=1
    and 16, K=4096, N=14336 (112 slabs of 128 columns), CUDA-graph replay, median of 3
    interleaved rounds (2026-11-30): split 1 (112 programs, no reduce kernel) with 4 stages
    3.63 / 3.85 TB/s of weight (cuBLAS 3.80 / 3.81), 3 stages 3.38 / 3.74; split 2 with 4
    stages 3.47 / 3.43; BLOCK_N=64 split 1 3.19 / 3.80. An earlier run (2026-11-29) ordered
    split 2 > 4 > 8 > 16 at M=1, 16 and 64 (split 2: 3.53 / 3.48 / 2.81 TB/s, 8: 3.27 / 2.99
    / 1.74). So the split is the power of 2 nearest to SMs / slabs (about one program per SM),
    at least 1 (split 1 is the pointer kernel with this tile, epilogue included), at most 4
    when BLOCK_M is 64, and clamped so that each split keeps >= 4 K-steps. Occupancy (ptxas
    via tkit.ir, sm_90): at BLOCK_M=16 the kernel takes 108 KB of shared memory at 4 stages, so
    2 programs fit per SM. docs/NOTES.md has the timings of the neighbours of this choice.
    """
    block_m = max(16, min(64, C.next_power_of_2(M)))
    block_n = 128 if N >= 128 else max(16, C.next_power_of_2(N))
    block_k = 128 if K >= 128 else max(16, C.next_power_of_2(K))
    tiles = C.cdiv(N, block_n) * C.cdiv(M, block_m)
    ratio = num_sms / tiles
    want = 1
    while want * 2 <= ratio * 1.41:  # nearest power of 2 on a log scale
        want *= 2
    if block_m >= 64:
        want = min(want, 4)
    k_steps = C.cdiv(K, block_k)
    while want > 1 and k_steps // want < 4:
        want //= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=want,
                NUM_STAGES=4, num_warps=4)


_INTERPRETER_TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, num_warps=4)


def ptr_config(M: int, N: int, K: int, elem_size: int = 2) -> dict:
    """The pointer kernel's fixed config per shape class (the sm_80 path, and strided operands
    on sm_90). Classes follow the tile-intensity argument of the module docstring: 128x256
    (85 FLOP/byte) when there are >= 2 waves of such tiles on 132 SMs, 128x128 when M >= 128,
    64x128 below (a 128-row tile would be mostly padding)."""
    if _env.INTERPRET:
        return dict(_INTERPRETER_TILE)
    bk = {1: 128, 2: 64, 4: 32}[elem_size]
    if C.cdiv(M, 128) * C.cdiv(N, 256) >= 2 * 132:
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=3)
    if M >= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=4, num_stages=4)


#: TMA tile candidates (BLOCK_M, BLOCK_N, num_warps, bf16 stages, relative per-tile efficiency).
#: Efficiencies from the H200 run at 4096^3: 128x256 757 TFLOP/s, 128x128 684 (0.90); 64x128
#: (one warpgroup, m64n128 wgmma) is put at 0.70.
_TMA_TILES = ((128, 256, 8, 3, 1.0), (128, 128, 8, 4, 0.90), (64, 128, 4, 4, 0.70))


def tma_config(M: int, N: int, K: int, elem_size: int = 2, num_sms: int = 132) -> dict:
    """A fixed TMA config for a shape, without autotuning (the default; see ``AUTOTUNE``).

    The persistent kernel runs ceil(tiles / SMs) waves of tiles, so the time of a tile shape is
    about waves x (BLOCK_M x BLOCK_N) / efficiency: 128x256 tiles (85 FLOP/byte, the fastest per
    FLOP) win whenever they make whole waves (4096^3, 8192^3: 0.97-1.12x cuBLAS measured), while
    a problem with fewer tiles than SMs (M=256, N=4096: 32 tiles of 128x256) is better cut into
    64x128 tiles that occupy every SM. BLOCK_K is 128 bytes of K: 64 for 16-bit, 128 for fp8,
    32 for fp32."""
    if _env.INTERPRET:
        return dict(_INTERPRETER_TILE, EPI_SUBTILE=True, FLATTEN=True)
    bk = {1: 128, 2: 64, 4: 32}[elem_size]
    best = None
    for bm, bn, warps, stages, eff in _TMA_TILES:
        waves = C.cdiv(C.cdiv(M, bm) * C.cdiv(N, bn), num_sms)
        t = waves * bm * bn / eff
        if best is None or t < best[0] * 0.999:
            best = (t, bm, bn, warps, stages)
    _, bm, bn, warps, stages = best
    if elem_size == 4 and bn == 256:
        stages = 4  # fp32: BLOCK_K=32, 4 stages fit (fp8 at 3 stages measured 1.031x vs 1.023x)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EPI_SUBTILE=True,
                FLATTEN=True, num_warps=warps, num_stages=stages)


def plan(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, *,
         path: str | None = None) -> MatmulPlan:
    """Which kernel ``matmul(a, b)`` runs for 2-D operands (after batch folding), and why."""
    M, K = a.shape
    N = b.shape[1]
    out_dtype = out_dtype or _default_out_dtype(a.dtype)
    major, sms = _arch(a.device)
    if M == 0 or N == 0:
        return MatmulPlan("empty", "empty output: nothing to launch")
    if path is not None:
        cfg = splitk_config(M, N, K, sms) if path == "splitk" else {}
        return MatmulPlan(path, "forced", cfg)
    if K == 0:
        return MatmulPlan("ptr", "K = 0: the output is the epilogue of zeros")
    if M <= _SKINNY_M and K * N >= _SKINNY_MIN_WEIGHT and not C.needs_int64(a, b):
        # (the split-K kernel's index math is 32-bit; a weight past 2**31 elements takes the
        # pointer kernel's 64-bit path)
        return MatmulPlan("splitk", f"M={M} <= {_SKINNY_M} with a {K}x{N} weight: "
                          "memory-bound, split-K streams the weight", splitk_config(M, N, K, sms))
    if major >= 9:
        out_es = out_dtype.itemsize
        if not (_tma_ok(a)[0] and _tma_ok(b)[0]):
            return MatmulPlan("ptr", "an operand's strides or alignment are not TMA-compatible")
        if (N * out_es) % 16:
            return MatmulPlan("ptr", f"output rows of {N * out_es} bytes are not a multiple of "
                              "16 (TMA store)")
        return MatmulPlan("tma", f"sm_{major}0 and TMA-compatible strides: persistent TMA kernel")
    if major == 0:
        return MatmulPlan("ptr", "Triton interpreter: portable kernel")
    return MatmulPlan("ptr", f"sm_{major}x: cp.async-pipelined pointer kernel")


def _default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype in C.FP8_DTYPES else dtype


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
_allocator_ready = False


def _ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need a little global scratch per program."""
    global _allocator_ready
    if not _allocator_ready:
        def alloc(size: int, alignment: int, stream):
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            return torch.empty(size, device=dev, dtype=torch.int8)

        triton.set_allocator(alloc)
        _allocator_ready = True


def _scale_mode(s: torch.Tensor | None) -> int:
    if s is None:
        return 0
    return 1 if s.numel() == 1 else 2


def _epilogue_args(a, scale_a, scale_b, bias, res2, activation):
    """Keyword arguments every kernel's epilogue takes (dummies where switched off)."""
    return dict(
        sa_ptr=scale_a if scale_a is not None else a,
        sb_ptr=scale_b if scale_b is not None else a,
        bias_ptr=bias if bias is not None else a,
        stride_bias=bias.stride(0) if bias is not None else 0,
        res_ptr=res2 if res2 is not None else a,
        stride_rm=res2.stride(-2) if res2 is not None else 0,
        stride_rn=res2.stride(-1) if res2 is not None else 0,
        SCALE_A=_scale_mode(scale_a), SCALE_B=_scale_mode(scale_b), HAS_BIAS=bias is not None,
        ACT=activation or "", HAS_RES=res2 is not None,
    )


def _launch_kwargs(config: dict | None) -> dict:
    """An explicit config (benchmarks, tests) as launch keyword arguments."""
    return dict(config) if config else {}


def _launch_ptr(a3, b3, out3, res3, epi, ieee, config=None):
    """Batched pointer kernel on 3-D views (B, M, K) @ (B, K, N) -> (B, M, N)."""
    B, M, K = a3.shape
    N = b3.shape[2]
    int64 = C.needs_int64(a3, b3, out3, res3)
    if res3 is not None:
        epi = dict(epi, res_ptr=res3)
    stride_rb = res3.stride(0) if res3 is not None else 0
    if config is None and not AUTOTUNE:
        config = ptr_config(M, N, K, a3.element_size())
    kernel = _matmul_kernel if config else _matmul_autotuned
    grid = lambda meta: (C.cdiv(M, meta["BLOCK_M"]) * C.cdiv(N, meta["BLOCK_N"]), B)
    C.launch(kernel, grid, a_ptr=a3, b_ptr=b3, c_ptr=out3, M=M, N=N, K=K,
             stride_ab=a3.stride(0), stride_am=a3.stride(1), stride_ak=a3.stride(2),
             stride_bb=b3.stride(0), stride_bk=b3.stride(1), stride_bn=b3.stride(2),
             stride_cb=out3.stride(0), stride_cm=out3.stride(1), stride_cn=out3.stride(2),
             stride_rb=stride_rb, **epi, IEEE=ieee, INT64=int64, **_launch_kwargs(config))


def _launch_tma(a, b, out, epi, ieee, num_sms, config=None):
    _, a_trans = _tma_ok(a)
    _, b_trans = _tma_ok(b)
    M, K = a.shape
    N = b.shape[1]
    _ensure_tma_allocator()
    if config is None and not AUTOTUNE:
        config = tma_config(M, N, K, a.element_size(), num_sms)
    kernel = _matmul_tma_kernel if config else _matmul_tma_autotuned

    def grid(meta):
        tiles = C.cdiv(M, meta["BLOCK_M"]) * C.cdiv(N, meta["BLOCK_N"])
        return (max(1, min(num_sms, tiles)),)

    res = epi["res_ptr"] if epi["HAS_RES"] else None
    if RESIDUAL_TMA and res is not None and res.dim() == 2 and tuple(res.shape) == (M, N) \
            and res.stride(0) > 0 and res.element_size() <= 2 and _tma_ok(res) == (True, False):
        # a row-major 16-bit residual is read by TMA (see the kernel's RES_TMA); its staging
        # buffer is 32 KB at 128x256 tiles (a float32 one, 64 KB, would not fit next to the
        # pipeline stages). Its row stride is the one _tma_ok checked: a single row's own
        # stride(0) may be anything, and a descriptor stride must be a multiple of 16 bytes.
        epi = dict(epi, HAS_RES=False, RES_TMA=True, stride_rm=_lead_stride(res, False))

    C.launch(kernel, grid, a_ptr=a, b_ptr=b, c_ptr=out, M=M, N=N, K=K,
             stride_a=_lead_stride(a, a_trans), stride_b=_lead_stride(b, b_trans),
             stride_cm=out.stride(0), A_TRANS=a_trans, B_TRANS=b_trans, **epi, IEEE=ieee,
             NUM_SMS=num_sms, **_launch_kwargs(config))


_COUNTERS: dict = {}


def _splitk_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-tile arrival counters of the one-launch split-K (config ``FUSED_REDUCE=True``, opt-in
    for now), zeroed once and left at zero by every launch, so calls need no memset. One buffer
    per device: two such launches running concurrently on different streams would share it,
    which is why it is not the default yet (and why the buffer must exist before a CUDA graph
    capture: the first call is eager)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n or device.type == "meta":
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        if device.type != "meta":
            _COUNTERS[key] = buf
    return buf


def _launch_splitk(a, b, out, epi, ieee, cfg):
    M, K = a.shape
    N = b.shape[1]
    split = cfg["SPLIT_K"]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if split == 1:  # nothing to reduce: the pointer kernel with this tile, epilogue included
        tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=1,
                    num_warps=cfg["num_warps"], num_stages=cfg["NUM_STAGES"])
        r3 = epi["res_ptr"].unsqueeze(0) if epi["HAS_RES"] else None
        _launch_ptr(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), r3, epi, ieee, tile)
        return
    # partials are float32 and fully overwritten: a plain allocation, never poisoned
    ws = C.scratch((split, M, N), torch.float32, a.device)
    if cfg.get("FUSED_REDUCE"):
        grid = (C.cdiv(N, bn), C.cdiv(M, bm), split)
        C.launch(_matmul_splitk_fused_kernel, grid, a_ptr=a, b_ptr=b, ws_ptr=ws,
                 cnt_ptr=_splitk_counters(a.device, grid[0] * grid[1]), c_ptr=out,
                 M=M, N=N, K=K, stride_am=a.stride(0), stride_ak=a.stride(1),
                 stride_bk=b.stride(0), stride_bn=b.stride(1), stride_cm=out.stride(0),
                 stride_cn=out.stride(1), **epi, IEEE=ieee, SPLIT_K=split,
                 NUM_STAGES=cfg["NUM_STAGES"], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"],
                 num_warps=cfg["num_warps"])
        return
    C.launch(_matmul_splitk_kernel, (C.cdiv(N, bn), C.cdiv(M, bm), split),
             a_ptr=a, b_ptr=b, ws_ptr=ws, M=M, N=N, K=K,
             stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_bk=b.stride(0), stride_bn=b.stride(1),
             IEEE=ieee, SPLIT_K=split, NUM_STAGES=cfg["NUM_STAGES"], BLOCK_M=bm, BLOCK_N=bn,
             BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])
    rbn = 128 if N >= 128 else max(16, C.next_power_of_2(N))
    C.launch(_splitk_reduce_kernel, (C.cdiv(N, rbn), C.cdiv(M, bm)),
             ws_ptr=ws, c_ptr=out, M=M, N=N, stride_cm=out.stride(0), stride_cn=out.stride(1),
             **epi, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=rbn, num_warps=4)


def _run_2d(a, b, out, res, scale_a, scale_b, bias, activation, ieee, p: MatmulPlan,
            config=None):
    epi = _epilogue_args(a, scale_a, scale_b, bias, res, activation)
    if p.path == "empty":
        return
    if p.path == "tma":
        _launch_tma(a, b, out, epi, ieee, _arch(a.device)[1], config)
    elif p.path == "splitk":
        _launch_splitk(a, b, out, epi, ieee, dict(p.config, **(config or {})))
    elif p.path == "ptr":
        r3 = res.unsqueeze(0) if res is not None else None
        _launch_ptr(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), r3, epi, ieee, config)
    else:
        raise ValueError(f"unknown matmul path {p.path!r}")


def _try_view(t: torch.Tensor, *shape: int) -> torch.Tensor | None:
    try:
        return t.view(*shape)
    except RuntimeError:
        return None


def _matmul_into(a, b, out, res, scale_a, scale_b, bias, activation, ieee, path, config):
    """a (..., M, K) @ b (..., K, N) into out (batch..., M, N); shapes already broadcast."""
    batch = tuple(out.shape[:-2])
    M, K = a.shape[-2:]
    N = b.shape[-1]
    ae, be = a.expand(*batch, M, K), b.expand(*batch, K, N)
    re = res.expand(out.shape) if res is not None else None
    if not batch:
        _run_2d(ae, be, out, re, scale_a, scale_b, bias, activation, ieee,
                plan(ae, be, out.dtype, path=path), config)
        return
    b_shared = all(st == 0 or sz == 1 for st, sz in zip(be.stride()[:-2], batch))
    a2 = _try_view(ae, -1, K) if b_shared else None
    if a2 is not None:
        # one weight for every batch: fold the batch into M (the nn.Linear case)
        b2 = be[(0,) * len(batch)]
        out2 = out.view(-1, N)
        r2 = None
        if re is not None:
            r2 = _try_view(re, -1, N)
            if r2 is None:  # an unusual residual layout: one copy, counted against nothing else
                r2 = re.reshape(-1, N)
        _run_2d(a2, b2, out2, r2, scale_a, scale_b, bias, activation, ieee,
                plan(a2, b2, out.dtype, path=path), config)
        return
    a3, b3 = _try_view(ae, -1, M, K), _try_view(be, -1, K, N)
    r3 = _try_view(re, -1, M, N) if re is not None else None
    if a3 is None or b3 is None or (re is not None and r3 is None):
        # batch dims that do not merge into one stride: one launch per leading index
        for i in range(batch[0]):
            _matmul_into(ae[i], be[i], out[i], re[i] if re is not None else None, scale_a,
                         scale_b, bias, activation, ieee, path, config)
        return
    if a3.shape[0] == 1 or path in ("tma", "splitk"):
        for i in range(a3.shape[0]):
            _run_2d(a3[i], b3[i], out.view(-1, M, N)[i], r3[i] if r3 is not None else None,
                    scale_a, scale_b, bias, activation, ieee,
                    plan(a3[i], b3[i], out.dtype, path=path), config)
        return
    epi = _epilogue_args(a3, scale_a, scale_b, bias, r3, activation)
    _launch_ptr(a3, b3, out.view(-1, M, N), r3, epi, ieee, config)


def _matmul_impl(a, b, bias=None, residual=None, scale_a=None, scale_b=None, activation=None,
                 out_dtype=None, allow_tf32=True, backend="auto", path=None, config=None):
    out_dtype = out_dtype or _default_out_dtype(a.dtype)
    batch = C.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, N = a.shape[-2], b.shape[-1]
    out = C.empty((*batch, M, N), out_dtype, a.device)
    if out.numel() == 0:
        return out
    if backend == "cuda":
        return _cuda_matmul(a, b, out, bias, residual, scale_a, scale_b, activation)
    ieee = a.dtype == torch.float32 and not allow_tf32
    _matmul_into(a, b, out, residual, scale_a, scale_b, bias, activation, ieee, path, config)
    return out


def _cuda_matmul(a, b, out, bias, residual, scale_a, scale_b, activation):
    """backend="cuda": the CUDA escape hatch of tkit.cuda_ext, epilogue applied unfused."""
    try:
        from tkit import cuda_ext
        call = getattr(cuda_ext, "matmul", None)
        if call is None:
            dispatch = cuda_ext.dispatch
            call = functools.partial(dispatch, "matmul")
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            "backend='cuda' needs tkit.cuda_ext.matmul(a, b) (or dispatch('matmul', a, b)), "
            f"which is not available here ({e}); use backend='triton' or 'auto'"
        ) from None
    if scale_a is not None or scale_b is not None:
        raise NotImplementedError("backend='cuda' does not take fp8 scales; use 'triton'")
    # tkit.cuda_ext raises its own CudaPathUnavailable, naming the reason, when it cannot run
    y = call(a, b).float()
    if bias is not None:
        y = y + bias.float()
    if activation:
        y = _torch_activation(y, activation)
    if residual is not None:
        y = y + residual.float()
    out.copy_(y)
    return out


def _torch_activation(x: torch.Tensor, act: str | None) -> torch.Tensor:
    if not act:
        return x
    if act == "silu":
        return torch.nn.functional.silu(x)
    if act in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")
    return torch.relu(x)


def _grouped_impl(a, b, offsets, out_dtype=None, config=None, allow_tf32=True):
    T, K = a.shape
    G, _, N = b.shape
    out = C.empty((T, N), out_dtype or a.dtype, a.device)
    if out.numel() == 0 or G == 0:
        if out.numel() and G == 0:
            out.zero_()
        return out
    cfg = dict(config or _grouped_config(T, N, G, a.device))
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    offsets = offsets.contiguous()  # read densely by the kernel
    # one tile more per group than cdiv(T, bm), and one each for the rows before the first
    # group and after the last (zeros; see the kernel)
    grid = (C.cdiv(T, bm) + G + 2, C.cdiv(N, bn))
    C.launch(_grouped_matmul_kernel, grid, a_ptr=a, b_ptr=b, c_ptr=out, off_ptr=offsets,
             T=T, G=G, N=N, K=K, stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_bg=b.stride(0), stride_bk=b.stride(1), stride_bn=b.stride(2),
             stride_cm=out.stride(0), stride_cn=out.stride(1),
             IEEE=a.dtype == torch.float32 and not allow_tf32,
             INT64=C.needs_int64(a, b, out), **cfg)
    return out


def _grouped_wgrad_impl(a, grad, offsets, G, b_dtype, allow_tf32=True):
    T, K = a.shape
    N = grad.shape[1]
    db = torch.empty((G, K, N), dtype=torch.float32, device=a.device)
    if db.numel() == 0:
        return db.to(b_dtype)
    cfg = (dict(BLOCK_K=32, BLOCK_N=64, BLOCK_R=32, num_warps=4) if a.device.type == "cpu"
           else dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=3))
    grid = (G, C.cdiv(K, cfg["BLOCK_K"]) * C.cdiv(N, cfg["BLOCK_N"]))
    offsets = offsets.contiguous()
    C.launch(_grouped_wgrad_kernel, grid, a_ptr=a, g_ptr=grad, db_ptr=db, off_ptr=offsets,
             T=T, G=G, K=K, N=N, stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_gm=grad.stride(0), stride_gn=grad.stride(1), stride_dg=db.stride(0),
             stride_dk=db.stride(1), stride_dn=db.stride(2),
             IEEE=a.dtype == torch.float32 and not allow_tf32,
             INT64=C.needs_int64(a, grad, db), G_BLOCK=C.next_power_of_2(G + 1), **cfg)
    return db.to(b_dtype)


def _grouped_config(T, N, G, device) -> dict:
    if device.type == "cpu":
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4)
    # MoE groups hold T*topk/G rows each, often a few hundred: 64-row tiles waste less at the
    # group edges than 128-row ones
    avg = T // max(G, 1)
    bm = 64 if avg <= 512 else 128
    return dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=64, num_warps=4 if bm == 64 else 8,
                num_stages=4)


# --------------------------------------------------------------------------------------------
# torch.library registration (custom op + fake + autograd)
# --------------------------------------------------------------------------------------------
def _out_shape(a, b):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (*batch, a.shape[-2], b.shape[-1])


@torch.library.custom_op("tkit::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
               residual: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],  # noqa: UP045
               scale_b: Optional[torch.Tensor], activation: str,  # noqa: UP045
               out_dtype: Optional[torch.dtype], allow_tf32: bool,  # noqa: UP045
               backend: str) -> torch.Tensor:
    return _matmul_impl(a, b, bias, residual, scale_a, scale_b, activation or None, out_dtype,
                        allow_tf32, backend)


@_matmul_op.register_fake
def _(a, b, bias, residual, scale_a, scale_b, activation, out_dtype, allow_tf32, backend):
    return a.new_empty(_out_shape(a, b), dtype=out_dtype or _default_out_dtype(a.dtype))


def _matmul_setup(ctx, inputs, output):
    a, b, bias, residual, scale_a, scale_b, activation, out_dtype, allow_tf32, backend = inputs
    ctx.activation = activation
    ctx.allow_tf32 = allow_tf32
    ctx.res_meta = (tuple(residual.shape), residual.dtype) if residual is not None else None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(a, b, bias, scale_a, scale_b)


def _matmul_backward(ctx, grad):
    """out = act(s * a@b + bias) + residual: the GEMMs of the backward run through tkit too
    (transposed operands are views, so no copies); the pre-activation is recomputed."""
    a, b, bias, scale_a, scale_b = ctx.saved_tensors
    if scale_a is not None or scale_b is not None:
        raise NotImplementedError("tkit.matmul with fp8 scales has no backward")
    g = grad
    if ctx.activation:
        pre = _matmul_op(a, b, bias, None, None, None, "", torch.float32, ctx.allow_tf32, "auto")
        g = _activation_grad(grad, pre, ctx.activation)
    ga = _matmul_op(g.to(a.dtype), b.mT, None, None, None, None, "", torch.float32,
                    ctx.allow_tf32, "auto")
    gb = _matmul_op(a.mT, g.to(b.dtype), None, None, None, None, "", torch.float32,
                    ctx.allow_tf32, "auto")
    ga = _sum_to(ga, a.shape, a.dtype)
    gb = _sum_to(gb, b.shape, b.dtype)
    gbias = None
    if bias is not None:
        gbias = g.float().reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype)
    gres = _sum_to(grad, *ctx.res_meta) if ctx.res_meta is not None else None
    return ga, gb, gbias, gres, None, None, None, None, None, None


_matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup)


@torch.library.custom_op("tkit::grouped_matmul", mutates_args=())
def _grouped_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                out_dtype: Optional[torch.dtype],  # noqa: UP045
                allow_tf32: bool = True) -> torch.Tensor:
    return _grouped_impl(a, b, offsets, out_dtype, allow_tf32=allow_tf32)


@_grouped_op.register_fake
def _(a, b, offsets, out_dtype, allow_tf32=True):
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)


def _grouped_setup(ctx, inputs, output):
    a, b, offsets, out_dtype, *rest = inputs
    ctx.allow_tf32 = rest[0] if rest else True
    ctx.save_for_backward(a, b, offsets)


def _grouped_backward(ctx, grad):
    """d a = grouped(grad, b^T) (one launch, b^T a strided view); d b[g] = a_g^T grad_g."""
    a, b, offsets = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = _grouped_op(grad.to(a.dtype), b.transpose(1, 2), offsets, a.dtype, ctx.allow_tf32)
    if ctx.needs_input_grad[1]:
        gb = _grouped_wgrad_op(a, grad.to(a.dtype), offsets, b.shape[0], b.dtype,
                               ctx.allow_tf32)
    return ga, gb, None, None, None


@torch.library.custom_op("tkit::grouped_matmul_wgrad", mutates_args=())
def _grouped_wgrad_op(a: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, G: int,
                      b_dtype: torch.dtype, allow_tf32: bool = True) -> torch.Tensor:
    return _grouped_wgrad_impl(a, grad, offsets, G, b_dtype, allow_tf32)


@_grouped_wgrad_op.register_fake
def _(a, grad, offsets, G, b_dtype, allow_tf32=True):
    return a.new_empty((G, a.shape[1], grad.shape[1]), dtype=b_dtype)


_grouped_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _check_out_dtype(out_dtype):
    if out_dtype is not None and out_dtype not in C.FLOAT_DTYPES:
        names = ", ".join(C.dtype_name(d) for d in C.FLOAT_DTYPES)
        raise TypeError(f"out_dtype {out_dtype} is not supported; supported: {names}")


def _check_operands(a, b, dtypes):
    C.check_tensor(a, "a", dtypes, min_ndim=2)
    C.check_tensor(b, "b", dtypes, min_ndim=2)
    C.check_same_device(a=a, b=b)
    if a.dtype != b.dtype:
        raise TypeError(f"b has dtype {C.dtype_name(b.dtype)} but a has "
                        f"{C.dtype_name(a.dtype)}; cast one of them")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)} cannot "
                         f"be multiplied: a.shape[-1]={a.shape[-1]} != b.shape[-2]="
                         f"{b.shape[-2]}")
    try:
        return (*C.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    except ValueError:
        raise ValueError(f"the batch dimensions of a {tuple(a.shape[:-2])} and b "
                         f"{tuple(b.shape[:-2])} do not broadcast") from None


def _check_epilogue(out_shape, device, bias, activation, residual):
    if bias is not None:
        C.check_tensor(bias, "bias", ndim=1)
        if bias.device != device:
            raise ValueError(f"bias is on {bias.device} but a is on {device}")
        if bias.shape[0] != out_shape[-1]:
            raise ValueError(f"bias must have shape ({out_shape[-1]},) (N), got "
                             f"{tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if residual is not None:
        C.check_tensor(residual, "residual")
        if residual.device != device:
            raise ValueError(f"residual is on {residual.device} but a is on {device}")
        try:
            ok = torch.broadcast_shapes(residual.shape, out_shape) == torch.Size(out_shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"residual of shape {tuple(residual.shape)} does not broadcast to "
                             f"the output shape {tuple(out_shape)}")


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, *, allow_tf32: bool = True,
           backend: str = "auto") -> torch.Tensor:
    """``act(a @ b + bias) + residual`` in one kernel, rounded once to ``out_dtype``.

    Parameters
    ----------
    a : Tensor
        (..., M, K), float32, float16 or bfloat16, any strides (row- or column-major, no copy).
    b : Tensor
        (..., K, N), same dtype; leading dims broadcast with a's. An nn.Linear weight ``w``
        (N, K) is passed as ``w.t()`` (a column-major view; no copy).
    bias : Tensor, optional
        (N,), added before the activation.
    activation : {None, "silu", "gelu", "gelu_tanh", "relu"}
    residual : Tensor, optional
        Broadcasts to the output; added after the activation.
    out_dtype : torch.dtype, optional
        Default: a's dtype.
    allow_tf32 : bool
        float32 inputs on tf32 tensor cores (default) or in full float32 (``False``).
    backend : {"auto", "triton", "cuda"}
        "auto" is the Triton kernel for now; "cuda" calls ``tkit.cuda_ext.dispatch("matmul",
        a, b)`` and applies the epilogue with separate torch ops.

    Returns
    -------
    Tensor
        (broadcast batch..., M, N), contiguous. :func:`plan` says which kernel runs.
    """
    if (P.ON and type(a) is _T and (type(b) is _T or type(b) is _Param) and bias is None
            and residual is None and backend == "auto" and not _compiling()
            and not (_grad_enabled() and (a.requires_grad or b.requires_grad))):
        # the eager plan (tkit.kernels._plan): the key holds all the ordinary path reads
        dev, stream = L._device_stream()
        key = (activation, out_dtype, allow_tf32, dev,
               a.shape, a.stride(), a.dtype, a.get_device(), not a.data_ptr() & 15,
               b.shape, b.stride(), b.dtype, b.get_device(), not b.data_ptr() & 15)
        try:
            p = _plans.get(key)
        except TypeError:  # an unhashable option: the ordinary path names it
            p = False
        if p:
            out = p(stream, a, b)
            if out is not None:
                return out
        elif p is None:
            P.stats["plan_miss"] += 1
            with P.recording() as rec:
                out = _matmul_slow(a, b, None, activation, None, out_dtype, allow_tf32,
                                   backend)
            P.store(_plans, key, rec, (a, b), (out,))
            return out
    return _matmul_slow(a, b, bias, activation, residual, out_dtype, allow_tf32, backend)


_T = torch.Tensor
_Param = torch.nn.Parameter
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()


def _matmul_slow(a, b, bias, activation, residual, out_dtype, allow_tf32, backend):
    direct = C.use_direct_path(a, b, bias, residual)
    cacheable = direct and backend in ("auto", "triton") and a.ndim == 2 and b.ndim == 2
    if cacheable:
        # eager 2-D calls: validation and planning once per call signature (a decode step
        # repeats the same few signatures; the kernels there last ~30 us, about what this
        # Python costs)
        key = _signature(a, b, bias, residual, activation, out_dtype, allow_tf32)
        hit = _FAST.get(key)
        if hit is not None:
            return _run_fast(a, b, bias, residual, activation, *hit)
    out_shape = _check_operands(a, b, C.FLOAT_DTYPES)
    _check_out_dtype(out_dtype)
    _check_epilogue(out_shape, a.device, bias, activation, residual)
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'cuda', got {backend!r}")
    if cacheable:
        od = out_dtype or _default_out_dtype(a.dtype)
        p = plan(a, b, od)
        ieee = a.dtype == torch.float32 and not allow_tf32
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST[key] = (od, ieee, p)
        return _run_fast(a, b, bias, residual, activation, od, ieee, p)
    if direct:
        return _matmul_impl(a, b, bias, residual, None, None, activation, out_dtype, allow_tf32,
                            backend)
    return _matmul_op(a, b, bias, residual, None, None, activation or "", out_dtype, allow_tf32,
                      backend)


#: call signature -> (out_dtype, ieee, plan) of eager 2-D matmul calls already validated
_FAST: dict = {}
_FAST_MAX = 4096


def _desc(t: torch.Tensor | None):
    """What validation and planning depend on, for one tensor: shape, strides, dtype, device
    and 16-byte alignment (TMA eligibility and Triton's pointer specialization)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _signature(a, b, bias, residual, activation, out_dtype, allow_tf32):
    return (_desc(a), _desc(b), _desc(bias), _desc(residual), activation, out_dtype,
            allow_tf32)


def _run_fast(a, b, bias, residual, activation, out_dtype, ieee, p):
    out = C.empty((a.shape[0], b.shape[1]), out_dtype, a.device)
    if out.numel() == 0:
        return out
    if residual is not None and residual.shape != out.shape:
        residual = residual.expand(out.shape)
    _run_2d(a, b, out, residual, None, None, bias, activation, ieee, p)
    return out


def _check_scale(s, name, n, what):
    C.check_tensor(s, name, (torch.float32,))
    if s.numel() == 1:
        return s.reshape(1)
    if s.numel() != n or (s.ndim == 2 and s.shape not in ((n, 1), (1, n))) or s.ndim > 2:
        raise ValueError(f"{name} must hold 1 element (per-tensor) or {n} ({what}), got shape "
                         f"{tuple(s.shape)}")
    return s.reshape(n)


def matmul_fp8(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, *, bias: torch.Tensor | None = None,
               activation: str | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """``(scale_a * scale_b * (a @ b))`` for float8_e4m3fn operands, float32 accumulation.

    Parameters
    ----------
    a : Tensor
        (M, K) float8_e4m3fn.
    b : Tensor
        (K, N) float8_e4m3fn; column-major (``w.t()`` of an (N, K) weight) is the fast layout on
        Hopper, as for ``torch._scaled_mm``.
    scale_a, scale_b : Tensor
        float32 dequantization scales: one element (per-tensor), or M (per-row of a,
        shape (M,) or (M, 1)) / N (per-column of b, shape (N,) or (1, N)); or block scales
        (DeepSeek-V3): scale_a (M, ceil(K / 128)) per 1x128 group of a row of a and scale_b
        (ceil(K / 128), ceil(N / 128)) per 128x128 block of b, applied to each 128-deep K
        step's MMA sum inside the K loop (tkit/kernels/matmul/fp8_block.py).
    out_dtype : torch.dtype
        bfloat16 (default), float16 or float32.
    bias, activation, residual
        The epilogue of :func:`matmul`, applied after the scales.
    """
    C.check_tensor(a, "a", C.FP8_DTYPES, ndim=2)
    C.check_tensor(b, "b", C.FP8_DTYPES, ndim=2)
    out_shape = _check_operands(a, b, C.FP8_DTYPES)
    _check_out_dtype(out_dtype)
    _check_epilogue(out_shape, a.device, bias, activation, residual)
    from tkit.kernels.matmul import fp8_block as _block

    if _block.is_block_scaled(a, b, scale_a, scale_b):
        return _block.matmul_fp8_block(a, b, scale_a, scale_b, out_dtype, bias, activation,
                                       residual)
    scale_a = _check_scale(scale_a, "scale_a", a.shape[0], "per row of a")
    scale_b = _check_scale(scale_b, "scale_b", b.shape[1], "per column of b")
    C.check_same_device(a=a, scale_a=scale_a, scale_b=scale_b)
    if C.use_direct_path(a, b, bias, residual):
        return _matmul_impl(a, b, bias, residual, scale_a, scale_b, activation, out_dtype)
    return _matmul_op(a, b, bias, residual, scale_a, scale_b, activation or "", out_dtype, True,
                      "auto")


def grouped_matmul(a, b, offsets: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, *, allow_tf32: bool = True):
    """Many GEMMs in one launch: ``a[offsets[g]:offsets[g+1]] @ b[g]`` for every group g.

    Parameters
    ----------
    a : Tensor or list of Tensor
        (T, K): the rows of all groups back to back (the MoE layout, tokens sorted by expert);
        or a list of (M_g, K) tensors.
    b : Tensor or list of Tensor
        (G, K, N), any strides (an expert weight stack of shape (G, N, K) is passed as
        ``w.transpose(1, 2)``); or a list of G (K, N) tensors.
    offsets : Tensor
        (G + 1,) int32 or int64 on a's device, non-decreasing, offsets[0] = 0 and
        offsets[G] = T. Read on the device only (no host sync). Omitted for list inputs.
        Checked before the launch when on the host (always so in the interpreter), and on the
        device under ``TKIT_CHECK=1``. Unchecked invalid offsets cannot make the kernel touch
        memory outside a, b or the output: group g takes rows [bound(g), bound(g+1)) where
        bound(j) is the largest of offsets[:j+1] clamped to [0, T], and rows in no group are
        zeros.
    out_dtype : torch.dtype, optional
    allow_tf32 : bool
        float32 inputs on tf32 tensor cores (default) or in full float32 (``False``), as in
        :func:`matmul`, for the forward and both gradients. torch's own float32 matmul is full
        float32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set: pass ``False`` to
        compare with it (tf32 keeps 10 mantissa bits of each operand: errors near 1e-3).

    Returns
    -------
    Tensor (T, N), or a list of (M_g, N) views of one output for list inputs. The list form
    concatenates its inputs first (one copy of a and b); pass the packed form to avoid it.
    Differentiable: the input gradient is one more grouped launch, the weight gradient a
    per-group reduction over rows (deterministic).
    """
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            raise ValueError("a and b must be lists of the same length for the list form")
        if offsets is not None:
            raise ValueError("offsets is computed from the list form; do not pass it")
        if not a:
            return []
        for i, (x, w) in enumerate(zip(a, b)):
            C.check_tensor(x, f"a[{i}]", ndim=2)
            C.check_tensor(w, f"b[{i}]", ndim=2)
            if x.shape[1] != w.shape[0] or w.shape != b[0].shape or x.dtype != a[0].dtype \
                    or w.dtype != a[0].dtype:
                raise ValueError(f"group {i}: a[{i}] {tuple(x.shape)} @ b[{i}] {tuple(w.shape)} "
                                 "must match group 0's K, N and dtype")
        sizes = [x.shape[0] for x in a]
        offs = [0]
        for s in sizes:
            offs.append(offs[-1] + s)
        packed = grouped_matmul(torch.cat(list(a)), torch.stack(list(b)),
                                torch.tensor(offs, dtype=torch.int32).to(a[0].device), out_dtype,
                                allow_tf32=allow_tf32)
        return list(packed.split(sizes))
    C.check_tensor(a, "a", ndim=2)
    C.check_tensor(b, "b", ndim=3)
    C.check_tensor(offsets, "offsets", (torch.int32, torch.int64), ndim=1)
    C.check_same_device(a=a, b=b, offsets=offsets)
    if a.dtype != b.dtype:
        raise TypeError(f"b has dtype {C.dtype_name(b.dtype)} but a has {C.dtype_name(a.dtype)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)}: "
                         "a.shape[1] must equal b.shape[1] (K)")
    if offsets.shape[0] != b.shape[0] + 1:
        raise ValueError(f"offsets must have G + 1 = {b.shape[0] + 1} entries, got "
                         f"{offsets.shape[0]}")
    _check_out_dtype(out_dtype)
    if _offsets.values_checked(offsets):
        _offsets.check_values(offsets, "offsets", a.shape[0], "a.shape[0]")
    if C.use_direct_path(a, b):
        return _grouped_impl(a, b, offsets, out_dtype, allow_tf32=allow_tf32)
    return _grouped_op(a, b, offsets, out_dtype, allow_tf32)


def cost(a: torch.Tensor, b: torch.Tensor, *args, out_dtype=None, **kwargs):
    """(bytes, FLOPs) of ``a @ b``: every operand read once, the output written once."""
    from tkit.registry import Cost, unique_bytes

    shape = _out_shape(a, b)
    out_es = (out_dtype or _default_out_dtype(a.dtype)).itemsize
    n = 1
    for s in shape:
        n *= s
    flops = 2.0 * n * a.shape[-1]
    return Cost(unique_bytes(a) + unique_bytes(b) + n * out_es, flops)
