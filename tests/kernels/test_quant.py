"""Dynamic quantization (tkit.quantize_fp8, tkit.quantize_int8) and the fused producers
(tkit.rms_norm_quant, tkit.silu_mul_quant): bit for bit against torch given the kernel's scales,
scales against torch's amax, round trips within the format's rounding, the fused ops against
float64 references under the reference rule, rows held in registers and rows walked in chunks,
non-contiguous inputs, odd sizes, NaN, zero rows, scale_ub, errors, registration."""

import pytest
import torch

import tkit
from tkit import registry
from tkit.kernels import _common as C
from tkit.kernels import quant as Q
from tkit.specs import inference as S
from tkit.testing import (
    assert_close_to_reference,
    check_spec,
    fuzz_spec,
    make_tensor,
    opcheck,
    poisoned_outputs,
)

ON_GPU = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NAMES = ["quantize_fp8", "quantize_int8", "rms_norm_quant", "silu_mul_quant"]
#: the interpreter holds whole rows of up to 16384 values; these force the two-walk path
WALKED = dict(max_tile=64, tile=64)


def _rows(shape, walked, least=0):
    """``shape``, with fewer rows when ``walked``: under WALKED a row of 48 elements or more
    is a program of its own (ROWS = 1), so three rows take every path and edge that 37 do, at
    a tenth of the interpreter's time; 37 rows matter where short rows are packed ROWS to a
    program (a partial last block of rows), unwalked. ``least``: rows the test needs."""
    if not walked or len(shape) < 2:
        return shape
    lead = (max(min(shape[0], 3), least),) + tuple(min(d, 2) for d in shape[1:-1])
    return lead + tuple(shape[-1:])


def _dev():
    return "cuda" if ON_GPU else "cpu"


def _groups(t, g):
    K = t.shape[-1]
    return t.reshape(*t.shape[:-1], K // (g or K), g or K)


def _torch_quant(v, scales, g, kind="fp8"):
    """float32 values v quantized by torch with the given (kernel's) scales."""
    r = _groups(v.float(), g) / scales[..., None]
    if kind == "fp8":
        return r.clamp(-448, 448).to(FP8).reshape(v.shape)
    return torch.round(r).clamp(-127, 127).to(torch.int8).reshape(v.shape)


def _torch_scales(v, g, kind="fp8", ub=None):
    vg = _groups(v.float(), g)
    amax = torch.where(vg.isnan(), 0.0, vg.abs()).amax(-1)
    if ub is not None:
        amax = amax.clamp(max=ub)
    if kind == "fp8":
        return (amax / 448).clamp(min=Q.FP8_MIN_SCALE)
    return torch.where(amax > 0, amax / 127, 1.0)


def _dequant(q, s, g):
    return (_groups(q.double(), g) * s.double()[..., None]).reshape(q.shape)


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- registry: check cases and fuzzing ---------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_check_cases(name):
    assert check_spec(name) > 0


@pytest.mark.parametrize("name", NAMES)
def test_fuzz(name):
    fuzz_spec(name, max_examples=None if ON_GPU else 12)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name):
    op, args, kwargs = registry.get(name).opcheck()
    opcheck(op, args, kwargs)


# ---- quantize_fp8 / quantize_int8 --------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,g", [((37, 129), None), ((37, 256), 64), ((5, 7, 96), 48),
                                     ((3, 1), None), ((1, 48), 16), ((0, 64), 32)])
@pytest.mark.parametrize("walked", [False, True])
def test_quantize_fp8_bits(dtype, shape, g, walked):
    shape = _rows(shape, walked)
    x = make_tensor(shape, dtype, seed=1, device=_dev()) * 3
    with Q.quant_config(**(WALKED if walked else {})), poisoned_outputs():
        q, s = tkit.quantize_fp8(x, group_size=g)
    assert q.dtype == FP8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == shape[:-1] + (shape[-1] // (g or shape[-1]),)
    assert torch.equal(s, _torch_scales(x, g))
    assert _same_bits(q, _torch_quant(x, s, g))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "offset", "permuted"])
