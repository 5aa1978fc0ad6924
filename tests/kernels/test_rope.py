"""RoPE (tkit.rope, tkit.rope_append_kv, tkit.rope_cache): against the float64 reference under the
reference rule, neox and GPT-J, partial rotary, in place and not, (tokens, ...) and (batch, seq,
...) layouts, non-contiguous views, odd sizes, positions out of range (clamped in-kernel, an error
where checked), the fused cache write in bf16/fp16/fp8 caches equal to rope + append_kv, the
llama3 and YaRN tables computed by hand from HF's formulas, errors, registration."""

import math

import pytest
import torch

import tkit
from tkit import registry
from tkit.kernels import _common as C
from tkit.kernels import rope as RP
from tkit.specs import decode_attention as DS
from tkit.specs import inference as S
from tkit.testing import (
    assert_close_to_reference,
    check_against_reference,
    fuzz,
    make_tensor,
    opcheck,
    poisoned_outputs,
)

ON_GPU = torch.cuda.is_available()
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn


def _dev():
    return "cuda" if ON_GPU else "cpu"


def _qk(lead, hq, hk, d, dtype, layout="contiguous"):
    q = make_tensor(lead + (hq, d), dtype, layout, seed=1, device=_dev())
    k = make_tensor(lead + (hk, d), dtype, layout, seed=2, device=_dev())
    return q, k


def _check(q, k, pos, cs, out, *, is_neox, rot=None):
    """out = (q', k') against the float64 reference (peer: torch in q's dtype)."""
    refs = S.ref_rope(q.double(), k.double(), pos, cs, is_neox=is_neox, rotary_dim=rot)
    peers = S.ref_rope(q, k, pos, cs, is_neox=is_neox, rotary_dim=rot)
    for name, o, r, p in zip("qk", out, refs, peers):
        assert_close_to_reference(o, r, p, name=name)


# ---- registry: check cases and fuzzing ---------------------------------------------------------
@pytest.mark.parametrize("name", ["rope", "rope_append_kv"])
def test_check_cases(name):
    spec = registry.get(name)
    for case in spec.check_cases():
        args, kwargs = case.make(_dev())
        check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)


@pytest.mark.parametrize("name", ["rope", "rope_append_kv"])
def test_fuzz(name):
    recipe = dict(registry.get(name).fuzz())
    fn, ref = recipe.pop("fn", registry.get(name).fn), recipe.pop("reference",
                                                                  registry.get(name).reference)
    fuzz(fn, ref, **recipe, max_examples=None if ON_GPU else 12)


# ---- rope --------------------------------------------------------------------------------------
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("d,rot", [(64, 64), (80, 32), (40, 24), (16, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_against_float64(is_neox, d, rot, dtype):
    q, k = _qk((29,), 5, 3, d, dtype)
    pos = S._positions((29,), 61, _dev())
    cs = tkit.rope_cache(61, rot, device=_dev())
    with poisoned_outputs():
        out = tkit.rope(q, k, pos, cs, is_neox=is_neox)
    assert out[0].is_contiguous() and out[1].is_contiguous()
    _check(q, k, pos, cs, out, is_neox=is_neox)
    # the part past the rotary dim is copied bit for bit
    assert torch.equal(out[0][..., rot:], q[..., rot:])
    assert torch.equal(out[1][..., rot:], k[..., rot:])


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [32, 20])
def test_rope_in_place(is_neox, rot):
    q, k = _qk((3, 7), 4, 2, 32, torch.float16)  # (batch, seq, heads, dim)
    pos = S._positions((3, 7), 40, _dev())
    cs = tkit.rope_cache(40, rot, device=_dev())
    want = tkit.rope(q, k, pos, cs, is_neox=is_neox)
    q0, k0 = q.clone(), k.clone()
    got = tkit.rope(q, k, pos, cs, is_neox=is_neox, inplace=True)
    assert got[0] is q and got[1] is k
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    assert torch.equal(q[..., rot:], q0[..., rot:])  # untouched
    _check(q0, k0, pos, cs, (q, k), is_neox=is_neox)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "offset", "permuted"])
