"""FlashAttention forward and backward in Triton, with the variants LLMs use.

Math, per batch b and query head h (key/value head ``h // group`` for GQA/MQA):

    S = scale * Q K^T                        (seqlen_q x seqlen_k), scale = 1/sqrt(head_dim)
    S = cap * tanh(S / cap)                  with softcap = cap > 0
    S[i, j] = -inf   unless key j is visible from query i (below)
    P = softmax(S, dim=-1),  O = P V,  lse[i] = logsumexp(S[i, :])

Visibility: keys and queries are aligned to the bottom-right corner, ``shift = seqlen_k -
seqlen_q`` (flash-attn's convention). Key j is visible from query i when
``i + shift - left <= j <= i + shift + right``, where ``window_size = (left, right)`` and -1
means unbounded; ``causal`` is ``right = 0``. A row with no visible key gives O = 0 and
lse = -inf (never NaN).

The forward never materialises S: it walks key blocks with the online softmax (running row max m,
running sum l, rescaling the accumulator by exp(m_old - m_new)), in base 2 with log2(e) folded
into the scale so that each score costs one FMA and one exp2. Key blocks are split in three
ranges per query block: blocks partly visible before the fully visible ones (window's left edge),
the fully visible blocks (no mask arithmetic at all), and blocks partly visible after them (the
causal diagonal, the window's right edge, the ragged end of the keys).

Backward (FlashAttention-2): ``delta[i] = rowsum(dO * O)`` (minus dlse when the lse is used
downstream), then one kernel per key block that recomputes P^T block by block and accumulates
dK and dV, looping over every query head of its GQA group (so dK/dV are reduced over the group
in-kernel, no atomics), and one kernel per query block that accumulates dQ. Both are
deterministic.

Cost model (B batch, H query heads, D head dim): the matmuls are 4*B*H*Sq*Sk*D FLOPs forward
(half that when causal), and the backward does 2.5x the forward's FLOPs (five matmuls instead of
two). HBM traffic is Q, K, V read and O written once, plus K and V re-read once per query block:
about (2*Sq + 2*Sk*ceil(Sq/BLOCK_M)) * B*H*D*itemsize bytes; at S=4096, D=128 and BLOCK_M=128
the intensity is ~ 2*BLOCK_M = 256 FLOP/byte, over the H200's ~170 FLOP/byte balance point:
compute-bound, the ceiling is the tensor cores (cuBLAS bf16 GEMM: 720 TFLOP/s).

Grid: (batch * heads, query blocks) for the forward and dQ, (batch * kv heads, key blocks) for
dK/dV. With a causal mask the forward and dQ run their query blocks last-first, so the longest
key ranges start in the first wave and the short ones fill the tail. The forward walks its tiles
in sections of ``fwd_head_group`` (batch, head) pairs whose K and V fit an 8 MB share of L2
(FlashAttention-3's scheduler does the same with 32 MB). Why: each program streams all of its
head's K/V (2 MB at S=4096, D=128, bf16); in the plain order every head of a query block is in
flight at once (64 heads, 128 MB at the benchmark shape, over the 60 MB L2), so few programs
share a head's K/V while it is in L2. Measured on the H200 (3 interleaved rounds): sections of
4 heads ran 5-16% faster than the plain order, and at least as fast as 16 (see
``_L2_KV_BUDGET``).

Layout: (batch, seqlen, heads, head_dim) with arbitrary strides (q, k, v may be views of one
packed qkv tensor); varlen tensors are (total_tokens, heads, head_dim) with ``cu_seqlens``.
Head dims up to 256; a non-power-of-2 head dim is padded in-kernel to BLOCK_D with masks. Batch,
head and sequence start offsets are 64-bit; offsets inside one (batch, head) stay 32-bit (a
sequence whose elements span 2**31 is refused before the launch). Varlen ``cu_seqlens`` are
clamped in-kernel (see :func:`_varlen_span`), so no value of them reaches outside a tensor.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit.kernels import _common as C
from tkit.kernels import _launch as L
from tkit.kernels import _offsets
from tkit.kernels import _plan as P
from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels._numerics import interpreter_operand as _interpreter_operand

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------
def _smem_limit() -> int:
    try:
        dev = torch.cuda.current_device()
        props = triton.runtime.driver.active.utils.get_device_properties(dev)
        return int(props["max_shared_mem"])
    except Exception:  # no GPU: nothing to prune against
        return 1 << 30


def _env_interpret() -> bool:
    return C._env.INTERPRET


def _fwd_smem(cfg, block_d: int, itemsize: int) -> int:
    # Q tile resident, K and V tiles multi-buffered over num_stages
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    return (bm * block_d + cfg.num_stages * 2 * bn * block_d) * itemsize


def _bwd_smem(kind: str):
    # the dK/dV kernel keeps K, V resident and streams Q, dO over num_stages; the dQ kernel keeps
    # Q, dO resident and streams K, V; both stage a BLOCK_M x BLOCK_N tile for the dots (these
    # estimates match the compiler's figures for sm_90 within ~20%, on the high side)
    def smem(cfg, block_d: int, itemsize: int) -> int:
        bm, bn, s = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_stages
        if kind == "dkdv":
            tiles = 2 * bn * block_d + s * 2 * bm * block_d
        else:
            tiles = 2 * bm * block_d + s * 2 * bn * block_d
        return (tiles + bm * bn) * itemsize

    return smem


def _prune(smem_fn, tma=None):
    """The autotuner's early pruner: configs whose shared memory fits and, where K/V cannot be
    read through TMA, no TMA configs (``tma`` given: that answer, and ``itemsize`` may stand
    in for Q)."""
    def prune(configs, named_args, **kwargs):
        # the autotuner passes the positional arguments as ``named_args`` and the keyword ones
        # as ``kwargs``; tkit launches with keywords only, so look in both
        args = {**named_args, **kwargs}
        block_d = args["BLOCK_D"]
        itemsize = args["itemsize"] if "itemsize" in args else args["Q"].element_size()
        limit = _smem_limit()
        use_tma = (tma if tma is not None else tma_ok(args["K"], args["V"])) \
            and not _env_interpret()
        padded = args.get("HEAD_DIM", block_d) != block_d
        kept = [c for c in configs if smem_fn(c, block_d, itemsize) <= limit
                and (use_tma or not c.kwargs.get("USE_TMA", False))
                and not (padded and _faults_when_padded(c))]
        if kept:
            return kept
        # never prune everything: fall back to a small tile
        extra = {k: False for k in ("USE_TMA", "WARP_SPEC") if k in configs[0].kwargs}
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, **extra}, num_stages=2,
                              num_warps=4)]

    return prune


def _faults_when_padded(c) -> bool:
    """128x64 two-stage pointer-load forward at a padded head dim: on the H200 (Triton 3.6,
    2026-11-30) D=192 (BLOCK_D=256) causal stopped with "CUDA error: misaligned address", a
    sticky error that fails everything after it in the process (non-causal passed; D=256 and
    D=128 ran in every sweep). Kept to unpadded head dims until the cause is known."""
    kw = c.kwargs
    return (kw.get("BLOCK_M") == 128 and c.num_stages == 2 and not kw.get("USE_TMA", False)
            and "WARP_SPEC" in kw)


# The forward's tiles (BLOCK_M, BLOCK_N, num_stages, num_warps, USE_TMA, WARP_SPEC), in order
# of preference: under TKIT_NO_AUTOTUNE the first that fits (shared memory, TMA-able inputs) is
# the default (``_fwd_default_config``): on the H200 in 16-bit, 128x64 s3 w8 ptr up to D=128,
# 128x64 s2 w8 ptr at D=256 (64x64 s3 w4 ptr would fit there too, with 224 KB of shared memory),
# and 64x64 s3 w4 ptr at head dims padded to 256 (``_faults_when_padded``).
_FWD_TILES = [
    (128, 64, 3, 8, False, True), (128, 64, 4, 8, False, True),
    (128, 64, 2, 8, False, False), (64, 64, 3, 4, False, False),
    (128, 64, 3, 8, True, True), (64, 64, 3, 4, True, False),
    (64, 32, 3, 4, True, False),
]


def _fwd_configs():
    # Measured on the H200 (B=4 H=16 S=4096 D=128 bf16, triton 3.6): non-causal, 128x64 s3 w8
    # with pointer loads and a warp-specialized unmasked loop is the fastest (468 TFLOP/s,
    # against 439-444 for the same tile through TMA or without warp specialization); causal,
    # 64x64 s3 w4 through TMA (431, against 415 for 128x64 s3 w8 ptr ws): the shorter query
    # tile wastes less work on the diagonal. BLOCK_N=128 (2 stages) lost (358-380), and two
    # stages with TMA descriptors crash Triton 3.6's ptxas (error -11), so neither is listed.
    # A fourth stage is offered to the pointer/warp-specialized tile (with TMA, 4 stages beat 3
    # by 1%). Warp specialization with 4 warps fails to compile (MLIR pass failure, not caught
    # by the autotuner), so only the 8-warp tiles use it.
    # WARP_SPEC is a no-op on sm_90 with Triton 3.6 (checked in the TTGIR: the loop keeps its
    # tt.warp_specialize attribute and no partition is made; the Hopper pass makes none for
    # this loop), so "ws" and plain configs are the same kernel and their measured gaps
    # (468 vs 439 in one run) are run-to-run noise.
    # A sweep with tile orders (H200, 2026-11-30, one timing each, +-8% noise):
    # 64x64 s3 w4 ptr led causal (446); at D=256, 128x64 s2 w8 ptr gave 481 / 489 (non-causal /
    # causal) against 363-388 for 64x32 s3 w4 TMA, the only tile listed there before. Compiled
    # for sm_90 (bf16, causal and not): 128x64 s2 w8 ptr takes 127-139 registers at D=64,
    # 188-224 at D=128, 255 at D=256 with 192 KB shared, no spills; 64x64 s3 w4 ptr 138-157,
    # 174-212, and 255 with 224 KB shared at D=256, no spills.
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma, "WARP_SPEC": ws},
                      num_stages=s, num_warps=w)
        for bm, bn, s, w, tma, ws in _FWD_TILES
    ]
    if _env_interpret():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "USE_TMA": False,
                               "WARP_SPEC": False})]
    # TKIT_NO_AUTOTUNE does not go through the autotuner (``_fwd_default_config``)
    return configs


def _first_kept(smem_fn, configs, block_d: int, itemsize: int, tma: bool,
                head_dim: int) -> dict:
    """The first config the autotuner's pruner keeps, as launch keywords (TKIT_NO_AUTOTUNE:
    Triton skips the pruner of an autotuner left with one config, so tkit applies it)."""
    c = _prune(smem_fn, tma=tma)(configs, {"BLOCK_D": block_d, "HEAD_DIM": head_dim},
                                 itemsize=itemsize)[0]
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)


def _fwd_default_config(block_d: int, itemsize: int, tma: bool, head_dim: int) -> dict:
    """The config launched under TKIT_NO_AUTOTUNE: the first of ``_FWD_TILES`` that fits shared
    memory at this head dim (and needs no TMA where the inputs cannot take it)."""
    return _first_kept(_fwd_smem, _fwd_configs(), block_d, itemsize, tma, head_dim)


def _bwd_configs(kind: str):
    # dK/dV ("dkdv"): BLOCK_N keys resident, BLOCK_M queries streamed; dQ ("dq"): BLOCK_M
    # queries resident, BLOCK_N keys streamed. The two kernels are tuned apart: each wants its
    # resident tile large and its streamed tile small. Measured with one config for both (H200,
    # main shape, causal): 64x64 s3 w4 255 TFLOP/s, 64x128 s2 w8 224, 32x128 s3 w4 97. Compiled
    # for sm_90 at D=128: dK/dV 32x128 w4 keeps 976 bytes a thread on the stack (hence its 97)
    # and dQ 128x32 w4 168, so neither is offered; dQ 128x64 w8 s2 fits in 235 registers with
    # no stack. At D=256 only 32x64 s2 w4 and 64x64 s1 w8 fit shared memory (measured there:
    # 82 and 109 TFLOP/s). The first config is the default under TKIT_NO_AUTOTUNE.
    return C.interpreter_configs(_bwd_tiles(kind),
                                 triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}))


def _bwd_tiles(kind: str) -> list:
    if kind == "dkdv":
        tiles = [(64, 64, 3, 4), (64, 128, 2, 8), (64, 128, 3, 8), (64, 64, 1, 8), (32, 64, 2, 4)]
    else:
        tiles = [(64, 64, 3, 4), (128, 64, 2, 8), (128, 64, 3, 8), (64, 64, 1, 8), (32, 64, 2, 4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w)
            for bm, bn, s, w in tiles]


def _bwd_default_config(kind: str, block_d: int, itemsize: int) -> dict:
    """The config launched under TKIT_NO_AUTOTUNE: the first backward tile that fits shared
    memory at this head dim. (Triton skips an autotuner's pruner when one config is left, so
    keeping only the first config would launch 64x64 s3 at D=256: 263 KB of shared memory, an
    OutOfResources error on the H200.)"""
    return _first_kept(_bwd_smem(kind), _bwd_tiles(kind), block_d, itemsize, False, block_d)


_TUNE_KEY = ["seqlen_q", "seqlen_k", "HEAD_DIM", "MASK_LO", "MASK_HI", "SOFTCAP", "VARLEN"]


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, acc=None, input_precision: tl.constexpr = None):
    """``tl.dot``; under the interpreter on float32 copies of bfloat16 / fp8 operands (see
    :mod:`tkit.kernels._numerics`)."""
    if _INTERPRET:
        a = _interpreter_operand(a)
        b = _interpreter_operand(b)
    return tl.dot(a, b, acc, input_precision=input_precision)


@triton.jit
def _varlen_span(CU, b, total, CU_BLOCK: tl.constexpr):
    """[start, end) of sequence ``b``: bound(j) is the largest of CU[0..j] clamped to
    [0, total], sequence b is [bound(b), bound(b+1)). For valid cu_seqlens (non-decreasing, 0 to
    total) that is CU[b]:CU[b+1]; whatever CU holds, sequences stay inside the tensors and never
    overlap. CU is read in CU_BLOCK chunks, up to entry b + 1 only."""
    start = b * 0
    end = b * 0
    for c0 in range(0, b + 2, CU_BLOCK):
        idx = c0 + tl.arange(0, CU_BLOCK)
        c = tl.load(CU + idx, mask=idx <= b + 1, other=0)
        c = tl.minimum(tl.maximum(c, 0), total)
        start = tl.maximum(start, tl.max(tl.where(idx <= b, c, 0), 0))
        end = tl.maximum(end, tl.max(c, 0))
    return start, end


@triton.jit
def _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, VARLEN: tl.constexpr,
                CU_BLOCK: tl.constexpr):
    """(first token, length, end) of sequence ``b`` for queries, then for keys. Varlen: the
    span of :func:`_varlen_span`, its length cut to seqlen_q / seqlen_k (max_seqlen_q/k, which
    size the grid): tokens past the cut belong to no sequence."""
    if VARLEN:
        q_start, q_end = _varlen_span(CU_Q, b, total_q, CU_BLOCK)
        k_start, k_end = _varlen_span(CU_K, b, total_k, CU_BLOCK)
        q_len = tl.minimum(q_end - q_start, seqlen_q)
        k_len = tl.minimum(k_end - k_start, seqlen_k)
    else:
        q_start = 0
        q_len = seqlen_q
        q_end = seqlen_q
        k_start = 0
        k_len = seqlen_k
        k_end = seqlen_k
    return q_start, q_len, q_end, k_start, k_len, k_end


@triton.jit
def _zero_rows(X, sxs, sxd, L, sls, start, end, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, HAS_L: tl.constexpr):
    """X[start:end] = 0 (rows of stride ``sxs``) and, with HAS_L, L[start:end] = -inf."""
    offs_d = tl.arange(0, BLOCK_D)
    for r0 in range(start, end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < end
        tl.store(X + rows[:, None] * sxs + offs_d[None, :] * sxd,
                 tl.zeros([BLOCK_M, BLOCK_D], dtype=X.dtype.element_ty),
                 mask=rmask[:, None] & (offs_d < HEAD_DIM)[None, :])
        if HAS_L:
            tl.store(L + rows * sls, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=rmask)


@triton.jit
def _zero_outside(X, sxs, sxd, L, sls, b, n_seq, start, length, end, total,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  HAS_L: tl.constexpr):
    """Varlen rows that belong to no sequence (possible only with invalid cu_seqlens or
    max_seqlen) get defined values: zeros (and lse -inf, as a row with no visible key). One
    program per (sequence, head) calls this: it covers its sequence's tokens past the cut to
    max_seqlen, and the first / last sequence the tokens before / after every sequence."""
    _zero_rows(X, sxs, sxd, L, sls, start + length, end, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_L)
    if b == 0:
        _zero_rows(X, sxs, sxd, L, sls, 0, start, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_L)
    if b == n_seq - 1:
        _zero_rows(X, sxs, sxd, L, sls, end, total, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_L)


@triton.jit
def _scores(qk, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """Scores in base-2 units; with SOFTCAP also tanh(.) (for the backward's derivative)."""
    if SOFTCAP:
        x = qk * cap_scale
        # tanh without libdevice (the interpreter has none), accurate to float32 rounding:
        # (1 - e) / (1 + e) with e = exp(-2|x|) away from 0, its Taylor series near 0 (where
        # 1 - e would cancel; the first omitted term is < 2e-10 at |x| = 0.2)
        ax = tl.abs(x)
        e = tl.exp2(ax * -2.8853900817779268)
        t_big = (1.0 - e) / (1.0 + e)
        t_big = tl.where(x < 0.0, -t_big, t_big)
        x2 = x * x
        t_small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
            -0.05396825396825397 + x2 * 0.021869488536155203))))
        t = tl.where(ax < 0.2, t_small, t_big)
        s = t * qk_scale
    else:
        t = qk
        s = qk * qk_scale
    return s, t