def test_quantize_non_contiguous(layout):
    x = make_tensor((6, 9, 64), torch.float16, layout, seed=2, device=_dev())
    for g in (None, 16):
        q, s = tkit.quantize_fp8(x, group_size=g)
        assert torch.equal(s, _torch_scales(x, g)) and _same_bits(q, _torch_quant(x, s, g))
    q, s = tkit.quantize_int8(x)
    assert torch.equal(s, _torch_scales(x, None, "int8"))
    assert torch.equal(q, _torch_quant(x, s, None, "int8"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("walked", [False, True])
def test_quantize_int8_bits(dtype, walked):
    shape = _rows((37, 200), walked, least=6)
    x = make_tensor(shape, dtype, seed=3, device=_dev())
    x[4] = 0.0  # an all-zero row: scale 1, zeros
    with Q.quant_config(**(WALKED if walked else {})), poisoned_outputs():
        q, s = tkit.quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (shape[0], 1)
    assert torch.equal(s, _torch_scales(x, None, "int8"))
    assert torch.equal(q, _torch_quant(x, s, None, "int8"))
    assert s[4].item() == 1.0 and not q[4].any()
    assert q.abs().max().item() == 127


@pytest.mark.parametrize("g", [None, 32])
def test_round_trips_within_the_formats_rounding(g):
    x = make_tensor((41, 256), torch.float32, seed=4, device=_dev()) * 10
    x[:, 5] *= 1e-4  # tiny values: the fp8 subnormal range relative to the scale
    q, s = tkit.quantize_fp8(x, group_size=g)
    y = _groups(x.double(), g) / s.double()[..., None]  # what was rounded, |y| <= 448
    # e4m3: 3 mantissa bits, so a rounding moves y by at most 2**(e - 4), e = floor(log2|y|),
    # and by at most 2**-10 among the subnormals (below 2**-6)
    e = torch.floor(torch.log2(y.abs().clamp(min=2.0**-6)))
    bound = (2.0 ** (e - 4)) * s.double()[..., None]
    err = (_dequant(q, s, g) - x.double()).abs()
    assert (_groups(err, g) <= bound * (1 + 1e-9)).all()
    assert _groups(q.float().abs(), g).amax(-1).eq(448).all()  # every row/group reaches 448
    qi, si = tkit.quantize_int8(x)
    err = (qi.double() * si.double() - x.double()).abs()
    assert (err <= si.double() / 2 * (1 + 1e-6)).all()


def test_nan_stays_nan_and_leaves_the_rest_alone():
    x = make_tensor((6, 64), torch.float16, seed=5, device=_dev())
    x[1, 3] = float("nan")
    x[4, 40] = float("nan")
    for g in (None, 16):
        q, s = tkit.quantize_fp8(x, group_size=g)
        assert torch.equal(q.float().isnan(), x.isnan())
        assert torch.isfinite(s).all()
        assert torch.equal(s, _torch_scales(x, g))
        ok = ~x.isnan()
        assert _same_bits(q[ok], _torch_quant(x, s, g)[ok])


def test_zero_rows_and_scale_ub():
    x = make_tensor((4, 64), torch.float32, seed=6, device=_dev())
    x[2] = 0.0
    q, s = tkit.quantize_fp8(x)
    assert s[2].item() == pytest.approx(Q.FP8_MIN_SCALE) and not q[2].float().any()
    for ub in (0.5, torch.tensor([0.5], device=_dev())):
        q, s = tkit.quantize_fp8(x, scale_ub=ub, group_size=32)
        assert torch.equal(s, _torch_scales(x, 32, ub=0.5))
        assert _same_bits(q, _torch_quant(x, s, 32))
        big = x.abs() > 0.5
        assert (q.float().abs()[big] == 448).all()  # saturated past the bound


def test_int64_offsets_same_bits(monkeypatch):
    x = make_tensor((9, 96), torch.float16, seed=7, device=_dev())
    want = tkit.quantize_fp8(x, group_size=32)
    r = make_tensor((9, 96), torch.float16, seed=8, device=_dev())
    w = S._weight(96, torch.float16, _dev())
    want_rms = tkit.rms_norm_quant(x, w, 1e-6, residual=r)
    monkeypatch.setattr(C, "needs_int64", lambda *t: True)
    got = tkit.quantize_fp8(x, group_size=32)
    assert _same_bits(got[0], want[0]) and torch.equal(got[1], want[1])
    got = tkit.rms_norm_quant(x, w, 1e-6, residual=r)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, want_rms))


# ---- fused producers ---------------------------------------------------------------------------
def _check_fused(y, s, g, v64, v_peer):
    """Dequantized y against the float64 values v64, with the peer's error: torch quantizing
    its own same-precision values v_peer (float32 math)."""
    qp, sp = S._quantize(v_peer.float(), g)
    # the kernel's arithmetic is float32: a floor of one float32 unit at the largest value (the
    # dequantized values are compared in float64, whose own unit would demand exact scales)
    assert_close_to_reference(_dequant(y, s, g), v64, _dequant(qp, sp, g).to(torch.float64),
                              floor=2.0**-23 * float(v64.abs().max()) if v64.numel() else 0.0,
                              name="dequantized y")
    # the scales: amax of the float64 values / 448, within float32 math of the peer
    assert_close_to_reference(s, S._quantize(v64, g)[1], sp, name="scales")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,g", [((37, 129), None), ((37, 256), 64), ((2, 5, 96), 48),
                                     ((3, 1), None), ((0, 32), None)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("walked", [False, True])
