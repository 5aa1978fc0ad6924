"""FlashAttention forward and backward in Triton, with the variants LLMs use.

Math, per batch b and query head h (key/value head ``h // group`` for GQA/MQA):

    S = scale * Q K^T                        (seqlen_q x seqlen_k), scale = 1/sqrt(head_dim)
    S = cap * tanh(S / cap)                  with softcap = cap > 0
    S[i, j] = -inf   unless key j is visible from query i (below)
    P = softmax(S, dim=-1),  O = P V,  lse[i] = logsumexp(S[i, :])

Visibility: keys and queries are aligned to the bottom-right corner, ``shift = seqlen_k -
seqlen_q`` (flash-attn's convention). Key j is visible from query i when
``i + shift - left <= j <= i + shift + right``, where ``window_size = (left, right)`` and -1
means unbounded; ``causal`` is ``right = 0``. A row with no visible key gives O = 0 and
lse = -inf (never NaN).

The forward never materialises S: it walks key blocks with the online softmax (running row max m,
running sum l, rescaling the accumulator by exp(m_old - m_new)), in base 2 with log2(e) folded
into the scale so that each score costs one FMA and one exp2. Key blocks are split in three
ranges per query block: blocks partly visible before the fully visible ones (window's left edge),
the fully visible blocks (no mask arithmetic at all), and blocks partly visible after them (the
causal diagonal, the window's right edge, the ragged end of the keys).

Backward (FlashAttention-2): ``delta[i] = rowsum(dO * O)`` (minus dlse when the lse is used
downstream), then one kernel per key block that recomputes P^T block by block and accumulates
dK and dV, looping over every query head of its GQA group (so dK/dV are reduced over the group
in-kernel, no atomics), and one kernel per query block that accumulates dQ. Both are
deterministic.

Cost model (B batch, H query heads, D head dim): the matmuls are 4*B*H*Sq*Sk*D FLOPs forward
(half that when causal), and the backward does 2.5x the forward's FLOPs (five matmuls instead of
two). HBM traffic is Q, K, V read and O written once, plus K and V re-read once per query block:
about (2*Sq + 2*Sk*ceil(Sq/BLOCK_M)) * B*H*D*itemsize bytes; at S=4096, D=128 and BLOCK_M=128
the intensity is ~ 2*BLOCK_M = 256 FLOP/byte, over the H200's ~170 FLOP/byte balance point:
compute-bound, the ceiling is the tensor cores (cuBLAS bf16 GEMM: 720 TFLOP/s).

Grid: (batch * heads, query blocks) for the forward and dQ, (batch * kv heads, key blocks) for
dK/dV (on sm_90 at D=128 with short tiles the Gluon forward runs persistent instead: one CTA an
SM takes the same tiles in the same order from a counter; ``hopper_config.config_for``).
With a causal mask the forward and dQ run their query blocks last-first, so the longest key
ranges start in the first wave and the short ones fill the tail. The forward walks its tiles
in sections of ``fwd_head_group`` (batch, head) pairs whose K and V fit an 8 MB share of L2
(FlashAttention-3's scheduler does the same with 32 MB). Why: each program streams all of its
head's K/V (2 MB at S=4096, D=128, bf16); in the plain order every head of a query block is in
flight at once (64 heads, 128 MB at the benchmark shape, over the 60 MB L2), so few programs
share a head's K/V while it is in L2. Measured on the H200 (3 interleaved rounds): sections of
4 heads ran 5-16% faster than the plain order, and at least as fast as 16 (see
``_L2_KV_BUDGET``).

Layout: (batch, seqlen, heads, head_dim) with arbitrary strides (q, k, v may be views of one
packed qkv tensor); varlen tensors are (total_tokens, heads, head_dim) with ``cu_seqlens``.
Head dims up to 256; a non-power-of-2 head dim is padded in-kernel to BLOCK_D with masks. Batch,
head and sequence start offsets are 64-bit; offsets inside one (batch, head) stay 32-bit (a
sequence whose elements span 2**31 is refused before the launch). Varlen ``cu_seqlens`` are
clamped in-kernel (see :func:`_varlen_span`), so no value of them reaches outside a tensor.
"""

from __future__ import annotations

import math

import torch

from tkit.kernels import _common as C
from tkit.kernels import _offsets
from tkit.kernels import _plan as P
from tkit.kernels.attention import config as AC
from tkit.kernels.attention.config import (  # noqa: F401  (public)
    AttentionConfig,
    attention_config,
    fwd_head_group,
)
from tkit.kernels.attention.ops import (  # noqa: F401  (public)
    EagerAttention,
    _check_cu,
    _check_inputs,
    _check_sequence_spans,
    _fwd_impl,
    _fwd_op,
    bwd_backend,
    fwd_backend,
    hopper_status,
)


