"""Elementwise family: fuzzing against the reference rule, autograd, registration, errors."""

import pytest
import torch

import tkit
from tkit import registry
from tkit.kernels import _common
from tkit.kernels import elementwise as ew
from tkit.testing import check_against_reference, fuzz, make_tensor

SPECS = [s for s in registry.all_specs() if s.family == "elementwise"]
IDS = [s.name for s in SPECS]
ON_GPU = torch.cuda.is_available()


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_fuzz_against_reference(spec):
    recipe = dict(spec.fuzz())
    fn = recipe.pop("fn", spec.fn)
    ref = recipe.pop("reference", spec.reference)
    fuzz(fn, ref, **recipe)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_check_cases(spec, device):
    for case in spec.check_cases():
        args, kwargs = case.make(device)
        check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_opcheck(spec):
    op, args, kwargs = spec.opcheck()
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("name", ["add", "sub", "mul", "residual_add", "silu", "gelu",
                                  "gelu_tanh", "relu", "silu_mul", "gelu_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradients(name, dtype, device):
    spec = registry.get(name)
    n = 1 if name in ("silu", "gelu", "gelu_tanh", "relu") else 2
    shapes = [(7, 33), (33,)][:n]  # the second input broadcasts: its gradient is reduced
    args = [make_tensor(s, dtype, seed=i, device=device) for i, s in enumerate(shapes)]
    check_against_reference(spec.fn, spec.reference, args, grad=True, ulps=spec.ulps)


def test_cast_gradient(device):
    x = make_tensor((9, 17), torch.float32, seed=3, device=device).requires_grad_()
    scale = torch.tensor([0.25], device=device)
    y = tkit.cast(x, torch.float16, scale)
    g = torch.randn(y.shape, device=device).half()
    y.backward(g)
    torch.testing.assert_close(x.grad, g.float() / 0.25)


@pytest.mark.parametrize("fn", [tkit.add, tkit.silu_mul])
def test_torch_compile_fullgraph(fn, device):
    a = make_tensor((6, 40), torch.float16, seed=1, device=device)
    b = make_tensor((40,), torch.float16, seed=2, device=device)
    backend = "inductor" if ON_GPU else "aot_eager"  # no C++ toolchain needed on CPU
    compiled = torch.compile(lambda a, b: fn(a, b) * 2, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(a, b), fn(a, b) * 2)


def test_direct_and_dispatched_paths_agree(device, monkeypatch):
    a = make_tensor((5, 64), torch.float32, seed=1, device=device)
    b = make_tensor((5, 64), torch.float32, "transposed", seed=2, device=device)
    direct = tkit.mul(a, b)
    monkeypatch.setattr(_common._env, "NO_DIRECT", True)
    assert not _common.use_direct_path(a, b)
    torch.testing.assert_close(tkit.mul(a, b), direct, rtol=0, atol=0)


def test_int64_index_path(device, monkeypatch):
    """The 64-bit offset code path computes the same thing (forced on at a small size; the
    GPU test below crosses 2**31 for real)."""
    monkeypatch.setattr(_common, "span_needs_int64", lambda *m: True)
    ew.ops._plan.cache_clear()  # launch plans are cached per layout
    try:
        for layout in ("contiguous", "transposed"):
            a = make_tensor((33, 70), torch.float16, layout, seed=1, device=device)
            b = make_tensor((70,), torch.float16, seed=2, device=device)
            metas = (ew.ops._meta(a), ew.ops._meta(b), ew.ops._meta(a + b))
            assert ew.ops._plan("add", False, metas)[1]["INT64"]
            check_against_reference(tkit.add, torch.add, [a, b])
    finally:
        ew.ops._plan.cache_clear()


def test_launch_plans_are_cached_per_layout(device):
    """The launcher's layout analysis is cached per (shape, strides, offset) of the operands.
    Eager plans off: on a GPU they serve the second call without reaching the launcher."""
    from tkit.kernels import _plan

    ew.ops._plan.cache_clear()
    with _plan.off("test"):
        a = make_tensor((16, 64), torch.float32, "sliced", seed=1, device=device)
        tkit.silu(a)
        tkit.silu(make_tensor((16, 64), torch.float32, "sliced", seed=2, device=device))
        assert ew.ops._plan.cache_info().hits == 1 and ew.ops._plan.cache_info().misses == 1
        tkit.silu(make_tensor((16, 65), torch.float32, "sliced", seed=2, device=device))
        assert ew.ops._plan.cache_info().misses == 2


@pytest.mark.parametrize("layout", ["transposed", "permuted", "sliced", "offset"])
@pytest.mark.parametrize("op", ["silu", "relu", "cast", "cast_scaled"])
def test_unary_output_keeps_a_dense_inputs_strides(op, layout, device):
    """A unary op or cast of a dense permutation (a transpose) returns the strides torch's own
    op returns (``preserve_format``) and runs as one contiguous run (the flat kernel); any
    other input (a slice) gives a contiguous output. Values against torch's op in float64."""
    shape = (6, 40, 24) if layout == "permuted" else (40, 24)
    x = make_tensor(shape, torch.float32, layout, seed=11, device=device)
    scale = torch.tensor([0.5], device=device)
    calls = {
        "silu": (tkit.silu, torch.nn.functional.silu),
        "relu": (tkit.relu, torch.relu),
        "cast": (lambda t: tkit.cast(t, torch.bfloat16), lambda t: t.to(torch.bfloat16)),
        "cast_scaled": (lambda t: tkit.cast(t, torch.float16, scale),
                        lambda t: (t.double() / 0.5).to(torch.float16)),
    }
    fn, ref_fn = calls[op]
    with _common.poisoned_outputs():
        out = fn(x)
    ref = ref_fn(x.double() if op in ("silu", "relu") else x)
    dense = layout in ("transposed", "permuted")  # offset: contiguous, sliced: not dense
    assert (_common.dense(x) and not x.is_contiguous()) == dense
    assert out.stride() == (ref.stride() if dense else torch.empty(shape).stride())
    assert out.is_contiguous() != dense
    launch_op = {"cast": "cast", "cast_scaled": "cast"}.get(op, op)
    kind = ew.ops._plan(launch_op, op == "cast_scaled", (ew.ops._meta(x), ew.ops._meta(out)))[0]
    assert kind == ("strided" if layout == "sliced" else "flat")
    # casts: within one unit of the target's rounding (the interpreter's bf16 conversion
    # truncates); activations in float32 against float64
    rtol = {"cast": 2.0**-7, "cast_scaled": 2.0**-10}.get(op, 1e-6)
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=1e-7)


def test_unary_fake_strides_follow_the_kernels(device):
    """The fakes (meta, torch.compile) give the strides the launcher allocates."""
    for layout in ("transposed", "permuted", "sliced", "contiguous"):
        x = make_tensor((3, 8, 5), torch.float32, layout, seed=1, device=device)
        xm = x.to("meta") if layout != "sliced" else torch.empty_strided(
            x.shape, x.stride(), device="meta")
        for got, fake in ((tkit.silu(x), torch.ops.tkit.unary(xm, "silu")),
                          (tkit.cast(x, torch.float16),
                           torch.ops.tkit.cast(xm, torch.float16, None))):
            assert got.stride() == fake.stride() and got.dtype == fake.dtype, layout
    xt = make_tensor((8, 5), torch.float32, "transposed", seed=2, device=device)
    torch.library.opcheck(torch.ops.tkit.unary.default, (xt, "silu"))
    torch.library.opcheck(torch.ops.tkit.cast.default, (xt, torch.float16, None))


def test_needs_int64_counts_span():
    small = torch.empty(0)
    assert not _common.needs_int64(small)
    big_view = torch.empty_strided((2, 2), (2**31, 1), device="meta")  # span only
    assert _common.needs_int64(big_view)


def test_collapse_dims_merges_contiguous_runs():
    # a contiguous (2, 3, 4) tensor and a broadcast row: the first two dims merge
    merged = ew.collapse_dims((2, 3, 4), [[12, 4, 1], [0, 0, 1], [12, 4, 1]])
    assert merged == [(6, [4, 0, 4]), (4, [1, 1, 1])]
    # everything contiguous: one run of stride 1
    assert ew.collapse_dims((2, 1, 5), [[5, 5, 1], [5, 5, 1]]) == [(10, [1, 1])]


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda d: tkit.add(torch.ones(3, dtype=torch.int32, device=d), torch.ones(3, device=d)),
         TypeError, "a has dtype int32"),
        (lambda d: tkit.add(torch.ones(3, device=d), torch.ones(4, device=d)),
         ValueError, "do not broadcast"),
        (lambda d: tkit.silu_mul(torch.ones(3, device=d), [1.0]), TypeError, "b must be"),
        (lambda d: tkit.gelu(torch.ones(3, device=d), approximate="fast"),
         ValueError, "approximate"),
        (lambda d: tkit.cast(torch.ones(3, device=d), torch.int8), TypeError, "dtype"),
        (lambda d: tkit.cast(torch.ones(3, device=d), torch.float16, torch.ones(2, device=d)),
         ValueError, "scale must hold one element"),
        (lambda d: tkit.add(torch.ones(3, dtype=torch.float64, device=d),
                            torch.ones(3, device=d)), TypeError, "float64"),
    ],
)
def test_bad_input_errors(call, exc, words, device):
    with pytest.raises(exc, match=words):
        call(device)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(_common._env, "INTERPRET", False)
    with pytest.raises(ValueError, match="a is on the CPU"):
        tkit.add(torch.ones(3), torch.ones(3))


@pytest.mark.gpu
def test_mixed_devices_refused():
    with pytest.raises(ValueError, match="b is on"):
        tkit.add(torch.ones(3, device="cuda"), torch.ones(3))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "broadcast"])
def test_more_than_2_31_elements(layout):
    """Offsets past 2**31 elements: check the tail, where 32-bit math would wrap."""
    n = 2**31 + 4096
    a = torch.randn(n // 4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) if layout == "broadcast"
         else torch.randn_like(a))
    out = tkit.add(a, b)
    for rows in (slice(0, 3), slice(-3, None)):
        torch.testing.assert_close(out[rows], (a[rows].float() + b[rows if b.shape[0] > 1
                                   else slice(None)].float()).bfloat16(), rtol=0, atol=0)
    del out, a, b
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_fp8_cast_matches_torch():
    x = torch.randn(4096, 1000, device="cuda", dtype=torch.bfloat16) * 50
    scale = torch.tensor([0.05], device="cuda")
    got = tkit.cast(x, torch.float8_e4m3fn, scale)
    want = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