def test_rope_non_contiguous(layout):
    q, k = _qk((2, 11), 3, 2, 48, torch.float32, layout)
    pos = S._positions((2, 11), 30, _dev())
    cs = tkit.rope_cache(30, 48, device=_dev())
    for is_neox in (True, False):
        _check(q, k, pos, cs, tkit.rope(q, k, pos, cs, is_neox=is_neox), is_neox=is_neox)
    # in place on views of one fused qkv projection (q, k and v interleaved per token)
    qkv = make_tensor((13, (4 + 2 + 2) * 32), torch.float16, seed=3, device=_dev())
    q = qkv[:, :128].unflatten(-1, (4, 32))
    k = qkv[:, 128:192].unflatten(-1, (2, 32))
    v0 = qkv[:, 192:].clone()
    q0, k0 = q.clone(), k.clone()
    pos = S._positions((13,), 30, _dev())
    cs = tkit.rope_cache(30, 16, device=_dev())
    tkit.rope(q, k, pos, cs, inplace=True)
    _check(q0, k0, pos, cs, (q, k), is_neox=True)
    assert torch.equal(qkv[:, 192:], v0)


@pytest.mark.parametrize("lead", [(0,), (1,), (1, 1), (3, 0)])
def test_rope_tiny_and_empty(lead):
    q, k = _qk(lead, 1, 1, 8, torch.float16)
    pos = torch.zeros(lead, dtype=torch.int32, device=_dev()) + 2
    cs = tkit.rope_cache(4, 8, device=_dev())
    out = tkit.rope(q, k, pos, cs)
    _check(q, k, pos, cs, out, is_neox=True)


def _same_values(got, want):
    tol = dict(rtol=0, atol=0) if _dev() == "cpu" else dict(rtol=2.0**-9, atol=2.0**-24)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


def test_rope_int64_offsets_and_config_override(monkeypatch):
    """The INT64 path and a config with several head tiles and token blocks a program give
    the default's values: the same bits in the interpreter, within one rounding on the GPU
    (the compiler contracts a * cos - b * sin into an FMA as each tiling's code allows)."""
    q, k = _qk((23,), 5, 3, 40, torch.float16)
    pos = S._positions((23,), 50, _dev())
    cs = tkit.rope_cache(50, 24, device=_dev())
    want = tkit.rope(q, k, pos, cs, is_neox=False)
    with RP.rope_config(block_t=4, block_h=2):
        got = tkit.rope(q, k, pos, cs, is_neox=False)
    _same_values(got, want)
    monkeypatch.setattr(C, "needs_int64", lambda *t: True)
    got = tkit.rope(q, k, pos, cs, is_neox=False)
    _same_values(got, want)
    with pytest.raises(TypeError, match="block_x"):
        with RP.rope_config(block_x=1):
            pass


def test_rope_config_is_validated():
    for bad in (dict(block_t=3), dict(block_h=0), dict(num_warps=True), dict(block_t=2.0)):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"RopeConfig.{name} must be a power of 2"):
            RP.RopeConfig(**bad)
        with pytest.raises(ValueError, match=f"RopeConfig.{name} must be a power of 2"):
            with RP.rope_config(**bad):
                tkit.rope(*_qk((3,), 1, 1, 8, torch.float16),
                          torch.zeros(3, dtype=torch.int64, device=_dev()),
                          tkit.rope_cache(4, 8, device=_dev()))


