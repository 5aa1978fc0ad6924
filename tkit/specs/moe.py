"""Specs of the mixture-of-experts family (tkit/kernels/moe/): the router's top-k, the combine,
and the whole MoE SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import tkit
from tkit.kernels import moe as MOE
from tkit.registry import (
    Case,
    OpSpec,
    eager_baseline,
    lazy_composite,
    optional_module,
    torch_compile_baseline,
)
from tkit.testing.tensors import make_tensor

st = optional_module("hypothesis.strategies")
BF16 = torch.bfloat16
ON_GPU = torch.cuda.is_available()

#: (experts, top_k, hidden, intermediate) of the models the benchmarks take
MIXTRAL_8X7B = (8, 2, 4096, 14336)
QWEN3_30B_A3B = (128, 8, 2048, 768)


def _wide(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---- references --------------------------------------------------------------------------------
def ref_moe_route(router_logits, top_k, *, renormalize=True, scoring="softmax"):
    """torch: scores in float32 (float64 for float64 logits), the top_k by a stable sort (ties
    to the lower index, as the kernel breaks them), the division."""
    z = router_logits.to(_wide(router_logits))
    s = torch.sigmoid(z) if scoring == "sigmoid" else torch.softmax(z, -1)
    w, ids = torch.sort(s, dim=-1, descending=True, stable=True)
    w, ids = w[:, :top_k], ids[:, :top_k]
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(torch.int32)


def ref_moe_combine(y, weights, inv):
    wide = _wide(y)
    rows = inv.long().clamp(0, y.shape[0] - 1)
    return (y.to(wide)[rows] * weights.to(wide)[..., None]).sum(1).to(y.dtype)


def ref_moe(x, router_logits, w_gate_up, w_down, top_k, *, renormalize=True,
            scoring="softmax"):
    """A loop over the experts (transformers' Mixtral block), each on its tokens' rows: in
    float64 for the reference; in x's dtype with float32 routing for the peer."""
    w, ids = ref_moe_route(router_logits, top_k, renormalize=renormalize, scoring=scoring)
    i = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=_wide(x), device=x.device)
    for e in range(w_gate_up.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = F.linear(x[tok], w_gate_up[e])
        y = F.linear(F.silu(gu[:, :i]) * gu[:, i:], w_down[e])
        out.index_add_(0, tok, y.to(out.dtype) * w[tok, slot, None].to(out.dtype))
    return out.to(x.dtype)


def torch_grouped_moe(x, router_logits, w_gate_up, w_down, top_k, *, renormalize=True,
                      scoring="softmax"):
    """The same pipeline in torch ops without a host sync: the route in torch, a stable sort,
    ``torch._grouped_mm`` for the experts' GEMMs (bf16 on sm_90), a gather-and-sum combine."""
    w, ids = ref_moe_route(router_logits, top_k, renormalize=renormalize, scoring=scoring)
    order, inv, offsets = MOE.moe_align(ids, w_gate_up.shape[0])
    i = w_down.shape[2]
    xs = x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))
    ends = offsets[1:]
    gu = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=ends)
    y = torch._grouped_mm(F.silu(gu[:, :i]) * gu[:, i:], w_down.transpose(1, 2), offs=ends)
    return (y[inv].float() * w[..., None]).sum(1).to(x.dtype)


def _torch_grouped():
    if not (ON_GPU and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability() >= (9, 0)):
        return None
    return torch_grouped_moe


# ---- inputs ------------------------------------------------------------------------------------
def _logits(t, e, dtype, device, seed):
    return make_tensor((t, e), dtype, seed=seed, device=device, scale=2.0)


def _route_case(t, e, k, dtype=BF16, group="route", **kw):
    def make(device):
        return (_logits(t, e, dtype, device, 1), k), dict(kw)

    opts = "".join(f" {a}={b}" for a, b in kw.items())
    return Case(f"T{t} E{e} top{k}{opts}", make, group, meta=dict(tokens=t, experts=e, top_k=k))


def _expert_order(ids):
    """Where each choice sits in the choices sorted stably by expert (``moe_align``'s inverse
    permutation, in torch: the case is made on any device, meta included)."""
    order = torch.sort(ids.reshape(-1).long(), stable=True).indices
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv.view(ids.shape)


