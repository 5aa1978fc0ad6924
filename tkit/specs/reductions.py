"""Specs of the reduction family (tkit/kernels/reductions/).

Bench groups: ``default`` (the M=16384 x N=8192 bf16 target shape), ``sweep`` (N from 1024 to
262144 at a fixed 256 MiB input, M = 2**27 / N rows of bf16) and ``long`` (softmax rows of
1M columns).
"""

from __future__ import annotations

import torch

import tkit
from tkit.kernels.reductions import (
    cost_layer_norm,
    cost_rms_norm,
    cost_rms_norm_residual,
    cost_softmax,
)
from tkit.registry import (
    Case,
    OpSpec,
    eager_baseline,
    lazy_composite,
    optional_module,
    torch_compile_baseline,
)
from tkit.testing.tensors import LAYOUTS, make_tensor

# hypothesis is a test dependency: imported when a fuzz recipe is first used
st = optional_module("hypothesis.strategies")
S = optional_module("tkit.testing.strategies")

BF16 = torch.bfloat16
BIG = (16384, 8192)
SMALL = (37, 129)  # interpreter-sized: odd rows, one column past a power of two
SWEEP_N = tuple(2**k for k in range(10, 19))  # 1024 .. 262144
SWEEP_ELEMENTS = 2**27  # 256 MiB of bf16
#: hidden sizes that break tiling; the fuzzers draw them too
ODD_HIDDEN = (1, 3, 127, 4097, 5120, 262147)


# ---- references (PyTorch; called on float64 copies and on the inputs themselves) -----------
def ref_softmax(x, dim=-1):
    return torch.softmax(x, dim)


def ref_log_softmax(x, dim=-1):
    return torch.log_softmax(x, dim)


def ref_rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_rms_norm_residual(x, residual, weight, eps=1e-6):
    h = x + residual
    return ref_rms_norm(h, weight, eps), h


def ref_layer_norm(x, weight, bias=None, eps=1e-5):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rms_norm_residual(x, residual, weight, eps=1e-6):
    """``tkit.rms_norm(x, weight, eps, residual=residual)`` with the residual positional."""
    return tkit.rms_norm(x, weight, eps, residual=residual)


# ---- inputs --------------------------------------------------------------------------------
def _x(shape, dtype, layout="contiguous", seed=1):
    return lambda d: make_tensor(shape, dtype, layout, seed=seed, device=d)


def _weight(n, dtype, seed=5, device=None):
    # around 1, as a trained norm weight is
    return 1.0 + 0.1 * make_tensor((n,), dtype, seed=seed, device=device)


def _softmax_case(label, shape, dtype, layout="contiguous", group="default", dim=-1):
    return Case(label, lambda d: ((make_tensor(shape, dtype, layout, seed=1, device=d),),
                                  {"dim": dim}), group)


def _norm_case(label, shape, dtype, kind, layout="contiguous", group="default"):
    def build(d):
        x = make_tensor(shape, dtype, layout, seed=1, device=d)
        w = _weight(shape[-1], dtype, device=d)
        if kind == "rms":
            return (x, w), {}
        if kind == "res":
            return (x, make_tensor(shape, dtype, layout, seed=2, device=d), w), {}
        return (x, w, 0.1 * make_tensor((shape[-1],), dtype, seed=6, device=d)), {}

    return Case(label, build, group)


