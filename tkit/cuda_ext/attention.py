"""Launcher of the FlashAttention-3-style forward in csrc/attn_fwd_sm90.cu (sm_90a).

What it is for: FlashAttention-3's Hopper schedule written out by hand, to see whether it
closes the gap between tkit's Gluon forward and FA3/FA4. Like the Gluon kernel, it overlaps
the softmax of key block j with the tensor cores' ``P_{j-1} @ V_{j-1}`` (two wgmma groups,
``wait_group 1``) and loads through a producer warpgroup; beyond it, it splits the registers
by ``setmaxnreg`` (producer 24, consumers 240), feeds P to the second product straight from
the first one's accumulator registers, and can make the two consumer warpgroups take turns
issuing their products (``pingpong``, named barriers). The Triton/Gluon forward
(``tkit.flash_attention``) stays the reference and the portable path; this one is opt-in
(:func:`flash_attention_sm90`, the ``cuda_flash_attention_sm90`` spec,
``AttentionConfig.cuda_fwd_cases``) until the H200 measures it ahead.

Scope: forward only; bf16 or fp16; head_dim 64, 128 or 256 (blocks of 128 keys, 80 at 256);
GQA/MQA; causal (bottom-right aligned) or not; no window, softcap or varlen
(:func:`unavailable_reason` names what a call lacks).

Cost: as ``tkit.flash_attention``'s (4 * batch * heads * seq_q * seq_k * head_dim flops,
halved by a causal mask over a square; Q, K, V and O read or written once).
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import torch

from tkit.cuda_ext import _loader
from tkit.cuda_ext.gemm import build_selftest, tensor_map
from tkit.kernels import _common

SOURCE = "attn_fwd_sm90.cu"
KERNEL = "attn_fwd_sm90"
#: query rows a CTA (two consumer warpgroups of 64)
BM = 128
THREADS = 384
HEAD_DIMS = (64, 128, 256)


def block_n(head_dim: int) -> int:
    """Keys a block: 128, or 80 at head_dim 256 (registers: o is 128 a thread there)."""
    return 80 if head_dim == 256 else 128

DTYPES = (torch.bfloat16, torch.float16)
#: the source's defaults (a build with no -D options): K and V rings of 2 slots each, the
#: softmax overlapped with the previous block's P @ V, the two consumers not taking turns
DEFAULTS = dict(stages=2, intra_overlap=True, pingpong=False)
_SMEM_LIMIT = 227 * 1024


def config(head_dim: int, dtype: torch.dtype, *, stages: int | None = None,
           intra_overlap: bool | None = None, pingpong: bool | None = None) -> dict:
    """One build: ``stages`` (slots of each of the K and V rings), ``intra_overlap`` (the
    softmax of a block under the previous block's P @ V), ``pingpong`` (the two consumer
    warpgroups take turns issuing their products; needs ``intra_overlap``); the -D options
    (only what differs from the source's defaults, so the default build has none beyond the
    head dim and dtype) and the dynamic shared memory it needs."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
    cfg = dict(DEFAULTS)
    cfg.update({k: v for k, v in dict(stages=stages, intra_overlap=intra_overlap,
                                      pingpong=pingpong).items() if v is not None})
    if cfg["pingpong"] and not cfg["intra_overlap"]:
        raise ValueError("pingpong orders the overlapped schedule: it needs intra_overlap")
    if not isinstance(cfg["stages"], int) or isinstance(cfg["stages"], bool) \
            or cfg["stages"] < 1:
        raise ValueError(f"stages must be a positive int, got {cfg['stages']!r}")
    q_tile, kv_tile = BM * head_dim * 2, block_n(head_dim) * head_dim * 2  # 16-bit values
    # 1024-byte alignment slack, Q, the K and V rings, the mbarriers
    smem = 1024 + q_tile + 2 * cfg["stages"] * kv_tile + 8 * (1 + 4 * cfg["stages"])
    if smem > _SMEM_LIMIT:
        raise ValueError(f"{cfg['stages']} stages at head_dim {head_dim} need {smem} bytes of "
                         f"shared memory, more than a block's {_SMEM_LIMIT}")
    opts = [f"-DHEAD_DIM={head_dim}"]
    if dtype == torch.float16:
        opts.append("-DELEM_FP16=1")
    if cfg["stages"] != DEFAULTS["stages"]:
        opts.append(f"-DSTAGES={cfg['stages']}")
    if cfg["intra_overlap"] != DEFAULTS["intra_overlap"]:
        opts.append(f"-DINTRA_OVERLAP={int(bool(cfg['intra_overlap']))}")
    if cfg["pingpong"] != DEFAULTS["pingpong"]:
        opts.append(f"-DPINGPONG={int(bool(cfg['pingpong']))}")
    return dict(cfg, head_dim=head_dim, smem=smem, options=tuple(opts))


