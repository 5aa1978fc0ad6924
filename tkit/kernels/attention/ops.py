"""The attention family's argument checks, the choice between the Triton and Gluon forwards,
the launchers (forward, backward) and the torch.library registrations
(``tkit::flash_attn_fwd``, ``tkit::flash_attn_bwd``) with their fakes and autograd."""

from __future__ import annotations

from typing import Optional

import torch

from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels import _plan as P
from tkit.kernels import _register as R
from tkit.kernels.attention import config as AC
from tkit.kernels.attention._kernels import (
    _attn_bwd_delta_kernel,
    _attn_bwd_dkdv_autotuned,
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_autotuned,
    _attn_bwd_dq_kernel,
    _attn_fwd_autotuned,
    _attn_fwd_kernel,
)
from tkit.kernels.attention.config import (
    DTYPES,
    LOG2E,
    MAX_HEAD_DIM,
    _bwd_default_config,
    _fwd_default_config,
    fwd_head_group,
)
from tkit.kernels.decode import config as DC
from tkit.kernels.decode.ops import _decode_impl


# --------------------------------------------------------------------------------------------
# Validation and launchers
# --------------------------------------------------------------------------------------------
def _strides4(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, seq, head, dim) strides; a varlen tensor (tokens, heads, dim) has batch 0."""
    if varlen:
        return (0, t.stride(0), t.stride(1), t.stride(2))
    return tuple(t.stride())


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    if varlen:  # (heads, total_q)
        return (0, lse.stride(0), lse.stride(1))
    return tuple(lse.stride())  # (batch, heads, seqlen_q)


def _flags(head_dim, causal, window, softcap, varlen, dtype):
    wl, wr = window
    if causal:
        wr = 0
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=max(16, C.next_power_of_2(head_dim)),
        MASK_LO=wl >= 0, MASK_HI=wr >= 0, SOFTCAP=softcap > 0.0, VARLEN=varlen,
        PREC="ieee" if dtype == torch.float32 else "tf32",
    ), max(wl, 0), max(wr, 0)


def _scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_scale) as the kernels take them."""
    if softcap > 0.0:
        return softcap * LOG2E, scale / softcap
    return scale * LOG2E, 1.0


def _check_sequence_spans(q, k, v, seqlen_q, seqlen_k):
    """Offsets inside one (sequence, head) are 32-bit in the kernels (batch, head and sequence
    starts are 64-bit): refuse a sequence whose elements span 2**31 or more in any tensor the
    kernels address that way (the inputs, and outputs and gradients laid out like q, k, v)."""
    for name, t, s in (("q", q, seqlen_q), ("k", k, seqlen_k), ("v", v, seqlen_k)):
        if s <= 0:
            continue
        d = t.shape[-1]
        dense = t.shape[-2] * d  # the token stride of an output or gradient
        span = (s - 1) * max(abs(t.stride(-3)), dense) + (d - 1) * max(abs(t.stride(-1)), 1)
        if span >= 2**31 - 1:
            raise ValueError(f"{name}: one sequence of {s} tokens spans {span} elements (token "
                             f"stride {max(abs(t.stride(-3)), dense)}); offsets inside a "
                             "sequence are 32-bit, so at most 2**31 - 1 are supported")


def _check_inputs(q, k, v, varlen, window_size, softcap, softmax_scale):
    nd = 3 if varlen else 4
    layout = "(total_tokens, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        C.check_tensor(t, name, DTYPES)
        if t.ndim != nd:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    C.check_same_device(q=q, k=k, v=v)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {C.dtype_name(q.dtype)}, "
                        f"{C.dtype_name(k.dtype)}, {C.dtype_name(v.dtype)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {k.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} is not supported (1 to {MAX_HEAD_DIM})")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of "
                         f"key/value heads ({hk})")
    C.check_attention_options(window_size, softcap, softmax_scale)


def _check_cu(cu, name, batch_hint=None):
    C.check_tensor(cu, name, (torch.int32,), ndim=1)
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must hold batch + 1 offsets, got shape {tuple(cu.shape)}")


