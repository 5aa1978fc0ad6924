"""tkit.fuse: functions of pointwise ops and last-dim reductions, compiled, against the same
function in float64 (the reference) and in the inputs' precision (the peer) under the reference
rule, outputs poisoned; the launches each plan makes; what stays in torch; the cache."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import tkit.fuse as fuse
from tkit.fuse import compiler
from tkit.testing import check_against_reference
from tkit.testing.tensors import default_device, make_tensor

BF16 = torch.bfloat16


def _dev():
    return default_device()


def rms_norm(x, w):
    v = x.float()
    return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(x.dtype)


def layer_norm(x, w, b):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) * (x - mu)).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * w + b


def softmaxes(x):
    return torch.softmax(x, -1), torch.log_softmax(x, -1)


def swiglu(a, b):
    return F.silu(a) * b


def gelus(x):
    return F.gelu(x, approximate="tanh") * torch.sigmoid(x) + F.gelu(x) - torch.tanh(x)


def masked(x, y):
    z = torch.where(x > 0.25, x * 2.0, y - 1.0).clamp(-1.5, 2.0)
    return z, (x <= y), torch.maximum(x, y).abs().amin(-1)


def row_stats(x):
    # reductions without keepdim, returned; a per-row value combined with rows
    s = x.sum(-1)
    m = x.amax(-1, keepdim=True)
    return s, s * 0.5 + 1.0, x - m, torch.exp(x - m).sum(-1, keepdim=True)


def masked_softmax(x, y):
    # an attention-style mask filled in, then the softmax; per-row views between forms
    p = torch.softmax(x.masked_fill(y < -0.5, -1e4), -1)
    s = x.sum(-1)
    return p, x - s.unsqueeze(-1), x * s.view(*s.shape, 1).squeeze(-1).unsqueeze(-1)


CASES = [
    ("rms_norm", rms_norm, [(6, 300), (300,)], [BF16, torch.float16, torch.float32], 1),
    ("rms_norm 3-D", rms_norm, [(2, 3, 130), (130,)], [BF16], 1),
    ("layer_norm", layer_norm, [(7, 129), (129,), (129,)], [torch.float32, torch.float16], 1),
    ("softmax, log_softmax", softmaxes, [(5, 1000)], [torch.float32, BF16], 1),
    ("swiglu, a per-batch row", swiglu, [(2, 3, 70), (2, 1, 70)], [BF16, torch.float32], 1),
    ("gelu forms", gelus, [(4, 2500)], [torch.float32], 1),  # 3 column blocks
    ("where, clamp, compare, amin", masked, [(9, 33), (9, 33)], [torch.float32], 1),
    ("row statistics", row_stats, [(4, 5, 48)], [torch.float32, torch.float16], 1),
    ("one dim", swiglu, [(3000,), (3000,)], [torch.float32], 1),
    ("four dims", rms_norm, [(2, 2, 3, 40), (40,)], [torch.float32], 1),
    ("masked softmax, per-row views", masked_softmax, [(6, 50), (6, 50)], [torch.float32, BF16],
     1),
]


@pytest.mark.parametrize("label, fn, shapes, dtypes, launches", CASES,
                         ids=[c[0] for c in CASES])
def test_against_the_reference(label, fn, shapes, dtypes, launches):
    f = fuse.fuse(fn)
    for dtype in dtypes:
        ins = [make_tensor(s, dtype, seed=i + 3, device=_dev()) for i, s in enumerate(shapes)]
        with _launch_count() as n:
            check_against_reference(f, fn, ins, ulps=4)
        assert n[0] == launches, f"{label} ({dtype}): {n[0]} launches"


def test_ops_it_does_not_know_run_in_torch():
    # a GEMM cuts the chain: a kernel before it, torch's mm, a kernel after it
    def fn(x, w):
        h = F.silu(x) * 2.0
        return torch.softmax(h @ w, -1) + 1.0

    x = make_tensor((5, 24), torch.float32, seed=1, device=_dev())
    w = make_tensor((24, 40), torch.float32, seed=2, device=_dev())
    f = fuse.fuse(fn)
    with _launch_count() as n:
        check_against_reference(f, fn, [x, w], ulps=4)
    assert n[0] == 2
    text = fuse.explain(f, x, w)
    assert "torch: aten.mm.default" in text and text.count("kernel over") == 2


def test_a_row_sum_against_rows_is_not_per_row():
    # x.sum(-1) is (R,): torch aligns it with x's last dim, so at R == N it is a column
    # vector, not a per-row value; the plan must keep torch's meaning
    def fn(x):
        return x - x.sum(-1)

    x = make_tensor((8, 8), torch.float32, seed=4, device=_dev())
    check_against_reference(fuse.fuse(fn), fn, [x], ulps=4)


def test_rows_longer_than_a_kernel_holds_reduce_in_torch():
    x = make_tensor((2, compiler.MAX_ROW + 5), torch.float32, seed=5, device=_dev())
    f = fuse.fuse(softmaxes)
    check_against_reference(f, softmaxes, [x], ulps=4)
    assert "torch: aten._softmax.default" in fuse.explain(f, x)


def test_plans_are_cached_per_signature(monkeypatch):
    traced = []
    real = compiler.trace
    monkeypatch.setattr(compiler, "trace", lambda fn, args: traced.append(1) or real(fn, args))
    f = fuse.fuse(swiglu)
    a, b = (make_tensor((4, 64), torch.float32, seed=s, device=_dev()) for s in (6, 7))
    f(a, b)
    f(b, a)
    assert len(traced) == 1
    f(a[:3], b[:3])
    assert len(traced) == 2


def test_inputs_that_need_a_gradient_are_refused():
    x = make_tensor((3, 8), torch.float32, seed=8, device=_dev()).requires_grad_()
    with pytest.raises(ValueError, match="inference only"):
        fuse.fuse(swiglu)(x, x)


@contextlib.contextmanager
def _launch_count():
    from tkit.kernels import _common as C

    n = [0]
    real = C.launch

    def counting(*a, **kw):
        n[0] += 1
        return real(*a, **kw)

    C.launch = counting
    try:
        yield n
    finally:
        C.launch = real


@pytest.mark.parametrize("fn, shapes", [(rms_norm, [(6, 300), (300,)]), (masked, [(9, 33)] * 2),
                                        (softmaxes, [(5, 1000)])],
                         ids=["rms_norm", "masked", "softmaxes"])
def test_generated_kernels_compile_for_sm90(fn, shapes):
    # the interpreter forgives what the compiler may not: every generated kernel compiled
    # ahead of time for sm_90 from its recorded launch, with a row's loads and stores in it
    from tkit.ir_tools.aot import compile_launch
    from tkit.kernels import _common as C

    ins = [make_tensor(s, BF16, seed=i, device=_dev()) for i, s in enumerate(shapes)]
    f = fuse.fuse(fn)
    f(*ins)  # traced on real values; then the launches recorded
    with C.capture_launches() as launches:
        f(*ins)
    assert launches
    for lc in launches:
        ptx = compile_launch(lc.kernel, dict(lc.kwargs), 90).asm["ptx"]
        assert "ld.global" in ptx and "st.global" in ptx


def test_no_fma_contraction():
    # x * y - max(x * y) at the row's max is 0 in torch; with the product and the subtraction
    # contracted into one FMA it is the product's rounding error (the GPU's random programs
    # found it; the interpreter never contracts, so the sm_90 PTX is what is checked here)
    from tkit.ir_tools.aot import compile_launch
    from tkit.kernels import _common as C

    def fn(x, y):
        v = x * y
        return v - v.amax(-1, keepdim=True)

    x = make_tensor((5, 1), torch.float32, seed=1, device=_dev())
    y = make_tensor((5, 1), torch.float32, seed=2, device=_dev())
    f = fuse.fuse(fn)
    assert torch.equal(f(x, y), torch.zeros_like(x))
    with C.capture_launches() as launches:
        f(x, y)
    (lc,) = launches
    ptx = compile_launch(lc.kernel, dict(lc.kwargs), 90).asm["ptx"]
    assert "mul.rn.f32" in ptx or "mul.f32" in ptx
    assert "fma.rn.f32" not in ptx


# ---- random programs ---------------------------------------------------------------------------
#: (name, arity, torch function): inputs kept in ranges where each is well-conditioned
_RANDOM_OPS = [
    ("add", 2, torch.add), ("sub", 2, torch.sub), ("mul", 2, torch.mul),
    ("div", 2, lambda a, b: a / (1.0 + b.abs())), ("max", 2, torch.maximum),
    ("min", 2, torch.minimum), ("where", 2, lambda a, b: torch.where(a > b, a, b * 0.5)),
    ("exp", 1, lambda a: torch.exp(a.clamp(-4.0, 4.0))), ("sigmoid", 1, torch.sigmoid),
    ("tanh", 1, torch.tanh), ("relu", 1, torch.relu), ("neg", 1, torch.neg),
    ("gelu", 1, F.gelu), ("silu", 1, F.silu), ("square", 1, lambda a: a.pow(2)),
    ("sqrt", 1, lambda a: torch.sqrt(a.abs() + 1.0)), ("scale", 1, lambda a: a * 0.75 + 0.25),
    ("root", 1, lambda a: (a.abs() + 1.0).pow(0.5)),
    ("inverse", 1, lambda a: (a * a + 1.0).pow(-2)),
]
_RANDOM_REDUCE = [None, ("sum", lambda a: a.sum(-1, keepdim=True) * 0.1),
                  ("mean", lambda a: a.mean(-1, keepdim=True)),
                  ("amax", lambda a: a.amax(-1, keepdim=True))]


def _program(steps, reduce):
    """A function of (x, y): each step applies an op to earlier values (x, y and results);
    ``reduce`` folds a last-dim reduction of the last value back into it."""
    def fn(x, y):
        vals = [x, y]
        for op, i, j in steps:
            _, arity, f = _RANDOM_OPS[op]
            a, b = vals[i % len(vals)], vals[j % len(vals)]
            vals.append(f(a, b) if arity == 2 else f(a))
        out = vals[-1]
        if reduce is not None:
            out = out - _RANDOM_REDUCE[reduce][1](out)
        return out, vals[len(vals) // 2]

    return fn


@pytest.mark.parametrize("seed", range(8))
def test_random_programs_under_the_reference_rule(seed):
    # generated code's precedence, literals and broadcasting, over programs nobody wrote:
    # chains of 3-6 ops drawn uniformly (every op appears in some program) on (rows, n) and
    # (n,) / (rows, 1) / (rows, n) operands, with or without a reduction folded back
    import random

    rng = random.Random(seed)
    for k in range(5):
        steps = [(rng.randrange(len(_RANDOM_OPS)), rng.randrange(10), rng.randrange(10))
                 for _ in range(rng.randint(3, 6))]
        reduce = rng.randrange(len(_RANDOM_REDUCE))
        fn = _program(steps, reduce or None)
        n = rng.choice([1, 7, 64, 130])
        dtype = rng.choice([torch.float32, BF16])
        shape = rng.choice([(5, 1), (n,), (5, n)])
        x = make_tensor((5, n), dtype, seed=seed * 10 + k, device=_dev())
        y = make_tensor(shape, dtype, seed=seed * 10 + k + 100, device=_dev())
        check_against_reference(fuse.fuse(fn), fn, [x, y], ulps=8)


# ---- the launch config ---------------------------------------------------------------------
def test_fuse_config_sets_the_launch_and_keeps_the_values():
    from tkit.kernels import _common as C

    x = make_tensor((6, 2048), BF16, seed=3, device=_dev())
    w = make_tensor((2048,), BF16, seed=4, device=_dev())
    y = make_tensor((6, 3000), BF16, seed=5, device=_dev())
    f, g = fuse.fuse(rms_norm), fuse.fuse(lambda a: F.silu(a) * 2.0)
    want_f, want_g = f(x, w), g(y)
    for over, warps_f, block_g, warps_g in ((dict(), 2, 1024, 1),
                                            (dict(values_per_thread=8), 8, 1024, 4),
                                            (dict(max_warps=1, block_cols=4096), 1, 4096, 1)):
        with fuse.fuse_config(**over):
            with C.capture_launches() as launches:
                f(x, w)
                g(y)
            (lf,), (lg,) = [lc for lc in launches if lc.kwargs["N"] == 2048], \
                [lc for lc in launches if lc.kwargs["N"] == 3000]
            assert (lf.kwargs["num_warps"], lg.kwargs["BLOCK"], lg.kwargs["num_warps"]) == \
                (warps_f, block_g, warps_g), over
            assert lg.grid == (6, -(-3000 // block_g))
            got_f, got_g = f(x, w), g(y)
        # the same values under any config: a row's sum in another order within rounding
        torch.testing.assert_close(got_f, want_f, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got_g, want_g, rtol=0, atol=0)
    assert compiler.current_config() == fuse.FuseConfig()  # the default outside the scopes
    with pytest.raises(TypeError, match="warps_per_row"):
        with fuse.fuse_config(warps_per_row=4):
            pass
    with pytest.raises(ValueError, match="values_per_thread"):
        fuse.FuseConfig(values_per_thread=12)
