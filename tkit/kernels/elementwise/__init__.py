"""Elementwise ops: binary arithmetic with broadcasting, activations, ``act(a) * b``, casts.

Math (computed in float32 whatever the storage dtype, rounded once on store):

    add/sub/mul   out = a (+|-|*) b                 broadcasting, torch type promotion
    residual_add  out = x + residual, in residual's dtype (the residual stream's precision)
    silu          out = x * sigmoid(x)
    gelu          out = x/2 * (1 + erf(x/sqrt(2)))                       approximate="none"
                  out = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))  approximate="tanh"
    relu          out = max(x, 0)   (NaN stays NaN, as in torch)
    act_mul       out = act(a) * b  (silu_mul is the SwiGLU gate, gelu_mul GeGLU)
    cast          out = x / scale   rounded to the target dtype; to float8_e4m3fn it saturates to
                  +-448 first (the convention of torch._scaled_mm: scale is the dequant scale)

Cost model: every input element is read once and every output written once, so bytes =
sum(unique input bytes) + output bytes; FLOPs are a handful per element. At about 1 FLOP per
byte against the H200's ~200 FLOP/byte balance point, every op here is memory-bound at any
size: the ceiling is the device-to-device copy bandwidth.

Two kernels serve every op, the math picked by a constexpr ``OP``:

* ``_ew_flat_kernel`` for inputs that are one contiguous run of memory with the output's shape
  (the common case): 1-D blocks, 16-byte accesses, block size autotuned.
* ``_ew_strided_kernel`` for everything else (broadcast, slices, transposes, storage offsets):
  the launcher first merges dimensions that are contiguous for every operand and drops size-1
  dimensions, leaving at most five; the kernel walks 2-D tiles of (outer dims flattened into
  rows) x (innermost dim). Without batch dimensions a 2-D tile lets Triton load a transposed
  operand coalesced along its own contiguous dimension and transpose it through shared memory,
  so a transpose is not a gather.

Output layout: binary ops and ``act_mul`` return contiguous tensors; a unary op or cast of a
tensor that is a permutation of a contiguous one (a transpose: no gaps, no overlaps) returns
that tensor's strides, as torch's own ``silu`` or ``.to()`` do (``preserve_format``), any other
input a contiguous output. The launcher orders the dimensions as the output lies in memory, so
a transposed input and its transposed output are one contiguous run (the flat kernel) instead
of a transpose through shared memory.

Index math is 32-bit unless some offset can reach 2**31 (then ``INT64`` is set).
"""

from __future__ import annotations

import torch

from tkit.kernels import _common as C
from tkit.kernels import _plan as P
from tkit.kernels.elementwise.config import ACTIVATIONS, BINARY_OPS  # noqa: F401  (public)
from tkit.kernels.elementwise.ops import (
    _T,
    _act_mul_impl,
    _act_mul_op,
    _binary_impl,
    _binary_op,
    _broadcast_shape,
    _cast_impl,
    _cast_op,
    _check_act,
    _check_binary,
    _check_out_dtype,
    _compiling,
    _grad_enabled,
    _plans,
    _unary_impl,
    _unary_op,
    collapse_dims,  # noqa: F401  (public)
)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _binary_slow(a, b, op, out_dtype=None):
    _check_binary(a, b)
    _check_out_dtype(out_dtype)
    if C.use_direct_path(a, b):
        return _binary_impl(a, b, op, out_dtype)
    return _binary_op(a, b, op, out_dtype)


def _binary(a, b, op, out_dtype=None):
    if (P.ON and type(a) is _T and type(b) is _T and not _compiling()
            and not (_grad_enabled() and (a.requires_grad or b.requires_grad))):
        return P.serve_fast(_plans, (op, out_dtype), (a, b), _binary_slow,
                            (a, b, op, out_dtype))
    return _binary_slow(a, b, op, out_dtype)


