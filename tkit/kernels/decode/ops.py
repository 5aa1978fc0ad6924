"""The decode family's argument checks, launchers (:func:`plan_splits`, decode, append, merge)
and torch.library registrations (``tkit::decode_attention``, ``tkit::append_kv``,
``tkit::merge_attention_states``) with their fakes."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels import _register as R
from tkit.kernels.decode._kernels import (
    _append_kv_kernel,
    _decode_combine_kernel,
    _decode_split_kernel,
    _merge_states_kernel,
)
from tkit.kernels.decode.config import (
    CACHE_DTYPES,
    FP8,
    LOG2E,
    MAX_HEAD_DIM,
    MAX_SEQLEN_Q,
    MAX_SPLITS,
    Q_DTYPES,
    QKS,
    DecodeConfig,
    choose_num_splits,
    current_append_config,
    current_config,
)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _values_checked(t: torch.Tensor) -> bool:
    from tkit.kernels import _offsets

    return _offsets.values_checked(t)


def _check_scale(s, name: str, cache: torch.Tensor, cache_name: str) -> int:
    """0 (none), 1 (per tensor) or 2 (per token and head) for an fp8 cache's scale."""
    if s is None:
        return 0
    C.check_tensor(s, name, (torch.float32,))
    if cache.dtype != FP8:
        raise ValueError(f"{name} is given but {cache_name} is {C.dtype_name(cache.dtype)}; "
                         "scales go with float8_e4m3fn caches")
    if s.ndim == 0:
        return 1
    if tuple(s.shape) != tuple(cache.shape[:-1]):
        raise ValueError(f"{name} must be a 0-d float32 tensor (per tensor) or shaped like "
                         f"{cache_name} without head_dim {tuple(cache.shape[:-1])} (per token "
                         f"and head), got shape {tuple(s.shape)}")
    return 2