def _split_kv_serves(q, k, v) -> bool:
    """Few queries a sequence (at most the decode family's MAX_SEQLEN_Q), one dtype: the
    decode family's split-KV kernel (flash-decoding) takes the forward. It packs the query
    heads of a KV head into one tile and splits the keys over as many programs as fill the
    GPU; this family's kernels run one program per (sequence, head, tile of 64-128 queries)
    and no split, so one query over 4096 keys was 32 programs for 32 heads, each streaming
    all the keys, and the Gluon kernel's 128-row tiles held 1 useful row."""
    return (q.shape[1] <= DC.MAX_SEQLEN_Q and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] <= DC.MAX_HEAD_DIM)


def _split_kv_forward(q, k, v, causal, scale, wl, wr, softcap):
    """(out, lse) from the decode kernels, k and v read as dense caches of seqlen_k keys; the
    same visibility rule (bottom-right aligned causal mask and window) and outputs (rows with
    no visible key: 0 and lse -inf)."""
    if causal:
        wr = 0
    return _decode_impl(q, k, v, None, None, None, None, scale, wl, wr, softcap)


def _hopper_module(q, causal, cases, field):
    """(the attention_hopper module, None) when the case (head dim, causal) is in ``cases``
    (AttentionConfig.``field``), q is on a GPU and Gluon imports; else (None, why not)."""
    if (q.shape[-1], bool(causal)) not in cases:
        return None, f"head_dim {q.shape[-1]}, causal={bool(causal)} not in AttentionConfig.{field}"
    if q.device.type != "cuda":
        return None, "not on a CUDA device"
    try:
        from tkit.kernels.attention import hopper as attention_hopper
    except ImportError as e:  # a Triton without Gluon's Hopper API: the Triton kernels serve
        return None, f"Gluon unavailable: {e}"
    return attention_hopper, None


def _hopper_choice(q, k, v, causal, window, softcap):
    """(the attention_hopper module, None) when its forward takes these inputs, else (None,
    the reason it does not)."""
    hopper, reason = _hopper_module(q, causal, AC.current_config().hopper_fwd_cases,
                                    "hopper_fwd_cases")
    if hopper is not None:
        reason = hopper.supported(q, k, v, causal, window, softcap)
        if reason is None:
            reason = hopper.call_declines(q, k, causal)
    return (hopper, None) if reason is None else (None, reason)


def _hopper_bwd_choice(q, k, v, lse, causal, window, softcap, varlen):
    """(the attention_hopper module, None) when its backward takes these inputs, else (None,
    the reason it does not)."""
    hopper, reason = _hopper_module(q, causal, AC.current_config().hopper_bwd_cases,
                                    "hopper_bwd_cases")
    if hopper is not None:
        reason = hopper.bwd_supported(q, k, v, causal, window, softcap, varlen, lse)
    return (hopper, None) if reason is None else (None, reason)


def bwd_backend(q, k, v, lse=None, causal=False, window_size=(-1, -1), softcap=0.0) -> str:
    """Which backward kernels ``flash_attention``'s gradient launches for these inputs, and
    why: "gluon (sm_90, ...)" or "triton (...)"."""
    hopper, reason = _hopper_bwd_choice(q, k, v, lse, causal, window_size, softcap, False)
    if hopper is None:
        return f"triton ({reason})"
    return "gluon (sm_90, asynchronous wgmmas, TMA rings; dK/dV and dQ kernels)"


def hopper_status(device=None) -> str:
    """Whether this machine's flash_attention forward can take the Gluon Hopper kernel, and
    for which cases (``tkit info`` prints it)."""
    cases = ", ".join(f"D={d}{' causal' if c else ''}"
                      for d, c in sorted(AC.current_config().hopper_fwd_cases))
    try:
        from tkit.kernels.attention import hopper as attention_hopper  # noqa: F401
    except ImportError as e:
        return f"Triton kernel only (Gluon unavailable: {e})"
    if not torch.cuda.is_available():
        return f"Triton kernel (the Gluon kernel for {cases} needs an sm_90 GPU; none here)"
    cap = D.capability(None if device is None else torch.device(device))
    if tuple(cap) != (9, 0):
        return f"Triton kernel (the Gluon kernel needs sm_90; this GPU is sm_{cap[0]}{cap[1]})"
    bwd = ", ".join(f"D={d}{' causal' if c else ''}"
                    for d, c in sorted(AC.current_config().hopper_bwd_cases))
    return (f"Gluon sm_90 kernel for {cases} (backward: {bwd}) with 16-bit TMA-able inputs "
            "and no window, softcap or varlen; the Triton kernel for the rest")


