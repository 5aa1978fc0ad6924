"""Specs of sampling (tkit/kernels/sampling/): ``sample`` and ``speculative_accept``.

The reference rule for random ops: the references below draw the *same* noise as the kernels
(:func:`tkit.kernels.sampling.philox_uniform` is Philox-4x32-10 in torch, bit for bit), apply
the same math in float64 (kept set by thresholds, Gumbel-max / exponential race), and so must
return the same ids; the comparison is exact (an int output's floor is under one id). What can
differ is a near-tie inside float32 rounding (two scores, or a top-p cumulative mass at the
boundary, within ~1e-6): on random inputs about one row in 10^5-10^6.
Tests check the distributions themselves statistically (tests/kernels/test_sampling.py).

Bench cases: batch 128, vocab 128256 (Llama 3), bf16 logits: temperature + top_k=50 +
top_p=0.9 (the aim is <= 0.15 ms on the H200; torch measured 0.374 ms top-k first,
2.47 ms through a full sort, docs/FACTS.md), temperature alone, top_k alone, min_p.
"""

from __future__ import annotations

import torch

import tkit
from tkit.kernels import sampling as SK
from tkit.registry import (
    Case,
    Cost,
    OpSpec,
    eager_baseline,
    optional_module,
    torch_compile_baseline,
)
from tkit.testing.tensors import make_tensor

st = optional_module("hypothesis.strategies")

BF16 = torch.bfloat16
BATCH, VOCAB = 128, 128256
SPAN = SK.SampleConfig.span


# ---- references ------------------------------------------------------------------------------
def _rows(x, batch, default, device, dtype=torch.float64):
    """A per-row option as a (batch,) tensor (``default`` where not given)."""
    if x is None:
        return torch.full((batch,), default, dtype=dtype, device=device)
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype)
    return torch.full((batch,), x, dtype=dtype, device=device)


def scaled_logits(logits, temperature=None):
    """(z, greedy rows) in float64: z = logits * (1 / T), T <= 0 rows unscaled."""
    b = logits.shape[0]
    x = logits.to(torch.float64)
    t = _rows(temperature, b, 1.0, x.device)
    greedy = t <= 0
    inv = torch.where(greedy, 1.0, 1.0 / torch.where(greedy, 1.0, t))
    return x * inv[:, None], greedy


def kept_mask(logits, *, temperature=None, top_k=None, top_p=None, min_p=None):
    """(batch, vocab) bool: the tokens a row may draw, by the module docstring's thresholds
    (min-p, then top-k, then top-p renormalized; ties at a threshold kept); argmax rows keep
    their first maximum only. Deterministic: tests compare what is drawn against it."""
    z, greedy = scaled_logits(logits, temperature)
    b, v = z.shape
    dev = z.device
    m = z.max(1).values if v else torch.zeros(b, dtype=z.dtype, device=dev)
    lo = m - SPAN
    if min_p is not None:
        mp = _rows(min_p, b, 0.0, dev)
        on = mp > 0
        lo = torch.where(on, torch.maximum(lo, m + torch.log(torch.where(on, mp, 1.0))), lo)
    keep = z >= lo[:, None]
    if top_k is not None:
        k = _rows(top_k, b, 0, dev, torch.int64)
        k_on = (k > 0) & (k < v)
        greedy = greedy | (k_on & (k == 1))
        zs = torch.where(keep, z, -torch.inf).sort(1, descending=True).values
        kth = zs.gather(1, (k.clamp(1, v) - 1)[:, None])
        keep = keep & (~k_on[:, None] | (z >= kth))
    if top_p is not None:
        p = _rows(top_p, b, 1.0, dev)
        p_on = p < 1
        e = torch.where(keep, torch.exp(z - m[:, None]), 0.0)
        total = e.sum(1)
        zs, order = torch.where(keep, z, -torch.inf).sort(1, descending=True)
        csum = e.gather(1, order).cumsum(1)
        first = (csum >= (p * total)[:, None]).to(torch.int8).argmax(1)
        tau = zs.gather(1, first[:, None])
        keep = keep & (~p_on[:, None] | (z >= tau))
    greedy = greedy | (m == -torch.inf)
    am = torch.nn.functional.one_hot(z.argmax(1), v).bool() if v else keep
    return torch.where(greedy[:, None], am, keep)


