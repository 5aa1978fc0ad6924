"""A Llama decoder layer from tkit ops, for a prompt (:func:`llama_layer`) and for one decode
step of a batch of sequences over a KV cache (:func:`llama_decode_layer`).

Weights are in nn.Linear's (out, in) layout, passed to ``tkit.matmul`` transposed (no copy);
the QKV projection is fused (q, k, v rows stacked in that order) as is gate/up (gate rows
first), whose SwiGLU runs in the GEMM's epilogue (``tkit.matmul_glu``: the (tokens, 2 * mlp)
product is never written).
"""

from __future__ import annotations

import tkit
from tkit.kernels._common import torch_tf32

#: Llama-3-8B's layer sizes
LLAMA3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336)
EPS = 1e-5


def head_dim(w_qkv, heads: int, kv_heads: int) -> int:
    """The head dim of a fused QKV weight ((heads + 2 kv_heads) * head_dim, hidden)."""
    return w_qkv.shape[0] // (heads + 2 * kv_heads)


def split_qkv(qkv, heads: int, kv_heads: int, d: int):
    """q, k, v views (tokens, heads, d) of the fused QKV product (tokens, (h + 2 hk) d)."""
    t = qkv.shape[0]
    return (qkv[:, :heads * d].view(t, heads, d),
            qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d),
            qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d))


def linear(x, w, **kw):
    """``x @ w.T`` by ``tkit.matmul`` (``kw``: its epilogue); float32 on tf32 tensor cores
    only where torch's own matmuls would be (``_common.torch_tf32``)."""
    return tkit.matmul(x, w.t(), allow_tf32=torch_tf32(), **kw)


def layer_tail(o, x, w_o, w_post, w_gu, w_down, eps, o_bias=None, moe=None):
    """Everything after attention: the output projection with the residual ``x`` (and the
    projection's bias, where the model has one) in its epilogue, RMSNorm, gate/up with SwiGLU,
    down with the residual. ``o`` (tokens, heads d). ``moe``: a sparse MLP instead of
    gate/up and down, (w_router (E, H), w_gate_up (E, 2I, H), w_down (E, H, I), top_k,
    renormalize): the router's logits by a GEMM, ``tkit.moe``, the residual added."""
    h = linear(o, w_o, residual=x, bias=o_bias)
    y = tkit.rms_norm(h, w_post, eps)
    if moe is not None:
        w_router, w_gate_up, w_experts_down, top_k, renormalize = moe
        return tkit.add(h, tkit.moe(y, linear(y, w_router), w_gate_up, w_experts_down, top_k,
                                    renormalize=renormalize))
    act = tkit.matmul_glu(y, w_gu.t(), allow_tf32=torch_tf32())  # SwiGLU in the GEMM
    return linear(act, w_down, residual=h)


def qkv_heads(x, w_in, w_qkv, *, heads, kv_heads, eps, qkv_bias=None, q_norm=None,
              k_norm=None):
    """RMSNorm and the fused QKV projection (with its bias: Qwen2's), split into q, k, v
    (tokens, heads, head_dim) views; q and k each normalized over the head dim where the
    model does (Qwen3's ``q_norm`` / ``k_norm``: RMSNorm weights (head_dim,), new tensors)."""
    d = head_dim(w_qkv, heads, kv_heads)
    qkv = linear(tkit.rms_norm(x, w_in, eps), w_qkv, bias=qkv_bias)
    q, k, v = split_qkv(qkv, heads, kv_heads, d)
    if q_norm is not None:
        q = tkit.rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = tkit.rms_norm(k, k_norm, eps)
    return q, k, v


def window_size(window: int) -> tuple[int, int]:
    """The attention ops' window of a causal layer that sees ``window`` keys back (-1: all)."""
    return (window, 0) if window >= 0 else (-1, -1)


def llama_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, *, heads, kv_heads, eps=EPS):
    """One decoder layer over ``x`` (tokens, hidden) of one sequence, causal, from tkit ops:
    RMSNorm, the QKV projection, causal GQA attention (no RoPE), the output projection with
    the residual in its epilogue, RMSNorm, gate/up with SwiGLU, down with the residual."""
    t = x.shape[0]
    d = head_dim(w_qkv, heads, kv_heads)
    qkv = linear(tkit.rms_norm(x, w_in, eps), w_qkv)
    q, k, v = split_qkv(qkv, heads, kv_heads, d)
    o = tkit.flash_attention(q[None], k[None], v[None], causal=True)
    return layer_tail(o.view(t, heads * d), x, w_o, w_post, w_gu, w_down, eps)


def llama_decode_layer(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, k_cache, v_cache, cos_sin, *,
                       positions, slot_mapping, cache_seqlens, block_table=None, heads,
                       kv_heads, eps=EPS, qkv_bias=None, o_bias=None, q_norm=None,
                       k_norm=None, window=-1, moe=None, k_scale=None, v_scale=None):
    """One decode step of a layer from tkit ops.

    ``x`` (batch, hidden) holds one new token of each sequence, at ``positions`` (batch,)
    (or (batch x T, hidden): T new tokens a sequence, sequence-major, with positions,
    slots of that shape; speculative decoding's verification, T <= 16). The
    token's q and k are rotated (neox RoPE of the whole head from ``cos_sin``, the table of
    ``tkit.rope_cache``) and its k and v written into the cache at ``slot_mapping`` (batch,)
    int64 (slot = block * page_size + offset) in one pass (``tkit.rope_append_kv``); then it
    attends to the first ``cache_seqlens`` (batch,) int32 positions of its sequence, itself
    the last of them (``tkit.decode_attention``). ``k_cache``, ``v_cache``: dense (batch,
    max_len, heads_kv, head_dim), or pages (num_blocks, page_size, heads_kv, head_dim) with
    ``block_table`` (batch, max_blocks) int32. Positions, slots and lengths are the caller's,
    as a model runner computes them once a step for every layer. Nine launches, none of which
    reads a value on the host: the step can be captured in a CUDA graph and replayed with
    new tokens, positions, slots and lengths copied into the captured tensors.

    The Llama family's variations: ``qkv_bias`` ((heads + 2 kv_heads) head_dim,: Qwen2) and
    ``o_bias`` in the projections' epilogues, ``q_norm`` / ``k_norm`` (head_dim,: Qwen3's
    RMSNorm of each head before RoPE), ``window`` (a sliding-window layer sees its last
    ``window`` + 1 positions: Mistral, Qwen2's sliding layers; -1 all), ``moe`` (a sparse MLP,
    as :func:`layer_tail` takes it: Mixtral, Qwen3-MoE; ``w_gu`` and ``w_down`` unused).
    ``k_scale``, ``v_scale``: an fp8 cache's scales (``tkit.append_kv``'s forms)."""
    n = x.shape[0]
    b = cache_seqlens.shape[0]
    q, k, v = qkv_heads(x, w_in, w_qkv, heads=heads, kv_heads=kv_heads, eps=eps,
                        qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm)
    d = q.shape[-1]
    tkit.rope_append_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                        k_scale=k_scale, v_scale=v_scale)
    o = tkit.decode_attention(q.view(b, n // b, heads, d), k_cache, v_cache, cache_seqlens,
                              block_table=block_table, window_size=window_size(window),
                              k_scale=k_scale, v_scale=v_scale)
    return layer_tail(o.view(n, heads * d), x, w_o, w_post, w_gu, w_down, eps, o_bias, moe)
