"""Launcher of the block-scaled fp8 GEMM in CUDA (csrc/gemm_fp8_block_sm90.cu, sm_90a): the
1x128 / 128x128 scale mode of :func:`tkit.matmul_fp8` (DeepSeek-V3's recipe, each 128-deep
group's sum promoted into a float32 accumulator) on 128 x 256 tiles, which the Gluon kernel
could not hold in registers (docs/NOTES.md). The block mode's dispatch
(``tkit.kernels.matmul.fp8_block``) takes it where it serves and says why where it does not.

Operands as the block mode's: ``a`` (M, K) float8_e4m3fn row-major, ``b`` (K, N)
float8_e4m3fn K-major (``b.stride(0) == 1``: the ``.t()`` of an (N, K) weight), 16-byte
aligned rows; ``scale_a`` (M, ceil(K / 128)) and ``scale_b`` (ceil(K / 128), ceil(N / 128))
float32, any strides; out bf16 or fp16 (M, N) with 16-byte rows. Cost: 2*M*N*K flops.
"""

from __future__ import annotations

import functools

import torch

from tkit.cuda_ext import _loader
from tkit.cuda_ext.gemm import _defines, _i32, _num_sms, build_selftest, tensor_map_2d
from tkit.kernels import _common

SOURCE = "gemm_fp8_block_sm90.cu"
BM, BK, THREADS = 128, 128, 384
BN = 256
#: the source's macro defaults (the build with no -D options)
DEFAULTS = dict(stages=4, group_m=16, epi_split=2, col_scale=0)
OUT_DTYPES = (torch.bfloat16, torch.float16)
SMEM_LIMIT = 227 * 1024


def config(**overrides) -> dict:
    """One build: :data:`DEFAULTS` with ``overrides`` (None keeps the default); derived:
    smem (bytes), options (-D...: only what differs from the source's defaults).
    The result is shared between calls (worked out once a build, as launches ask for it
    every call): do not modify it."""
    unknown = set(overrides) - set(DEFAULTS) - {"out_dtype"}
    if unknown:
        raise TypeError(f"unknown fp8 block build option(s) {sorted(unknown)}; "
                        f"known: {sorted(DEFAULTS)}")
    out_dtype = overrides.get("out_dtype") or torch.bfloat16
    return _config(out_dtype, *(overrides.get(k) for k in DEFAULTS))


