"""Dynamic quantization of activations, alone or fused with the op that produces them.

Math, per row (token) of K values v (float32 inside whatever the storage dtype):

    quantize_fp8     v = x
    quantize_int8    v = x
    rms_norm_quant   h = x (+ residual, rounded to x's dtype and returned), v = h * rstd * w,
                     rstd = 1 / sqrt(mean(h^2) + eps)
    silu_mul_quant   v = silu(a) * b

    per token:       one scale a row;  per group (group_size g): one scale per g columns
    amax = max |v| over the row or group (NaN ignored: one NaN does not take its row with it)
    fp8 e4m3fn:      amax = min(amax, scale_ub) when given;
                     scale = max(amax / 448, 1 / (448 * 512))   (vLLM's floor, so that an
                     all-zero row gets a finite scale); q = clamp(v / scale, -448, 448),
                     rounded to nearest even, NaN stays NaN
    int8:            scale = amax / 127 (1 for an all-zero row); q = round_half_even(v / scale)

    v ~ q * scale: dequantization multiplies by the scale (torch._scaled_mm's convention).
    v is quantized straight from float32: the fused producers do not round it to x's dtype
    first (the unfused composition does; the fused result is the closer one).

Scales are float32, (rows, 1) per token or (rows, K // g) per group (row-major; the 1x128
layout of DeepSeek-V3 with g = 128).

Cost model: memory-bound at any size. quantize: reads K * itemsize, writes K bytes + the
scales a row; rms_norm_quant adds the residual read, the h write and the weight;
silu_mul_quant reads two inputs. About 1 FLOP per byte.

Kernel (``_quant_kernel``, one for all four ops, the math picked by the constexpr ``OP``):
a program takes ROWS rows and views each as groups of G columns: a tile is (ROWS, CHUNK_NG,
BLOCK_G), columns ``group * G + j``, so the amax of a group is a reduction over the last axis
and per-token scales (G then a sub-width, NG = cdiv(K, G)) a reduction over the last two.
A row that fits one tile (``SINGLE``) is loaded once: statistics, scale, cast and store from
registers (one pass). Longer rows are walked in chunks of CHUNK_NG groups: per group with no
row statistic (quantize, silu_mul_quant) the chunks are independent programs (grid axis 1);
otherwise a first walk takes the row's statistics (sum of squares for RMSNorm; amax for a
per-token scale, taken as rstd * max |h w| for RMSNorm since rstd > 0) and a second walk,
mostly from L2, quantizes. Offsets are 32-bit unless a tensor spans 2**31 elements.
"""

from __future__ import annotations

import torch

from tkit.kernels import _common as C
from tkit.kernels import _plan as P
from tkit.kernels.quant.config import (  # noqa: F401  (public)
    _OVERRIDES,
    FP8,
    FP8_MAX,
    FP8_MIN_SCALE,
    INT8_MAX,
    QuantConfig,
    current_config,
    quant_config,
)
from tkit.kernels.quant.ops import (
    _check_group,
    _check_ub,
    _check_x,
    _quant_launch,
    _quantize_op,
    _rms_norm_quant_op,
    _silu_mul_quant_op,
)