@triton.jit
def _visible(rows, cols, q_len, k_len, shift, wl, wr,
             MASK_LO: tl.constexpr, MASK_HI: tl.constexpr):
    """Mask of visible (query row, key column) pairs; rows and cols broadcast against each
    other."""
    ok = (rows < q_len) & (cols < k_len)
    if MASK_HI:
        ok = ok & (cols <= rows + shift + wr)
    if MASK_LO:
        ok = ok & (cols >= rows + shift - wl)
    return ok


@triton.jit
def _key_ranges(m0, q_len, k_len, shift, wl, wr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK_LO: tl.constexpr, MASK_HI: tl.constexpr):
    """Key block ranges for query rows [m0, m0 + BLOCK_M): [lo, full_lo) partly visible,
    [full_lo, full_hi) fully visible to every row, [full_hi, hi) partly visible."""
    lo = 0
    hi = k_len
    if MASK_LO:
        lo = tl.maximum(m0 + shift - wl, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if MASK_HI:
        hi = tl.minimum(k_len, tl.maximum(m0 + BLOCK_M + shift + wr, 0))
    hi = tl.maximum(hi, lo)
    full_lo = lo
    if MASK_LO:
        full_lo = tl.maximum(m0 + BLOCK_M - 1 + shift - wl, 0)
        full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_end = k_len
    if MASK_HI:
        full_end = tl.minimum(k_len, tl.maximum(m0 + shift + wr + 1, 0))
    full_hi = (full_end // BLOCK_N) * BLOCK_N
    # rows past q_len are padding; a block with padded rows is only "fully visible" for the
    # columns, which is all the masks below need (padded rows are never stored)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(n0, q_len, k_len, shift, wl, wr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_LO: tl.constexpr, MASK_HI: tl.constexpr):
    """Query block ranges that see keys [n0, n0 + BLOCK_N): partly / fully / partly."""
    lo = 0
    hi = q_len
    if MASK_HI:
        lo = tl.maximum(n0 - shift - wr, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if MASK_LO:
        hi = tl.minimum(q_len, tl.maximum(n0 + BLOCK_N - shift + wl, 0))
    hi = tl.maximum(hi, lo)
    full_lo = lo
    if MASK_HI:
        full_lo = tl.maximum(n0 + BLOCK_N - 1 - shift - wr, 0)
        full_lo = ((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_end = q_len
    if MASK_LO:
        full_end = tl.minimum(q_len, tl.maximum(n0 - shift + wl + 1, 0))
    full_hi = (full_end // BLOCK_M) * BLOCK_M
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    if n0 + BLOCK_N > k_len:  # ragged last key block: every query block needs the key mask
        full_lo = hi
        full_hi = hi
    return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, sks, skd, svs, svd,
               start, end, offs_m, offs_n, offs_d, q_len, k_len, shift, wl, wr,
               qk_scale, cap_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, MASK_LO: tl.constexpr, MASK_HI: tl.constexpr,
               SOFTCAP: tl.constexpr, PREC: tl.constexpr, WARP_SPEC: tl.constexpr,
               USE_TMA: tl.constexpr):
    dmask = offs_d < HEAD_DIM
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPEC):
        cols = start_n + offs_n
        if USE_TMA:  # K, V are tensor descriptors: out-of-range rows/columns read as zeros
            kt = tl.trans(K.load([start_n, 0]))
        else:
            kt_ptrs = K + cols[None, :] * sks + offs_d[:, None] * skd
            if MASKED:
                kt = tl.load(kt_ptrs, mask=dmask[:, None] & (cols[None, :] < k_len), other=0.0)
            elif HEAD_DIM == BLOCK_D:
                kt = tl.load(kt_ptrs)
            else:
                kt = tl.load(kt_ptrs, mask=dmask[:, None], other=0.0)
        qk = _dot(q, kt, input_precision=PREC)
        if SOFTCAP:
            s, t = _scores(qk, qk_scale, cap_scale, SOFTCAP)
        else:
            # scale > 0 commutes with the row max: take the max of the raw scores and fold the
            # scale into the exponent's argument, one FMA a score (qk * scale - m) instead of a
            # multiply and a subtract
            s = qk
        if MASKED:
            ok = _visible(offs_m[:, None], cols[None, :], q_len, k_len, shift, wl, wr,
                          MASK_LO, MASK_HI)
            s = tl.where(ok, s, float("-inf"))
        if SOFTCAP:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MASKED:
            # a row that has seen no visible key yet keeps m = -inf: subtract 0 instead
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        if SOFTCAP:
            p = tl.exp2(s - m_use[:, None])
        else:
            p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = V.load([start_n, 0])
        else:
            v_ptrs = V + cols[:, None] * svs + offs_d[None, :] * svd
            if MASKED:
                v = tl.load(v_ptrs, mask=dmask[None, :] & (cols[:, None] < k_len), other=0.0)
            elif HEAD_DIM == BLOCK_D:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=dmask[None, :], other=0.0)
        acc = _dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod,
    slb, slh, sls,
    seqlen_q, seqlen_k, H, GROUP, HEAD_GROUP, qk_scale, cap_scale, wl, wr,
    total_q, total_k, n_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_LO: tl.constexpr,
    MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    WARP_SPEC: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CU_BLOCK: tl.constexpr = 1,
):
    """One program: BLOCK_M query rows of one (batch, query head).

    Q, K, V, O: (batch, seqlen, heads, head_dim) addressed through strides ``s?b, s?s, s?h,
    s?d`` (varlen: ``s?b`` = 0 and sequences start at CU_Q[b] / CU_K[b]); LSE: float32 at
    ``b*slb + h*slh + token*sls``. ``qk_scale`` = scale*log2(e) (softcap: cap*log2(e), and
    ``cap_scale`` = scale/cap); ``wl``/``wr`` the window's left/right extent (used only when
    MASK_LO/MASK_HI). ``seqlen_q``/``seqlen_k`` are the lengths (varlen: the maxima, unused).
    USE_TMA reads K and V through device-side tensor descriptors (TMA on Hopper; needs unit
    head-dim strides and 16-byte aligned rows); WARP_SPEC asks for warp specialization of the
    unmasked loop (Triton 3.6 leaves it a no-op on sm_90: the loop keeps the attribute and no
    partition is made).

    Tile order: the grid is (batch * heads, query blocks) and runs in launch order (axis 0
    fastest); that order is remapped to sections of HEAD_GROUP (batch, head) pairs, query
    blocks in the outer order and heads in the inner one inside a section, so the programs
    in flight share the K/V of a few heads in L2 (HEAD_GROUP >= batch * heads gives the
    plain order: every head of one query block, then the next block). With a causal mask the
    query blocks of a section run last-first, so the longest key ranges start first.
    """
    n_bh = tl.num_programs(0)
    n_m = tl.num_programs(1)
    tile = tl.program_id(1) * n_bh + tl.program_id(0)
    section = tile // (HEAD_GROUP * n_m)
    first_bh = section * HEAD_GROUP
    heads_here = tl.minimum(HEAD_GROUP, n_bh - first_bh)
    r = tile - first_bh * n_m
    pid_m = r // heads_here
    pid_bh = first_bh + r % heads_here
    if MASK_HI:  # causal: the longest key ranges (last query blocks) start first
        pid_m = n_m - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    q_start, q_len, q_end, k_start, k_len, k_end = _seq_bounds(
        CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, VARLEN, CU_BLOCK)
    if VARLEN:
        if pid_m == 0:
            h64 = h.to(tl.int64)
            _zero_outside(O + h64 * soh, sos, sod, LSE + h64 * slh, sls, b, n_seq, q_start,
                          q_len, q_end, total_q, HEAD_DIM, BLOCK_D, BLOCK_M, True)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    hk = h // GROUP
    b64 = b.to(tl.int64)
    Q += b64 * sqb + h.to(tl.int64) * sqh + q_start.to(tl.int64) * sqs
    K += b64 * skb + hk.to(tl.int64) * skh + k_start.to(tl.int64) * sks
    V += b64 * svb + hk.to(tl.int64) * svh + k_start.to(tl.int64) * svs
    O += b64 * sob + h.to(tl.int64) * soh + q_start.to(tl.int64) * sos
    LSE += b64 * slb + h.to(tl.int64) * slh + q_start.to(tl.int64) * sls
    shift = k_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if USE_TMA:
        K = tl.make_tensor_descriptor(K, shape=[k_len, HEAD_DIM], strides=[sks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[k_len, HEAD_DIM], strides=[svs, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
    lo, full_lo, full_hi, hi = _key_ranges(m0, q_len, k_len, shift, wl, wr,
                                           BLOCK_M, BLOCK_N, MASK_LO, MASK_HI)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, sks, skd, svs, svd, lo, full_lo,
                               offs_m, offs_n, offs_d, q_len, k_len, shift, wl, wr,
                               qk_scale, cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True,
                               MASK_LO, MASK_HI, SOFTCAP, PREC, False, USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, sks, skd, svs, svd, full_lo, full_hi,
                               offs_m, offs_n, offs_d, q_len, k_len, shift, wl, wr,
                               qk_scale, cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N, False,
                               MASK_LO, MASK_HI, SOFTCAP, PREC, WARP_SPEC, USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, sks, skd, svs, svd, full_hi, hi,
                               offs_m, offs_n, offs_d, q_len, k_len, shift, wl, wr,
                               qk_scale, cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True,
                               MASK_LO, MASK_HI, SOFTCAP, PREC, False, USE_TMA)
    empty = l_i == 0.0  # no visible key: O = 0, lse = -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    log_l = tl.log2(tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + log_l) * 0.6931471805599453)  # natural log
    tl.store(O + offs_m[:, None] * sos + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + offs_m * sls, lse, mask=offs_m < q_len)


_attn_fwd_autotuned = triton.autotune(
    configs=_fwd_configs(), key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune(_fwd_smem)},
)(_attn_fwd_kernel)


@triton.jit
def _attn_bwd_delta_kernel(
    O, DO, DELTA, CU_Q, sob, sos, soh, sod, sdb, sds, sdh, sdd, slb, slh, sls,
    seqlen_q, H, total_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, CU_BLOCK: tl.constexpr = 1,
):
    """delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] (float32, the LSE's layout)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_start, q_len, _, _, _, _ = _seq_bounds(CU_Q, CU_Q, b, seqlen_q, seqlen_q, total_q, total_q,
                                             VARLEN, CU_BLOCK)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    s64 = q_start.to(tl.int64)
    O += b64 * sob + h64 * soh + s64 * sos
    DO += b64 * sdb + h64 * sdh + s64 * sds
    DELTA += b64 * slb + h64 * slh + s64 * sls
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + offs_m[:, None] * sos + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * sds + offs_d[None, :] * sdd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + offs_m * sls, delta, mask=offs_m < q_len)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqs, sqd, sds, sdd, sls,
                    start, end, offs_n, offs_mb, offs_d, q_len, k_len, shift, wl, wr,
                    qk_scale, cap_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                    MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                    PREC: tl.constexpr):
    dmask = offs_d < HEAD_DIM
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_mb
        rmask = rows < q_len
        qt = tl.load(Q + rows[None, :] * sqs + offs_d[:, None] * sqd,
                     mask=dmask[:, None] & rmask[None, :], other=0.0)
        do = tl.load(DO + rows[:, None] * sds + offs_d[None, :] * sdd,
                     mask=rmask[:, None] & dmask[None, :], other=0.0)
        lse = tl.load(LSE + rows * sls, mask=rmask, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + rows * sls, mask=rmask, other=0.0)
        qkt = _dot(k, qt, input_precision=PREC)  # (BLOCK_N, BLOCK_M)
        st, tt = _scores(qkt, qk_scale, cap_scale, SOFTCAP)
        pt = tl.exp2(st - lse[None, :])
        if MASKED:
            ok = _visible(rows[None, :], offs_n[:, None], q_len, k_len, shift, wl, wr,
                          MASK_LO, MASK_HI)
            pt = tl.where(ok, pt, 0.0)
        dv = _dot(pt.to(do.dtype), do, dv, input_precision=PREC)
        dpt = _dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk = _dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sds, sdh, sdd,
    sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, slb, slh, sls,
    seqlen_q, seqlen_k, HK, GROUP, sm_scale, qk_scale, cap_scale, wl, wr,
    total_q, total_k, n_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_LO: tl.constexpr,
    MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CU_BLOCK: tl.constexpr = 1,
):
    """One program: BLOCK_N keys of one (batch, key/value head), summed over the GROUP query
    heads that share it. DO: the output gradient (strides ``sd*``); DK, DV: outputs (strides
    ``sdk*``, ``sdv*``); LSE, DELTA: float32 rows (layout ``slb, slh, sls``); other arguments
    as in :func:`_attn_fwd_kernel`; ``sm_scale`` the softmax scale."""
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)  # causal: the first key blocks, the longest, start first
    b = pid_bh // HK
    hk = pid_bh % HK
    q_start, q_len, q_end, k_start, k_len, k_end = _seq_bounds(
        CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, VARLEN, CU_BLOCK)
    if VARLEN:
        if pid_n == 0:  # keys of no sequence get zero gradients
            hk64 = hk.to(tl.int64)
            _zero_outside(DK + hk64 * sdkh, sdks, sdkd, DK, 0, b, n_seq, k_start, k_len, k_end,
                          total_k, HEAD_DIM, BLOCK_D, BLOCK_N, False)
            _zero_outside(DV + hk64 * sdvh, sdvs, sdvd, DV, 0, b, n_seq, k_start, k_len, k_end,
                          total_k, HEAD_DIM, BLOCK_D, BLOCK_N, False)
    n0 = pid_n * BLOCK_N
    if n0 >= k_len:
        return
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    qs64 = q_start.to(tl.int64)
    ks64 = k_start.to(tl.int64)
    K += b64 * skb + hk64 * skh + ks64 * sks
    V += b64 * svb + hk64 * svh + ks64 * svs
    DK += b64 * sdkb + hk64 * sdkh + ks64 * sdks
    DV += b64 * sdvb + hk64 * sdvh + ks64 * sdvs
    shift = k_len - q_len
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + offs_n[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + offs_n[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_ranges(n0, q_len, k_len, shift, wl, wr,
                                             BLOCK_M, BLOCK_N, MASK_LO, MASK_HI)
    for g in range(0, GROUP):
        h64 = (hk * GROUP + g).to(tl.int64)
        Qh = Q + b64 * sqb + h64 * sqh + qs64 * sqs
        DOh = DO + b64 * sdb + h64 * sdh + qs64 * sds
        LSEh = LSE + b64 * slb + h64 * slh + qs64 * sls
        DELTAh = DELTA + b64 * slb + h64 * slh + qs64 * sls
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sqd, sds, sdd, sls,
                                 lo, full_lo, offs_n, offs_mb, offs_d, q_len, k_len, shift,
                                 wl, wr, qk_scale, cap_scale, HEAD_DIM, BLOCK_M, True,
                                 MASK_LO, MASK_HI, SOFTCAP, PREC)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sqd, sds, sdd, sls,
                                 full_lo, full_hi, offs_n, offs_mb, offs_d, q_len, k_len, shift,
                                 wl, wr, qk_scale, cap_scale, HEAD_DIM, BLOCK_M, False,
                                 MASK_LO, MASK_HI, SOFTCAP, PREC)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sqd, sds, sdd, sls,
                                 full_hi, hi, offs_n, offs_mb, offs_d, q_len, k_len, shift,
                                 wl, wr, qk_scale, cap_scale, HEAD_DIM, BLOCK_M, True,
                                 MASK_LO, MASK_HI, SOFTCAP, PREC)
    dk = dk * sm_scale
    tl.store(DK + offs_n[:, None] * sdks + offs_d[None, :] * sdkd, dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + offs_n[:, None] * sdvs + offs_d[None, :] * sdvd, dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K, V, sks, skd, svs, svd,
                  start, end, offs_m, offs_nb, offs_d, q_len, k_len, shift, wl, wr,
                  qk_scale, cap_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                  PREC: tl.constexpr):
    dmask = offs_d < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_nb
        cmask = cols < k_len
        kt = tl.load(K + cols[None, :] * sks + offs_d[:, None] * skd,
                     mask=dmask[:, None] & cmask[None, :], other=0.0)
        vt = tl.load(V + cols[None, :] * svs + offs_d[:, None] * svd,
                     mask=dmask[:, None] & cmask[None, :], other=0.0)
        qk = _dot(q, kt, input_precision=PREC)
        s, t = _scores(qk, qk_scale, cap_scale, SOFTCAP)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            ok = _visible(offs_m[:, None], cols[None, :], q_len, k_len, shift, wl, wr,
                          MASK_LO, MASK_HI)
            p = tl.where(ok, p, 0.0)
        dp = _dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = _dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sds, sdh, sdd,
    sdqb, sdqs, sdqh, sdqd, slb, slh, sls,
    seqlen_q, seqlen_k, H, GROUP, sm_scale, qk_scale, cap_scale, wl, wr,
    total_q, total_k, n_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_LO: tl.constexpr,
    MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CU_BLOCK: tl.constexpr = 1,
):
    """One program: dQ for BLOCK_M query rows of one (batch, query head); DQ strides
    ``sdq*``; other arguments as in :func:`_attn_bwd_dkdv_kernel`."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    if MASK_HI:  # causal: the longest key ranges (last query blocks) start first
        pid_m = tl.num_programs(1) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    q_start, q_len, q_end, k_start, k_len, k_end = _seq_bounds(
        CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, VARLEN, CU_BLOCK)
    if VARLEN:
        if tl.program_id(1) == 0:  # queries of no sequence get zero gradients
            _zero_outside(DQ + h.to(tl.int64) * sdqh, sdqs, sdqd, DQ, 0, b, n_seq, q_start,
                          q_len, q_end, total_q, HEAD_DIM, BLOCK_D, BLOCK_M, False)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    hk = h // GROUP
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    qs64 = q_start.to(tl.int64)
    ks64 = k_start.to(tl.int64)
    Q += b64 * sqb + h64 * sqh + qs64 * sqs
    DO += b64 * sdb + h64 * sdh + qs64 * sds
    DQ += b64 * sdqb + h64 * sdqh + qs64 * sdqs
    LSE += b64 * slb + h64 * slh + qs64 * sls
    DELTA += b64 * slb + h64 * slh + qs64 * sls
    K += b64 * skb + hk64 * skh + ks64 * sks
    V += b64 * svb + hk64 * svh + ks64 * svs
    shift = k_len - q_len
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = offs_m < q_len
    mask = rmask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * sds + offs_d[None, :] * sdd, mask=mask, other=0.0)
    lse = tl.load(LSE + offs_m * sls, mask=rmask, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + offs_m * sls, mask=rmask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(m0, q_len, k_len, shift, wl, wr,
                                           BLOCK_M, BLOCK_N, MASK_LO, MASK_HI)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, sks, skd, svs, svd, lo, full_lo,
                       offs_m, offs_nb, offs_d, q_len, k_len, shift, wl, wr, qk_scale,
                       cap_scale, HEAD_DIM, BLOCK_N, True, MASK_LO, MASK_HI, SOFTCAP, PREC)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, sks, skd, svs, svd, full_lo, full_hi,
                       offs_m, offs_nb, offs_d, q_len, k_len, shift, wl, wr, qk_scale,
                       cap_scale, HEAD_DIM, BLOCK_N, False, MASK_LO, MASK_HI, SOFTCAP, PREC)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, sks, skd, svs, svd, full_hi, hi,
                       offs_m, offs_nb, offs_d, q_len, k_len, shift, wl, wr, qk_scale,
                       cap_scale, HEAD_DIM, BLOCK_N, True, MASK_LO, MASK_HI, SOFTCAP, PREC)
    dq = dq * sm_scale
    tl.store(DQ + offs_m[:, None] * sdqs + offs_d[None, :] * sdqd, dq.to(DQ.dtype.element_ty),
             mask=mask)


