"""Specs of the elementwise family (tkit/kernels/elementwise/)."""

from __future__ import annotations

import functools

import torch

import tkit
from tkit.registry import (
    Case,
    Cost,
    OpSpec,
    eager_baseline,
    optional_module,
    torch_compile_baseline,
    unique_bytes,
)
from tkit.testing.tensors import LAYOUTS, make_tensor

# hypothesis is a test dependency: imported when a fuzz recipe is first used
st = optional_module("hypothesis.strategies")
S = optional_module("tkit.testing.strategies")

BF16 = torch.bfloat16
# 16384 x 8192 bf16 is 256 MiB a tensor: 4x the L2, enough work to fill the chip many times over.
BIG = (16384, 8192)
SMALL = (37, 129)  # interpreter-sized: odd rows, one column past a power of two


# ---- references (PyTorch; called on float64 copies and on the inputs themselves) -----------
def _ref_binary(op):
    def ref(a, b):
        return op(a, b)

    ref.__name__ = f"torch_{op.__name__}"
    return ref


def ref_residual_add(x, residual):
    return (x.to(residual.dtype) + residual) if x.dtype != torch.float64 else x + residual


def _ref_act(act, approximate="none"):
    def ref(x):
        if act == "silu":
            return torch.nn.functional.silu(x)
        if act == "gelu":
            return torch.nn.functional.gelu(x, approximate=approximate)
        return torch.relu(x)

    return ref


def ref_silu_mul(a, b):
    return torch.nn.functional.silu(a) * b


def ref_gelu_mul(a, b, approximate="none"):
    return torch.nn.functional.gelu(a, approximate=approximate) * b


def ref_cast(x, dtype, scale=None):
    y = x if scale is None else x / scale.to(x.dtype if x.dtype == torch.float64 else
                                             torch.float32)
    if dtype == torch.float8_e4m3fn:
        y = y.clamp(-448.0, 448.0)
    return y.to(dtype)


