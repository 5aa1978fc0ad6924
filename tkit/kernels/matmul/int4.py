"""INT4 weight-only GEMM (W4A16): ``out = a @ dequant(w).T + bias`` for an nn.Linear weight.

Math. ``w`` (N, K) is stored as 4-bit unsigned codes ``q`` in [0, 15] with one scale ``s`` and
one zero point ``z`` per group of ``group_size`` consecutive K values of a row:

    dequant(w)[n, k] = (q[n, k] - z[k // G, n]) * s[k // G, n]

Symmetric weights (``zeros=None``) take ``z = 8``: codes 0..15 are the signed values -8..7.
The kernel dequantizes in a's dtype (fp16 / bf16) exactly as torch does it -- ``q - z``
rounded, then ``* s`` rounded, with z and s first rounded to a's dtype -- and multiplies on the
tensor cores with a float32 accumulator; the reference rule's peer does the same in torch
(dequantize in a's dtype, then a @ w.T), so the weight the MMA sees is bit for bit the
reference's.

Layout (tkit's; chosen for the kernel, and the same as GPTQ's ``qweight``):

    qweight  int32 (K // 8, N): qweight[i, n] holds q[n, 8*i + j] in bits 4*j .. 4*j + 3,
             j = 0..7 (eight consecutive K values of one output column, low nibble first)
    scales   (K // G, N), float16 / bfloat16 / float32 (row g: the scales of group g)
    zeros    (K // G, N), same dtype as scales, or None (symmetric, z = 8). Zero points are
             kept as floats in code units (integers for AWQ/GPTQ and quantize_int4), so any
             checkpoint's convention is one exact conversion.

Why this layout: a (BLOCK_K // 8, BLOCK_N) int32 tile is contiguous along N (coalesced rows),
and one int32 holds eight K values of one column, unpacked in registers. Scales and zeros of
one K-step are one row (BLOCK_K divides G), loaded once per step.

Dequantization (``_dequant_tile``): one inline-PTX block per word turns it into four 32-bit
registers, each holding two consecutive K values in a's dtype, the form the MMA operand
takes: ``prmt`` puts nibble 2m in bits 0..3 and nibble 2m+1 in bits 16..19, one ``lop3``
masks them and ORs in the bits of MAGIC (128 in bf16, 1024 in fp16: both halves are then
MAGIC + q exactly, no int -> float conversion), and packed ``fma``s compute q, q - z and
(q - z) * s on both halves (~3 instructions a weight). The pairs are joined into the
(BLOCK_K, BLOCK_N) tile in a *permuted K order* (``_k_order``) chosen so that the four K values
of each thread's MMA B-operand registers (mma.sync, kWidth 4) are nibbles of one word that
the thread itself unpacked: the tile needs no exchange through shared memory, and the
activations are loaded in the same K order (8-byte runs), which is legal because the dot sums
over K. Tiles of BLOCK_M >= 64 (wgmma, which reads B from shared memory) and BLOCK_K = 16 keep
the natural order. The interpreter runs the same math in float32 with explicit roundings.

Cost model: FLOPs = 2*M*N*K; bytes = K*N/2 (weight) + 2 * (K/G)*N*s_size (scales, zeros)
+ M*K*a_size + M*N*out_size. At M = 1..16 the weight bytes dominate (K=4096, N=14336, G=128:
29.4 MB of codes + 1.8 MB of fp16 scales and zeros, against 117 MB for bf16): memory-bound,
so the target is the copy bandwidth over ~4x fewer bytes than a bf16 GEMV. The arithmetic
intensity is ~4*M FLOP/byte, so INT4 stops winning when the bf16 GEMM turns compute-bound
itself (M ~ 200 on the H200) and falls behind past that (the dequantization is extra work
per weight element per M tile).

Kernel: ``_matmul_int4_kernel``, program_id(0) walks N tiles, (1) M tiles, (2) K splits.
Decode (M <= 64): BLOCK_M = 16..64, BLOCK_N = 64 (128 where that leaves >= 3 programs per
SM), BLOCK_K = min(128, G), and K split only as far as needed for >= 3 programs per SM (K=4096,
N=14336: 224 column slabs x split 2 = 448 programs, see ``Int4Config.for_shape``); partials in
float32 are summed in a fixed order by matmul's ``_splitk_reduce_kernel``, which applies the
bias (deterministic, no atomics). Rows past M are masked on the activation load (M = 1 reads
one row, not 16). Larger M: 64/128 x 128 tiles, no split, the dequantized tile through shared
memory into wgmma.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels._numerics import INTERPRET, round_to
from tkit.kernels.matmul._kernels import _dot, _splitk_reduce_kernel

ACT_DTYPES = (torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the zero point of symmetric weights (codes 0..15 are -8..7)
SYM_ZERO = 8


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4Config:
    """Launch parameters of ``_matmul_int4_kernel``. BLOCK_K must divide the group size (one
    scale row per K step) and be a power of 2 >= 16; split_k > 1 adds the reduce launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    @staticmethod
    def for_shape(M: int, N: int, K: int, group_size: int, num_sms: int = 132) -> Int4Config:
        """Heuristic; the numbers below are predicted from first principles and sm_90a compile
        facts (tkit.ir), not measured.

        Decode (M <= 64) streams the weight and is bound by instruction issue as much as by
        bytes: ~58.7 M weights at K=4096, N=14336 in ~10 us is ~22 weights per SM per clock.
        The kernel spends ~5.5 SASS instructions per weight a thread (K=4096, N=14336, 64 x
        16-row tile, 4 warps: 354 in the loop for 64 weights a thread; the previous kernel 994
        for 128), so it wants many warps per SM: 4 warps of 16 columns each (BLOCK_N = 64; at
        BLOCK_N = 32 a warp's 8 columns do not pay for its share of the activation operand).
        Column slabs of 128 narrow to 64 when there are fewer than 3 programs per SM, then K is
        split (powers of 2, >= 8 K steps a split) up to >= 3 programs per SM: K=4096, N=14336
        gives 224 slabs x split 2 = 448 programs, all resident at once (95 registers: 5 per
        SM), 13.6 warps per SM. Each program keeps NUM_STAGES - 1 steps of BLOCK_K x BLOCK_N
        / 2 bytes in flight: 3 x 4 KB, ~41 KB per SM, above the ~26 KB that Little's law asks
        for (~4.2 TB/s / 132 SMs x ~0.8 us). Shared memory per program (stages x (a tile +
        packed tile)) stays under ~56 KB (110 KB at BLOCK_M = 64). A GEMV without tensor cores
        is not used at small M: it needs the same dequantization plus a bf16 -> fp32 convert
        and an FFMA per weight, while the MMA costs 16 instructions per 2048 weights a warp.
        Larger M takes a compute tile (64/128 x 128, no split)."""
        bk = _block_k(group_size)
        bn = 128 if N >= 128 else max(16, C.next_power_of_2(N))
        if _env.INTERPRET:  # the interpreter pays per program and per element: small tiles
            bn = min(bn, 64)
        if M <= 64:
            bm = max(16, min(64, C.next_power_of_2(M)))
            m_tiles = C.cdiv(M, bm)
            if bn > 64 and C.cdiv(N, bn) * m_tiles < 3 * num_sms:
                bn = 64
            tiles = C.cdiv(N, bn) * m_tiles
            split, k_steps = 1, K // bk
            while tiles * split < 3 * num_sms and k_steps // (2 * split) >= 8:
                split *= 2
            step_bytes = bk * bn // 2
            stages = max(3, min(6, 1 + C.cdiv(10240, step_bytes)))
            per_stage = bm * bk * 2 + step_bytes
            budget = (56 if bm <= 32 else 110) * 1024  # 4 programs an SM (2 at BLOCK_M 64)
            while stages > 2 and stages * per_stage > budget:
                stages -= 1
            return Int4Config(bm, bn, bk, split, num_warps=4, num_stages=stages)
        bm = 64 if M <= 128 else 128
        return Int4Config(bm, bn, bk, 1, num_warps=8 if bm == 128 else 4, num_stages=3)


