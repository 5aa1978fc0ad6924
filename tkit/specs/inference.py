"""Specs of the inference family: RoPE (tkit/kernels/rope/) and dynamic quantization with its
fused producers (tkit/kernels/quant/).

Bench cases are Llama-3-8B prefill shapes: RoPE in place over 16384 tokens x (32 + 8)
heads x 128 (bf16), RoPE fused with the paged-cache write, quantize_fp8 per token and 1x128,
rms_norm_quant with the residual and silu_mul_quant at 16384 x 4096 / 14336. The baselines are
the references themselves (the same composition) in torch eager and under torch.compile.

Positions, tables, caches and slot mappings travel as keyword arguments: the reference rule
upcasts positional float tensors only, and the case-building test reads positional 1-D integer
tensors as offsets.
"""

from __future__ import annotations

import torch

import tkit
from tkit.kernels import quant as Q
from tkit.kernels import rope as RP
from tkit.registry import (
    Case,
    Cost,
    OpSpec,
    eager_baseline,
    lazy_composite,
    optional_module,
    torch_compile_baseline,
)
from tkit.specs.decode_attention import ref_append_kv
from tkit.testing.tensors import make_tensor

st = optional_module("hypothesis.strategies")
S = optional_module("tkit.testing.strategies")

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
ON_GPU = torch.cuda.is_available()
#: the RoPE bench shape: Llama-3-8B's 32 query and 8 KV heads of 128, 16384 tokens
ROPE_T, ROPE_HQ, ROPE_HK, ROPE_D = 16384, 32, 8, 128


