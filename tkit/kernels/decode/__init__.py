"""Decode attention over a (paged) KV cache, writing new tokens into it, merging partial states.

Math, per sequence b, query head h (key/value head ``hk = h // group``), new token i of
``seqlen_q`` (1 to 16; speculative decoding verifies several at once):

    L = cache_seqlens[b]                      valid tokens, the new ones included
    key j (0 <= j < L) is at position j of the sequence; query i at position L - seqlen_q + i
    S[i, j] = scale * q[i] . k[j]             (k dequantized: k8[j] * k_scale)
    S = cap * tanh(S / cap)                   with softcap = cap > 0
    S[i, j] = -inf  unless j is visible from i: causal bottom-right, ``window_size`` as in
                    :func:`tkit.flash_attention` (shift = L - seqlen_q)
    O[i] = softmax(S[i]) V,  lse[i] = logsumexp(S[i]);  no visible key: O = 0, lse = -inf

Cache layouts: dense ``(batch, max_len, heads_kv, head_dim)``, or paged ``(num_blocks,
page_size, heads_kv, head_dim)`` with ``block_table`` (batch, max_blocks) int32: position j of
sequence b lives in block ``block_table[b, j // page_size]`` at offset ``j % page_size``. Pages
may come in any order and may be shared by several sequences.

Cost model: decode is memory-bound. One call reads K and V of every valid token once
(2 * sum(L) * heads_kv * head_dim * itemsize bytes, plus the scales of an fp8 cache) and q, and
writes O; the FLOPs are 4 * sum(L) * heads_q * seqlen_q * head_dim, i.e. about
``2 * group * seqlen_q / itemsize`` FLOP/byte (group 4, bf16: 4 FLOP/byte, far below the H200's
~170): the ceiling is the copy bandwidth, and every design choice below is about reading each KV
byte exactly once with enough bytes in flight.

Kernel design:

* GQA packing: one program takes every query row of one (sequence, kv head): the ``seqlen_q *
  group`` rows (row r = query ``r // group``, head ``hk * group + r % group``) are one M tile,
  padded to >= 16 for ``tl.dot``, so each K/V byte is read once for the whole group (more than
  ``block_m`` rows take several M tiles, which read the same keys at the same time, from L2).
* Keys in tiles of ``block_n`` (64) positions whatever the page size: a tile inside one page
  (page_size >= block_n) reads one block-table entry; smaller pages gather the tile across
  ``block_n / page_size`` pages through the block table. Addresses are 64-bit (block index x
  block stride can pass 2**31 elements).
* Split-KV (flash-decoding): the grid is (splits x M tiles, kv heads, batch); split s of a
  sequence takes the s-th of ``num_splits`` equal runs of its *actual* key tiles (read from
  ``cache_seqlens`` on the device) and writes a partial O and LSE in float32; a second kernel
  combines the splits by their LSEs. With one split the first kernel writes O directly.
  ``num_splits`` is chosen on the host from the SM count, batch, kv heads and the *largest
  possible* length (the cache or block-table shape): no host sync, so a call can be captured in
  a CUDA graph at the largest shapes and replayed with new lengths and tables.
* Online softmax in base 2 with log2(e) folded into the scale (one FMA and one exp2 a score),
  float32 accumulation; fp8 caches are converted to the query's dtype in registers, per-tensor
  scales folded into the score scale (K) and the output (V), per-token-head scales applied to
  the scores (K) and to the probabilities (V) of each key, never to the K/V tiles.
* Masks cost nothing where they cannot matter: each program's key range is cut in three (tiles
  partly visible at a window's left edge, fully visible tiles, tiles partly visible at the
  causal diagonal / the end of the sequence); only the outer two evaluate a mask.

Memory safety: no value of ``cache_seqlens`` or ``block_table`` makes a kernel read outside the
cache: lengths are clamped to [0, max_len] in-kernel, key positions past the length are clamped
to the last valid one (and masked), block indices to [0, num_blocks - 1]; ``append_kv`` skips a
slot outside the cache as it skips -1. The public functions check shapes, dtypes and page sizes
always, and the values of these tensors where that costs no sync (host tensors, hence always in
the interpreter) or under ``TKIT_CHECK=1``.
"""

from __future__ import annotations

import math

