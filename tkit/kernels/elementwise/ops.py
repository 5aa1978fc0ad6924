"""The elementwise family's launcher (dimension collapsing, the flat/strided choice), argument
checks, and torch.library registrations (``tkit::binary``, ``tkit::unary``, ``tkit::act_mul``,
``tkit::cast``) with their fakes and autograd, and the eager plans (tkit.kernels._plan) the
wrappers serve from."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from tkit.kernels import _common as C
from tkit.kernels import _plan as P
from tkit.kernels import _register as R
from tkit.kernels.elementwise._kernels import _ew_flat_autotuned, _ew_strided_kernel


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _broadcast_meta_strides(meta: tuple, shape: tuple[int, ...]) -> list[int]:
    """Strides of a tensor given as (shape, stride, offset) viewed at the broadcast ``shape``
    (0 on broadcast dimensions)."""
    tshape, tstride, _ = meta
    lead = len(shape) - len(tshape)
    strides = [0] * len(shape)
    for i in range(len(tshape)):
        strides[lead + i] = 0 if (tshape[i] == 1 and shape[lead + i] != 1) else tstride[i]
    return strides


def collapse_dims(shape, strides_per_operand):
    """Drop size-1 dimensions and merge neighbours that are contiguous for every operand.

    Returns a list of (size, [stride of each operand]) from outermost to innermost; a list of
    length <= 1 whose strides are all 1 is one contiguous run.
    """
    merged: list[tuple[int, list[int]]] = []
    for i, size in enumerate(shape):
        if size == 1:
            continue
        strides = [st[i] for st in strides_per_operand]
        if merged:
            psize, pstrides = merged[-1]
            if all(ps == s * size for ps, s in zip(pstrides, strides)):
                merged[-1] = (psize * size, strides)
                continue
        merged.append((size, strides))
    return merged


def _strided_tile(rows: int, N: int, transposed: bool) -> tuple[int, int, int]:
    # About 4096 elements a program (as the flat kernel's best blocks), as wide along the inner
    # dimension as it allows; 64 x 64 when an operand runs contiguously down the rows instead,
    # so that its loads get 64 contiguous elements too.
    if rows == 1:
        block_n = min(C.next_power_of_2(N), 4096)
        return 1, block_n, 4 if block_n <= 1024 else 8
    block_n = min(C.next_power_of_2(N), 64 if transposed else 128)
    block_m = min(C.next_power_of_2(rows), max(1, 4096 // block_n))
    return block_m, block_n, 4 if block_m * block_n <= 2048 else 8


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


@functools.lru_cache(maxsize=4096)
def _plan(op: str, has_scale: bool, metas: tuple) -> tuple:
    """What ``_launch`` launches for operands of these (shape, stride, storage offset) triples
    (a, [b,] out): ("flat", kwargs) or ("strided", kwargs, grid). Cached: the layout analysis
    is most of a small op's host time, and a model calls the same shapes over and over."""
    shape = metas[-1][0]
    n = 1
    for s in shape:
        n *= s
    strides = [_broadcast_meta_strides(m, shape) for m in metas]
    # the dimensions in the output's memory order (outermost first; no change for a
    # contiguous output), so that operands laid out as the output, e.g. a transposed input
    # and its transposed output, merge into one contiguous run
    order = sorted(range(len(shape)), key=lambda i: -strides[-1][i])
    shape = tuple(shape[i] for i in order)
    strides = [[st[i] for i in order] for st in strides]
    merged = collapse_dims(shape, strides)
    int64 = any(C.span_needs_int64(*m) for m in metas)
    flags = dict(OP=op, HAS_B=len(metas) == 3, HAS_SCALE=has_scale, INT64=int64)
    if len(merged) <= 1 and all(s == 1 for _, sts in merged for s in sts):
        return "flat", dict(n_elements=n, size_class=C.size_class(n), **flags), None
    if len(merged) > 5:
        raise NotImplementedError(
            f"elementwise {op}: this layout needs {len(merged)} strided dimensions after merging "
            "contiguous ones (at most 5 are supported); call .contiguous() on an input first"
        )
    merged = [(1, [0] * len(metas))] * (5 - len(merged)) + merged
    sizes = [m[0] for m in merged]
    st = [[m[1][k] for m in merged] for k in range(len(metas))]
    sa, so = st[0], st[-1]
    sb = st[1] if len(metas) == 3 else sa
    rows = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    transposed = any(t[3] == 1 and t[4] != 1 for t in st)
    block_m, block_n, warps = _strided_tile(rows, sizes[4], transposed)
    grid = (C.cdiv(rows, block_m) * C.cdiv(sizes[4], block_n),)
    kwargs = dict(
        D0=sizes[0], D1=sizes[1], D2=sizes[2], M=sizes[3], N=sizes[4],
        sa0=sa[0], sa1=sa[1], sa2=sa[2], sam=sa[3], san=sa[4],
        sb0=sb[0], sb1=sb[1], sb2=sb[2], sbm=sb[3], sbn=sb[4],
        so0=so[0], so1=so[1], so2=so[2], som=so[3], son=so[4],
        **flags, BATCHED=rows != sizes[3], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    return "strided", kwargs, grid


def _flat_grid(meta):
    return (C.cdiv(meta["n_elements"], meta["BLOCK"]),)


def _launch(op: str, a: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``op`` into the preallocated ``out`` (inputs already validated and broadcastable)."""
    if out.numel() == 0:
        return out
    metas = (_meta(a),) + ((_meta(b),) if b is not None else ()) + (_meta(out),)
    kind, kwargs, grid = _plan(op, scale is not None, metas)
    ptr_args = dict(a_ptr=a, b_ptr=b if b is not None else a, out_ptr=out,
                    scale_ptr=scale if scale is not None else a)
    if kind == "flat":
        C.launch(_ew_flat_autotuned, _flat_grid, **ptr_args, **kwargs)
    else:
        C.launch(_ew_strided_kernel, grid, **ptr_args, **kwargs)
    return out


def _broadcast_shape(a: torch.Tensor, b: torch.Tensor, names=("a", "b")) -> tuple[int, ...]:
    try:
        return C.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(
            f"{names[0]} of shape {tuple(a.shape)} and {names[1]} of shape "
            f"{tuple(b.shape)} do not broadcast"
        ) from None


def _check_binary(a, b, names=("a", "b")):
    C.check_tensor(a, names[0])
    C.check_tensor(b, names[1])
    C.check_same_device(**{names[0]: a, names[1]: b})
    return _broadcast_shape(a, b, names)


def _check_out_dtype(out_dtype, allowed=C.FLOAT_DTYPES) -> None:
    if out_dtype is not None and out_dtype not in allowed:
        names = ", ".join(C.dtype_name(d) for d in allowed)
        raise TypeError(f"out_dtype {out_dtype} is not supported; supported: {names}")


def _check_act(activation: str, approximate: str = "none") -> str:
    if activation == "gelu":
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        return "gelu_tanh" if approximate == "tanh" else "gelu"
    if activation not in ("silu", "relu", "gelu_tanh"):
        raise ValueError(f"activation must be one of silu, gelu, relu; got {activation!r}")
    return activation


def _binary_impl(a, b, op, out_dtype):
    shape = _broadcast_shape(a, b)
    dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    return _launch(op, a, b, C.empty(shape, dtype, a.device))


def _unary_impl(x, act):
    return _launch(act, x, None, C.empty_like_dense(x, x.dtype))


def _act_mul_impl(a, b, act):
    shape = _broadcast_shape(a, b)
    dtype = torch.promote_types(a.dtype, b.dtype)
    return _launch(f"{act}_mul", a, b, C.empty(shape, dtype, a.device))


def _cast_impl(x, dtype, scale):
    op = "cast_fp8" if dtype in C.FP8_DTYPES else "cast"
    return _launch(op, x, None, C.empty_like_dense(x, dtype), scale)


# --------------------------------------------------------------------------------------------
# torch.library registration (custom op + fake + autograd)
# --------------------------------------------------------------------------------------------
@R.custom_op("tkit::binary", mutates_args=(), plans=True)
def _binary_op(a: torch.Tensor, b: torch.Tensor, op: str,
               out_dtype: Optional[torch.dtype]) -> torch.Tensor:  # noqa: UP045 (schema parser)
    return P.serve_op(_binary_op, _binary_impl, (a, b, op, out_dtype))


@_binary_op.register_fake
def _(a, b, op, out_dtype):
    shape = torch.broadcast_shapes(a.shape, b.shape)
    return a.new_empty(shape, dtype=out_dtype or torch.promote_types(a.dtype, b.dtype))


def _sum_to(grad: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Reduce a broadcast gradient back to an input's shape and dtype."""
    lead = grad.ndim - len(shape)
    if lead:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.to(dtype)


def _binary_setup(ctx, inputs, output):
    a, b, op, _ = inputs
    ctx.op = op
    ctx.save_for_backward(a if op == "mul" else None, b if op == "mul" else None)
    ctx.a_meta = (tuple(a.shape), a.dtype)
    ctx.b_meta = (tuple(b.shape), b.dtype)


def _binary_backward(ctx, grad):
    a, b = ctx.saved_tensors
    if ctx.op == "add":
        ga, gb = grad, grad
    elif ctx.op == "sub":
        ga, gb = grad, -grad
    else:
        ga, gb = grad * b, grad * a
    return _sum_to(ga, *ctx.a_meta), _sum_to(gb, *ctx.b_meta), None, None


_binary_op.register_autograd(_binary_backward, setup_context=_binary_setup)


@R.custom_op("tkit::unary", mutates_args=(), plans=True)
def _unary_op(x: torch.Tensor, act: str) -> torch.Tensor:
    return P.serve_op(_unary_op, _unary_impl, (x, act))


def _fake_like(x, dtype):
    """The output of a unary op or cast as the launcher allocates it (C.empty_like_dense)."""
    strides = C.dense_like_strides(x)
    if strides is None:
        return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return x.new_empty_strided(tuple(x.shape), strides, dtype=dtype)


@_unary_op.register_fake
def _(x, act):
    return _fake_like(x, x.dtype)


def _activation_grad(grad: torch.Tensor, x: torch.Tensor, act: str) -> torch.Tensor:
    """d act(x) / dx times grad, in float32."""
    grad, x = grad.float(), x.float()
    if act == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    if act in ("gelu", "gelu_tanh"):
        approx = "tanh" if act == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_backward(grad, x, approximate=approx)
    return torch.ops.aten.threshold_backward(grad, x, 0)


def _torch_activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return torch.nn.functional.silu(x)
    if act in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")
    return torch.relu(x)


def _unary_setup(ctx, inputs, output):
    x, act = inputs
    ctx.act = act
    ctx.save_for_backward(x)


def _unary_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return _activation_grad(grad, x, ctx.act).to(x.dtype), None


_unary_op.register_autograd(_unary_backward, setup_context=_unary_setup)


@R.custom_op("tkit::act_mul", mutates_args=(), plans=True)
def _act_mul_op(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    return P.serve_op(_act_mul_op, _act_mul_impl, (a, b, act))


@_act_mul_op.register_fake
def _(a, b, act):
    shape = torch.broadcast_shapes(a.shape, b.shape)
    return a.new_empty(shape, dtype=torch.promote_types(a.dtype, b.dtype))


def _act_mul_setup(ctx, inputs, output):
    a, b, act = inputs
    ctx.act = act
    ctx.save_for_backward(a, b)


def _act_mul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    ga = _activation_grad(grad * b.float(), a, ctx.act)
    gb = grad.float() * _torch_activation(a.float(), ctx.act)
    return _sum_to(ga, a.shape, a.dtype), _sum_to(gb, b.shape, b.dtype), None


_act_mul_op.register_autograd(_act_mul_backward, setup_context=_act_mul_setup)


@R.custom_op("tkit::cast", mutates_args=(), plans=True)
def _cast_op(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    return P.serve_op(_cast_op, _cast_impl, (x, dtype, scale))


@_cast_op.register_fake
def _(x, dtype, scale):
    return _fake_like(x, dtype)


def _cast_setup(ctx, inputs, output):
    x, dtype, scale = inputs
    ctx.in_dtype = x.dtype
    ctx.save_for_backward(scale)


def _cast_backward(ctx, grad):
    (scale,) = ctx.saved_tensors
    g = grad.float()
    if scale is not None:
        g = g / scale.float()
    return g.to(ctx.in_dtype), None, None


_cast_op.register_autograd(_cast_backward, setup_context=_cast_setup)


# --------------------------------------------------------------------------------------------
# Eager plans (tkit.kernels._plan): a repeated eager call with the same signature allocates its
# output and calls the launcher, nothing else. The key holds everything the ordinary path reads
# from the arguments; the ordinary path validates, launches and records the plan on a miss.
# The registered ops above serve from plans of their own (``P.serve_op``).
# --------------------------------------------------------------------------------------------
_T = torch.Tensor
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()