def fwd_backend(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0) -> str:
    """Which forward kernel ``flash_attention`` launches for these inputs, and why:
    "split-kv (...)", "gluon (sm_90, ...)" or "triton (...)"."""
    if _split_kv_serves(q, k, v):
        return (f"split-kv (seqlen_q {q.shape[1]} <= {DC.MAX_SEQLEN_Q}: the decode family's "
                "kernel, keys split over programs)")
    hopper, reason = _hopper_choice(q, k, v, causal, window_size, softcap)
    if hopper is None:
        return f"triton ({reason})"
    cfg = hopper.call_config(q, k, causal)
    if cfg.get("PERSISTENT"):
        ctas = cfg.get("CTAS", 1)
        who = "one CTA an SM takes" if ctas == 1 else f"{ctas} CTAs an SM take"
        tail = f", persistent: {who} tiles from a counter; warp-specialized)"
    elif cfg.get("WS"):
        tail = (", warp-specialized TMA loader"
                + (f", {cfg['CTAS']} CTAs an SM)" if cfg.get("CTAS", 1) > 1 else ")"))
    else:
        tail = ")"
    return "gluon (sm_90, wgmma overlapped with the softmax" + tail


def _fwd_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap,
              config=None):
    """Launch the forward; returns (out, lse). Without ``config``, the inputs and cases that
    the Gluon Hopper kernel serves go there (``AttentionConfig.hopper_fwd_cases``). ``config``
    (a dict with BLOCK_M, BLOCK_N, num_warps, num_stages and optionally USE_TMA, WARP_SPEC)
    launches this module's Triton kernel with it, bypassing the autotuner;
    its optional HEAD_GROUP entry (the tile order's section size) overrides
    :func:`fwd_head_group`."""
    varlen = cu_q is not None
    if config is None and not varlen and _split_kv_serves(q, k, v):
        return _split_kv_forward(q, k, v, causal, scale, wl, wr, softcap)
    if config is None and not varlen:
        hopper, _ = _hopper_choice(q, k, v, causal, (wl, wr), softcap)
        if hopper is not None:
            return hopper.forward(q, k, v, causal, scale)
    hq, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if varlen:
        batch = cu_q.shape[0] - 1
        out = C.empty(q.shape, q.dtype, q.device)
        lse = C.empty((hq, q.shape[0]), torch.float32, q.device)
        sq, sk = max_q, max_k
        cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # the kernels read them densely
    else:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        out = C.empty(q.shape, q.dtype, q.device)
        lse = C.empty((batch, hq, sq), torch.float32, q.device)
    if batch == 0 or sq == 0 or hq == 0:
        if varlen:  # tokens in no sequence (possible only for invalid arguments): defined values
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    flags, wl, wr = _flags(d, causal, (wl, wr), softcap, varlen, q.dtype)
    qk_scale, cap_scale = _scales(scale, softcap)
    dummy = cu_q if varlen else q
    args = dict(
        Q=q, K=k, V=v, O=out, LSE=lse, CU_Q=dummy, CU_K=cu_k if varlen else q,
        **_named("sq", _strides4(q, varlen)), **_named("sk", _strides4(k, varlen)),
        **_named("sv", _strides4(v, varlen)), **_named("so", _strides4(out, varlen)),
        **_named("sl", _lse_strides(lse, varlen), dims="bhs"),
        seqlen_q=sq, seqlen_k=sk, H=hq, GROUP=hq // hk, qk_scale=qk_scale,
        cap_scale=cap_scale, wl=wl, wr=wr, **_varlen_args(q, k, batch, varlen), **flags,
    )
    cfg = dict(config) if config is not None else {}
    head_group = cfg.pop("HEAD_GROUP", None)
    if head_group is None:
        head_group = fwd_head_group(sk, d, q.element_size(), hq // hk)
    args["HEAD_GROUP"] = max(1, min(int(head_group), batch * hq))
    if config is None and C._env.NO_AUTOTUNE and not AC._env_interpret():
        cfg = _fwd_default_config(flags["BLOCK_D"], q.element_size(), D.tma_ok(k, v), d)
    if not cfg:
        grid = lambda meta: (batch * hq, C.cdiv(sq, meta["BLOCK_M"]))
        if q.device.type == "cuda" and D.tma_ok(k, v):
            D.ensure_tma_allocator()
        C.launch(_attn_fwd_autotuned, grid, **args)
    else:  # a config given, or TKIT_NO_AUTOTUNE's default
        cfg.setdefault("WARP_SPEC", False)
        cfg.setdefault("USE_TMA", False)
        if cfg["USE_TMA"]:
            if not D.tma_ok(k, v):
                raise ValueError("USE_TMA needs k and v with unit head_dim stride and 16-byte "
                                 "aligned rows")
            D.ensure_tma_allocator()
        grid = (batch * hq, C.cdiv(sq, cfg["BLOCK_M"]))
        C.launch(_attn_fwd_kernel, grid, **args, **cfg)
    return out, lse


def _varlen_args(q, k, batch, varlen) -> dict:
    """The kernels' arguments for clamping cu_seqlens: token counts, the number of sequences
    and the chunk in which cu_seqlens is read (up to 1024 entries at a time)."""
    return dict(total_q=q.shape[0], total_k=k.shape[0], n_seq=batch,
                CU_BLOCK=min(C.next_power_of_2(batch + 1), 1024) if varlen else 1)


def _named(prefix, strides, dims="bshd"):
    return {f"{prefix}{c}": s for c, s in zip(dims, strides)}


def _bwd_impl(do, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr,
              softcap, config=None):
    """Launch the backward; returns (dq, dk, dv). ``config`` bypasses the autotuners."""
    varlen = cu_q is not None
    hq, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    dq = C.empty(q.shape, q.dtype, q.device)
    dk = C.empty(k.shape, k.dtype, k.device)
    dv = C.empty(v.shape, v.dtype, v.device)
    if varlen:
        batch, sq, sk = cu_q.shape[0] - 1, max_q, max_k
        cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
        # with no query (key) block to launch, no program writes the zeros of tokens in no
        # sequence (possible only for invalid arguments)
        if batch == 0 or hq == 0 or sq == 0:
            dq.zero_()
        if batch == 0 or hq == 0 or sk == 0:
            dk.zero_()
            dv.zero_()
    else:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if batch == 0 or hq == 0 or (sq == 0 and sk == 0):
        return dq, dk, dv
    if config is None:
        hopper, _ = _hopper_bwd_choice(q, k, v, lse, causal, (wl, wr), softcap, varlen)
        if hopper is not None:  # its kernels write every element of dq, dk, dv
            return hopper.backward(do, q, k, v, out, lse, dlse, causal, scale,
                                   AC.current_config().hopper_bwd)
    flags, wl, wr = _flags(d, causal, (wl, wr), softcap, varlen, q.dtype)
    qk_scale, cap_scale = _scales(scale, softcap)
    delta = C.empty(lse.shape, torch.float32, q.device)
    lse_st = _named("sl", _lse_strides(lse, varlen), dims="bhs")
    cu_q_arg = cu_q if varlen else q
    cu_k_arg = cu_k if varlen else q
    if sq > 0:
        block_m = 64
        C.launch(_attn_bwd_delta_kernel, (batch * hq, C.cdiv(sq, block_m)),
                 O=out, DO=do, DELTA=delta, CU_Q=cu_q_arg,
                 **_named("so", _strides4(out, varlen)), **_named("sd", _strides4(do, varlen)),
                 **lse_st, seqlen_q=sq, H=hq, total_q=q.shape[0], HEAD_DIM=d,
                 BLOCK_D=flags["BLOCK_D"], VARLEN=varlen, BLOCK_M=block_m,
                 CU_BLOCK=_varlen_args(q, k, batch, varlen)["CU_BLOCK"])
        if dlse is not None:  # d lse_i / d S_ij = P_ij: folds into delta
            delta = delta - dlse.to(torch.float32)
    common = dict(
        Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, CU_Q=cu_q_arg, CU_K=cu_k_arg,
        **_named("sq", _strides4(q, varlen)), **_named("sk", _strides4(k, varlen)),
        **_named("sv", _strides4(v, varlen)), **_named("sd", _strides4(do, varlen)),
        **lse_st, seqlen_q=sq, seqlen_k=sk, GROUP=hq // hk, sm_scale=scale,
        qk_scale=qk_scale, cap_scale=cap_scale, wl=wl, wr=wr,
        **_varlen_args(q, k, batch, varlen), **flags,
    )
    dkdv_args = dict(common, DK=dk, DV=dv, **_named("sdk", _strides4(dk, varlen)),
                     **_named("sdv", _strides4(dv, varlen)), HK=hk)
    dq_args = dict(common, DQ=dq, **_named("sdq", _strides4(dq, varlen)), H=hq)
    if config is None and C._env.NO_AUTOTUNE and not AC._env_interpret():
        block_d, es = flags["BLOCK_D"], q.element_size()
        c1, c2 = _bwd_default_config("dkdv", block_d, es), _bwd_default_config("dq", block_d, es)
        C.launch(_attn_bwd_dkdv_kernel, (batch * hk, C.cdiv(sk, c1["BLOCK_N"])),
                 **dkdv_args, **c1)
        C.launch(_attn_bwd_dq_kernel, (batch * hq, C.cdiv(sq, c2["BLOCK_M"])), **dq_args, **c2)
    elif config is None:
        C.launch(_attn_bwd_dkdv_autotuned,
                 lambda meta: (batch * hk, C.cdiv(sk, meta["BLOCK_N"])), **dkdv_args)
        C.launch(_attn_bwd_dq_autotuned,
                 lambda meta: (batch * hq, C.cdiv(sq, meta["BLOCK_M"])), **dq_args)
    else:
        cfg = dict(config)
        C.launch(_attn_bwd_dkdv_kernel, (batch * hk, C.cdiv(sk, cfg["BLOCK_N"])),
                 **dkdv_args, **cfg)
        C.launch(_attn_bwd_dq_kernel, (batch * hq, C.cdiv(sq, cfg["BLOCK_M"])),
                 **dq_args, **cfg)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# torch.library registration (custom op + fake + autograd)
# --------------------------------------------------------------------------------------------
@R.custom_op("tkit::flash_attn_fwd", mutates_args=(), plans=True)
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],  # noqa: UP045
            max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
            window_left: int, window_right: int, softcap: float,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    if cu_seqlens_q is None and cu_seqlens_k is None and not AC.overridden():
        # served by an eager plan on a repeated signature, as the eager call is
        return P.serve_op(_fwd_op, _fwd_impl, (q, k, v, None, None, max_seqlen_q, max_seqlen_k,
                                               causal, softmax_scale, window_left, window_right,
                                               softcap))
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, window_left, window_right, softcap)