import torch

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _plan as P
from tkit.kernels.decode.config import (  # noqa: F401  (public)
    _APPEND_OVERRIDES,
    _OVERRIDES,
    Q_DTYPES,
    AppendConfig,
    DecodeConfig,
    append_config,
    choose_num_splits,
    current_config,
    decode_config,
)
from tkit.kernels.decode.ops import (
    _append_impl,
    _append_op,
    _check_decode,
    _check_decode_values,
    _check_slot_values,
    _decode_impl,
    _decode_op,
    _merge_impl,
    _merge_op,
    append_kv_checks,
    plan_splits,  # noqa: F401  (public)
)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None,
                     softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                     k_scale=None, v_scale=None, num_splits=None, return_lse=False):
    """Attention of a few new tokens per sequence over a KV cache (dense or paged).

    Parameters
    ----------
    q : Tensor (batch, seqlen_q, heads_q, head_dim), float16, bfloat16 (float32 for tests)
        seqlen_q from 1 to 16; the new tokens are the last seqlen_q positions of each sequence.
    k_cache, v_cache : Tensor
        Dense (batch, max_len, heads_kv, head_dim) when ``block_table`` is None; paged
        (num_blocks, page_size, heads_kv, head_dim) otherwise, page_size a power of 2 from 1
        to 256. q's dtype, or float8_e4m3fn (dequantized in-kernel with ``k_scale`` /
        ``v_scale``). heads_q must be a multiple of heads_kv (GQA/MQA). Any strides.
    cache_seqlens : int32 Tensor (batch,), on the device
        Valid tokens per sequence, the new ones included; 0 gives out = 0 and lse = -inf.
    block_table : int32 Tensor (batch, max_blocks), optional
        Page j of sequence b is block ``block_table[b, j]``; any order, pages may be shared.
    softmax_scale : float, optional
        Default 1/sqrt(head_dim).
    causal : bool
        Bottom-right causal mask among the new tokens (query i sees keys up to position
        ``cache_seqlens - seqlen_q + i``).
    window_size : (int, int)
        Sliding window (left, right), -1 unbounded, as in :func:`tkit.flash_attention`.
    softcap : float
        When > 0, scores become ``softcap * tanh(scores / softcap)``.
    k_scale, v_scale : float32 Tensor, optional
        For float8_e4m3fn caches: 0-d (per tensor), or shaped like the cache without head_dim
        (per token and head). The value is ``cache.float() * scale``.
    num_splits : int, optional
        Split-KV count; default chosen from the SM count, batch, heads and the largest
        possible length (the cache's shape), never from ``cache_seqlens`` (no host sync: the
        call can be captured in a CUDA graph and replayed with new lengths and tables).
    return_lse : bool
        Also return the log-sum-exp of each row's scores, float32 (batch, heads_q, seqlen_q).

    Values of ``cache_seqlens`` and ``block_table`` are checked where that costs no sync (host
    tensors) or under TKIT_CHECK=1; unchecked, out-of-range values are clamped in-kernel (a
    length to [0, max_len], a block index to [0, num_blocks - 1]) and never read outside the
    cache.

    Returns
    -------
    out : Tensor like q; or (out, lse).
    """
    if (P.ON and type(q) is _T and type(k_cache) is _T and type(v_cache) is _T
            and type(cache_seqlens) is _T and type(block_table) in _OPT_T
            and type(k_scale) in _OPT_T and type(v_scale) in _OPT_T
            and not _overrides.value and not _compiling()
            and not (_grad_enabled() and q.requires_grad)):
        # the eager plan (tkit.kernels._plan): the key holds all the ordinary path reads (the
        # SM count and config follow from the device index and the shapes)
        # the lengths' and the table's values are read per call: checked before a plan's
        # launches where that costs no sync (host tensors) or under TKIT_CHECK=1
        check = _decode_hit_check if _env.CHECK or not cache_seqlens.is_cuda else None
        out_lse = P.serve_fast(_plans, (causal, softmax_scale, window_size, softcap, num_splits),
                               (q, k_cache, v_cache, cache_seqlens, block_table, k_scale,
                                v_scale), _decode_slow,
                               (q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                                causal, window_size, softcap, k_scale, v_scale, num_splits),
                               check)
        return out_lse if return_lse else out_lse[0]
    out, lse = _decode_slow(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                            causal, window_size, softcap, k_scale, v_scale, num_splits)
    return (out, lse) if return_lse else out


_T = torch.Tensor
_OPT_T = (torch.Tensor, type(None))
_overrides = _OVERRIDES.state  # .value: decode_config overrides in force (this thread)
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()


def _decode_hit_check(q, k_cache, v_cache, cache_seqlens, block_table, *_):
    _check_decode_values(k_cache, cache_seqlens, block_table,
                         k_cache.shape[1] if block_table is None
                         else block_table.shape[1] * k_cache.shape[1])


def _decode_slow(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal,
                 window_size, softcap, k_scale, v_scale, num_splits):
    """(out, lse) through validation and the launcher (the registered op when needed)."""
    _check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale,
                  window_size, softcap, softmax_scale, num_splits)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    wl, wr = (int(w) for w in window_size)
    if causal:
        wr = 0
    splits = int(num_splits) if num_splits is not None else 0
    args = (q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, scale, wl, wr,
            float(softcap), splits)
    if C.use_direct_path(q):
        return _decode_impl(*args)
    return _decode_op(*args)