def check_inputs(q, k, v, softmax_scale) -> float:
    """TypeError / ValueError naming the argument for what this kernel cannot take; the
    softmax scale (default 1 / sqrt(head_dim))."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float16, got {t.dtype}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be (batch, seq, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, _, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k's batch and head_dim must match q's, got k {tuple(k.shape)} for q "
                         f"{tuple(q.shape)}")
    hk = k.shape[2]
    if hk == 0 or hq % hk:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's ({hk})")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} for this kernel, got {d}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # TMA: unit head_dim stride, 16-byte aligned base and strides (8 elements)
        if t.stride(3) != 1 or any(st % 8 for st in t.stride()[:3]) or t.data_ptr() % 16:
            raise ValueError(f"{name} needs a unit head_dim stride, strides that are multiples "
                             f"of 8 elements and a 16-byte aligned start; got strides "
                             f"{t.stride()}")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d)
    elif (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
          and softmax_scale > 0):
        scale = float(softmax_scale)
    else:
        raise ValueError(f"softmax_scale must be a finite positive number, got "
                         f"{softmax_scale!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    return scale


def unavailable_reason(q, k, v, softmax_scale=None) -> str | None:
    """Why :func:`flash_attention_sm90` cannot take this call here (None when it can), without
    launching anything."""
    cupy, why = _loader.import_cupy()
    if cupy is None:
        return why
    try:
        check_inputs(q, k, v, softmax_scale)
    except (TypeError, ValueError) as e:
        return str(e)
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return "sm_90a code needs compute capability 9.0"
    if _loader.nvcc_path() is None:
        return "nvcc not found (the sm_90a build needs it)"
    return selftest(q.shape[3], q.dtype)


def flash_attention_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                         causal: bool = False, softmax_scale: float | None = None,
                         stages: int | None = None, intra_overlap: bool | None = None,
                         pingpong: bool | None = None, ctas: int | None = None,
                         check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale) v`` by the CUDA kernel: (out like q, contiguous; lse float32
    (batch, heads_q, seq_q)), as ``tkit.flash_attention(..., return_lse=True)`` returns them.
    A row that sees no key (causal with seq_q > seq_k, or seq_k = 0) gives 0 and -inf.
    ``stages``, ``intra_overlap`` and ``pingpong`` pick a build (:func:`config`); ``ctas``
    launches a persistent grid of that many CTAs, which take the tiles (128 query rows of a
    head) in turn, the next tile's Q and first K and V loaded under the last one's epilogue
    (None: a CTA a tile); ``check`` runs that build's self-test first (once per machine)."""
    scale = check_inputs(q, k, v, softmax_scale)
    return forward(q, k, v, causal, scale, stages=stages, intra_overlap=intra_overlap,
                   pingpong=pingpong, ctas=ctas, check=check)


