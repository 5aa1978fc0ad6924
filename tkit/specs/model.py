"""Specs of the models (tkit/models/): a Llama-3-8B decoder layer from tkit ops, for a prompt
and for a decode step.

Not kernels of their own: a layer is where per-call host cost (the eager tax) and the gaps
between kernels add up, so it is measured as a whole against the same layer in torch, eager
and under torch.compile.

``llama_layer`` (a prompt): causal GQA attention between the projections, without RoPE: the
case was defined before ``tkit.rope`` existed and is kept as it is so that its runs stay
comparable. ``llama_decode_layer`` (one decode step of a batch of sequences over a KV cache):
RoPE fused with the cache write and decode attention over the cache, dense or paged; its
benchmark case is dense, the static cache a torch user decodes over (torch has no paged
attention: its reference gathers the pages first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tkit
from tkit.models.llama import EPS, LLAMA3_8B, head_dim, llama_decode_layer, llama_layer
from tkit.registry import (
    Case,
    Cost,
    OpSpec,
    eager_baseline,
    lazy_composite,
    optional_module,
    torch_compile_baseline,
)
from tkit.specs.decode_attention import paged_table
from tkit.specs.inference import ref_rope
from tkit.testing import make_tensor

st = optional_module("hypothesis.strategies")

#: the check cases' model, small enough for the interpreter
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96)


def _dims(x, w_qkv, w_down, heads, kv_heads):
    return x.shape[0], head_dim(w_qkv, heads, kv_heads), w_down.shape[1]


def ref_llama_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, *, heads, kv_heads, eps=EPS):
    """The same layer in torch (F.rms_norm, F.linear, SDPA with GQA)."""
    t, d, mlp = _dims(x, w_qkv, w_down, heads, kv_heads)
    qkv = F.linear(F.rms_norm(x, (x.shape[-1],), w_in, eps), w_qkv)
    q = qkv[:, :heads * d].view(1, t, heads, d).transpose(1, 2)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(1, t, kv_heads, d).transpose(1, 2)
    v = qkv[:, (heads + kv_heads) * d:].view(1, t, kv_heads, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    h = x + F.linear(o.transpose(1, 2).reshape(t, heads * d), w_o)
    gu = F.linear(F.rms_norm(h, (h.shape[-1],), w_post, eps), w_gu)
    return h + F.linear(F.silu(gu[:, :mlp]) * gu[:, mlp:], w_down)


def cost_llama_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, *, heads, kv_heads, eps=EPS):
    """FLOPs of the four projections and causal attention (half the score matrix); bytes of
    the weights and the activations each kernel must read and write once."""
    t, d, mlp = _dims(x, w_qkv, w_down, heads, kv_heads)
    hidden = x.shape[1]
    weights = (w_in, w_qkv, w_o, w_post, w_gu, w_down)
    gemm = 2 * t * sum(w.shape[0] * w.shape[1] for w in (w_qkv, w_o, w_gu, w_down))
    attn = 2 * 2 * heads * d * t * (t + 1) / 2
    el = x.element_size()
    acts = t * el * (2 * hidden  # norm in, out
                     + hidden + qkv_width(heads, kv_heads, d)  # qkv projection
                     + qkv_width(heads, kv_heads, d) + heads * d  # attention
                     + heads * d + 2 * hidden  # o-proj with the residual
                     + 2 * hidden  # norm
                     + hidden + mlp  # gate/up with SwiGLU in its epilogue
                     + mlp + 2 * hidden)  # down with the residual
    return Cost(bytes=sum(w.numel() * w.element_size() for w in weights) + acts,
                flops=gemm + attn)


def qkv_width(heads, kv_heads, d):
    return (heads + 2 * kv_heads) * d


def _make(tokens, cfg, dtype, seed=0):
    def make(device):
        hidden, mlp = cfg["hidden"], cfg["mlp"]
        qkv = qkv_width(cfg["heads"], cfg["kv_heads"], cfg["head_dim"])
        o_in = cfg["heads"] * cfg["head_dim"]

        def lin(n, k, s):  # nn.Linear's default scale, so activations stay O(1)
            return make_tensor((n, k), dtype, seed=seed + s, device=device, scale=k ** -0.5)

        norm_w = lambda s: 1.0 + 0.1 * make_tensor((hidden,), dtype, seed=seed + s,  # noqa: E731
                                                   device=device)
        args = (make_tensor((tokens, hidden), dtype, seed=seed, device=device), norm_w(1),
                lin(qkv, hidden, 2), lin(hidden, o_in, 3), norm_w(4), lin(2 * mlp, hidden, 5),
                lin(hidden, mlp, 6))
        return args, {"heads": cfg["heads"], "kv_heads": cfg["kv_heads"]}

    return make


def _bench():
    cfg = LLAMA3_8B
    return [Case(f"Llama-3-8B layer, {t} tokens bf16", _make(t, cfg, torch.bfloat16),
                 group="layer", meta={"tokens": t, **cfg}) for t in (512, 4096)]


def _check():
    return [Case(f"tiny layer, {t} tokens {str(dt).split('.')[-1]}", _make(t, TINY, dt),
                 group="layer") for t, dt in ((16, torch.float32), (33, torch.bfloat16))]


@lazy_composite
def _layer_args(draw):
    return draw(st.integers(1, 40))


def _fuzz():
    # token counts only: the layer's parts are fuzzed as ops of their own
    def extra_args(tensors, dtype, device):
        (args, _), = [_make(tensors[0].shape[0], TINY, dtype)(device)]
        return args[1:]

    return dict(shapes=_layer_args().map(lambda t: ((t, TINY["hidden"]),)),
                dtypes=(torch.float32, torch.bfloat16), extra_args=extra_args,
                kwargs=st.just({"heads": TINY["heads"], "kv_heads": TINY["kv_heads"]}))


def _tkit_compiled():
    """torch.compile (fullgraph) over the layer of tkit ops: the registered ops must trace
    without a graph break, and the compiled layer should be no slower than the eager one."""
    if not torch.cuda.is_available():
        return None
    import torch._dynamo as dynamo

    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 1024)
    return torch.compile(llama_layer, dynamic=False, fullgraph=True)


# ---- the decode step ---------------------------------------------------------------------------
def _dense_kv(cache, block_table):
    """(batch, heads_kv, max_len, head_dim): a dense cache's view, or a paged cache's pages
    gathered in each sequence's order (a copy)."""
    if block_table is not None:
        b, n = block_table.shape
        cache = cache[block_table.long()].reshape(b, n * cache.shape[1], *cache.shape[2:])
    return cache.transpose(1, 2)