_OVERRIDES = C.ConfigOverrides(Int4Config)


def int4_config(**overrides):
    """Override fields of :class:`Int4Config` for the calls made inside (this thread only),
    e.g. ``with int4_config(split_k=4, num_stages=3): ...``; an unknown field is a TypeError
    naming it, and a block_k that does not divide the group size a ValueError at the call.
    For experiments (the H200 sweep of this table) and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(M: int, N: int, K: int, group_size: int, num_sms: int) -> Int4Config:
    cfg = Int4Config.for_shape(M, N, K, group_size, num_sms)
    if _OVERRIDES.active():
        cfg = _OVERRIDES.apply(cfg)
        if group_size % cfg.block_k or cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1):
            raise ValueError(f"block_k={cfg.block_k} must be a power of 2 >= 16 dividing "
                             f"group_size={group_size}")
    return cfg


def _block_k(group_size: int) -> int:
    bk = 128
    while group_size % bk:
        bk //= 2
    return bk


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
#: bits of the 16-bit constants the dequantization works with, per activation dtype
#: (one, minus one, -MAGIC, -(MAGIC + SYM_ZERO), -0.0): MAGIC = 128 for bfloat16 (7 mantissa bits:
#: 0x4300 | q is 128 + q exactly), 1024 for float16 (0x6400 | q is 1024 + q)
_BF16_BITS = (0x3F80, 0xBF80, 0xC300, 0xC308, 0x8000)
_F16_BITS = (0x3C00, 0xBC00, 0xE400, 0xE408, 0x8000)


def _pair(b: int) -> int:
    return b | (b << 16)


def _dequant_asm(is_bf16: bool, has_zeros: bool) -> str:
    """PTX for one packed word: $4 = qweight word (8 K values, nibble j = k 8i + j), $5 = the
    column's zero point (both halves, a's dtype), $6 = its scale. Outputs $0..$3: the pairs
    (k 8i + 2m, 8i + 2m + 1), m = 0..3, as 16-bit x2 words of ``(q - z) * s`` rounded once per
    operation exactly as torch does in a's dtype (``(q - z)`` then ``* s``)."""
    one, neg_one, neg_magic, neg_sym, neg_zero = _BF16_BITS if is_bf16 else _F16_BITS
    magic = 0x4300 if is_bf16 else 0x6400
    fma = "fma.rn.bf16x2" if is_bf16 else "fma.rn.f16x2"
    lines = ["{", ".reg .b32 hi, t, c1, cm, c0;",
             f"mov.b32 c1, {_pair(one):#010x};",
             f"mov.b32 cm, {_pair(neg_one):#010x};" if has_zeros else
             f"mov.b32 cm, {_pair(neg_sym):#010x};",
             f"mov.b32 c0, {_pair(neg_zero):#010x};",
             "shr.u32 hi, $4, 4;"]
    if has_zeros:
        lines.append(".reg .b32 cq;")
        lines.append(f"mov.b32 cq, {_pair(neg_magic):#010x};")
    for m in range(4):
        # byte m of the word (nibbles 2m, 2m+1): nibble 2m to bits 0..3, nibble 2m+1 to 16..19
        sel = ((4 + m) << 12) | ((4 + m) << 8) | (m << 4) | m
        lines += [f"prmt.b32 t, $4, hi, {sel:#06x};",
                  # (t & 0x000F000F) | MAGIC: MAGIC + q in both halves, one LOP3
                  f"lop3.b32 t, t, 0x000F000F, {_pair(magic):#010x}, 0xEA;"]
        if has_zeros:
            lines += [f"{fma} t, t, c1, cq;",  # q (exact)
                      f"{fma} t, $5, cm, t;"]  # q - z
        else:
            lines.append(f"{fma} t, t, c1, cm;")  # q - 8 (exact)
        lines.append(f"{fma} ${m}, t, $6, c0;")  # (q - z) * s
    lines.append("}")
    return "\n".join(lines)


