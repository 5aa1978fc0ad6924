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

Index math is 32-bit unless some offset can reach 2**31 (then ``INT64`` is set).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit.kernels import _common as C
from tkit.kernels import _launch as L
from tkit.kernels import _plan as P
from tkit.kernels._numerics import fp8_keep_nan

# Ops and their arity. "cast" is the identity before the store's conversion.
BINARY_OPS = ("add", "sub", "mul")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# --------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------
def _flat_configs():
    # A block of 1024..8192 elements per program: at 16-byte accesses, 4 to 16 vectors per thread
    # with 4 or 8 warps, enough loads in flight to cover HBM latency. Smaller blocks only add
    # programs; larger ones spill registers on the 3-operand ops.
    # Measured on the H200 (benchmarks/results/h200-2026-11-29-a-elementwise.log):
    # at 16384 x 8192 bf16 every config from 1024 to 8192 elements with 4-16 warps lands within
    # 1% of torch.compile (188.7 us for add); an "evict_first" hint on the loads cost 4-5% in
    # every config (197 us), so there is none. The first config is the default when autotuning
    # is off (it was among the fastest for add, silu_mul and the fp8 cast).
    configs = [triton.Config({"BLOCK": 2048}, num_warps=4)] + [
        triton.Config({"BLOCK": block}, num_warps=warps)
        for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 4), (8192, 16))
    ]
    # the interpreter pays per program, not per element: one large block
    return C.interpreter_configs(configs, triton.Config({"BLOCK": 4096}, num_warps=4))


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
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact limits at +-inf, no libdevice call
        y = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
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
        y = fp8_keep_nan(r)
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
    return _launch(act, x, None, C.empty(x.shape, x.dtype, x.device))


def _act_mul_impl(a, b, act):
    shape = _broadcast_shape(a, b)
    dtype = torch.promote_types(a.dtype, b.dtype)
    return _launch(f"{act}_mul", a, b, C.empty(shape, dtype, a.device))


def _cast_impl(x, dtype, scale):
    op = "cast_fp8" if dtype in C.FP8_DTYPES else "cast"
    return _launch(op, x, None, C.empty(x.shape, dtype, x.device), scale)


# --------------------------------------------------------------------------------------------
# torch.library registration (custom op + fake + autograd)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("tkit::binary", mutates_args=())
def _binary_op(a: torch.Tensor, b: torch.Tensor, op: str,
               out_dtype: Optional[torch.dtype]) -> torch.Tensor:  # noqa: UP045 (schema parser)
    return _op_planned(("binary", op, out_dtype), _binary_impl, (a, b), a, b, op, out_dtype)


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


@torch.library.custom_op("tkit::unary", mutates_args=())
def _unary_op(x: torch.Tensor, act: str) -> torch.Tensor:
    return _op_planned(("unary", act), _unary_impl, (x,), x, act)


@_unary_op.register_fake
def _(x, act):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


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


@torch.library.custom_op("tkit::act_mul", mutates_args=())
def _act_mul_op(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    return _op_planned(("act_mul", act), _act_mul_impl, (a, b), a, b, act)


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


@torch.library.custom_op("tkit::cast", mutates_args=())
def _cast_op(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    if scale is None:
        return _op_planned(("cast", dtype), _cast_impl, (x,), x, dtype, None)
    return _op_planned(("cast_scaled", dtype), _cast_impl, (x, scale), x, dtype, scale)


@_cast_op.register_fake
def _(x, dtype, scale):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


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
# --------------------------------------------------------------------------------------------
_T = torch.Tensor
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()


def _planned(key, slow, inputs, *args):
    """A miss: the ordinary path, recorded, and the plan kept for the next call."""
    P.stats["plan_miss"] += 1
    with P.recording() as rec:
        out = slow(*args)
    P.store(_plans, key, rec, inputs, (out,))
    return out


def _serve(key, stream, slow, inputs, *args):
    """The eager call of signature ``key``: its plan's launch on a hit, else ``slow(*args)``
    (recorded as the signature's plan on a first miss)."""
    try:
        plan = _plans.get(key)
    except TypeError:  # an unhashable option: the ordinary path names it
        plan = False
    if plan:
        out = plan(stream, *inputs)
        if out is not None:
            return out
    elif plan is None:
        return _planned(key, slow, inputs, *args)
    return slow(*args)


def _op_planned(what, impl, tensors, *args):
    """A registered op's implementation: what a torch.compile graph, the autograd path and
    ``torch.ops.tkit.*`` run. Its arguments were checked before the dispatcher (the public
    function, or the traced one), so a plan of the same signature serves it as it serves an
    eager call: a compiled graph of tkit ops otherwise paid the launch layer's full Python a
    call (2.5x the eager time of a Llama layer at 512 tokens on the H200)."""
    if P.ON and all(type(t) is _T for t in tensors):
        dev, stream = L._device_stream()
        key = ("op", *what, dev) + tuple(
            x for t in tensors
            for x in (t.shape, t.stride(), t.dtype, t.get_device(), not t.data_ptr() & 15))
        return _serve(key, stream, impl, tensors, *args)
    return impl(*args)


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
        dev, stream = L._device_stream()
        key = (op, out_dtype, dev,
               a.shape, a.stride(), a.dtype, a.get_device(), not a.data_ptr() & 15,
               b.shape, b.stride(), b.dtype, b.get_device(), not b.data_ptr() & 15)
        return _serve(key, stream, _binary_slow, (a, b), a, b, op, out_dtype)
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
        dev, stream = L._device_stream()
        key = ("residual_add", dev,
               x.shape, x.stride(), x.dtype, x.get_device(), not x.data_ptr() & 15,
               residual.shape, residual.stride(), residual.dtype, residual.get_device(),
               not residual.data_ptr() & 15)
        return _serve(key, stream, _residual_add_slow, (x, residual), x, residual)
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
        dev, stream = L._device_stream()
        key = (act, dev, x.shape, x.stride(), x.dtype, x.get_device(), not x.data_ptr() & 15)
        return _serve(key, stream, _unary_slow, (x,), x, act)
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
        dev, stream = L._device_stream()
        key = ("act_mul", activation, approximate, dev,
               a.shape, a.stride(), a.dtype, a.get_device(), not a.data_ptr() & 15,
               b.shape, b.stride(), b.dtype, b.get_device(), not b.data_ptr() & 15)
        return _serve(key, stream, _act_mul_slow, (a, b), a, b, activation, approximate)
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
        dev, stream = L._device_stream()
        if scale is None:
            key = ("cast", dtype, dev,
                   x.shape, x.stride(), x.dtype, x.get_device(), not x.data_ptr() & 15)
            return _serve(key, stream, _cast_slow, (x,), x, dtype, None)
        elif type(scale) is _T and not (_grad_enabled() and scale.requires_grad):
            key = ("cast", dtype, dev,
                   x.shape, x.stride(), x.dtype, x.get_device(), not x.data_ptr() & 15,
                   scale.shape, scale.stride(), scale.dtype, scale.get_device(),
                   not scale.data_ptr() & 15)
            return _serve(key, stream, _cast_slow, (x, scale), x, dtype, scale)
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