def test_rms_norm_quant_against_float64(dtype, shape, g, residual, walked):
    shape = _rows(shape, walked)
    x = make_tensor(shape, dtype, seed=1, device=_dev())
    r = make_tensor(shape, dtype, seed=2, device=_dev()) if residual else None
    w = S._weight(shape[-1], dtype, _dev())
    with Q.quant_config(**(WALKED if walked else {})), poisoned_outputs():
        out = tkit.rms_norm_quant(x, w, 1e-6, residual=r, group_size=g)
    assert len(out) == (3 if residual else 2)
    y, s = out[:2]
    h = x if r is None else x + r
    if residual:
        assert torch.equal(out[2], h)  # x + residual rounded once to x's dtype
    hd = h.double()
    v64 = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    hf = h.float()
    v32 = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    _check_fused(y, s, g, v64, v32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,g", [((37, 129), None), ((37, 256), 64), ((4, 3, 96), 48)])
@pytest.mark.parametrize("walked", [False, True])
@pytest.mark.parametrize("fused_views", [False, True])
def test_silu_mul_quant_against_float64(dtype, shape, g, walked, fused_views):
    shape = _rows(shape, walked)
    if fused_views:
        a, b = make_tensor(shape[:-1] + (2 * shape[-1],), dtype, seed=1,
                           device=_dev()).chunk(2, -1)
    else:
        a = make_tensor(shape, dtype, seed=1, device=_dev())
        b = make_tensor(shape, dtype, "transposed", seed=2, device=_dev())
    with Q.quant_config(**(WALKED if walked else {})), poisoned_outputs():
        y, s = tkit.silu_mul_quant(a, b, group_size=g)
    v64 = torch.nn.functional.silu(a.double()) * b.double()
    v32 = torch.nn.functional.silu(a.float()) * b.float()
    _check_fused(y, s, g, v64, v32)


def test_walked_and_single_paths_agree():
    """Rows walked in chunks give the single-tile result (the same scales: amax is exact;
    the RMSNorm sum of squares may differ in its last bit)."""
    x = make_tensor((7, 1000), torch.float16, seed=3, device=_dev())
    b = make_tensor((7, 1000), torch.float16, seed=4, device=_dev())
    for g in (None, 40):
        one = tkit.silu_mul_quant(x, b, group_size=g)
        with Q.quant_config(max_tile=128, tile=128):
            walked = tkit.silu_mul_quant(x, b, group_size=g)
        assert torch.equal(one[1], walked[1]) and _same_bits(one[0], walked[0])


# ---- errors ------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    dev = _dev()
    x = make_tensor((4, 96), torch.float16, seed=1, device=dev)
    w = S._weight(96, torch.float16, dev)
    with pytest.raises(ValueError, match="group_size 64 does not divide the last dimension"):
        tkit.quantize_fp8(x, group_size=64)
    with pytest.raises(ValueError, match="group_size must be positive"):
        tkit.quantize_fp8(x, group_size=0)
    with pytest.raises(TypeError, match="group_size must be an int"):
        tkit.quantize_fp8(x, group_size=32.0)
    with pytest.raises(ValueError, match="scale_ub must be positive"):
        tkit.quantize_fp8(x, scale_ub=-1.0)
    with pytest.raises(ValueError, match="scale_ub must hold one element"):
        tkit.quantize_fp8(x, scale_ub=torch.ones(2, device=dev))
    with pytest.raises(TypeError, match="x has dtype int32"):
        tkit.quantize_int8(x.int())
    with pytest.raises(ValueError, match="group_size 50 does not divide"):
        tkit.rms_norm_quant(x, w, 1e-6, group_size=50)
    with pytest.raises(ValueError, match="weight must have shape"):
        tkit.rms_norm_quant(x, w[:50])
    with pytest.raises(ValueError, match="residual must have x's shape"):
        tkit.rms_norm_quant(x, w, residual=x[:2])
    with pytest.raises(ValueError, match="a and b must have the same shape"):
        tkit.silu_mul_quant(x, x[:2])
    with pytest.raises(TypeError, match="b has dtype"):
        tkit.silu_mul_quant(x, x.float())
    with pytest.raises(ValueError, match="group_size 7 does not divide"):
        tkit.silu_mul_quant(x, x, group_size=7)


def test_direct_and_dispatched_paths_agree(monkeypatch):
    x = make_tensor((5, 64), torch.float16, seed=1, device=_dev())
    r = make_tensor((5, 64), torch.float16, seed=2, device=_dev())
    w = S._weight(64, torch.float16, _dev())
    calls = [lambda: tkit.quantize_fp8(x, group_size=16), lambda: tkit.quantize_int8(x),
             lambda: tkit.rms_norm_quant(x, w, residual=r, group_size=32),
             lambda: tkit.rms_norm_quant(x, w), lambda: tkit.silu_mul_quant(x, r)]
    want = [c() for c in calls]
    monkeypatch.setattr(C, "use_direct_path", lambda *t: False)
    for c, wnt in zip(calls, want):
        got = c()
        assert len(got) == len(wnt)
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, wnt))