def _combine_inputs(t, e, k, h, dtype, device, seed=0):
    w, ids = ref_moe_route(_logits(t, e, torch.float32, device, seed + 1), k)
    y = make_tensor((t * k, h), dtype, seed=seed + 2, device=device)
    return y, w.float(), _expert_order(ids)


def _combine_case(t, e, k, h, dtype=BF16, group="combine"):
    def make(device):
        return _combine_inputs(t, e, k, h, dtype, device), {}

    return Case(f"T{t} top{k} H{h}", make, group, meta=dict(tokens=t, top_k=k, hidden=h))


def _moe_inputs(t, e, k, h, i, dtype, device, seed=0):
    x = make_tensor((t, h), dtype, seed=seed, device=device)
    z = _logits(t, e, dtype, device, seed + 1)
    wgu = make_tensor((e, 2 * i, h), dtype, seed=seed + 2, device=device, scale=h ** -0.5)
    wd = make_tensor((e, h, i), dtype, seed=seed + 3, device=device, scale=i ** -0.5)
    return x, z, wgu, wd, k


def _moe_case(label, t, dims, dtype=BF16, group="moe", **kw):
    e, k, h, i = dims

    def make(device):
        return _moe_inputs(t, e, k, h, i, dtype, device), dict(kw)

    return Case(label, make, group, meta=dict(tokens=t, experts=e, top_k=k, hidden=h,
                                              intermediate=i))


def route_bench_cases():
    # few cases: each adds its torch.compile baseline to the main job's compiles
    return [_route_case(4096, 8, 2), _route_case(4096, 128, 8)]


def route_check_cases():
    f32 = torch.float32
    return [_route_case(37, 6, 3, f32), _route_case(20, 64, 8, BF16, renormalize=False),
            _route_case(9, 5, 2, f32, scoring="sigmoid"), _route_case(3, 1, 1, f32)]


def combine_bench_cases():
    return [_combine_case(4096, 128, 8, 2048)]


def combine_check_cases():
    return [_combine_case(37, 6, 3, 96, torch.float32), _combine_case(20, 8, 2, 200, BF16)]


def moe_bench_cases():
    return [_moe_case("Qwen3-30B-A3B experts, 4096 tokens", 4096, QWEN3_30B_A3B),
            _moe_case("Mixtral-8x7B experts, 4096 tokens", 4096, MIXTRAL_8X7B),
            _moe_case("Qwen3-30B-A3B experts, 32 tokens (decode)", 32, QWEN3_30B_A3B,
                      group="moe decode")]


def moe_check_cases():
    return [_moe_case("T21 E6 top2 H32 I24 f32", 21, (6, 2, 32, 24), torch.float32),
            _moe_case("T16 E8 top3 H64 I48 bf16 sigmoid", 16, (8, 3, 64, 48), BF16,
                      scoring="sigmoid", renormalize=False)]


# ---- fuzz ----------------------------------------------------------------------------------------
@lazy_composite
def _route_shapes(draw):
    t = draw(st.integers(0, 40))
    e = draw(st.integers(1, 40))
    return ((t, e),)


def fuzz_route(z, *, top_k, **kw):
    return tkit.moe_route(z, min(top_k, z.shape[1]), **kw)


def fuzz_route_ref(z, *, top_k, **kw):
    return ref_moe_route(z, min(top_k, z.shape[1]), **kw)


def _fuzz_route():
    return dict(fn=fuzz_route, reference=fuzz_route_ref, shapes=_route_shapes(),
                dtypes=(torch.float32, torch.float16, BF16),
                layouts=("contiguous", "transposed", "sliced"),
                kwargs=st.fixed_dictionaries({"top_k": st.integers(1, 8),
                                              "renormalize": st.booleans(),
                                              "scoring": st.sampled_from(("softmax",
                                                                          "sigmoid"))}))


@lazy_composite
def _combine_shapes(draw):
    t = draw(st.integers(1, 30))
    k = draw(st.integers(1, 6))
    h = draw(st.sampled_from((1, 16, 40, 130)))
    return ((t * k, h), (t, k))


