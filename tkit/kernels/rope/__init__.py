"""Rotary position embeddings (RoPE): rotate q and k, optionally fused with the paged KV-cache
write; and the cos/sin table, with the llama3 and YaRN scalings of HF configs.

Math, for a token at position p, a head row x of head_dim D, rotary_dim R <= D (R even),
c_i = cos_sin_cache[p, i] and s_i = cos_sin_cache[p, R/2 + i] for i < R/2:

    neox (rotate halves):   a = x[i],  b = x[R/2 + i]
    GPT-J (interleaved):    a = x[2i], b = x[2i + 1]
                            a' = a c_i - b s_i,   b' = b c_i + a s_i
    x[R:] is left as it is (partial rotary).

Float32 inside whatever the storage dtype (the interpreter's bf16 arithmetic is wrong, and
float32 is what the GPU does anyway), rounded once on store.

Cost model: memory-bound (6 FLOPs per rotated pair). In place, the rotary part of q and k is
read and written once: 2 * tokens * (heads_q + heads_kv) * R * itemsize bytes, plus the
positions and one cache row (R * 4 bytes) per distinct position. Out of place, all of q and k
is read and a new q and k written. ``rope_append_kv`` reads q, k, v, writes the rotary parts
of q and k back and k, v into the cache (in the cache's dtype, plus per-token scales).

Kernel (``_rope_kernel``, one launch for q, k and, fused, v): a program takes BLOCK_T tokens,
loads their positions (clamped to [0, max_position - 1]: no value reads outside the table) and
their cos/sin rows once, then walks q's heads and k's heads (and v's) in tiles of
(BLOCK_T, BLOCK_H, R/2). neox loads the two halves of each head as two contiguous runs; GPT-J
loads the run x[0:R] and splits it into pairs in registers, so every access is a contiguous run
of the head row (16-byte vectors when the head dim's stride is 1: sm_90 PTX of the bench cases
has only ld/st.global.v4 for q and k). Offsets are 32-bit unless some
tensor spans 2**31 elements (``INT64``); cache offsets are always 64-bit (block index x block
stride). The fused cache write uses ``tkit.append_kv``'s format and fp8 rules: per-tensor
``x / scale`` saturated to +-448, or per-(token, head) scales amax / 448 computed here and
stored at the slot; slot -1 (or any slot outside the cache) skips the write.
"""

from __future__ import annotations

import math

