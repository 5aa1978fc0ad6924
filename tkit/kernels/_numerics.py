"""Jit helpers that keep results right where a backend's number handling is wrong.

Triton's interpreter (``TRITON_INTERPRET=1``) holds bfloat16 and fp8 values as raw integers and
converts them with bit arithmetic that knows nothing of NaN:

* ``tl.dot`` (and add/mul) on bfloat16 operands multiplies the raw 16-bit integers: results off
  by ~1e10, silently. Load, store and ``.to(tl.float32)`` are right.
* An fp8 e4m3fn NaN (0x7F) is read as 480.0 (by ``.to`` and by ``tl.dot``), and a float32 NaN is
  written to fp8 as 384.0 (0x7C); its float32 -> fp8 rounding carries a mantissa overflow into
  the exponent wrongly (1.999 -> 1.0) and flushes subnormals to zero.

:func:`interpreter_operand` gives ``tl.dot`` float32 operands instead (the products of 16- and
8-bit floats are exact in float32, as on the tensor cores, so results match the GPU's up to the
order of summation); kernels call it under ``if INTERPRET:``, a constexpr that is False on a GPU,
where the compiled kernel is unchanged. :func:`fp8_keep_nan` is used on every backend: what the
hardware conversion does with NaN is then not a question.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tkit import _env

#: True under Triton's interpreter; a constexpr, so ``if INTERPRET:`` compiles to nothing on a GPU
INTERPRET = tl.constexpr(_env.INTERPRET)


@triton.jit
def interpreter_operand(x):
    """``x`` as the interpreter can multiply it: bfloat16 and fp8 e4m3fn become float32 (fp8 NaN
    kept NaN); other dtypes are returned as they are."""
    if x.dtype == tl.bfloat16:
        x = x.to(tl.float32)
    elif x.dtype == tl.float8e4nv:
        bits = x.to(tl.uint8, bitcast=True)
        x = tl.where((bits & 0x7F) == 0x7F, float("nan"), x.to(tl.float32))
    return x


@triton.jit
def _round_to_e4m3(r):
    """``r`` (float32, |r| <= 448) rounded to the nearest e4m3 value, ties to even, in float32
    arithmetic. The interpreter's own fp8 rounding carries a mantissa overflow into the
    exponent wrongly (1.999 -> 1.0) and flushes subnormals; given a value already on the e4m3
    grid it only has to copy bits."""
    e = ((r.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2|r|) for normal r
    e = tl.maximum(e, -6)  # e4m3 subnormals are multiples of 2**-9
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    q = r / ulp  # exact (a power of 2); |q| < 16
    q = (q + 12582912.0) - 12582912.0  # round half to even (1.5 * 2**23)
    y = q * ulp
    y = tl.where(y == 0.0, r * 0.0, y)  # a negative that rounds to zero is -0, as in torch
    return tl.where(r != r, r, y)


@triton.jit
def and_scalar(mask, live):
    """``mask & live`` for a scalar ``live``. Triton 3.9's interpreter rejects that mask
    (a bool tensor and-ed with a scalar comparison); ``tl.where`` gives it the same values
    there, and the compiled kernel keeps the plain and."""
    if INTERPRET:
        r = tl.where(live, mask, False)
    else:
        r = mask & live
    return r


@triton.jit
def scalar_mask(live, like):
    """The scalar mask ``live`` for a load over ``like``'s shape (an integer tensor): ``live``
    itself when compiled (the load broadcasts it), broadcast explicitly under the interpreter
    (Triton 3.9's rejects a scalar mask over a tensor of pointers)."""
    if INTERPRET:
        r = tl.where(live, like == like, False)
    else:
        r = live
    return r


@triton.jit
def saturate_fp8(r):
    """float32 ``r`` clamped to e4m3fn's +-448 with NaN left NaN. Not ``tl.minimum`` /
    ``tl.maximum``: on a GPU they return the other operand for a NaN (PTX min/max), so a NaN
    became -448 (triton 3.9's interpreter behaves the same; 3.6's kept the NaN)."""
    return tl.where(r > 448.0, 448.0, tl.where(r < -448.0, -448.0, r))


@triton.jit
def fp8_keep_nan(r):
    """float32 ``r`` rounded to float8_e4m3fn with NaN kept NaN (0x7F, sign kept, as torch does).
    ``r`` must already be saturated to +-448: e4m3fn has no infinity."""
    if INTERPRET:
        r = _round_to_e4m3(r)
    y = r.to(tl.float8e4nv)
    bits = y.to(tl.uint8, bitcast=True)
    bits = tl.where(r != r, (bits | 0x7F).to(tl.uint8), bits)
    return bits.to(tl.float8e4nv, bitcast=True)


@triton.jit
def to_fp8_saturated(r):
    """float32 ``r`` to float8_e4m3fn as ``fp8_keep_nan(saturate_fp8(r))`` gives it, bit for bit.
    Compiled for sm_89+, Triton's cast is ``cvt.rn.satfinite.e4m3x2.f32``, which saturates to
    +-448 (infinities included) and turns NaN into an e4m3fn NaN (all 7 low bits set): the
    clamp and the NaN select are ~10 instructions an element that change nothing there (the
    two forms compared bit for bit on the H200 over all finite bf16 values, +-inf and NaN).
    The interpreter's cast knows neither, and takes the long form."""
    if INTERPRET:
        q = fp8_keep_nan(saturate_fp8(r))
    else:
        q = r.to(tl.float8e4nv)
    return q


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (``x.to(dtype)``). Triton 3.6's interpreter truncates
    float32 -> bfloat16 (1.0 + 6.9/128 -> 1.0 + 6/128, where torch and the GPU's cvt.rn give
    1.0 + 7/128); under ``INTERPRET`` the rounding to nearest even is done on the bits first,
    so that the conversion only has to drop zeros. NaN and infinities pass unchanged."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x == x, rounded.to(tl.float32, bitcast=True), x)
    return x.to(dtype)