_attn_bwd_dkdv_autotuned = triton.autotune(
    configs=_bwd_configs("dkdv"), key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune(_bwd_smem("dkdv"))},
)(_attn_bwd_dkdv_kernel)
_attn_bwd_dq_autotuned = triton.autotune(
    configs=_bwd_configs("dq"), key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune(_bwd_smem("dq"))},
)(_attn_bwd_dq_kernel)


# --------------------------------------------------------------------------------------------
# Validation and launchers
# --------------------------------------------------------------------------------------------
def _strides4(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, seq, head, dim) strides; a varlen tensor (tokens, heads, dim) has batch 0."""
    if varlen:
        return (0, t.stride(0), t.stride(1), t.stride(2))
    return tuple(t.stride())


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    if varlen:  # (heads, total_q)
        return (0, lse.stride(0), lse.stride(1))
    return tuple(lse.stride())  # (batch, heads, seqlen_q)


def _flags(head_dim, causal, window, softcap, varlen, dtype):
    wl, wr = window
    if causal:
        wr = 0
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=max(16, C.next_power_of_2(head_dim)),
        MASK_LO=wl >= 0, MASK_HI=wr >= 0, SOFTCAP=softcap > 0.0, VARLEN=varlen,
        PREC="ieee" if dtype == torch.float32 else "tf32",
    ), max(wl, 0), max(wr, 0)


def _scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_scale) as the kernels take them."""
    if softcap > 0.0:
        return softcap * LOG2E, scale / softcap
    return scale * LOG2E, 1.0