import torch

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _offsets
from tkit.kernels import _plan as P
from tkit.kernels.decode.ops import _check_slot_values, append_kv_checks
from tkit.kernels.rope.config import _OVERRIDES, RopeConfig, current_config, rope_config  # noqa: F401  (public)
from tkit.kernels.rope.ops import (
    _check_positions,
    _check_rope,
    _rope_append_impl,
    _rope_append_op,
    _rope_impl,
    _rope_inplace_impl,
    _rope_inplace_op,
    _rope_op,
)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
         cos_sin_cache: torch.Tensor, *, is_neox: bool = True, rotary_dim: int | None = None,
         inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, one launch for both.

    Parameters
    ----------
    q : Tensor
        (tokens, heads_q, head_dim) or (batch, seq, heads_q, head_dim); float32/float16/
        bfloat16, any strides.
    k : Tensor
        Like q with heads_kv heads; q's dtype.
    positions : int32/int64 Tensor
        q's leading shape ((tokens,) or (batch, seq)). Values outside [0, max_position) are
        clamped in the kernel (never read outside the table) and are a ValueError where the
        values are checked (host tensors, and every call under ``TKIT_CHECK=1``).
    cos_sin_cache : Tensor (max_position, rotary_dim)
        cos in the first half of each row, sin in the second (:func:`rope_cache`); float32
        (float16/bfloat16 accepted, used in float32).
    is_neox : bool
        True: rotate halves (x[i], x[R/2 + i]) (Llama, NeoX); False: interleaved pairs
        (x[2i], x[2i + 1]) (GPT-J).
    rotary_dim : int, optional
        R, the leading part of each head that is rotated; default (and must equal)
        ``cos_sin_cache.shape[1]``. x[R:] is left untouched (copied when not in place).
    inplace : bool
        Rotate q and k in place and return them; otherwise return new contiguous tensors.

    Returns
    -------
    (q, k)
    """
    args = (q, k, positions, cos_sin_cache, is_neox, rotary_dim, inplace)
    if (type(rotary_dim) in _ROT_T
            and P.plannable(_OVERRIDES.state.value, q, k, positions, cos_sin_cache)):
        # the eager plan (tkit.kernels._plan): the config follows from the shapes; host
        # positions are still checked per call
        check = _positions_hit_check if _env.CHECK or not positions.is_cuda else None
        out = P.serve_fast(_plans, (is_neox, rotary_dim, inplace),
                           (q, k, positions, cos_sin_cache), _rope_slow, args, check)
    else:
        out = _rope_slow(*args)
    return (q, k) if inplace else out


def _rope_slow(q, k, positions, cos_sin_cache, is_neox, rotary_dim, inplace):
    """The ordinary path of :func:`rope`: None in place (the plan then has no outputs)."""
    rotary_dim = _check_rope(q, k, positions, cos_sin_cache, rotary_dim)
    direct = C.use_direct_path(q, k)
    if inplace:
        if direct:
            _rope_inplace_impl(q, k, positions, cos_sin_cache, bool(is_neox), rotary_dim)
        else:
            _rope_inplace_op(q, k, positions, cos_sin_cache, bool(is_neox), rotary_dim)
        return None
    if direct:
        return _rope_impl(q, k, positions, cos_sin_cache, bool(is_neox), rotary_dim)
    return _rope_op(q, k, positions, cos_sin_cache, bool(is_neox), rotary_dim)


def _positions_hit_check(q, k, positions, cos_sin_cache, *_):
    _check_positions(positions, cos_sin_cache)


_plans = P.new_cache()
_append_plans = P.new_cache()
_ROT_T = (int, type(None))  # a bool equals 1 as a key: the ordinary path checks the type


def rope_append_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, is_neox: bool = True,
                   rotary_dim: int | None = None, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE fused with the KV-cache write: q and k rotated in place (as
    ``rope(..., inplace=True)``), and the rotated k and v written into the (paged) cache, in
    one pass over q, k, v.

    Parameters
    ----------
    q, k, v : Tensor (tokens, heads, head_dim)
        q with heads_q heads, k and v with heads_kv; one float dtype; any strides.
    positions, cos_sin_cache, is_neox, rotary_dim
        As :func:`rope`.
    k_cache, v_cache : Tensor (num_blocks, page_size, heads_kv, head_dim)
        The format of :func:`tkit.append_kv`: k's dtype or float8_e4m3fn.
    slot_mapping : int64 Tensor (tokens,)
        slot = block * page_size + offset; -1 (or any slot outside the cache) skips the write
        (the token is still rotated).
    k_scale, v_scale : float32 Tensor, optional (fp8 caches)
        0-d per-tensor scales (``x / scale`` saturated to +-448), or shaped like the cache
        without head_dim: per (token, head) scales computed here (amax / 448) and stored at
        the slot. An fp8 cache without a scale uses scale 1.

    Returns
    -------
    (q, k): the inputs, rotated.
    """
    args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale,
            v_scale, is_neox, rotary_dim)
    if (type(rotary_dim) in _ROT_T
            and P.plannable(_OVERRIDES.state.value, q, k, v, positions, cos_sin_cache, k_cache,
                            v_cache, slot_mapping, k_scale, v_scale)):
        check = (_rope_append_hit_check
                 if _env.CHECK or not (positions.is_cuda and slot_mapping.is_cuda) else None)
        P.serve_fast(_append_plans, (is_neox, rotary_dim),
                     (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                      k_scale, v_scale), _rope_append_slow, args, check)
    else:
        _rope_append_slow(*args)
    return q, k


def _rope_append_slow(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                      k_scale, v_scale, is_neox, rotary_dim):
    rotary_dim = _check_rope(q, k, positions, cos_sin_cache, rotary_dim)
    if q.ndim != 3:
        raise ValueError(f"q must be (tokens, heads_q, head_dim), got shape {tuple(q.shape)}")
    append_kv_checks(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale,
            v_scale, bool(is_neox), rotary_dim)
    if C.use_direct_path(q, k, v):
        _rope_append_impl(*args)
    else:
        _rope_append_op(*args)