def forward(q, k, v, causal: bool, scale: float, *, stages=None, intra_overlap=None,
            pingpong=None, ctas=None, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_attention_sm90` for inputs already accepted (:func:`check_inputs` or
    :func:`unavailable_reason`: ``tkit.flash_attention``'s dispatch), ``scale`` resolved."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    tiles = _common.cdiv(sq, BM) * hq * b
    if tiles >= 2**31:
        raise ValueError(f"{tiles} tiles of {BM} query rows: more than this kernel indexes")
    if ctas is not None and (isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1):
        raise ValueError(f"ctas must be a positive int, got {ctas!r}")
    build = dict(stages=stages, intra_overlap=intra_overlap, pingpong=pingpong)
    cfg = config(d, q.dtype, **build)
    out = _common.empty((b, sq, hq, d), q.dtype, q.device)
    lse = _common.empty((b, hq, sq), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse
    if sk == 0:  # no key: a tensor map needs every dim > 0
        return out.zero_(), lse.fill_(float("-inf"))
    if check:
        why = selftest(d, q.dtype, **build)
        if why is not None:
            raise RuntimeError(f"the CUDA attention kernel is off on this machine: {why}")
    dev = q.device.index or 0
    func = _loader.nvcc_kernel(SOURCE, KERNEL, cfg["options"], dev)
    bn = block_n(d)
    maps = (_map(q, BM), _map(k, bn), _map(v, bn))
    so = out.stride()
    with torch.cuda.device(q.device):
        _loader.launch(func, (min(tiles, ctas or tiles),), (THREADS,), (
            *maps, out, lse, np.int64(so[0]), np.int64(so[1]), np.int64(so[2]),
            np.int32(sq), np.int32(sk), np.int32(hq), np.int32(b), np.int32(hq // hk),
            np.int32(bool(causal)), np.float32(scale * math.log2(math.e))), smem=cfg["smem"])
    return out, lse


def _map(t: torch.Tensor, rows: int):
    """(batch, seq, heads, head_dim) as the 4-d tensor (head_dim, seq, heads, batch) with its
    own strides, boxes of 64 columns x ``rows`` rows of one head (128-byte swizzle)."""
    b, s, h, d = t.shape
    return tensor_map(t, (d, s, h, b), (t.stride(1), t.stride(2), t.stride(0)),
                      (64, rows, 1, 1))


_SELFTEST_CODE = """
import json, sys, torch
from tkit.cuda_ext.attention import flash_attention_sm90
from tkit.specs.attention import ref_attention
kw = json.loads(sys.argv[1])
d, dtype = kw.pop("head_dim"), getattr(torch, kw.pop("dtype"))
for b, sq, sk, hq, hk, causal in ((1, 300, 300, 2, 1, True), (2, 129, 257, 4, 2, False),
                                  (1, 200, 70, 2, 2, True)):
    g = torch.Generator(device="cuda").manual_seed(sq)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=g).to(dtype)
               for n, h in ((sq, hq), (sk, hk), (sk, hk)))
    o, lse = flash_attention_sm90(q, k, v, causal=causal, check=False, **kw)
    o2, lse2 = flash_attention_sm90(q, k, v, causal=causal, check=False, ctas=2, **kw)
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and torch.equal(lse, lse2), "two CTAs taking every tile differ"
    ref = ref_attention(q.float(), k.float(), v.float(), causal=causal)
    torch.cuda.synchronize()
    err = (o.float() - ref).abs().max().item()
    assert err < 0.03, f"{(b, sq, sk, hq, hk, causal)}: max error {err}"
print("SELFTEST OK")
"""


@functools.cache
def selftest(head_dim: int, dtype: torch.dtype, *, stages=None, intra_overlap=None,
             pingpong=None) -> str | None:
    """None when this build has run three small calls correctly on this machine (once per
    machine and build, in a subprocess with a timeout: a barrier bug hangs), else why not."""
    build = dict(stages=stages, intra_overlap=intra_overlap, pingpong=pingpong)
    cfg = config(head_dim, dtype, **build)
    opts = {k: v for k, v in build.items() if v is not None}
    opts.update(head_dim=head_dim, dtype=str(dtype).replace("torch.", ""))
    return build_selftest("attn-sm90", SOURCE, _SELFTEST_CODE, opts,
                          json.dumps(cfg["options"]))