def test_positions_out_of_range_are_clamped_and_checked(full_checks):
    q, k = _qk((6,), 2, 1, 16, torch.float32)
    cs = tkit.rope_cache(10, 16, device=_dev())
    bad = torch.tensor([0, 3, -5, 10, 1000, 9], device=_dev())
    with pytest.raises(ValueError, match=r"positions\[2\] = -5"):
        tkit.rope(q, k, bad, cs)
    with pytest.raises(ValueError, match=r"positions\[4\] = 1000"):
        tkit.rope(q, k, bad.clamp(min=0), cs)
    # the op itself (no validation) reads the clamped rows, never outside the table
    got = torch.ops.tkit.rope(q, k, bad, cs, True, 16)
    _check(q, k, bad.clamp(0, 9), cs, got, is_neox=True)


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=lambda q: q[0]), ValueError, "q must be"),
    (dict(k=lambda k: k[..., :8]), ValueError, "k must be q's shape"),
    (dict(k=lambda k: k.half()), TypeError, "k has dtype"),
    (dict(q=lambda q: q.long(), k=lambda k: k.long()), TypeError, "q has dtype"),
    (dict(pos=lambda p: p[:3]), ValueError, "positions must have"),
    (dict(pos=lambda p: p.float()), TypeError, "positions has dtype"),
    (dict(cs=lambda c: c[:, :6], rot=8), ValueError, "cos_sin_cache must be"),
    (dict(cs=lambda c: c[0]), ValueError, "cos_sin_cache must have 2"),
    (dict(rot=7), ValueError, "rotary_dim must be even"),
    (dict(rot=32), ValueError, "rotary_dim must be even and in"),
    (dict(rot=4), ValueError, "cos_sin_cache must be"),
])
def test_rope_errors_name_the_argument(change, exc, match):
    q, k = _qk((5,), 2, 1, 16, torch.float32)
    pos = torch.arange(5, device=_dev())
    cs = tkit.rope_cache(8, 8, device=_dev())
    q = change.get("q", lambda t: t)(q)
    k = change.get("k", lambda t: t)(k)
    pos = change.get("pos", lambda t: t)(pos)
    cs = change.get("cs", lambda t: t)(cs)
    with pytest.raises(exc, match=match):
        tkit.rope(q, k, pos, cs, rotary_dim=change.get("rot"))


@pytest.mark.parametrize("name", ["rope", "rope_inplace", "rope_append_kv"])
def test_opcheck(name):
    if name == "rope_inplace":
        op, args, kwargs = S._opcheck_rope(True)()
    else:
        op, args, kwargs = registry.get(name).opcheck()
    opcheck(op, args, kwargs)