# Public API
# --------------------------------------------------------------------------------------------
def _resolve(q, causal, softmax_scale, window_size, softcap):
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    wl, wr = (int(w) for w in window_size)
    return bool(causal), scale, wl, wr, float(softcap)


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, return_lse=False):
    """Scaled dot-product attention, FlashAttention style (never materialises the scores).

    Parameters
    ----------
    q : Tensor (batch, seqlen_q, heads_q, head_dim), float16, bfloat16 or float32
    k, v : Tensor (batch, seqlen_k, heads_kv, head_dim); heads_q a multiple of heads_kv
        (GQA/MQA). Any strides (e.g. views of one packed qkv tensor).
    causal : bool
        Mask keys after the query, aligned to the bottom-right corner when seqlen_q != seqlen_k.
    softmax_scale : float, optional
        Default 1/sqrt(head_dim).
    window_size : (int, int)
        Sliding window (left, right); -1 is unbounded. Key j is visible from query i when
        ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``.
    softcap : float
        When > 0, scores become ``softcap * tanh(scores / softcap)`` before the softmax.
    return_lse : bool
        Also return the log-sum-exp of each row's scores, float32 (batch, heads_q, seqlen_q).

    Returns
    -------
    out : Tensor like q; or (out, lse). Rows with no visible key give 0 and lse -inf.
    """
    if (P.ON and type(q) is _T and type(k) is _T and type(v) is _T and not _compiling()
            and not (_grad_enabled() and (q.requires_grad or k.requires_grad
                                          or v.requires_grad))
            and not _overrides.value):
        # the eager plan (tkit.kernels._plan): the key holds all the ordinary path reads
        out_lse = P.serve_fast(_plans, (causal, softmax_scale, window_size, softcap),
                               (q, k, v), _flash_attention_slow,
                               (q, k, v, causal, softmax_scale, window_size, softcap))
        return out_lse if return_lse else out_lse[0]
    out_lse = _flash_attention_slow(q, k, v, causal, softmax_scale, window_size, softcap)
    return out_lse if return_lse else out_lse[0]


_T = torch.Tensor
_overrides = AC._OVERRIDES.state  # .value: attention_config overrides in force (this thread)
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()


def _flash_attention_slow(q, k, v, causal, softmax_scale, window_size, softcap):
    """(out, lse) through validation and the launcher (the registered op under autograd)."""
    _check_inputs(q, k, v, False, window_size, softcap, softmax_scale)
    causal, scale, wl, wr, softcap = _resolve(q, causal, softmax_scale, window_size, softcap)
    sq, sk = q.shape[1], k.shape[1]
    _check_sequence_spans(q, k, v, sq, sk)
    if C.use_direct_path(q, k, v):
        out, lse = _fwd_impl(q, k, v, None, None, sq, sk, causal, scale, wl, wr, softcap)
    elif C.eager_autograd():
        out, lse = EagerAttention.apply(q, k, v, sq, sk, causal, scale, wl, wr, softcap)
    else:
        out, lse = _fwd_op(q, k, v, None, None, sq, sk, causal, scale, wl, wr, softcap)
    return out, lse


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           return_lse=False):
    """:func:`flash_attention` over packed sequences of different lengths, without padding.

    Parameters
    ----------
    q : Tensor (total_q, heads_q, head_dim); k, v : Tensor (total_k, heads_kv, head_dim)
    cu_seqlens_q, cu_seqlens_k : int32 Tensor (batch + 1,)
        Cumulative sequence lengths: sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``;
        non-decreasing, from 0 to total_q (total_k).
    max_seqlen_q, max_seqlen_k : int
        At least the longest sequence (sizes the grid; never read from the device).

    cu_seqlens and max_seqlen are checked before the launch when cu_seqlens is on the host
    (always so in the interpreter), and on the device under ``TKIT_CHECK=1``. Unchecked invalid
    values cannot make the kernels touch memory outside the tensors: sequence b takes tokens
    [bound(b), bound(b+1)) where bound(j) is the largest of cu_seqlens[:j+1] clamped to
    [0, total], cut to its first max_seqlen tokens; tokens in no sequence get out = 0,
    lse = -inf, and zero gradients.
    Other options as in :func:`flash_attention`; the lse is (heads_q, total_q).
    """
    _check_inputs(q, k, v, True, window_size, softcap, softmax_scale)
    _check_cu(cu_seqlens_q, "cu_seqlens_q")
    _check_cu(cu_seqlens_k, "cu_seqlens_k")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    C.check_same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if int(m) != m or m < 0:
            raise ValueError(f"{name} must be a non-negative int, got {m!r}")
    for t, x, cu, m in (("q", q, cu_seqlens_q, max_seqlen_q), ("k", k, cu_seqlens_k,
                                                                 max_seqlen_k)):
        if _offsets.values_checked(cu):
            _offsets.check_values(cu, f"cu_seqlens_{t}", x.shape[0], f"{t}.shape[0]", int(m),
                                  f"max_seqlen_{t}")
    # the kernels cut every sequence to max_seqlen: that bounds the offsets inside one
    _check_sequence_spans(q, k, v, min(int(max_seqlen_q), q.shape[0]),
                          min(int(max_seqlen_k), k.shape[0]))
    causal, scale, wl, wr, softcap = _resolve(q, causal, softmax_scale, window_size, softcap)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal,
            scale, wl, wr, softcap)
    if C.use_direct_path(q, k, v):
        out, lse = _fwd_impl(*args)
    else:
        out, lse = _fwd_op(*args)
    return (out, lse) if return_lse else out


def cost(q, k, v, *args, causal=False, backward=False, **kwargs):
    """(bytes, flops) of one call: Q, K, V read and O written once; 4*B*H*Sq*Sk*D FLOPs
    (half when causal), 2.5x that for the backward."""
    from tkit._cost import Cost

    if q.ndim == 4:
        b, sq, h, d = q.shape
        sk = k.shape[1]
        pairs = b * sq * sk
    else:  # varlen: args are cu_seqlens_q, cu_seqlens_k
        cu_q, cu_k = args[0], args[1]
        lq = (cu_q[1:] - cu_q[:-1]).double()
        lk = (cu_k[1:] - cu_k[:-1]).double()
        pairs = float((lq * lk).sum())
        h, d = q.shape[1], q.shape[2]
    flops = 4.0 * pairs * h * d * (0.5 if causal else 1.0)
    nbytes = (q.numel() * 2 + k.numel() + v.numel()) * q.element_size()
    if backward:
        flops *= 2.5
        nbytes *= 2
    return Cost(nbytes, flops)