@functools.cache
def _config(out_dtype: torch.dtype, *values) -> dict:
    cfg = {k: (DEFAULTS[k] if v is None else v) for k, v in zip(DEFAULTS, values)}
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")
    if cfg["epi_split"] not in (1, 2, 4):
        raise ValueError(f"epi_split must split the {BN} columns into whole 64-column boxes "
                         f"(1, 2 or 4), got {cfg['epi_split']}")
    if cfg["col_scale"] not in (0, 1):
        raise ValueError(f"col_scale must be 0 or 1, got {cfg['col_scale']}")
    if cfg["stages"] < 2:
        raise ValueError(f"stages must be >= 2, got {cfg['stages']}")
    cfg["smem"] = (cfg["stages"] * (BM + BN) * BK + 2 * 64 * (BN // cfg["epi_split"]) * 2
                   + 1024 + 16 * cfg["stages"])
    if cfg["smem"] > SMEM_LIMIT:
        raise ValueError(f"stages={cfg['stages']} with epi_split={cfg['epi_split']} at "
                         f"{BN} columns needs {cfg['smem']} bytes of shared memory, more than "
                         f"{SMEM_LIMIT}")
    diff = {k: cfg[k] for k in DEFAULTS if cfg[k] != DEFAULTS[k]}
    cfg["options"] = _defines(**diff) + (("-DOUT_F16=1",) if out_dtype == torch.float16 else ())
    cfg["out_dtype"] = out_dtype
    return cfg


_SELFTEST_CODE = """
import json, sys, torch
from tkit.cuda_ext.gemm_fp8_block import matmul_fp8_block
kw = json.loads(sys.argv[1])
out_dtype = getattr(torch, kw.pop("out", "bfloat16"))
for M, N, K in ((129, 392, 208), (300, 520, 144), (1024, 1024, 1024), (256, 512, 4096)):
    g = torch.Generator(device="cuda").manual_seed(M)
    a = torch.randn(M, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(N, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    kb, nb = (K + 127) // 128, (N + 127) // 128
    sa = torch.rand(M, kb, device="cuda", generator=g) + 0.5
    sb = torch.rand(kb, nb, device="cuda", generator=g) + 0.5
    cs = torch.rand(N, device="cuda", generator=g) + 0.5 if kw.get("col_scale") else None
    c = matmul_fp8_block(a, w.t(), sa, sb, out_dtype, check=False, scale_n=cs,
                         **{k: v for k, v in kw.items() if k != "col_scale"})
    ks = torch.arange(K, device="cuda") // 128
    if cs is not None:  # the col_scale build reads cs in place of sb
        ref = ((a.double() * sa.double()[:, ks]) @ w.double().t()) * cs.double()
    else:
        ref = (a.double() * sa.double()[:, ks]) @ (w.double() * sb.double()[ks][
            :, torch.arange(N, device="cuda") // 128].t()).t()
    err = (c.double() - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item(), f"{M}x{N}x{K}: max error {err}"
print("SELFTEST OK")
"""


def selftest(**kw) -> str | None:
    """None when this build has run correctly on this machine (once per machine and source
    version, in a subprocess: see :func:`tkit.cuda_ext.gemm.build_selftest`), else why not."""
    import json

    cfg = config(**kw)
    opts = {k: v for k, v in sorted(kw.items()) if v is not None and k != "out_dtype"}
    opts["out"] = str(cfg["out_dtype"]).removeprefix("torch.")
    return build_selftest("fp8-block", SOURCE, _SELFTEST_CODE, opts, json.dumps(cfg["options"]))


def unavailable(out_dtype: torch.dtype = torch.bfloat16, col_scale: bool = False
                ) -> str | None:
    """Why the default build for this output dtype (with ``col_scale``: the per-column scale
    build) cannot run here (cupy or nvcc missing, a failed build or self-test), else None."""
    why = _loader.missing(nvcc=True)
    if why is None:
        try:
            why = selftest(out_dtype=out_dtype, col_scale=1 if col_scale else None)
        except Exception as e:  # a compile error: report it, the caller falls back
            why = f"build failed: {type(e).__name__}: {str(e)[:300]}"
    return why


#: stream-K runs are at least this many 128-deep groups (a split tile costs its owner a
#: wait and a read of each later piece's 128 KiB of sums)
SK_MIN_GROUPS = 8


def schedule(M: int, N: int, K: int, sms: int, stream_k: bool | None = None
             ) -> tuple[int, int, int]:
    """(grid, dp_tiles, sk_ctas) of a launch on ``sms`` SMs: whole waves of 128 x 256 tiles
    go to the CTAs in turn; with ``stream_k``, the tiles left under one wave are split by
    groups into runs of equal length (at least :data:`SK_MIN_GROUPS`) over up to ``sms``
    CTAs, so no SM idles through a last, part-filled wave. None: stream-K where that last
    wave would be at most a quarter full (docs/NOTES.md: 18% full gained 12%; 27%, 70% and
    94% full lost 2-13%, 52% and 73% tied)."""
    tiles = _common.cdiv(M, BM) * _common.cdiv(N, BN)
    grid, tail = min(tiles, sms), tiles % sms
    if stream_k is None:
        stream_k = 4 * tail <= sms
    if not stream_k or tail == 0:
        return grid, tiles, 0
    dp = tiles - tail
    groups = tail * _common.cdiv(K, BK)  # the kernel counts them in 32 bits
    sk_ctas = min(sms, groups // SK_MIN_GROUPS)
    if sk_ctas <= tail or groups >= 2**31:  # no run shorter than a tile: no gain
        return grid, tiles, 0
    return max(grid, sk_ctas), dp, sk_ctas


_WORKSPACE: dict = {}


def _workspace(device: torch.device, ctas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream-K partial sums and flags of this device and stream, for ``ctas`` (the
    device's SMs) CTAs (kept: the flags are all 0 between launches, each reset by the CTA
    that consumed it; one set a stream, so launches on two streams never share one)."""
    return _loader.per_stream(_WORKSPACE, device, lambda: (
        torch.empty(ctas * BM * BN, dtype=torch.float32, device=device),
        torch.zeros(ctas * 2, dtype=torch.int32, device=device)))


def matmul_fp8_block(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                     scale_b: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                     out: torch.Tensor | None = None, check: bool = True,
                     stages: int | None = None, group_m: int | None = None,
                     epi_split: int | None = None, ctas: int | None = None,
                     stream_k: bool | None = None,
                     scale_n: torch.Tensor | None = None) -> torch.Tensor:
    """The block-scaled product (module docstring) by the CUDA kernel. The operands are
    assumed checked by the block mode (shapes, dtypes, TMA alignment: its ``supported``);
    ``out`` an (M, N) row-major output to write (else one is allocated); ``check`` runs
    the build's self-test first (once per machine). Build knobs: ``stages`` (ring slots of
    one group, 48 KiB each), ``group_m`` (tile-row section height), ``epi_split`` (epilogue
    parts a consumer); ``ctas`` the SMs the persistent grid spreads over (None: all; no
    more than the device has: a split tile's owner waits for CTAs of higher index, which
    must be resident or come after it); ``stream_k`` as :func:`schedule`'s. ``scale_n``:
    (N,) float32 contiguous per-column scales of b in place of ``scale_b`` (then not read: any
    tensor), multiplied into the output before the store (the ``col_scale`` build): the
    per-channel weight scales, which have no 128-column block form."""
    knobs = dict(stages=stages, group_m=group_m, epi_split=epi_split,
                 col_scale=None if scale_n is None else 1)
    cfg = config(**knobs, out_dtype=out_dtype)
    sms = _num_sms(a.device.index or 0)
    if ctas is not None and not 1 <= ctas <= sms:
        raise ValueError(f"ctas must be from 1 to the device's {sms} SMs, got {ctas}")
    M, K = a.shape
    N = b.shape[1]
    c = out if out is not None else _common.empty((M, N), out_dtype, a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:  # no groups (and empty scales the kernel would read before its K loop)
        return c.zero_()
    if check:
        why = selftest(**knobs, out_dtype=out_dtype)
        if why is not None:
            raise RuntimeError(f"the CUDA block-scaled fp8 kernel is off on this machine: {why}")
    dev = a.device.index or 0
    func = _loader.nvcc_kernel(SOURCE, "gemm_fp8_block", cfg["options"], dev)
    maps = (tensor_map_2d(a, BK, BM), tensor_map_2d(b.t(), BK, BN), tensor_map_2d(c, 64, 64))
    grid, dp_tiles, sk_ctas = schedule(M, N, K, ctas or sms, stream_k)
    partial, flags = _workspace(a.device, sms) if sk_ctas else (c, c)
    cs = scale_b if scale_n is None else scale_n  # not read without the col_scale build
    _loader.launch(func, (grid,), (THREADS,), (*maps, scale_a, scale_b, cs, *_i32(
        M, N, K, scale_a.stride(0), scale_a.stride(1), scale_b.stride(0), scale_b.stride(1),
        dp_tiles, sk_ctas), partial, flags), smem=cfg["smem"])
    return c