def test_direct_and_dispatched_paths_agree(monkeypatch):
    q, k = _qk((9,), 3, 1, 32, torch.float16)
    pos = S._positions((9,), 20, _dev())
    cs = tkit.rope_cache(20, 32, device=_dev())
    want = tkit.rope(q, k, pos, cs)
    monkeypatch.setattr(C, "use_direct_path", lambda *t: False)
    got = tkit.rope(q, k, pos, cs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q2, k2 = q.clone(), k.clone()
    tkit.rope(q2, k2, pos, cs, inplace=True)
    assert torch.equal(q2, want[0]) and torch.equal(k2, want[1])


# ---- rope_append_kv ----------------------------------------------------------------------------
def _append_inputs(t, hq, hk, d, dtype, page, blocks, rot, fp8=None, seed=0):
    dev = _dev()
    q = make_tensor((t, hq, d), dtype, seed=seed + 1, device=dev)
    k = make_tensor((t, hk, d), dtype, seed=seed + 2, device=dev)
    v = make_tensor((t, hk, d), dtype, seed=seed + 3, device=dev)
    cdt = FP8 if fp8 else dtype
    kc = make_tensor((blocks, page, hk, d), torch.float32, seed=seed + 4, device=dev).to(cdt)
    vc = make_tensor((blocks, page, hk, d), torch.float32, seed=seed + 5, device=dev).to(cdt)
    gen = torch.Generator().manual_seed(seed + t)
    slots = torch.randperm(blocks * page, generator=gen)[:t]
    slots[1] = -1
    slots[3] = blocks * page + 5  # outside the cache: skipped (the op itself, unchecked)
    pos = S._positions((t,), 64, dev, seed)
    cs = tkit.rope_cache(64, rot, device=dev)
    ks = vs = None
    if fp8 == "tensor":
        ks, vs = torch.tensor(0.02, device=dev), torch.tensor(0.03, device=dev)
    elif fp8 == "token":
        ks = torch.full((blocks, page, hk), -1.0, device=dev)
        vs = torch.full((blocks, page, hk), -1.0, device=dev)
    return q, k, v, pos, cs, kc, vc, slots.to(dev), ks, vs


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("fp8", [None, "tensor", "token"])
@pytest.mark.parametrize("dtype,d,rot", [(torch.float16, 64, 64), (torch.float32, 48, 32),
                                         (torch.bfloat16, 40, 24)])
def test_rope_append_equals_rope_then_append_kv(is_neox, fp8, dtype, d, rot):
    """The fused op writes what rope(in place) + append_kv write: bit for bit for 16-bit caches
    and fp32 inputs (one rounding of the same float32 value); for 16-bit inputs into fp8 caches
    the unfused path rounds k to 16 bits first, so those are checked against the float64
    reference instead."""
    args = _append_inputs(19, 4, 2, d, dtype, 4, 8, rot, fp8)
    q, k, v, pos, cs, kc, vc, slots, ks, vs = args
    q1, k1, kc1, vc1 = q.clone(), k.clone(), kc.clone(), vc.clone()
    ks1 = ks.clone() if ks is not None and ks.ndim else ks
    vs1 = vs.clone() if vs is not None and vs.ndim else vs
    q0, k0 = q.clone(), k.clone()
    torch.ops.tkit.rope_append_kv(q, k, v, pos, cs, kc, vc, slots, ks, vs, is_neox, rot)
    tkit.rope(q1, k1, pos, cs, is_neox=is_neox, inplace=True)
    torch.ops.tkit.append_kv(k1, v, kc1, vc1, slots, ks1, vs1)
    assert torch.equal(q, q1) and torch.equal(k, k1)
    _check(q0, k0, pos, cs, (q, k), is_neox=is_neox)
    assert torch.equal(vc.float(), vc1.float())
    if fp8 is None or dtype == torch.float32:
        assert torch.equal(kc.view(torch.uint8), kc1.view(torch.uint8))
        if fp8 == "token":
            assert torch.equal(ks, ks1) and torch.equal(vs, vs1)
    else:
        kr = S.ref_rope(q0.double(), k0.double(), pos, cs, is_neox=is_neox)[1]
        (rk, rks), _ = DS.ref_append_kv(kr, v.double(), kc1.float(), vc1.float(), slots,
                                        k_scale=ks1, v_scale=vs1)
        # one fp8 rounding of a value within float32 of the reference: at most one fp8 step
        diff = (kc.float() - rk.float()).abs()
        assert diff.max() <= 32.0 and (diff > 0).float().mean() < 0.05
        if fp8 == "token":
            torch.testing.assert_close(ks, rks.float(), rtol=1e-6, atol=0)


def test_rope_append_checks_slots_and_shapes(full_checks):
    q, k, v, pos, cs, kc, vc, slots, ks, vs = _append_inputs(7, 2, 1, 16, torch.float32, 4, 3,
                                                             16)
    with pytest.raises(ValueError, match=r"slot_mapping\[3\]"):
        tkit.rope_append_kv(q, k, v, pos, cs, kc, vc, slots)
    slots[3] = -1
    with pytest.raises(ValueError, match="q must be \\(tokens"):
        tkit.rope_append_kv(q[None], k[None], v, pos[None], cs, kc, vc, slots)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        tkit.rope_append_kv(q, k, v[:, :, :8], pos, cs, kc, vc, slots)
    with pytest.raises(ValueError, match="k_scale is given"):
        tkit.rope_append_kv(q, k, v, pos, cs, kc, vc, slots,
                            k_scale=torch.tensor(1.0, device=_dev()))
    out = tkit.rope_append_kv(q, k, v, pos, cs, kc, vc, slots)
    assert out[0] is q and out[1] is k


# ---- rope_cache --------------------------------------------------------------------------------
def _hf_inv_freq_default(dim, base):
    return [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]


def test_rope_cache_default_and_linear():
    cs = tkit.rope_cache(100, 16, 10000.0)
    assert cs.shape == (100, 16) and cs.dtype == torch.float32
    inv = _hf_inv_freq_default(16, 10000.0)
    for p in (0, 1, 37, 99):
        for i in (0, 3, 7):
            assert cs[p, i].item() == pytest.approx(math.cos(p * inv[i]), abs=1e-7)
            assert cs[p, 8 + i].item() == pytest.approx(math.sin(p * inv[i]), abs=1e-7)
    lin = tkit.rope_cache(100, 16, 10000.0, {"rope_type": "linear", "factor": 4.0})
    assert torch.allclose(lin[40], cs[10], atol=1e-7)  # position 40 / 4


def test_rope_cache_llama3_by_hand():
    """Llama 3.1's rope_scaling (factor 8, low 1, high 4, original 8192, theta 500000, dim
    128), following HF's _compute_llama3_parameters step by step in plain Python."""
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv, attn = RP._inv_freq(128, 500000.0, sc, 131072)
    assert attn == 1.0
    want = []
    for f in _hf_inv_freq_default(128, 500000.0):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:  # high frequency: kept
            want.append(f)
        elif wavelen > 8192 / 1:  # low frequency: divided by the factor
            want.append(f / 8)
        else:  # in between: smoothed
            s = (8192 / wavelen - 1) / (4 - 1)
            want.append((1 - s) * f / 8 + s * f)
    assert inv.tolist() == pytest.approx(want, rel=1e-12)
    # spot values: i=0 unchanged (1.0), the last divided by 8, and some smoothed in between
    assert inv[0].item() == 1.0
    assert inv[-1].item() == pytest.approx(500000.0 ** (-126 / 128) / 8, rel=1e-12)
    kept = sum(a == b for a, b in zip(inv.tolist(), _hf_inv_freq_default(128, 500000.0)))
    assert 0 < kept < 64
    cs = tkit.rope_cache(64, 128, 500000.0, sc)
    assert cs[63, 127].item() == pytest.approx(math.sin(63 * want[63]), abs=1e-7)


def test_rope_cache_yarn_by_hand():
    """YaRN (factor 4, original 4096, beta 32/1, theta 10000, dim 64): HF's
    _compute_yarn_parameters in plain Python, and the attention factor on cos and sin."""
    dim, base, factor, orig = 64, 10000.0, 4.0, 4096
    sc = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    inv, attn = RP._inv_freq(dim, base, sc, 16384)
    assert attn == pytest.approx(0.1 * math.log(factor) + 1.0)

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), dim - 1)
    want = []
    for i, f in enumerate(_hf_inv_freq_default(dim, base)):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        extra = 1 - ramp
        want.append(f / factor * (1 - extra) + f * extra)
    assert inv.tolist() == pytest.approx(want, rel=1e-12)
    assert inv[0].item() == 1.0 and inv[-1].item() == pytest.approx(
        _hf_inv_freq_default(dim, base)[-1] / factor)
    cs = tkit.rope_cache(32, dim, base, sc)
    assert (cs[:, :32] ** 2 + cs[:, 32:] ** 2).sqrt().sub(attn).abs().max() < 1e-6
    # DeepSeek-style mscale / mscale_all_dim: their ratio
    ds = dict(sc, mscale=1.0, mscale_all_dim=0.5)
    _, attn2 = RP._inv_freq(dim, base, ds, 16384)
    assert attn2 == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))


def test_rope_cache_errors():
    with pytest.raises(ValueError, match="rotary_dim"):
        tkit.rope_cache(10, 7)
    with pytest.raises(ValueError, match="max_position"):
        tkit.rope_cache(0, 8)
    with pytest.raises(ValueError, match="low_freq_factor"):
        tkit.rope_cache(10, 8, scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="not supported"):
        tkit.rope_cache(10, 8, scaling={"rope_type": "longrope"})