def add(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a + b`` with broadcasting and any strides.

    Parameters
    ----------
    a, b : Tensor
        float32, float16 or bfloat16 CUDA tensors whose shapes broadcast.
    out_dtype : torch.dtype, optional
        Output dtype; default is torch's promotion of the two input dtypes.

    Returns
    -------
    Tensor
        A new contiguous tensor of the broadcast shape.
    """
    return _binary(a, b, "add", out_dtype)


def sub(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a - b`` with broadcasting and any strides (see :func:`add`)."""
    return _binary(a, b, "sub", out_dtype)


def mul(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a * b`` with broadcasting and any strides (see :func:`add`)."""
    return _binary(a, b, "mul", out_dtype)


def residual_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``x + residual`` kept in ``residual``'s dtype.

    The residual stream of a transformer is often held in a wider dtype than the block outputs
    (a float32 stream with bfloat16 blocks); this adds in float32 and rounds once to the
    stream's dtype. Shapes broadcast as in :func:`add`.
    """
    if (P.ON and type(x) is _T and type(residual) is _T and not _compiling()
            and not (_grad_enabled() and (x.requires_grad or residual.requires_grad))):
        return P.serve_fast(_plans, ("residual_add",), (x, residual), _residual_add_slow,
                            (x, residual))
    return _residual_add_slow(x, residual)


def _residual_add_slow(x, residual):
    C.check_tensor(x, "x")
    C.check_tensor(residual, "residual")
    C.check_same_device(x=x, residual=residual)
    _broadcast_shape(x, residual, ("x", "residual"))
    if C.use_direct_path(x, residual):
        return _binary_impl(x, residual, "add", residual.dtype)
    return _binary_op(x, residual, "add", residual.dtype)


def _unary_slow(x, act):
    C.check_tensor(x, "x")
    if C.use_direct_path(x):
        return _unary_impl(x, act)
    return _unary_op(x, act)


def _unary(x, act):
    if (P.ON and type(x) is _T and not _compiling()
            and not (_grad_enabled() and x.requires_grad)):
        return P.serve_fast(_plans, (act,), (x,), _unary_slow, (x, act))
    return _unary_slow(x, act)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` for float32/float16/bfloat16 CUDA tensors of any strides."""
    return _unary(x, "silu")


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, exact (``approximate="none"``, erf) or the tanh approximation (``"tanh"``)."""
    return _unary(x, _check_act("gelu", approximate))


def relu(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0)``; NaN stays NaN."""
    return _unary(x, "relu")


def act_mul(a: torch.Tensor, b: torch.Tensor, activation: str = "silu", *,
            approximate: str = "none") -> torch.Tensor:
    """``act(a) * b`` in one pass: the gated MLP of SwiGLU (silu) and GeGLU (gelu) models.

    Parameters
    ----------
    a, b : Tensor
        Gate and up projections; float32/float16/bfloat16, shapes broadcast, any strides (for a
        fused ``[gate | up]`` projection pass the two halves as views: ``x.chunk(2, -1)``).
    activation : {"silu", "gelu", "relu"}
    approximate : {"none", "tanh"}
        For gelu only.
    """
    if (P.ON and type(a) is _T and type(b) is _T and not _compiling()
            and not (_grad_enabled() and (a.requires_grad or b.requires_grad))):
        return P.serve_fast(_plans, ("act_mul", activation, approximate), (a, b),
                            _act_mul_slow, (a, b, activation, approximate))
    return _act_mul_slow(a, b, activation, approximate)


def _act_mul_slow(a, b, activation, approximate):
    act = _check_act(activation, approximate)
    _check_binary(a, b)
    if C.use_direct_path(a, b):
        return _act_mul_impl(a, b, act)
    return _act_mul_op(a, b, act)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` (SwiGLU); see :func:`act_mul`."""
    return act_mul(a, b, "silu")


def gelu_mul(a: torch.Tensor, b: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(a) * b`` (GeGLU); see :func:`act_mul`."""
    return act_mul(a, b, "gelu", approximate=approximate)


def cast(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Convert ``x`` to ``dtype`` (float32, float16, bfloat16 or float8_e4m3fn).

    Parameters
    ----------
    x : Tensor
        float32/float16/bfloat16, any strides.
    dtype : torch.dtype
        Target dtype.
    scale : Tensor, optional
        One-element float32 tensor on x's device. The output is ``x / scale`` rounded to
        ``dtype``; for float8_e4m3fn it saturates to +-448 first, so that
        ``torch._scaled_mm(..., scale_a=scale)`` dequantizes it. NaN stays NaN.
    """
    if (P.ON and type(x) is _T and not _compiling()
            and not (_grad_enabled() and x.requires_grad)):
        if scale is None:
            return P.serve_fast(_plans, ("cast", dtype), (x,), _cast_slow, (x, dtype, None))
        elif type(scale) is _T and not (_grad_enabled() and scale.requires_grad):
            return P.serve_fast(_plans, ("cast", dtype), (x, scale), _cast_slow,
                                (x, dtype, scale))
    return _cast_slow(x, dtype, scale)


def _cast_slow(x, dtype, scale):
    C.check_tensor(x, "x")
    if dtype not in C.FLOAT_DTYPES + C.FP8_DTYPES:
        names = ", ".join(C.dtype_name(d) for d in C.FLOAT_DTYPES + C.FP8_DTYPES)
        raise TypeError(f"dtype {dtype} is not a supported cast target; supported: {names}")
    if scale is not None:
        C.check_tensor(scale, "scale", (torch.float32,))
        if scale.numel() != 1:
            raise ValueError(f"scale must hold one element (per-tensor), got shape "
                             f"{tuple(scale.shape)}")
        C.check_same_device(x=x, scale=scale)
    if C.use_direct_path(x):
        return _cast_impl(x, dtype, scale)
    return _cast_op(x, dtype, scale)
