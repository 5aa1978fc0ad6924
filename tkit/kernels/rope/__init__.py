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
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels._numerics import fp8_keep_nan, round_to, saturate_fp8
from tkit.kernels.decode import FP8, append_kv_checks

POS_DTYPES = (torch.int32, torch.int64)
CS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RopeConfig:
    """Launch parameters of ``_rope_kernel``.

    block_t: tokens a program (their positions and cos/sin rows are loaded once).
    block_h: heads a tile (a power of 2); the program walks q's, k's (and v's) heads in tiles.
    num_warps: warps a program.
    """

    block_t: int = 4
    block_h: int = 8
    num_warps: int = 4

    @classmethod
    def for_device(cls, rotary_dim: int, max_heads: int) -> RopeConfig:
        """Not measured yet (no GPU run of this kernel so far). The reasoning: a tile of
        block_t x block_h x R/2 pairs is ~4096 elements (8 KiB of bf16 in, 8 out: 16 values,
        two 16-byte vectors a thread per half with 4 warps) and a program walks 10-20 such
        tiles at the bench shape (16384 tokens x (32 + 8) heads x 128): 4096 programs, ~31 a
        SM, few registers (cos/sin and one tile), so many programs share an SM and hide each
        other's latency. The interpreter pays per program: few, large ones."""
        half = C.next_power_of_2(max(1, rotary_dim // 2))
        heads = C.next_power_of_2(max(1, max_heads))
        if _env.INTERPRET:
            return cls(block_t=16, block_h=min(heads, 64), num_warps=4)
        block_h = max(1, min(heads, 16, 2048 // half))
        block_t = max(1, min(16, 2048 // (half * block_h)))
        return cls(block_t=block_t, block_h=block_h, num_warps=4)


_OVERRIDES = C.ConfigOverrides(RopeConfig)


def rope_config(**overrides):
    """Override fields of :class:`RopeConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(rotary_dim: int, max_heads: int) -> RopeConfig:
    cfg = RopeConfig.for_device(rotary_dim, max_heads)
    return _OVERRIDES.apply(cfg)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _rot_offsets(base, d_stride, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 IS_NEOX: tl.constexpr):
    """Offsets of the rotated pairs of a (BLOCK_T, BLOCK_H) set of head rows starting at
    ``base``: neox (a, b) = (x[i], x[HALF + i]), each (T, H, BLOCK_HALF); GPT-J one
    (T, H, 2 * BLOCK_HALF) run x[0 .. 2 * HALF) (returned twice), split into pairs in
    registers (a load of (HALF, 2) offsets compiled to 4-byte accesses on sm_90; a contiguous
    run reshaped after the load gives 16-byte ones)."""
    if IS_NEOX:
        i = tl.arange(0, BLOCK_HALF)
        oa = base[:, :, None] + (i * d_stride)[None, None, :]
        ob = base[:, :, None] + ((i + HALF) * d_stride)[None, None, :]
    else:
        d = tl.arange(0, 2 * BLOCK_HALF)
        oa = base[:, :, None] + (d * d_stride)[None, None, :]
        ob = oa
    return oa, ob


@triton.jit
def _rot_mask(m2, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    if IS_NEOX:
        m3 = m2[:, :, None] & (tl.arange(0, BLOCK_HALF) < HALF)[None, None, :]
    else:
        m3 = m2[:, :, None] & (tl.arange(0, 2 * BLOCK_HALF) < 2 * HALF)[None, None, :]
    return m3


@triton.jit
def _load_rotate(X, base, d_stride, m2, cos, sin, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """The rotated pairs (a', b') in float32, (T, H, BLOCK_HALF) each; zeros where masked."""
    oa, ob = _rot_offsets(base, d_stride, HALF, BLOCK_HALF, IS_NEOX)
    m = _rot_mask(m2, HALF, BLOCK_HALF, IS_NEOX)
    if IS_NEOX:
        a = tl.load(X + oa, mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + ob, mask=m, other=0.0).to(tl.float32)
    else:
        x = tl.load(X + oa, mask=m, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], BLOCK_HALF, 2)))
    c = cos[:, None, :]
    s = sin[:, None, :]
    return a * c - b * s, b * c + a * s


@triton.jit
def _store_rot(Y, base, d_stride, m2, ya, yb, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
               IS_NEOX: tl.constexpr):
    """Store the pairs (already in Y's dtype) where _load_rotate found them."""
    oa, ob = _rot_offsets(base, d_stride, HALF, BLOCK_HALF, IS_NEOX)
    m = _rot_mask(m2, HALF, BLOCK_HALF, IS_NEOX)
    if IS_NEOX:
        tl.store(Y + oa, ya, mask=m)
        tl.store(Y + ob, yb, mask=m)
    else:
        y = tl.reshape(tl.join(ya, yb), (ya.shape[0], ya.shape[1], 2 * BLOCK_HALF))
        tl.store(Y + oa, y, mask=m)


@triton.jit
def _pass_offsets(base, d_stride, m2, START: tl.constexpr, LEN: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    j = tl.arange(0, BLOCK_P)
    off = base[:, :, None] + ((START + j) * d_stride)[None, None, :]
    return off, m2[:, :, None] & (j < LEN)[None, None, :]


@triton.jit
def _quant_scale(amax, QUANT: tl.constexpr, XS, soff, m2):
    """The divisor of an fp8 cache write: the per-tensor scale (QUANT 1) or amax / 448 per
    (token, head), stored at the slot (QUANT 2), as ``tkit.append_kv`` does."""
    if QUANT == 1:
        sc = tl.zeros(amax.shape, tl.float32) + tl.load(XS)
    else:
        sc = tl.where(amax > 0.0, amax / 448.0, 1.0)
        tl.store(XS + soff, sc, mask=m2)
    return sc


@triton.jit
def _to_cache(y, sc, XC, QUANT: tl.constexpr):
    """float32 ``y`` in the cache's dtype: rounded, or divided by the scale and saturated to
    +-448 (NaN kept) for an fp8 cache."""
    if QUANT == 0:
        out = round_to(y, XC.dtype.element_ty)
    else:
        if len(y.shape) == 4:
            r = y / sc[:, :, None, None]
        else:
            r = y / sc[:, :, None]
        r = saturate_fp8(r)
        out = fp8_keep_nan(r)
    return out


@triton.jit
def _absmax(y):
    """max |y| over a head row's values (the last one or two axes) -> (T, H)."""
    a = tl.abs(y)
    if len(y.shape) == 4:
        a = tl.max(a, 3)
    return tl.max(a, 2)


@triton.jit
def _rope_kernel(
    Q, K, V, QO, KO, POS, CS, KC, VC, KS, VS, SLOT,
    T, S, HQ, HK, max_pos, n_slots, page_size,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
    sob, sos, soh, sod, skob, skos, skoh, skod,
    spb, sps, scp, scd, s_slot,
    kcn, kcp, kch, kcd, vcn, vcp, vch, vcd,
    ksn, ksp, ksh, vsn, vsp, vsh,
    HEAD_DIM: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr,
    COPY_PASS: tl.constexpr, APPEND: tl.constexpr, QUANT_K: tl.constexpr,
    QUANT_V: tl.constexpr, INT64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rotate BLOCK_T tokens of q (Q -> QO) and k (K -> KO) and, with APPEND, write the rotated
    k and v (V) into the caches KC / VC at slot SLOT[t].

    Token t is (b, s) = (t // S, t % S): q is addressed as b * sqb + s * sqs + h * sqh +
    d * sqd (S = tokens and sqb = 0 for a (tokens, heads, dim) tensor), likewise k, v, the
    outputs (so*, sko*) and the positions (spb, sps). CS: the (max_pos, ROT) cos/sin table
    (row stride scp, column stride scd). QO/KO may be Q/K themselves (in place); COPY_PASS
    copies x[ROT:HEAD_DIM] to the outputs (out of place). Caches (blocks, page, heads, dim)
    with strides kc*/vc*; QUANT_K/QUANT_V 0 (same dtype), 1 (fp8, per-tensor scale KS/VS) or 2
    (fp8, per-(block, row, head) scales with strides ks*/vs*, computed and stored here).
    """
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    if INT64:
        t = t.to(tl.int64)
    tmask = t < T
    bi = t // S
    si = t - bi * S
    pos = tl.load(POS + bi * spb + si * sps, mask=tmask, other=0)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # never outside the table
    if INT64:
        pos = pos.to(tl.int64)
    else:
        pos = pos.to(tl.int32)
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = HEAD_DIM - ROT
    i = tl.arange(0, BLOCK_HALF)
    cmask = tmask[:, None] & (i < HALF)[None, :]
    crow = pos[:, None] * scp
    cos = tl.load(CS + crow + i[None, :] * scd, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(CS + crow + (i + HALF)[None, :] * scd, mask=cmask, other=0.0).to(tl.float32)
    hr = tl.arange(0, BLOCK_H)

    # q
    for h0 in range(0, HQ, BLOCK_H):
        h = h0 + hr
        m2 = tmask[:, None] & (h < HQ)[None, :]
        xb = bi[:, None] * sqb + si[:, None] * sqs + h[None, :] * sqh
        ob = bi[:, None] * sob + si[:, None] * sos + h[None, :] * soh
        ya, yb = _load_rotate(Q, xb, sqd, m2, cos, sin, HALF, BLOCK_HALF, IS_NEOX)
        _store_rot(QO, ob, sod, m2, round_to(ya, QO.dtype.element_ty),
                   round_to(yb, QO.dtype.element_ty), HALF, BLOCK_HALF, IS_NEOX)
        if COPY_PASS and PASS > 0:
            pi, pm = _pass_offsets(xb, sqd, m2, ROT, PASS, BLOCK_P)
            po, _pm = _pass_offsets(ob, sod, m2, ROT, PASS, BLOCK_P)
            tl.store(QO + po, tl.load(Q + pi, mask=pm), mask=pm)

    if APPEND:
        slot = tl.load(SLOT + t * s_slot, mask=tmask, other=-1).to(tl.int64)
        valid = tmask & (slot >= 0) & (slot < n_slots)
        slot = tl.where(valid, slot, 0)
        blk = slot // page_size
        row = slot - blk * page_size
    # k
    for h0 in range(0, HK, BLOCK_H):
        h = h0 + hr
        m2 = tmask[:, None] & (h < HK)[None, :]
        xb = bi[:, None] * skb + si[:, None] * sks + h[None, :] * skh
        ob = bi[:, None] * skob + si[:, None] * skos + h[None, :] * skoh
        ya, yb = _load_rotate(K, xb, skd, m2, cos, sin, HALF, BLOCK_HALF, IS_NEOX)
        _store_rot(KO, ob, skod, m2, round_to(ya, KO.dtype.element_ty),
                   round_to(yb, KO.dtype.element_ty), HALF, BLOCK_HALF, IS_NEOX)
        if PASS > 0:
            pi, pm = _pass_offsets(xb, skd, m2, ROT, PASS, BLOCK_P)
            if COPY_PASS or APPEND:
                p = tl.load(K + pi, mask=pm)
            if COPY_PASS:
                po, _pm = _pass_offsets(ob, skod, m2, ROT, PASS, BLOCK_P)
                tl.store(KO + po, p, mask=pm)
        if APPEND:
            h64 = h.to(tl.int64)
            cm2 = m2 & valid[:, None]
            cb = blk[:, None] * kcn + row[:, None] * kcp + h64[None, :] * kch
            sc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
            if QUANT_K != 0:
                amax = tl.maximum(_absmax(ya), _absmax(yb))
                if PASS > 0:
                    amax = tl.maximum(amax, _absmax(p.to(tl.float32)))
                soff = blk[:, None] * ksn + row[:, None] * ksp + h64[None, :] * ksh
                sc = _quant_scale(amax, QUANT_K, KS, soff, cm2)
            _store_rot(KC, cb, kcd, cm2, _to_cache(ya, sc, KC, QUANT_K),
                       _to_cache(yb, sc, KC, QUANT_K), HALF, BLOCK_HALF, IS_NEOX)
            if PASS > 0:
                pc, pcm = _pass_offsets(cb, kcd, cm2, ROT, PASS, BLOCK_P)
                tl.store(KC + pc, _to_cache(p.to(tl.float32), sc, KC, QUANT_K), mask=pcm)
    # v: copied (or quantized) into its cache
    if APPEND:
        for h0 in range(0, HK, BLOCK_H):
            h = h0 + hr
            m2 = tmask[:, None] & (h < HK)[None, :]
            h64 = h.to(tl.int64)
            cm2 = m2 & valid[:, None]
            xb = bi[:, None] * svb + si[:, None] * svs + h[None, :] * svh
            vi, vm = _pass_offsets(xb, svd, cm2, 0, HEAD_DIM, BLOCK_D)
            x = tl.load(V + vi, mask=vm, other=0.0).to(tl.float32)
            cb = blk[:, None] * vcn + row[:, None] * vcp + h64[None, :] * vch
            sc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
            if QUANT_V != 0:
                soff = blk[:, None] * vsn + row[:, None] * vsp + h64[None, :] * vsh
                sc = _quant_scale(_absmax(x), QUANT_V, VS, soff, cm2)
            vc, _vcm = _pass_offsets(cb, vcd, cm2, 0, HEAD_DIM, BLOCK_D)
            tl.store(VC + vc, _to_cache(x, sc, VC, QUANT_V), mask=vm)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _bs_strides(x: torch.Tensor) -> tuple[int, int]:
    """(batch stride, token stride) of a (tokens, ...) or (batch, seq, ...) tensor."""
    if x.ndim == 4:
        return x.stride(0), x.stride(1)
    return 0, x.stride(0)


def _pos_strides(positions: torch.Tensor) -> tuple[int, int]:
    if positions.ndim == 2:
        return positions.stride(0), positions.stride(1)
    return 0, positions.stride(0)


def _rope_launch(q, k, qo, ko, positions, cos_sin_cache, is_neox, rotary_dim, *, copy_pass,
                 v=None, k_cache=None, v_cache=None, slot_mapping=None, k_scale=None,
                 v_scale=None) -> None:
    if q.ndim == 4:
        B, S = q.shape[0], q.shape[1]
    else:
        B, S = 1, q.shape[0]
    T = B * S
    hq, d = q.shape[-2], q.shape[-1]
    hk = k.shape[-2]
    if T == 0 or (hq == 0 and hk == 0):
        return
    cfg = current_config(rotary_dim, max(hq, hk))
    append = k_cache is not None
    quant = []
    scales = []
    for cache, s in ((k_cache, k_scale), (v_cache, v_scale)):
        if not append or cache.dtype != FP8:
            quant.append(0)
            scales.append(s)
        elif s is None or s.ndim == 0:
            quant.append(1)
            scales.append(s if s is not None
                          else torch.ones((), dtype=torch.float32, device=q.device))
        else:
            quant.append(2)
            scales.append(s)
    ks, vs = scales
    z4, z3 = (0, 0, 0, 0), (0, 0, 0)
    int64 = C.needs_int64(q, k, qo, ko, positions, cos_sin_cache, v)
    sq, sk, so, sko = (_bs_strides(t) + t.stride()[-2:] for t in (q, k, qo, ko))
    sv = _bs_strides(v) + v.stride()[-2:] if append else z4
    C.launch(
        _rope_kernel, (C.cdiv(T, cfg.block_t),),
        Q=q, K=k, V=v if append else q, QO=qo, KO=ko, POS=positions, CS=cos_sin_cache,
        KC=k_cache if append else q, VC=v_cache if append else q,
        KS=ks if ks is not None else cos_sin_cache, VS=vs if vs is not None else cos_sin_cache,
        SLOT=slot_mapping if append else positions,
        T=T, S=S, HQ=hq, HK=hk, max_pos=cos_sin_cache.shape[0],
        n_slots=k_cache.shape[0] * k_cache.shape[1] if append else 0,
        page_size=k_cache.shape[1] if append else 1,
        **_named("sq", sq, "bshd"), **_named("sk", sk, "bshd"), **_named("sv", sv, "bshd"),
        **_named("so", so, "bshd"), **_named("sko", sko, "bshd"),
        **_named("sp", _pos_strides(positions), "bs"),
        scp=cos_sin_cache.stride(0), scd=cos_sin_cache.stride(1),
        s_slot=slot_mapping.stride(0) if append else 0,
        **_named("kc", k_cache.stride() if append else z4, "nphd"),
        **_named("vc", v_cache.stride() if append else z4, "nphd"),
        **_named("ks", ks.stride() if quant[0] == 2 else z3, "nph"),
        **_named("vs", vs.stride() if quant[1] == 2 else z3, "nph"),
        HEAD_DIM=d, ROT=rotary_dim, IS_NEOX=bool(is_neox), COPY_PASS=bool(copy_pass),
        APPEND=append, QUANT_K=quant[0], QUANT_V=quant[1], INT64=int64,
        BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h,
        BLOCK_HALF=C.next_power_of_2(max(1, rotary_dim // 2)),
        BLOCK_P=C.next_power_of_2(max(1, d - rotary_dim)), BLOCK_D=C.next_power_of_2(d),
        num_warps=cfg.num_warps,
    )


def _named(prefix, strides, dims):
    return {f"{prefix}{c}": s for c, s in zip(dims, strides)}


def _rope_impl(q, k, positions, cos_sin_cache, is_neox, rotary_dim):
    qo = C.empty(q.shape, q.dtype, q.device)
    ko = C.empty(k.shape, k.dtype, k.device)
    _rope_launch(q, k, qo, ko, positions, cos_sin_cache, is_neox, rotary_dim, copy_pass=True)
    return qo, ko


def _rope_inplace_impl(q, k, positions, cos_sin_cache, is_neox, rotary_dim):
    _rope_launch(q, k, q, k, positions, cos_sin_cache, is_neox, rotary_dim, copy_pass=False)


def _rope_append_impl(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                      k_scale, v_scale, is_neox, rotary_dim):
    _rope_launch(q, k, q, k, positions, cos_sin_cache, is_neox, rotary_dim, copy_pass=False,
                 v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                 k_scale=k_scale, v_scale=v_scale)


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("tkit::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin_cache: torch.Tensor, is_neox: bool,
             rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_impl(q, k, positions, cos_sin_cache, is_neox, rotary_dim)


@_rope_op.register_fake
def _(q, k, positions, cos_sin_cache, is_neox, rotary_dim):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


@torch.library.custom_op("tkit::rope_", mutates_args=("q", "k"))
def _rope_inplace_op(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool, rotary_dim: int) -> None:
    _rope_inplace_impl(q, k, positions, cos_sin_cache, is_neox, rotary_dim)


@_rope_inplace_op.register_fake
def _(q, k, positions, cos_sin_cache, is_neox, rotary_dim):
    return None


@torch.library.custom_op("tkit::rope_append_kv",
                         mutates_args=("q", "k", "k_cache", "v_cache", "k_scale", "v_scale"))
def _rope_append_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor],  # noqa: UP045
                    v_scale: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                    is_neox: bool, rotary_dim: int) -> None:
    _rope_append_impl(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                      k_scale, v_scale, is_neox, rotary_dim)


@_rope_append_op.register_fake
def _(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
      is_neox, rotary_dim):
    return None


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _check_rope(q, k, positions, cos_sin_cache, rotary_dim) -> int:
    """Validate; returns the rotary dim."""
    C.check_tensor(q, "q")
    C.check_tensor(k, "k")
    C.check_tensor(positions, "positions", POS_DTYPES)
    C.check_tensor(cos_sin_cache, "cos_sin_cache", CS_DTYPES, ndim=2)
    C.check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be (tokens, heads_q, head_dim) or (batch, seq, heads_q, "
                         f"head_dim), got shape {tuple(q.shape)}")
    if k.ndim != q.ndim or tuple(k.shape[:-2]) != tuple(q.shape[:-2]) \
            or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be q's shape {tuple(q.shape)} with its own heads_kv, got "
                         f"{tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {C.dtype_name(k.dtype)} but q has "
                        f"{C.dtype_name(q.dtype)}; they must match")
    lead = tuple(q.shape[:-2])
    if tuple(positions.shape) != lead:
        raise ValueError(f"positions must have q's leading shape {lead}, got "
                         f"{tuple(positions.shape)}")
    d = q.shape[-1]
    table_dim = cos_sin_cache.shape[1]
    if rotary_dim is None:
        rotary_dim = table_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim = {d}], got "
                         f"{rotary_dim}")
    if table_dim != rotary_dim:
        raise ValueError(f"cos_sin_cache must be (max_position, rotary_dim = {rotary_dim}): "
                         f"cos in the first half of a row, sin in the second; got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.shape[0] == 0:
        raise ValueError("cos_sin_cache has no rows (max_position = 0)")
    from tkit.kernels import _offsets

    if positions.numel() and _offsets.values_checked(positions):
        lo, hi = int(positions.min()), int(positions.max())
        n = cos_sin_cache.shape[0]
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            idx = (positions == bad).nonzero()[0].tolist()
            raise ValueError(f"positions{idx} = {bad} is outside [0, max_position = {n}) "
                             f"(cos_sin_cache has {n} rows); the kernel clamps, but the "
                             f"result would be meaningless")
    return rotary_dim


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
    rotary_dim = _check_rope(q, k, positions, cos_sin_cache, rotary_dim)
    direct = C.use_direct_path(q, k)
    if inplace:
        if direct:
            _rope_inplace_impl(q, k, positions, cos_sin_cache, bool(is_neox), rotary_dim)
        else:
            _rope_inplace_op(q, k, positions, cos_sin_cache, bool(is_neox), rotary_dim)
        return q, k
    if direct:
        return _rope_impl(q, k, positions, cos_sin_cache, bool(is_neox), rotary_dim)
    return _rope_op(q, k, positions, cos_sin_cache, bool(is_neox), rotary_dim)


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
    return q, k


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