def _check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale,
                  window_size, softcap, softmax_scale, num_splits):
    C.check_tensor(q, "q", Q_DTYPES, ndim=4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        C.check_tensor(t, name, CACHE_DTYPES, ndim=4)
    C.check_tensor(cache_seqlens, "cache_seqlens", (torch.int32,), ndim=1)
    C.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                        block_table=block_table, k_scale=k_scale, v_scale=v_scale)
    b, sq, hq, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must share a dtype, got "
                        f"{C.dtype_name(k_cache.dtype)} and {C.dtype_name(v_cache.dtype)}")
    if k_cache.dtype != FP8 and k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache has dtype {C.dtype_name(k_cache.dtype)} but q has "
                        f"{C.dtype_name(q.dtype)}: a 16-bit cache must match q's dtype "
                        "(float8_e4m3fn caches take any q dtype)")
    if b > 65535:  # the grid's batch axis (CUDA's limit on grid y and z)
        raise ValueError(f"q: batch = {b} is more than 65535 sequences a call")
    if not 1 <= sq <= MAX_SEQLEN_Q:
        raise ValueError(f"q: seqlen_q = {sq} (q.shape[1]) must be from 1 to {MAX_SEQLEN_Q}")
    if k_cache.shape[-1] != d:
        raise ValueError(f"q and k_cache must have the same head_dim, got {d} and "
                         f"{k_cache.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim {d} is not supported (1 to {MAX_HEAD_DIM})")
    hk = k_cache.shape[2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hk} key/value heads of "
                         "k_cache (GQA/MQA needs heads_q = group * heads_kv)")
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must have batch = {b} entries, got shape "
                         f"{tuple(cache_seqlens.shape)}")
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"k_cache is dense (no block_table): (batch, max_len, heads_kv, "
                             f"head_dim) with batch = {b}, got shape {tuple(k_cache.shape)}")
        max_len = k_cache.shape[1]
    else:
        C.check_tensor(block_table, "block_table", (torch.int32,), ndim=2)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must be (batch = {b}, max_blocks), got shape "
                             f"{tuple(block_table.shape)}")
        p = k_cache.shape[1]
        if not (1 <= p <= 256 and p & (p - 1) == 0):
            raise ValueError(f"k_cache: page_size = {p} (k_cache.shape[1]) must be a power of "
                             "2 from 1 to 256")
        max_len = block_table.shape[1] * p
    ks = _check_scale(k_scale, "k_scale", k_cache, "k_cache")
    vs = _check_scale(v_scale, "v_scale", v_cache, "v_cache")
    C.check_attention_options(window_size, softcap, softmax_scale)
    if num_splits is not None and (int(num_splits) != num_splits or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1 (or None: chosen), got {num_splits!r}")
    if _values_checked(cache_seqlens):
        _check_decode_values(k_cache, cache_seqlens, block_table, max_len)
    return ks, vs, max_len


def _check_decode_values(k_cache, cache_seqlens, block_table, max_len) -> None:
    """The values of ``cache_seqlens`` (and of the pages they use in ``block_table``), read on
    the host: called where :func:`_values_checked` says so."""
    lens = cache_seqlens.tolist()
    for i, n in enumerate(lens):
        if not 0 <= n <= max_len:
            what = "k_cache.shape[1]" if block_table is None else \
                "block_table.shape[1] * page_size"
            raise ValueError(f"cache_seqlens[{i}] = {n} is outside [0, {what} = {max_len}]")
    if block_table is not None and _values_checked(block_table):
        p, nb = k_cache.shape[1], k_cache.shape[0]
        rows = block_table.tolist()
        for i, n in enumerate(lens):
            for j in range((n + p - 1) // p):
                if not 0 <= rows[i][j] < nb:
                    raise ValueError(f"block_table[{i}, {j}] = {rows[i][j]} is outside "
                                     f"[0, num_blocks = {nb}) (a page of the "
                                     f"{n} tokens of sequence {i})")


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def plan_splits(q, k_cache, block_table, num_splits: int = 0,
                config: DecodeConfig | None = None,
                fp8_mma: bool = True) -> tuple[int, DecodeConfig, int, int]:
    """(num_splits, config, BLOCK_M, M tiles) for a call, from shapes only (never the lengths:
    no host sync). ``fp8_mma=False``: the default as if the fp8 wgmma could not run."""
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    size, paged = k_cache.element_size(), block_table is not None
    sms = D.sm_count(q.device)
    page = k_cache.shape[1] if paged else 0
    fp8_mma = (fp8_mma and size == 1 and q.dtype in (torch.float16, torch.bfloat16)
               and sq * (hq // max(hk, 1)) <= 8 and D.capability(q.device)[0] == 9)
    cfg = config or current_config(d, size, paged, b * hk if fp8_mma else 0, sms, page,
                                   fp8_mma)
    if block_table is None:
        max_len = k_cache.shape[1]
    else:
        max_len = block_table.shape[1] * k_cache.shape[1]
    n_rows = sq * (hq // hk)

    def plan(cfg):
        if cfg.qk == "wgmma_fp8" and size == 1:
            # the transposed fp8 scores: 8 or 16 query rows a tile (hi and lo parts: N = 16
            # or 32)
            block_m = max(8, min(C.next_power_of_2(n_rows), cfg.block_m, 16))
        else:
            block_m = max(16, min(C.next_power_of_2(n_rows), cfg.block_m))
        n_m = C.cdiv(n_rows, block_m)
        n_tiles = C.cdiv(max_len, cfg.block_n)
        splits = num_splits or cfg.num_splits
        if not splits:
            kv_bytes = 2 * max_len * d * size
            splits = choose_num_splits(b * hk * n_m, n_tiles, sms, ctas_per_sm=cfg.ctas_per_sm,
                                       min_splits=C.cdiv(kv_bytes, cfg.split_bytes))
        splits = max(1, min(int(splits), MAX_SPLITS, max(n_tiles, 1)))
        return splits, block_m, n_m

    splits, block_m, n_m = plan(cfg)
    if config is None and fp8_mma and cfg.qk == "wgmma_fp8" and splits > 1:
        # the wgmma default is measured unsplit only: the word pipeline where it would split
        return plan_splits(q, k_cache, block_table, num_splits, fp8_mma=False)
    if config is None and not paged:  # the dense default depends on the grid it makes
        wide = current_config(d, size, paged, b * hk * n_m * splits, sms, page)
        if wide != cfg:
            cfg = wide
            splits, block_m, n_m = plan(cfg)
    return splits, cfg, block_m, n_m


def _decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, scale,
                 window_left, window_right, softcap, num_splits=0, config=None):
    """Launch the decode kernels; returns (out, lse). ``window_right`` already 0 when causal.
    ``cache_seqlens`` None with a dense cache: every sequence holds all its keys. Arguments are
    not validated here (the public function does it)."""
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    paged = block_table is not None
    out = C.empty(q.shape, q.dtype, q.device)
    lse = C.empty((b, hq, sq), torch.float32, q.device)
    if b == 0 or hq == 0 or sq == 0:
        return out, lse
    splits, cfg, block_m, n_m = plan_splits(q, k_cache, block_table, num_splits, config)
    if paged:
        max_len = block_table.shape[1] * k_cache.shape[1]
        page, n_blocks = k_cache.shape[1], k_cache.shape[0]
        bt, bt_strides = block_table, block_table.stride()
    else:
        max_len, page, n_blocks = k_cache.shape[1], 1, b
        bt, bt_strides = (cache_seqlens if cache_seqlens is not None else q), (0, 0)
    block_d = max(16, C.next_power_of_2(d))
    scale_k = 0 if k_scale is None else (1 if k_scale.ndim == 0 else 2)
    scale_v = 0 if v_scale is None else (1 if v_scale.ndim == 0 else 2)
    ks_strides = k_scale.stride() if scale_k == 2 else (0, 0, 0)
    vs_strides = v_scale.stride() if scale_v == 2 else (0, 0, 0)
    if softcap > 0.0:
        qk_scale, cap_scale = softcap * LOG2E, scale / softcap
    else:
        qk_scale, cap_scale = scale * LOG2E, 1.0
    # fp8 caches read as int32 words of 4 values, where the layout allows
    # (a tile's row offsets are 32-bit: block_n row strides below 2**31)
    word_layout = block_d >= 64 and _fp8_words(k_cache, v_cache)
    row_stride = max(k_cache.stride(1), v_cache.stride(1), ks_strides[1], vs_strides[1])
    words = word_layout and row_stride * cfg.block_n < 2**31
    same = k_cache.stride() == v_cache.stride() and ks_strides == vs_strides
    if cfg.qk not in QKS:
        raise ValueError(f"DecodeConfig: qk = {cfg.qk!r} must be one of {QKS}")
    qk_wg = (cfg.qk == "wgmma_fp8" and words and d == block_d and q.dtype != torch.float32
             and _sm90_or_interpreter(q.device))
    if cfg.qk == "wgmma_fp8" and not qk_wg:  # the MMA path's M tiles (16 rows or more)
        # (a default planned for the wgmma falls back to the default without it: its own
        # tiles, so everything derived from the config is derived again below)
        base = config or plan_splits(q, k_cache, block_table, num_splits, fp8_mma=False)[1]
        splits, cfg, block_m, n_m = plan_splits(q, k_cache, block_table, num_splits,
                                                dataclasses.replace(base, qk="mma"))
        words = word_layout and row_stride * cfg.block_n < 2**31
    # an override of block_n alone
    sub_n = min(cfg.sub_n or cfg.block_n, cfg.block_n)
    if sub_n < 16 or cfg.block_n % sub_n or sub_n & (sub_n - 1):
        raise ValueError(f"DecodeConfig: sub_n = {cfg.sub_n} must be a power of 2 >= 16 that "
                         f"divides block_n = {cfg.block_n}")
    if cfg.combine not in COMBINES:
        raise ValueError(f"DecodeConfig: combine = {cfg.combine!r} must be one of {COMBINES}")
    fused = splits > 1 and cfg.combine != "launch"
    if splits == 1:
        o_part, l_part = out, lse
        o_st, l_st = out.stride(), lse.stride()
        o_split, l_split = 0, 0
    else:
        # scratch: written in full by the split kernel before the combine reads it (an eager
        # plan allocates it afresh per call)
        o_part = C.scratch((b, sq, hq, splits, d), torch.float32, q.device)
        l_part = C.scratch((b, hq, sq, splits), torch.float32, q.device)
        s = o_part.stride()
        o_st, o_split = (s[0], s[1], s[2], s[4]), s[3]
        s = l_part.stride()
        l_st, l_split = s[:3], s[3]
    C.launch(
        _decode_split_kernel, (splits * n_m, hk, b),
        Q=q, K=k_cache, V=v_cache, KS=k_scale if scale_k else q, VS=v_scale if scale_v else q,
        SEQLENS=cache_seqlens, BT=bt, O=o_part, LSE=l_part,
        **_named("sq", q.stride(), "bshd"), **_named("sk", k_cache.stride(), "nphd"),
        **_named("sv", v_cache.stride(), "nphd"), **_named("sks", ks_strides, "nph"),
        **_named("svs", vs_strides, "nph"),
        s_len=cache_seqlens.stride(0) if cache_seqlens is not None else 0,
        sbtb=bt_strides[0], sbtn=bt_strides[1],
        **_named("so", o_st, "bshd"), **_named("sl", l_st, "bhs"),
        sos_split=o_split, sls_split=l_split,
        seqlen_q=sq, max_len=max_len, n_blocks=n_blocks, GROUP=hq // hk, num_splits=splits,
        qk_scale=qk_scale, cap_scale=cap_scale, wl=max(window_left, 0),
        wr=max(window_right, 0),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        SUB_N=sub_n, PAGE_SIZE=page,
        PAGED=paged, MASK_LO=window_left >= 0, MASK_HI=window_right >= 0,
        SOFTCAP=softcap > 0.0, SCALE_K=scale_k, SCALE_V=scale_v,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"FP8_WORDS": True, "SAME_STRIDES": same} if words else {}),
        **({"QK_WG": True} if qk_wg else {}),
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
        **(_fused_args(out, lse, b * hk * n_m) if fused else {}),
    )
    if splits > 1 and not fused:
        sp = o_part.stride()
        lp = l_part.stride()
        C.launch(
            _decode_combine_kernel, (sq * hq, b),
            OP=o_part, LP=l_part, O=out, LSE=lse,
            sopb=sp[0], sops=sp[1], soph=sp[2], sopk=sp[3], sopd=sp[4],
            slpb=lp[0], slph=lp[1], slps=lp[2], slpk=lp[3],
            **_named("so", out.stride(), "bshd"), **_named("sl", lse.stride(), "bhs"),
            H=hq, num_splits=splits, HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_S=min(16, C.next_power_of_2(splits)), num_warps=4,
        )
    return out, lse


COMBINES = ("launch", "fused")


def _fused_args(out, lse, n):
    """The split kernel's arguments for merging the splits itself: the final output and
    ``n`` counters at zero. The counters are a scratch of this call, zeroed on its stream
    (a fill launch; an eager plan allocates them the same way, a CUDA graph replays the
    fill): a call in flight on another stream never shares them."""
    cnt = C.scratch((n,), torch.int32, out.device, zero=True)
    so, sl = out.stride(), lse.stride()
    return dict(OUT=out, LOUT=lse, CNT=cnt, sfb=so[0], sfs=so[1], sfh=so[2], sfd=so[3],
                sgb=sl[0], sgh=sl[1], sgs=sl[2], FUSED=True)


def _sm90_or_interpreter(device) -> bool:
    """The fp8 wgmma exists on sm_90 (meta tensors plan as the H200); the interpreter runs the
    same kernel with float32 dots (CPU tensors)."""
    return D.capability(device)[0] == 9 or device.type == "cpu"


def _fp8_words(k_cache, v_cache) -> bool:
    """fp8 caches the pipelined loops can read as int32 words of 4 values: a contiguous head dim
    that is a multiple of 4, every other stride 4-byte aligned, the base 16-byte aligned (the
    granularity of an eager plan's key, so that a plan never serves a base this excludes).
    The caller also wants a padded head dim of 64 or more: the words' four quarters are dotted
    separately, and a compiled tl.dot takes K >= 16."""
    return all(c.dtype == FP8 and c.stride(-1) == 1 and c.shape[-1] % 4 == 0
               and all(s % 4 == 0 for s in c.stride()[:-1]) and c.data_ptr() % 16 == 0
               for c in (k_cache, v_cache))


def _named(prefix, strides, dims):
    return {f"{prefix}{c}": s for c, s in zip(dims, strides)}


def _append_impl(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    t, hk, d = k.shape
    if t == 0 or hk == 0:
        return
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    cfg = current_append_config()
    block_d = max(16, C.next_power_of_2(d))
    block_h = max(1, min(C.next_power_of_2(hk), max(1, 4096 // block_d)))
    block_t = cfg.block_t
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"AppendConfig.block_t must be a power of 2, got {block_t}")
    launch = {}
    for name, x, xc, xs in (("k", k, k_cache, k_scale), ("v", v, v_cache, v_scale)):
        quant = 0 if xc.dtype != FP8 else (1 if xs is None or xs.ndim == 0 else 2)
        if quant == 1 and xs is None:  # an fp8 cache without a scale: scale 1
            xs = torch.ones((), dtype=torch.float32, device=x.device)
        ss = xs.stride() if quant == 2 else (0, 0, 0)
        launch.update({name.upper(): x, name.upper() + "C": xc,
                       name.upper() + "S": xs if xs is not None else x,
                       "QUANT_" + name.upper(): quant},
                      **_named("s" + name, x.stride(), "thd"),
                      **_named(f"s{name}c", xc.stride(), "nphd"),
                      **_named(f"s{name}s", ss, "nph"))
    C.launch(_append_kv_kernel, (C.cdiv(t, block_t), C.cdiv(hk, block_h)), SLOT=slot_mapping,
             T=t, n_slots=n_slots, page_size=k_cache.shape[1], s_slot=slot_mapping.stride(0),
             HKV=hk, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_T=block_t,
             num_warps=cfg.num_warps, **launch)


def _merge_impl(o_a, lse_a, o_b, lse_b):
    squeeze = o_a.ndim == 3  # (tokens, heads, dim) with lse (heads, tokens): batch of 1
    if squeeze:
        o_a, o_b, lse_a, lse_b = o_a[None], o_b[None], lse_a[None], lse_b[None]
    b, s, h, d = o_a.shape
    out = C.empty(o_a.shape, o_a.dtype, o_a.device)
    lse = C.empty((b, h, s), torch.float32, o_a.device)
    if out.numel() or lse.numel():
        if d == 0:
            raise ValueError("o_a: head_dim must be >= 1")
        C.launch(_merge_states_kernel, (b * s * h,),
                 OA=o_a, LA=lse_a, OB=o_b, LB=lse_b, O=out, LSE=lse,
                 **_named("sa", o_a.stride(), "bshd"), **_named("sla", lse_a.stride(), "bhs"),
                 **_named("sb", o_b.stride(), "bshd"), **_named("slb", lse_b.stride(), "bhs"),
                 **_named("so", out.stride(), "bshd"), **_named("sl", lse.stride(), "bhs"),
                 H=h, S=s, HEAD_DIM=d, BLOCK_D=max(16, C.next_power_of_2(d)), num_warps=1)
    if squeeze:
        return out[0], lse[0]
    return out, lse


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@R.custom_op("tkit::decode_attention", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],  # noqa: UP045
               k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],  # noqa: UP045
               softmax_scale: float, window_left: int, window_right: int, softcap: float,
               num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale,
                        softmax_scale, window_left, window_right, softcap, num_splits)


@_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, softmax_scale,
      window_left, window_right, softcap, num_splits):
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)


@R.custom_op("tkit::append_kv", mutates_args=("k_cache", "v_cache", "k_scale",
                                                          "v_scale"))
def _append_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor],  # noqa: UP045
               v_scale: Optional[torch.Tensor]) -> None:  # noqa: UP045
    _append_impl(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_append_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    return None


@R.custom_op("tkit::merge_attention_states", mutates_args=())
def _merge_op(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _merge_impl(o_a, lse_a, o_b, lse_b)


@_merge_op.register_fake
def _(o_a, lse_a, o_b, lse_b):
    if o_a.ndim == 3:
        return o_a.new_empty(o_a.shape), o_a.new_empty((o_a.shape[1], o_a.shape[0]),
                                                       dtype=torch.float32)
    b, s, h, _ = o_a.shape
    return o_a.new_empty(o_a.shape), o_a.new_empty((b, h, s), dtype=torch.float32)


def append_kv_checks(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """The validation of :func:`append_kv` (shared with :func:`tkit.rope_append_kv`)."""
    C.check_tensor(k, "k", Q_DTYPES, ndim=3)
    C.check_tensor(v, "v", Q_DTYPES, ndim=3)
    C.check_tensor(k_cache, "k_cache", CACHE_DTYPES, ndim=4)
    C.check_tensor(v_cache, "v_cache", CACHE_DTYPES, ndim=4)
    C.check_tensor(slot_mapping, "slot_mapping", (torch.int64,), ndim=1)
    C.check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                        k_scale=k_scale, v_scale=v_scale)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k is (tokens, heads_kv, head_dim) = {tuple(k.shape)} but k_cache "
                         f"holds (heads_kv, head_dim) = {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must have one slot per token ({k.shape[0]}), got "
                         f"shape {tuple(slot_mapping.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != FP8 and cache.dtype != k.dtype:
            raise TypeError(f"{name} has dtype {C.dtype_name(cache.dtype)} but k has "
                            f"{C.dtype_name(k.dtype)}")
    _check_scale(k_scale, "k_scale", k_cache, "k_cache")
    _check_scale(v_scale, "v_scale", v_cache, "v_cache")
    if _values_checked(slot_mapping):
        _check_slot_values(slot_mapping, k_cache)


def _check_slot_values(slot_mapping, k_cache) -> None:
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if not -1 <= s < n_slots:
            raise ValueError(f"slot_mapping[{i}] = {s} is outside [0, num_blocks * "
                             f"page_size = {n_slots}) (and not -1: skip)")