def _rope_append_hit_check(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                           *_):
    _check_positions(positions, cos_sin_cache)
    if _offsets.values_checked(slot_mapping):
        _check_slot_values(slot_mapping, k_cache)


# --------------------------------------------------------------------------------------------
# The cos/sin table
# --------------------------------------------------------------------------------------------
def _inv_freq(rotary_dim: int, base: float, scaling: dict | None,
              max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (R/2,) float64, attention factor) following HF transformers'
    ``ROPE_INIT_FUNCTIONS`` (modeling_rope_utils.py) for the rope types given."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if not scaling:
        return inv, 1.0
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be a dict (an HF config's rope_scaling), got "
                        f"{type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))

    def need(key):
        if key not in scaling:
            raise ValueError(f"scaling of rope_type {kind!r} needs {key!r}; got keys "
                             f"{sorted(scaling)}")
        return scaling[key]

    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(need("factor")), 1.0
    if kind == "llama3":
        factor = float(need("factor"))
        low = float(need("low_freq_factor"))
        high = float(need("high_freq_factor"))
        old_len = float(need("original_max_position_embeddings"))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_l), 1.0
    if kind == "yarn":
        factor = float(need("factor"))
        old_len = float(scaling.get("original_max_position_embeddings") or max_position)
        attn = scaling.get("attention_factor")
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attn is None:
            if mscale and mscale_all:
                attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            else:
                attn = get_mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def corr_dim(rot):
            return (rotary_dim * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001  # as HF: no division by zero
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp  # 1: keep the original frequency (high frequencies)
        inv_interp = inv / factor
        return inv_interp * (1 - extrapolation) + inv * extrapolation, float(attn)
    raise ValueError(f"scaling rope_type {kind!r} is not supported (default, linear, llama3, "
                     f"yarn)")


def rope_cache(max_position: int, rotary_dim: int, base: float = 10000.0,
               scaling: dict | None = None, *, device=None) -> torch.Tensor:
    """The (max_position, rotary_dim) float32 cos/sin table of :func:`rope`: row p is
    ``[cos(p * f_0) ... cos(p * f_{R/2-1}), sin(p * f_0) ... sin(p * f_{R/2-1})]`` times the
    scaling's attention factor, with f_i = base ** (-2i / R).

    ``scaling`` is an HF config's ``rope_scaling`` dict: ``rope_type`` (or ``type``)
    "default", "linear" (``factor``), "llama3" (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``) or "yarn" (``factor``,
    optional ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``, ``attention_factor``, ``truncate``), following transformers'
    ``ROPE_INIT_FUNCTIONS``. YaRN takes ``factor`` from the dict (as vLLM does); recent
    transformers recompute it as max_position_embeddings / original_max_position_embeddings
    when the latter is given, the same number for consistent configs (DeepSeek-V3: 163840 /
    4096 = 40). Angles are computed in float64 and rounded once (HF multiplies positions by
    the frequencies in float32, off by up to ~1e-2 radians at position 131072).
    """
    if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position < 1:
        raise ValueError(f"max_position must be a positive int, got {max_position!r}")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 \
            or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if not base > 0:
        raise ValueError(f"base must be positive, got {base!r}")
    inv, attn = _inv_freq(rotary_dim, float(base), scaling, max_position)
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    table = torch.cat([ang.cos(), ang.sin()], dim=1) * attn
    return table.to(torch.float32).to(device) if device is not None else table.float()


def cost(q, k, positions=None, cos_sin_cache=None, *, inplace=False, rotary_dim=None,
         **kw):
    """Bytes of one :func:`rope` call: in place the rotary part of q and k read and written,
    out of place all of q and k read and written; positions and one table row a token."""
    from tkit._cost import Cost

    d = q.shape[-1]
    r = rotary_dim or (cos_sin_cache.shape[1] if cos_sin_cache is not None else d)
    n = (q.numel() + k.numel()) // max(d, 1)  # head rows
    e = q.element_size()
    moved = 2 * n * (r if inplace else d) * e
    t = positions.numel() if positions is not None else 0
    rows = min(t, cos_sin_cache.shape[0]) if cos_sin_cache is not None else 0
    extra = t * (positions.element_size() if positions is not None else 0) + rows * r * 4
    return Cost(moved + extra, 3 * n * r)
