"""FlashAttention forward for Hopper (sm_90) in Gluon: the launcher (:func:`forward`) and the
ahead-of-time build (:func:`compile_sm90`). The kernels and their schedule are described in
``_hopper_kernels.py``; configs, defaults and scope (:func:`supported`) are in
``hopper_config.py``, whose names this module also exports.

Same math, conventions and outputs as :mod:`tkit.kernels.attention` (its ``_fwd_impl``). Cost
model: as the Triton forward, 4*B*H*Sq*Sk*D FLOPs (half when causal), compute-bound at the
benchmark shape; shared memory per CTA is (BLOCK_M + 2 * STAGES * BLOCK_N) * D * itemsize plus
the mbarriers (``_smem_bytes``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.experimental.gluon import language as gl

from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels.attention._hopper_bwd_kernels import (
    _attn_bwd_dkdv_hopper_kernel,
    _attn_bwd_dq_hopper_kernel,
)
from tkit.kernels.attention._hopper_kernels import (  # noqa: F401
    _attn_fwd_hopper_kernel,
    _attn_fwd_hopper_persistent_kernel,
    _attn_fwd_hopper_ws_kernel,
)
from tkit.kernels.attention.config import LOG2E, fwd_head_group
from tkit.kernels.attention.hopper_config import (  # noqa: F401
    BLOCK_M,
    BWD_DEFAULTS,
    BWD_DKDV_BLOCK,
    BWD_DQ_BLOCK_M,
    BWD_NUM_WARPS,
    BWD_ROW_PAD,
    CAUSAL_DEFAULTS,
    CONFIGS,
    DEFAULTS,
    DTYPES,
    HEAD_DIMS,
    NUM_WARPS,
    PERSISTENT_RULES,
    SMEM_LIMIT,
    SMEM_PER_SM,
    WS_CONSUMER_REGS,
    WS_LOADER_REGS,
    WS_MAXNREG,
    WS_TWO_CTA_CONSUMER_REGS,
    WS_TWO_CTA_MAXNREG,
    Candidate,
    HopperBwdConfig,
    PersistentRule,
    _cfg_key,
    _smem_bytes,
    _tma_reason,
    _tma_strides,
    bwd_supported,
    config_dict,
    config_for,
    configs,
    declines,
    default_config,
    supported,
)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.cache
def smem_layout(block_rows: int, head_dim: int, dtype: torch.dtype):
    """The shared layout of a [1, block_rows, 1, head_dim] TMA tile: the widest swizzle.
    Cached: Gluon derives it in Python (tens of microseconds), four times a call."""
    return gl.NVMMASharedLayout.get_default_for([1, block_rows, 1, head_dim], _gl_dtype(dtype))


def _descriptor(t: torch.Tensor, block_rows: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = t.shape[-1]
    return TensorDescriptor(t, list(t.shape), _tma_strides(t), [1, block_rows, 1, d],
                            smem_layout(block_rows, d, t.dtype))


def _tiles_and_sms(q) -> tuple[int, int]:
    batch, sq, hq, _ = q.shape
    return batch * hq * triton.cdiv(sq, BLOCK_M), D.sm_count(q.device)


def call_config(q, k, causal=False) -> dict:
    """The config :func:`forward` launches for these inputs without one (:func:`config_for`
    of their shapes and this GPU's SM count); a new dict."""
    return config_for(q.shape[-1], q.element_size(), q.shape[1], k.shape[1], causal,
                      *_tiles_and_sms(q))


def call_declines(q, k, causal=False) -> str | None:
    """:func:`declines` for these inputs: why a call without a config goes to the Triton kernel
    although :func:`supported` accepts it (None: it does not)."""
    return declines(q.shape[-1], q.element_size(), k.shape[1], causal, *_tiles_and_sms(q))


def forward(q, k, v, causal=False, scale=None, config=None):
    """(out, lse) for inputs that :func:`supported` accepts; ``config`` a dict with BLOCK_N,
    STAGES (WS, PERSISTENT, num_warps, maxnreg, CONSUMER_REGS, CTAS) from :func:`configs`,
    default :func:`config_for` the call, and optionally HEAD_GROUP (the tile order's section
    size). WS=True runs the warp-specialized kernel (CONSUMER_REGS: its consumer warpgroup
    1's registers), PERSISTENT=True its persistent form on CTAS CTAs an SM."""
    reason = supported(q, k, v, causal)
    if reason is not None:
        raise ValueError(f"the Hopper attention forward does not apply: {reason}")
    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    out = C.empty(q.shape, q.dtype, q.device)
    lse = C.empty((batch, hq, sq), torch.float32, q.device)
    if batch == 0 or sq == 0 or hq == 0:
        return out, lse
    if sk == 0:  # no key at all: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    cfg = call_config(q, k, causal) if config is None else dict(config)
    head_group = cfg.pop("HEAD_GROUP", None)
    if head_group is None:
        head_group = fwd_head_group(sk, d, q.element_size(), hq // hk)
    head_group = max(1, min(int(head_group), batch * hq))
    ws = bool(cfg.pop("WS", False))
    persistent = bool(cfg.pop("PERSISTENT", False))
    extra = {}
    grid = (batch * hq, triton.cdiv(sq, BLOCK_M))
    if ws:  # q and o tiles of one consumer warpgroup; the launch of config_dict
        kernel, q_rows = _attn_fwd_hopper_ws_kernel, BLOCK_M // 2
        num_warps = cfg.pop("num_warps", 4)
        extra["maxnreg"] = cfg.pop("maxnreg", WS_MAXNREG)
        extra["CONSUMER_REGS"] = cfg.pop("CONSUMER_REGS", WS_CONSUMER_REGS)
        ctas = cfg.pop("CTAS", 1)
        if persistent:  # at most CTAS CTAs an SM, taking the tiles from a counter
            kernel = _attn_fwd_hopper_persistent_kernel
            extra["n_bh"] = batch * hq
            # the tile counter: zero at each launch (a fresh one per call, so that calls on
            # other streams never share it)
            extra["TILE_CNT"] = C.scratch((1,), torch.int32, q.device, zero=True)
            grid = (min(grid[0] * grid[1], ctas * D.sm_count(q.device)),)
    else:
        kernel, q_rows = _attn_fwd_hopper_kernel, BLOCK_M
        num_warps = cfg.pop("num_warps", NUM_WARPS)
    C.launch(kernel, grid,
             q_desc=_descriptor(q, q_rows), k_desc=_descriptor(k, cfg["BLOCK_N"]),
             v_desc=_descriptor(v, cfg["BLOCK_N"]), o_desc=_descriptor(out, q_rows),
             LSE=lse, slb=lse.stride(0), slh=lse.stride(1),
             seqlen_q=sq, seqlen_k=sk, H=hq, GROUP=hq // hk, HEAD_GROUP=head_group,
             qk_scale=scale * LOG2E, CAUSAL=bool(causal), BLOCK_N=cfg["BLOCK_N"],
             STAGES=cfg["STAGES"], num_warps=num_warps, **extra)
    return out, lse


@functools.cache
def _row_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _row_descriptor(t: torch.Tensor, block: int):
    """A 1-D TMA descriptor over a flat float32 vector, block ``block`` (the lse2 / delta
    rows)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, [t.numel()], [1], [block], _row_layout())


def backward(do, q, k, v, out, lse, dlse=None, causal=False, scale=None, config=None):
    """(dq, dk, dv) for inputs that :func:`bwd_supported` accepts, given the forward's out and
    lse (float32 (batch, heads, seqlen_q), contiguous) and optionally the gradient of lse;
    ``config`` a :class:`HopperBwdConfig` (default: ``BWD_DEFAULTS`` of the head dim). A ``do``
    that TMA cannot read (an expanded gradient, say) is copied to a contiguous one first."""
    from tkit.kernels.attention._kernels import _attn_bwd_prep_kernel

    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    cfg = BWD_DEFAULTS[d] if config is None else config
    if _tma_reason(do, "do") is not None:
        do = do.contiguous()
    dq = C.empty(q.shape, q.dtype, q.device)
    dk = C.empty(k.shape, k.dtype, k.device)
    dv = C.empty(v.shape, v.dtype, v.device)
    pq = triton.cdiv(sq, BWD_ROW_PAD) * BWD_ROW_PAD
    bm, bn = BWD_DKDV_BLOCK
    # lse2 and delta, each 64-row block's pair adjacent (one TMA copy of 2 x 64 floats)
    rows = C.empty((batch * hq * 2 * pq,), torch.float32, q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    C.launch(_attn_bwd_prep_kernel, (batch * hq, pq // bm), O=out, DO=do, LSE=lse,
             DLSE=lse if dlse is None else dlse, ROWS=rows,
             sob=out.stride(0), sos=out.stride(1), soh=out.stride(2), sod=out.stride(3),
             sdb=do.stride(0), sds=do.stride(1), sdh=do.stride(2), sdd=do.stride(3),
             seqlen_q=sq, padded_q=pq, H=hq, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm,
             HAS_DLSE=dlse is not None)
    common = dict(seqlen_q=sq, seqlen_k=sk, GROUP=hq // hk, PQ=pq, sm_scale=scale,
                  qk_scale=scale * LOG2E, CAUSAL=bool(causal), num_warps=BWD_NUM_WARPS)
    C.launch(_attn_bwd_dkdv_hopper_kernel, (batch * hk, triton.cdiv(sk, bn)),
             q_desc=_descriptor(q, bm), k_desc=_descriptor(k, bn), v_desc=_descriptor(v, bn),
             do_desc=_descriptor(do, bm), dk_desc=_descriptor(dk, bn),
             dv_desc=_descriptor(dv, bn), rows_desc=_row_descriptor(rows, 2 * bm), HK=hk,
             STAGES=cfg.dkdv_stages, **common)
    C.launch(_attn_bwd_dq_hopper_kernel, (batch * hq, triton.cdiv(sq, BWD_DQ_BLOCK_M)),
             q_desc=_descriptor(q, BWD_DQ_BLOCK_M), k_desc=_descriptor(k, cfg.dq_block_n),
             v_desc=_descriptor(v, cfg.dq_block_n), do_desc=_descriptor(do, BWD_DQ_BLOCK_M),
             dq_desc=_descriptor(dq, BWD_DQ_BLOCK_M), ROWS=rows, H=hq,
             STAGES=cfg.dq_stages, **common)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed): the IR, PTX and cubin for sm_90
# --------------------------------------------------------------------------------------------
def compile_sm90(head_dim: int = 128, causal: bool = False, dtype: torch.dtype = torch.bfloat16,
                 config: dict | None = None):
    """Compile the kernel for sm_90 ahead of time; returns Triton's compiled kernel (``.asm``
    holds ``ttgir``, ``ptx``, ``cubin``; ``.metadata.shared`` the shared memory in bytes)."""
    cfg = dict(default_config(head_dim) if config is None else config)
    ws = bool(cfg.get("WS", False))
    persistent = bool(cfg.get("PERSISTENT", False))
    kernel = _attn_fwd_hopper_ws_kernel if ws else _attn_fwd_hopper_kernel
    if persistent:
        kernel = _attn_fwd_hopper_persistent_kernel
    q_rows = BLOCK_M // 2 if ws else BLOCK_M
    tname = "bf16" if dtype == torch.bfloat16 else "fp16"

    def desc(rows):
        layout = smem_layout(rows, head_dim, dtype)
        return f"tensordesc<{tname}[1, {rows}, 1, {head_dim}],{layout!r}>"

    signature = dict(
        q_desc=desc(q_rows), k_desc=desc(cfg["BLOCK_N"]), v_desc=desc(cfg["BLOCK_N"]),
        o_desc=desc(q_rows), LSE="*fp32", slb="i32", slh="i32", seqlen_q="i32",
        seqlen_k="i32", H="i32", GROUP="i32", HEAD_GROUP="i32", qk_scale="fp32",
        **(dict(n_bh="i32", TILE_CNT="*i32") if persistent else {}),
        CAUSAL="constexpr", BLOCK_N="constexpr", STAGES="constexpr",
        **(dict(CONSUMER_REGS="constexpr") if ws else {}),
    )
    from tkit.kernels._gluon import compile_sm90 as gluon_compile_sm90

    consts = dict(CAUSAL=bool(causal), BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"])
    if ws:
        consts["CONSUMER_REGS"] = cfg.get("CONSUMER_REGS", WS_CONSUMER_REGS)
    return gluon_compile_sm90(
        kernel, signature, consts,
        num_warps=cfg.get("num_warps", 4 if ws else NUM_WARPS),
        maxnreg=cfg.get("maxnreg", WS_MAXNREG) if ws else None)


def compile_bwd_sm90(kind: str, head_dim: int = 128, causal: bool = False,
                     dtype: torch.dtype = torch.bfloat16, config: HopperBwdConfig | None = None):
    """Compile one backward kernel (``kind`` "dkdv" or "dq") for sm_90 ahead of time, as
    :func:`compile_sm90` does the forward."""
    cfg = BWD_DEFAULTS[head_dim] if config is None else config
    tname = "bf16" if dtype == torch.bfloat16 else "fp16"

    def desc(rows):
        layout = smem_layout(rows, head_dim, dtype)
        return f"tensordesc<{tname}[1, {rows}, 1, {head_dim}],{layout!r}>"

    bm, bn = BWD_DKDV_BLOCK
    if kind == "dkdv":
        kernel, stages = _attn_bwd_dkdv_hopper_kernel, cfg.dkdv_stages
        descs = dict(q_desc=desc(bm), k_desc=desc(bn), v_desc=desc(bn), do_desc=desc(bm),
                     dk_desc=desc(bn), dv_desc=desc(bn))
        heads = dict(HK="i32")
        rows = dict(rows_desc=f"tensordesc<fp32[{2 * bm}],{_row_layout()!r}>")
    elif kind == "dq":
        kernel, stages = _attn_bwd_dq_hopper_kernel, cfg.dq_stages
        m, n = BWD_DQ_BLOCK_M, cfg.dq_block_n
        descs = dict(q_desc=desc(m), k_desc=desc(n), v_desc=desc(n), do_desc=desc(m),
                     dq_desc=desc(m))
        heads = dict(H="i32")
        rows = dict(ROWS="*fp32")
    else:
        raise ValueError(f"kind must be 'dkdv' or 'dq', got {kind!r}")
    signature = dict(**descs, **rows, seqlen_q="i32", seqlen_k="i32", **heads, GROUP="i32",
                     PQ="i32", sm_scale="fp32", qk_scale="fp32", CAUSAL="constexpr",
                     STAGES="constexpr")
    from tkit.kernels._gluon import compile_sm90 as gluon_compile_sm90

    return gluon_compile_sm90(kernel, signature, dict(CAUSAL=bool(causal), STAGES=stages),
                              num_warps=BWD_NUM_WARPS)
