"""INT4 weight-only GEMM (W4A16): ``out = a @ dequant(w).T + bias`` for an nn.Linear weight.

Math. ``w`` (N, K) is stored as 4-bit unsigned codes ``q`` in [0, 15] with one scale ``s`` and
one zero point ``z`` per group of ``group_size`` consecutive K values of a row:

    dequant(w)[n, k] = (q[n, k] - z[k // G, n]) * s[k // G, n]

Symmetric weights (``zeros=None``) take ``z = 8``: codes 0..15 are the signed values -8..7.
The tile kernel dequantizes in float32, rounds the weight tile once to a's dtype (fp16 /
bf16) and multiplies on the tensor cores with a float32 accumulator; the GEMV kernel keeps
everything in float32 (the weight is never rounded). The reference rule's peer dequantizes
in a's dtype in torch, then a @ w.T.

Layout (tkit's; chosen for the kernel, and the same as GPTQ's ``qweight``):

    qweight  int32 (K // 8, N): qweight[i, n] holds q[n, 8*i + j] in bits 4*j .. 4*j + 3,
             j = 0..7 (eight consecutive K values of one output column, low nibble first)
    scales   (K // G, N), float16 / bfloat16 / float32 (row g: the scales of group g)
    zeros    (K // G, N), same dtype as scales, or None (symmetric, z = 8). Zero points are
             kept as floats in code units (integers for AWQ/GPTQ and quantize_int4), so any
             checkpoint's convention is one exact conversion.

Why this layout: a (BLOCK_K // 8, BLOCK_N) int32 tile is contiguous along N, so a program
loads 16-byte vectors (four columns) and one int32 is unpacked into eight K values of the
same column with shifts and masks in registers: ``(q[:, None, :] >> 4*j) & 15`` reshaped to
(BLOCK_K, BLOCK_N) is already the K-major B operand of ``tl.dot``; no transpose, no shared
memory round trip before the MMA operand conversion. Scales and zeros of one K-step are one
row (BLOCK_K divides G), loaded once per step.

Cost model: FLOPs = 2*M*N*K; bytes = K*N/2 (weight) + 2 * (K/G)*N*s_size (scales, zeros)
+ M*K*a_size + M*N*out_size. At M = 1..16 the weight bytes dominate (K=4096, N=14336, G=128:
29.4 MB of codes + 1.8 MB of fp16 scales and zeros, against 117 MB for bf16): memory-bound,
so the target is the copy bandwidth over ~4x fewer bytes than a bf16 GEMV. The arithmetic
intensity is ~4*M FLOP/byte, so INT4 stops winning when the bf16 GEMM turns compute-bound
itself (M ~ 200 on the H200) and falls behind past that (the dequantization is extra work
per weight element per M tile).

Kernels (``Int4Config.path``; the heuristic picks, ``int4_config(path=...)`` overrides):

* ``"cuda_gemv"`` (1 <= M <= 32 on sm_90 by default, where :func:`cuda_gemv_reason` finds
  nothing in the way): ``tkit.cuda_ext.gemm_int4.matmul_int4_gemv_cuda``, a CUDA GEMV: a CTA
  is a 32-column slab whose warps ("K lanes") walk equal runs of whole groups; each thread
  loads its 16-byte words of codes straight into register rings (to 16 rows two rings of 2
  chunks of 32 K, a pass loading the next pass's codes first; one ring of 4 at 32),
  dequantizes them as the tc kernel does into mma.sync m16n8k16's register operand (the
  weight as A, the rows of ``a`` the MMA's n8 tiles: 1, 2 or 4 of them, 8 to 32 rows a CTA;
  from 9 rows the groups' sums of ``a`` by one stacked MMA a k16 step and pair of tiles) and
  the lanes meet once at the end. About 1.9 instructions a weight at M = 1 (the Triton
  GEMV's FMAs take ~3.5), no TMA ring, no stream-K hand-over. Past 32 rows, more CTAs a
  slab (neighbours in the grid, so all but the first read the slab's codes from L2).
* ``"cuda_wgmma"`` (33 <= M <= 512 on sm_90 by default): ``tkit.cuda_ext.gemm_int4``'s
  ``matmul_int4_wgmma``, the product transposed on wgmma, ``out^T tile = W tile @ a^T
  tile``: one producer warp streams 64-deep K steps of a (128-byte swizzle), the codes and
  the scale and zero rows through a TMA ring; each consumer warpgroup dequantizes 64 weight
  columns once a CTA straight into wgmma's register A operand (an 8-bit shared load, an
  IMAD and a LOP3 a pair, two 16-bit FMAs) while the previous step's wgmmas run, with up to
  128 rows of a as the wgmma's N. K split where the tiles leave SMs idle (the last split to
  arrive adds the float32 tiles in split order). Past 32 rows the GEMV repeats its work for
  each 32-row block; past ~512 dequantize + GEMM's one pass over the weight costs less than
  dequantizing it once per 128-row tile.
* ``"cuda"`` (2 <= M <= 32 on sm_90 where the GEMV does not serve): ``tkit.cuda_ext.gemm_int4``,
  a CUDA kernel for decode sizes: one producer warp
  streams the codes, scales, zeros and a through a TMA ring of 512-deep K steps, eight
  consumer warps dequantize as the tc kernel does into mma.sync's register operand, and the
  K steps of all column tiles are dealt out in equal runs over one CTA an SM (stream-K; the
  pieces of a shared tile added up in CTA order by the last to finish). Elsewhere (another
  device, M = 1, operands outside its scope, no nvcc) the paths below, and
  :func:`backend` says why.

* ``"tc"`` (2 <= M <= 64 by default, any M on request): ``_matmul_int4_tc_kernel``, the decode
  kernel on the tensor cores with the operands swapped, ``out^T = W a^T``: the weight tile
  (BLOCK_N columns of the output, 128 at two warpgroups) is the MMA's first operand, which
  wgmma / mma.sync take from registers, and the BLOCK_M = 8, 16, 32 or 64 rows of ``a``
  (padded: rows past M read the last row, never stored) its second. The packed (BLOCK_N,
  BLOCK_K // 8) tile, the scales and the zeros are pipelined through tensor descriptors
  made on the host (``q_tma``; cp.async and scales loaded a step ahead where TMA does not
  apply) and read from shared memory
  straight into the operand's register layout; a K step is taken plane-major (operand K
  index BKQ j + i is K = 8 i + j: nibble j of packed row i), so each plane is an
  elementwise function of the words and the planes join into the operand without a
  shared-memory round trip. Dequantization is a PRMT and a LOP3 per two weights (the
  nibbles of two words OR-ed into the mantissa of 128.0 (bf16) / 1024.0 (fp16): ``O + q``
  exactly); offset and zero point come off the MMA sums once per step in float32, ``s
  (sum_k a_k (O + q_k) - (O + z) sum_k a_k)`` (exact for any z; the activations' K gather
  and their per-step sums cost the same at any M <= 16). K split into programs and summed
  by the reduce launch as below.
* ``"gemv"`` (M = 1 by default, any M <= 16 on request): ``_matmul_int4_gemv_kernel``, a
  memory-bound GEMV on the CUDA cores. program_id(0) a slab of BLOCK_N columns, (1) a K
  split. At M = 1 (``k_lanes``): all of K in one program, walked by "K lanes" (4 warps,
  and the threads the columns leave over, take interleaved 32-deep chunks) that sum once at
  the end: one launch, no partials, ~16 warps an SM; 32 columns a program (8 a thread, two
  16-byte vectors sharing the activations' 16-byte loads), or 16 (one vector of 4 a thread,
  twice the programs) where 32 would give the SMs at most 2 programs each (N up to 8448
  on 132 SMs). At M = 2 one warp a program and a K split. Every step's codes are loaded
  one step ahead, straight into registers. The column-slab order of the reads costs nothing
  by itself: a bare read of the codes in the same slabs, grid and prefetch takes what
  contiguous chunks take (~12 us at K=4096 N=14336 on the H200, against ~17.7 for this
  kernel), so what is left above the read is the kernel's own work per step, not the
  layout. Dequantization needs no int -> float convert (nibbles OR-ed into float
  mantissas, see the kernel), two instructions a weight plus 3/8 of a shift, and the zero
  point and scale are applied once per word and step; sums over the step's packed rows
  stay within the thread. A K split's float32 partials are summed in split order by
  matmul's ``_splitk_reduce_kernel`` (a second launch, which applies the bias) or, with
  ``fused_reduce``, by the last program of each slab to arrive (one launch, the same bits;
  per-device counters, opt-in).
* ``"tile"`` (64 < M < 256 by default): ``_matmul_int4_kernel``, program_id(0) walks N
  tiles, (1) M tiles, (2) K splits. M <= 64 (on request): BLOCK_M = 16..64, BLOCK_N = 64,
  BLOCK_K = min(128, G), 3 stages, K split so that about four programs per SM stream the
  weight, partials reduced as above. Larger M: 64/128 x 128 tiles, no split: dequantize the
  tile in registers, then tl.dot. Both dequantize without an int -> float convert (OR-ed
  mantissas).
* ``"dequant"`` (M >= 256, prefill): ``_dequant_int4_kernel`` writes the (N, K) weight in
  a's dtype once (a temporary of the call), then ``tkit.matmul`` multiplies by its
  transpose: the tile kernel would convert every code once per row tile of ``a``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env, _hooks
from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels import _plan as P
from tkit.kernels import _register as R
from tkit.kernels._numerics import INTERPRET, and_scalar, round_to, scalar_mask
from tkit.kernels.matmul._kernels import _dot, _splitk_reduce_kernel
from tkit.kernels.matmul.ops import _matmul_impl, _splitk_counters

ACT_DTYPES = (torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the zero point of symmetric weights (codes 0..15 are -8..7)
SYM_ZERO = 8
#: 2^23 and 2^27 as float32 bits: a nibble OR-ed into the mantissa is an exact float
MAGIC_A, MAGIC_B = 0x4B000000, 0x4D000000


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4Config:
    """Launch parameters of the INT4 GEMM. ``path``: ``"gemv"`` (``_matmul_int4_gemv_kernel``,
    CUDA-core FMAs, rows of ``a`` up to BLOCK_M <= 16 in one program), ``"tc"`` (the
    tensor-core decode kernel, M <= 16 a program), ``"tile"``
    (``_matmul_int4_kernel``, tl.dot on a BLOCK_M x BLOCK_N tile, any M) or ``"dequant"``
    (prefill: ``_dequant_int4_kernel`` writes the (N, K) weight in a's dtype once, BLOCK_N x
    BLOCK_K a program, and tkit.matmul multiplies by its transpose). BLOCK_K must divide
    the group size (one scale row per K step) and be a power of 2 >= 16; split_k > 1 adds
    the reduce launch (a deterministic two-stage sum, no atomics)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    path: str = "tile"
    #: gemv path, split_k > 1: the last program of each column slab sums the partials (one
    #: launch, deterministic; per-device arrival counters, so opt-in as matmul's)
    fused_reduce: bool = False
    #: gemv path: K lanes a program (its warps, and a warp's threads that N leaves over, walk
    #: interleaved BLOCK_K chunks of the program's K range and sum once at the end): many
    #: warps over all of K without split partials. A power of 2; BLOCK_N // 4 * K_LANES
    #: should be 32 * num_warps (fewer threads than that repeat the tile in registers)
    k_lanes: int = 1
    #: gemv path: 16-byte vectors of 4 columns a thread holds per packed row (1 or 2): the
    #: activations' loads and sums serve 4 * n_vecs columns
    n_vecs: int = 1
    #: tc path: the packed tile, scales and zeros through tensor descriptors (TMA) where they
    #: are 16-byte aligned (N a multiple of 8 for 16-bit scales), else cp.async of 4-byte
    #: words and scales loaded a step ahead. The descriptors are made on the host and passed
    #: to the kernel (no per-program descriptor writes and fences before the first load; no
    #: global scratch, so the eager plans rebuild them over each call's tensors, as the
    #: Gluon GEMM's, and the C++ executor encodes them)
    q_tma: bool = False

    @staticmethod
    def for_shape(M: int, N: int, K: int, group_size: int, num_sms: int = 132,
                  path: str | None = None) -> Int4Config:
        """Heuristic. M <= GEMV_MAX_M: the GEMV; M <= TC_MAX_M: the tensor-core decode kernel
        ("tc", below). Other decode shapes (M <= 64) stream the weight through tl.dot with
        about four programs per SM (each holds NUM_STAGES - 1 steps of BLOCK_K x BLOCK_N / 2
        bytes in flight: 8 KB at 128 x 64 and 3 stages); larger M takes a compute tile.
        ``path``: that path's own defaults at this shape (what ``int4_config(path=...)``
        starts from)."""
        bk = _block_k(group_size)
        bn = 128 if N >= 128 else max(16, C.next_power_of_2(N))
        if _env.INTERPRET:  # the interpreter pays per program and per element: small tiles
            bn = min(bn, 64)
        k_steps = K // bk
        if path is None:
            path = ("gemv" if M <= GEMV_MAX_M else "tc" if M <= TC_MAX_M
                    else "dequant" if M >= DEQUANT_MIN_M else "tile")
        if path == "cuda_gemv":
            # tkit.cuda_ext.gemm_int4's GEMV: 32-column slabs; num_warps is its K lanes (warps
            # a slab) and num_stages the chunks of codes a ring pass, 0 meaning the kernel's
            # own choice
            return Int4Config(min(32, C.next_power_of_2(M)), 32, bk, 1, num_warps=0,
                              num_stages=0, path="cuda_gemv")
        if path == "cuda_wgmma":
            # tkit.cuda_ext.gemm_int4's wgmma GEMM: its own tiles (64-column warpgroups, up to
            # 128 rows of a a CTA, 64-deep K steps); num_stages is its ring's slots and
            # split_k its K splits, 0 meaning the kernel's own choice
            return Int4Config(min(128, max(8, C.next_power_of_2(M))), 128, bk, 0,
                              num_warps=9, num_stages=0, path="cuda_wgmma")
        if path == "cuda":
            # tkit.cuda_ext.gemm_int4: its own tiles (128 columns, 512-deep K steps); only
            # num_stages (its ring's slots) is read, 0 meaning the kernel's own choice (3,
            # or as many as fit in shared memory)
            return Int4Config(min(32, C.next_power_of_2(M)), 128, bk, 1, num_warps=9,
                              num_stages=0, path="cuda")
        if path == "dequant":
            # a program converts a 64 x 128 block of the weight (4 KB of codes, 16 KB out)
            return Int4Config(16, 64 if not _env.INTERPRET else 32, bk, 1, num_warps=4,
                              num_stages=1, path="dequant")
        if path == "tc":
            # the weight as the MMA's register operand (``_matmul_int4_tc_kernel``), 128
            # columns a program. M <= 8: 8 rows of a (mma.sync m16n8k16, a's tile
            # read straight from shared memory into its operand layout), 4 warps of 32
            # columns. M <= 16: 16 rows, one warpgroup (wgmma m64n16k16 twice); 32 and 64
            # rows likewise (wgmma N = 32 / 64). K split so that the programs an SM holds are
            # all busy, each with >= 4 steps. H200 (run 3, docs/NOTES.md "INT4 decode on the
            # tensor cores"): M=16 4 warps split 2 / 4 27.0 / 27.6 us at K=4096 N=14336 /
            # K=N=8192, 8 warps 27.9 / 28.8.
            # The packed tile, scales and zeros come through tensor descriptors (q_tma; the
            # launcher falls back to cp.async where they are not 16-byte aligned): the H200
            # sweep timed the scales' per-step loads as the kernel's bottleneck before they
            # were staged with the tile.
            bm = max(8, min(64, C.next_power_of_2(M)))
            tbn, warps, per_sm = (128, 4, 4) if bm == 8 else (128, 4, 2)
            if _env.INTERPRET:
                tbn, warps = bn, 4
            split = _split_for(C.cdiv(N, tbn) * C.cdiv(M, bm), per_sm * num_sms, k_steps, 4)
            # stages: 3 at 8 rows (run 4: 25.8 / 26.6 us against 27.6 / 26.8 for 4; fewer
            # bytes of shared memory a program), 4 at 16, 2 above (64 rows x 4 overflowed)
            stages = 3 if bm == 8 else 4 if bm == 16 else 2
            return Int4Config(bm, tbn, bk, split, num_warps=warps, num_stages=stages,
                              path="tc", q_tma=True)
        if path == "gemv" and M == 1:
            # K lanes: all of K in one program (no split, no reduce launch), 4 warps, 32-deep
            # chunks; 32 columns a program (two 16-byte vectors a thread), or 16 (one vector,
            # twice the programs) where 32 would leave the SMs at most 2 programs each: on
            # the H200 16 columns were faster at K=N=8192 and level at K=4096 N=14336. With
            # one vector a thread, tl.load's layout of the scales is the codes' own, so the
            # step needs no layout conversion (docs/NOTES.md, forty-fourth session)
            bn, vecs = (16, 1) if C.cdiv(N, 32) <= 2 * num_sms else (32, 2)
            return Int4Config(1, bn, min(32, bk), 1, num_warps=4, num_stages=1, path="gemv",
                              k_lanes=32, n_vecs=vecs)
        if path == "gemv":
            # one warp a program; more rows of a hold more partial sums: smaller steps (M = 2:
            # 256 x 32, 168 registers; M = 4: 128 x 32, 168). K split so that ~10 programs per
            # SM stream the weight, >= 4 steps each (M = 1, before the K lanes: 128 x 64 split
            # 16). M = 2 and 4: sm_90a compile facts, not timings.
            gbn, gbk = {1: (128, 64), 2: (256, 32), 4: (128, 32)}.get(C.next_power_of_2(M),
                                                                     (128, 16))
            if _env.INTERPRET:
                gbn = bn
            gbk = min(gbk, bk)
            split = _split_for(C.cdiv(N, gbn), 10 * num_sms, K // gbk, 4)
            return Int4Config(min(16, C.next_power_of_2(M)), gbn, gbk, split, num_warps=1,
                              num_stages=1, path="gemv")
        if M <= 64:
            # 64 columns, 3 stages: 128 registers (128 columns: 255, with the OR-ed nibbles),
            # K split so that ~8 programs per SM stream the weight, at most 4 ways (H200, M=16:
            # split 4 beat 2 by 6% at K=4096 N=14336 and tied at K=N=8192, where 8 lost 4%)
            bm = max(16, min(64, C.next_power_of_2(M)))
            bn = min(bn, 64)
            split = min(4, _split_for(C.cdiv(N, bn) * C.cdiv(M, bm), 8 * num_sms, k_steps, 4))
            return Int4Config(bm, bn, bk, split, num_warps=4, num_stages=3)
        bm = 64 if M <= 128 else 128
        return Int4Config(bm, bn, bk, 1, num_warps=8 if bm == 128 else 4, num_stages=3)


#: the largest M the heuristic gives to the GEMV kernel (its FMAs per weight grow with M):
#: from M = 2 the tensor-core kernel's 8-row tile streams the weight faster than the
#: one-warp GEMV (docs/NOTES.md, "INT4's tensor-core decode kernel takes host descriptors")
GEMV_MAX_M = 1
#: the largest M the heuristic gives to the tensor-core decode kernel (its dequantization per
#: weight does not depend on M; row tiles of 8 to 64): up to 64 rows it beats the tile
#: kernel, at 128 it no longer does (the same NOTES section)
TC_MAX_M = 64
#: the smallest M the heuristic gives to "dequant" (prefill: the weight written once in a's
#: dtype, then the 16-bit GEMM). It costs a read of the codes plus a write and a read of the
#: 16-bit weight beside the GEMM, while the tile kernel converts every code of the weight once
#: per row tile of a: the H200 had them level near M = 150 at K=4096 N=14336 (M=128: the tile
#: kernel 1.05x faster; M=512: dequant 1.80x; M=4096: 2.48x; docs/NOTES.md). The (N, K) 16-bit
#: weight is a temporary of each call (117 MB at N=14336 K=4096 in bf16).
DEQUANT_MIN_M = 256
PATHS = ("gemv", "tile", "tc", "dequant", "cuda", "cuda_gemv", "cuda_wgmma")


#: the rows of a for which unforced calls take the stream-K CUDA kernel where it serves and
#: the CUDA GEMV (below) does not: from 2 to 32 rows it led the tc kernel's best by 1.1-1.3x
#: (docs/NOTES.md, "the INT4 decode GEMM in CUDA"; it holds at most 32 rows: four n8 tiles)
CUDA_MIN_M, CUDA_MAX_M = 2, 32
#: the rows of a for which unforced calls take the CUDA GEMV (``tkit.cuda_ext.gemm_int4``'s
#: ``matmul_int4_gemv_cuda``: the codes straight into registers, mma.sync on dequantized
#: registers, a 32-column slab and up to 32 rows a CTA, no TMA ring or stream-K) where it
#: serves: a stream of the weight, faster than the Triton GEMV, the stream-K kernel and the
#: wgmma GEMM there. Past 32 rows it repeats all of its work for each 32-row block, and the
#: wgmma GEMM (below) takes over (figures: docs/NOTES.md)
CUDA_GEMV_MIN_M, CUDA_GEMV_MAX_M = 1, 32
#: the rows of a for which unforced calls take the CUDA wgmma GEMM (``tkit.cuda_ext.gemm_int4``'s
#: ``matmul_int4_wgmma``: each weight element dequantized once a CTA into wgmma's register
#: operand, up to 128 rows of a at once) where it serves and the GEMV does not: it pays the
#: conversion once per 128 rows where the GEMV pays it per 32 and the Triton tile kernel per
#: row tile; past ~512 rows dequantize + GEMM's one pass over the weight costs less than the
#: conversion once per 128-row tile (figures: docs/NOTES.md)
CUDA_WGMMA_MIN_M, CUDA_WGMMA_MAX_M = 33, 512


def _split_for(tiles: int, want_programs: int, k_steps: int, min_steps: int) -> int:
    """The power of 2 nearest (log scale) to want_programs / tiles, halved until every split
    has at least min_steps K steps."""
    want = 1
    while want * 2 <= want_programs / tiles * 1.41:
        want *= 2
    while want > 1 and k_steps // want < min_steps:
        want //= 2
    return want


_OVERRIDES = C.ConfigOverrides(Int4Config)


def int4_config(**overrides):
    """Override fields of :class:`Int4Config` for the calls made inside (this thread only),
    e.g. ``with int4_config(split_k=4, num_stages=3): ...``; an unknown field is a TypeError
    naming it, and a block_k that does not divide the group size a ValueError at the call.
    For experiments (the H200 sweep of this table) and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(M: int, N: int, K: int, group_size: int, num_sms: int) -> Int4Config:
    over = _OVERRIDES.state.value
    if over.get("path") is not None and over["path"] not in PATHS:
        raise ValueError(f"path={over['path']!r} must be one of {PATHS}")
    cfg = Int4Config.for_shape(M, N, K, group_size, num_sms, path=over.get("path"))
    if _OVERRIDES.active():
        cfg = _OVERRIDES.apply(cfg)
        if group_size % cfg.block_k or cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1):
            raise ValueError(f"block_k={cfg.block_k} must be a power of 2 >= 16 dividing "
                             f"group_size={group_size}")
        if cfg.path not in PATHS:
            raise ValueError(f"path={cfg.path!r} must be one of {PATHS}")
        if cfg.path == "gemv" and M > 16:
            raise ValueError(f"path='gemv' takes all M={M} rows in one program: M <= 16")
        if cfg.k_lanes < 1 or cfg.k_lanes & (cfg.k_lanes - 1):
            raise ValueError(f"k_lanes={cfg.k_lanes} must be a power of 2")
        if cfg.n_vecs not in (1, 2) or cfg.block_n < 4 * cfg.n_vecs:
            raise ValueError(f"n_vecs={cfg.n_vecs} must be 1 or 2 with block_n >= 4 * n_vecs")
        # one program's rows: all of them on the gemv path, >= 16 for tl.dot on the tile path,
        # a power of 2 >= 8 on the tc path (the MMA's N; fewer rows gained nothing)
        if cfg.path == "dequant":
            bm = cfg.block_m  # not used: the GEMM takes its own config
        elif cfg.path == "gemv":
            bm = C.next_power_of_2(M)
        elif cfg.path == "tc":
            bm = max(8, C.next_power_of_2(cfg.block_m))
        else:
            bm = max(16, cfg.block_m)
        if bm != cfg.block_m:
            cfg = dataclasses.replace(cfg, block_m=bm)
    return cfg


def _block_k(group_size: int) -> int:
    bk = 128
    while group_size % bk:
        bk //= 2
    return bk


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _matmul_int4_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, c_ptr, ws_ptr, bias_ptr, M, N, K,
    stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_cm, stride_cn, stride_bias, magic,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile over this program's K range.

    a_ptr (M, K) fp16/bf16 any strides; q_ptr int32 (K // 8, N) in the layout of the module
    docstring; s_ptr / z_ptr (K // GROUP, N). SPLIT_K == 1: bias and the store to c_ptr
    (M, N) here; otherwise the float32 partial goes to ws_ptr[pid_k] (SPLIT_K, M, N),
    contiguous, summed by ``_splitk_reduce_kernel``. K is a multiple of GROUP, GROUP of
    BLOCK_K (the launcher checks), so no K masks.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = offs_m % M  # rows / columns past the edge read a valid one; masked on the store
    offs_bn = offs_n % N
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * per_split
    k_end = tl.minimum(k_begin + per_split, k_tiles)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kq = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    a_ptrs = (a_ptr + offs_am[:, None] * stride_am
              + (k_begin * BLOCK_K + offs_k)[None, :] * stride_ak)
    q_ptrs = (q_ptr + (k_begin * (BLOCK_K // 8) + offs_kq)[:, None] * stride_qk
              + offs_bn[None, :] * stride_qn)
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(k_begin, k_end, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs)
        # the weight is read once: do not let it push the activations out of L2
        q = tl.load(q_ptrs, eviction_policy="evict_first")
        g = (kt * BLOCK_K) // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_bn * stride_sn).to(tl.float32)
        if HAS_ZEROS:
            zs = tl.load(z_ptr + g * stride_zg + offs_bn * stride_zn).to(tl.float32) * s
        else:
            zs = 8.0 * s  # SYM_ZERO (a global the compiler cannot read)
        # (BLOCK_K // 8, 8, BLOCK_N) nibbles -> (BLOCK_K, BLOCK_N): row 8*i + j is nibble j of
        # packed row i (the arithmetic shift's sign bits are masked off), OR-ed into the
        # mantissa of 2^23 (magic: 2^23's bits, a runtime argument so that mask and OR are one
        # LOP3) instead of an int -> float convert (I2F, a quarter-rate instruction on sm_90):
        # f - 2^23 = q exactly; then w = q * s - z * s, one FMA
        nib = (q[:, None, :] >> shifts[None, :, None]) & 0xF
        f = (nib | magic).to(tl.float32, bitcast=True) - 8388608.0
        w = tl.reshape(f, (BLOCK_K, BLOCK_N)) * s[None, :] - zs[None, :]
        acc = _dot(a, round_to(w, dtype), acc, False)
        a_ptrs += BLOCK_K * stride_ak
        q_ptrs += (BLOCK_K // 8) * stride_qk
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        ws_ptrs = ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(ws_ptrs, acc, mask=mask)



@triton.jit
def _rotl(x, BITS: tl.constexpr):
    """x rotated left by BITS (one funnel shift), x uint32."""
    return (x << BITS) | (x >> (32 - BITS))


@triton.jit
def _nibble_pair(src, magic_a, magic_b):
    """The nibbles at bits 16..19 and 12..15 of ``src`` (uint32) as floats ``2^16 * (128 + q)``
    and ``2^16 * (2048 + q)``: each masked and OR-ed into the mantissa of 2^23 (resp. 2^27)
    by one LOP3 (the magics are runtime arguments, so they sit in registers), exact."""
    fa = ((src & 0xF0000) | magic_a).to(tl.float32, bitcast=True)
    fb = ((src & 0xF000) | magic_b).to(tl.float32, bitcast=True)
    return fa, fb


@triton.jit
def _a_words(ptrs, live, MASKED: tl.constexpr):
    """The 8 16-bit activations at ``ptrs`` .. ``ptrs + 7`` (16-byte aligned) as 4 int32
    words (value 2 w in the low half of word w, 2 w + 1 in the high half), 0 where not
    ``live`` (if MASKED): one 16-byte load on the GPU (inline PTX: Triton would not vectorize loads
    whose addresses it sees as strided)."""
    if INTERPRET:
        p16 = ptrs.to(tl.pointer_type(tl.uint16), bitcast=True)
        w0 = tl.load(p16).to(tl.uint32) | (tl.load(p16 + 1).to(tl.uint32) << 16)
        w1 = tl.load(p16 + 2).to(tl.uint32) | (tl.load(p16 + 3).to(tl.uint32) << 16)
        w2 = tl.load(p16 + 4).to(tl.uint32) | (tl.load(p16 + 5).to(tl.uint32) << 16)
        w3 = tl.load(p16 + 6).to(tl.uint32) | (tl.load(p16 + 7).to(tl.uint32) << 16)
        w0 = w0.to(tl.int32, bitcast=True)
        w1 = w1.to(tl.int32, bitcast=True)
        w2 = w2.to(tl.int32, bitcast=True)
        w3 = w3.to(tl.int32, bitcast=True)
    else:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptrs],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    if MASKED:
        w0 = tl.where(live, w0, 0)
        w1 = tl.where(live, w1, 0)
        w2 = tl.where(live, w2, 0)
        w3 = tl.where(live, w3, 0)
    return w0, w1, w2, w3


@triton.jit
def _a_step(a_ptrs, a_ptr, live, step_live, M, stride_am, BLOCK_M: tl.constexpr,
            EVEN: tl.constexpr):
    """One step's activations for ``_matmul_int4_gemv_kernel``'s A_VEC path: the (WK, BKQ)
    rows of 8 at ``a_ptrs`` for each of the BLOCK_M rows of a (rows past M read row M - 1),
    as 4 words each (a flat tuple); lanes (or, EVEN, the whole step) not live read row 0's
    first values instead (in bounds), and add 0 (masked words; EVEN: a step not live is
    never used)."""
    aw = ()
    for m in tl.static_range(BLOCK_M):
        a_row = a_ptrs + tl.minimum(m, M - 1) * stride_am
        if EVEN:
            w0, w1, w2, w3 = _a_words(tl.where(step_live, a_row, a_ptr), live, False)
        else:
            w0, w1, w2, w3 = _a_words(tl.where(live[:, None], a_row, a_ptr), live[:, None],
                                      True)
        aw = aw + (w0, w1, w2, w3)
    return aw


@triton.jit
def _lane_mask(lane_live, step_live, like, EVEN: tl.constexpr):
    """The mask of a (lanes, rows, columns) load of codes: per lane, or (EVEN: every lane
    has a chunk in every step) the scalar ``step_live``."""
    if EVEN:
        r = scalar_mask(step_live, like)
    else:
        r = lane_live[:, None, None, None]
    return r


@triton.jit
def _a_half(w, HI: tl.constexpr, dtype: tl.constexpr):
    """The low (HI = 0) or high 16-bit float of the int32 word ``w`` as float32 (bf16: a
    shift or a mask, exact)."""
    if dtype == tl.bfloat16:
        if HI:
            return (w & -65536).to(tl.float32, bitcast=True)
        return (w << 16).to(tl.float32, bitcast=True)
    if HI:
        return (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _matmul_int4_gemv_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, c_ptr, ws_ptr, bias_ptr, M, N, K,
    stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_cm, stride_cn, stride_bias, magic_a, magic_b, cnt_ptr,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, FUSED_REDUCE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_LANES: tl.constexpr = 1, A_VEC: tl.constexpr = False, EVEN: tl.constexpr = False,
    N_VECS: tl.constexpr = 1,
):
    """All M (<= BLOCK_M) rows of ``a`` times BLOCK_N columns over this program's K range, on
    the CUDA cores: a memory-bound GEMV that streams (BLOCK_K // 8, BLOCK_N) int32 tiles of
    codes with 16-byte loads along N. Arguments and outputs as ``_matmul_int4_kernel``'s;
    ``magic_a`` / ``magic_b`` are 2^23 / 2^27 as float32 bits (MAGIC_A, MAGIC_B).

    K_LANES: the program's K range is walked by K_LANES independent lanes (the warps, and the
    threads of a warp that N leaves over), lane l taking the BLOCK_K-deep chunks l, l +
    K_LANES, ...: one step reads a (K_LANES, BLOCK_K // 8, BLOCK_N) tile, every lane keeps its
    own partial sums and they meet once, after the loop (one cross-warp sum). So a program can
    cover all of K with many warps in flight, with no second launch and no split partials.
    The next step's codes are loaded before this step's are used, in registers.
    A_VEC: the 8 activations of a packed row come in one 16-byte load (a contiguous along K,
    16-byte aligned rows; the launcher checks) instead of eight 2-byte loads.
    N_VECS: 16-byte vectors of columns a thread holds per packed row (1 or 2; BLOCK_N //
    N_VECS apart): the activations' loads, converts and sums serve 4 N_VECS columns.
    EVEN: every split has the same number of chunks, a multiple of K_LANES (the launcher
    checks): no lane is ever past its range's end, only the loads ahead are masked.

    Dequantization without an int -> float convert, two instructions a weight: the word and
    its rotations by 8, 16 and 24 bits put every nibble once at bits 16..19 (nibbles 4, 2, 0,
    6) or 12..15 (3, 1, 7, 5); one LOP3 masks it and ORs in the exponent of 2^23 (resp.
    2^27), which makes the float ``f = 2^16 (O + q)`` exactly, O = 128 (resp. 2048); one FMA
    adds ``a_k * f`` to the word's sum t. The offsets, the zero point and the scale are
    applied once per word and K step: ``sum_k a_k (q_k - z) s = s 2^-16 (t - 2^16 ((128 + z)
    sum_A a + (2048 + z) sum_B a))`` (A, B: the nibbles of each offset), exact for any
    (fractional) z up to float32 rounding: the cancellation costs ~11 of float32's 24 bits,
    against the 8 of bf16. Partial sums stay per (row of a, packed row, lane, column) in
    registers, one tile per row of a (a tuple); the reduction over packed rows happens once
    a step, within each thread.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BKQ: tl.constexpr = BLOCK_K // 8
    WK: tl.constexpr = K_LANES
    NH: tl.constexpr = N_VECS
    BNH: tl.constexpr = BLOCK_N // N_VECS
    # (NH, BNH): column h BNH + c of the slab
    offs_n = pid_n * BLOCK_N + (tl.arange(0, NH)[:, None] * BNH + tl.arange(0, BNH)[None, :])
    offs_bn = offs_n % N  # columns past the edge read a valid one; masked on the store
    offs_kq = tl.arange(0, BKQ)
    lanes = tl.arange(0, WK)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * per_split
    k_end = tl.minimum(k_begin + per_split, k_tiles)
    n_steps = tl.cdiv(tl.maximum(k_end - k_begin, 0), WK)
    # (WK, BKQ, NH, BNH): lane l's chunk, its packed row i, columns (h, c) (the lanes first:
    # the layout gives the threads and warps that N leaves over to the first dimension, and
    # the sums over i stay in each thread)
    q_ptrs = (q_ptr + (k_begin * BKQ).to(tl.int64) * stride_qk
              + (lanes[:, None, None, None] * BKQ + offs_kq[None, :, None, None]) * stride_qk
              + offs_bn[None, None, :, :] * stride_qn)
    # (WK, BKQ): the activation of nibble 0 of packed row i of lane l's chunk
    a_ptrs = (a_ptr + (k_begin * BLOCK_K).to(tl.int64) * stride_ak
              + (lanes[:, None] * BLOCK_K + offs_kq[None, :] * 8) * stride_ak)
    s_ptrs = s_ptr + offs_bn[None, :, :] * stride_sn
    z_ptrs = z_ptr + offs_bn[None, :, :] * stride_zn
    zero = tl.zeros((WK, NH, BNH), dtype=tl.float32)
    accs = (zero,)
    for _m in tl.static_range(1, BLOCK_M):
        accs = accs + (zero,)
    # the coming steps' codes are loaded before this step's are used (16-byte loads straight
    # into registers, in the layout the FMAs use; Triton's pipeliner would stage them through
    # shared memory and pick another layout); the weight is read once: evict_first keeps
    # the activations in L2. Lanes past the range's end read nothing (their a is 0 too).
    step_k = WK * BKQ * stride_qk
    q_tile = lanes[:, None, None, None] + offs_kq[None, :, None, None] + offs_bn[None, None]
    q_next = tl.load(q_ptrs, other=0, eviction_policy="evict_first",
                     mask=_lane_mask(k_begin + lanes < k_end, 0 < n_steps, q_tile, EVEN))
    # the scales and zeros of a step come with its codes, a step ahead (their group's row;
    # chunks past the end read the last one, unused)
    g = ((tl.minimum(k_begin + lanes, k_end - 1) * BLOCK_K) // GROUP)[:, None, None]
    s_next = tl.load(s_ptrs + g * stride_sg)  # (WK, NH, BNH)
    z_next = s_next
    if HAS_ZEROS:
        z_next = tl.load(z_ptrs + g * stride_zg)
    for st in tl.range(0, n_steps, num_stages=1):
        c = k_begin + st * WK + lanes  # this step's chunk of each lane
        live = c < k_end
        q = q_next.to(tl.uint32, bitcast=True)
        s = s_next.to(tl.float32)
        if HAS_ZEROS:
            z = z_next.to(tl.float32)
        else:
            z = 8.0  # SYM_ZERO (a global the compiler cannot read)
        q_ptrs += step_k
        ahead = _lane_mask(c + WK < k_end, st + 1 < n_steps, q_tile, EVEN)
        q_next = tl.load(q_ptrs, mask=ahead, other=0, eviction_policy="evict_first")
        g = ((tl.minimum(c + WK, k_end - 1) * BLOCK_K) // GROUP)[:, None, None]
        s_next = tl.load(s_ptrs + g * stride_sg)
        if HAS_ZEROS:
            z_next = tl.load(z_ptrs + g * stride_zg)
        # derived from s, so that z is brought to s's layout (not s and z to two layouts)
        ca = (z + 128.0) * s
        cb = (z + 2048.0) * s
        s = s * (1.0 / 65536.0)
        a_live = live[:, None]
        # nibble j of each word (K = 8 * row + j) as f = 2^16 * (offset + q), one pair of
        # nibbles at a time, each used by every row of a before the next pair is made (at
        # M > 1 the tile's 8 nibble planes would not fit in registers)
        ts = ()
        sums_a = ()
        sums_b = ()
        # A_VEC: each row's 8 activations in one 16-byte load
        aw = ()
        if A_VEC:
            aw = _a_step(a_ptrs, a_ptr, live, st < n_steps, M, stride_am, BLOCK_M, EVEN)
        for p in tl.static_range(4):
            # pairs (4, 3), (2, 1), (0, 7), (6, 5) from q rotated left by 0, 8, 16, 24
            JA = (4, 2, 0, 6)[p]
            JB = (3, 1, 7, 5)[p]
            fa, fb = _nibble_pair(_rotl(q, 8 * p) if p > 0 else q, magic_a, magic_b)
            new_t = ()
            new_a = ()
            new_b = ()
            for m in tl.static_range(BLOCK_M):
                # rows past M read row M - 1; masked on the store
                a_row = a_ptrs + tl.minimum(m, M - 1) * stride_am
                if A_VEC:
                    # JA = 4, 2, 0, 6 is the low half of word (2 - p) % 4, JB = 3, 1, 7, 5
                    # the high half of word (1 - p) % 4 (constant indices: the tuple of
                    # nibbles above is not)
                    aa = _a_half(aw[4 * m + (2 - p) % 4], 0, a_ptr.dtype.element_ty)
                    ab = _a_half(aw[4 * m + (1 - p) % 4], 1, a_ptr.dtype.element_ty)
                else:
                    if EVEN:
                        aa = tl.load(a_row + JA * stride_ak).to(tl.float32)
                        ab = tl.load(a_row + JB * stride_ak).to(tl.float32)
                    else:
                        aa = tl.load(a_row + JA * stride_ak, mask=a_live, other=0.0)
                        ab = tl.load(a_row + JB * stride_ak, mask=a_live, other=0.0)
                        aa = aa.to(tl.float32)
                        ab = ab.to(tl.float32)
                if p == 0:
                    t = aa[:, :, None, None] * fa
                    sa = aa
                    sb = ab
                else:
                    t = ts[m] + aa[:, :, None, None] * fa  # one FMA each
                    sa = sums_a[m] + aa
                    sb = sums_b[m] + ab
                t += ab[:, :, None, None] * fb
                new_t = new_t + (t,)
                new_a = new_a + (sa,)
                new_b = new_b + (sb,)
            ts = new_t
            sums_a = new_a
            sums_b = new_b
        new = ()
        for m in tl.static_range(BLOCK_M):
            # over the packed rows: within each thread (the warps split N and the lanes)
            acc = accs[m] + tl.sum(ts[m], axis=1) * s
            acc -= tl.sum(sums_a[m], axis=1)[:, None, None] * ca
            acc -= tl.sum(sums_b[m], axis=1)[:, None, None] * cb
            new = new + (acc,)
        accs = new
        a_ptrs += WK * BLOCK_K * stride_ak
    mask = offs_n < N
    if HAS_BIAS and (SPLIT_K == 1 or FUSED_REDUCE):
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask, other=0.0).to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        out = tl.sum(accs[m], axis=0)  # over the lanes: across warps, once
        if SPLIT_K == 1:
            if HAS_BIAS:
                out += bias
            tl.store(c_ptr + m * stride_cm + offs_n * stride_cn,
                     out.to(c_ptr.dtype.element_ty), mask=and_scalar(mask, m < M))
        else:
            tl.store(ws_ptr + (pid_k * M + m).to(tl.int64) * N + offs_n, out,
                     mask=and_scalar(mask, m < M))
    if FUSED_REDUCE:
        # the last program of this column slab to arrive sums the partials in split order
        # (deterministic) and stores; its counter goes back to 0 for the next launch
        tl.debug_barrier()  # every thread's partial is stored before the (releasing) arrival
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for m in tl.static_range(BLOCK_M):
                total = tl.zeros((NH, BNH), dtype=tl.float32)
                for sp in tl.static_range(SPLIT_K):
                    total += tl.load(ws_ptr + tl.cast(sp * M + m, tl.int64) * N + offs_n,
                                     mask=and_scalar(mask, m < M), other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += bias
                tl.store(c_ptr + m * stride_cm + offs_n * stride_cn,
                         total.to(c_ptr.dtype.element_ty), mask=and_scalar(mask, m < M))
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _dequant_int4_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, stride_qk, stride_qn, stride_sg,
                         stride_sn, stride_zg, stride_zn, stride_wn, stride_wk,
                         GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """w[n, k] = (q[n, k] - z[g, n]) * s[g, n] in w's dtype (computed in float32, rounded
    once), for a BLOCK_K x BLOCK_N block: BLOCK_K // 8 packed rows of int32 words (8 codes
    along K each, code j in bits 4j..4j+3), one group (BLOCK_K divides GROUP). Offsets into
    w are 64-bit (N * K may pass 2**31)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    r = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    words = tl.load(q_ptr + r[:, None] * stride_qk + n[None, :] * stride_qn, mask=nm[None, :],
                    other=0)
    shifts = tl.arange(0, 8) * 4
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF
    codes = tl.reshape(codes, (BLOCK_K, BLOCK_N)).to(tl.float32)  # row r * 8 + j = k
    g = (pid_k * BLOCK_K) // GROUP
    sc = tl.load(s_ptr + g * stride_sg + n * stride_sn, mask=nm, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zr = tl.load(z_ptr + g * stride_zg + n * stride_zn, mask=nm, other=0.0).to(tl.float32)
    else:
        zr = tl.full((BLOCK_N,), 8.0, tl.float32)  # SYM_ZERO
    w = ((codes - zr[None, :]) * sc[None, :]).to(w_ptr.dtype.element_ty)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs = n.to(tl.int64)[None, :] * stride_wn + k.to(tl.int64)[:, None] * stride_wk
    tl.store(w_ptr + offs, w, mask=nm[None, :])


@triton.jit
def _plane(q, q4, J: tl.constexpr, dtype: tl.constexpr):
    """Nibble J of every word of ``q`` (int32; ``q4 = q >> 4``) as the 16-bit float
    ``O + q_J`` (O = 128 for bf16, 1024 for fp16: the magic whose mantissa's low bits are
    units), exactly, with no int -> float convert. On the GPU two words a step: one PRMT
    gathers byte J // 2 of both words (of q4 for odd J) into the low bytes of two halves, one
    LOP3 keeps the nibbles and ORs in O's bits: the pair is one register of the MMA operand."""
    MAGIC: tl.constexpr = 0x4300 if dtype == tl.bfloat16 else 0x6400
    if J % 2:
        src = q4
    else:
        src = q
    if INTERPRET:
        x = ((src >> (8 * (J // 2))) & 0xF) | MAGIC
        return x.to(tl.int16).to(dtype, bitcast=True)
    B: tl.constexpr = J // 2
    SEL: tl.constexpr = B | (B << 4) | ((4 + B) << 8) | ((4 + B) << 12)
    return tl.inline_asm_elementwise(
        f"{{ .reg .b32 t; prmt.b32 t, $1, $2, {SEL}; "
        f"lop3.b32 $0, t, 0x000F000F, {MAGIC | (MAGIC << 16)}, 0xEA; }}",
        "=r,r,r", [src], dtype=tl.bfloat16 if dtype == tl.bfloat16 else tl.float16,
        is_pure=True, pack=2)


@triton.jit
def _planes(q, dtype: tl.constexpr):
    """The (BN, BKQ) packed tile as the (BN, 8 BKQ) operand whose column BKQ j + i is nibble j
    of word i: the planes joined along K, plane-major, so that each 16-wide K chunk of the
    MMA is one plane and every thread's operand registers hold planes of its own words."""
    BN: tl.constexpr = q.shape[0]
    BKQ: tl.constexpr = q.shape[1]
    q4 = q >> 4
    x = tl.join(tl.join(tl.join(_plane(q, q4, 0, dtype), _plane(q, q4, 4, dtype)),
                        tl.join(_plane(q, q4, 2, dtype), _plane(q, q4, 6, dtype))),
                tl.join(tl.join(_plane(q, q4, 1, dtype), _plane(q, q4, 5, dtype)),
                        tl.join(_plane(q, q4, 3, dtype), _plane(q, q4, 7, dtype))))
    x = tl.permute(tl.reshape(x, (BN, BKQ, 8)), (0, 2, 1))
    return tl.reshape(x, (BN, 8 * BKQ))


@triton.jit
def _matmul_int4_tc_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, c_ptr, ws_ptr, bias_ptr, q_hdesc, s_hdesc, z_hdesc, M, N, K,
    stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_cm, stride_cn, stride_bias,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, Q_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``out^T = W a^T`` on the tensor cores for decode sizes: the weight tile (BLOCK_N
    columns of the output x BLOCK_K) is the MMA's first operand, the BLOCK_M (>= 16) rows of
    ``a`` its second, so the dequantized weight never waits on a shared-memory store: it is
    made in registers, in the operand's layout, from the packed tile.

    No reshape of nibbles: the K step is split into 8 planes, plane j being nibble j of every
    packed word, i.e. K = 8 i + j for the step's packed rows i. Each plane is an elementwise
    function of the (BLOCK_N, BLOCK_K // 8) int32 tile (a shift and a LOP3, then the 16-bit
    float ``16 + q`` by OR-ing into 16.0's mantissa, exact), and multiplies the activations
    of the same K (a strided gather of the small ``a``). The offset and the zero point come
    off once per step, in float32, on the MMA sums: ``sum_k a_k (q_k - z) s = s (sum_k a_k
    (16 + q_k) - (16 + z) sum_k a_k)`` (any z, fractional included; the offset 16 costs about
    2 of float32's 24 bits). One scale row per step (BLOCK_K divides GROUP).

    Arguments as ``_matmul_int4_kernel``'s; grid (N tiles, M tiles, K splits). Q_TMA: the
    packed tile, scales and zeros come through the tensor descriptors ``q_hdesc`` /
    ``s_hdesc`` / ``z_hdesc``, made on the host (one bulk copy a stage instead of a 4-byte
    cp.async per word and thread; the launcher checks the 16-byte alignment TMA needs).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    BKQ: tl.constexpr = BLOCK_K // 8
    dtype: tl.constexpr = a_ptr.dtype.element_ty
    OFFSET: tl.constexpr = 128.0 if dtype == tl.bfloat16 else 1024.0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_bn = offs_n % N  # columns past the edge read a valid one; masked on the store
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_in = offs_m < M
    offs_kq = tl.arange(0, BKQ)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * per_split
    k_end = tl.minimum(k_begin + per_split, k_tiles)
    q_ptrs = (q_ptr + (k_begin * BKQ).to(tl.int64) * stride_qk
              + offs_kq[None, :] * stride_qk + offs_bn[:, None] * stride_qn)  # (BN, BKQ)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = (a_ptr + (k_begin * BLOCK_K).to(tl.int64) * stride_ak + offs_k[None, :] * stride_ak
              + tl.minimum(offs_m, M - 1)[:, None] * stride_am)  # (BLOCK_M, BLOCK_K)
    s_ptrs = s_ptr + offs_bn * stride_sn
    z_ptrs = z_ptr + offs_bn * stride_zn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The scales and zeros of a step must not be loaded in the step that uses them (a DRAM
    # latency every step: the pipeliner leaves loads that do not feed the MMA in the loop).
    # Through descriptors the pipeliner stages them with the packed tile; otherwise they are
    # loaded a step ahead by hand (two steps ahead stopped the pipelining of the tiles).
    # Steps past the split's end read its last row (in bounds; unused).
    last = k_end - 1
    if not Q_TMA:
        s1 = tl.load(s_ptrs + ((tl.minimum(k_begin, last) * BLOCK_K) // GROUP) * stride_sg)
        if HAS_ZEROS:
            z1 = tl.load(z_ptrs + ((tl.minimum(k_begin, last) * BLOCK_K) // GROUP) * stride_zg)
    for kt in tl.range(k_begin, k_end, num_stages=NUM_STAGES):
        g = (kt * BLOCK_K) // GROUP
        if Q_TMA:  # columns past N read zeros; masked on the store
            q = tl.trans(q_hdesc.load([kt * BKQ, pid_n * BLOCK_N]))
            s = tl.reshape(s_hdesc.load([g, pid_n * BLOCK_N]), (BLOCK_N,)).to(tl.float32)
            if HAS_ZEROS:
                z = tl.reshape(z_hdesc.load([g, pid_n * BLOCK_N]), (BLOCK_N,)).to(tl.float32)
            else:
                z = 8.0  # SYM_ZERO (a global the compiler cannot read)
        else:
            # the weight is read once: do not let it push the activations out of L2
            q = tl.load(q_ptrs, eviction_policy="evict_first")
            g1 = (tl.minimum(kt + 1, last) * BLOCK_K) // GROUP
            s = s1.to(tl.float32)
            s1 = tl.load(s_ptrs + g1 * stride_sg)
            if HAS_ZEROS:
                z = z1.to(tl.float32)
                z1 = tl.load(z_ptrs + g1 * stride_zg)
            else:
                z = 8.0  # SYM_ZERO (a global the compiler cannot read)
        # rows of a past M read row M - 1 (no mask: they are dropped on the store)
        a = tl.load(a_ptrs)
        asum = tl.sum(a.to(tl.float32), axis=1)
        # the operand's K order is plane-major (row BKQ j + i is K = 8 i + j)
        at = tl.reshape(tl.permute(tl.reshape(a, (BLOCK_M, BKQ, 8)), (2, 1, 0)),
                        (BLOCK_K, BLOCK_M))
        w = _planes(q, dtype)
        part = _dot(w, at, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), False)
        if HAS_ZEROS:
            zo = (z + OFFSET)[:, None]
        else:
            zo = z + OFFSET  # a scalar: Triton 3.9's interpreter cannot index one
        acc += (part - zo * asum[None, :]) * s[:, None]
        q_ptrs += BKQ * stride_qk
        a_ptrs += BLOCK_K * stride_ak
    mask = (offs_n[:, None] < N) & m_in[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
            acc = acc + bias.to(tl.float32)[:, None]
        c_ptrs = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        ws_ptrs = ws_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(ws_ptrs, acc, mask=mask)


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------
def _matmul_int4_impl(a, qweight, scales, zeros, group_size, bias, config=None):
    M, K = a.shape
    N = qweight.shape[1]
    out = C.empty((M, N), a.dtype, a.device)
    if out.numel() == 0:
        return out
    if K == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out.dtype)
        return out
    cfg = config or current_config(M, N, K, group_size, D.sm_count(a.device))
    unforced = config is None and not _OVERRIDES.active()
    if cfg.path == "cuda_gemv" or unforced:
        forced = cfg.path == "cuda_gemv"
        why = cuda_gemv_reason(a, qweight, scales, zeros, group_size, bias, forced=forced)
        if why is None:
            return _hooks.cuda_int4().matmul_int4_gemv_cuda(
                a, qweight, scales, zeros, group_size, bias, out=out,
                lanes=(cfg.num_warps or None) if forced else None,
                pf=(cfg.num_stages or None) if forced else None)
        if forced:
            raise ValueError(f"path='cuda_gemv': the CUDA INT4 GEMV does not apply: {why}")
    if cfg.path == "cuda_wgmma" or unforced:
        forced = cfg.path == "cuda_wgmma"
        why = cuda_wgmma_reason(a, qweight, scales, zeros, group_size, bias, forced=forced)
        if why is None:
            return _hooks.cuda_int4().matmul_int4_wgmma(
                a, qweight, scales, zeros, group_size, bias, out=out,
                stages=(cfg.num_stages or None) if forced else None,
                split=(cfg.split_k or None) if forced else None)
        if forced:
            raise ValueError(f"path='cuda_wgmma': the CUDA INT4 wgmma GEMM does not apply: "
                             f"{why}")
    forced = cfg.path == "cuda"
    if forced or unforced:
        why = cuda_reason(a, qweight, scales, zeros, group_size, bias, forced=forced)
        if why is None:
            return _hooks.cuda_int4().matmul_int4_cuda(
                a, qweight, scales, zeros, group_size, bias, out=out, check=False,
                stages=(cfg.num_stages or None) if forced else None)
        if forced:
            raise ValueError(f"path='cuda': the CUDA INT4 kernel does not apply: {why}")
    if cfg.path == "dequant":
        return _dequant_matmul(a, qweight, scales, zeros, group_size, bias, cfg)
    split = cfg.split_k
    extra = {}
    if cfg.path == "gemv":
        kernel, grid = _matmul_int4_gemv_kernel, (C.cdiv(N, cfg.block_n), split)
        fused = cfg.fused_reduce and split > 1
        # the per-device arrival counters of matmul's one-launch split-K (left at zero)
        cnt = _splitk_counters(a.device, grid[0]) if fused else qweight
        # the activations' 16-byte loads: a contiguous along K, every row 16-byte aligned;
        # few rows of a (the loaded words are held for the whole step)
        a_vec = (a.stride(1) == 1 and a.data_ptr() % 16 == 0 and cfg.block_m <= 4
                 and (M == 1 or a.stride(0) % 8 == 0))
        k_tiles = K // cfg.block_k
        even = k_tiles % split == 0 and (k_tiles // split) % cfg.k_lanes == 0
        extra.update(magic_a=MAGIC_A, magic_b=MAGIC_B, cnt_ptr=cnt, FUSED_REDUCE=fused,
                     K_LANES=cfg.k_lanes, A_VEC=a_vec, EVEN=even, N_VECS=cfg.n_vecs)
    elif cfg.path == "tc":
        kernel, grid = _matmul_int4_tc_kernel, (C.cdiv(N, cfg.block_n), C.cdiv(M, cfg.block_m),
                                                split)
        # descriptors only where the H200 ran them correctly: 16-bit scales, 128-deep K steps,
        # boxes of >= 64 columns (the GPU tests crashed on a run that also used 32-column
        # boxes, fp32 scales and shorter steps; not narrowed down yet)
        q_tma = (cfg.q_tma and cfg.block_n >= 64 and cfg.block_k == 128
                 and scales.element_size() == 2
                 and D.tma_ok(qweight, scales, *([zeros] if zeros is not None else [])))
        fused = False
        hq = hs = hz = qweight  # unused pointers without the descriptors
        if q_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            bkq = cfg.block_k // 8
            hq = TensorDescriptor(qweight, list(qweight.shape), list(qweight.stride()),
                                  [bkq, cfg.block_n])
            hs = TensorDescriptor(scales, list(scales.shape), list(scales.stride()),
                                  [1, cfg.block_n])
            hz = (TensorDescriptor(zeros, list(zeros.shape), list(zeros.stride()),
                                   [1, cfg.block_n]) if zeros is not None else hs)
        extra.update(Q_TMA=1 if q_tma else 0, q_hdesc=hq, s_hdesc=hs, z_hdesc=hz)
    else:
        fused = False
        extra.update(magic=MAGIC_A)
        kernel, grid = _matmul_int4_kernel, (C.cdiv(N, cfg.block_n), C.cdiv(M, cfg.block_m),
                                             split)
    ws = C.scratch((split, M, N), torch.float32, a.device) if split > 1 else out
    z = zeros if zeros is not None else scales
    C.launch(kernel, grid, a_ptr=a, q_ptr=qweight, s_ptr=scales, z_ptr=z,
             c_ptr=out, ws_ptr=ws, bias_ptr=bias if bias is not None else scales,
             M=M, N=N, K=K, stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_qk=qweight.stride(0), stride_qn=qweight.stride(1),
             stride_sg=scales.stride(0), stride_sn=scales.stride(1),
             stride_zg=z.stride(0), stride_zn=z.stride(1),
             stride_cm=out.stride(0), stride_cn=out.stride(1),
             stride_bias=bias.stride(0) if bias is not None else 0, **extra,
             GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
             SPLIT_K=split, NUM_STAGES=cfg.num_stages, BLOCK_M=cfg.block_m,
             BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if split > 1 and not fused:
        _reduce_splits(ws, out, bias, M, N, split)
    return out


_CUDA_BUILD: dict = {}


def _cuda_module(a):
    """(tkit.cuda_ext.gemm_int4, None) for a call on a's device, or (None, why not): the
    CUDA kernels are plugged in by the layer above (tkit/_hooks.py)."""
    if a.device.type != "cuda":
        return None, "not on a CUDA device"
    try:
        if _hooks.cuda_int4 is None:
            raise ImportError("no CUDA INT4 kernel is registered in tkit._hooks")
        return _hooks.cuda_int4(), None
    except (ImportError, AttributeError) as e:
        return None, f"tkit.cuda_ext unavailable: {e}"


def cuda_reason(a, qweight, scales, zeros, group_size, bias, forced=False) -> str | None:
    """None when the CUDA kernel (``tkit.cuda_ext.gemm_int4``) serves this call, else why
    not: unforced only for CUDA_MIN_M <= M <= CUDA_MAX_M; operands in its scope (its
    ``supported``); a build that has passed its self-test on this machine (worked out once a
    device and build: the build's compile options follow from the rows of a, the dtypes and
    the group size)."""
    M = a.shape[0]
    if not forced and not CUDA_MIN_M <= M <= CUDA_MAX_M:
        return (f"M={M} is outside {CUDA_MIN_M}..{CUDA_MAX_M}, the rows for which it is "
                f"the default")
    mod, why = _cuda_module(a)
    if why is not None:
        return why
    why = mod.supported(a, qweight, scales, zeros, group_size, bias)
    if why is not None:
        return why
    key = (a.device.index or 0, mod.config(M, a.dtype, scales.dtype, group_size)["options"])
    if key not in _CUDA_BUILD:
        _CUDA_BUILD[key] = mod.unavailable(M, a.dtype, scales.dtype, group_size)
    return _CUDA_BUILD[key]


def _hatch_reason(name, tag, lo, hi, a, qweight, scales, zeros, group_size, bias, forced,
                  supported, config, unavailable) -> str | None:
    """None when a CUDA hatch kernel of ``tkit.cuda_ext.gemm_int4`` (its ``supported``,
    ``config`` and ``unavailable`` functions, by name) serves this call, else why not:
    unforced only for lo <= M <= hi; operands in its scope; a build that compiles here
    (worked out once a device and build, under ``tag``)."""
    M, K = a.shape
    if not forced and not lo <= M <= hi:
        return f"M={M} is outside {lo}..{hi}, the rows for which the {name} is the default"
    mod, why = _cuda_module(a)
    if why is not None:
        return why
    why = getattr(mod, supported)(a, qweight, scales, zeros, group_size, bias)
    if why is not None:
        return why
    dev = a.device.index or 0
    cfg = getattr(mod, config)(M, qweight.shape[1], K, a.dtype, scales.dtype, group_size,
                               D.sm_count(a.device))
    key = (tag, dev, cfg["options"])
    if key not in _CUDA_BUILD:
        _CUDA_BUILD[key] = getattr(mod, unavailable)(cfg["options"], dev)
    return _CUDA_BUILD[key]


def cuda_gemv_reason(a, qweight, scales, zeros, group_size, bias, forced=False
                     ) -> str | None:
    """None when the CUDA GEMV (``tkit.cuda_ext.gemm_int4.matmul_int4_gemv_cuda``) serves
    this call, else why not: unforced only for CUDA_GEMV_MIN_M <= M <= CUDA_GEMV_MAX_M;
    operands in its scope (``gemv_supported``); a build that compiles here."""
    return _hatch_reason("CUDA GEMV", "gemv", CUDA_GEMV_MIN_M, CUDA_GEMV_MAX_M, a, qweight,
                         scales, zeros, group_size, bias, forced, "gemv_supported",
                         "gemv_config", "gemv_unavailable")


def cuda_wgmma_reason(a, qweight, scales, zeros, group_size, bias, forced=False
                      ) -> str | None:
    """None when the CUDA wgmma GEMM (``tkit.cuda_ext.gemm_int4.matmul_int4_wgmma``) serves
    this call, else why not: unforced only for CUDA_WGMMA_MIN_M <= M <= CUDA_WGMMA_MAX_M;
    operands in its scope (``w4_supported``); a build that compiles here."""
    return _hatch_reason("CUDA wgmma GEMM", "wgmma", CUDA_WGMMA_MIN_M, CUDA_WGMMA_MAX_M, a,
                         qweight, scales, zeros, group_size, bias, forced, "w4_supported",
                         "w4_config", "w4_unavailable")


def backend(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None = None, *, group_size: int = 128,
            bias: torch.Tensor | None = None) -> str:
    """Which kernel an unforced ``matmul_int4`` call with these operands launches, and why
    (a 2-d ``a``)."""
    why_gemv = cuda_gemv_reason(a, qweight, scales, zeros, group_size, bias)
    if why_gemv is None:
        return ("cuda gemv (sm_90a: the codes straight into registers, mma.sync on "
                "dequantized registers, a 32-column slab a CTA)")
    why_wgmma = cuda_wgmma_reason(a, qweight, scales, zeros, group_size, bias)
    if why_wgmma is None:
        return ("cuda wgmma (sm_90a: TMA ring of 64-deep K steps, the weight dequantized once "
                "a CTA into wgmma's register operand, up to 128 rows of a a CTA)")
    why = cuda_reason(a, qweight, scales, zeros, group_size, bias)
    if why is None:
        return ("cuda (sm_90a: TMA ring of 512-deep K steps, mma.sync on dequantized "
                "registers, stream-K over one CTA an SM)")
    M, K = a.shape
    cfg = current_config(M, qweight.shape[1], K, group_size, D.sm_count(a.device))
    if CUDA_GEMV_MIN_M <= M <= CUDA_GEMV_MAX_M:
        why = why_gemv
    return f"triton {cfg.path} (not cuda: {why})"


def _dequant_matmul(a, qweight, scales, zeros, group_size, bias, cfg):
    """a @ dequant(w).T + bias: the (N, K) weight in a's dtype (a scratch of the call) by
    ``_dequant_int4_kernel``, then the 16-bit GEMM with its transpose (K-major, as an
    nn.Linear weight's ``w.t()``)."""
    M, K = a.shape
    N = qweight.shape[1]
    w = C.scratch((N, K), a.dtype, a.device)
    z = zeros if zeros is not None else scales
    C.launch(_dequant_int4_kernel, (C.cdiv(N, cfg.block_n), K // cfg.block_k), q_ptr=qweight,
             s_ptr=scales, z_ptr=z, w_ptr=w, N=N, stride_qk=qweight.stride(0),
             stride_qn=qweight.stride(1), stride_sg=scales.stride(0),
             stride_sn=scales.stride(1), stride_zg=z.stride(0), stride_zn=z.stride(1),
             stride_wn=w.stride(0), stride_wk=w.stride(1), GROUP=group_size,
             HAS_ZEROS=zeros is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
             num_warps=cfg.num_warps)
    return _matmul_impl(a, w.t(), bias, None, None, None, None, None, True, "auto")


def _reduce_splits(ws, out, bias, M, N, split):
    """out = the sum of the split partials ws (split, M, N) float32 (+ bias), in split order."""
    rbn = 128 if N >= 128 else max(16, C.next_power_of_2(N))
    rbm = max(16, min(64, C.next_power_of_2(M)))
    C.launch(_splitk_reduce_kernel, (C.cdiv(N, rbn), C.cdiv(M, rbm)),
             ws_ptr=ws, c_ptr=out, sa_ptr=ws, sb_ptr=ws,
             bias_ptr=bias if bias is not None else ws, res_ptr=ws, M=M, N=N,
             stride_cm=out.stride(0), stride_cn=out.stride(1), stride_rm=0, stride_rn=0,
             stride_bias=bias.stride(0) if bias is not None else 0, SPLIT_K=split,
             SCALE_A=0, SCALE_B=0, HAS_BIAS=bias is not None, ACT="", HAS_RES=False,
             BLOCK_M=rbm, BLOCK_N=rbn, num_warps=4)


@R.custom_op("tkit::matmul_int4", mutates_args=(), plans=True)
def _matmul_int4_op(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: Optional[torch.Tensor], group_size: int,  # noqa: UP045
                    bias: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    if not _OVERRIDES.active():
        # served by an eager plan on a repeated signature, as the eager call is (what a
        # torch.compile graph calls: its Python path took ~80 us a call on an H100's host
        # against ~7 for the eager call's plan); an override is read by the Python path alone
        args = (a, qweight, scales, zeros, group_size, bias)
        return P.serve_op(_matmul_int4_op, _matmul_int4_impl, args)
    return _matmul_int4_impl(a, qweight, scales, zeros, group_size, bias)


@_matmul_int4_op.register_fake
def _(a, qweight, scales, zeros, group_size, bias):
    return a.new_empty((a.shape[0], qweight.shape[1]))


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _check_group(group_size, K: int, K_name: str = "K") -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size <= 0 or group_size % 16:
        raise ValueError(f"group_size must be a positive multiple of 16, got {group_size}")
    if K % group_size:
        raise ValueError(f"group_size={group_size} does not divide {K_name}={K}")


def _check_packed(qweight, scales, zeros, group_size,
                  scale_dtypes=SCALE_DTYPES) -> tuple[int, int]:
    """(K, N) of a packed weight, after checking the three tensors against each other."""
    C.check_tensor(qweight, "qweight", (torch.int32,), ndim=2)
    C.check_tensor(scales, "scales", scale_dtypes, ndim=2)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    _check_group(group_size, K, "K (8 * qweight.shape[0])")
    if tuple(scales.shape) != (K // group_size, N):
        raise ValueError(f"scales must have shape (K // group_size, N) = "
                         f"({K // group_size}, {N}), got {tuple(scales.shape)}")
    if zeros is not None:
        C.check_tensor(zeros, "zeros", scale_dtypes, ndim=2)
        if zeros.shape != scales.shape:
            raise ValueError(f"zeros must have the shape of scales {tuple(scales.shape)}, got "
                             f"{tuple(zeros.shape)}")
    C.check_same_device(qweight=qweight, scales=scales, zeros=zeros)
    return K, N


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def matmul_int4(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None = None, *, group_size: int = 128,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ dequant(w).T + bias`` for an INT4 weight in tkit's layout (module docstring).

    Parameters
    ----------
    a : Tensor
        (..., K) float16 or bfloat16, any strides.
    qweight : Tensor
        int32 (K // 8, N), from :func:`quantize_int4`, :func:`int4_from_awq` or
        :func:`int4_from_gptq`.
    scales : Tensor
        (K // group_size, N) float16 / bfloat16 / float32.
    zeros : Tensor, optional
        (K // group_size, N), scales' dtype, zero points in code units; None: symmetric (8).
    group_size : int
        A multiple of 16 that divides K.
    bias : Tensor, optional
        (N,).

    Returns
    -------
    Tensor (..., N) in a's dtype.
    """
    if (type(group_size) is int
            and P.plannable(_OVERRIDES.state.value, a, qweight, scales, zeros, bias)):
        # the eager plan (tkit.kernels._plan): the config follows from the shapes, the group
        # size and the device; the one-launch split-K reduce (per-device counters) is never
        # planned, its calls take the ordinary path
        args = (a, qweight, scales, zeros, bias)
        return P.serve_fast(_plans, (group_size,), args, _matmul_int4_slow,
                            (a, qweight, scales, zeros, group_size, bias))
    return _matmul_int4_slow(a, qweight, scales, zeros, group_size, bias)


_plans = P.new_cache()


def _matmul_int4_slow(a, qweight, scales, zeros, group_size, bias):
    C.check_tensor(a, "a", ACT_DTYPES, min_ndim=1)
    K, N = _check_packed(qweight, scales, zeros, group_size)
    if a.shape[-1] != K:
        raise ValueError(f"a.shape[-1]={a.shape[-1]} must equal K = 8 * qweight.shape[0] = {K}")
    if zeros is not None and zeros.dtype != scales.dtype:
        raise TypeError(f"zeros has dtype {C.dtype_name(zeros.dtype)} but scales has "
                        f"{C.dtype_name(scales.dtype)}")
    if bias is not None:
        C.check_tensor(bias, "bias", C.FLOAT_DTYPES, ndim=1)
        if bias.shape[0] != N:
            raise ValueError(f"bias must have shape ({N},) (N), got {tuple(bias.shape)}")
    C.check_same_device(a=a, qweight=qweight, bias=bias)
    lead = a.shape[:-1]
    a2 = a.reshape(-1, K)
    if C.use_direct_path(a2, scales, zeros, bias):
        out = _matmul_int4_impl(a2, qweight, scales, zeros, group_size, bias)
    else:
        out = _matmul_int4_op(a2, qweight, scales, zeros, group_size, bias)
    return out.reshape(*lead, N)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False):
    """Quantize an nn.Linear weight (N, K) to tkit's INT4 layout (round to nearest).

    Asymmetric (default, AWQ's rule): per group, ``s = (max - min) / 15`` (1 where max = min),
    ``z = clamp(round(-min / s), 0, 15)``, ``q = clamp(round(w / s) + z, 0, 15)``.
    Symmetric: ``s = amax / 7`` (1 where amax = 0), ``q = clamp(round(w / s), -8, 7) + 8``,
    ``zeros`` is None. Rounding is half to even, in float32.

    Returns
    -------
    (qweight int32 (K // 8, N), scales (K // group_size, N), zeros (K // group_size, N) or
    None); scales and zeros in w's dtype for float16 / bfloat16 weights, else float32.
    Round trip: |dequant(q) - w| <= s / 2 (plus the rounding of s and z to their dtype).
    """
    C.check_tensor(w, "w", C.FLOAT_DTYPES, ndim=2)
    N, K = w.shape
    _check_group(group_size, K)
    sdt = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float32
    g = w.detach().float().reshape(N, K // group_size, group_size)
    if symmetric:
        amax = g.abs().amax(-1, keepdim=True)
        s = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(sdt)
        q = torch.clamp(torch.round(g / s.float()), -8, 7) + SYM_ZERO
        zeros = None
    else:
        lo = g.amin(-1, keepdim=True)
        hi = g.amax(-1, keepdim=True)
        s = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi)).to(sdt)
        z = torch.clamp(torch.round(-lo / s.float()), 0, 15)
        q = torch.clamp(torch.round(g / s.float()) + z, 0, 15)
        zeros = z.reshape(N, -1).t().contiguous().to(sdt)
    qweight = pack_int4(q.reshape(N, K).to(torch.uint8))
    return qweight, s.reshape(N, -1).t().contiguous(), zeros


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q`` (N, K) in [0, 15] (any integer dtype) -> tkit's qweight, int32 (K // 8, N)."""
    N, K = q.shape
    if K % 8:
        raise ValueError(f"K={K} must be a multiple of 8 to pack")
    t = q.t().to(torch.int64).reshape(K // 8, 8, N)
    shifts = (torch.arange(8, device=q.device, dtype=torch.int64) * 4).reshape(1, 8, 1)
    packed = (t << shifts).sum(1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32).contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """tkit's qweight int32 (K // 8, N) -> codes (N, K) uint8 in [0, 15]."""
    k8, N = qweight.shape
    shifts = (torch.arange(8, device=qweight.device, dtype=torch.int32) * 4).reshape(1, 8, 1)
    q = (qweight[:, None, :] >> shifts) & 0xF
    return q.reshape(k8 * 8, N).t().to(torch.uint8)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None = None, *, group_size: int = 128,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight (N, K) a packed INT4 weight stands for, ``(q - z) * s``, computed in
    ``dtype`` (default: scales' dtype; float64 for the reference)."""
    K, N = _check_packed(qweight, scales, zeros, group_size, (*SCALE_DTYPES, torch.float64))
    dtype = dtype or scales.dtype
    q = unpack_int4(qweight).to(dtype).reshape(N, K // group_size, group_size)
    s = scales.t().to(dtype)[:, :, None]
    z = zeros.t().to(dtype)[:, :, None] if zeros is not None else SYM_ZERO
    return ((q - z) * s).reshape(N, K)


def _unpack_cols(packed: torch.Tensor, order) -> torch.Tensor:
    """int32 (R, C // 8) packed 8 to a word along the columns -> (R, C) codes, where bits
    4*i .. 4*i + 3 of word c hold column 8*c + order[i]."""
    R, C8 = packed.shape
    shifts = (torch.arange(8, device=packed.device, dtype=torch.int32) * 4)
    nib = (packed[:, :, None] >> shifts) & 0xF  # (R, C8, 8): nibble i
    out = torch.empty_like(nib)
    out[:, :, list(order)] = nib
    return out.reshape(R, C8 * 8)


#: AutoAWQ's nibble order: bits 4*i of a packed word hold column 8*c + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def int4_from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """tkit's INT4 layout from an AutoAWQ "GEMM" checkpoint (``WQLinear_GEMM``, version gemm).

    AWQ format (AutoAWQ's ``WQLinear_GEMM.from_linear`` / ``awq.utils.packing_utils``):

    * ``qweight`` int32 (K, N // 8): row k is input channel k; 8 output columns are packed
      per word in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7]: bits 4*i .. 4*i + 3 of word
      c hold column 8*c + [0, 2, 4, 6, 1, 3, 5, 7][i] (AutoAWQ unpacks with the reverse
      order [0, 4, 1, 5, 2, 6, 3, 7]).
    * ``qzeros`` int32 (K // G, N // 8), packed the same way; zero points used as stored.
    * ``scales`` float16 (K // G, N).
    * ``w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.

    Returns (qweight, scales, zeros) for :func:`matmul_int4` with ``group_size = K //
    scales.shape[0]``; scales keep their dtype, zeros take it. Exact (no rounding).
    """
    C.check_tensor(qweight, "qweight", (torch.int32,), ndim=2)
    C.check_tensor(qzeros, "qzeros", (torch.int32,), ndim=2)
    C.check_tensor(scales, "scales", SCALE_DTYPES, ndim=2)
    K, N = qweight.shape[0], qweight.shape[1] * 8
    if scales.shape[1] != N or scales.shape[0] == 0 or K % scales.shape[0]:
        raise ValueError(f"scales must have shape (K // G, N) with N = 8 * qweight.shape[1] = "
                         f"{N} and K // G dividing K = {K}, got {tuple(scales.shape)}")
    if tuple(qzeros.shape) != (scales.shape[0], N // 8):
        raise ValueError(f"qzeros must have shape ({scales.shape[0]}, {N // 8}), got "
                         f"{tuple(qzeros.shape)}")
    q = _unpack_cols(qweight, AWQ_ORDER)  # (K, N)
    z = _unpack_cols(qzeros, AWQ_ORDER)
    return pack_int4(q.t()), scales.contiguous(), z.to(scales.dtype).contiguous()


def int4_from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor | None = None, *, checkpoint_format: str = "gptq"):
    """tkit's INT4 layout from an AutoGPTQ / GPTQModel 4-bit checkpoint.

    GPTQ format (AutoGPTQ ``QuantLinear.pack``):

    * ``qweight`` int32 (K // 8, N): bits 4*j .. 4*j + 3 of qweight[i, n] hold q[8*i + j, n]
      (packed along K, in order) -- the layout tkit uses, so it is taken as is.
    * ``qzeros`` int32 (K // G, N // 8): packed along N in order (bits 4*j: column 8*c + j).
      ``checkpoint_format="gptq"`` (AutoGPTQ, and GPTQModel's v1 checkpoints) stores every
      zero point minus one (``zeros -= 1`` before packing; the kernels add it back), so
      z = stored + 1 (wrapping 15 + 1 to 16 is kept as 16: it is what the original model
      computed). ``"gptq_v2"`` (GPTQModel's internal format) stores z itself.
    * ``scales`` float16 (K // G, N); ``g_idx`` int32 (K,), the group of each input channel:
      ``k // G`` unless the model was quantized with act-order (desc_act), which is not
      supported here yet (a permutation of K would have to travel with the weight).
    * ``w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``.

    Returns (qweight, scales, zeros) for :func:`matmul_int4` with ``group_size = K //
    scales.shape[0]``. Exact.
    """
    C.check_tensor(qweight, "qweight", (torch.int32,), ndim=2)
    C.check_tensor(qzeros, "qzeros", (torch.int32,), ndim=2)
    C.check_tensor(scales, "scales", SCALE_DTYPES, ndim=2)
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got "
                         f"{checkpoint_format!r}")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    if scales.shape[1] != N or scales.shape[0] == 0 or K % scales.shape[0]:
        raise ValueError(f"scales must have shape (K // G, N) with N = qweight.shape[1] = {N} "
                         f"and K // G dividing K = {K}, got {tuple(scales.shape)}")
    groups = scales.shape[0]
    if tuple(qzeros.shape) != (groups, C.cdiv(N, 8)):
        raise ValueError(f"qzeros must have shape ({groups}, {C.cdiv(N, 8)}), got "
                         f"{tuple(qzeros.shape)}")
    G = K // groups
    if g_idx is not None:
        C.check_tensor(g_idx, "g_idx", (torch.int32, torch.int64), ndim=1)
        want = torch.arange(K, device=g_idx.device) // G
        if g_idx.shape[0] != K or not torch.equal(g_idx.to(torch.int64), want):
            raise ValueError("g_idx is not k // group_size (an act-order / desc_act "
                             "checkpoint): not supported yet")
    z = _unpack_cols(qzeros, range(8))[:, :N].to(scales.dtype)
    if checkpoint_format == "gptq":
        z = z + 1
    return qweight.contiguous(), scales.contiguous(), z.contiguous()


def cost(a, qweight, scales, zeros=None, *, group_size=128, bias=None, **kwargs):
    """(bytes, FLOPs): codes, scales, zeros, a and bias read once, the output written once."""
    from tkit._cost import Cost

    K, N = qweight.shape[0] * 8, qweight.shape[1]
    M = a.numel() // max(K, 1)
    nbytes = (qweight.numel() * 4 + scales.numel() * scales.element_size()
              + (zeros.numel() * zeros.element_size() if zeros is not None else 0)
              + M * K * a.element_size() + M * N * a.element_size()
              + (bias.numel() * bias.element_size() if bias is not None else 0))
    return Cost(nbytes, 2.0 * M * N * K)


__all__ = ["matmul_int4", "quantize_int4", "dequantize_int4", "int4_from_awq", "int4_from_gptq",
           "pack_int4", "unpack_int4", "Int4Config", "int4_config"]
