# %% [markdown]
# # 09. Quantized and fused kernels: fewer bytes per weight, fewer passes per activation
#
# Inference on an H200 is mostly memory-bound: a decode step reads every weight once for a
# handful of tokens, and the ops between the GEMMs (norms, activations, RoPE) read and write
# activations at a few FLOPs per byte. Two levers cut the bytes: store weights in fewer bits
# (INT4 weight-only GEMM, fp8 activations) and fuse the small ops so each activation crosses
# HBM once. This chapter reads the formats' bits, states tkit's scale conventions and checks
# them, predicts from the roofline when INT4 beats a bf16 GEMM and when it stops, counts the
# bytes the fusions save, and on a GPU measures all of it against the prediction.
#
# Run it: `python tutorials/09_quantized_and_fused.py` (on a GPU it prints the measured table);
# `pytest tutorials/09_quantized_and_fused.py` checks every claim on any machine (kernels run in
# Triton's interpreter without a GPU).

# %%
from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # run kernels in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

import tkit  # noqa: E402
from tkit import registry  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The H200's measured ceilings (tkit's copy benchmark and cuBLAS bf16 GEMM, chapter 01)
HBM_TBPS = 4.24  # TB/s, device-to-device copy
BF16_TFLOPS = 700.0  # TFLOP/s, dense bf16 GEMM (tkit measured 680-720)


# %% [markdown]
# ## 1. The formats, from their bits
#
# A float8 byte is sign, exponent, mantissa. **e4m3fn** (1-4-3, bias 7) spends its top
# exponent on numbers instead of infinities ("fn": finite, with NaN only at S.1111.111), so
# its largest value is 1.110 x 2^8 = 448; the smallest subnormal is 0.001 x 2^-6 = 2^-9.
# **e5m2** (1-5-2, bias 15) keeps IEEE's specials (inf at exponent 31, mantissa 0) and trades
# a mantissa bit for range: max 1.11 x 2^15 = 57344. Three mantissa bits mean a step of 2^-3
# relative to the binade, so rounding to nearest is within 2^-4 = 6.25% of the value: e4m3 is
# the format for weights and activations, e5m2 for gradients. The decoder below follows the
# definitions and the tests compare it with torch's decoding of all 256 bytes.

# %%
def decode_minifloat(byte: int, exp_bits: int, man_bits: int, bias: int, ieee: bool) -> float:
    """The value of a 1-exp_bits-man_bits float byte. ieee: exponent all ones is inf/NaN
    (e5m2); otherwise only the all-ones pattern is NaN (e4m3fn)."""
    sign = -1.0 if byte >> (exp_bits + man_bits) else 1.0
    e = (byte >> man_bits) & ((1 << exp_bits) - 1)
    m = byte & ((1 << man_bits) - 1)
    top = (1 << exp_bits) - 1
    if ieee and e == top:
        return sign * math.inf if m == 0 else math.nan
    if not ieee and e == top and m == (1 << man_bits) - 1:
        return math.nan
    if e == 0:  # subnormal: 0.m x 2^(1 - bias)
        return sign * m / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)


def torch_decode(dtype) -> list[float]:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double().tolist()


def _same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def test_e4m3fn_bits():
    vals = torch_decode(E4M3)
    assert _same(vals, [decode_minifloat(b, 4, 3, 7, ieee=False) for b in range(256)])
    finite = [v for v in vals if math.isfinite(v)]
    assert not any(math.isinf(v) for v in vals)  # no infinities at all
    assert [b for b, v in enumerate(vals) if math.isnan(v)] == [0x7F, 0xFF]
    assert max(finite) == 448.0 == vals[0x7E] == torch.finfo(E4M3).max
    assert vals[0x01] == 2.0 ** -9 == min(v for v in finite if v > 0)
    assert vals[0x08] == 2.0 ** -6  # smallest normal


def test_e5m2_bits():
    vals = torch_decode(E5M2)
    assert _same(vals, [decode_minifloat(b, 5, 2, 15, ieee=True) for b in range(256)])
    assert vals[0x7C] == math.inf and vals[0xFC] == -math.inf
    assert [b for b, v in enumerate(vals) if math.isnan(v)] == [0x7D, 0x7E, 0x7F,
                                                                0xFD, 0xFE, 0xFF]
    assert max(v for v in vals if math.isfinite(v)) == 57344.0 == vals[0x7B]
    assert vals[0x01] == 2.0 ** -16


def e4m3_half_step(q: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3 values at q (subnormals: 2^-10)."""
    e = torch.floor(torch.log2(q.abs().double().clamp(min=2.0 ** -9))).clamp(min=-6)
    return 2.0 ** (e - 4)


# %% [markdown]
# The integer formats are simpler. **int8 symmetric** uses -127..127, not -128: the range is
# symmetric (q and -q both exist) and the scale is amax / 127. **int4** has 16 codes: 0..15
# with a zero point z per group (w = (q - z) s, asymmetric, AWQ's rule), or the signed values
# -8..7 stored as code = value + 8 (tkit's symmetric form, z = 8, s = amax / 7, so code 0, the
# value -8, is never produced).
#
# ## Scale conventions in tkit
#
# Everywhere, **x ~ q * scale** (dequantize by multiplying: `torch._scaled_mm`'s convention).
#
# * **fp8 activations, per token**: one float32 scale a row, amax / 448 (floored at
#   1 / (448 * 512) so an all-zero row stays finite): `tkit.quantize_fp8(x)`, scales (T, 1).
# * **1x128 groups** (DeepSeek-V3's activations): `quantize_fp8(x, group_size=128)`, scales
#   (T, K / 128). An outlier then spoils 128 values, not the whole row.
# * **128 x 128 weight blocks** (DeepSeek-V3's weights): one scale per block, (K / 128,
#   N / 128) for the (K, N) operand `w.t()`; `tkit.matmul_fp8` applies sa * sb to each 128-deep
#   K step's partial sum inside the K loop.
# * **int4 weights** (`tkit.quantize_int4`, group 128): per group of 128 consecutive K values
#   of a row, a scale and a zero point, each stored (K / 128, N). Packing (tkit/kernels, the
#   int4 module's docstring, the same as GPTQ's qweight): int32 (K / 8, N), word [i, n] holds
#   the codes of w[n, 8i .. 8i+7], nibble j in bits 4j .. 4j+3, low nibble first. Eight K
#   values of one output column per word and words contiguous along N: the kernel loads
#   16-byte vectors of four columns and unpacks with shifts and masks straight into the K-major
#   operand of `tl.dot`.

# %%
def unpack_int4_by_hand(qweight: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) from tkit's qweight (K / 8, N), read as the layout says."""
    k8, n = qweight.shape
    codes = torch.empty(n, k8 * 8, dtype=torch.int64)
    for j in range(8):
        codes[:, j::8] = ((qweight.to(torch.int64) >> (4 * j)) & 0xF).t()
    return codes


def block_quant_weight(w: torch.Tensor, block: int = 128):
    """w (N, K) -> (w_fp8 (N, K), scales (K / block, N / block)): one scale per block."""
    n, k = w.shape
    blocks = w.float().reshape(n // block, block, k // block, block)
    s = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1 / (448 * 512))  # (N/b, K/b)
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).to(E4M3).reshape(n, k)
    return q, s.t().contiguous()


