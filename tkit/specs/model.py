"""Model: a Llama-3-8B decoder layer assembled from tkit ops.

Not a kernel of its own: the layer is where per-call host cost (the eager tax) and the gaps
between kernels add up, so it is measured as a whole against the same layer in torch, eager
and under torch.compile. One layer: RMSNorm, the fused QKV projection, causal GQA attention,
the output projection with the residual added in its epilogue, RMSNorm, the fused gate/up
projection with SwiGLU in its epilogue (``tkit.matmul_glu``: the (tokens, 2 * mlp) product is
never written), the down projection with the residual. No RoPE: the case was defined before
``tkit.rope`` existed and is kept as it is so that its runs stay comparable.
Weights are in nn.Linear's (out, in) layout, passed to ``tkit.matmul`` transposed (no copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tkit
from tkit.registry import (
    Case,
    Cost,
    OpSpec,
    eager_baseline,
    lazy_composite,
    optional_module,
    torch_compile_baseline,
)
from tkit.testing import make_tensor

st = optional_module("hypothesis.strategies")

#: Llama-3-8B's layer; the check cases use a model small enough for the interpreter
LLAMA3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96)
EPS = 1e-5


def _dims(x, w_qkv, w_down, heads, kv_heads):
    tokens = x.shape[0]
    head_dim = w_qkv.shape[0] // (heads + 2 * kv_heads)
    return tokens, head_dim, w_down.shape[1]


def llama_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, *, heads, kv_heads, eps=EPS):
    """One decoder layer over ``x`` (tokens, hidden) of one sequence, causal, from tkit ops."""
    t, d, mlp = _dims(x, w_qkv, w_down, heads, kv_heads)
    qkv = tkit.matmul(tkit.rms_norm(x, w_in, eps), w_qkv.t())
    q = qkv[:, :heads * d].view(1, t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(1, t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(1, t, kv_heads, d)
    o = tkit.flash_attention(q, k, v, causal=True)
    h = tkit.matmul(o.view(t, heads * d), w_o.t(), residual=x)
    act = tkit.matmul_glu(tkit.rms_norm(h, w_post, eps), w_gu.t())  # SwiGLU in the GEMM
    return tkit.matmul(act, w_down.t(), residual=h)


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


SPECS = [
    OpSpec(name="llama_layer", family="model", fn=llama_layer, reference=ref_llama_layer,
           cost=cost_llama_layer, bench_cases=_bench, check_cases=_check, fuzz=_fuzz,
           baselines={"torch": eager_baseline(ref_llama_layer),
                      "torch.compile": torch_compile_baseline(ref_llama_layer),
                      "tkit+torch.compile": _tkit_compiled},
           bound="compute", doc=__doc__.splitlines()[0]),
]