def ref_llama_decode_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, k_cache, v_cache,
                           cos_sin, *, positions, slot_mapping, cache_seqlens, block_table=None,
                           heads, kv_heads, eps=EPS):
    """The same step in torch, as a torch user writes it over a static cache: RoPE in float32
    (:func:`tkit.specs.inference.ref_rope`), k and v written by ``index_copy_`` (every slot
    valid), and SDPA over the cache with the query heads of a kv head as its query rows (no
    copy of K or V for GQA) and a mask of each sequence's length. A paged cache is gathered
    into a dense one first (torch has no paged attention)."""
    b = x.shape[0]
    d = head_dim(w_qkv, heads, kv_heads)
    qkv = F.linear(F.rms_norm(x, (x.shape[-1],), w_in, eps), w_qkv)
    q = qkv[:, :heads * d].view(b, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(b, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(b, kv_heads, d)
    q, k = ref_rope(q, k, positions, cos_sin)
    slots = slot_mapping.long()
    k_cache.view(-1, kv_heads, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, d).index_copy_(0, slots, v.to(v_cache.dtype))
    kc, vc = _dense_kv(k_cache, block_table), _dense_kv(v_cache, block_table)
    keys = torch.arange(kc.shape[2], device=x.device)
    mask = (keys[None, :] < cache_seqlens.to(x.device)[:, None]).view(b, 1, 1, -1)
    o = F.scaled_dot_product_attention(q.view(b, kv_heads, heads // kv_heads, d),
                                       kc.to(q.dtype), vc.to(q.dtype), attn_mask=mask)
    h = x + F.linear(o.reshape(b, heads * d), w_o)
    gu = F.linear(F.rms_norm(h, (h.shape[-1],), w_post, eps), w_gu)
    mlp = w_down.shape[1]
    return h + F.linear(F.silu(gu[:, :mlp]) * gu[:, mlp:], w_down)


def cost_llama_decode_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, k_cache, v_cache,
                            cos_sin, *, positions, slot_mapping, cache_seqlens,
                            block_table=None, heads, kv_heads, eps=EPS):
    """Bytes: the weights, the cached K and V each sequence reads (its length), the new k
    and v written, the activations (negligible beside them); FLOPs: the projections and
    attention (QK^T and PV over each sequence's keys). One host read of the lengths (the
    cost is computed once a case, not in the timed call)."""
    b = x.shape[0]
    d = head_dim(w_qkv, heads, kv_heads)
    keys = int(cache_seqlens.long().sum().item())
    weights = (w_in, w_qkv, w_o, w_post, w_gu, w_down)
    kv = 2 * keys * kv_heads * d * k_cache.element_size()
    acts = 4 * b * x.shape[1] * x.element_size()
    gemm = 2 * b * sum(w.shape[0] * w.shape[1] for w in (w_qkv, w_o, w_gu, w_down))
    return Cost(bytes=sum(w.numel() * w.element_size() for w in weights) + kv + acts,
                flops=gemm + 4 * keys * heads * d)


def _make_decode(batch, lengths, cfg, dtype, page=None, seed=0):
    """A decode step: ``lengths`` (one a sequence, the new token included) over a cache of
    ``max(lengths)`` positions a sequence rounded up to pages; dense when ``page`` is None,
    else pages in a shuffled order."""
    def make(device):
        args, kw = _make(batch, cfg, dtype, seed)(device)
        hk, d = cfg["kv_heads"], cfg["head_dim"]
        max_len = max(lengths)
        lens = torch.tensor(lengths, dtype=torch.int32)
        pos = (lens - 1).long()
        if page is None:
            shape = (batch, max_len, hk, d)
            table = None
            slots = torch.arange(batch) * max_len + pos
        else:
            per_seq = -(-max_len // page)
            shape = (batch * per_seq, page, hk, d)
            table = paged_table(batch, per_seq, batch * per_seq,
                                torch.Generator().manual_seed(seed + batch))
            slots = table[torch.arange(batch), pos // page].long() * page + pos % page
            table = table.to(device)
        caches = tuple(make_tensor(shape, dtype, seed=seed + 7 + i, device=device)
                       for i in range(2))
        cos_sin = tkit.rope_cache(max_len, d, 500000.0, device=device)
        kw.update(positions=pos.to(device), slot_mapping=slots.to(device),
                  cache_seqlens=lens.to(device), block_table=table)
        return args + caches + (cos_sin,), kw

    return make


def _decode_bench():
    cfg = LLAMA3_8B
    b, n = 32, 4096
    return [Case(f"Llama-3-8B layer decode, B{b} L{n} dense bf16",
                 _make_decode(b, [n] * b, cfg, torch.bfloat16), group="decode",
                 meta={"batch": b, "max_len": n, **cfg})]


def _decode_check():
    return [
        Case("tiny layer decode, B3 dense float32",
             _make_decode(3, [24, 1, 11], TINY, torch.float32), group="decode"),
        Case("tiny layer decode, B4 page 4 shuffled bfloat16",
             _make_decode(4, [9, 16, 1, 30], TINY, torch.bfloat16, page=4), group="decode"),
    ]


def fuzz_decode_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, k_cache, v_cache, cos_sin,
                      positions, slot_mapping, cache_seqlens, block_table, **kw):
    """:func:`llama_decode_layer` with the step's integer tensors positional (the fuzz
    recipe's ``extra_args`` appends them)."""
    return llama_decode_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, k_cache, v_cache,
                              cos_sin, positions=positions, slot_mapping=slot_mapping,
                              cache_seqlens=cache_seqlens, block_table=block_table, **kw)


def fuzz_decode_layer_ref(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, k_cache, v_cache,
                          cos_sin, positions, slot_mapping, cache_seqlens, block_table, **kw):
    return ref_llama_decode_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, k_cache, v_cache,
                                  cos_sin, positions=positions, slot_mapping=slot_mapping,
                                  cache_seqlens=cache_seqlens, block_table=block_table, **kw)


def decode_layer_extra_args(tensors, dtype, device):
    """The step around the drawn ``x``: lengths 1..29 and the cache's form (dense, or pages
    of 1, 4 or 8) follow from the batch size."""
    b = tensors[0].shape[0]
    lens = [1 + (7 * i + 3 * b) % 29 for i in range(b)]
    args, kw = _make_decode(b, lens, TINY, dtype, page=(None, 1, 4, 8)[b % 4], seed=b)(device)
    return args[1:] + (kw["positions"], kw["slot_mapping"], kw["cache_seqlens"],
                       kw["block_table"])


def _decode_fuzz():
    # batch sizes (and x's layout) only: the layer's parts are fuzzed as ops of their own
    return dict(fn=fuzz_decode_layer, reference=fuzz_decode_layer_ref,
                shapes=st.integers(1, 6).map(lambda b: ((b, TINY["hidden"]),)),
                dtypes=(torch.float32, torch.bfloat16), extra_args=decode_layer_extra_args,
                kwargs=st.just({"heads": TINY["heads"], "kv_heads": TINY["kv_heads"]}))


def _tkit_decode_compiled():
    """torch.compile (fullgraph) over the decode step of tkit ops (the in-place RoPE and cache
    write included)."""
    if not torch.cuda.is_available():
        return None
    import torch._dynamo as dynamo

    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 1024)
    return torch.compile(llama_decode_layer, dynamic=False, fullgraph=True)


SPECS = [
    OpSpec(name="llama_layer", family="model", fn=llama_layer, reference=ref_llama_layer,
           cost=cost_llama_layer, bench_cases=_bench, check_cases=_check, fuzz=_fuzz,
           baselines={"torch": eager_baseline(ref_llama_layer),
                      "torch.compile": torch_compile_baseline(ref_llama_layer),
                      "tkit+torch.compile": _tkit_compiled},
           bound="compute", doc=__doc__.splitlines()[0]),
    OpSpec(name="llama_decode_layer", family="model", fn=llama_decode_layer,
           reference=ref_llama_decode_layer, cost=cost_llama_decode_layer,
           bench_cases=_decode_bench, check_cases=_decode_check, fuzz=_decode_fuzz,
           baselines={"torch": eager_baseline(ref_llama_decode_layer),
                      "torch.compile": torch_compile_baseline(ref_llama_decode_layer),
                      "tkit+torch.compile": _tkit_decode_compiled},
           bound="memory", doc=llama_decode_layer.__doc__.splitlines()[0]),
]
