"""The elementwise family's Triton code (``@triton.jit`` only, and the autotuned wrapper): the
flat and strided kernels and the activation helpers other families inline (matmul's
epilogue)."""

from __future__ import annotations

import triton
import triton.language as tl

from tkit.kernels._numerics import to_fp8_saturated
from tkit.kernels.elementwise.config import _flat_configs


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == "silu":
        y = x * tl.sigmoid(x)
    elif ACT == "gelu":
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == "gelu_tanh":
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # 0.5 * (1 + tanh(u)) = sigmoid(2u), from e = exp(-2|u|) <= 1: 1 / (1 + e) for u >= 0,
        # e / (1 + e) below. No libdevice call, no overflow, the limits at +-inf (NaN at -inf,
        # as torch), and no cancellation: 2 - 2 / (exp(2u) + 1) lost bits for x < 0 (12
        # units of rounding seen)
        e = tl.exp(-2.0 * tl.abs(u))
        r = 1.0 / (1.0 + e)
        y = x * tl.where(u >= 0.0, r, e * r)
    elif ACT == "relu":
        y = tl.where(x < 0.0, 0.0, x)
    else:
        y = x
    return y


@triton.jit
def _apply(a, b, scale_ptr, OP: tl.constexpr, HAS_SCALE: tl.constexpr):
    """The math of every op on float32 values; ``b`` is ignored by unary ops."""
    if OP == "add":
        r = a + b
    elif OP == "sub":
        r = a - b
    elif OP == "mul":
        r = a * b
    elif OP == "silu_mul":
        r = _activation(a, "silu") * b
    elif OP == "gelu_mul":
        r = _activation(a, "gelu") * b
    elif OP == "gelu_tanh_mul":
        r = _activation(a, "gelu_tanh") * b
    elif OP == "relu_mul":
        r = _activation(a, "relu") * b
    elif OP == "cast_fp8":
        r = a
        if HAS_SCALE:
            r = r / tl.load(scale_ptr).to(tl.float32)
        # saturate, keeping NaN (a comparison with NaN is false)
        r = tl.where(r > 448.0, 448.0, tl.where(r < -448.0, -448.0, r))
    elif OP == "cast":
        r = a
        if HAS_SCALE:
            r = r / tl.load(scale_ptr).to(tl.float32)
    else:
        r = _activation(a, OP)
    return r


@triton.jit
def _out_value(r, out_ptr, OP: tl.constexpr):
    """float32 ``r`` in the output's dtype; an fp8 cast keeps NaN NaN whatever the backend's
    conversion does with it (Triton's interpreter writes 384.0)."""
    if OP == "cast_fp8":
        y = to_fp8_saturated(r)
    else:
        y = r.to(out_ptr.dtype.element_ty)
    return y


@triton.jit
def _ew_flat_kernel(
    a_ptr, b_ptr, out_ptr, scale_ptr, n_elements, size_class,
    OP: tl.constexpr, HAS_B: tl.constexpr, HAS_SCALE: tl.constexpr, INT64: tl.constexpr,
    BLOCK: tl.constexpr, EVEN: tl.constexpr,
):
    """out[i] = OP(a[i], b[i]) over ``n_elements`` contiguous elements.

    EVEN (set when BLOCK divides n_elements) drops the bounds mask.

    a_ptr, b_ptr: inputs (b_ptr unused when HAS_B is false); out_ptr: output;
    scale_ptr: one float32 divisor for casts (unused when HAS_SCALE is false).
    size_class: unused by the kernel; the autotune key (log2 bucket of n_elements).
    """
    pid = tl.program_id(0)
    if INT64:
        start = pid.to(tl.int64) * BLOCK
    else:
        start = pid * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if EVEN:
        a = tl.load(a_ptr + offs).to(tl.float32)
        if HAS_B:
            b = tl.load(b_ptr + offs).to(tl.float32)
        else:
            b = a
        r = _apply(a, b, scale_ptr, OP, HAS_SCALE)
        tl.store(out_ptr + offs, _out_value(r, out_ptr, OP))
    else:
        mask = offs < n_elements
        a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
        if HAS_B:
            b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
        else:
            b = a
        r = _apply(a, b, scale_ptr, OP, HAS_SCALE)
        tl.store(out_ptr + offs, _out_value(r, out_ptr, OP), mask=mask)


_ew_flat_autotuned = triton.autotune(configs=_flat_configs(), key=["size_class"])(
    triton.heuristics({"EVEN": lambda a: a["n_elements"] % a["BLOCK"] == 0})(_ew_flat_kernel))


@triton.jit
def _ew_strided_kernel(
    a_ptr, b_ptr, out_ptr, scale_ptr,
    D0, D1, D2, M, N,
    sa0, sa1, sa2, sam, san,
    sb0, sb1, sb2, sbm, sbn,
    so0, so1, so2, som, son,
    OP: tl.constexpr, HAS_B: tl.constexpr, HAS_SCALE: tl.constexpr, INT64: tl.constexpr,
    BATCHED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[i0, i1, i2, m, n] = OP(a[...], b[...]) over a (D0, D1, D2, M, N) index space.

    Each operand is addressed through its own five strides (``sa*`` for a, ``sb*`` for b,
    ``so*`` for out); a stride of 0 is a broadcast dimension. The outer four dimensions are
    flattened into rows; one program covers BLOCK_M rows x BLOCK_N columns. Without batch
    dimensions (BATCHED false) a row is m itself, which keeps Triton's contiguity analysis
    able to coalesce an operand whose stride along m is 1 (a transpose).
    """
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_n = pid % tiles_n
    pid_m = pid // tiles_n
    if INT64:
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if BATCHED:
        n_rows = D0 * D1 * D2 * M
        if INT64:
            n_rows = n_rows.to(tl.int64)
        m = rows % M
        rest = rows // M
        i2 = rest % D2
        rest = rest // D2
        i1 = rest % D1
        i0 = rest // D1
        a_row = i0 * sa0 + i1 * sa1 + i2 * sa2 + m * sam
        b_row = i0 * sb0 + i1 * sb1 + i2 * sb2 + m * sbm
        o_row = i0 * so0 + i1 * so1 + i2 * so2 + m * som
    else:
        n_rows = M
        a_row = rows * sam
        b_row = rows * sbm
        o_row = rows * som
    mask = (rows < n_rows)[:, None] & (rn < N)[None, :]
    a = tl.load(a_ptr + (a_row[:, None] + rn[None, :] * san), mask=mask).to(tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + (b_row[:, None] + rn[None, :] * sbn), mask=mask).to(tl.float32)
    else:
        b = a
    r = _apply(a, b, scale_ptr, OP, HAS_SCALE)
    tl.store(out_ptr + (o_row[:, None] + rn[None, :] * son),
             _out_value(r, out_ptr, OP), mask=mask)