def _check_sequence_spans(q, k, v, seqlen_q, seqlen_k):
    """Offsets inside one (sequence, head) are 32-bit in the kernels (batch, head and sequence
    starts are 64-bit): refuse a sequence whose elements span 2**31 or more in any tensor the
    kernels address that way (the inputs, and outputs and gradients laid out like q, k, v)."""
    for name, t, s in (("q", q, seqlen_q), ("k", k, seqlen_k), ("v", v, seqlen_k)):
        if s <= 0:
            continue
        d = t.shape[-1]
        dense = t.shape[-2] * d  # the token stride of an output or gradient
        span = (s - 1) * max(abs(t.stride(-3)), dense) + (d - 1) * max(abs(t.stride(-1)), 1)
        if span >= 2**31 - 1:
            raise ValueError(f"{name}: one sequence of {s} tokens spans {span} elements (token "
                             f"stride {max(abs(t.stride(-3)), dense)}); offsets inside a "
                             "sequence are 32-bit, so at most 2**31 - 1 are supported")


def _check_inputs(q, k, v, varlen, window_size, softcap, softmax_scale):
    nd = 3 if varlen else 4
    layout = "(total_tokens, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        C.check_tensor(t, name, DTYPES)
        if t.ndim != nd:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    C.check_same_device(q=q, k=k, v=v)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {C.dtype_name(q.dtype)}, "
                        f"{C.dtype_name(k.dtype)}, {C.dtype_name(v.dtype)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {k.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} is not supported (1 to {MAX_HEAD_DIM})")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of "
                         f"key/value heads ({hk})")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(int(w) != w or w < -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, "
                         f"got {window_size!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 turns it off), got {softcap}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")