def append_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Write new tokens' keys and values into a (paged) KV cache, in place.

    Parameters
    ----------
    k, v : Tensor (tokens, heads_kv, head_dim)
    k_cache, v_cache : Tensor (num_blocks, page_size, heads_kv, head_dim)
        (a dense (batch, max_len, ...) cache is the same with page_size = max_len). A
        float8_e4m3fn cache is written quantized: ``x / scale`` saturated to +-448.
    slot_mapping : int64 Tensor (tokens,)
        slot = block * page_size + offset; -1 skips a token (a slot outside the cache is
        skipped too, and is an error where the values are checked).
    k_scale, v_scale : float32 Tensor, optional (fp8 caches)
        0-d: the given per-tensor scale; shaped like the cache without head_dim: per token and
        head, computed here (amax over head_dim / 448) and stored at the token's slot.
    """
    if (P.ON and type(k) is _T and type(v) is _T and type(k_cache) is _T
            and type(v_cache) is _T and type(slot_mapping) is _T and type(k_scale) in _OPT_T
            and type(v_scale) in _OPT_T and not _append_overrides.value and not _compiling()
            and not (_grad_enabled() and (k.requires_grad or v.requires_grad))):
        # the eager plan: no outputs, the launches write the caches (and per-token scales)
        check = _append_hit_check if _env.CHECK or not slot_mapping.is_cuda else None
        args = (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        P.serve_fast(_append_plans, (), args, _append_slow, args, check)
        return
    _append_slow(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


_append_plans = P.new_cache()
_append_overrides = _APPEND_OVERRIDES.state  # .value: append_config overrides in force


def _append_hit_check(k, v, k_cache, v_cache, slot_mapping, *_):
    _check_slot_values(slot_mapping, k_cache)


def _append_slow(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    append_kv_checks(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if C.use_direct_path(k, v):
        _append_impl(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        _append_op(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """Combine two partial attentions over disjoint key sets (shared prefix + suffix, cascade
    decoding, split-KV): ``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a - lse) o_a +
    exp(lse_b - lse) o_b``; both -inf gives o = 0, lse = -inf.

    Parameters
    ----------
    o_a, o_b : Tensor (batch, seqlen, heads, head_dim) (or (tokens, heads, head_dim))
    lse_a, lse_b : float32 Tensor (batch, heads, seqlen) (or (heads, tokens)), as returned by
        ``decode_attention(..., return_lse=True)`` / :func:`tkit.flash_attention`.

    Returns
    -------
    (o, lse): o in o_a's dtype, lse float32.
    """
    if (P.ON and type(o_a) is _T and type(lse_a) is _T and type(o_b) is _T
            and type(lse_b) is _T and not _compiling()
            and not (_grad_enabled() and (o_a.requires_grad or o_b.requires_grad
                                          or lse_a.requires_grad or lse_b.requires_grad))):
        args = (o_a, lse_a, o_b, lse_b)
        return P.serve_fast(_merge_plans, (), args, _merge_slow, args)
    return _merge_slow(o_a, lse_a, o_b, lse_b)


_merge_plans = P.new_cache()


def _merge_slow(o_a, lse_a, o_b, lse_b):
    C.check_tensor(o_a, "o_a", Q_DTYPES)
    C.check_tensor(o_b, "o_b", Q_DTYPES)
    C.check_tensor(lse_a, "lse_a", (torch.float32,))
    C.check_tensor(lse_b, "lse_b", (torch.float32,))
    C.check_same_device(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if o_a.ndim not in (3, 4):
        raise ValueError(f"o_a must be (batch, seqlen, heads, head_dim) or (tokens, heads, "
                         f"head_dim), got shape {tuple(o_a.shape)}")
    if o_b.shape != o_a.shape:
        raise ValueError(f"o_b must have o_a's shape {tuple(o_a.shape)}, got "
                         f"{tuple(o_b.shape)}")
    want = (o_a.shape[1], o_a.shape[0]) if o_a.ndim == 3 else \
        (o_a.shape[0], o_a.shape[2], o_a.shape[1])
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} for o_a of shape "
                             f"{tuple(o_a.shape)}, got {tuple(t.shape)}")
    if C.use_direct_path(o_a, o_b, lse_a, lse_b):
        return _merge_impl(o_a, lse_a, o_b, lse_b)
    return _merge_op(o_a, lse_a, o_b, lse_b)


def cost(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_scale=None, v_scale=None,
         **kw):
    """(bytes, flops) of one call: K and V of every valid token read once (and their
    per-token scales), q read and out written; 4 * sum(L) * heads_q * seqlen_q * head_dim
    FLOPs. Reads ``cache_seqlens`` (host code for reports, never on the call path)."""
    from tkit._cost import Cost

    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    max_len = k_cache.shape[1] if block_table is None else \
        block_table.shape[1] * k_cache.shape[1]
    tokens = float(cache_seqlens.clamp(0, max_len).sum()) if cache_seqlens.numel() else 0.0
    kv = 2.0 * tokens * hk * d * k_cache.element_size()
    for s in (k_scale, v_scale):
        if s is not None and s.ndim > 0:
            kv += tokens * hk * 4
    nbytes = kv + 2.0 * q.numel() * q.element_size()
    return Cost(nbytes, 4.0 * tokens * hq * sq * d)
