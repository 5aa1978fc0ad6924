"""Decode attention over a (paged) KV cache, writing new tokens into it, merging partial states.

Math, per sequence b, query head h (key/value head ``hk = h // group``), new token i of
``seqlen_q`` (1 to 16; speculative decoding verifies several at once):

    L = cache_seqlens[b]                      valid tokens, the new ones included
    key j (0 <= j < L) is at position j of the sequence; query i at position L - seqlen_q + i
    S[i, j] = scale * q[i] . k[j]             (k dequantized: k8[j] * k_scale)
    S = cap * tanh(S / cap)                   with softcap = cap > 0
    S[i, j] = -inf  unless j is visible from i: causal bottom-right, ``window_size`` as in
                    :func:`tkit.flash_attention` (shift = L - seqlen_q)
    O[i] = softmax(S[i]) V,  lse[i] = logsumexp(S[i]);  no visible key: O = 0, lse = -inf

Cache layouts: dense ``(batch, max_len, heads_kv, head_dim)``, or paged ``(num_blocks,
page_size, heads_kv, head_dim)`` with ``block_table`` (batch, max_blocks) int32: position j of
sequence b lives in block ``block_table[b, j // page_size]`` at offset ``j % page_size``. Pages
may come in any order and may be shared by several sequences.

Cost model: decode is memory-bound. One call reads K and V of every valid token once
(2 * sum(L) * heads_kv * head_dim * itemsize bytes, plus the scales of an fp8 cache) and q, and
writes O; the FLOPs are 4 * sum(L) * heads_q * seqlen_q * head_dim, i.e. about
``2 * group * seqlen_q / itemsize`` FLOP/byte (group 4, bf16: 4 FLOP/byte, far below the H200's
~170): the ceiling is the copy bandwidth, and every design choice below is about reading each KV
byte exactly once with enough bytes in flight.

Kernel design:

* GQA packing: one program takes every query row of one (sequence, kv head): the ``seqlen_q *
  group`` rows (row r = query ``r // group``, head ``hk * group + r % group``) are one M tile,
  padded to >= 16 for ``tl.dot``, so each K/V byte is read once for the whole group (more than
  ``block_m`` rows take several M tiles, which read the same keys at the same time, from L2).
* Keys in tiles of ``block_n`` (64) positions whatever the page size: a tile inside one page
  (page_size >= block_n) reads one block-table entry; smaller pages gather the tile across
  ``block_n / page_size`` pages through the block table. Addresses are 64-bit (block index x
  block stride can pass 2**31 elements).
* Split-KV (flash-decoding): the grid is (splits x M tiles, kv heads, batch); split s of a
  sequence takes the s-th of ``num_splits`` equal runs of its *actual* key tiles (read from
  ``cache_seqlens`` on the device) and writes a partial O and LSE in float32; a second kernel
  combines the splits by their LSEs. With one split the first kernel writes O directly.
  ``num_splits`` is chosen on the host from the SM count, batch, kv heads and the *largest
  possible* length (the cache or block-table shape): no host sync, so a call can be captured in
  a CUDA graph at the largest shapes and replayed with new lengths and tables.
* Online softmax in base 2 with log2(e) folded into the scale (one FMA and one exp2 a score),
  float32 accumulation; fp8 caches are converted to the query's dtype in registers, per-tensor
  scales folded into the score scale (K) and the output (V), per-token-head scales applied to
  the scores (K) and to the probabilities (V) of each key, never to the K/V tiles.
* Masks cost nothing where they cannot matter: each program's key range is cut in three (tiles
  partly visible at a window's left edge, fully visible tiles, tiles partly visible at the
  causal diagonal / the end of the sequence); only the outer two evaluate a mask.

Memory safety: no value of ``cache_seqlens`` or ``block_table`` makes a kernel read outside the
cache: lengths are clamped to [0, max_len] in-kernel, key positions past the length are clamped
to the last valid one (and masked), block indices to [0, num_blocks - 1]; ``append_kv`` skips a
slot outside the cache as it skips -1. The public functions check shapes, dtypes and page sizes
always, and the values of these tensors where that costs no sync (host tensors, hence always in
the interpreter) or under ``TKIT_CHECK=1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels import _launch as _L
from tkit.kernels import _plan as P
from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels._numerics import fp8_keep_nan as _fp8_keep_nan
from tkit.kernels._numerics import interpreter_operand as _interpreter_operand
from tkit.kernels._numerics import saturate_fp8 as _saturate_fp8

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
MAX_SEQLEN_Q = 16
MAX_SPLITS = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels.

    block_n: keys per tile (a power of 2 >= 16), independent of the page size.
    sub_n: keys per sub-tile (a power of 2 >= 16 dividing block_n; None: block_n): a tile's
        loads are in flight together, its converted operands live one sub-tile at a time.
    block_m: the most packed (query, head) rows in one M tile (a power of 2 >= 16).
    num_warps, num_stages: of the split kernel (the software pipeline streams K/V tiles).
    num_splits: None lets :func:`choose_num_splits` decide; an int forces it (the call's own
        ``num_splits`` argument wins over both).
    ctas_per_sm: resident programs per SM that the split heuristic counts as slots.
    split_bytes: K+V bytes one split should stream at most (the split heuristic's floor on the
        number of splits, so that the longest sequence of a mixed batch is not one long tail).
    """

    block_n: int = 64
    sub_n: Optional[int] = None  # noqa: UP045
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_splits: Optional[int] = None  # noqa: UP045
    ctas_per_sm: int = 2
    split_bytes: int = 2 << 20

    @classmethod
    def for_device(cls, head_dim: int, cache_itemsize: int) -> DecodeConfig:
        """The default for this head dim and cache element size (docs/NOTES.md has the H200
        sweep of B32 D128, dense and paged): K tiles of 16 KB (64 keys at D=128 in 16 bits,
        32 at D=256, 128 for fp8 at D=128), 4 warps, 2 or 3 stages (below). The interpreter
        pays per tile, not per element, but tests want several tiles and splits on tiny
        caches: 16-key tiles there.

        fp8 at D=128 (sm_90a compile, B32 Hq32/Hkv8 L8192 page 64, per-token scales; Triton
        3.6 gives each loop one ring slot of K and V whatever num_stages says, so the bytes in
        flight an SM are resident programs x one K+V tile): whole 128-key tiles at 3 stages
        took 201 registers, 2 programs an SM, 66 KB in flight; 128-key tiles in sub-tiles of
        32 keys at 2 stages take 168 registers, 3 programs, 99 KB in flight, no spills (64-key
        sub-tiles: 255 registers; 64-key tiles: 168-190 registers, 50 KB). Not yet timed."""
        if _env.INTERPRET:
            return cls(block_n=16, block_m=16, num_stages=1)
        block_d = max(16, C.next_power_of_2(head_dim))
        block_n = max(16, min(128, (16 << 10) // (block_d * cache_itemsize)))
        if cache_itemsize == 1 and block_d == 128:
            return cls(block_n=128, sub_n=32, num_stages=2)
        # 16-bit D=128, dense: two stages take 39 KB of shared memory and four programs fit an
        # SM (the register limit), three take 72 KB and three fit; the dense cache then read
        # 4.1 TB/s instead of 3.5 (a paged cache, whose loop keeps one K/V buffer at either
        # setting, read 4.0 both ways); other head dims keep three until measured
        stages = 2 if cache_itemsize == 2 and block_d == 128 else 3
        return cls(block_n=block_n, num_stages=stages)


_OVERRIDES = C.ConfigOverrides(DecodeConfig)


def decode_config(**overrides):
    """Override fields of :class:`DecodeConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(head_dim: int, cache_itemsize: int) -> DecodeConfig:
    cfg = DecodeConfig.for_device(head_dim, cache_itemsize)
    return _OVERRIDES.apply(cfg)


def choose_num_splits(work: int, n_tiles: int, sms: int, *, ctas_per_sm: int = 2,
                      min_splits: int = 1, max_splits: int = MAX_SPLITS) -> int:
    """Splits of each (sequence, kv head, M tile) program's keys.

    ``work``: programs without splitting (batch * kv heads * M tiles); ``n_tiles``: key tiles
    of the longest possible sequence; ``min_splits``: the floor from ``split_bytes``. Among
    ``min_splits .. max_splits`` (no more than there are tiles) take the smallest whose waves
    over ``sms * ctas_per_sm`` slots are at least 85% as full as the best's (FlashAttention-2's
    rule, with the floor added: its batch-wide wave count ignores that one long sequence of a
    mixed batch would be a tail of few programs)."""
    cap = max(1, min(max_splits, n_tiles))
    lo = max(1, min(min_splits, cap))
    if work <= 0:
        return 1
    slots = max(1, sms * ctas_per_sm)
    if lo == 1 and work >= 0.8 * slots:
        return 1
    eff = {}
    for s in range(lo, cap + 1):
        waves = work * s / slots
        eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    for s in range(lo, cap + 1):
        if eff[s] >= 0.85 * best:
            return s
    return lo


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, acc=None, input_precision: tl.constexpr = None):
    """``tl.dot``; under the interpreter on float32 copies of bfloat16 / fp8 operands."""
    if _INTERPRET:
        a = _interpreter_operand(a)
        b = _interpreter_operand(b)
    return tl.dot(a, b, acc, input_precision=input_precision)


@triton.jit
def _softcap(qk, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """Scores in base-2 units (softcap: cap * log2e * tanh(qk * scale / cap))."""
    if SOFTCAP:
        x = qk * cap_scale
        # tanh without libdevice (the interpreter has none); series near 0 (see attention.py)
        ax = tl.abs(x)
        e = tl.exp2(ax * -2.8853900817779268)
        t_big = (1.0 - e) / (1.0 + e)
        t_big = tl.where(x < 0.0, -t_big, t_big)
        x2 = x * x
        t_small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
            -0.05396825396825397 + x2 * 0.021869488536155203))))
        s = tl.where(ax < 0.2, t_small, t_big) * qk_scale
    else:
        s = qk * qk_scale
    return s


@triton.jit
def _from_fp8(x, dtype: tl.constexpr):
    """An fp8 tile in ``dtype`` (every step exact). To bfloat16 through float32: Triton's
    direct path on sm_90 is e4m3x2 -> f16x2 (one F2FP a pair) and then one F2F.BF16.F16 an
    element, on the SM's slow conversion pipe (16 a clock); through float32 the second step is
    an HADD2.F32 an element and one F2FP.BF16.F32.PACK_AB a pair."""
    if dtype == tl.bfloat16:
        return x.to(tl.float32).to(tl.bfloat16)
    return x.to(dtype)


@triton.jit
def _key_rows(BT, start_n, cols, L, b64, n_blocks, sbtn,
              PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(block index, row in block) of key positions ``cols`` (clamped to [0, L - 1]), as int64.
    Paged: the block comes from the block table (row BT of it), clamped to [0, n_blocks - 1];
    dense: the block is the sequence, the row the position."""
    c = tl.minimum(cols, L - 1)
    if PAGED:
        if PAGE_SIZE >= BLOCK_N:  # the whole tile is in one page: one table entry
            blk = tl.load(BT + (start_n // PAGE_SIZE) * sbtn)
            blk = tl.minimum(tl.maximum(blk, 0), n_blocks - 1).to(tl.int64)
            blk = tl.broadcast_to(blk, [BLOCK_N])
        else:
            blk = tl.load(BT + (c // PAGE_SIZE) * sbtn)
            blk = tl.minimum(tl.maximum(blk, 0), n_blocks - 1).to(tl.int64)
        row = (c % PAGE_SIZE).to(tl.int64)
    else:
        blk = tl.broadcast_to(b64, [BLOCK_N])
        row = c.to(tl.int64)
    return blk, row


@triton.jit
def _decode_tile(acc, l_i, m_i, q, K, V, KS, VS, BT, start_n, L, qpos, offs_n, offs_d,
                  b64, n_blocks, shift, wl, wr, qk_scale, cap_scale,
                  skn, skp, skd, svn, svp, svd, sksn, sksp, svsn, svsp, sbtn,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
                  MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                  SCALE_K: tl.constexpr, SCALE_V: tl.constexpr, PREC: tl.constexpr):
    """One sub-tile of SUB_N keys from ``start_n``: the online-softmax update."""
    dmask = offs_d < HEAD_DIM
    cols = start_n + offs_n
    blk, row = _key_rows(BT, start_n, cols, L, b64, n_blocks, sbtn, PAGE_SIZE, PAGED,
                         SUB_N)
    k_ptrs = K + (blk * skn + row * skp)[:, None] + offs_d[None, :] * skd
    if HEAD_DIM == BLOCK_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=dmask[None, :], other=0.0)
    if k.dtype != q.dtype:  # fp8 cache: to the query's dtype in registers
        k = _from_fp8(k, q.dtype)
    qk = _dot(q, tl.trans(k), input_precision=PREC)
    if SCALE_K == 2:  # per token and head
        ks = tl.load(KS + blk * sksn + row * sksp)
        qk = qk * ks[None, :]
    s = _softcap(qk, qk_scale, cap_scale, SOFTCAP)
    if MASKED:
        ok = (cols < L)[None, :]
        if MASK_HI:
            ok = ok & (cols[None, :] <= qpos[:, None] + shift + wr)
        if MASK_LO:
            ok = ok & (cols[None, :] >= qpos[:, None] + shift - wl)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row that has seen no visible key keeps m = -inf: subtract 0 instead
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v_ptrs = V + (blk * svn + row * svp)[:, None] + offs_d[None, :] * svd
    if HEAD_DIM == BLOCK_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=dmask[None, :], other=0.0)
    if v.dtype != q.dtype:
        v = _from_fp8(v, q.dtype)
    if SCALE_V == 2:
        vs = tl.load(VS + blk * svsn + row * svsp)
        p = p * vs[None, :]
    acc = _dot(p.to(q.dtype), v, acc, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def _decode_tiles(acc, l_i, m_i, q, K, V, KS, VS, BT, start, end, L, qpos, offs_n, offs_d,
                  b64, n_blocks, shift, wl, wr, qk_scale, cap_scale,
                  skn, skp, skd, svn, svp, svd, sksn, sksp, svsn, svsp, sbtn,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  SUB_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
                  MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                  SCALE_K: tl.constexpr, SCALE_V: tl.constexpr, PREC: tl.constexpr):
    """Online softmax over the key tiles [start, end) (multiples of BLOCK_N); MASKED tiles
    evaluate visibility, the others are fully visible to every row. A tile is taken in
    BLOCK_N // SUB_N sub-tiles of SUB_N keys (``offs_n`` is SUB_N long): the loads of a whole
    tile are issued together (the pipeline streams tiles), but only one sub-tile's converted
    operands are live in registers at a time (fp8 caches: see DecodeConfig)."""
    for start_t in range(start, end, BLOCK_N):
        for j in tl.static_range(BLOCK_N // SUB_N):
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, K, V, KS, VS, BT, start_t + j * SUB_N, L, qpos, offs_n, offs_d,
                b64, n_blocks, shift, wl, wr, qk_scale, cap_scale, skn, skp, skd, svn, svp, svd,
                sksn, sksp, svsn, svsp, sbtn, HEAD_DIM, BLOCK_D, SUB_N, PAGE_SIZE, PAGED, MASKED,
                MASK_LO, MASK_HI, SOFTCAP, SCALE_K, SCALE_V, PREC)
    return acc, l_i, m_i


@triton.jit
def _decode_split_kernel(
    Q, K, V, KS, VS, SEQLENS, BT, O, LSE,
    sqb, sqs, sqh, sqd, skn, skp, skh, skd, svn, svp, svh, svd,
    sksn, sksp, sksh, svsn, svsp, svsh, s_len, sbtb, sbtn,
    sob, sos, soh, sod, slb, slh, sls, sos_split, sls_split,
    seqlen_q, max_len, n_blocks, GROUP, num_splits, qk_scale, cap_scale, wl, wr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
    MASK_LO: tl.constexpr, MASK_HI: tl.constexpr, SOFTCAP: tl.constexpr,
    SCALE_K: tl.constexpr, SCALE_V: tl.constexpr, PREC: tl.constexpr,
):
    """One program: the packed rows of one M tile of one (sequence, kv head), over split
    ``s`` of its keys. Grid (num_splits * M tiles, heads_kv, batch), M tiles fastest.

    Q: (batch, seqlen_q, heads_q, head_dim) strides ``sq*``; K, V: blocks x rows x heads x dim
    (dense: the block is the sequence) strides ``sk*`` / ``sv*``; KS, VS: per-tensor scale
    (SCALE_* = 1, a 0-d tensor) or per (block, row, head) (SCALE_* = 2, strides ``sks*`` /
    ``svs*``); SEQLENS (batch,) int32; BT: block table (``sbtb``, ``sbtn``), PAGED only.
    O, LSE: with one split the final output (O like Q, LSE (batch, heads_q, seqlen_q));
    with several, float32 partials whose split index has strides ``sos_split`` /
    ``sls_split`` and whose other strides follow the same (batch, query, head, dim) names.
    ``qk_scale`` = softmax scale * log2(e) (softcap: cap * log2(e); ``cap_scale`` = scale /
    cap); ``wl``, ``wr`` the window (used when MASK_LO / MASK_HI; causal is wr = 0)."""
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    n_m = tl.num_programs(0) // num_splits
    split = pid // n_m
    mb = pid % n_m
    b64 = b.to(tl.int64)
    L = tl.load(SEQLENS + b64 * s_len)
    L = tl.minimum(tl.maximum(L, 0), max_len)
    shift = L - seqlen_q
    n_rows = seqlen_q * GROUP

    # packed rows: query position i = r // GROUP, head hk * GROUP + r % GROUP
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    qpos = rows // GROUP
    heads = (hk * GROUP + rows % GROUP).to(tl.int64)
    offs_n = tl.arange(0, SUB_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    q_off = b64 * sqb + qpos.to(tl.int64) * sqs + heads * sqh
    q = tl.load(Q + q_off[:, None] + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & dmask[None, :], other=0.0)

    # the key range of this M tile: [lo, hi), fully visible to every row in [full_lo, full_hi)
    i_lo = (mb * BLOCK_M) // GROUP
    i_hi = (tl.minimum(mb * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
    lo = 0
    hi = L
    full_lo = 0
    full_end = L
    if MASK_LO:
        lo = (tl.maximum(i_lo + shift - wl, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(i_hi + shift - wl, 0)
        full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    if MASK_HI:
        hi = tl.minimum(L, tl.maximum(i_hi + shift + wr + 1, 0))
        full_end = tl.minimum(L, tl.maximum(i_lo + shift + wr + 1, 0))
    hi = tl.maximum(hi, lo)
    # this split's run of tiles
    n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
    per = (n_tiles + num_splits - 1) // num_splits
    t0 = tl.minimum(lo + split * per * BLOCK_N, hi)
    t1 = tl.minimum(t0 + per * BLOCK_N, hi)
    a = tl.minimum(tl.maximum(full_lo, t0), t1)
    full_hi = (full_end // BLOCK_N) * BLOCK_N
    c = tl.minimum(tl.maximum(full_hi, a), t1)

    KS += hk.to(tl.int64) * sksh
    VS += hk.to(tl.int64) * svsh
    Kh = K + hk.to(tl.int64) * skh
    Vh = V + hk.to(tl.int64) * svh
    BTb = BT + b64 * sbtb
    if SCALE_K == 1:  # per tensor: folded into the score scale
        ks0 = tl.load(KS)
        if SOFTCAP:
            cap_scale = cap_scale * ks0
        else:
            qk_scale = qk_scale * ks0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, Kh, Vh, KS, VS, BTb, t0, a, L, qpos, offs_n, offs_d, b64, n_blocks,
        shift, wl, wr, qk_scale, cap_scale, skn, skp, skd, svn, svp, svd, sksn, sksp, svsn,
        svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED, True, MASK_LO, MASK_HI,
        SOFTCAP, SCALE_K, SCALE_V, PREC)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, Kh, Vh, KS, VS, BTb, a, c, L, qpos, offs_n, offs_d, b64, n_blocks,
        shift, wl, wr, qk_scale, cap_scale, skn, skp, skd, svn, svp, svd, sksn, sksp, svsn,
        svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED, False, MASK_LO, MASK_HI,
        SOFTCAP, SCALE_K, SCALE_V, PREC)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, Kh, Vh, KS, VS, BTb, c, t1, L, qpos, offs_n, offs_d, b64, n_blocks,
        shift, wl, wr, qk_scale, cap_scale, skn, skp, skd, svn, svp, svd, sksn, sksp, svsn,
        svsp, sbtn, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N, PAGE_SIZE, PAGED, True, MASK_LO, MASK_HI,
        SOFTCAP, SCALE_K, SCALE_V, PREC)

    empty = l_i == 0.0  # no visible key in this split: O = 0, lse = -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if SCALE_V == 1:
        out = out * tl.load(VS)
    lse = tl.where(empty, float("-inf"),
                   (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    split64 = split.to(tl.int64)
    o_off = b64 * sob + qpos.to(tl.int64) * sos + heads * soh + split64 * sos_split
    tl.store(O + o_off[:, None] + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])
    l_off = b64 * slb + heads * slh + qpos.to(tl.int64) * sls + split64 * sls_split
    tl.store(LSE + l_off, lse, mask=row_ok)


@triton.jit
def _merge_rows(OA, LA, OB, LB, O, LSE, n_parts, sa_part, sla_part,
                a_off, la_off, b_off, lb_off, o_off, l_off, sad, sbd, sod,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                TWO: tl.constexpr):
    """One output row from ``n_parts`` partial rows (stride ``sa_part`` / ``sla_part`` between
    parts of A) or, with TWO, from one row of A and one of B: O = sum_s w_s O_s / sum_s w_s
    with w_s = exp(lse_s - max lse), lse = max + log(sum w); all -inf gives O = 0, -inf."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    if TWO:
        la = tl.load(LA + la_off)
        lb = tl.load(LB + lb_off)
        m = tl.maximum(la, lb)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m_use)
        wb = tl.exp(lb - m_use)
        tot = wa + wb
        oa = tl.load(OA + a_off + offs_d * sad, mask=dmask, other=0.0).to(tl.float32)
        ob = tl.load(OB + b_off + offs_d * sbd, mask=dmask, other=0.0).to(tl.float32)
        # a part whose weight is 0 contributes nothing (even where its O is not finite)
        acc = tl.where(wa > 0.0, wa * oa, 0.0) + tl.where(wb > 0.0, wb * ob, 0.0)
    else:
        offs_s = tl.arange(0, BLOCK_S)
        m = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, n_parts, BLOCK_S):
            sidx = s0 + offs_s
            ls = tl.load(LA + la_off + sidx.to(tl.int64) * sla_part, mask=sidx < n_parts,
                         other=float("-inf"))
            m = tl.maximum(m, ls)
        m = tl.max(m, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BLOCK_D], tl.float32)
        tot_v = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, n_parts, BLOCK_S):
            sidx = s0 + offs_s
            smask = sidx < n_parts
            ls = tl.load(LA + la_off + sidx.to(tl.int64) * sla_part, mask=smask,
                         other=float("-inf"))
            w = tl.exp(ls - m_use)
            tot_v += w
            o = tl.load(OA + a_off + sidx.to(tl.int64)[:, None] * sa_part
                        + offs_d[None, :] * sad, mask=smask[:, None] & dmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0), 0)
        tot = tl.sum(tot_v, 0)
    empty = tot == 0.0
    out = acc / tl.where(empty, 1.0, tot)
    lse = tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, tot)))
    tl.store(O + o_off + offs_d * sod, out.to(O.dtype.element_ty), mask=dmask)
    tl.store(LSE + l_off, lse)


@triton.jit
def _decode_combine_kernel(
    OP, LP, O, LSE, sopb, sops, soph, sopk, sopd, slpb, slph, slps, slpk,
    sob, sos, soh, sod, slb, slh, sls, H, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program: one (sequence, query, head) row of O and LSE from the ``num_splits``
    float32 partials. Grid (seqlen_q * heads_q, batch)."""
    pid = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    i = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    _merge_rows(OP, LP, OP, LP, O, LSE, num_splits, sopk, slpk,
                b64 * sopb + i * sops + h * soph, b64 * slpb + h * slph + i * slps, 0, 0,
                b64 * sob + i * sos + h * soh, b64 * slb + h * slh + i * sls,
                sopd, sopd, sod, HEAD_DIM, BLOCK_D, BLOCK_S, False)


@triton.jit
def _merge_states_kernel(
    OA, LA, OB, LB, O, LSE,
    sab, sas, sah, sad, slab, slah, slas, sbb, sbs, sbh, sbd, slbb, slbh, slbs,
    sob, sos, soh, sod, slb, slh, sls, H,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: one (batch, query, head) row of merge_attention_states. Grid
    (seqlen * heads, batch)."""
    pid = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    i = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    _merge_rows(OA, LA, OB, LB, O, LSE, 2, 0, 0,
                b64 * sab + i * sas + h * sah, b64 * slab + h * slah + i * slas,
                b64 * sbb + i * sbs + h * sbh, b64 * slbb + h * slbh + i * slbs,
                b64 * sob + i * sos + h * soh, b64 * slb + h * slh + i * sls,
                sad, sbd, sod, HEAD_DIM, BLOCK_D, 1, True)


@triton.jit
def _append_kv_kernel(
    X, XC, XS, SLOT, n_slots, page_size,
    sxt, sxh, sxd, scn, scp, sch, scd, ssn, ssp, ssh, s_slot, HKV,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program: token t's (heads, head_dim) of X written to slot SLOT[t] of the cache XC
    (blocks x rows x heads x dim; slot = block * page_size + row). A slot < 0 or >= n_slots
    is skipped. QUANT 1: fp8 with the per-tensor scale XS (x / scale, saturated to +-448);
    QUANT 2: fp8 with per-(block, row, head) scales amax / 448 computed here and stored to XS.
    Grid (tokens, head blocks)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + t * s_slot).to(tl.int64)
    if (slot < 0) | (slot >= n_slots):
        return
    blk = slot // page_size
    row = slot % page_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = heads < HKV
    mask = hmask[:, None] & (offs_d < HEAD_DIM)[None, :]
    h64 = heads.to(tl.int64)
    x = tl.load(X + t * sxt + h64[:, None] * sxh + offs_d[None, :] * sxd, mask=mask, other=0.0)
    dst = XC + blk * scn + row * scp + h64[:, None] * sch + offs_d[None, :] * scd
    if QUANT == 0:
        tl.store(dst, x.to(XC.dtype.element_ty), mask=mask)
    else:
        xf = x.to(tl.float32)
        if QUANT == 1:
            y = xf / tl.load(XS)
        else:
            amax = tl.max(tl.abs(xf), 1)
            sc = tl.where(amax > 0.0, amax / 448.0, 1.0)
            tl.store(XS + blk * ssn + row * ssp + h64 * ssh, sc, mask=hmask)
            y = xf / sc[:, None]
        y = _saturate_fp8(y)
        tl.store(dst, _fp8_keep_nan(y), mask=mask)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _values_checked(t: torch.Tensor) -> bool:
    from tkit.kernels import _offsets

    return _offsets.values_checked(t)


def _check_scale(s, name: str, cache: torch.Tensor, cache_name: str) -> int:
    """0 (none), 1 (per tensor) or 2 (per token and head) for an fp8 cache's scale."""
    if s is None:
        return 0
    C.check_tensor(s, name, (torch.float32,))
    if cache.dtype != FP8:
        raise ValueError(f"{name} is given but {cache_name} is {C.dtype_name(cache.dtype)}; "
                         "scales go with float8_e4m3fn caches")
    if s.ndim == 0:
        return 1
    if tuple(s.shape) != tuple(cache.shape[:-1]):
        raise ValueError(f"{name} must be a 0-d float32 tensor (per tensor) or shaped like "
                         f"{cache_name} without head_dim {tuple(cache.shape[:-1])} (per token "
                         f"and head), got shape {tuple(s.shape)}")
    return 2


def _check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale,
                  window_size, softcap, softmax_scale, num_splits):
    C.check_tensor(q, "q", Q_DTYPES, ndim=4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        C.check_tensor(t, name, CACHE_DTYPES, ndim=4)
    C.check_tensor(cache_seqlens, "cache_seqlens", (torch.int32,), ndim=1)
    C.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                        block_table=block_table, k_scale=k_scale, v_scale=v_scale)
    b, sq, hq, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must share a dtype, got "
                        f"{C.dtype_name(k_cache.dtype)} and {C.dtype_name(v_cache.dtype)}")
    if k_cache.dtype != FP8 and k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache has dtype {C.dtype_name(k_cache.dtype)} but q has "
                        f"{C.dtype_name(q.dtype)}: a 16-bit cache must match q's dtype "
                        "(float8_e4m3fn caches take any q dtype)")
    if b > 65535:  # the grid's batch axis (CUDA's limit on grid y and z)
        raise ValueError(f"q: batch = {b} is more than 65535 sequences a call")
    if not 1 <= sq <= MAX_SEQLEN_Q:
        raise ValueError(f"q: seqlen_q = {sq} (q.shape[1]) must be from 1 to {MAX_SEQLEN_Q}")
    if k_cache.shape[-1] != d:
        raise ValueError(f"q and k_cache must have the same head_dim, got {d} and "
                         f"{k_cache.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim {d} is not supported (1 to {MAX_HEAD_DIM})")
    hk = k_cache.shape[2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hk} key/value heads of "
                         "k_cache (GQA/MQA needs heads_q = group * heads_kv)")
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must have batch = {b} entries, got shape "
                         f"{tuple(cache_seqlens.shape)}")
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"k_cache is dense (no block_table): (batch, max_len, heads_kv, "
                             f"head_dim) with batch = {b}, got shape {tuple(k_cache.shape)}")
        max_len = k_cache.shape[1]
    else:
        C.check_tensor(block_table, "block_table", (torch.int32,), ndim=2)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must be (batch = {b}, max_blocks), got shape "
                             f"{tuple(block_table.shape)}")
        p = k_cache.shape[1]
        if not (1 <= p <= 256 and p & (p - 1) == 0):
            raise ValueError(f"k_cache: page_size = {p} (k_cache.shape[1]) must be a power of "
                             "2 from 1 to 256")
        max_len = block_table.shape[1] * p
    ks = _check_scale(k_scale, "k_scale", k_cache, "k_cache")
    vs = _check_scale(v_scale, "v_scale", v_cache, "v_cache")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(int(w) != w or w < -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, "
                         f"got {window_size!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 turns it off), got {softcap}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    if num_splits is not None and (int(num_splits) != num_splits or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1 (or None: chosen), got {num_splits!r}")
    if _values_checked(cache_seqlens):
        _check_decode_values(k_cache, cache_seqlens, block_table, max_len)
    return ks, vs, max_len


def _check_decode_values(k_cache, cache_seqlens, block_table, max_len) -> None:
    """The values of ``cache_seqlens`` (and of the pages they use in ``block_table``), read on
    the host: called where :func:`_values_checked` says so."""
    lens = cache_seqlens.tolist()
    for i, n in enumerate(lens):
        if not 0 <= n <= max_len:
            what = "k_cache.shape[1]" if block_table is None else \
                "block_table.shape[1] * page_size"
            raise ValueError(f"cache_seqlens[{i}] = {n} is outside [0, {what} = {max_len}]")
    if block_table is not None and _values_checked(block_table):
        p, nb = k_cache.shape[1], k_cache.shape[0]
        rows = block_table.tolist()
        for i, n in enumerate(lens):
            for j in range((n + p - 1) // p):
                if not 0 <= rows[i][j] < nb:
                    raise ValueError(f"block_table[{i}, {j}] = {rows[i][j]} is outside "
                                     f"[0, num_blocks = {nb}) (a page of the "
                                     f"{n} tokens of sequence {i})")


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def plan_splits(q, k_cache, block_table, num_splits: int = 0,
                config: DecodeConfig | None = None) -> tuple[int, DecodeConfig, int, int]:
    """(num_splits, config, BLOCK_M, M tiles) for a call, from shapes only (never the lengths:
    no host sync)."""
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    cfg = config or current_config(d, k_cache.element_size())
    n_rows = sq * (hq // hk)
    block_m = max(16, min(C.next_power_of_2(n_rows), cfg.block_m))
    n_m = C.cdiv(n_rows, block_m)
    if block_table is None:
        max_len = k_cache.shape[1]
    else:
        max_len = block_table.shape[1] * k_cache.shape[1]
    n_tiles = C.cdiv(max_len, cfg.block_n)
    splits = num_splits or cfg.num_splits
    if not splits:
        kv_bytes = 2 * max_len * d * k_cache.element_size()
        splits = choose_num_splits(b * hk * n_m, n_tiles, D.sm_count(q.device),
                                   ctas_per_sm=cfg.ctas_per_sm,
                                   min_splits=C.cdiv(kv_bytes, cfg.split_bytes))
    splits = max(1, min(int(splits), MAX_SPLITS, max(n_tiles, 1)))
    return splits, cfg, block_m, n_m


def _decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, scale,
                 window_left, window_right, softcap, num_splits=0, config=None):
    """Launch the decode kernels; returns (out, lse). ``window_right`` already 0 when causal.
    Arguments are not validated here (the public function does it)."""
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    paged = block_table is not None
    out = C.empty(q.shape, q.dtype, q.device)
    lse = C.empty((b, hq, sq), torch.float32, q.device)
    if b == 0 or hq == 0 or sq == 0:
        return out, lse
    splits, cfg, block_m, n_m = plan_splits(q, k_cache, block_table, num_splits, config)
    if paged:
        max_len = block_table.shape[1] * k_cache.shape[1]
        page, n_blocks = k_cache.shape[1], k_cache.shape[0]
        bt, bt_strides = block_table, block_table.stride()
    else:
        max_len, page, n_blocks = k_cache.shape[1], 1, b
        bt, bt_strides = cache_seqlens, (0, 0)
    block_d = max(16, C.next_power_of_2(d))
    sub_n = min(cfg.sub_n or cfg.block_n, cfg.block_n)  # an override of block_n alone
    if sub_n < 16 or cfg.block_n % sub_n or sub_n & (sub_n - 1):
        raise ValueError(f"DecodeConfig: sub_n = {cfg.sub_n} must be a power of 2 >= 16 that "
                         f"divides block_n = {cfg.block_n}")
    scale_k = 0 if k_scale is None else (1 if k_scale.ndim == 0 else 2)
    scale_v = 0 if v_scale is None else (1 if v_scale.ndim == 0 else 2)
    ks_strides = k_scale.stride() if scale_k == 2 else (0, 0, 0)
    vs_strides = v_scale.stride() if scale_v == 2 else (0, 0, 0)
    if softcap > 0.0:
        qk_scale, cap_scale = softcap * LOG2E, scale / softcap
    else:
        qk_scale, cap_scale = scale * LOG2E, 1.0
    if splits == 1:
        o_part, l_part = out, lse
        o_st, l_st = out.stride(), lse.stride()
        o_split, l_split = 0, 0
    else:
        # scratch: written in full by the split kernel before the combine reads it (an eager
        # plan allocates it afresh per call)
        o_part = C.scratch((b, sq, hq, splits, d), torch.float32, q.device)
        l_part = C.scratch((b, hq, sq, splits), torch.float32, q.device)
        s = o_part.stride()
        o_st, o_split = (s[0], s[1], s[2], s[4]), s[3]
        s = l_part.stride()
        l_st, l_split = s[:3], s[3]
    C.launch(
        _decode_split_kernel, (splits * n_m, hk, b),
        Q=q, K=k_cache, V=v_cache, KS=k_scale if scale_k else q, VS=v_scale if scale_v else q,
        SEQLENS=cache_seqlens, BT=bt, O=o_part, LSE=l_part,
        **_named("sq", q.stride(), "bshd"), **_named("sk", k_cache.stride(), "nphd"),
        **_named("sv", v_cache.stride(), "nphd"), **_named("sks", ks_strides, "nph"),
        **_named("svs", vs_strides, "nph"), s_len=cache_seqlens.stride(0),
        sbtb=bt_strides[0], sbtn=bt_strides[1],
        **_named("so", o_st, "bshd"), **_named("sl", l_st, "bhs"),
        sos_split=o_split, sls_split=l_split,
        seqlen_q=sq, max_len=max_len, n_blocks=n_blocks, GROUP=hq // hk, num_splits=splits,
        qk_scale=qk_scale, cap_scale=cap_scale, wl=max(window_left, 0),
        wr=max(window_right, 0),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        SUB_N=sub_n, PAGE_SIZE=page,
        PAGED=paged, MASK_LO=window_left >= 0, MASK_HI=window_right >= 0,
        SOFTCAP=softcap > 0.0, SCALE_K=scale_k, SCALE_V=scale_v,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        sp = o_part.stride()
        lp = l_part.stride()
        C.launch(
            _decode_combine_kernel, (sq * hq, b),
            OP=o_part, LP=l_part, O=out, LSE=lse,
            sopb=sp[0], sops=sp[1], soph=sp[2], sopk=sp[3], sopd=sp[4],
            slpb=lp[0], slph=lp[1], slps=lp[2], slpk=lp[3],
            **_named("so", out.stride(), "bshd"), **_named("sl", lse.stride(), "bhs"),
            H=hq, num_splits=splits, HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_S=min(16, C.next_power_of_2(splits)), num_warps=4,
        )
    return out, lse


def _named(prefix, strides, dims):
    return {f"{prefix}{c}": s for c, s in zip(dims, strides)}


def _append_impl(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    t, hk, d = k.shape
    if t == 0 or hk == 0:
        return
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    block_d = max(16, C.next_power_of_2(d))
    block_h = max(1, min(C.next_power_of_2(hk), max(1, 4096 // block_d)))
    for x, xc, xs in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        quant = 0 if xc.dtype != FP8 else (1 if xs is None or xs.ndim == 0 else 2)
        if quant == 1 and xs is None:  # an fp8 cache without a scale: scale 1
            xs = torch.ones((), dtype=torch.float32, device=x.device)
        ss = xs.stride() if quant == 2 else (0, 0, 0)
        C.launch(_append_kv_kernel, (t, C.cdiv(hk, block_h)),
                 X=x, XC=xc, XS=xs if xs is not None else x, SLOT=slot_mapping,
                 n_slots=n_slots, page_size=xc.shape[1],
                 **_named("sx", x.stride(), "thd"), **_named("sc", xc.stride(), "nphd"),
                 **_named("ss", ss, "nph"), s_slot=slot_mapping.stride(0), HKV=hk,
                 HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h, QUANT=quant, num_warps=4)


def _merge_impl(o_a, lse_a, o_b, lse_b):
    squeeze = o_a.ndim == 3  # (tokens, heads, dim) with lse (heads, tokens): batch of 1
    if squeeze:
        o_a, o_b, lse_a, lse_b = o_a[None], o_b[None], lse_a[None], lse_b[None]
    b, s, h, d = o_a.shape
    out = C.empty(o_a.shape, o_a.dtype, o_a.device)
    lse = C.empty((b, h, s), torch.float32, o_a.device)
    if out.numel() or lse.numel():
        if d == 0:
            raise ValueError("o_a: head_dim must be >= 1")
        C.launch(_merge_states_kernel, (s * h, b),
                 OA=o_a, LA=lse_a, OB=o_b, LB=lse_b, O=out, LSE=lse,
                 **_named("sa", o_a.stride(), "bshd"), **_named("sla", lse_a.stride(), "bhs"),
                 **_named("sb", o_b.stride(), "bshd"), **_named("slb", lse_b.stride(), "bhs"),
                 **_named("so", out.stride(), "bshd"), **_named("sl", lse.stride(), "bhs"),
                 H=h, HEAD_DIM=d, BLOCK_D=max(16, C.next_power_of_2(d)), num_warps=1)
    if squeeze:
        return out[0], lse[0]
    return out, lse


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("tkit::decode_attention", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],  # noqa: UP045
               k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],  # noqa: UP045
               softmax_scale: float, window_left: int, window_right: int, softcap: float,
               num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale,
                        softmax_scale, window_left, window_right, softcap, num_splits)


@_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, softmax_scale,
      window_left, window_right, softcap, num_splits):
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("tkit::append_kv", mutates_args=("k_cache", "v_cache", "k_scale",
                                                          "v_scale"))
def _append_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor],  # noqa: UP045
               v_scale: Optional[torch.Tensor]) -> None:  # noqa: UP045
    _append_impl(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_append_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    return None


@torch.library.custom_op("tkit::merge_attention_states", mutates_args=())
def _merge_op(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _merge_impl(o_a, lse_a, o_b, lse_b)


@_merge_op.register_fake
def _(o_a, lse_a, o_b, lse_b):
    if o_a.ndim == 3:
        return o_a.new_empty(o_a.shape), o_a.new_empty((o_a.shape[1], o_a.shape[0]),
                                                       dtype=torch.float32)
    b, s, h, _ = o_a.shape
    return o_a.new_empty(o_a.shape), o_a.new_empty((b, h, s), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None,
                     softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                     k_scale=None, v_scale=None, num_splits=None, return_lse=False):
    """Attention of a few new tokens per sequence over a KV cache (dense or paged).

    Parameters
    ----------
    q : Tensor (batch, seqlen_q, heads_q, head_dim), float16, bfloat16 (float32 for tests)
        seqlen_q from 1 to 16; the new tokens are the last seqlen_q positions of each sequence.
    k_cache, v_cache : Tensor
        Dense (batch, max_len, heads_kv, head_dim) when ``block_table`` is None; paged
        (num_blocks, page_size, heads_kv, head_dim) otherwise, page_size a power of 2 from 1
        to 256. q's dtype, or float8_e4m3fn (dequantized in-kernel with ``k_scale`` /
        ``v_scale``). heads_q must be a multiple of heads_kv (GQA/MQA). Any strides.
    cache_seqlens : int32 Tensor (batch,), on the device
        Valid tokens per sequence, the new ones included; 0 gives out = 0 and lse = -inf.
    block_table : int32 Tensor (batch, max_blocks), optional
        Page j of sequence b is block ``block_table[b, j]``; any order, pages may be shared.
    softmax_scale : float, optional
        Default 1/sqrt(head_dim).
    causal : bool
        Bottom-right causal mask among the new tokens (query i sees keys up to position
        ``cache_seqlens - seqlen_q + i``).
    window_size : (int, int)
        Sliding window (left, right), -1 unbounded, as in :func:`tkit.flash_attention`.
    softcap : float
        When > 0, scores become ``softcap * tanh(scores / softcap)``.
    k_scale, v_scale : float32 Tensor, optional
        For float8_e4m3fn caches: 0-d (per tensor), or shaped like the cache without head_dim
        (per token and head). The value is ``cache.float() * scale``.
    num_splits : int, optional
        Split-KV count; default chosen from the SM count, batch, heads and the largest
        possible length (the cache's shape), never from ``cache_seqlens`` (no host sync: the
        call can be captured in a CUDA graph and replayed with new lengths and tables).
    return_lse : bool
        Also return the log-sum-exp of each row's scores, float32 (batch, heads_q, seqlen_q).

    Values of ``cache_seqlens`` and ``block_table`` are checked where that costs no sync (host
    tensors) or under TKIT_CHECK=1; unchecked, out-of-range values are clamped in-kernel (a
    length to [0, max_len], a block index to [0, num_blocks - 1]) and never read outside the
    cache.

    Returns
    -------
    out : Tensor like q; or (out, lse).
    """
    if (P.ON and type(q) is _T and type(k_cache) is _T and type(v_cache) is _T
            and type(cache_seqlens) is _T and type(block_table) in _OPT_T
            and type(k_scale) in _OPT_T and type(v_scale) in _OPT_T
            and not _OVERRIDES.active() and not _compiling()
            and not (_grad_enabled() and q.requires_grad)):
        # the eager plan (tkit.kernels._plan): the key holds all the ordinary path reads (the
        # SM count and config follow from the device index and the shapes)
        dev, stream = _L._device_stream()
        key = (causal, softmax_scale, window_size, softcap, num_splits, dev, _sig(q),
               _sig(k_cache), _sig(v_cache), _sig(cache_seqlens), _sig(block_table),
               _sig(k_scale), _sig(v_scale))
        try:
            plan = _plans.get(key)
        except TypeError:  # an unhashable option: the ordinary path names it
            plan = False
        if plan:
            if _env.CHECK or not cache_seqlens.is_cuda:  # values are read per call
                _check_decode_values(k_cache, cache_seqlens, block_table,
                                     k_cache.shape[1] if block_table is None
                                     else block_table.shape[1] * k_cache.shape[1])
            out_lse = plan(stream, q, k_cache, v_cache, cache_seqlens, block_table, k_scale,
                           v_scale)
            if out_lse is not None:
                return out_lse if return_lse else out_lse[0]
        elif plan is None:
            P.stats["plan_miss"] += 1
            with P.recording() as rec:
                out_lse = _decode_slow(q, k_cache, v_cache, cache_seqlens, block_table,
                                       softmax_scale, causal, window_size, softcap, k_scale,
                                       v_scale, num_splits)
            P.store(_plans, key, rec, (q, k_cache, v_cache, cache_seqlens, block_table,
                                       k_scale, v_scale), out_lse)
            return out_lse if return_lse else out_lse[0]
    out, lse = _decode_slow(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                            causal, window_size, softcap, k_scale, v_scale, num_splits)
    return (out, lse) if return_lse else out


_T = torch.Tensor
_OPT_T = (torch.Tensor, type(None))
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()


def _sig(t):
    """What Triton and the ordinary path read of one (optional) tensor argument."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.get_device(), not t.data_ptr() & 15


def _decode_slow(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal,
                 window_size, softcap, k_scale, v_scale, num_splits):
    """(out, lse) through validation and the launcher (the registered op when needed)."""
    _check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale,
                  window_size, softcap, softmax_scale, num_splits)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    wl, wr = (int(w) for w in window_size)
    if causal:
        wr = 0
    splits = int(num_splits) if num_splits is not None else 0
    args = (q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, scale, wl, wr,
            float(softcap), splits)
    if C.use_direct_path(q):
        return _decode_impl(*args)
    return _decode_op(*args)


def append_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Write new tokens' keys and values into a (paged) KV cache, in place.

    Parameters
    ----------
    k, v : Tensor (tokens, heads_kv, head_dim)
    k_cache, v_cache : Tensor (num_blocks, page_size, heads_kv, head_dim)
        (a dense (batch, max_len, ...) cache is the same with page_size = max_len). A
        float8_e4m3fn cache is written quantized: ``x / scale`` saturated to +-448.
    slot_mapping : int64 Tensor (tokens,)
        slot = block * page_size + offset; -1 skips a token (a slot outside the cache is
        skipped too, and is an error where the values are checked).
    k_scale, v_scale : float32 Tensor, optional (fp8 caches)
        0-d: the given per-tensor scale; shaped like the cache without head_dim: per token and
        head, computed here (amax over head_dim / 448) and stored at the token's slot.
    """
    if (P.ON and type(k) is _T and type(v) is _T and type(k_cache) is _T
            and type(v_cache) is _T and type(slot_mapping) is _T and type(k_scale) in _OPT_T
            and type(v_scale) in _OPT_T and not _compiling()
            and not (_grad_enabled() and (k.requires_grad or v.requires_grad))):
        # the eager plan: no outputs, the launches write the caches (and per-token scales)
        dev, stream = _L._device_stream()
        key = (dev, _sig(k), _sig(v), _sig(k_cache), _sig(v_cache), _sig(slot_mapping),
               _sig(k_scale), _sig(v_scale))
        plan = _append_plans.get(key)
        args = (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        if plan:
            if _env.CHECK or not slot_mapping.is_cuda:  # values are read per call
                _check_slot_values(slot_mapping, k_cache)
            if plan(stream, *args) is not None:
                return
        elif plan is None:
            P.stats["plan_miss"] += 1
            with P.recording() as rec:
                _append_slow(*args)
            P.store(_append_plans, key, rec, args, ())
            return
    _append_slow(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


_append_plans = P.new_cache()


def _append_slow(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    append_kv_checks(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if C.use_direct_path(k, v):
        _append_impl(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        _append_op(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def append_kv_checks(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """The validation of :func:`append_kv` (shared with :func:`tkit.rope_append_kv`)."""
    C.check_tensor(k, "k", Q_DTYPES, ndim=3)
    C.check_tensor(v, "v", Q_DTYPES, ndim=3)
    C.check_tensor(k_cache, "k_cache", CACHE_DTYPES, ndim=4)
    C.check_tensor(v_cache, "v_cache", CACHE_DTYPES, ndim=4)
    C.check_tensor(slot_mapping, "slot_mapping", (torch.int64,), ndim=1)
    C.check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                        k_scale=k_scale, v_scale=v_scale)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k is (tokens, heads_kv, head_dim) = {tuple(k.shape)} but k_cache "
                         f"holds (heads_kv, head_dim) = {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must have one slot per token ({k.shape[0]}), got "
                         f"shape {tuple(slot_mapping.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != FP8 and cache.dtype != k.dtype:
            raise TypeError(f"{name} has dtype {C.dtype_name(cache.dtype)} but k has "
                            f"{C.dtype_name(k.dtype)}")
    _check_scale(k_scale, "k_scale", k_cache, "k_cache")
    _check_scale(v_scale, "v_scale", v_cache, "v_cache")
    if _values_checked(slot_mapping):
        _check_slot_values(slot_mapping, k_cache)


def _check_slot_values(slot_mapping, k_cache) -> None:
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if not -1 <= s < n_slots:
            raise ValueError(f"slot_mapping[{i}] = {s} is outside [0, num_blocks * "
                             f"page_size = {n_slots}) (and not -1: skip)")


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """Combine two partial attentions over disjoint key sets (shared prefix + suffix, cascade
    decoding, split-KV): ``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a - lse) o_a +
    exp(lse_b - lse) o_b``; both -inf gives o = 0, lse = -inf.

    Parameters
    ----------
    o_a, o_b : Tensor (batch, seqlen, heads, head_dim) (or (tokens, heads, head_dim))
    lse_a, lse_b : float32 Tensor (batch, heads, seqlen) (or (heads, tokens)), as returned by
        ``decode_attention(..., return_lse=True)`` / :func:`tkit.flash_attention`.

    Returns
    -------
    (o, lse): o in o_a's dtype, lse float32.
    """
    if (P.ON and type(o_a) is _T and type(lse_a) is _T and type(o_b) is _T
            and type(lse_b) is _T and not _compiling()
            and not (_grad_enabled() and (o_a.requires_grad or o_b.requires_grad
                                          or lse_a.requires_grad or lse_b.requires_grad))):
        dev, stream = _L._device_stream()
        key = (dev, _sig(o_a), _sig(lse_a), _sig(o_b), _sig(lse_b))
        plan = _merge_plans.get(key)
        if plan:
            out_lse = plan(stream, o_a, lse_a, o_b, lse_b)
            if out_lse is not None:
                return out_lse
        elif plan is None:
            P.stats["plan_miss"] += 1
            with P.recording() as rec:
                out_lse = _merge_slow(o_a, lse_a, o_b, lse_b)
            P.store(_merge_plans, key, rec, (o_a, lse_a, o_b, lse_b), out_lse)
            return out_lse
    return _merge_slow(o_a, lse_a, o_b, lse_b)


_merge_plans = P.new_cache()


def _merge_slow(o_a, lse_a, o_b, lse_b):
    C.check_tensor(o_a, "o_a", Q_DTYPES)
    C.check_tensor(o_b, "o_b", Q_DTYPES)
    C.check_tensor(lse_a, "lse_a", (torch.float32,))
    C.check_tensor(lse_b, "lse_b", (torch.float32,))
    C.check_same_device(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if o_a.ndim not in (3, 4):
        raise ValueError(f"o_a must be (batch, seqlen, heads, head_dim) or (tokens, heads, "
                         f"head_dim), got shape {tuple(o_a.shape)}")
    if o_b.shape != o_a.shape:
        raise ValueError(f"o_b must have o_a's shape {tuple(o_a.shape)}, got "
                         f"{tuple(o_b.shape)}")
    want = (o_a.shape[1], o_a.shape[0]) if o_a.ndim == 3 else \
        (o_a.shape[0], o_a.shape[2], o_a.shape[1])
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} for o_a of shape "
                             f"{tuple(o_a.shape)}, got {tuple(t.shape)}")
    if C.use_direct_path(o_a, o_b, lse_a, lse_b):
        return _merge_impl(o_a, lse_a, o_b, lse_b)
    return _merge_op(o_a, lse_a, o_b, lse_b)


def cost(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_scale=None, v_scale=None,
         **kw):
    """(bytes, flops) of one call: K and V of every valid token read once (and their
    per-token scales), q read and out written; 4 * sum(L) * heads_q * seqlen_q * head_dim
    FLOPs. Reads ``cache_seqlens`` (host code for reports, never on the call path)."""
    from tkit._cost import Cost

    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    max_len = k_cache.shape[1] if block_table is None else \
        block_table.shape[1] * k_cache.shape[1]
    tokens = float(cache_seqlens.clamp(0, max_len).sum()) if cache_seqlens.numel() else 0.0
    kv = 2.0 * tokens * hk * d * k_cache.element_size()
    for s in (k_scale, v_scale):
        if s is not None and s.ndim > 0:
            kv += tokens * hk * 4
    nbytes = kv + 2.0 * q.numel() * q.element_size()
    return Cost(nbytes, 4.0 * tokens * hq * sq * d)