def _check_cu(cu, name, batch_hint=None):
    C.check_tensor(cu, name, (torch.int32,), ndim=1)
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must hold batch + 1 offsets, got shape {tuple(cu.shape)}")


#: Forward cases (head_dim, causal) that go to the Gluon kernel of
#: :mod:`tkit.kernels.attention.hopper` on sm_90 when it supports the inputs: where it measured
#: faster than this module's autotuned Triton kernel (H200, B=4 H=16 S=4096 bf16, 3 interleaved
#: rounds, 2026-11-30, TFLOP/s Gluon / Triton): D=128, warp-specialized, 580.6 / 479.1
#: non-causal and 569.8 / 426.4 causal; D=64 causal (not warp-specialized) 375.2 / 362.4.
#: D=64 non-causal stays here (411.2 / 424.5).
#: Set ``HOPPER_FWD_CASES = frozenset()`` to keep every forward on the Triton kernel.
HOPPER_FWD_CASES = frozenset({(128, False), (128, True), (64, True)})


def _hopper_choice(q, k, v, causal, window, softcap):
    """(the attention_hopper module, None) when its forward takes these inputs, else (None,
    the reason it does not)."""
    if (q.shape[-1], bool(causal)) not in HOPPER_FWD_CASES:
        return None, f"head_dim {q.shape[-1]}, causal={bool(causal)} not in HOPPER_FWD_CASES"
    if q.device.type != "cuda":
        return None, "not on a CUDA device"
    try:
        from tkit.kernels.attention import hopper as attention_hopper
    except ImportError as e:  # a Triton without Gluon's Hopper API: the Triton kernel serves
        return None, f"Gluon unavailable: {e}"
    reason = attention_hopper.supported(q, k, v, causal, window, softcap)
    return (attention_hopper, None) if reason is None else (None, reason)