def quantize_fp8(x: torch.Tensor, *, group_size: int | None = None,
                 scale_ub: float | torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic float8_e4m3fn quantization, per token or per group, in one pass.

    Parameters
    ----------
    x : Tensor (..., K)
        float32/float16/bfloat16, any strides (a row is one token).
    group_size : int, optional
        None: one scale a row (scales (..., 1)); g: one scale per g columns (scales
        (..., K // g); g = 128 is DeepSeek-V3's 1x128 activation layout). g must divide K.
    scale_ub : float or one-element float32 Tensor, optional
        Upper bound on each amax (vLLM's ``scale_ub``): values past it saturate to +-448.

    Returns
    -------
    (x_fp8, scales): x_fp8 like x (contiguous) with ``x ~ x_fp8 * scale``; scales float32,
    ``max(amax / 448, 1 / (448 * 512))``. NaN stays NaN and does not enter the amax.
    """
    if (type(scale_ub) in _UB_TYPES and type(group_size) in _GS_T
            and P.plannable(_OVERRIDES.state.value, x,
                            scale_ub if type(scale_ub) is _T else None)):
        # the eager plan (tkit.kernels._plan): a tensor bound is an input, a number an option
        ub_t = scale_ub if type(scale_ub) is _T else None
        return P.serve_fast(_plans, ("fp8", group_size, None if ub_t is not None else scale_ub),
                            (x, ub_t), _quantize_fp8_slow, (x, group_size, scale_ub))
    return _quantize_fp8_slow(x, group_size, scale_ub)


_plans = P.new_cache()
_T = torch.Tensor
_UB_TYPES = (torch.Tensor, type(None), float, int)
# a bool equals 1 as a key: options whose type the ordinary path checks are plain ints here
_GS_T = (int, type(None))


def _quantize_fp8_slow(x, group_size, scale_ub):
    _check_x(x)
    g = _check_group(group_size, x.shape[-1])
    ub_value, ub_tensor = _check_ub(scale_ub, x)
    if C.use_direct_path(x):
        return _quant_launch("none", x, None, None, None, 0.0, g, "fp8", ub_value,
                             ub_tensor)[:2]
    return _quantize_op(x, g, "fp8", ub_value, ub_tensor)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization, one scale a row (token), in one pass.

    Returns (x_int8, scales): x_int8 like x with values in [-127, 127], rounded half to even,
    ``x ~ x_int8 * scale``; scales (..., 1) float32, amax / 127 (1 for an all-zero row).
    NaN inputs give undefined int8 values (they are left out of the amax).
    """
    if P.plannable(_OVERRIDES.state.value, x):
        return P.serve_fast(_plans, ("int8",), (x,), _quantize_int8_slow, (x,))
    return _quantize_int8_slow(x)


def _quantize_int8_slow(x):
    _check_x(x)
    if C.use_direct_path(x):
        return _quant_launch("none", x, None, None, None, 0.0, 0, "int8", None, None)[:2]
    return _quantize_op(x, 0, "int8", None, None)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, group_size: int | None = None):
    """RMSNorm (optionally after the residual add) and fp8 quantization in one pass: the
    producer of the next GEMM's fp8 activations.

    Parameters
    ----------
    x, weight, eps, residual
        As :func:`tkit.rms_norm`.
    group_size : int, optional
        As :func:`quantize_fp8`.

    Returns
    -------
    (y_fp8, scales), or (y_fp8, scales, h) with ``residual`` (h = x + residual in x's dtype,
    the residual stream for the next layer). ``y_fp8 * scales ~ rms_norm(h) * weight``,
    quantized from float32 (not rounded to x's dtype first).
    """
    if (type(eps) is float and type(group_size) in _GS_T
            and P.plannable(_OVERRIDES.state.value, x, weight, residual)):
        return P.serve_fast(_plans, ("rms", eps, group_size), (x, weight, residual),
                            _rms_norm_quant_slow, (x, weight, eps, residual, group_size))
    return _rms_norm_quant_slow(x, weight, eps, residual, group_size)


def _rms_norm_quant_slow(x, weight, eps, residual, group_size):
    from tkit.kernels.reductions.ops import _check_norm

    _check_norm(x, weight, residual=residual, eps=eps)
    g = _check_group(group_size, x.shape[-1])
    if C.use_direct_path(x, weight, residual):
        y, s, h = _quant_launch("rms", x, None, residual, weight.contiguous(), eps, g, "fp8",
                                None, None)
    else:
        y, s, h = _rms_norm_quant_op(x, weight.contiguous(), residual, float(eps), g)
    return (y, s) if residual is None else (y, s, h)


def silu_mul_quant(a: torch.Tensor, b: torch.Tensor, group_size: int | None = None):
    """``silu(a) * b`` (SwiGLU) quantized to fp8 in one pass: the down projection's input.

    a and b: the same shape (..., K) and dtype (float32/float16/bfloat16), any strides (the
    two halves of a fused [gate | up] projection as views). group_size as
    :func:`quantize_fp8`. Returns (y_fp8, scales).
    """
    if type(group_size) in _GS_T and P.plannable(_OVERRIDES.state.value, a, b):
        return P.serve_fast(_plans, ("silu_mul", group_size), (a, b), _silu_mul_quant_slow,
                            (a, b, group_size))
    return _silu_mul_quant_slow(a, b, group_size)


def _silu_mul_quant_slow(a, b, group_size):
    _check_x(a, "a")
    _check_x(b, "b")
    C.check_same_device(a=a, b=b)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"b has dtype {C.dtype_name(b.dtype)} but a has "
                        f"{C.dtype_name(a.dtype)}; they must match")
    g = _check_group(group_size, a.shape[-1])
    if C.use_direct_path(a, b):
        return _quant_launch("silu_mul", a, b, None, None, 0.0, g, "fp8", None, None)[:2]
    return _silu_mul_quant_op(a, b, g)


def cost(x, *, group_size=None, out_itemsize=1, inputs=1, residual=False, weight=None):
    """Bytes of one call: ``inputs`` tensors like x read (+ the residual and the h write),
    the quantized output and the float32 scales written, the weight read."""
    from tkit._cost import Cost

    n, K = x.numel(), x.shape[-1]
    rows = n // K if K else 0
    ng = 1 if not group_size else K // group_size
    e = x.element_size()
    nbytes = inputs * n * e + n * out_itemsize + rows * ng * 4
    if residual:
        nbytes += 2 * n * e
    if weight is not None:
        nbytes += weight.numel() * weight.element_size()
    return Cost(nbytes, 4 * n)