def _sweep(make):
    return [make(f"sweep N={n}", (SWEEP_ELEMENTS // n, n), BF16, group="sweep")
            for n in SWEEP_N]


def _softmax_bench():
    return ([_softmax_case("16384x8192 bf16", BIG, BF16)] + _sweep(_softmax_case)
            + [_softmax_case("128x1048576 bf16 long row", (128, 2**20), BF16, group="long")])


def _norm_bench(kind):
    def make(label, shape, dtype, group="default"):
        return _norm_case(label, shape, dtype, kind, group=group)

    return [make("16384x8192 bf16", BIG, BF16)] + _sweep(make)


def _softmax_check():
    return [
        _softmax_case("37x129 fp32", SMALL, torch.float32),
        _softmax_case("37x129 fp16 transposed", SMALL, torch.float16, "transposed"),
        _softmax_case("3x5x33 fp16 dim=1", (3, 5, 33), torch.float16, dim=1),
        _softmax_case("2x20000 fp32 split path", (2, 20000), torch.float32),
        _softmax_case("37x129 bf16", SMALL, BF16),
    ]


def _norm_check(kind):
    return [
        _norm_case("37x129 fp32", SMALL, torch.float32, kind),
        _norm_case("37x129 fp16 sliced", SMALL, torch.float16, kind, "sliced"),
        _norm_case("2x3x127 bf16", (2, 3, 127), BF16, kind),
        _norm_case("2x20000 fp32 chunked path", (2, 20000), torch.float32, kind),
    ]


# ---- fuzz recipes --------------------------------------------------------------------------
def _hidden_sizes():
    # odd hidden sizes (interpreter-sized ones; 4097+ are in a dedicated test) and the usual.
    # N = 1 is left to a dedicated test: there dx = w*dy*eps/(x^2+eps)^1.5 is ~1e-6 of the
    # terms it is computed from, so the rule's floor (one ulp of the reference's magnitude)
    # asks for digits the cancellation has already lost, in torch's formula as in ours.
    return st.one_of(S.dim_sizes(max_size=300, allow_zero=False).filter(lambda n: n > 1),
                     st.sampled_from([3, 127, 128, 129, 1000]))


@lazy_composite
def _norm_shapes(draw, n_inputs):
    n = draw(_hidden_sizes())
    lead = draw(S.shapes(min_dims=0, max_dims=3, max_size=40, max_numel=max(1, 4096 // n)))
    x = tuple(lead) + (n,)
    return (x,) * n_inputs + ((n,),)


def _fuzz_softmax():
    return dict(shapes=S.shapes(min_dims=1, max_dims=3).map(lambda s: (s,)),
                dtypes=S.FLOAT_DTYPES, layouts=LAYOUTS,
                kwargs=st.fixed_dictionaries({"dim": st.sampled_from([-1, 0])}), grad=True)


def _fuzz_norm(kind):
    def recipe():
        n_inputs = 2 if kind == "res" else 1
        r = dict(shapes=_norm_shapes(n_inputs), dtypes=S.FLOAT_DTYPES,
                 layouts=("contiguous", "sliced", "offset", "transposed"), grad=True)
        if kind == "ln":
            r["extra_args"] = lambda ts, dtype, dev: (
                0.1 * make_tensor(ts[0].shape[-1:], dtype, seed=9, device=dev),)
        return r

    return recipe


def _opcheck(op_name, kind):
    def build():
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        x = make_tensor((5, 7), torch.float32, seed=1, device=dev).requires_grad_()
        w = _weight(7, torch.float32, device=dev).requires_grad_()
        op = getattr(torch.ops.tkit, op_name).default
        if kind == "softmax":
            return op, (x, -1, False), {}
        if kind == "rms":
            return op, (x, w, 1e-6, True), {}
        if kind == "res":
            r = make_tensor((5, 7), torch.float32, seed=2, device=dev).requires_grad_()
            return op, (x, r, w, 1e-6, True), {}
        b = make_tensor((7,), torch.float32, seed=3, device=dev).requires_grad_()
        return op, (x, w, b, 1e-5, True), {}

    return build


# ---- peers ---------------------------------------------------------------------------------
def _liger(kind):
    def factory():
        if not torch.cuda.is_available():
            return None
        try:
            if kind == "softmax":
                from liger_kernel.ops.softmax import LigerSoftmaxFunction

                return lambda x, dim=-1: LigerSoftmaxFunction.apply(x)
            if kind in ("rms", "res"):
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction

                if kind == "rms":
                    return lambda x, w, eps=1e-6: LigerRMSNormFunction.apply(x, w, eps)
                return None  # Liger has no fused residual form
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return lambda x, w, b=None, eps=1e-5: LigerLayerNormFunction.apply(x, w, b, eps)
        except Exception:
            return None

    return factory


def _spec(name, fn, ref, cost, bench, check, fuzz, opcheck, peer):
    baselines = {"torch": eager_baseline(ref), "torch.compile": torch_compile_baseline(ref),
                 "liger": peer}
    return OpSpec(name=name, family="reductions", fn=fn, reference=ref, cost=cost,
                  bench_cases=bench, check_cases=check, fuzz=fuzz, baselines=baselines,
                  opcheck=opcheck)


SPECS = [
    _spec("softmax", tkit.softmax, ref_softmax, cost_softmax, _softmax_bench, _softmax_check,
          _fuzz_softmax, _opcheck("softmax", "softmax"), _liger("softmax")),
    _spec("log_softmax", tkit.log_softmax, ref_log_softmax, cost_softmax,
          lambda: _softmax_bench()[:1], _softmax_check, _fuzz_softmax,
          _opcheck("softmax", "softmax"), lambda: None),
    _spec("rms_norm", tkit.rms_norm, ref_rms_norm, cost_rms_norm, lambda: _norm_bench("rms"),
          lambda: _norm_check("rms"), _fuzz_norm("rms"), _opcheck("rms_norm", "rms"),
          _liger("rms")),
    _spec("rms_norm_residual", rms_norm_residual, ref_rms_norm_residual, cost_rms_norm_residual,
          lambda: _norm_bench("res"), lambda: _norm_check("res"), _fuzz_norm("res"),
          _opcheck("rms_norm_residual", "res"), _liger("res")),
    _spec("layer_norm", tkit.layer_norm, ref_layer_norm, cost_layer_norm,
          lambda: _norm_bench("ln"), lambda: _norm_check("ln"), _fuzz_norm("ln"),
          _opcheck("layer_norm", "ln"), _liger("ln")),
]