def hopper_status(device=None) -> str:
    """Whether this machine's flash_attention forward can take the Gluon Hopper kernel, and
    for which cases (``tkit info`` prints it)."""
    cases = ", ".join(f"D={d}{' causal' if c else ''}" for d, c in sorted(HOPPER_FWD_CASES))
    try:
        from tkit.kernels.attention import hopper as attention_hopper  # noqa: F401
    except ImportError as e:
        return f"Triton kernel only (Gluon unavailable: {e})"
    if not torch.cuda.is_available():
        return f"Triton kernel (the Gluon kernel for {cases} needs an sm_90 GPU; none here)"
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) != (9, 0):
        return f"Triton kernel (the Gluon kernel needs sm_90; this GPU is sm_{cap[0]}{cap[1]})"
    return (f"Gluon sm_90 kernel for {cases} with 16-bit TMA-able inputs and no window, "
            "softcap or varlen; the Triton kernel for the rest")


def fwd_backend(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0) -> str:
    """Which forward kernel ``flash_attention`` launches for these inputs, and why:
    "gluon (sm_90, ...)" or "triton (...)"."""
    hopper, reason = _hopper_choice(q, k, v, causal, window_size, softcap)
    if hopper is None:
        return f"triton ({reason})"
    ws = hopper.default_config(q.shape[-1], q.element_size()).get("WS", False)
    return ("gluon (sm_90, wgmma overlapped with the softmax"
            + (", warp-specialized TMA loader)" if ws else ")"))