def combine_extra(tensors, dtype, device):
    t, k = tensors[1].shape
    gen = torch.Generator().manual_seed(t * 7 + k)
    return (torch.randperm(t * k, generator=gen).view(t, k).to(device),)


def fuzz_combine(y, w, inv):
    return tkit.moe_combine(y, w.float(), inv)


def fuzz_combine_ref(y, w, inv):
    return ref_moe_combine(y, w.float() if w.dtype != torch.float64 else w, inv)


def _fuzz_combine():
    return dict(fn=fuzz_combine, reference=fuzz_combine_ref, shapes=_combine_shapes(),
                dtypes=(torch.float32, torch.float16, BF16),
                layouts=("contiguous", "transposed", "sliced"), extra_args=combine_extra)


@lazy_composite
def _moe_shapes(draw):
    t = draw(st.integers(1, 24))
    e = draw(st.integers(1, 8))
    h = draw(st.sampled_from((16, 32, 48)))
    i = draw(st.sampled_from((16, 24)))
    return ((t, h), (t, e), (e, 2 * i, h), (e, h, i))


def _fan_in(w):
    """A power of 2 near 1 / sqrt(fan-in), exact in any dtype: activations stay O(1)."""
    return 2.0 ** -round(0.5 * math.log2(w.shape[-1]))


def fuzz_moe(x, z, wgu, wd, *, top_k, **kw):
    return tkit.moe(x, z, wgu * _fan_in(wgu), wd * _fan_in(wd), min(top_k, z.shape[1]), **kw)


def fuzz_moe_ref(x, z, wgu, wd, *, top_k, **kw):
    return ref_moe(x, z, wgu * _fan_in(wgu), wd * _fan_in(wd), min(top_k, z.shape[1]), **kw)


def _fuzz_moe():
    # float32 only: the parts are fuzzed in 16 bits on their own (route, combine, grouped
    # GEMMs, silu_mul); through three rounded stages a few outputs' max error in bf16 is a
    # matter of luck for the peer too (one token of 16 outputs: tkit 5.4e-3 against torch's
    # 1.1e-3, the intermediate stages each within a rounding of the exact value)
    return dict(fn=fuzz_moe, reference=fuzz_moe_ref, shapes=_moe_shapes(),
                dtypes=(torch.float32,), layouts=("contiguous",),
                kwargs=st.fixed_dictionaries({"top_k": st.integers(1, 4),
                                              "renormalize": st.booleans()}))


SPECS = [
    OpSpec(name="moe_route", family="moe", fn=tkit.moe_route, reference=ref_moe_route,
           cost=MOE.cost_route, bench_cases=route_bench_cases, check_cases=route_check_cases,
           fuzz=_fuzz_route, ulps=4.0,  # a GPU's exp2 is within 2 units of float32's rounding
           baselines={"torch": eager_baseline(ref_moe_route),
                      "torch.compile": torch_compile_baseline(ref_moe_route)},
           bound="memory", doc="bytes: the logits read, weights and ids written"),
    OpSpec(name="moe_combine", family="moe", fn=tkit.moe_combine, reference=ref_moe_combine,
           cost=MOE.cost_combine, bench_cases=combine_bench_cases,
           check_cases=combine_check_cases, fuzz=_fuzz_combine,
           baselines={"torch": eager_baseline(ref_moe_combine),
                      "torch.compile": torch_compile_baseline(ref_moe_combine)},
           bound="memory", doc="bytes: top_k rows of y a token read, one row written"),
    OpSpec(name="moe", family="moe", fn=tkit.moe, reference=ref_moe, cost=MOE.cost,
           bench_cases=moe_bench_cases, check_cases=moe_check_cases, fuzz=_fuzz_moe,
           baselines={"torch (loop over experts)": eager_baseline(ref_moe),
                      "torch._grouped_mm": _torch_grouped},
           bound="compute",
           doc="FLOPs: the experts' two GEMMs over tokens x top_k rows; bytes: the weights "
               "once, the rows each GEMM reads and writes"),
]