@_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap):
    out = q.new_empty(q.shape)
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@R.custom_op("tkit::flash_attn_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],  # noqa: UP045
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],  # noqa: UP045
            max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
            window_left: int, window_right: int, softcap: float,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      causal, softmax_scale, window_left, window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.opts = (max_q, max_k, causal, scale, wl, wr, softcap)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.opts)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


class EagerAttention(torch.autograd.Function):
    """Eager autograd of ``tkit::flash_attn_fwd`` for dense inputs: the op's launchers and its
    backward rule (:func:`_fwd_backward`) without the dispatcher, which costs a training
    step's call tens of microseconds of host time (as ``tkit.cross_entropy``'s eager
    Function). torch.compile traces the registered op instead."""

    @staticmethod
    def forward(ctx, q, k, v, sq, sk, causal, scale, wl, wr, softcap):
        args = (q, k, v, None, None, sq, sk, causal, scale, wl, wr, softcap)
        # served by the op's eager plans where its own implementation would be
        out, lse = _fwd_impl(*args) if AC.overridden() else P.serve_op(_fwd_op, _fwd_impl, args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = (sq, sk, causal, scale, wl, wr, softcap)
        ctx.overrides = R.capture_overrides()
        ctx.set_materialize_grads(False)  # an unused lse gives None, not a tensor of zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        # the forward's config overrides (autograd's device thread has none of its own)
        with R.restored_overrides(ctx.overrides):
            dq, dk, dv = _bwd_impl(dout, q, k, v, out, lse, dlse, None, None, *ctx.opts)
        return dq, dk, dv, None, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------