def _fwd_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap,
              config=None):
    """Launch the forward; returns (out, lse). Without ``config``, the inputs and cases that
    the Gluon Hopper kernel serves go there (``HOPPER_FWD_CASES``). ``config`` (a dict with
    BLOCK_M, BLOCK_N, num_warps, num_stages and optionally USE_TMA, WARP_SPEC) launches this
    module's Triton kernel with it, bypassing the autotuner;
    its optional HEAD_GROUP entry (the tile order's section size) overrides
    :func:`fwd_head_group`."""
    varlen = cu_q is not None
    if config is None and not varlen:
        hopper, _ = _hopper_choice(q, k, v, causal, (wl, wr), softcap)
        if hopper is not None:
            return hopper.forward(q, k, v, causal, scale)
    hq, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if varlen:
        batch = cu_q.shape[0] - 1
        out = C.empty(q.shape, q.dtype, q.device)
        lse = C.empty((hq, q.shape[0]), torch.float32, q.device)
        sq, sk = max_q, max_k
        cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # the kernels read them densely
    else:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        out = C.empty(q.shape, q.dtype, q.device)
        lse = C.empty((batch, hq, sq), torch.float32, q.device)
    if batch == 0 or sq == 0 or hq == 0:
        if varlen:  # tokens in no sequence (possible only for invalid arguments): defined values
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    flags, wl, wr = _flags(d, causal, (wl, wr), softcap, varlen, q.dtype)
    qk_scale, cap_scale = _scales(scale, softcap)
    dummy = cu_q if varlen else q
    args = dict(
        Q=q, K=k, V=v, O=out, LSE=lse, CU_Q=dummy, CU_K=cu_k if varlen else q,
        **_named("sq", _strides4(q, varlen)), **_named("sk", _strides4(k, varlen)),
        **_named("sv", _strides4(v, varlen)), **_named("so", _strides4(out, varlen)),
        **_named("sl", _lse_strides(lse, varlen), dims="bhs"),
        seqlen_q=sq, seqlen_k=sk, H=hq, GROUP=hq // hk, qk_scale=qk_scale,
        cap_scale=cap_scale, wl=wl, wr=wr, **_varlen_args(q, k, batch, varlen), **flags,
    )
    cfg = dict(config) if config is not None else {}
    head_group = cfg.pop("HEAD_GROUP", None)
    if head_group is None:
        head_group = fwd_head_group(sk, d, q.element_size(), hq // hk)
    args["HEAD_GROUP"] = max(1, min(int(head_group), batch * hq))
    if config is None and C._env.NO_AUTOTUNE and not _env_interpret():
        cfg = _fwd_default_config(flags["BLOCK_D"], q.element_size(), tma_ok(k, v), d)
    if not cfg:
        grid = lambda meta: (batch * hq, C.cdiv(sq, meta["BLOCK_M"]))
        if q.device.type == "cuda" and tma_ok(k, v):
            _set_tma_allocator(q.device)
        C.launch(_attn_fwd_autotuned, grid, **args)
    else:  # a config given, or TKIT_NO_AUTOTUNE's default
        cfg.setdefault("WARP_SPEC", False)
        cfg.setdefault("USE_TMA", False)
        if cfg["USE_TMA"]:
            if not tma_ok(k, v):
                raise ValueError("USE_TMA needs k and v with unit head_dim stride and 16-byte "
                                 "aligned rows")
            _set_tma_allocator(q.device)
        grid = (batch * hq, C.cdiv(sq, cfg["BLOCK_M"]))
        C.launch(_attn_fwd_kernel, grid, **args, **cfg)
    return out, lse


# K and V bytes that the programs in flight should share in L2 (the H200 has 60 MB in two
# halves). FlashAttention-3's tile scheduler uses 32 MB; on the H200 (B4 S4096 H16 D128 bf16,
# 2 MB of K/V a head, median of 3 interleaved rounds, 2026-11-30) sections of 4 heads (8 MB)
# were at least as fast as 16 heads (32 MB) in every config, and both well ahead of no
# sections: 128x64 s3 w8 non-causal 475 / 466 / 446 TFLOP/s (4 / 16 / all heads), causal
# 419 / 414 / 389; 64x64 s3 w4 causal 414 / 412 / 381. One head (2 MB) was erratic (379-492).
_L2_KV_BUDGET = 8 << 20


def fwd_head_group(seqlen_k: int, head_dim: int, itemsize: int, group: int) -> int:
    """(batch, query head) pairs per section of the forward's tile order: as many key/value
    heads as fit ``_L2_KV_BUDGET`` (a power of 2, at least 1), times the GQA group (query heads
    of one key/value head read the same K/V)."""
    kv_bytes = 2 * max(seqlen_k, 1) * head_dim * itemsize
    n = max(1, _L2_KV_BUDGET // kv_bytes)
    return (1 << (n.bit_length() - 1)) * max(group, 1)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Can these (.., seqlen, heads, head_dim) tensors be read through tensor descriptors?
    TMA needs the innermost stride 1, the other strides and the base 16-byte aligned."""
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((st * es) % 16 for st in t.stride()[:-1]):
            return False
    return True


_TMA_ALLOCATOR_SET = False


def _set_tma_allocator(device) -> None:
    # device-side tensor descriptors need a small global scratch buffer per launch
    global _TMA_ALLOCATOR_SET
    if _TMA_ALLOCATOR_SET:
        return

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, device="cuda", dtype=torch.int8)  # the current device

    triton.set_allocator(alloc)
    _TMA_ALLOCATOR_SET = True


def _varlen_args(q, k, batch, varlen) -> dict:
    """The kernels' arguments for clamping cu_seqlens: token counts, the number of sequences
    and the chunk in which cu_seqlens is read (up to 1024 entries at a time)."""
    return dict(total_q=q.shape[0], total_k=k.shape[0], n_seq=batch,
                CU_BLOCK=min(C.next_power_of_2(batch + 1), 1024) if varlen else 1)


def _named(prefix, strides, dims="bshd"):
    return {f"{prefix}{c}": s for c, s in zip(dims, strides)}


def _bwd_impl(do, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr,
              softcap, config=None):
    """Launch the backward; returns (dq, dk, dv). ``config`` bypasses the autotuners."""
    varlen = cu_q is not None
    hq, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    dq = C.empty(q.shape, q.dtype, q.device)
    dk = C.empty(k.shape, k.dtype, k.device)
    dv = C.empty(v.shape, v.dtype, v.device)
    if varlen:
        batch, sq, sk = cu_q.shape[0] - 1, max_q, max_k
        cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
        # with no query (key) block to launch, no program writes the zeros of tokens in no
        # sequence (possible only for invalid arguments)
        if batch == 0 or hq == 0 or sq == 0:
            dq.zero_()
        if batch == 0 or hq == 0 or sk == 0:
            dk.zero_()
            dv.zero_()
    else:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if batch == 0 or hq == 0 or (sq == 0 and sk == 0):
        return dq, dk, dv
    flags, wl, wr = _flags(d, causal, (wl, wr), softcap, varlen, q.dtype)
    qk_scale, cap_scale = _scales(scale, softcap)
    delta = C.empty(lse.shape, torch.float32, q.device)
    lse_st = _named("sl", _lse_strides(lse, varlen), dims="bhs")
    cu_q_arg = cu_q if varlen else q
    cu_k_arg = cu_k if varlen else q
    if sq > 0:
        block_m = 64
        C.launch(_attn_bwd_delta_kernel, (C.cdiv(sq, block_m), batch * hq),
                 O=out, DO=do, DELTA=delta, CU_Q=cu_q_arg,
                 **_named("so", _strides4(out, varlen)), **_named("sd", _strides4(do, varlen)),
                 **lse_st, seqlen_q=sq, H=hq, total_q=q.shape[0], HEAD_DIM=d,
                 BLOCK_D=flags["BLOCK_D"], VARLEN=varlen, BLOCK_M=block_m,
                 CU_BLOCK=_varlen_args(q, k, batch, varlen)["CU_BLOCK"])
        if dlse is not None:  # d lse_i / d S_ij = P_ij: folds into delta
            delta = delta - dlse.to(torch.float32)
    common = dict(
        Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, CU_Q=cu_q_arg, CU_K=cu_k_arg,
        **_named("sq", _strides4(q, varlen)), **_named("sk", _strides4(k, varlen)),
        **_named("sv", _strides4(v, varlen)), **_named("sd", _strides4(do, varlen)),
        **lse_st, seqlen_q=sq, seqlen_k=sk, GROUP=hq // hk, sm_scale=scale,
        qk_scale=qk_scale, cap_scale=cap_scale, wl=wl, wr=wr,
        **_varlen_args(q, k, batch, varlen), **flags,
    )
    dkdv_args = dict(common, DK=dk, DV=dv, **_named("sdk", _strides4(dk, varlen)),
                     **_named("sdv", _strides4(dv, varlen)), HK=hk)
    dq_args = dict(common, DQ=dq, **_named("sdq", _strides4(dq, varlen)), H=hq)
    if config is None and C._env.NO_AUTOTUNE and not _env_interpret():
        block_d, es = flags["BLOCK_D"], q.element_size()
        c1, c2 = _bwd_default_config("dkdv", block_d, es), _bwd_default_config("dq", block_d, es)
        C.launch(_attn_bwd_dkdv_kernel, (batch * hk, C.cdiv(sk, c1["BLOCK_N"])),
                 **dkdv_args, **c1)
        C.launch(_attn_bwd_dq_kernel, (batch * hq, C.cdiv(sq, c2["BLOCK_M"])), **dq_args, **c2)
    elif config is None:
        C.launch(_attn_bwd_dkdv_autotuned,
                 lambda meta: (batch * hk, C.cdiv(sk, meta["BLOCK_N"])), **dkdv_args)
        C.launch(_attn_bwd_dq_autotuned,
                 lambda meta: (batch * hq, C.cdiv(sq, meta["BLOCK_M"])), **dq_args)
    else:
        cfg = dict(config)
        C.launch(_attn_bwd_dkdv_kernel, (batch * hk, C.cdiv(sk, cfg["BLOCK_N"])),
                 **dkdv_args, **cfg)
        C.launch(_attn_bwd_dq_kernel, (batch * hq, C.cdiv(sq, cfg["BLOCK_M"])),
                 **dq_args, **cfg)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# torch.library registration (custom op + fake + autograd)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("tkit::flash_attn_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],  # noqa: UP045
            max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
            window_left: int, window_right: int, softcap: float,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, window_left, window_right, softcap)


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap):
    out = q.new_empty(q.shape)
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("tkit::flash_attn_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],  # noqa: UP045
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],  # noqa: UP045
            max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
            window_left: int, window_right: int, softcap: float,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      causal, softmax_scale, window_left, window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.opts = (max_q, max_k, causal, scale, wl, wr, softcap)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.opts)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _resolve(q, causal, softmax_scale, window_size, softcap):
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    wl, wr = (int(w) for w in window_size)
    return bool(causal), scale, wl, wr, float(softcap)


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, return_lse=False):
    """Scaled dot-product attention, FlashAttention style (never materialises the scores).

    Parameters
    ----------
    q : Tensor (batch, seqlen_q, heads_q, head_dim), float16, bfloat16 or float32
    k, v : Tensor (batch, seqlen_k, heads_kv, head_dim); heads_q a multiple of heads_kv
        (GQA/MQA). Any strides (e.g. views of one packed qkv tensor).
    causal : bool
        Mask keys after the query, aligned to the bottom-right corner when seqlen_q != seqlen_k.
    softmax_scale : float, optional
        Default 1/sqrt(head_dim).
    window_size : (int, int)
        Sliding window (left, right); -1 is unbounded. Key j is visible from query i when
        ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``.
    softcap : float
        When > 0, scores become ``softcap * tanh(scores / softcap)`` before the softmax.
    return_lse : bool
        Also return the log-sum-exp of each row's scores, float32 (batch, heads_q, seqlen_q).

    Returns
    -------
    out : Tensor like q; or (out, lse). Rows with no visible key give 0 and lse -inf.
    """
    if (P.ON and type(q) is _T and type(k) is _T and type(v) is _T and not _compiling()
            and not (_grad_enabled() and (q.requires_grad or k.requires_grad
                                          or v.requires_grad))):
        # the eager plan (tkit.kernels._plan): the key holds all the ordinary path reads
        dev, stream = L._device_stream()
        key = (causal, softmax_scale, window_size, softcap, dev,
               q.shape, q.stride(), q.dtype, q.get_device(), not q.data_ptr() & 15,
               k.shape, k.stride(), k.dtype, k.get_device(), not k.data_ptr() & 15,
               v.shape, v.stride(), v.dtype, v.get_device(), not v.data_ptr() & 15)
        try:
            p = _plans.get(key)
        except TypeError:  # an unhashable option: the ordinary path names it
            p = False
        if p:
            out_lse = p(stream, q, k, v)
            if out_lse is not None:
                return out_lse if return_lse else out_lse[0]
        elif p is None:
            P.stats["plan_miss"] += 1
            with P.recording() as rec:
                out_lse = _flash_attention_slow(q, k, v, causal, softmax_scale, window_size,
                                                softcap)
            P.store(_plans, key, rec, (q, k, v), out_lse)
            return out_lse if return_lse else out_lse[0]
    out_lse = _flash_attention_slow(q, k, v, causal, softmax_scale, window_size, softcap)
    return out_lse if return_lse else out_lse[0]


_T = torch.Tensor
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()


def _flash_attention_slow(q, k, v, causal, softmax_scale, window_size, softcap):
    """(out, lse) through validation and the launcher (the registered op under autograd)."""
    _check_inputs(q, k, v, False, window_size, softcap, softmax_scale)
    causal, scale, wl, wr, softcap = _resolve(q, causal, softmax_scale, window_size, softcap)
    sq, sk = q.shape[1], k.shape[1]
    _check_sequence_spans(q, k, v, sq, sk)
    if C.use_direct_path(q, k, v):
        out, lse = _fwd_impl(q, k, v, None, None, sq, sk, causal, scale, wl, wr, softcap)
    else:
        out, lse = _fwd_op(q, k, v, None, None, sq, sk, causal, scale, wl, wr, softcap)
    return out, lse


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           return_lse=False):
    """:func:`flash_attention` over packed sequences of different lengths, without padding.

    Parameters
    ----------
    q : Tensor (total_q, heads_q, head_dim); k, v : Tensor (total_k, heads_kv, head_dim)
    cu_seqlens_q, cu_seqlens_k : int32 Tensor (batch + 1,)
        Cumulative sequence lengths: sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``;
        non-decreasing, from 0 to total_q (total_k).
    max_seqlen_q, max_seqlen_k : int
        At least the longest sequence (sizes the grid; never read from the device).

    cu_seqlens and max_seqlen are checked before the launch when cu_seqlens is on the host
    (always so in the interpreter), and on the device under ``TKIT_CHECK=1``. Unchecked invalid
    values cannot make the kernels touch memory outside the tensors: sequence b takes tokens
    [bound(b), bound(b+1)) where bound(j) is the largest of cu_seqlens[:j+1] clamped to
    [0, total], cut to its first max_seqlen tokens; tokens in no sequence get out = 0,
    lse = -inf, and zero gradients.
    Other options as in :func:`flash_attention`; the lse is (heads_q, total_q).
    """
    _check_inputs(q, k, v, True, window_size, softcap, softmax_scale)
    _check_cu(cu_seqlens_q, "cu_seqlens_q")
    _check_cu(cu_seqlens_k, "cu_seqlens_k")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    C.check_same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if int(m) != m or m < 0:
            raise ValueError(f"{name} must be a non-negative int, got {m!r}")
    for t, x, cu, m in (("q", q, cu_seqlens_q, max_seqlen_q), ("k", k, cu_seqlens_k,
                                                                 max_seqlen_k)):
        if _offsets.values_checked(cu):
            _offsets.check_values(cu, f"cu_seqlens_{t}", x.shape[0], f"{t}.shape[0]", int(m),
                                  f"max_seqlen_{t}")
    # the kernels cut every sequence to max_seqlen: that bounds the offsets inside one
    _check_sequence_spans(q, k, v, min(int(max_seqlen_q), q.shape[0]),
                          min(int(max_seqlen_k), k.shape[0]))
    causal, scale, wl, wr, softcap = _resolve(q, causal, softmax_scale, window_size, softcap)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal,
            scale, wl, wr, softcap)
    if C.use_direct_path(q, k, v):
        out, lse = _fwd_impl(*args)
    else:
        out, lse = _fwd_op(*args)
    return (out, lse) if return_lse else out


def cost(q, k, v, *args, causal=False, backward=False, **kwargs):
    """(bytes, flops) of one call: Q, K, V read and O written once; 4*B*H*Sq*Sk*D FLOPs
    (half when causal), 2.5x that for the backward."""
    from tkit.registry import Cost

    if q.ndim == 4:
        b, sq, h, d = q.shape
        sk = k.shape[1]
        pairs = b * sq * sk
    else:  # varlen: args are cu_seqlens_q, cu_seqlens_k
        cu_q, cu_k = args[0], args[1]
        lq = (cu_q[1:] - cu_q[:-1]).double()
        lk = (cu_k[1:] - cu_k[:-1]).double()
        pairs = float((lq * lk).sum())
        h, d = q.shape[1], q.shape[2]
    flops = 4.0 * pairs * h * d * (0.5 if causal else 1.0)
    nbytes = (q.numel() * 2 + k.numel() + v.numel()) * q.element_size()
    if backward:
        flops *= 2.5
        nbytes *= 2
    return Cost(nbytes, flops)
