"""RoPE's launcher, argument checks and torch.library registrations (``tkit::rope``,
``tkit::rope_``, ``tkit::rope_append_kv``) with their fakes."""

from __future__ import annotations

from typing import Optional

import torch

from tkit.kernels import _common as C
from tkit.kernels import _register as R
from tkit.kernels.decode.config import FP8
from tkit.kernels.rope._kernels import _rope_kernel
from tkit.kernels.rope.config import CS_DTYPES, POS_DTYPES, current_config


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
    append = k_cache is not None
    cfg = current_config(rotary_dim, max(hq, hk), append)
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
@R.custom_op("tkit::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin_cache: torch.Tensor, is_neox: bool,
             rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_impl(q, k, positions, cos_sin_cache, is_neox, rotary_dim)


@_rope_op.register_fake
def _(q, k, positions, cos_sin_cache, is_neox, rotary_dim):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


@R.custom_op("tkit::rope_", mutates_args=("q", "k"))
def _rope_inplace_op(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool, rotary_dim: int) -> None:
    _rope_inplace_impl(q, k, positions, cos_sin_cache, is_neox, rotary_dim)


@_rope_inplace_op.register_fake
def _(q, k, positions, cos_sin_cache, is_neox, rotary_dim):
    return None


@R.custom_op("tkit::rope_append_kv",
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
    _check_positions(positions, cos_sin_cache)
    return rotary_dim


def _check_positions(positions, cos_sin_cache) -> None:
    """Positions inside the table, where their values are checked (host tensors, or
    TKIT_CHECK=1)."""
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