def _wide(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---- references ------------------------------------------------------------------------------
def _rotate(x, positions, cos_sin_cache, is_neox, rotary_dim):
    wide = _wide(x)
    r = rotary_dim or cos_sin_cache.shape[1]
    half = r // 2
    pos = positions.long().clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache.to(wide)[pos]  # lead + (R,)
    cos, sin = cs[..., None, :half], cs[..., None, half:r]
    y = x.to(wide).clone()
    if is_neox:
        a, b = y[..., :half].clone(), y[..., half:r].clone()
        y[..., :half], y[..., half:r] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = y[..., 0:r:2].clone(), y[..., 1:r:2].clone()
        y[..., 0:r:2], y[..., 1:r:2] = a * cos - b * sin, b * cos + a * sin
    return y.to(x.dtype)


def ref_rope(q, k, positions, cos_sin_cache, *, is_neox=True, rotary_dim=None, inplace=False):
    """RoPE in PyTorch (float32 math for low-precision inputs, float64 for float64 ones),
    functional: new tensors whatever ``inplace`` says."""
    return (_rotate(q, positions, cos_sin_cache, is_neox, rotary_dim),
            _rotate(k, positions, cos_sin_cache, is_neox, rotary_dim))


def ref_rope_append_kv(q, k, v, *, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       is_neox=True, rotary_dim=None, k_scale=None, v_scale=None):
    """(q, k rotated, k_cache, v_cache[, k_scale, v_scale]) after the write, functional."""
    qr, kr = ref_rope(q, k, positions, cos_sin_cache, is_neox=is_neox, rotary_dim=rotary_dim)
    (kc, ks), (vc, vs) = ref_append_kv(kr, v, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                       v_scale=v_scale)
    per_token = k_scale is not None and k_scale.ndim > 0
    return (qr, kr, kc, vc) + ((ks, vs) if per_token else ())


def _quantize(v, group_size, kind="fp8", scale_ub=None):
    """(q, scales) of values v (float32 or float64): unrounded clamped quotients for float64
    (the reference), fp8 / int8 for float32 (the same-precision peer and the baselines)."""
    K = v.shape[-1]
    g = group_size or K
    vg = v.reshape(*v.shape[:-1], K // g if g else 0, g)
    amax = torch.where(vg.isnan(), 0.0, vg.abs()).amax(-1, keepdim=True)
    if scale_ub is not None:
        ub = scale_ub if not isinstance(scale_ub, torch.Tensor) else scale_ub.to(v.dtype)
        amax = amax.clamp(max=ub)
    if kind == "fp8":
        s = (amax / Q.FP8_MAX).clamp(min=Q.FP8_MIN_SCALE)
        r = (vg / s).clamp(-Q.FP8_MAX, Q.FP8_MAX)
        q = r if v.dtype == torch.float64 else r.to(FP8)
    else:
        s = torch.where(amax > 0, amax / Q.INT8_MAX, 1.0)
        r = torch.round(vg / s).clamp(-Q.INT8_MAX, Q.INT8_MAX)
        q = r if v.dtype == torch.float64 else r.to(torch.int8)
    return q.reshape(v.shape), s.squeeze(-1).to(v.dtype if v.dtype == torch.float64
                                                 else torch.float32)


def ref_quantize_fp8(x, *, group_size=None, scale_ub=None):
    return _quantize(x.to(_wide(x)), group_size, "fp8", scale_ub)


def ref_quantize_int8(x):
    return _quantize(x.to(_wide(x)), None, "int8")


def ref_rms_norm_quant(x, residual, weight, eps=1e-6, group_size=None):
    """(y, scales, h): h = x + residual in x's dtype, RMSNorm in float32 (float64), quantized."""
    h = x + residual
    hw = h.to(_wide(x))
    v = hw * torch.rsqrt(hw.pow(2).mean(-1, keepdim=True) + eps) * weight.to(hw.dtype)
    return _quantize(v, group_size) + (h,)


def ref_silu_mul_quant(a, b, group_size=None):
    wide = _wide(a)
    return _quantize(torch.nn.functional.silu(a.to(wide)) * b.to(wide), group_size)


def torch_rope_append_kv(q, k, v, *, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                         is_neox=True, rotary_dim=None, k_scale=None, v_scale=None):
    """The composition a PyTorch user writes, for the baselines: RoPE on q and k in place, then
    each cache written with one indexed store of the cached tokens (fp8 caches quantized on
    the way), returning what the op returns. The reference (a loop over tokens, on copies)
    checks; this times."""
    qr, kr = ref_rope(q, k, positions, cos_sin_cache, is_neox=is_neox, rotary_dim=rotary_dim)
    q.copy_(qr)
    k.copy_(kr)
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < k_cache.shape[0] * k_cache.shape[1])
    idx = slots[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        xs = x[keep]
        if cache.dtype == FP8:
            xf = xs.float()
            if scale is None or scale.ndim == 0:
                y = xf / (scale if scale is not None else 1.0)
            else:
                amax = xf.abs().amax(-1)
                sc = torch.where(amax > 0, amax / Q.FP8_MAX, torch.ones_like(amax))
                scale.view(-1, scale.shape[-1])[idx] = sc
                y = xf / sc[..., None]
            flat[idx] = y.clamp(-Q.FP8_MAX, Q.FP8_MAX).to(FP8)
        else:
            flat[idx] = xs.to(cache.dtype)
    per_token = k_scale is not None and k_scale.ndim > 0
    return (q, k, k_cache, v_cache) + ((k_scale, v_scale) if per_token else ())


# ---- spec functions (what is timed and checked) ----------------------------------------------
def rms_norm_quant_residual(x, residual, weight, eps=1e-6, group_size=None):
    """``tkit.rms_norm_quant`` with the residual positional: (y_fp8, scales, h)."""
    return tkit.rms_norm_quant(x, weight, eps, residual=residual, group_size=group_size)


def rope_append_kv_call(q, k, v, *, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                        is_neox=True, rotary_dim=None, k_scale=None, v_scale=None):
    """tkit.rope_append_kv (in place), returning what it wrote: q, k, the caches (and the
    per-token scales). No copies in the timed call; the reference's same-precision peer sees
    q and k already rotated (a looser bound for them; tests/kernels/test_rope.py checks them
    against the float64 reference exactly)."""
    tkit.rope_append_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                        is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale,
                        v_scale=v_scale)
    per_token = k_scale is not None and k_scale.ndim > 0
    return (q, k, k_cache, v_cache) + ((k_scale, v_scale) if per_token else ())


# ---- costs -----------------------------------------------------------------------------------
def cost_rope(q, k, positions=None, cos_sin_cache=None, *, inplace=False, rotary_dim=None,
              **kw):
    return RP.cost(q, k, positions, cos_sin_cache, inplace=inplace, rotary_dim=rotary_dim)


def cost_rope_append_kv(q, k, v, *, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                        rotary_dim=None, k_scale=None, **kw):
    """q's rotary part read and written, k read (all of it, for the cache) and its rotary part
    written, v read, both caches written (+ per-token scales), positions, slots, table rows."""
    d = q.shape[-1]
    r = rotary_dim or cos_sin_cache.shape[1]
    e = q.element_size()
    tq, tk = q.numel() // d, k.numel() // d  # head rows
    nbytes = 2 * tq * r * e + tk * (d + r) * e + v.numel() * e
    nbytes += 2 * tk * d * k_cache.element_size()
    if k_scale is not None and k_scale.ndim:
        nbytes += 2 * tk * 4
    t = positions.numel()
    nbytes += t * (positions.element_size() + 8) + min(t, cos_sin_cache.shape[0]) * r * 4
    return Cost(nbytes, 3 * (tq + tk) * r)


def cost_quantize_fp8(x, *, group_size=None, scale_ub=None):
    return Q.cost(x, group_size=group_size)


def cost_quantize_int8(x):
    return Q.cost(x)


def cost_rms_norm_quant(x, residual, weight, eps=1e-6, group_size=None):
    return Q.cost(x, group_size=group_size, residual=True, weight=weight)


def cost_silu_mul_quant(a, b, group_size=None):
    return Q.cost(a, group_size=group_size, inputs=2)


# ---- inputs ----------------------------------------------------------------------------------
def _positions(lead, max_pos, device, seed=0):
    """Prefill-like positions: each sequence (row of a (batch, seq) shape) counts up from a
    random start; token-major positions are several sequences packed."""
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for s in lead:
        n *= s
    seq = lead[-1] if len(lead) == 2 else max(1, min(n, 97))
    starts = torch.randint(0, max(1, max_pos - seq), (max(1, -(-n // seq)),), generator=gen)
    pos = (starts[:, None] + torch.arange(seq)[None, :]).reshape(-1)[:n] % max_pos
    return pos.reshape(lead).to(device)


def _rope_case(label, t, hq, hk, d, dtype, *, rot=None, neox=True, inplace=False,
               batch=None, layout="contiguous", group="rope", max_pos=None):
    rot = rot or d
    max_pos = max_pos or (2 * t if t <= 4096 else t)

    def make(device):
        lead = (t,) if batch is None else (batch, t // batch)
        if layout == "qkv":  # q and k as views of one fused qkv projection
            qkv = make_tensor(lead + ((hq + 2 * hk) * d,), dtype, seed=1, device=device)
            q = qkv[..., :hq * d].unflatten(-1, (hq, d))
            k = qkv[..., hq * d:(hq + hk) * d].unflatten(-1, (hk, d))
        else:
            q = make_tensor(lead + (hq, d), dtype, layout, seed=1, device=device)
            k = make_tensor(lead + (hk, d), dtype, layout, seed=2, device=device)
        kw = dict(positions=_positions(lead, max_pos, device), is_neox=neox, inplace=inplace,
                  cos_sin_cache=RP.rope_cache(max_pos, rot, device=device))
        return (q, k), kw

    meta = dict(tokens=t, heads_q=hq, heads_kv=hk, head_dim=d, rotary_dim=rot)
    return Case(label, make, group, meta=meta)


def rope_bench_cases():
    T, HQ, HK, D = ROPE_T, ROPE_HQ, ROPE_HK, ROPE_D
    lab = f"{T} tok ({HQ}+{HK})x{D}"
    return [
        _rope_case(f"{lab} neox in place", T, HQ, HK, D, BF16, inplace=True),
        _rope_case(f"{lab} neox", T, HQ, HK, D, BF16),
        _rope_case(f"{lab} gptj in place", T, HQ, HK, D, BF16, neox=False, inplace=True),
        _rope_case(f"{lab} neox in place, views of qkv", T, HQ, HK, D, BF16, inplace=True,
                   layout="qkv", group="strided"),
    ]


def rope_check_cases():
    f16 = torch.float16
    return [
        _rope_case("37 tok (4+2)x64 neox", 37, 4, 2, 64, f16),
        _rope_case("2x9 tok (3+1)x80 gptj rot 32", 18, 3, 1, 80, f16, rot=32, neox=False,
                   batch=2),
        _rope_case("19 tok (4+2)x40 neox rot 24, views of qkv", 19, 4, 2, 40, torch.float32,
                   rot=24, layout="qkv", group="strided"),
    ]


def _rope_append_case(label, t, hq, hk, d, dtype, *, page=16, fp8=None, rot=None, neox=True,
                      max_pos=None):
    rot = rot or d
    max_pos = max_pos or (2 * t if t <= 4096 else t)

    def make(device):
        q = make_tensor((t, hq, d), dtype, seed=1, device=device)
        k = make_tensor((t, hk, d), dtype, seed=2, device=device)
        v = make_tensor((t, hk, d), dtype, seed=3, device=device)
        blocks = -(-t // page) + 2
        cdt = FP8 if fp8 else dtype
        kc = make_tensor((blocks, page, hk, d), cdt, seed=4, device=device)
        vc = make_tensor((blocks, page, hk, d), cdt, seed=5, device=device)
        gen = torch.Generator().manual_seed(t)
        slots = torch.randperm(blocks * page, generator=gen)[:t]
        if t > 1:
            slots[1] = -1  # a token that is rotated but not cached
        kw = dict(positions=_positions((t,), max_pos, device),
                  cos_sin_cache=RP.rope_cache(max_pos, rot, device=device), k_cache=kc,
                  v_cache=vc, slot_mapping=slots.to(device), is_neox=neox)
        if fp8 == "tensor":
            kw.update(k_scale=torch.tensor(0.05, device=device),
                      v_scale=torch.tensor(0.05, device=device))
        elif fp8 == "token":
            kw.update(k_scale=torch.ones((blocks, page, hk), device=device),
                      v_scale=torch.ones((blocks, page, hk), device=device))
        return (q, k, v), kw

    return Case(label, make, "rope_append",
                meta=dict(tokens=t, heads_q=hq, heads_kv=hk, head_dim=d, page=page))


def rope_append_bench_cases():
    T, HQ, HK, D = ROPE_T, ROPE_HQ, ROPE_HK, ROPE_D
    lab = f"{T} tok ({HQ}+{HK})x{D} page16"
    return [_rope_append_case(f"{lab} bf16 cache", T, HQ, HK, D, BF16),
            _rope_append_case(f"{lab} fp8/token cache", T, HQ, HK, D, BF16, fp8="token")]


def rope_append_check_cases():
    f16 = torch.float16
    return [_rope_append_case("37 tok (4+2)x64 page8", 37, 4, 2, 64, f16, page=8),
            _rope_append_case("21 tok (2+1)x48 gptj rot 32 page4 fp8/tensor", 21, 2, 1, 48,
                              torch.float32, page=4, fp8="tensor", rot=32, neox=False)]


def _x_case(label, shape, dtype, kw=None, layout="contiguous", group="quant", seed=1):
    return Case(label, lambda d: ((make_tensor(shape, dtype, layout, seed=seed, device=d),),
                                  dict(kw or {})), group)


def quantize_fp8_bench_cases():
    out = []
    for k in (4096, 14336):
        out += [_x_case(f"16384x{k} per token", (16384, k), BF16),
                _x_case(f"16384x{k} 1x128", (16384, k), BF16, dict(group_size=128))]
    return out


def quantize_fp8_check_cases():
    f16 = torch.float16
    return [_x_case("37x129 per token", (37, 129), f16),
            _x_case("37x256 1x64", (37, 256), f16, dict(group_size=64)),
            _x_case("2x19x96 1x48 transposed", (2, 19, 96), torch.float32,
                    dict(group_size=48), layout="transposed", group="strided"),
            _x_case("37x129 per token scale_ub 1.5", (37, 129), f16, dict(scale_ub=1.5))]


def quantize_int8_bench_cases():
    return [_x_case("16384x4096 per token", (16384, 4096), BF16)]


def quantize_int8_check_cases():
    return [_x_case("37x129 per token", (37, 129), torch.float16),
            _x_case("37x129 sliced", (37, 129), torch.float32, layout="sliced",
                    group="strided")]


def _weight(n, dtype, device):
    return 1.0 + 0.1 * make_tensor((n,), dtype, seed=5, device=device)


def _rms_case(label, shape, dtype, group_size=None, layout="contiguous", group="quant"):
    def make(d):
        x = make_tensor(shape, dtype, layout, seed=1, device=d)
        r = make_tensor(shape, dtype, layout, seed=2, device=d)
        return (x, r, _weight(shape[-1], dtype, d)), dict(group_size=group_size)

    return Case(label, make, group)


def rms_norm_quant_bench_cases():
    return [_rms_case("16384x4096 residual per token", (16384, 4096), BF16),
            _rms_case("16384x4096 residual 1x128", (16384, 4096), BF16, 128)]


def rms_norm_quant_check_cases():
    f16 = torch.float16
    return [_rms_case("37x129 per token", (37, 129), f16),
            _rms_case("37x256 1x64", (37, 256), f16, 64),
            _rms_case("37x96 1x48 sliced", (37, 96), torch.float32, 48, "sliced", "strided")]


def _silu_case(label, shape, dtype, group_size=None, fused=False, group="quant"):
    def make(d):
        if fused:  # [gate | up] of one fused projection, as two row-strided views
            a, b = make_tensor(shape[:-1] + (2 * shape[-1],), dtype, seed=1,
                               device=d).chunk(2, dim=-1)
        else:
            a = make_tensor(shape, dtype, seed=1, device=d)
            b = make_tensor(shape, dtype, seed=2, device=d)
        return (a, b), dict(group_size=group_size)

    return Case(label, make, group)


def silu_mul_quant_bench_cases():
    return [_silu_case("16384x14336 per token", (16384, 14336), BF16),
            _silu_case("16384x14336 1x128", (16384, 14336), BF16, 128),
            _silu_case("16384x14336 1x128 chunked gate|up", (16384, 14336), BF16, 128, True,
                       "strided")]


def silu_mul_quant_check_cases():
    f16 = torch.float16
    return [_silu_case("37x129 per token", (37, 129), f16),
            _silu_case("37x256 1x64 chunked gate|up", (37, 256), f16, 64, True, "strided")]


# ---- fuzz recipes ----------------------------------------------------------------------------
@lazy_composite
def rope_shapes(draw):
    t = draw(st.sampled_from((0, 1, 3, 17)))
    hq = draw(st.sampled_from((1, 3, 4)))
    hk = draw(st.sampled_from((1, 2)))
    d = draw(st.sampled_from((16, 40, 64, 80)))
    batched = draw(st.booleans()) and t > 0
    lead = (2, t) if batched else (t,)
    return lead + (hq, d), lead + (hk, d)


def rope_tables(tensors, dtype, device):
    """positions and a table for fuzzed q, k: the rotary dim follows the head dim (full for
    16 and 64, partial for 40 and 80)."""
    q = tensors[0]
    d = q.shape[-1]
    rot = d if d in (16, 64) else (24 if d == 40 else 32)
    lead = tuple(q.shape[:-2])
    return (_positions(lead, 50, device, seed=sum(lead) + d), RP.rope_cache(50, rot,
                                                                            device=device))


def _fuzz_rope():
    return dict(shapes=rope_shapes(), dtypes=S.FLOAT_DTYPES,
                layouts=("contiguous", "sliced", "offset", "transposed", "permuted"),
                extra_args=rope_tables,
                kwargs=st.fixed_dictionaries({"is_neox": st.booleans()}))


def fuzz_rope_append(q, k, v, positions, cos_sin_cache, k_cache, v_cache, fp8=None):
    """rope_append_kv on copies of q, k and the caches, returning what it wrote."""
    slots = _fuzz_slots(k.shape[0], k_cache.shape[0] * k_cache.shape[1], k.device)
    q, k, kc, vc = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    ks = vs = None
    if fp8:
        kc, vc = kc.float().to(FP8), vc.float().to(FP8)
        ks, vs = _fuzz_scales(kc, fp8)
    tkit.rope_append_kv(q, k, v, positions, cos_sin_cache, kc, vc, slots, k_scale=ks,
                        v_scale=vs)
    return _fuzz_result(q, k, kc, vc, ks, vs, fp8)


def fuzz_rope_append_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, fp8=None):
    slots = _fuzz_slots(k.shape[0], k_cache.shape[0] * k_cache.shape[1], k.device)
    ks = vs = None
    if fp8:
        k_cache = k_cache.float().to(FP8).float()
        v_cache = v_cache.float().to(FP8).float()
        ks, vs = _fuzz_scales(k_cache, fp8)
    out = ref_rope_append_kv(q, k, v, positions=positions, cos_sin_cache=cos_sin_cache,
                             k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
                             k_scale=ks, v_scale=vs)
    qr, kr, kc, vc = out[:4]
    return _fuzz_result(qr, kr, kc, vc, *(out[4:6] if len(out) > 4 else (ks, vs)), fp8)


def _fuzz_slots(tokens, n_slots, device):
    gen = torch.Generator().manual_seed(tokens * 13 + n_slots)
    slots = torch.randperm(n_slots, generator=gen)[:tokens]
    slots = torch.cat([slots, torch.full((max(0, tokens - n_slots),), -1)])
    if tokens > 1:
        slots[1] = -1
    return slots.to(device)


def _fuzz_scales(kc, fp8):
    if fp8 == "tensor":
        return (torch.tensor(0.01, device=kc.device), torch.tensor(0.02, device=kc.device))
    return (torch.ones(kc.shape[:3], device=kc.device),
            torch.ones(kc.shape[:3], device=kc.device))


def _fuzz_result(q, k, kc, vc, ks, vs, fp8):
    out = (q, k)
    if not fp8:
        return out + (kc, vc)
    out += (kc.float(), vc.float())
    return out + ((ks, vs) if fp8 == "token" else ())


@lazy_composite
def rope_append_shapes(draw):
    t = draw(st.sampled_from((0, 1, 5, 16)))
    hq = draw(st.sampled_from((1, 4)))
    hk = draw(st.sampled_from((1, 2)))
    d = draw(st.sampled_from((16, 40, 64)))
    page = draw(st.sampled_from((1, 4, 16)))
    blocks = draw(st.integers(1, 4))
    return ((t, hq, d), (t, hk, d), (t, hk, d), (blocks, page, hk, d), (blocks, page, hk, d))


def fuzz_rope_append_ordered(q, k, v, k_cache, v_cache, positions, cos_sin_cache, fp8=None):
    """fuzz_rope_append with the arguments in the order fuzz draws them (tensors, then
    :func:`rope_tables`)."""
    return fuzz_rope_append(q, k, v, positions, cos_sin_cache, k_cache, v_cache, fp8)


def fuzz_rope_append_ordered_ref(q, k, v, k_cache, v_cache, positions, cos_sin_cache,
                                 fp8=None):
    return fuzz_rope_append_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, fp8)


def _fuzz_rope_append():
    dtypes = (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16, torch.float32)
    return dict(fn=fuzz_rope_append_ordered, reference=fuzz_rope_append_ordered_ref,
                shapes=rope_append_shapes(), dtypes=dtypes, layouts=("contiguous", "sliced"),
                extra_args=rope_tables,
                kwargs=st.fixed_dictionaries({"fp8": st.sampled_from((None, "tensor",
                                                                      "token"))}))


@lazy_composite
def quant_shapes(draw, n_inputs=1, weight=False):
    k = draw(st.sampled_from((48, 96, 240, 480)))  # every group size drawn divides them
    lead = draw(S.shapes(min_dims=0, max_dims=2, max_size=40, max_numel=max(1, 4096 // k)))
    x = tuple(lead) + (k,)
    return (x,) * n_inputs + (((k,),) if weight else ())


def _group_kwargs(extra=None):
    d = {"group_size": st.sampled_from((None, 16, 48))}
    d.update(extra or {})
    return st.fixed_dictionaries(d)


def _fuzz_quantize_fp8():
    return dict(shapes=quant_shapes(), dtypes=S.FLOAT_DTYPES,
                layouts=("contiguous", "sliced", "offset", "transposed"),
                kwargs=_group_kwargs({"scale_ub": st.sampled_from((None, 0.5))}), ulps=_SCALE_ULPS)


def _fuzz_quantize_int8():
    return dict(shapes=quant_shapes(), dtypes=S.FLOAT_DTYPES,
                layouts=("contiguous", "sliced", "offset", "transposed"), ulps=_SCALE_ULPS)


def _fuzz_rms_norm_quant():
    return dict(shapes=quant_shapes(2, weight=True), dtypes=S.FLOAT_DTYPES,
                layouts=("contiguous", "sliced", "offset", "transposed"),
                kwargs=_group_kwargs(), ulps=_SCALE_ULPS)


def _fuzz_silu_mul_quant():
    return dict(shapes=quant_shapes(2), dtypes=S.FLOAT_DTYPES,
                layouts=("contiguous", "sliced", "offset", "transposed"),
                kwargs=_group_kwargs(), ulps=_SCALE_ULPS)


#: comparison floor of the float32 scales, in units of rounding: a scale is amax / 448 (or / 127)
#: of values the kernel derives with the GPU's division, exp and rsqrt (each within 2 ulp),
#: where torch's float32 peer can be exact at the amax element (3 ulp seen: silu_mul_quant,
#: 16384 x 14336)
_SCALE_ULPS = 4.0


# ---- opcheck -----------------------------------------------------------------------------------
def _dev():
    return "cuda" if ON_GPU else "cpu"


def _opcheck_rope(inplace):
    def build():
        dev = _dev()
        q = make_tensor((5, 3, 16), torch.float32, seed=1, device=dev)
        k = make_tensor((5, 1, 16), torch.float32, seed=2, device=dev)
        pos = torch.tensor([0, 3, 7, 1, 2], device=dev)
        cs = RP.rope_cache(8, 8, device=dev)
        op = torch.ops.tkit.rope_ if inplace else torch.ops.tkit.rope
        return op.default, (q, k, pos, cs, True, 8), {}

    return build


def _opcheck_rope_append():
    dev = _dev()
    q = make_tensor((3, 2, 16), torch.float32, seed=1, device=dev)
    k = make_tensor((3, 1, 16), torch.float32, seed=2, device=dev)
    v = make_tensor((3, 1, 16), torch.float32, seed=3, device=dev)
    kc = make_tensor((2, 4, 1, 16), torch.float32, seed=4, device=dev)
    vc = make_tensor((2, 4, 1, 16), torch.float32, seed=5, device=dev)
    pos = torch.tensor([4, 0, 2], device=dev)
    slots = torch.tensor([5, -1, 0], dtype=torch.int64, device=dev)
    return torch.ops.tkit.rope_append_kv.default, (q, k, v, pos, RP.rope_cache(8, 16, device=dev),
                                                   kc, vc, slots, None, None, True, 16), {}


def _opcheck_quant(kind):
    def build():
        dev = _dev()
        x = make_tensor((5, 64), torch.float32, seed=1, device=dev)
        if kind == "fp8":
            return torch.ops.tkit.quantize.default, (x, 32, "fp8", None, None), {}
        if kind == "int8":
            return torch.ops.tkit.quantize.default, (x, 0, "int8", None, None), {}
        if kind == "rms":
            r = make_tensor((5, 64), torch.float32, seed=2, device=dev)
            return torch.ops.tkit.rms_norm_quant.default, (x, _weight(64, torch.float32, dev),
                                                           r, 1e-6, 0), {}
        b = make_tensor((5, 64), torch.float32, seed=2, device=dev)
        return torch.ops.tkit.silu_mul_quant.default, (x, b, 32), {}

    return build


def _baselines(ref):
    return {"torch": eager_baseline(ref), "torch.compile": torch_compile_baseline(ref)}


SPECS = [
    OpSpec(name="rope", family="inference", fn=tkit.rope, reference=ref_rope, cost=cost_rope,
           bench_cases=rope_bench_cases, check_cases=rope_check_cases, fuzz=_fuzz_rope,
           baselines=_baselines(ref_rope), opcheck=_opcheck_rope(False), bound="memory",
           doc="bytes: in place the rotary part of q and k read and written, else all of q and "
               "k; positions and one table row a token. In-place cases: the reference's "
               "same-precision peer sees the rotated q, k (a looser bound; the kernel's output "
               "is still compared with the float64 reference of the original inputs)"),
    OpSpec(name="rope_append_kv", family="inference", fn=rope_append_kv_call,
           reference=ref_rope_append_kv, cost=cost_rope_append_kv,
           bench_cases=rope_append_bench_cases, check_cases=rope_append_check_cases,
           fuzz=_fuzz_rope_append, baselines=_baselines(torch_rope_append_kv),
           opcheck=_opcheck_rope_append, bound="memory",
           doc="fn returns q, k and the caches after tkit.rope_append_kv (in place); bytes: "
               "q's rotary part read and written, k read and its rotary part written, v read, "
               "k and v written to the cache"),
    OpSpec(name="quantize_fp8", family="inference", fn=tkit.quantize_fp8,
           reference=ref_quantize_fp8, cost=cost_quantize_fp8,
           bench_cases=quantize_fp8_bench_cases, check_cases=quantize_fp8_check_cases,
           fuzz=_fuzz_quantize_fp8, baselines=_baselines(ref_quantize_fp8),
           opcheck=_opcheck_quant("fp8"), bound="memory",
           ulps=_SCALE_ULPS),
    OpSpec(name="quantize_int8", family="inference", fn=tkit.quantize_int8,
           reference=ref_quantize_int8, cost=cost_quantize_int8,
           bench_cases=quantize_int8_bench_cases, check_cases=quantize_int8_check_cases,
           fuzz=_fuzz_quantize_int8, baselines=_baselines(ref_quantize_int8),
           opcheck=_opcheck_quant("int8"), bound="memory",
           ulps=_SCALE_ULPS),
    OpSpec(name="rms_norm_quant", family="inference", fn=rms_norm_quant_residual,
           reference=ref_rms_norm_quant, cost=cost_rms_norm_quant,
           bench_cases=rms_norm_quant_bench_cases, check_cases=rms_norm_quant_check_cases,
           fuzz=_fuzz_rms_norm_quant, baselines=_baselines(ref_rms_norm_quant),
           opcheck=_opcheck_quant("rms"), bound="memory",
           ulps=_SCALE_ULPS,
           doc="with the residual: (y_fp8, scales, h)"),
    OpSpec(name="silu_mul_quant", family="inference", fn=tkit.silu_mul_quant,
           reference=ref_silu_mul_quant, cost=cost_silu_mul_quant,
           bench_cases=silu_mul_quant_bench_cases, check_cases=silu_mul_quant_check_cases,
           fuzz=_fuzz_silu_mul_quant, baselines=_baselines(ref_silu_mul_quant),
           opcheck=_opcheck_quant("silu"), bound="memory",
           ulps=_SCALE_ULPS),
]