def _x(shape, seed, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def test_fp8_per_token_and_1x128_round_trip():
    x = _x((6, 256), 0, scale=3.0)
    x[2, 77] = 40.0  # an outlier in row 2, group 0
    for g, ngroups in ((None, 1), (128, 2)):
        q, s = tkit.quantize_fp8(x, group_size=g)
        assert q.dtype == E4M3 and s.shape == (6, ngroups)
        xg = x.float().reshape(6, ngroups, -1)
        torch.testing.assert_close(s, xg.abs().amax(-1) / 448, rtol=2e-7, atol=0)
        r = xg / s[..., None]  # x in code units
        qg = q.float().reshape_as(r)
        assert (qg.abs().amax(-1) == 448).all()  # each amax lands on the top code
        assert ((r - qg).abs() <= e4m3_half_step(qg).to(r.device) * (1 + 1e-6)).all()
    # per token the outlier coarsens all of row 2; with 1x128 only its own group
    s_tok = tkit.quantize_fp8(x)[1]
    s_grp = tkit.quantize_fp8(x, group_size=128)[1]
    assert s_tok[2, 0] == s_grp[2, 0] > 4 * s_grp[2, 1]


def test_int8_round_trip():
    x = _x((5, 96), 1, scale=2.0)
    q, s = tkit.quantize_int8(x)
    assert q.dtype == torch.int8 and q.min() >= -127 and q.abs().max() == 127
    assert ((x.float() / s - q.float()).abs() <= 0.5 + 1e-5).all()


def test_int4_layout_and_round_trip():
    w = _x((64, 256), 2, torch.float32)
    qw, s, z = tkit.quantize_int4(w, group_size=128)
    assert qw.dtype == torch.int32 and qw.shape == (256 // 8, 64)
    assert s.shape == z.shape == (256 // 128, 64)
    codes = unpack_int4_by_hand(qw.cpu())
    assert codes.min() >= 0 and codes.max() <= 15
    zk = z.cpu().t().repeat_interleave(128, dim=1)  # (N, K): the zero point of each element
    sk = s.cpu().t().repeat_interleave(128, dim=1)
    by_hand = (codes - zk) * sk
    torch.testing.assert_close(by_hand, tkit.dequantize_int4(qw, s, z).cpu(), rtol=0, atol=0)
    assert ((by_hand - w.cpu()).abs() <= sk / 2 * (1 + 1e-5)).all()  # within half a step
    # symmetric: no zeros, codes = value + 8, and code 0 (-8) never used
    qw8, s8, z8 = tkit.quantize_int4(w, group_size=128, symmetric=True)
    c8 = unpack_int4_by_hand(qw8.cpu())
    assert z8 is None and c8.min() >= 1 and c8.max() <= 15
    # the GEMM computes a @ dequant(w).T
    a = _x((3, 256), 3)
    ref = a.double() @ by_hand.double().to(DEVICE).t()
    out = tkit.matmul_int4(a, qw, s.bfloat16(), z.bfloat16(), group_size=128)
    assert (out.double() - ref).abs().max() < 0.05 * ref.abs().max()


def test_block_scaled_fp8_gemm():
    a, w = _x((16, 256), 4), _x((256, 256), 5, scale=0.05)
    qa, sa = tkit.quantize_fp8(a, group_size=128)  # (16, 2): 1x128
    qw, sw = block_quant_weight(w)  # (2, 2): 128x128
    assert sa.shape == (16, 2) and sw.shape == (2, 2)
    out = tkit.matmul_fp8(qa, qw.t(), sa, sw.to(DEVICE))
    ref = a.double() @ w.double().t()
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 0.06  # two fp8 roundings, each within 2^-4 of its value


# %% [markdown]
# ## 2. INT4 weight-only GEMM (W4A16) against bf16, from the roofline
#
# The question: for an MLP projection of N = 14336, K = 4096 (Llama-3-8B's up projection),
# when does storing the weight in 4 bits pay? The GEMM does 2 M N K FLOPs either way. It moves
#
# * bf16: 2 N K bytes of weight (117 MB) + 2 M K of activations + 2 M N of output;
# * int4: N K / 2 of codes (29.4 MB) + 2 (K / 128) N 2 bytes of fp16 scales and zeros (1.8
#   MB, 6% of the codes) + the same activations and output.
#
# At decode (M = 1..16) the bytes alone predict the bytes ratio, ~3.76x, not 4x because of the
# scales and zeros. But the weight must also be *converted*: every element is unpacked and
# turned into bf16 (shift, mask, int-to-float, subtract the zero, multiply by the scale, round
# to bf16: ~6 instructions, counted from the kernel's loop body, not counting the trip through
# shared memory that the MMA's operand takes) once per BLOCK_M-row tile, before the same bf16
# tensor-core MMA. The H200 issues ~33 T lane-instructions/s (132 SMs x 128 lanes x 1.98 GHz,
# the datasheet; an optimistic rate, conversions issue slower): 10.5 us per pass over the
# 58.7 M weights, more than the 7.4 us the int4 bytes take. So the prediction at M = 1 is
# 2.6x with this conversion, and the full 3.76x only for a conversion of <= 4.2 instructions
# an element (kernels such as Marlin convert with bit tricks to get under that).
#
# Past decode, the bf16 GEMM's intensity is ~M FLOP/byte: it reaches the H200's ridge
# (700 / 4.24 = 165 FLOP/byte) at M ~ 175 (activations count too) and is compute-bound from
# there on. The INT4 GEMM's intensity is ~3.8 M (ridge at M ~ 47), and its compute is slower
# per FLOP than bf16's: the conversion is repeated for every M tile. Two bounds: conversion
# fully overlapped with the MMAs (time = the larger) or not at all (time = the sum). INT4 stops
# winning between the two models' crossovers: M = 65 if nothing overlaps (tkit's heuristic
# takes a second 64-row tile there, a second conversion of the weight) and M ~ 175 if all of
# it does (where bf16 turns compute-bound and both hit the same tensor-core ceiling). At
# prefill (M = 4096) INT4 is at best even, and 1.5x slower if nothing overlaps.

# %%
N_, K_, GROUP = 14336, 4096, 128
ALU_LANE_OPS = 132 * 128 * 1.98e9  # H200 datasheet: SMs x FP32 lanes x boost clock (not measured)
DEQUANT_OPS = 6  # per weight element and M tile, counted from the int4 kernel's loop body


def block_m(M: int) -> int:
    """The int4 kernel's M tile, as its launch heuristic picks it (16..64 at decode, then 128)."""
    if M <= 64:
        return max(16, min(64, 1 << (M - 1).bit_length()))
    return 64 if M <= 128 else 128


def w4a16(M: int, N: int = N_, K: int = K_, group: int = GROUP) -> dict:
    act = 2 * M * K + 2 * M * N  # bf16 activations in, output out
    b16 = 2 * N * K + act
    b4 = N * K // 2 + 2 * (K // group) * N * 2 + act
    flops = 2.0 * M * N * K
    mem16, mem4 = b16 / (HBM_TBPS * 1e12), b4 / (HBM_TBPS * 1e12)
    mma = flops / (BF16_TFLOPS * 1e12)
    deq = math.ceil(M / block_m(M)) * N * K * DEQUANT_OPS / ALU_LANE_OPS
    t16 = max(mem16, mma)
    return dict(bytes_bf16=b16, bytes_int4=b4, flops=flops, ai_bf16=flops / b16,
                ai_int4=flops / b4, t_bf16_us=t16 * 1e6, dequant_us=deq * 1e6,
                t_int4_overlap_us=max(mem4, mma, deq) * 1e6,
                t_int4_serial_us=max(mem4, mma + deq) * 1e6)


RIDGE = BF16_TFLOPS / HBM_TBPS  # FLOP/byte


def first_m(pred, m_max: int = 8192) -> int:
    return next(m for m in range(1, m_max + 1) if pred(m))


def crossovers() -> dict:
    return dict(
        int4_compute_bound=first_m(lambda m: w4a16(m)["ai_int4"] >= RIDGE),
        bf16_compute_bound=first_m(lambda m: w4a16(m)["ai_bf16"] >= RIDGE),
        int4_loses_serial=first_m(lambda m: w4a16(m)["t_int4_serial_us"]
                                  >= w4a16(m)["t_bf16_us"]),
        int4_loses_overlap=first_m(lambda m: w4a16(m)["t_int4_overlap_us"]
                                   >= w4a16(m)["t_bf16_us"]),
    )


def test_w4a16_decode_prediction():
    p = w4a16(1)
    assert abs(p["bytes_bf16"] - 117.48e6) < 0.01e6 and abs(p["bytes_int4"] - 31.23e6) < 0.01e6
    # the byte count is the one tkit's registry uses for the op (benchmark bytes of M=1)
    spec = registry.get("matmul_int4")
    qw = torch.empty(K_ // 8, N_, dtype=torch.int32, device="meta")
    sz = torch.empty(K_ // GROUP, N_, dtype=torch.float16, device="meta")
    a = torch.empty(1, K_, dtype=torch.bfloat16, device="meta")
    assert spec.cost(a, qw, sz, sz, group_size=GROUP).bytes == p["bytes_int4"] == 31232000
    mem_int4_us = p["bytes_int4"] / (HBM_TBPS * 1e12) * 1e6
    assert abs(p["t_bf16_us"] - 27.7) < 0.1 and abs(mem_int4_us - 7.37) < 0.01
    assert 3.7 < p["t_bf16_us"] / mem_int4_us < 3.8  # 4x the bytes, less scales and zeros
    # the conversion, not the stream, bounds INT4 at decode: 10.5 us, a 2.6x speedup
    assert p["dequant_us"] > mem_int4_us and abs(p["dequant_us"] - 10.5) < 0.1
    assert 2.5 < p["t_bf16_us"] / p["t_int4_overlap_us"] < 2.7
    break_even = mem_int4_us * 1e-6 * ALU_LANE_OPS / (N_ * K_)  # instructions an element
    assert 4.0 < break_even < 4.4
    for m in (1, 4, 16):  # memory-bound bf16 all through decode, int4 flat in M
        q = w4a16(m)
        assert q["ai_bf16"] < RIDGE / 10 and q["t_int4_overlap_us"] == q["dequant_us"]


def test_w4a16_crossover_and_prefill():
    c = crossovers()
    assert 44 <= c["int4_compute_bound"] <= 50  # ~3.8 M FLOP/byte reaches 165
    assert 165 <= c["bf16_compute_bound"] <= 180  # ~M FLOP/byte reaches 165
    # INT4 stops winning in between: the range the two conversion models bracket
    assert 64 < c["int4_loses_serial"] < c["int4_loses_overlap"] <= c["bf16_compute_bound"]
    assert w4a16(64)["t_int4_serial_us"] < w4a16(64)["t_bf16_us"]  # still wins at 64
    p = w4a16(4096)  # prefill: both compute-bound, int4 at best even
    assert p["t_int4_overlap_us"] == p["t_bf16_us"] and abs(p["t_bf16_us"] - 687) < 1
    assert 1.4 < p["t_int4_serial_us"] / p["t_bf16_us"] < 1.6


# %% [markdown]
# ## 3. Fusion: the bytes between the GEMMs
#
# A transformer block's non-GEMM ops each read and write whole activations. Fused, the
# intermediate never reaches HBM. Per element of a (T, K) bf16 activation:
#
# * **residual + RMSNorm + fp8 quant** (`tkit.rms_norm_quant(x, w, eps, residual=r)`): read x
#   and r (4 bytes), write h = x + r (2, the residual stream) and y in fp8 (1), plus a float32
#   scale a row: 7 bytes. Unfused (add, norm, quant: three kernels): 6 + 4 + 3 = 13 bytes; with
#   the add already fused into the norm, 8 + 3 = 11. The fusion saves the bf16 y's write and
#   re-read.
# * **SiLU-mul + quant** (`tkit.silu_mul_quant(a, b)`, the down projection's input): read a
#   and b (4), write fp8 (1): 5 bytes, against 4 + 2 for silu_mul then 2 + 1 for the quant: 9.
# * **RoPE + KV-cache write** (`tkit.rope_append_kv`): q and k rotated in place and the rotated
#   k and v written into the paged cache in the same pass; unfused, `rope` then `append_kv`
#   reads k and v a second time. With 32 query heads and 8 kv heads only k and v are re-read,
#   so the saving is small in bytes (1.15x) and the point is one launch instead of two at
#   decode, where a layer moves ~26 KB a token and launch latency dominates.
#
# The fused results are not bit-equal to the compositions: the fused producers quantize the
# float32 value, the composition rounds it to bf16 first. The tests allow one fp8 code of
# difference, and check the fused one is the closer to the float64 truth on average.

# %%
T_, H_, I_ = 16384, 4096, 14336  # tokens, hidden, intermediate (bench shapes)


def fusion_bytes(t=T_, k=H_, inter=I_, hq=32, hkv=8, d=128) -> dict:
    e = 2
    rms = dict(fused=7 * t * k + 4 * t + e * k,
               unfused=(3 * e + 2 * e + e + 1) * t * k + 4 * t + e * k,  # add, norm, quant
               add_in_norm=(4 * e + e + 1) * t * k + 4 * t + e * k)
    silu = dict(fused=(2 * e + 1) * t * inter + 4 * t,
                unfused=(3 * e + e + 1) * t * inter + 4 * t)
    fused_rope = e * (2 * hq * d + 2 * hkv * d + hkv * d) + 2 * hkv * d * e  # per token
    rope = dict(fused=fused_rope, unfused=fused_rope + 2 * hkv * d * e)
    return dict(rms=rms, silu=silu, rope_per_token=rope)


def test_fusion_byte_counts():
    f = fusion_bytes()
    ratio = {k: v["unfused"] / v["fused"] for k, v in f.items()}
    assert abs(ratio["rms"] - 13 / 7) < 1e-3 and abs(ratio["silu"] - 9 / 5) < 1e-3
    assert abs(f["rms"]["add_in_norm"] / f["rms"]["fused"] - 11 / 7) < 1e-3
    assert f["rope_per_token"] == dict(fused=26624, unfused=30720)  # 1.15x
    # the fused counts are the ones the registry's cost models charge
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = torch.empty(T_, H_, **meta)
    rn = registry.get("rms_norm_quant").cost(x, x, torch.empty(H_, **meta))
    a = torch.empty(T_, I_, **meta)
    assert rn.bytes == f["rms"]["fused"]
    assert registry.get("silu_mul_quant").cost(a, a).bytes == f["silu"]["fused"]


def test_rope_append_kv_cost_matches_count():
    t, hq, hkv, d = 16, 32, 8, 128
    q, k, v = (torch.empty(t, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    kc = torch.empty(4, 16, hkv, d, dtype=torch.bfloat16)
    c = registry.get("rope_append_kv").cost(
        q, k, v, positions=torch.arange(t), cos_sin_cache=torch.empty(64, d),
        k_cache=kc, v_cache=kc, slot_mapping=torch.arange(t))
    extra = t * (8 + 8) + t * d * 4  # int64 positions and slots, one cos/sin row a token
    assert c.bytes == t * fusion_bytes()["rope_per_token"]["fused"] + extra


def _fp8_code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in e4m3 codes (signed magnitude order: adjacent values differ by 1)."""
    def ordinal(q):
        bits = q.view(torch.uint8).to(torch.int32)
        return torch.where(bits >= 128, -(bits - 128), bits)
    return (ordinal(a) - ordinal(b)).abs()


def _check_fused_vs_unfused(fused, unfused, truth):
    (qf, sf), (qu, su) = fused, unfused
    torch.testing.assert_close(sf, su, rtol=2 ** -7, atol=0)  # amax of v vs of bf16(v)
    assert _fp8_code_distance(qf, qu).max() <= 1
    assert (_fp8_code_distance(qf, qu) == 0).float().mean() > 0.9
    err_f = (qf.double() * sf.double() - truth).abs().mean()
    err_u = (qu.double() * su.double() - truth).abs().mean()
    assert err_f <= err_u * 1.005  # one rounding instead of two: no farther from the truth


def test_rms_norm_quant_equals_unfused():
    x, r = _x((8, 256), 6), _x((8, 256), 7)
    w = 1 + 0.1 * _x((256,), 8)
    y, s, h = tkit.rms_norm_quant(x, w, 1e-6, residual=r)
    h_ref = x + r  # bf16 add
    assert torch.equal(h, h_ref)
    hf = h_ref.double()
    truth = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    normed = (h_ref.float() * torch.rsqrt(h_ref.float().pow(2).mean(-1, keepdim=True) + 1e-6)
              * w.float()).to(torch.bfloat16)  # unfused: the norm writes bf16
    _check_fused_vs_unfused((y, s), tkit.quantize_fp8(normed), truth)


def test_silu_mul_quant_equals_unfused():
    a, b = _x((8, 384), 9, scale=2.0), _x((8, 384), 10)
    truth = F.silu(a.double()) * b.double()
    unfused = tkit.quantize_fp8((F.silu(a.float()) * b.float()).to(torch.bfloat16))
    _check_fused_vs_unfused(tkit.silu_mul_quant(a, b), unfused, truth)
    q128, s128 = tkit.silu_mul_quant(a, b, group_size=128)
    assert s128.shape == (8, 3)


# %% [markdown]
# ### Into a GEMM's epilogue: the gated MLP
#
# The Llama MLP's up-projection is two GEMMs over the same activation, gate and up, joined
# by SwiGLU: silu(a @ W_g.T) * (a @ W_u.T). Checkpoints (and vLLM) keep W_g and W_u stacked
# as one (2N, K) weight, so the plain way is one GEMM writing the (M, 2N) product in bf16,
# then `silu_mul` reading it back and writing (M, N). `tkit.matmul_glu(a, w_gu.t())` computes
# a gate column and its up column in the same output tile (one TMA descriptor over the
# stacked weight, gate rows at n and up rows at N + n) and applies SiLU and the product to
# the float32 sums before the one store. Per (M, N) output, the fusion removes:
#
# * the GEMM's write of the second half of the width: (M, 2N) against (M, N) bf16, 2MN bytes;
# * `silu_mul`'s whole pass: read 4MN, write 2MN.
#
# 8MN bytes and one launch. Whether all of it shows up depends on the GEMM: at prefill
# (M = 4096, 963 GFLOP) the GEMM is compute-bound, and its extra output write might hide
# under the math, leaving only silu_mul's 6MN. So the predicted saving is a band, 6MN to 8MN
# bytes at the copy rate, plus a launch (a few us) at decode sizes where the bytes are
# nothing. The epilogue is not free either: SiLU is an exp and a reciprocal an element (two
# MUFU operations, 16 a clock an SM), ~1.1 us of a 128 x 128 tile with the tensor cores
# idle, unless the next tile's first MMAs are issued before it (what the 128-row build does).

# %%
N_MLP = 14336  # Llama-3-8B's intermediate size


def glu_saving_us(m: int, n: int = N_MLP) -> tuple[float, float]:
    """(low, high) predicted time saved by fusing SwiGLU into the GEMM, us: silu_mul's
    pass alone (6MN bytes) to that plus the GEMM's extra half-width write (8MN)."""
    bw = HBM_TBPS * 1e12
    return 6 * m * n / bw * 1e6, 8 * m * n / bw * 1e6


def test_glu_cost_counts_one_output():
    """The registry charges matmul_glu for its (M, N) output, matmul for the (M, 2N) one: the
    2MN bytes of the first bullet above."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    m, k = 512, 4096
    a, w = torch.empty(m, k, **meta), torch.empty(2 * N_MLP, k, **meta)
    glu = registry.get("matmul_glu").cost(a, w.t())
    plain = registry.get("matmul").cost(a, w.t())
    assert plain.bytes - glu.bytes == 2 * m * N_MLP  # bf16: 2 bytes an element
    assert glu.flops == plain.flops == 2 * m * k * 2 * N_MLP


def test_matmul_glu_equals_gemm_then_silu_mul():
    a, w = _x((16, 64), 11), _x((96, 64), 12)
    fused = tkit.matmul_glu(a, w.t())
    g, u = (a.double() @ w.double().t()).split(48, dim=1)
    truth = F.silu(g) * u
    unfused = tkit.silu_mul(*tkit.matmul(a, w.t()).split(48, dim=1))  # one more bf16 rounding
    assert (fused.double() - truth).abs().mean() <= (unfused.double() - truth).abs().mean()
    torch.testing.assert_close(fused.double(), truth, rtol=2 ** -6, atol=2 ** -6)


# %% [markdown]
# Measured on the H200 (docs/NOTES.md, "matmul_glu", K=4096, N=14336, CUDA-graph replays,
# L2 read-flushed, `benchmarks/config_sweep.py matmul_glu`), `tkit.matmul` + `tkit.silu_mul`
# against `tkit.matmul_glu`:
#
# | M | unfused | fused | saved | predicted saving (6MN .. 8MN bytes) |
# | --- | --- | --- | --- | --- |
# | 1 | 66.1 us | 64.8 us | 1.3 us | 0.02 .. 0.03 us + a launch |
# | 16 | 64.1 | 61.4 | 2.7 | 0.3 .. 0.4 + a launch |
# | 512 | 173.2 | 162.8 | 10.4 | 10.4 .. 13.9 |
# | 4096 | 1407.1 | 1295.6 | 111.5 | 83.1 .. 110.8 |
#
# At decode sizes the saving is the second launch; at 512 rows, silu_mul's pass; at 4096
# rows, all 8MN bytes: the GEMM's wider output did not hide under its math. (The 4096 row
# is also a different tile shape: 256 columns computed as two 128-wide accumulators, the
# fastest gated build; the same sweep's timings move 3-6% between repeats, so the last digit
# is not meaningful.) In the Llama-3-8B layer (`tkit/specs/model.py`, 2980 us at 4096
# tokens) this one fusion is worth about 4%.

# %%
MEASURED_GLU_H200 = {1: (66.1, 64.8), 16: (64.1, 61.4), 512: (173.2, 162.8),
                     4096: (1407.1, 1295.6)}  # M: (unfused us, fused us)


def test_glu_measured_against_prediction():
    for m, (unfused, fused) in MEASURED_GLU_H200.items():
        low, high = glu_saving_us(m)
        saved = unfused - fused
        assert saved > 0
        if m >= 512:  # bytes dominate: the saving within the band, 5% for the timing noise
            assert 0.95 * low <= saved <= 1.05 * high
        else:  # bytes are nothing: what is saved is about one launch
            assert high < 1.0 < saved < 5.0


# %% [markdown]
# ## 4. Measure (GPU): fused against unfused, INT4 against bf16
#
# The cell below times, with `tkit.bench.timing.time_fn` (medians, L2 flushed between calls),
# the fused ops against their unfused torch compositions, and `tkit.matmul_int4` against
# `F.linear` on the dequantized bf16 weight over M = 1..4096, and prints measured against
# predicted. The prose above is the prediction; the table is the measurement. On the H200 on
# 2026-12-01 (docs/NOTES.md, run j, bf16, copy ceiling 4.24 TB/s) the project measured:
#
# | op, case | time | TB/s | % of copy | note |
# | --- | --- | --- | --- | --- |
# | rms_norm_quant 16384x4096, residual, per token | 0.119 ms | 3.96 | 93% | 1.11x torch.compile |
# | quantize_fp8 16384x4096 per token | 72 us | 2.79 | 66% | |
# | silu_mul_quant 16384x14336 per token | 0.43 ms | 2.73 | 64% | |
# | matmul_int4 M=1 K=4096 N=14336 g128 (first kernel) | 45.5 us | 0.69 | 16% | cuBLAS: 41.1 us |
#
# The fused norm is where the prediction says (93% of the copy ceiling). The first INT4 GEMM
# was not: 0.90x cuBLAS bf16's speed at M=1 where section 2 predicts 2.6x, slower than even
# the bf16 floor (27.7 us), its weight stream at 0.69 TB/s: too few bytes in flight and a
# second launch for its split-K sums.
#
# Since then (docs/NOTES.md, "INT4 decode", eighth and ninth sessions): the GEMV's warps walk
# interleaved chunks of the program's whole K range and add up once at the end (no split-K
# partials, no second launch), 32 columns a program, 16-byte loads of the codes and of the
# activations, each step's scales and zeros loaded a step ahead with its codes. On the H200
# on 2026-12-02 (run `h200-2026-12-02-zf-int4`, L2 flushed, the three peers in the same run) M=1
# took 17.3 us at K=4096 N=14336 (1.80 TB/s of packed weights, scales and zeros): 1.97x
# cuBLAS bf16 (34.1 us), 1.20x torch's own int4 kernel (`_weight_int4pack_mm`) and 1.45x
# gemlite; at K=N=8192 18.9 us, 1.93x / 1.25x / 1.47x. That is under the bf16 floor but 1.6x
# the conversion's estimate (10.5 us): the stream is the limit. Every variant tried holds
# 1.2-1.9 TB/s with ~16 warps and 32-64 KB of codes in flight an SM. How fast can 31 MB be
# read at all? A kernel that only sums the same bytes (run `h200-2026-12-02-zm-int4-floor`,
# graph replays, L2 flushed) took 11.46 us at its best grid, 3808 programs of 8 warps (2.72
# TB/s; a replayed empty kernel alone takes 3.5 us), 12.2 us at 952 programs and 31.3 us at
# 132: one 31 MB pass is too short for the 4.15 TB/s of a 1 GiB copy to ramp up, and it needs
# many programs in flight. 11.46 us is 2.92x cuBLAS's 33.5 us, so in this harness 3.5x at this
# size would need the weights faster than a bare read of their bytes. Both times hold the
# replay's 3.5 us floor, though. Timed by the span of each call's own device records instead
# (run `h200-2026-12-05-m-int4-floor`, both timers in one run, min of 3 medians): an empty
# kernel 0.58 us (3.09 by events), the best read 8.26 us (3.78 TB/s, 3808 programs of 8
# warps; 12.00 by events), cuBLAS 29.66 us (33.47), tkit's GEMV 14.62 us (18.40). So at zero
# arithmetic the bound is 3.59x cuBLAS of device time (2.79x by events): a 3.5x GEMV would
# have to stream its weights within 2.6% of a bare read's time, a 3.0x one (the bar at M=16)
# within 20%; tkit's GEMV, at 2.03x, takes 1.77x the read's time. M=16 (the tensor-core
# kernel) is 1.18x cuBLAS, 2.59x torch's int4 and 1.89x gemlite.
#
# Reading the compiler (tutorial 07) finds one cause of that 1.77x. `tkit ir matmul_int4
# --case "M=1 K=4096 N=14336" --stage ttgir` shows the scales and zeros loaded by `tl.load`
# in a layout of their own (8 contiguous bf16 a thread, the coalescing pass's choice for
# their pointer tile) while the codes' tile has 4 words a thread: the step's sums meet the
# scales through a `convert_layout`, and the activations' sums through a reduction split over
# warps, each a shared-memory round trip between CTA barriers: 8 barriers in every step of
# the loop's SASS. Loaded instead by elementwise inline loads (an `ld.global.nc` of each
# int32 word of two scales, the halves joined back into columns), the scales take the layout
# their users want and the step has no barrier and no shared memory. Timed on an H100 (two
# runs, both timers), that bought 2.4-3.8% at K=N=8192 and nothing at K=4096 N=14336, and
# every form that spent registers to keep the 32-deep steps lost 11-39%: the barriers were a
# real cost but not the bound. On the H200 the word loads then tied with `tl.load` at
# K=N=8192, and a third form beat both by 1.4-4.6% in five runs: 16 columns a program, one
# vector of 4 columns a thread, which makes the coalesced layout of the scales the codes'
# own, so `tl.load` needs no conversion and the program count doubles (512 at N=8192). That
# is the default there now, and the word loads are gone (docs/NOTES.md, forty-fourth
# session). The lesson is the ordinary one: a compile fact names a suspect, only the clock
# convicts it, and only on the machine the number is for.
#
# Where INT4 stops winning (run `h200-2026-12-02-ze-final`, K=4096 N=14336, x cuBLAS bf16):
# M=1 1.84, 2-16 1.18-1.26, 32 0.69, 64 0.63, 128-4096 0.37-0.43. Section 2's models put the
# crossover at M = 65 (nothing overlapped) to 175 (all of it); the measured one is between 16
# and 32, earlier than either: tkit's tensor-core kernel streams its codes at ~1.2 TB/s (27% of
# the roofline at M=16), so it is slower than its own no-overlap model before the conversion
# matters, and at prefill it is 0.4x cuBLAS, below the 1.5x-slower bound of that model (where
# a prefill layer should dequantize once and run the bf16 GEMM).
#
# Later (run `h200-2026-12-03-j-int4-eager`, same harness): the tensor-core kernel takes its
# TMA descriptors from the host (each program had built three and fenced them: ~3 us of a
# ~27 us call) and runs from M = 2 to 64 with 32- and 64-row tiles. x cuBLAS bf16: M=1 1.85,
# 2-8 1.44-1.46, 16 1.26, 32 0.94, 64 0.68. The crossover moved to just under M = 32, still
# short of the models': the codes stream at 1.25-1.36 TB/s at M <= 16, a third of the copy
# rate, so the kernel is bound by its latency, not by the bytes the roofline counts.
#
# That latency is what CUDA's escape hatch is for (`tkit.cuda_ext.gemm_int4`, chapter 06b's
# tools): one producer warp per SM keeps three 512-deep K steps of codes, scales, zeros and
# activations in flight through TMA (four boxes a step: small boxes cost the TMA unit per
# operation, and 16 boxes a step had held the stream at ~2 TB/s), eight consumer warps
# dequantize into mma.sync's register operand, and the K steps of all column tiles are dealt
# out evenly over the 132 SMs (stream-K: the tiles are fewer than the SMs at N = 14336). A
# trace of one launch (%globaltimer stamps per CTA) read ~2-3 us until a CTA's first slot
# is full, the stream itself at ~3.1 TB/s, and ~2 us to add up the pieces of tiles that two
# CTAs share. Run `h200-2026-12-04-zzzd-int4-cuda-32` (x cuBLAS bf16, K=4096 N=14336): M=2
# 1.90, 4 1.87, 8 1.86, 16 1.57 (21.1 us; 3.40x torch's int4, 2.48x gemlite), 32 1.09 (the
# tc kernel: 0.96); K=N=8192 M=16 1.48. M=1 stays on the GEMV (1.92x): the CUDA kernel tied
# it there (17.8 against 17.3 us). The crossover under cuBLAS moved from between 16 and 32
# rows to between 32 and 64: the stream, not the conversion, was what ended INT4's lead.
# A kernel launched from Python pays Python per call: ~190 us an eager call on the H200's
# host until the C++ executor replayed its launch (tensor maps encoded over the call's
# tensors, the stream's workspace by address): 17.1 us a call at M=16, its kernel's time,
# against F.linear's 32.3 (run `h200-2026-12-04-zzze-latency`).
#
# Counting instructions finds the GEMV's other bound. Its FMAs cost ~3.5 instructions a weight:
# 6.4 M warp instructions at K=4096 N=14336, ~6 us of issue on the H200 with every scheduler
# busy. The CUDA kernel's dequantization into mma.sync's operand costs ~0.9. So
# `csrc/gemv_int4.cu` uses that dequantization with a GEMV's schedule: a 32-column slab a CTA,
# its warps on whole groups of K, and each thread's 16-byte words of codes loaded straight
# into a register ring. It takes ~1.9 instructions a weight in the loop, with no TMA and no
# stream-K.
#
# On an H100 (runs `h100-2026-12-06-e/f/g-int4-gemv-cuda`, kernel timer) it took 0.91-0.92x
# the Triton GEMV's time at M=1, and 0.76-0.85x the stream-K kernel's at M = 2..16. It is the
# default for M <= 16 then. With the two rings and the stacked sums below, the bench there
# (run `h100-2026-12-06-s-matmul-int4`, events) reads M=1 2.93x cuBLAS bf16 and M=16 2.58x
# (3.34x and 2.89x by the kernel timer), against 2.35x and 2.06x before the CUDA GEMV.
# Four n8 tiles of rows make a 32-row CTA, and past that a slab gets one CTA per 32 rows,
# neighbours in the grid so that all but the first read its codes from L2. That made the
# GEMV the default to 128 rows: 0.73-0.81x the stream-K kernel's time at M = 24..32,
# 0.87-0.93x the tc kernel's at 48..64, 0.67-0.88x the tile kernel's at 96..128 (run
# `h100-2026-12-06-v-int4-gemv-rows`). Each 32-row block costs about what the first does,
# latency at 8 warps an SM (their sums and a's chunks take ~200 registers a thread), so
# INT4 stops beating cuBLAS bf16 near M=64 (1.04-1.18x there, 0.65-0.67x at 96), well
# before the roofline's M ~ 200: past 64 rows the dequantization is paid again per block.
#
# Its ring was settled by the SASS's control bits, not by the source. With one ring, each
# slot is reloaded as it is read; ptxas issues a pass's loads about a third of the way into
# the pass and waits for all of them, on one scoreboard, at the next pass's top. So 4 chunks
# beat 8: with 8, the loads went to the pass's end and the wait took them at once. Two rings
# of 2 chunks fix the order in the source: a pass first loads the next pass's codes into the
# other ring, so they have the whole pass in flight. That took 0.92-0.98x one ring's time at
# M <= 8 (runs `h100-2026-12-06-j/k/o-int4-gemv-cuda`); three rings, two passes ahead, took
# 1.17-1.27x.
#
# The offset and zero point come off once a group, so the kernel needs each group's sum of
# each row of a. An MMA with an all-ones A and a's fragment as B gives it in the order the
# promotion reads, but costs one MMA a k16 step and tile: 4 of the 12 a chunk at 16 rows.
# Two B fragments side by side are a valid A, and a B of ones over K slots 0..7 in even
# columns and 8..15 in odd ones sums each fragment's halves into its own column: one MMA a
# k16 step for both tiles, then two shuffles a group to hand each thread the rows it needs.
# At 16 rows that freed 4 registers, enough for two rings of 2, and took 0.97-0.99x the time
# at K=4096 N=14336 (level at K=N=8192; runs `h100-2026-12-06-p/q/r-int4-gemv-cuda`). At
# M <= 8 it was level, since the tensor pipe is far from full: the 16-row loop's 12 MMAs a
# chunk are ~4 us of it in a 16 us kernel.
#
# How far from the floor? A bare read of the same codes takes ~10.6 us on the H100 by the
# kernel timer, however it is laid out (32-column slabs as the GEMV reads them, wider slabs,
# or a contiguous stream: run `h100-2026-12-06-m-int4-read-pattern`), so ~11.3 us for the
# 31.2 MB with scales and zeros; the GEMV takes 13.0. ncu finds it latency-bound: 13 of 64
# warps an SM (128 registers a thread), and with one ring 59% of a warp's cycles waiting on
# its loads. More warps at fewer registers (more K lanes at 96, 80 and 64 registers) took
# 1.01-1.17x the two rings' time, so the loads in flight a warp are what is left to raise,
# and three rings show the limit: ptxas put their loads on the one scoreboard and waited on
# it right after issuing the loads two passes ahead, the single ring of 8's failure again.
#
# So from M = 256 rows `matmul_int4` does that: `_dequant_int4_kernel` writes the (N, K)
# weight in bf16 once (a read of 29 MB of codes and a write of 117 MB, ~35 us at the copy
# rate) and `tkit.matmul` runs the bf16 GEMM. Same run, L2 flushed (run
# `h200-2026-12-02-zg-int4-rope-sweep`): M=128 81.8 us against the tile kernel's 78.0 (the
# conversion is not yet paid back), M=512 135.5 against 243.4 (1.80x), M=4096 641.6 against
# 1592.1 (2.48x). At prefill INT4 then costs
# what the 16-bit GEMM costs plus one pass over the weight: the bytes it saved no longer
# matter once the GEMM is compute-bound, which is the roofline's answer to the chapter's
# question.
#
# Between the GEMV and the prefill path, the roofline says INT4 should still win: at M=128,
# K=4096 N=14336 the product is 15 GFLOP (~23 us of tensor time on an H100) over 29 MB of
# codes (~10 us), against cuBLAS bf16's ~43 us on its 117 MB. What stood in the way was the
# conversion paid per row block (the GEMV's 32-row blocks, the tile kernel's row tiles).
# `csrc/gemm_w4a16_sm90.cu` pays it once per 128 rows: the product is taken transposed on
# wgmma, the weight as its register A operand (each consumer warpgroup dequantizes 64 columns
# of a 64-deep K step straight into the fragment's layout, an 8-bit shared load, an IMAD, a
# LOP3 and two 16-bit FMAs a pair), and up to 128 rows of a as its N from shared memory,
# while the previous step's wgmmas run. On the H100 (runs `h100-2026-12-06-x/y/z-int4-wgmma`,
# kernel timer, x cuBLAS bf16 at K=4096 N=14336 / K=N=8192) it reads M=48 1.50 / 1.29, 64
# 1.45 / 1.28, 96 1.26 / 0.97, 128 1.23 / 0.98 (the GEMV: 0.57 / 0.65 there), 256 0.68 /
# 0.80 and 512 0.66 / 0.68, and it is the default from 33 to 512 rows. The GEMV keeps 1..32
# (the wgmma GEMM took 1.15-1.43x its time there) and dequantize + GEMM the rows from 1024
# (the wgmma GEMM 1.06-1.47x its time). The crossover under cuBLAS moved to ~128 rows at
# K=4096 N=14336, still short of the roofline's ~200: ncu at M=128 finds the tensor pipe busy
# 54% of the time and issue 39%, the warps waiting on the dequantization's dependent chain at
# two warps a scheduler, so a step costs ~960 cycles against ~512 of tensor work. Neither
# remedy tried helped on the H200 (runs `h200-2026-12-06-k/l`): one wgmma group a k16 slice
# with three kept in flight took 1.04-1.13x the time, and three consumer warpgroups
# (192-column tiles: 75 of them at N=14336) 1.14-1.29x (level, 0.98x, only at 512 rows and
# N=14336).
#
# On the H200 the GEMV and the wgmma GEMM run about as fast as on the H100 while cuBLAS bf16
# reads its 117 MB faster, so the ratios fall (run `h200-2026-12-06-j`, kernel timer, x cuBLAS
# bf16 at K=4096 N=14336 / K=N=8192): M=1 2.44 / 2.71, M=16 1.84 / 2.02; and from run
# `h200-2026-12-06-k`, M=64 1.08 / 0.99, M=128 0.91 / 0.73. The GEMV's 12.2 us at M=1 is
# 1.48x the H200's bare read of the same bytes (8.26 us, run `h200-2026-12-05-m-int4-floor`),
# against 1.16x on the H100. The likely reason: the faster memory wants more bytes in flight
# than 16 warps an SM with their register rings hold; but neither more K lanes (1.06-1.25x
# the time at M = 1 and 16) nor one ring of 4 (1.03-1.09x) helped (run `h200-2026-12-06-m`).
# Nor did taking the ring out of the registers: codes staged in shared memory by cp.async,
# each thread 1 to 15 chunks ahead in its own slots, ran at 5 CTAs an SM and took 1.50-1.82x
# the register rings' time on an H100 at every depth (run `h100-2026-12-06-za`), so the
# depth was not what it lacked. Nor did prefetching the codes into L2 8 to 32 chunks ahead of
# the rings: 1.04-1.29x the time on an H100, the further ahead the slower (run
# `h100-2026-12-07-a`). Two ways of putting more of the weight in flight lost on the H100.
#
# The whole sweep with today's dispatch, on an H100 (run `h100-2026-12-06-zb-int4-m-sweep`,
# `tkit bench matmul_int4 --group "M sweep"`, events, K=4096 N=14336, x cuBLAS bf16): M = 1..8
# 2.85-2.95 (the GEMV, 1.92 TB/s, 63% of the roofline), 16 2.56, 32 1.70, 64 1.36 and 128
# 1.20 (the wgmma GEMM), 256 and 512 0.66, 1024 0.79, 2048 0.85, 4096 0.92 (dequantize +
# GEMM, which approaches the bf16 GEMM as the one pass over the weight is amortized). The
# crossover is between 128 and 256 rows, against the roofline's ~200: at 256 rows cuBLAS is
# compute-bound (30 GFLOP in 47.7 us) while the wgmma GEMM dequantizes every weight once per
# 128-row tile, twice here, and runs at 413 TFLOP/s. Each of the dispatch's cuts was timed
# against the paths beside it on an H100 (run `h100-2026-12-07-b`): at 32 rows the GEMV
# leads the wgmma GEMM by 15-16%, at 512 the wgmma GEMM leads dequantize + GEMM by 7-19%, and
# at 1024 dequantize + GEMM leads the wgmma GEMM by 10-14%. At K=N=8192 INT4 stops winning
# earlier, between 32 and 128 rows (0.92x cuBLAS at 128).

# %%
MEASURED_H200 = {  # docs/NOTES.md and benchmarks/results/h200.jsonl, run j, 2026-12-01
    "rms_norm_quant": (119e-6, 3.96), "silu_mul_quant": (0.430e-3, 2.73),
    "matmul_int4_m1": (45.5e-6, None), "f_linear_bf16_m1": (41.1e-6, None),
    # the K-lanes GEMV and cuBLAS bf16 in one run, 2026-12-02 (h200-2026-12-02-zf-int4)
    "matmul_int4_m1_lanes": (17.3e-6, None), "f_linear_bf16_m1_later": (34.1e-6, None),
    # the CUDA GEMV (csrc/gemv_int4.cu) and cuBLAS bf16 in one run, 2026-12-06
    # (h200-2026-12-06-i-int4-decode, K=4096 N=14336, events)
    "matmul_int4_m1_cuda": (15.49e-6, None), "f_linear_bf16_m1_cuda_run": (32.64e-6, None),
}


def test_measured_figures_against_prediction():
    f = fusion_bytes()
    for name, key in (("rms_norm_quant", "rms"), ("silu_mul_quant", "silu")):
        sec, tbps = MEASURED_H200[name]
        assert abs(f[key]["fused"] / sec / 1e12 - tbps) < 0.02  # the notes' bytes are ours
    assert MEASURED_H200["rms_norm_quant"][1] / HBM_TBPS > 0.9
    p = w4a16(1)
    # the first int4 kernel was 4x off its predicted time and slower than the bf16 floor
    assert MEASURED_H200["matmul_int4_m1"][0] * 1e6 > 4 * p["t_int4_overlap_us"]
    assert MEASURED_H200["matmul_int4_m1"][0] * 1e6 > p["t_bf16_us"]
    # the K-lanes GEMV: under the bf16 floor, within 2x of its prediction, ~2x cuBLAS
    lanes = MEASURED_H200["matmul_int4_m1_lanes"][0] * 1e6
    assert p["t_int4_overlap_us"] < lanes < min(2 * p["t_int4_overlap_us"], p["t_bf16_us"])
    assert 1.9 < MEASURED_H200["f_linear_bf16_m1_later"][0] * 1e6 / lanes < 2.1
    # the CUDA GEMV: 1.5x its prediction (the read floor's ramp and the launch), 2.1x cuBLAS
    cuda = MEASURED_H200["matmul_int4_m1_cuda"][0] * 1e6
    assert p["t_int4_overlap_us"] < cuda < min(lanes, 1.6 * p["t_int4_overlap_us"])
    assert 2.0 < MEASURED_H200["f_linear_bf16_m1_cuda_run"][0] * 1e6 / cuda < 2.2


def unfused_rms_quant(x, r, w, eps=1e-6):
    h = x + r
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    amax = y.abs().amax(-1, keepdim=True).float()
    s = (amax / 448).clamp(min=1 / (448 * 512))
    return (y.float() / s).clamp(-448, 448).to(E4M3), s, h


def unfused_silu_quant(a, b):
    y = F.silu(a) * b
    s = (y.abs().amax(-1, keepdim=True).float() / 448).clamp(min=1 / (448 * 512))
    return (y.float() / s).clamp(-448, 448).to(E4M3), s


def measure(ms=(1, 4, 16, 64, 128, 256, 1024, 4096), fused=True) -> list[tuple]:
    """(what, measured us, predicted us low, high) rows, on a GPU. The unfused rows' prediction
    is three one-pass kernels; eager torch moves more (chapter 04), so it is a floor."""
    from tkit.bench.timing import time_fn

    def us(fn):
        return time_fn(fn).median_ms * 1e3

    rows, bw, f = [], HBM_TBPS * 1e12, fusion_bytes()

    def row(name, fn, nbytes):
        rows.append((name, us(fn), nbytes / bw * 1e6, nbytes / bw * 1e6))

    if fused:
        x, r = (torch.randn(T_, H_, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        w = torch.ones(H_, device=DEVICE, dtype=torch.bfloat16)
        row("rms_norm_quant fused", lambda: tkit.rms_norm_quant(x, w, 1e-6, residual=r),
            f["rms"]["fused"])
        row("rms_norm_quant unfused torch", lambda: unfused_rms_quant(x, r, w),
            f["rms"]["unfused"])
        a, b = (torch.randn(T_, I_, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        row("silu_mul_quant fused", lambda: tkit.silu_mul_quant(a, b), f["silu"]["fused"])
        row("silu_mul_quant unfused torch", lambda: unfused_silu_quant(a, b),
            f["silu"]["unfused"])
    if ms:
        wt = torch.randn(N_, K_, device=DEVICE, dtype=torch.bfloat16) * 0.02
        qw, s, z = tkit.quantize_int4(wt, group_size=GROUP)
        wd = tkit.dequantize_int4(qw, s, z, group_size=GROUP)
    for m in ms:
        act = torch.randn(m, K_, device=DEVICE, dtype=torch.bfloat16)
        p = w4a16(m)
        rows.append((f"int4 M={m}", us(lambda act=act: tkit.matmul_int4(act, qw, s, z)),
                     p["t_int4_overlap_us"], p["t_int4_serial_us"]))
        rows.append((f"bf16 F.linear M={m}", us(lambda act=act: F.linear(act, wd)),
                     p["t_bf16_us"], p["t_bf16_us"]))
    return rows


@pytest.mark.gpu
def test_fused_faster_than_unfused_gpu():
    t = {row[0]: row[1] for row in measure(ms=())}
    assert t["rms_norm_quant fused"] < t["rms_norm_quant unfused torch"]
    assert t["silu_mul_quant fused"] < t["silu_mul_quant unfused torch"]


@pytest.mark.gpu
def test_int4_faster_than_bf16_at_decode_gpu():
    t = {row[0]: row[1] for row in measure(ms=(1,), fused=False)}
    assert t["int4 M=1"] < t["bf16 F.linear M=1"]


# %% [markdown]
# ## 5. RoPE and sampling, briefly
#
# **RoPE** rotates pairs (a, b) of each head row of q and k by the angle p * f_i of the
# token's position: a' = a cos - b sin, b' = b cos + a sin, with f_i = base^(-2i/R) and "neox"
# pairs (x[i], x[R/2 + i]). Per token it reads the cos/sin row once (R float32) and rotates
# every head in registers: 6 FLOPs per pair, so memory-bound: in place, the rotary part of q
# and k is read and written once (measured 90.7 us, 3.79 TB/s, 89% of copy, at 16384 tokens x
# (32 + 8) heads x 128 on 2026-12-01).
#
# **Sampling** (`tkit.sample`) gives each row (one sequence's logits, V = 128256) one program.
# Temperature, min-p, top-k and top-p are all thresholds on z = x / T, so the kernel never
# sorts: it finds the max, then searches the threshold with a few pivots per pass (counting,
# for top-p summing exp(z - max) above each pivot), compacts the few hundred survivors into
# registers for the exact cut and takes the Gumbel-max argmax(z + g) over them, g from Philox
# keyed by the seed (reproducible, no host sync). A sort-based sampler writes the permuted row
# (values and indices) in every radix pass and then a cumulative sum for top-p; the search
# only reads, a handful of passes, re-read from L2, keeping its counters in registers. Bytes: the
# logits once from HBM, 128 x 128256 x 2 = 32.8 MB, 7.7 us at the copy ceiling; measured
# 216-259 us (2026-12-01): one program per row leaves the search passes latency-bound, far
# from the byte floor.

# %%
def rope_reference(x, positions, base=10000.0):
    """neox RoPE in float64 through complex multiplication: (x[i] + i x[R/2 + i]) e^{i p f}."""
    d = x.shape[-1]
    f = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None, None] * f
    xc = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * torch.polar(
        torch.ones_like(ang), ang)
    return torch.cat([xc.real, xc.imag], dim=-1)


def test_rope_and_fused_cache_write():
    t, hq, hkv, d = 5, 4, 2, 64
    q, k, v = _x((t, hq, d), 11), _x((t, hkv, d), 12), _x((t, hkv, d), 13)
    pos = torch.tensor([0, 3, 7, 100, 511], device=DEVICE)
    table = tkit.rope_cache(512, d, device=DEVICE)
    qr, kr = tkit.rope(q, k, pos, table)
    for got, x in ((qr, q), (kr, k)):
        assert (got.double() - rope_reference(x, pos)).abs().max() < 2 ** -6 * x.abs().max()
    assert torch.equal(qr[0], q[0])  # position 0: no rotation
    # fused: the same rotation, and k, v written at their slots of a paged cache
    kc, vc = (torch.zeros(3, 4, hkv, d, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    slots = torch.tensor([9, 0, 5, -1, 2], device=DEVICE)  # -1: no write
    q2, k2 = q.clone(), k.clone()
    tkit.rope_append_kv(q2, k2, v, pos, table, kc, vc, slots)
    assert torch.equal(q2, qr) and torch.equal(k2, kr)
    flat_k, flat_v = kc.reshape(12, hkv, d), vc.reshape(12, hkv, d)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], kr[i]) and torch.equal(flat_v[slot], v[i])
    assert flat_k[[1, 3, 4, 6, 7, 8, 10, 11]].abs().sum() == 0  # nothing else written


def test_sample_thresholds_without_sort():
    logits = _x((4, 64), 14, torch.float32, scale=2.0)
    top = logits.topk(5, dim=-1).indices
    assert torch.equal(tkit.sample(logits, top_k=1, seed=0), logits.argmax(-1))
    ids = tkit.sample(logits, top_k=5, top_p=0.8, seed=3)
    assert (ids[:, None] == top).any(-1).all()  # always one of the top 5
    ref = registry.get("sample").reference(logits, top_k=5, top_p=0.8, seed=3)
    assert torch.equal(ids.cpu(), ref.cpu())  # the same Philox noise, the same ids


# %%
if __name__ == "__main__":
    for m in (1, 16, 4096):
        p = w4a16(m)
        print(f"M={m:5d}: bf16 {p['bytes_bf16'] / 1e6:6.1f} MB, int4 {p['bytes_int4'] / 1e6:5.1f}"
              f" MB, AI {p['ai_bf16']:6.1f} / {p['ai_int4']:6.1f} FLOP/B (ridge {RIDGE:.0f}); "
              f"predicted bf16 {p['t_bf16_us']:6.1f} us, int4 {p['t_int4_overlap_us']:6.1f}-"
              f"{p['t_int4_serial_us']:6.1f} us")
    print("crossovers (M):", crossovers())
    for name, v in fusion_bytes().items():
        print(f"{name}: fused {v['fused'] / 1e6:.3f} MB, unfused {v['unfused'] / 1e6:.3f} MB, "
              f"saving {v['unfused'] / v['fused']:.2f}x")
    test_e4m3fn_bits()
    test_int4_layout_and_round_trip()
    test_rms_norm_quant_equals_unfused()
    print("format, layout and fused-vs-unfused checks passed")
    if torch.cuda.is_available():
        print(f"{'case':30s} {'measured us':>12s} {'predicted us':>16s}")
        for name, meas, lo, hi in measure():
            pred = f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"
            print(f"{name:30s} {meas:12.1f} {pred:>16s}")
    else:
        print("the measurement (section 4) needs a CUDA GPU: skipped")