# ---- costs ---------------------------------------------------------------------------------
def _out_bytes(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def cost_binary(a, b, *args, out_dtype=None, flops_per_element=1, **kw):
    shape = torch.broadcast_shapes(a.shape, b.shape)
    dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    n = 1
    for s in shape:
        n *= s
    return Cost(unique_bytes(a) + unique_bytes(b) + _out_bytes(shape, dtype),
                flops_per_element * n)


def cost_residual_add(x, residual):
    return cost_binary(x, residual, out_dtype=residual.dtype)


def cost_unary(x, *args, flops_per_element=4, **kw):
    return Cost(unique_bytes(x) + x.numel() * x.element_size(), flops_per_element * x.numel())


def cost_act_mul(a, b, *args, **kw):
    return cost_binary(a, b, flops_per_element=6)


def cost_cast(x, dtype, scale=None):
    return Cost(unique_bytes(x) + _out_bytes(x.shape, dtype), x.numel())


# ---- inputs ----------------------------------------------------------------------------------
def _t(shape, dtype=BF16, layout="contiguous", seed=0):
    return functools.partial(make_tensor, shape, dtype, layout, seed=seed)


def _binary_cases(shape, dtype, layouts=True):
    def make(layout_a, layout_b="contiguous", b_shape=None):
        def build(device):
            a = make_tensor(shape, dtype, layout_a, seed=1, device=device)
            b = make_tensor(b_shape or shape, dtype, layout_b, seed=2, device=device)
            return (a, b), {}

        return build

    label = "x".join(map(str, shape))
    cases = [Case(f"{label} contiguous", make("contiguous"), "contiguous")]
    if layouts:
        cases += [
            Case(f"{label} a transposed", make("transposed"), "strided"),
            Case(f"{label} a sliced", make("sliced"), "strided"),
            Case(f"{label} + row", make("contiguous", b_shape=shape[-1:]), "broadcast"),
            Case(f"{label} + column", make("contiguous", b_shape=(shape[0], 1)), "broadcast"),
        ]
    return cases


def _unary_cases(shape, dtype, layouts=True):
    def make(layout):
        return lambda device: ((make_tensor(shape, dtype, layout, seed=3, device=device),), {})

    label = "x".join(map(str, shape))
    cases = [Case(f"{label} contiguous", make("contiguous"), "contiguous")]
    if layouts:
        cases.append(Case(f"{label} transposed", make("transposed"), "strided"))
    return cases


def _act_mul_cases(shape, dtype, kwargs=None, layouts=True):
    kwargs = kwargs or {}

    def contiguous(device):
        a = make_tensor(shape, dtype, seed=4, device=device)
        b = make_tensor(shape, dtype, seed=5, device=device)
        return (a, b), dict(kwargs)

    def fused_projection(device):
        # [gate | up] from one fused projection, split as two row-strided views
        gu = make_tensor((shape[0], 2 * shape[1]), dtype, seed=6, device=device)
        a, b = gu.chunk(2, dim=-1)
        return (a, b), dict(kwargs)

    label = "x".join(map(str, shape))
    cases = [Case(f"{label} contiguous", contiguous, "contiguous")]
    if layouts:
        cases.append(Case(f"{label} chunked gate|up", fused_projection, "strided"))
    return cases


def _cast_cases(big: bool):
    def make(shape, src, dst, layout="contiguous", scaled=False):
        def build(device):
            x = make_tensor(shape, src, layout, seed=7, device=device)
            scale = torch.tensor([0.02], device=device) if scaled else None
            return (x, dst, scale), {}

        return build

    s16 = (16384, 16384) if big else SMALL
    s32 = BIG if big else SMALL
    lab16, lab32 = "x".join(map(str, s16)), "x".join(map(str, s32))
    cases = [
        Case(f"{lab32} fp32->bf16", make(s32, torch.float32, BF16), "contiguous"),
        Case(f"{lab16} bf16->fp8 scaled", make(s16, BF16, torch.float8_e4m3fn, scaled=True),
             "contiguous"),
        Case(f"{lab16} bf16->fp16 transposed", make(s16, BF16, torch.float16, "transposed"),
             "strided"),
    ]
    if not big:
        # the interpreter's float8 conversion rounds wrongly (see docs/NOTES.md): GPU only
        cases = [c for c in cases if "fp8" not in c.label]
    return cases


# ---- fuzz recipes -------------------------------------------------------------------------
def _fuzz_binary():
    return dict(shapes=S.binary_shapes(), dtypes=S.FLOAT_DTYPES, layouts=LAYOUTS)


def _fuzz_unary():
    return dict(shapes=S.shapes().map(lambda s: (s,)), dtypes=S.FLOAT_DTYPES, layouts=LAYOUTS)


#: comparison floor of float32 outputs of the activations, in units of rounding: exp, erf and
#: tanh in float32 (the kernels', the interpreter's numpy and torch's each) are within a few
#: ulp, and torch's peer can be exact where the kernel is not (gelu tanh of one float32 value
#: under triton 3.9's interpreter: 1.3 ulp against a bound of 1.2)
_ACT_ULPS = 4.0


def _fuzz_act(unary=True):
    return dict((_fuzz_unary if unary else _fuzz_binary)(), ulps=_ACT_ULPS)


def _cast_targets():
    # float8 only on the GPU: the interpreter's float8 conversion is wrong (docs/NOTES.md)
    targets = [torch.float32, torch.float16, torch.bfloat16]
    if torch.cuda.is_available():
        targets.append(torch.float8_e4m3fn)
    return targets


def cast_with_scale(x, dtype, scale=None):
    """``tkit.cast`` with a Python float scale, for fuzzing."""
    s = None if scale is None else torch.tensor([scale], device=x.device)
    return tkit.cast(x, dtype, s)


def ref_cast_with_scale(x, dtype, scale=None):
    s = None if scale is None else torch.tensor([scale], device=x.device)
    return ref_cast(x, dtype, s)


def _fuzz_cast():
    kw = st.fixed_dictionaries({
        "dtype": st.sampled_from(_cast_targets()),
        "scale": st.sampled_from([None, 0.5, 0.013, 3.0]),
    })
    return dict(fn=cast_with_scale, reference=ref_cast_with_scale, shapes=S.shapes().map(
        lambda s: (s,)), dtypes=S.FLOAT_DTYPES, layouts=LAYOUTS, kwargs=kw, scale=4.0)


def _opcheck(op_name, *extra, shape=(5, 7), n=2):
    def build():
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        ts = tuple(make_tensor(shape, torch.float32, seed=i, device=dev).requires_grad_()
                   for i in range(n))
        return getattr(torch.ops.tkit, op_name).default, ts + extra, {}

    return build


def _liger_swiglu():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return None
    return LigerSiLUMulFunction.apply


def _spec(name, fn, ref, cost, bench, check, fuzz, opcheck, peers=None, ulps=1.0):
    baselines = {"torch": eager_baseline(ref), "torch.compile": torch_compile_baseline(ref)}
    baselines.update(peers or {})
    return OpSpec(name=name, family="elementwise", fn=fn, reference=ref, cost=cost,
                  bench_cases=bench, check_cases=check, fuzz=fuzz, baselines=baselines,
                  opcheck=opcheck, ulps=ulps)


SPECS = [
    _spec("add", tkit.add, _ref_binary(torch.add), cost_binary,
          lambda: _binary_cases(BIG, BF16), lambda: _binary_cases(SMALL, torch.float16),
          _fuzz_binary, _opcheck("binary", "add", None)),
    _spec("sub", tkit.sub, _ref_binary(torch.sub), cost_binary,
          lambda: _binary_cases(BIG, BF16, layouts=False),
          lambda: _binary_cases(SMALL, torch.float16), _fuzz_binary,
          _opcheck("binary", "sub", None)),
    _spec("mul", tkit.mul, _ref_binary(torch.mul), cost_binary,
          lambda: _binary_cases(BIG, BF16), lambda: _binary_cases(SMALL, torch.float16),
          _fuzz_binary, _opcheck("binary", "mul", None)),
    _spec("residual_add", tkit.residual_add, ref_residual_add, cost_residual_add,
          lambda: [Case("16384x8192 bf16 + fp32 stream", lambda d: (
              (make_tensor(BIG, BF16, seed=1, device=d),
               make_tensor(BIG, torch.float32, seed=2, device=d)), {}), "contiguous")],
          lambda: [Case("37x129 fp16 + fp32 stream", lambda d: (
              (make_tensor(SMALL, torch.float16, seed=1, device=d),
               make_tensor(SMALL, torch.float32, seed=2, device=d)), {}), "contiguous")],
          _fuzz_binary, _opcheck("binary", "add", torch.float32)),
    _spec("silu", tkit.silu, _ref_act("silu"), cost_unary,
          lambda: _unary_cases(BIG, BF16), lambda: _unary_cases(SMALL, BF16), _fuzz_act,
          _opcheck("unary", "silu", n=1), ulps=_ACT_ULPS),
    _spec("gelu", tkit.gelu, _ref_act("gelu"), cost_unary,
          lambda: _unary_cases(BIG, BF16, layouts=False), lambda: _unary_cases(SMALL, BF16),
          _fuzz_act, _opcheck("unary", "gelu", n=1), ulps=_ACT_ULPS),
    _spec("gelu_tanh", functools.partial(tkit.gelu, approximate="tanh"),
          _ref_act("gelu", "tanh"), cost_unary,
          lambda: _unary_cases(BIG, BF16, layouts=False), lambda: _unary_cases(SMALL, BF16),
          _fuzz_act, _opcheck("unary", "gelu_tanh", n=1), ulps=_ACT_ULPS),
    _spec("relu", tkit.relu, _ref_act("relu"), cost_unary,
          lambda: _unary_cases(BIG, BF16, layouts=False), lambda: _unary_cases(SMALL, BF16),
          _fuzz_unary, _opcheck("unary", "relu", n=1)),
    _spec("silu_mul", tkit.silu_mul, ref_silu_mul, cost_act_mul,
          lambda: _act_mul_cases((16384, 7168), BF16),
          lambda: _act_mul_cases(SMALL, torch.float16), lambda: _fuzz_act(False),
          _opcheck("act_mul", "silu"), peers={"liger": _liger_swiglu}, ulps=_ACT_ULPS),
    _spec("gelu_mul", tkit.gelu_mul, ref_gelu_mul, cost_act_mul,
          lambda: _act_mul_cases((16384, 7168), BF16, layouts=False),
          lambda: _act_mul_cases(SMALL, torch.float16), lambda: _fuzz_act(False),
          _opcheck("act_mul", "gelu"), ulps=_ACT_ULPS),
    _spec("cast", tkit.cast, ref_cast, cost_cast,
          lambda: _cast_cases(big=True), lambda: _cast_cases(big=False), _fuzz_cast,
          _opcheck("cast", torch.float16, None, n=1)),
]