def _seed_rows(seed, batch, device):
    """(seed, stream) per row as the kernels use them."""
    if seed is None:
        raise ValueError("the reference needs a seed (None draws fresh ones)")
    rows = torch.arange(batch, device=device)
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64), torch.zeros_like(rows)
    return torch.full((batch,), int(seed), dtype=torch.int64, device=device), rows


def ref_sample(logits, *, temperature=None, top_k=None, top_p=None, min_p=None, seed=None):
    """:func:`tkit.sample` in torch, float64, with the kernel's noise: argmax over the kept
    tokens of z + g, g = -log(-log(u)), u from the same Philox counters."""
    b, v = logits.shape
    z, _ = scaled_logits(logits, temperature)
    keep = kept_mask(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    seeds, streams = _seed_rows(seed, b, z.device)
    idx = torch.arange(v, device=z.device)[None, :]
    u = SK.philox_uniform(seeds[:, None], streams[:, None], SK.PURPOSE_SAMPLE, idx)
    score = torch.where(keep, z - torch.log(-torch.log(u)), -torch.inf)
    # argmax rows keep one token: it wins whatever its noise
    return score.argmax(1)


def ref_speculative_accept(draft_token_ids, draft_probs, target_probs, *, seed=None):
    """Chain rejection sampling in torch, float64, with the kernel's uniforms."""
    b, k = draft_token_ids.shape
    v = draft_probs.shape[-1]
    dev = draft_probs.device
    pd_all = draft_probs.to(torch.float64)
    pt_all = target_probs.to(torch.float64)
    seeds, streams = _seed_rows(seed, b, dev)
    ids = draft_token_ids.long().clamp(0, v - 1)
    pd = pd_all.gather(2, ids[..., None])[..., 0]
    pt = pt_all.gather(2, ids[..., None])[..., 0]
    pos = torch.arange(k, device=dev)[None, :]
    u = SK.philox_uniform(seeds[:, None], streams[:, None], SK.PURPOSE_ACCEPT, pos)
    accept = (pt >= pd) | (u * pd < pt)
    j = torch.where(~accept, pos, k).min(1).values  # first rejection, k if none
    rows = torch.arange(b, device=dev)
    q_t = pt_all[rows, j]
    q_d = torch.where((j < k)[:, None], pd_all[rows, j.clamp(max=k - 1)], 0.0)
    q_r = (q_t - q_d).clamp_min(0.0)
    e = -torch.log(_resample_uniform(seeds, streams, j, v))
    s_r, s_t = q_r / e, q_t / e
    new = torch.where(s_r.max(1).values > 0, s_r.argmax(1), s_t.argmax(1))
    out_pos = torch.arange(k + 1, device=dev)[None, :]
    drafted = torch.cat([draft_token_ids.long(), torch.zeros_like(j)[:, None]], 1)
    out = torch.where(out_pos < j[:, None], drafted,
                      torch.where(out_pos == j[:, None], new[:, None], -1))
    return out, j.to(torch.int32)


def _resample_uniform(seeds, streams, j, v):
    """u of the resampling draw of each row: purpose 2 + (position of the draw)."""
    cols = torch.arange(v, device=seeds.device)[None, :]
    out = torch.empty((seeds.shape[0], v), dtype=torch.float64, device=seeds.device)
    for jj in j.unique().tolist():
        sel = j == jj
        out[sel] = SK.philox_uniform(seeds[sel][:, None], streams[sel][:, None],
                                     SK.PURPOSE_RESAMPLE + jj, cols)
    return out


# ---- baselines (torch, what serving stacks run; noise from torch's generator) -----------------
def _prep(logits, temperature):
    x = logits.float()
    if temperature is not None:
        t = temperature if not isinstance(temperature, torch.Tensor) else temperature[:, None]
        x = x / t
    return x


def _race(probs):
    """A draw from each row of (unnormalized) probs, exponential race, no host sync."""
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def torch_sample_topk_first(logits, *, temperature=None, top_k=None, top_p=None, min_p=None,
                            seed=None):
    """top-k first (torch.topk), then top-p on the k sorted values; min-p on the full row.
    The fast torch recipe (0.374 ms at the headline case on the H200). Without top_k it
    is the full-sort recipe."""
    if top_k is None or isinstance(top_k, torch.Tensor):
        return torch_sample_full_sort(logits, temperature=temperature, top_k=top_k,
                                      top_p=top_p, min_p=min_p)
    x = _prep(logits, temperature)
    if min_p is not None:
        probs = x.softmax(-1)
        pmax = probs.max(-1, keepdim=True).values
        x = x.masked_fill(probs < min_p * pmax, -torch.inf)
    vals, idx = x.topk(top_k, dim=-1)
    probs = vals.softmax(-1)
    if top_p is not None:
        csum = probs.cumsum(-1)
        probs = probs.masked_fill(csum - probs > top_p, 0.0)
    return idx.gather(-1, _race(probs)[:, None])[:, 0]


def torch_sample_full_sort(logits, *, temperature=None, top_k=None, top_p=None, min_p=None,
                           seed=None):
    """Sort the whole row, mask by position (top-k), cumulative mass (top-p) and min-p."""
    x = _prep(logits, temperature)
    vals, idx = x.sort(-1, descending=True)
    probs = vals.softmax(-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k is not None:
        k = top_k if not isinstance(top_k, torch.Tensor) else top_k[:, None]
        keep &= torch.arange(x.shape[-1], device=x.device)[None, :] < k
    if min_p is not None:
        keep &= probs >= min_p * probs[:, :1]
    if top_p is not None:
        p = torch.where(keep, probs, 0.0)
        p = p / p.sum(-1, keepdim=True)
        keep &= p.cumsum(-1) - p <= top_p
    return idx.gather(-1, _race(torch.where(keep, probs, 0.0))[:, None])[:, 0]


def torch_speculative_accept(draft_token_ids, draft_probs, target_probs, *, seed=None):
    """Rejection sampling in torch ops (vLLM's recipe, without its Triton kernels)."""
    b, k = draft_token_ids.shape
    dev = draft_probs.device
    ids = draft_token_ids.long()
    pd = draft_probs.gather(2, ids[..., None])[..., 0].float()
    pt = target_probs[:, :k].gather(2, ids[..., None])[..., 0].float()
    u = torch.rand((b, k), device=dev)
    accept = (pt >= pd) | (u * pd < pt)
    pos = torch.arange(k, device=dev)[None, :]
    j = torch.where(~accept, pos, k).min(1).values
    rows = torch.arange(b, device=dev)
    q_t = target_probs[rows, j].float()
    q_d = torch.where((j < k)[:, None], draft_probs[rows, j.clamp(max=k - 1)].float(), 0.0)
    new = _race((q_t - q_d).clamp_min(0.0))
    out_pos = torch.arange(k + 1, device=dev)[None, :]
    drafted = torch.cat([ids, torch.zeros_like(j)[:, None]], 1)
    out = torch.where(out_pos < j[:, None], drafted,
                      torch.where(out_pos == j[:, None], new[:, None], -1))
    return out, j.to(torch.int32)


# ---- costs -----------------------------------------------------------------------------------
def cost_sample(logits, **kw) -> Cost:
    return SK.cost(logits)


def cost_speculative(draft_token_ids, draft_probs, target_probs, **kw) -> Cost:
    return SK.cost_speculative(draft_token_ids, draft_probs, target_probs)


# ---- cases -----------------------------------------------------------------------------------
def _logits(shape, dtype, device, seed=1, layout="contiguous", scale=2.5):
    # LLM logits spread over a few units; make_tensor is deterministic
    return make_tensor(shape, dtype, layout, seed=seed, device=device, scale=scale)


def _sample_case(label, shape, dtype, group="default", layout="contiguous", per_row=(),
                 **opts):
    """One sample case; ``per_row`` names options given as (batch,) tensors (varied per row)
    and ``seed`` is a per-row tensor when "seed" is among them."""

    def build(device):
        b = shape[0]
        kw = dict(opts)
        gen = torch.Generator().manual_seed(b * 31 + shape[1])
        for name in per_row:
            if name == "seed":
                kw["seed"] = torch.randint(0, 2**62, (b,), generator=gen).to(device)
            elif name == "top_k":
                kw[name] = torch.randint(0, 8, (b,), generator=gen).to(device)
            elif name == "temperature":
                t = 0.5 + torch.rand(b, generator=gen)
                t[::4] = 0.0
                kw[name] = t.to(device)
            else:
                lo, hi = {"top_p": (0.3, 1.0), "min_p": (0.0, 0.3)}[name]
                kw[name] = (lo + (hi - lo) * torch.rand(b, generator=gen)).to(device)
        kw.setdefault("seed", 1234)
        return (_logits(shape, dtype, device, layout=layout),), kw

    return Case(label, build, group, meta=dict(batch=shape[0], vocab=shape[1]))


def sample_bench():
    big = (BATCH, VOCAB)
    return [
        _sample_case("B128 V128256 bf16 T=0.7 top_k=50 top_p=0.9", big, BF16,
                     temperature=0.7, top_k=50, top_p=0.9),
        _sample_case("B128 V128256 bf16 T=0.7", big, BF16, group="temperature",
                     temperature=0.7),
        _sample_case("B128 V128256 bf16 top_k=50", big, BF16, group="top_k", top_k=50),
        _sample_case("B128 V128256 bf16 T=0.7 min_p=0.1", big, BF16, group="min_p",
                     temperature=0.7, min_p=0.1),
    ]


def sample_check():
    f16, f32 = torch.float16, torch.float32
    return [
        _sample_case("B8 V100 fp32 T=0.7 top_k=5 top_p=0.8", (8, 100), f32, temperature=0.7,
                     top_k=5, top_p=0.8),
        _sample_case("B8 V77 fp16 T=1.3", (8, 77), f16, group="temperature", temperature=1.3),
        _sample_case("B8 V100 fp32 top_p=0.6 transposed", (8, 100), f32, layout="transposed",
                     top_p=0.6),
        _sample_case("B8 V64 bf16 min_p=0.2", (8, 64), BF16, group="min_p", min_p=0.2),
        _sample_case("B12 V40 fp32 per-row options and seeds", (12, 40), f32, group="per_row",
                     per_row=("temperature", "top_k", "top_p", "min_p", "seed")),
    ]


def _spec_case(label, b, k, v, dtype=torch.float32, group="default", **kw):
    def build(device):
        # target logits; the draft's are the target's plus noise (a draft model that agrees
        # with the target most of the time), its ids drawn from the draft
        gen = torch.Generator().manual_seed(b * 131 + k * 7 + v)
        tgt = torch.randn((b, k + 1, v), generator=gen) * 2
        draft = (tgt[:, :k] + torch.randn((b, k, v), generator=gen)).softmax(-1)
        target = tgt.softmax(-1)
        ids = torch.multinomial(draft.reshape(-1, v), 1, generator=gen).reshape(b, k)
        return (ids.to(device), draft.to(dtype).to(device), target.to(dtype).to(device)), \
            {"seed": 7, **kw}

    return Case(label, build, group, meta=dict(batch=b, k=k, vocab=v))


def spec_bench():
    return [_spec_case("B64 k4 V128256 fp32", 64, 4, VOCAB)]


def spec_check():
    return [_spec_case("B16 k3 V50 fp32", 16, 3, 50),
            _spec_case("B9 k1 V33 fp16", 9, 1, 33, torch.float16)]


# ---- fuzz recipes (shapes, dtypes, layouts; options drawn as keyword arguments) ---------------
def _sample_fuzz():
    S = optional_module("tkit.testing.strategies")
    opts = st.fixed_dictionaries({
        "temperature": st.sampled_from([None, 0.0, 0.5, 1.0, 2.0]),
        "top_k": st.sampled_from([None, 1, 2, 5, 1000]),
        "top_p": st.sampled_from([None, 0.3, 0.9, 1.0]),
        "min_p": st.sampled_from([None, 0.0, 0.05, 0.5]),
        "seed": st.integers(0, 2**40),
    })
    shapes = st.tuples(st.integers(1, 5), S.dim_sizes(max_size=70, allow_zero=False)).map(
        lambda s: (s,))
    return dict(shapes=shapes, dtypes=(torch.float32, torch.float16),
                layouts=("contiguous", "transposed", "sliced"), kwargs=opts, scale=3.0)


def _spec_fuzz():
    return dict(fn=_fuzz_spec, reference=_fuzz_spec_ref,
                shapes=st.tuples(st.integers(1, 4), st.integers(1, 4),
                                 st.integers(1, 40)).map(lambda s: ((s[0], s[1] + 1, s[2]),)),
                dtypes=(torch.float32,), layouts=("contiguous",),
                kwargs=st.fixed_dictionaries({"seed": st.integers(0, 2**40)}))


def _spec_inputs(logits_t):
    """From (b, k + 1, v) target logits: draft probs a blend towards the target, draft ids
    drawn from the draft (seeded by the shape)."""
    b, k1, v = logits_t.shape
    k = k1 - 1
    gen = torch.Generator().manual_seed(b * 1000 + k * 10 + v)
    target = logits_t.softmax(-1)
    noise = torch.randn((b, k, v), generator=gen, dtype=torch.float64).to(logits_t.device)
    draft = (logits_t[:, :k] + noise.to(logits_t.dtype)).softmax(-1)
    ids = torch.multinomial(draft.float().reshape(-1, v).cpu(), 1, generator=gen)
    return ids.reshape(b, k).to(logits_t.device), draft, target


def _fuzz_spec(target_logits, seed=0):
    ids, draft, target = _spec_inputs(target_logits)
    return tkit.speculative_accept(ids, draft, target, seed=seed)


def _fuzz_spec_ref(target_logits, seed=0):
    ids, draft, target = _spec_inputs(target_logits.float())
    return ref_speculative_accept(ids, draft, target, seed=seed)


def _opcheck_sample():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = make_tensor((3, 20), torch.float32, seed=1, device=dev)
    k = torch.tensor([2, 5, 0], device=dev)
    return torch.ops.tkit.sample.default, (x, None, k, None, None, None, 0.8, 0, 0.7, -1.0,
                                          5), {}


def _opcheck_spec():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids, draft, target = _spec_inputs(make_tensor((2, 3, 10), torch.float32, seed=2,
                                                  device=dev))
    return torch.ops.tkit.speculative_accept.default, (ids, draft, target, None, 3), {}


SPECS = [
    OpSpec(name="sample", family="sampling", fn=tkit.sample, reference=ref_sample,
           cost=cost_sample, bench_cases=sample_bench, check_cases=sample_check,
           fuzz=_sample_fuzz,
           baselines={"torch top-k first": eager_baseline(torch_sample_topk_first),
                      "torch full sort": eager_baseline(torch_sample_full_sort),
                      "torch.compile top-k first": torch_compile_baseline(
                          torch_sample_topk_first),
                      "torch.compile full sort": torch_compile_baseline(
                          torch_sample_full_sort)},
           opcheck=_opcheck_sample,
           doc="ids from logits: temperature, min-p, top-k, top-p; sorting-free, seeded"),
    OpSpec(name="speculative_accept", family="sampling", fn=tkit.speculative_accept,
           reference=ref_speculative_accept, cost=cost_speculative, bench_cases=spec_bench,
           check_cases=spec_check, fuzz=_spec_fuzz,
           baselines={"torch": eager_baseline(torch_speculative_accept),
                      "torch.compile": torch_compile_baseline(torch_speculative_accept)},
           opcheck=_opcheck_spec,
           doc="chain rejection sampling of speculative decoding"),
]