_ASM = {(bf, hz): _dequant_asm(bf, hz) for bf in (True, False) for hz in (True, False)}
_ASM_BF16_Z = tl.constexpr(_ASM[True, True])
_ASM_BF16_SYM = tl.constexpr(_ASM[True, False])
_ASM_F16_Z = tl.constexpr(_ASM[False, True])
_ASM_F16_SYM = tl.constexpr(_ASM[False, False])


@triton.jit
def _split_pair(d, dtype: tl.constexpr):
    """A 32-bit word holding two 16-bit values -> (low, high) in ``dtype``."""
    lo = d.to(tl.int16).to(dtype, bitcast=True)
    hi = (d >> 16).to(tl.int16).to(dtype, bitcast=True)
    return lo, hi


@triton.jit
def _dequant_pairs_interp(q, z, s, m: tl.constexpr, dtype: tl.constexpr):
    """The interpreter's twin of one asm output: the nibbles 2m, 2m+1 of each word as
    ``(q - z) * s`` rounded to dtype after each operation (z, s: float32 holding dtype values)."""
    lo = ((q >> (8 * m)) & 0xF).to(tl.float32)
    hi = ((q >> (8 * m + 4)) & 0xF).to(tl.float32)
    lo = round_to(round_to(lo - z, dtype).to(tl.float32) * s, dtype)
    hi = round_to(round_to(hi - z, dtype).to(tl.float32) * s, dtype)
    return lo, hi


