"""The decode family's warp-specialized Gluon kernel for Hopper (``DecodeConfig(qk="ws_fp8")``):
its scope (:func:`supported`), launch (:func:`launch`) and ahead-of-time build
(:func:`compile_sm90`). The kernel and its schedule are described in ``_hopper_kernels.py``."""

from __future__ import annotations

import torch

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels.decode._hopper_kernels import TILE as _TILE
from tkit.kernels.decode._hopper_kernels import _decode_fp8_ws_kernel
from tkit.kernels.decode.config import FP8

TILE = int(_TILE.value)  # keys a ring slot
HEAD_DIMS = (128,)
ROWS = 8  # packed (query, head) rows a program: the scores' N is 2 x ROWS (hi, lo parts)
MAXNREG = 128  # launch registers a thread: 8 warps (a consumer and a loader warpgroup), two
#                programs an SM; the consumer takes the loader's spare registers (setmaxnreg)
STAGES = 3  # 128-key ring slots: 3 x 33 KB with the scales, two programs an SM


def device_reason(device) -> str | None:
    """None where the kernel can run, else why not."""
    if _env.INTERPRET or device.type != "cuda":
        return "a CUDA device, not the interpreter (Gluon)"
    if D.capability(device) != (9, 0):
        return "sm_90 only (wgmma, TMA, setmaxnreg)"
    return None


def supported(q, k_cache, v_cache, block_table, k_scale, v_scale, window_left, window_right,
              softcap, splits) -> str | None:
    """None if the kernel runs this call, else why not (the split kernel runs it)."""
    why = device_reason(q.device)
    if why is not None:
        return why
    if k_cache.dtype != FP8 or v_cache.dtype != FP8:
        return "fp8 caches only"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "16-bit queries only"
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    if d not in HEAD_DIMS:
        return f"head dim {d} (takes {HEAD_DIMS})"
    if sq * (hq // hk) > ROWS:
        return f"{sq * (hq // hk)} packed rows a kv head (at most {ROWS})"
    if block_table is None:
        return "paged caches only"
    page = k_cache.shape[1]
    if page < 64:
        return f"page size {page} (64 or more)"
    if window_left >= 0 or (window_right > 0) or (window_right < 0 and sq > 1):
        return "no window (causal or one query)"
    if softcap > 0.0:
        return "no softcap"
    if splits != 1:
        return f"{splits} splits (one only)"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(3) != 1 or c.stride(1) % 16 or c.stride(2) % 16 or c.data_ptr() % 16:
            return f"{name}: TMA wants a contiguous head dim and 16-byte aligned rows and heads"
        if c.stride(0) != page * c.stride(1):
            return f"{name}: a block's stride must be page_size rows"
        if c.shape[0] * page >= 2**31:
            return f"{name}: more than 2**31 rows"
    return None


def launch(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, out, lse,
           qk_scale: float, stages: int = STAGES, maxnreg: int | None = None,
           per_warp: bool = False, early: bool = True) -> None:
    """Run the kernel for a call :func:`supported` accepts (``out``, ``lse`` written);
    ``stages`` ring slots, ``maxnreg`` launch registers a thread (default :data:`MAXNREG`)."""
    b, sq, hq, d = q.shape
    n_blocks, page, hk, _ = k_cache.shape
    scale_k = 0 if k_scale is None else (1 if k_scale.ndim == 0 else 2)
    scale_v = 0 if v_scale is None else (1 if v_scale.ndim == 0 else 2)
    ks = k_scale.stride() if scale_k == 2 else (0, 0, 0)
    vs = v_scale.stride() if scale_v == 2 else (0, 0, 0)
    D.ensure_tma_allocator()
    C.launch(
        _decode_fp8_ws_kernel, (hk, b),
        Q=q, K=k_cache, V=v_cache, KS=k_scale if scale_k else q, VS=v_scale if scale_v else q,
        SEQLENS=cache_seqlens, BT=block_table, O=out, LSE=lse,
        sqb=q.stride(0), sqs=q.stride(1), sqh=q.stride(2), sqd=q.stride(3),
        skn=k_cache.stride(0), skp=k_cache.stride(1), skh=k_cache.stride(2),
        svn=v_cache.stride(0), svp=v_cache.stride(1), svh=v_cache.stride(2),
        sksn=ks[0], sksp=ks[1], sksh=ks[2], svsn=vs[0], svsp=vs[1], svsh=vs[2],
        s_len=cache_seqlens.stride(0), sbtb=block_table.stride(0), sbtn=block_table.stride(1),
        sob=out.stride(0), sos=out.stride(1), soh=out.stride(2), sod=out.stride(3),
        slb=lse.stride(0), slh=lse.stride(1), sls=lse.stride(2),
        seqlen_q=sq, n_blocks=n_blocks, max_pages=block_table.shape[1], n_kv_heads=hk,
        GROUP=hq // hk, qk_scale=qk_scale,
        HEAD_DIM=d, ROWS=ROWS, PAGE=page, BOX=min(page, TILE), STAGES=stages,
        SCALE_K=scale_k, SCALE_V=scale_v, PER_WARP=per_warp, EARLY=early, num_warps=4,
        maxnreg=maxnreg or MAXNREG,
    )


def compile_sm90(page: int = 64, q_dtype: torch.dtype = torch.bfloat16, scale_k: int = 2,
                 scale_v: int = 2, stages: int = STAGES, per_warp: bool = False,
                 early: bool = True):
    """Compile the kernel for sm_90 ahead of time (no GPU needed); returns Triton's compiled
    kernel (``.asm``: ``ttgir``, ``ptx``, ``cubin``; ``.metadata.shared`` in bytes)."""
    from tkit.kernels._gluon import compile_sm90 as gluon_compile_sm90

    qt = "bf16" if q_dtype == torch.bfloat16 else "fp16"
    names = ("Q K V KS VS SEQLENS BT O LSE sqb sqs sqh sqd skn skp skh svn svp svh sksn sksp "
             "sksh svsn svsp svsh s_len sbtb sbtn sob sos soh sod slb slh sls seqlen_q "
             "n_blocks max_pages n_kv_heads GROUP qk_scale").split()
    types = dict(Q=f"*{qt}", K="*fp8e4nv", V="*fp8e4nv", KS="*fp32", VS="*fp32",
                 SEQLENS="*i32", BT="*i32", O=f"*{qt}", LSE="*fp32", qk_scale="fp32")
    constexprs = dict(HEAD_DIM=128, ROWS=ROWS, PAGE=page, BOX=min(page, TILE), STAGES=stages,
                      SCALE_K=scale_k, SCALE_V=scale_v, PER_WARP=per_warp,
                      EARLY=early)
    signature = {n: types.get(n, "i32") for n in names}
    signature.update({k: "constexpr" for k in constexprs})
    return gluon_compile_sm90(_decode_fp8_ws_kernel, signature, constexprs, num_warps=4,
                              maxnreg=MAXNREG)