@triton.jit
def _dequant_tile(q, z, s, dtype: tl.constexpr, HAS_ZEROS: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PERMUTE: tl.constexpr):
    """(BLOCK_K // 8, BLOCK_N) packed words -> the (BLOCK_K, BLOCK_N) dequantized tile in dtype,
    rows in _k_order's K order (natural unless PERMUTE). z, s: (BLOCK_N,) float32 holding
    values of dtype (z = 8 if not HAS_ZEROS). On the GPU one inline-asm block per word: 1
    shift, then per output pair (two K values in one 32-bit register, as the MMA operand
    holds them) prmt + lop3 + 3 packed fma (2 when symmetric): 21 instructions per 8 weights
    (17 symmetric), no int -> float conversion (the nibble is OR-ed into the mantissa of
    MAGIC = 128 / 1024)."""
    if INTERPRET:
        w0l, w0h = _dequant_pairs_interp(q, z[None, :], s[None, :], 0, dtype)
        w1l, w1h = _dequant_pairs_interp(q, z[None, :], s[None, :], 1, dtype)
        w2l, w2h = _dequant_pairs_interp(q, z[None, :], s[None, :], 2, dtype)
        w3l, w3h = _dequant_pairs_interp(q, z[None, :], s[None, :], 3, dtype)
    else:
        zb = z.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        sb = s.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        zz = (zb | (zb << 16))[None, :]
        ss = (sb | (sb << 16))[None, :]
        if dtype == tl.bfloat16:
            if HAS_ZEROS:
                asm: tl.constexpr = _ASM_BF16_Z
            else:
                asm: tl.constexpr = _ASM_BF16_SYM
        else:
            if HAS_ZEROS:
                asm: tl.constexpr = _ASM_F16_Z
            else:
                asm: tl.constexpr = _ASM_F16_SYM
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            asm, "=r,=r,=r,=r,r,r,r", [q, zz, ss],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        w0l, w0h = _split_pair(d0, dtype)
        w1l, w1h = _split_pair(d1, dtype)
        w2l, w2h = _split_pair(d2, dtype)
        w3l, w3h = _split_pair(d3, dtype)
    # [i, n, p, b, c] = physical K value 8i + 4c + 2b + p of column n (word i, nibble 2m + p,
    # m = 2c + b)
    x = tl.join(tl.join(tl.join(w0l, w0h), tl.join(w1l, w1h)),
                tl.join(tl.join(w2l, w2h), tl.join(w3l, w3h)))
    if PERMUTE:
        # the tile in _k_order's logical order: word i = KH t + h (t < 4, h < KH = BLOCK_K / 32)
        # to row 32h + 16c + 4t + 2b + p, so that the four K values of one MMA B-operand
        # register pair (kWidth 4) are one thread's nibbles of one word and the operand needs
        # no exchange between threads (the K order is the activations' too: the dot sums K)
        x = tl.reshape(x, (4, BLOCK_K // 32, BLOCK_N, 2, 2, 2))  # [t, h, n, p, b, c]
        x = tl.permute(x, (1, 5, 0, 4, 3, 2))  # [h, c, t, b, p, n]
    else:
        # natural K order: row 8i + 4c + 2b + p = k (the tile goes to shared memory, where
        # wgmma reads its B operand, with 16-byte stores)
        x = tl.permute(x, (0, 4, 3, 2, 1))  # [i, c, b, p, n]
    return tl.reshape(x, (BLOCK_K, BLOCK_N))


@triton.jit
def _k_order(BLOCK_K: tl.constexpr, PERMUTE: tl.constexpr):
    """The physical K offset (inside a BLOCK_K step) of each logical row of the tile that
    _dequant_tile builds: row r = 32h + 16c + 4t + e holds K = 8 (KH t + h) + 4c + e."""
    r = tl.arange(0, BLOCK_K)
    if PERMUTE:
        h = r // 32
        c = (r // 16) % 2
        t = (r // 4) % 4
        e = r % 4
        r = 8 * ((BLOCK_K // 32) * t + h) + 4 * c + e
    return r


@triton.jit
def _matmul_int4_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, c_ptr, ws_ptr, bias_ptr, M, N, K,
    stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_cm, stride_cn, stride_bias,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile over this program's K range.

    a_ptr (M, K) fp16/bf16 any strides; q_ptr int32 (K // 8, N) in the layout of the module
    docstring; s_ptr / z_ptr (K // GROUP, N). SPLIT_K == 1: bias and the store to c_ptr
    (M, N) here; otherwise the float32 partial goes to ws_ptr[pid_k] (SPLIT_K, M, N),
    contiguous, summed by ``_splitk_reduce_kernel``. K is a multiple of GROUP, GROUP of
    BLOCK_K (the launcher checks), so no K masks. A split may own no K step (then it stores
    zeros).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past M are masked on the load (no bytes fetched: M = 1 reads one row of a, not
    # BLOCK_M copies of it) and on the store; columns past N read a valid one
    a_mask = (offs_m < M)[:, None]
    offs_bn = offs_n % N
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * per_split
    k_end = tl.minimum(k_begin + per_split, k_tiles)
    # small tiles (mma.sync) take the dequantized tile straight from registers in a permuted
    # K order; BLOCK_M >= 64 tiles (wgmma, B from shared memory) keep the natural order
    PERMUTE: tl.constexpr = BLOCK_K >= 32 and BLOCK_M < 64
    offs_k = _k_order(BLOCK_K, PERMUTE)  # the dequantized tile's K order
    offs_kq = tl.arange(0, BLOCK_K // 8)
    a_ptrs = (a_ptr + offs_m[:, None] * stride_am
              + (k_begin * BLOCK_K + offs_k)[None, :] * stride_ak)
    q_ptrs = (q_ptr + (k_begin * (BLOCK_K // 8) + offs_kq)[:, None] * stride_qk
              + offs_bn[None, :] * stride_qn)
    s_ptrs = s_ptr + offs_bn * stride_sn
    z_ptrs = z_ptr + offs_bn * stride_zn
    dtype: tl.constexpr = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(k_begin, k_end, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        q = tl.load(q_ptrs)
        g = (kt * BLOCK_K) // GROUP
        # scale and zero in a's dtype, as the reference dequantizes (held in float32)
        s = round_to(tl.load(s_ptrs + g * stride_sg).to(tl.float32), dtype).to(tl.float32)
        if HAS_ZEROS:
            z = round_to(tl.load(z_ptrs + g * stride_zg).to(tl.float32), dtype).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        w = _dequant_tile(q, z, s, dtype, HAS_ZEROS, BLOCK_K, BLOCK_N, PERMUTE)
        acc = _dot(a, w, acc, False)
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


def _k_order_host(block_k: int, block_m: int = 16) -> list[int]:
    """The K order of :func:`_k_order` in Python (for tests and readers)."""
    if block_k < 32 or block_m >= 64:
        return list(range(block_k))
    return [8 * ((block_k // 32) * ((r // 4) % 4) + r // 32) + 4 * ((r // 16) % 2) + r % 4
            for r in range(block_k)]


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
    split = cfg.split_k
    grid = (C.cdiv(N, cfg.block_n), C.cdiv(M, cfg.block_m), split)
    ws = C.scratch((split, M, N), torch.float32, a.device) if split > 1 else out
    z = zeros if zeros is not None else scales
    C.launch(_matmul_int4_kernel, grid, a_ptr=a, q_ptr=qweight, s_ptr=scales, z_ptr=z,
             c_ptr=out, ws_ptr=ws, bias_ptr=bias if bias is not None else scales,
             M=M, N=N, K=K, stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_qk=qweight.stride(0), stride_qn=qweight.stride(1),
             stride_sg=scales.stride(0), stride_sn=scales.stride(1),
             stride_zg=z.stride(0), stride_zn=z.stride(1),
             stride_cm=out.stride(0), stride_cn=out.stride(1),
             stride_bias=bias.stride(0) if bias is not None else 0,
             GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
             SPLIT_K=split, NUM_STAGES=cfg.num_stages, BLOCK_M=cfg.block_m,
             BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if split > 1:
        rbn = 128 if N >= 128 else max(16, C.next_power_of_2(N))
        C.launch(_splitk_reduce_kernel, (C.cdiv(N, rbn), C.cdiv(M, cfg.block_m)),
                 ws_ptr=ws, c_ptr=out, sa_ptr=ws, sb_ptr=ws,
                 bias_ptr=bias if bias is not None else ws, res_ptr=ws, M=M, N=N,
                 stride_cm=out.stride(0), stride_cn=out.stride(1), stride_rm=0, stride_rn=0,
                 stride_bias=bias.stride(0) if bias is not None else 0, SPLIT_K=split,
                 SCALE_A=0, SCALE_B=0, HAS_BIAS=bias is not None, ACT="", HAS_RES=False,
                 BLOCK_M=cfg.block_m, BLOCK_N=rbn, num_warps=4)
    return out


@torch.library.custom_op("tkit::matmul_int4", mutates_args=())
def _matmul_int4_op(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: Optional[torch.Tensor], group_size: int,  # noqa: UP045
                    bias: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
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
