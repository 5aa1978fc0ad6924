"""Launchers of the INT4 weight-only GEMMs at decode sizes in CUDA, sm_90a: the GEMV
(csrc/gemv_int4.cu, :func:`matmul_int4_gemv_cuda`: the codes straight into a register ring, a
32-column slab and up to 32 rows a CTA, one more CTA a slab for each 32 rows past that) and the
stream-K GEMM (csrc/gemm_int4_sm90.cu, below).

The stream-K GEMM: ``a @ dequant(w).T + bias`` for M <= 32 rows of ``a``, the weight in
tkit's layout (:mod:`tkit.kernels.matmul.int4`), streamed through a TMA ring by one producer
warp, dealt out as equal runs of 512-deep K steps over one CTA an SM (stream-K), dequantized
into mma.sync's register operand. ``tkit.kernels.matmul.int4`` dispatches to either where
its ``*supported`` function says it serves (and its rule, ``cuda_gemv_reason`` /
``cuda_reason``, prefers it) and reports why where it does not.

Scope (:func:`supported`): a (M, K) fp16/bf16, M <= 32, rows contiguous and 16-byte aligned,
K a multiple of 64; qweight int32 (K // 8, N) contiguous, N a multiple of 32; scales and
zeros (K // G, N) fp16 / bf16 / fp32 with contiguous 16-byte aligned rows; G dividing 512 or
a multiple of it; bias None or (N,) in a's dtype, contiguous. Cost: the weight's bytes once,
a's once a column tile.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tkit.cuda_ext import _loader
from tkit.cuda_ext.gemm import _defines, _i32, _num_sms, build_selftest, tensor_map
from tkit.kernels import _common

SOURCE = "gemm_int4_sm90.cu"
#: columns a tile, K a step (the source's BN and BKQ * 8)
BN, KSTEP = 128, 512
ACT_DTYPES = (torch.float16, torch.bfloat16)
SCALE_T = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
#: the source's macro defaults (the build with no -D options)
DEFAULTS = dict(stages=3)
SMEM_LIMIT = 227 * 1024
MAX_M = 32
THREADS = 288
#: floats a consumer thread parks in the stream-K workspace (its 8 NT sums, NT <= 4)
WS_FLOATS = 32


def _rup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _out_or_done(a: torch.Tensor, N: int, bias: torch.Tensor | None,
                 out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """The (M, N) output (``out`` or a new one) and whether it is already complete without a
    launch: empty, or K == 0 (bias alone, else zeros)."""
    M, K = a.shape
    c = out if out is not None else _common.empty((M, N), a.dtype, a.device)
    if M == 0 or N == 0:
        return c, True
    if K == 0:
        c.zero_()
        if bias is not None:
            c += bias
        return c, True
    return c, False


def _build_unavailable(source: str, kernel: str, options: tuple[str, ...], device: int
                       ) -> str | None:
    """Why a build of ``kernel`` in ``source`` cannot run here (cupy or nvcc missing, a
    failed build), else None."""
    why = _loader.missing(nvcc=True)
    if why is None:
        try:
            _loader.nvcc_kernel(source, kernel, options, device)
        except Exception as e:  # a compile error: report it, the caller falls back
            why = f"build failed: {type(e).__name__}: {str(e)[:300]}"
    return why


def _nt(M: int) -> int:
    return 1 if M <= 8 else 2 if M <= 16 else 4


def _smem(M: int, scale_dtype: torch.dtype, group_size: int, stages: int) -> int:
    """Dynamic shared memory of a build: the ring's slots (codes, a, scales and zeros), the
    alignment slack and barriers, and the buffer where the two halves of a step meet."""
    nt, sr = _nt(M), max(1, KSTEP // group_size)
    slot = (KSTEP // 2) * 128 + (KSTEP // 64) * 8 * nt * 128 + 2 * _rup(
        4 * sr * 32 * scale_dtype.itemsize, 1024)
    return stages * slot + 2048 + 128 * 8 * nt * 4


@functools.cache
def config(M: int, act_dtype: torch.dtype, scale_dtype: torch.dtype, group_size: int,
           stages: int | None = None) -> dict:
    """One build for these operands: nt (n8 tiles of rows of a: 1, 2 or 4), sr (scale rows a
    K step),
    smem (bytes) and options (-D...); ``stages``: ring slots of one 512-deep K step (48-56
    KiB each). Shared between calls: do not modify it."""
    if stages is None:  # the default, or as many as fit (32 rows of a with 32-wide groups)
        for stages in range(DEFAULTS["stages"], 1, -1):
            if _smem(M, scale_dtype, group_size, stages) <= SMEM_LIMIT:
                break
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    if KSTEP % group_size and group_size % KSTEP:
        raise ValueError(f"group_size={group_size} neither divides nor is a multiple of the "
                         f"{KSTEP}-deep K step")
    nt = _nt(M)
    sr = max(1, KSTEP // group_size)
    smem = _smem(M, scale_dtype, group_size, stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"stages={stages} needs {smem} bytes of shared memory, more than "
                         f"{SMEM_LIMIT}")
    opts = dict(nt=nt, sr=sr, scale_t=SCALE_T[scale_dtype])
    if stages != DEFAULTS["stages"]:
        opts["stages"] = stages
    options = _defines(**opts) + (("-DACT_F16=1",) if act_dtype == torch.float16 else ())
    return dict(nt=nt, sr=sr, smem=smem, options=options)


def _scales_bias_reason(a, scales, zeros, bias, note: str = "") -> str | None:
    """Why the scales, zeros or bias are outside both kernels' scope (16-bit or fp32 scales
    and zeros of one dtype, contiguous 16-byte aligned rows; bias contiguous in a's dtype),
    else None; ``note`` ends the alignment reason."""
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is None:
            continue
        if t.dtype not in SCALE_T:
            return f"{name}' dtype {t.dtype} is not fp16/bf16/fp32"
        if (t.stride(1) != 1 or (t.shape[0] > 1 and (t.stride(0) * t.element_size()) % 16)
                or t.data_ptr() % 16):
            return f"{name}' rows are not contiguous and 16-byte aligned{note}"
    if zeros is not None and zeros.dtype != scales.dtype:
        return "zeros and scales differ in dtype"
    if bias is not None and (bias.dtype != a.dtype or bias.stride(0) != 1):
        return "bias is not contiguous in a's dtype"
    return None


def supported(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None
              ) -> str | None:
    """None when the kernel serves these (checked) operands, else why not."""
    M, K = a.shape
    N = qweight.shape[1]
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) != (9, 0):
        return "not an sm_90 device (the kernel is built for sm_90a)"
    if M > MAX_M:
        return f"M={M} rows of a: the kernel takes at most {MAX_M}"
    if a.dtype not in ACT_DTYPES:
        return f"a's dtype {a.dtype} is not fp16/bf16"
    if KSTEP % group_size and group_size % KSTEP:
        return f"group_size={group_size} neither divides nor is a multiple of {KSTEP}"
    if a.stride(1) != 1 or (M > 1 and (a.stride(0) * 2) % 16) or a.data_ptr() % 16:
        return "a's rows are not contiguous and 16-byte aligned (TMA)"
    if N % 32 or K % 64:
        return f"N={N} is not a multiple of 32 or K={K} not of 64 (the kernel's TMA boxes)"
    if qweight.stride(1) != 1 or qweight.stride(0) != N or qweight.data_ptr() % 16:
        return "qweight is not contiguous and 16-byte aligned (TMA)"
    why = _scales_bias_reason(a, scales, zeros, bias, " (TMA)")
    if why is not None:
        return why
    if (N + BN - 1) // BN * ((K + KSTEP - 1) // KSTEP) >= 2**31:
        return "too many (column tile, K step) pairs for 32-bit counts"
    return None


_SELFTEST_CODE = """
import json, sys, torch
from tkit.cuda_ext.gemm_int4 import matmul_int4_cuda
from tkit.kernels.matmul.int4 import quantize_int4, dequantize_int4
kw = json.loads(sys.argv[1])
dt = getattr(torch, kw.pop("act"))
sdt = getattr(torch, kw.pop("scale"))
G = kw.pop("group")
for M, N, K in ((kw.pop("m"), 416, 3 * 512 + max(G, 64)), (1, 1024, 2048), (3, 2048, 768)):
    K = K // G * G
    g = torch.Generator(device="cuda").manual_seed(N)
    w = torch.randn(N, K, device="cuda", generator=g)
    q, s, z = quantize_int4(w, group_size=G)
    s, z = s.to(sdt), z.to(sdt)
    a = torch.randn(M, K, device="cuda", generator=g).to(dt)
    c = matmul_int4_cuda(a, q, s, z, G, None, check=False, **kw)
    ref = a.double() @ dequantize_int4(q, s, z, group_size=G).double().t()
    err = (c.double() - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item(), f"{M}x{N}x{K}: max error {err}"
print("SELFTEST OK")
"""


def selftest(M: int, act_dtype: torch.dtype, scale_dtype: torch.dtype, group_size: int,
             stages: int | None = None) -> str | None:
    """None when this build has run correctly on this machine (once per machine and source
    version, in a subprocess: see :func:`tkit.cuda_ext.gemm.build_selftest`), else why not."""
    import json

    cfg = config(M, act_dtype, scale_dtype, group_size, stages)
    opts = dict(m=8 * cfg["nt"], act=str(act_dtype).removeprefix("torch."),
                scale=str(scale_dtype).removeprefix("torch."), group=min(group_size, KSTEP))
    if stages is not None:
        opts["stages"] = stages
    return build_selftest("int4", SOURCE, _SELFTEST_CODE, opts, json.dumps(cfg["options"]))


def unavailable(M: int, act_dtype: torch.dtype, scale_dtype: torch.dtype,
                group_size: int) -> str | None:
    """Why the default build for these operands cannot run here (cupy or nvcc missing, a
    failed build or self-test), else None."""
    why = _loader.missing(nvcc=True)
    if why is None:
        try:
            why = selftest(M, act_dtype, scale_dtype, group_size)
        except Exception as e:  # a compile error: report it, the caller falls back
            why = f"build failed: {type(e).__name__}: {str(e)[:300]}"
    return why


_WORKSPACE: dict = {}


def _workspace(device: torch.device, ctas: int, tiles: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream-K partial sums (two slots of 128 threads x WS_FLOATS a CTA) and the
    per-tile arrival counters of this device and stream (kept: every counter is back at 0
    when a launch ends; one set a stream, so launches on two streams never share one)."""
    floats = ctas * 2 * 128 * WS_FLOATS
    return _loader.per_stream(
        _WORKSPACE, device,
        lambda: (torch.empty(floats, dtype=torch.float32, device=device),
                 torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)),
        lambda ws: ws[0].numel() >= floats and ws[1].numel() >= tiles)


def _slab_map(t: torch.Tensor, rows: int, swizzle: bool) -> bytes:
    """The (R, N) matrix ``t`` (codes, scales or zeros; N a multiple of 32) seen as (32
    columns, R rows, N / 32 slabs), boxes of 32 x ``rows`` x 4 slabs (a tile's 128 columns).
    One row: its stride is never stepped over and may be anything; TMA wants a 16-byte
    multiple."""
    R, N = t.shape
    return tensor_map(t, (32, R, N // 32), (t.stride(0) if R > 1 else N, 32), (32, rows, 4),
                      swizzle=swizzle)


def _act_map(a: torch.Tensor, mpad: int) -> bytes:
    """a (M, K) as (64, M rows, K / 64 chunks), boxes of ``mpad`` rows x 8 chunks (one
    512-deep step; one row: its stride is never used, and TMA wants a 16-byte multiple)."""
    M, K = a.shape
    return tensor_map(a, (64, M, K // 64), (a.stride(0) if M > 1 else K, 64),
                      (64, mpad, KSTEP // 64))


def matmul_int4_cuda(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                     check: bool = True, stages: int | None = None,
                     ctas: int | None = None) -> torch.Tensor:
    """The product (module docstring) by the CUDA kernel. The operands are assumed checked
    (shapes, dtypes) by ``tkit.matmul_int4`` and in scope (:func:`supported`); ``out`` an
    (M, N) row-major output to write (else one is allocated); ``check`` runs the build's
    self-test first (once per machine). ``stages``: ring slots of one 512-deep K step;
    ``ctas``: the CTAs the K steps are dealt over (None: one an SM)."""
    M, K = a.shape
    N = qweight.shape[1]
    c, done = _out_or_done(a, N, bias, out)
    if done:
        return c
    cfg = config(M, a.dtype, scales.dtype, group_size, stages)
    if check:
        why = selftest(M, a.dtype, scales.dtype, group_size, stages)
        if why is not None:
            raise RuntimeError(f"the CUDA INT4 kernel is off on this machine: {why}")
    dev = a.device.index or 0
    if ctas is not None and ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    tiles = _common.cdiv(N, BN)
    steps = _common.cdiv(K, KSTEP)
    grid = min(ctas or _num_sms(dev), tiles * steps)
    ws, counters = _workspace(a.device, grid, tiles)
    mpad = 8 * cfg["nt"]
    z = zeros if zeros is not None else scales
    maps = (_slab_map(qweight, KSTEP // 8, True), _act_map(a, mpad),
            _slab_map(scales, cfg["sr"], False),
            _slab_map(z, cfg["sr"], False))
    func = _loader.nvcc_kernel(SOURCE, "gemm_int4", cfg["options"], dev)
    _loader.launch(func, (grid,), (THREADS,), (
        *maps, c, bias if bias is not None else np.int64(0), ws, counters,
        *_i32(M, N, K, group_size, int(zeros is not None), steps)), smem=cfg["smem"])
    return c


# ---- the GEMV (csrc/gemv_int4.cu): no TMA, no stream-K; up to 32 rows a CTA -----------------
GEMV_SOURCE = "gemv_int4.cu"
#: rows of a the launcher takes (8 * nt a CTA, more rows in more CTAs a slab): forced calls
#: and sweeps may go past the default's 128 rows (``tkit.kernels.matmul.int4``), where each
#: 32-row block costs about what the first does and dequantize + GEMM wins
GEMV_MAX_M = 1024
#: rings of 32-deep chunks of codes, by n8 tiles a CTA (8 rows of a or fewer / 16 / 32): with
#: 2, a pass loads the next pass's codes into the other ring before its own work (a single ring
#: reloads each slot as it is read). Two rings of 2 took 0.92-0.98x one ring of 4's time at
#: M <= 8 on the H100; at 16 rows, with the stacked sums of a (:data:`GEMV_STACKED`),
#: 0.97-0.99x at K=4096 N=14336 and level at K=N=8192. At 32 rows a CTA one ring of 4 won:
#: two rings of 2 took 1.05-1.13x its time, two of 4 1.07-1.17x, one of 8 1.10-1.29x (H100,
#: 32 to 128 rows). The K lanes (warps a 32-column slab) follow from the shape
#: (:func:`gemv_config`).
GEMV_RB = {1: 2, 2: 2, 4: 1}
#: chunks a ring pass, for one ring / two
GEMV_PF = {1: 4, 2: 2}
#: the groups' sums of a, 8 rows of a or fewer / 16 / 32: True, one MMA with a's rows as A a
#: chunk (8 rows) or a k16 step and pair of n8 tiles, moved to their threads by shuffles once a
#: group; False, an all-ones A each k16 step and n8 tile (csrc/gemv_int4.cu, ``AS``). Stacked
#: took 0.97-1.00x the all-ones form's time at 16 rows in two rings of 2, 1.00-1.05x at 8 rows
#: or fewer, and 0.95-1.00x at 32 rows a CTA (H100)
GEMV_STACKED = {1: False, 2: True, 4: True}
#: warps an SM the build's launch bounds leave registers for, by n8 tiles: 16 (128 registers a
#: thread) up to 16 rows; at 32 rows the sums and a's chunks alone take ~100 and ptxas spilled
#: under 128 and 168, not under 255 (8 warps)
GEMV_WS = {1: 16, 2: 16, 4: 8}
#: registers the ring may take (by n8 tiles and the sums' form) under the 128 a thread that 16
#: warps an SM leave: past them ptxas spilled (sm_90a builds, nvcc 13.0; the stacked form at
#: 16 rows holds 4 fewer sums, and ptxas fit rings to 56 there and spilled from 64). At 32 rows
#: (255 registers, :data:`GEMV_WS`) one ring of 4 and of 8 fit without spills
GEMV_RING_REGS = {(1, False): 52, (1, True): 52, (2, False): 36, (2, True): 56,
                  (4, False): 64, (4, True): 64}


def _gemv_lanes(N: int, K: int, group_size: int, num_sms: int, ctas_a_slab: int = 1,
                warps_sm: int = 16) -> int:
    """Warps a CTA: the power of 2 that gives the SMs about ``warps_sm`` warps each (all CTAs
    resident at once: 16 at 128 registers a thread), at most 16 and at most the groups of K
    (a warp takes whole groups); ``ctas_a_slab``: the row blocks of a 32-column slab. The H100
    sweeps timed the other powers of 2 at 1.11-1.26x this one's time at M <= 16 (docs/NOTES.md,
    forty-sixth session)."""
    ctas = max(1, N // 32) * ctas_a_slab
    kl = 1
    while kl < min(16, warps_sm) and kl * 2 <= warps_sm * num_sms / ctas * 1.41:
        kl *= 2
    while kl > 1 and kl > K // group_size:
        kl //= 2
    return kl


def _pf_fits(pf: int, gc: int) -> bool:
    """The ring's chunks and a group's (gc) line up: one a multiple of the other."""
    return pf % gc == 0 or gc % pf == 0


@functools.cache
def gemv_config(M: int, N: int, K: int, act_dtype: torch.dtype, scale_dtype: torch.dtype,
                group_size: int, num_sms: int, *, lanes: int | None = None,
                pf: int | None = None, rb: int | None = None,
                stacked: bool | None = None, nt: int | None = None) -> dict:
    """One GEMV build and launch for these operands: nt (n8 tiles of rows of a a CTA), rbs
    (CTAs a 32-column slab, each 8 nt rows), kl (warps a CTA), pf (chunks of codes in flight a
    thread) and options (-D...). ``lanes`` / ``pf`` override the K lanes and the ring's depth
    (a multiple or a divisor of the group's 32-deep chunks), ``rb`` the rings (1 or 2,
    :data:`GEMV_RB`), ``stacked`` the form of the groups' sums of a (:data:`GEMV_STACKED`),
    ``nt`` the row tiles a CTA (1, 2 or 4), for sweeps.
    Shared between calls: do not modify it."""
    if not 1 <= M <= GEMV_MAX_M:
        raise ValueError(f"the INT4 GEMV takes 1..{GEMV_MAX_M} rows of a, got M={M}")
    if nt is None:
        nt = 1 if M <= 8 else 2 if M <= 16 else 4
    if nt not in (1, 2, 4):
        raise ValueError(f"nt must be 1, 2 or 4, got {nt}")
    rbs = -(-M // (8 * nt))
    ws = GEMV_WS[nt]
    kl = lanes if lanes is not None else _gemv_lanes(N, K, group_size, num_sms, rbs, ws)
    if kl not in (1, 2, 4, 8, 16):
        raise ValueError(f"lanes must be 1, 2, 4, 8 or 16, got {kl}")
    rb = GEMV_RB[nt] if rb is None else rb
    stacked = GEMV_STACKED[nt] if stacked is None else bool(stacked)
    if rb not in (1, 2):
        raise ValueError(f"rb must be 1 or 2, got {rb}")
    gc = group_size // 32
    if pf is None:
        # the deepest ring that lines up with the groups, ends at most two of them (each
        # group it ends holds its scale and zero words, and its promotion's temporaries),
        # and whose registers (codes, a's two chunks, those words; each ring its own) fit
        # beside the sums
        words = scale_dtype.itemsize * 2
        pf = GEMV_PF[rb]
        while pf > 1 and (not _pf_fits(pf, gc) or pf > 2 * gc or rb * 4 * pf + 8 * nt + rb * words
                          * (pf // gc if pf % gc == 0 else 1) > GEMV_RING_REGS[nt, stacked]):
            pf -= 1
    if not 1 <= pf <= 16 or not _pf_fits(pf, gc):
        raise ValueError(f"pf must be in 1..16, a multiple or a divisor of the group's {gc} "
                         f"32-deep chunks; got {pf}")
    options = _defines(nt=nt, kl=kl, pf=pf, rb=rb, pa=2 if pf % 2 == 0 else 1,
                       group=group_size, scale_t=SCALE_T[scale_dtype],
                       act_f16=int(act_dtype == torch.float16), ws=ws if ws != 16 else None,
                       **{"as": stacked})
    return dict(nt=nt, rbs=rbs, kl=kl, pf=pf, rb=rb, stacked=stacked,
                options=("-std=c++17",) + options)


def gemv_supported(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None
                   ) -> str | None:
    """None when the GEMV serves these (checked) operands, else why not (the device last:
    the operands' own limits are the same on any machine)."""
    M, K = a.shape
    N = qweight.shape[1]
    if M > GEMV_MAX_M:
        return f"M={M} rows of a: the GEMV takes at most {GEMV_MAX_M}"
    if a.dtype not in ACT_DTYPES:
        return f"a's dtype {a.dtype} is not fp16/bf16"
    if group_size % 32 or K % group_size:
        return f"group_size={group_size} is not a multiple of 32 dividing K={K}"
    if N % 32:
        return f"N={N} is not a multiple of 32 (the GEMV's column slabs)"
    if a.stride(1) != 1 or (M > 1 and a.stride(0) % 8) or a.data_ptr() % 16:
        return "a's rows are not contiguous and 16-byte aligned"
    if qweight.stride(1) != 1 or qweight.stride(0) != N or qweight.data_ptr() % 16:
        return "qweight is not contiguous and 16-byte aligned"
    why = _scales_bias_reason(a, scales, zeros, bias)
    if why is not None:
        return why
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) != (9, 0):
        return "not an sm_90 device (the kernel is built for sm_90a)"
    return None


def gemv_unavailable(options: tuple[str, ...], device: int) -> str | None:
    """Why a GEMV build cannot run here (cupy or nvcc missing, a failed build), else None.
    The kernel waits on no barrier a bug could leave unreleased, so a build needs no
    self-test in a subprocess; the GPU tests check its numbers."""
    return _build_unavailable(GEMV_SOURCE, "gemv_int4", options, device)


def matmul_int4_gemv_cuda(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor | None, group_size: int,
                          bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                          lanes: int | None = None, pf: int | None = None,
                          rb: int | None = None, stacked: bool | None = None,
                          nt: int | None = None) -> torch.Tensor:
    """The product (module docstring) by the GEMV. The operands are assumed checked by
    ``tkit.matmul_int4`` and in scope (:func:`gemv_supported`); ``out`` an (M, N) row-major
    output to write (else one is allocated). ``lanes``, ``pf``, ``rb``, ``stacked``, ``nt``:
    see :func:`gemv_config`."""
    M, K = a.shape
    N = qweight.shape[1]
    c, done = _out_or_done(a, N, bias, out)
    if done:
        return c
    dev = a.device.index or 0
    cfg = gemv_config(M, N, K, a.dtype, scales.dtype, group_size, _num_sms(dev), lanes=lanes,
                      pf=pf, rb=rb, stacked=stacked, nt=nt)
    func = _loader.nvcc_kernel(GEMV_SOURCE, "gemv_int4", cfg["options"], dev)
    z = zeros if zeros is not None else scales
    lds = scales.stride(0) if scales.shape[0] > 1 else N
    ldz = z.stride(0) if z.shape[0] > 1 else N
    _loader.launch(func, (N // 32 * cfg["rbs"],), (32 * cfg["kl"],), (
        qweight, a, scales, z, c, bias if bias is not None else np.int64(0),
        *_i32(M, N, K, a.stride(0) if M > 1 else K, lds, ldz, int(zeros is not None))))
    return c


# ---- the wgmma GEMM (csrc/gemm_w4a16_sm90.cu): any rows, each weight element dequantized
# once a CTA into wgmma's register operand -----------------------------------------------------
W4_SOURCE = "gemm_w4a16_sm90.cu"
#: K a step, rows of a a CTA (the wgmma's N) the source builds
W4_BK = 64
W4_BTS = (8, 16, 32, 64, 128)
W4_THREADS_PER_WG = 128


def _w4_bt(M: int) -> int:
    """Rows of a a CTA: the smallest tile that holds M, at most 128 (more rows: more tiles)."""
    for bt in W4_BTS:
        if M <= bt:
            return bt
    return W4_BTS[-1]


def _w4_slot(bt: int, cw: int, scale_dtype: torch.dtype, group_size: int) -> int:
    sr = 1 if group_size >= W4_BK else W4_BK // group_size
    raw = bt * 128 + 8 * 64 * cw * 4 + 2 * sr * 64 * cw * scale_dtype.itemsize
    return _rup(raw, 1024)


@functools.cache
def w4_config(M: int, N: int, K: int, act_dtype: torch.dtype, scale_dtype: torch.dtype,
              group_size: int, num_sms: int, *, bt: int | None = None, cw: int | None = None,
              stages: int | None = None, split: int | None = None) -> dict:
    """One build and launch of the wgmma GEMM: bt (rows of a a CTA), cw (consumer
    warpgroups, 64 weight columns each), minb (CTAs an SM its launch bounds allow), stages
    (ring slots of a 64-deep K step), split (K splits), tiles_m / tiles_n, smem and options.
    Defaults: the smallest bt that holds M (at most 128); two consumers (three, with
    192-column tiles, were slower: 75 or 43 column tiles leave SMs idle; docs/NOTES.md); two
    CTAs an SM up to 32 rows; as many slots as fit, at most 8; K split so that the tiles fill
    the SMs' CTAs, each split at least 8 steps. Shared between calls: do not modify it."""
    bt = _w4_bt(M) if bt is None else bt
    if bt not in W4_BTS:
        raise ValueError(f"bt must be one of {W4_BTS}, got {bt}")
    cw = 2 if cw is None else cw
    if cw not in (1, 2):
        raise ValueError(f"cw must be 1 or 2, got {cw}")
    if group_size % W4_BK and group_size != 32:
        raise ValueError(f"group_size={group_size} must be 32 or a multiple of {W4_BK}")
    minb = 2 if bt <= 32 else 1
    slot = _w4_slot(bt, cw, scale_dtype, group_size)
    fit = (SMEM_LIMIT // minb - 2048) // slot
    if stages is None:
        stages = max(2, min(8, fit))
    if stages < 2 or stages > fit:
        raise ValueError(f"stages must be from 2 to the {fit} slots of {slot} bytes that fit "
                         f"in shared memory, got {stages}")
    tiles_n = -(-N // (64 * cw))
    tiles_m = -(-M // bt)
    steps = -(-K // W4_BK)
    if split is None:
        split = max(1, min(num_sms * minb // (tiles_n * tiles_m), steps // 8))
    if not 1 <= split <= steps:
        raise ValueError(f"split must be from 1 to the {steps} K steps, got {split}")
    smem = stages * slot + 1024 + 16 * stages
    options = _defines(bt=bt, cw=cw, stages=stages, group=group_size, minb=minb,
                       scale_t=SCALE_T[scale_dtype], act_f16=int(act_dtype == torch.float16))
    return dict(bt=bt, cw=cw, minb=minb, stages=stages, split=split, tiles_m=tiles_m,
                tiles_n=tiles_n, smem=smem, options=("-std=c++17",) + options)


def w4_supported(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None
                 ) -> str | None:
    """None when the wgmma GEMM serves these (checked) operands, else why not (the device
    last: the operands' own limits are the same on any machine)."""
    M, K = a.shape
    N = qweight.shape[1]
    if a.dtype not in ACT_DTYPES:
        return f"a's dtype {a.dtype} is not fp16/bf16"
    if group_size % W4_BK and group_size != 32:
        return f"group_size={group_size} is not 32 or a multiple of {W4_BK}"
    if N % 8:
        return f"N={N} is not a multiple of 8 (TMA's 16-byte rows of scales)"
    if a.stride(1) != 1 or (M > 1 and (a.stride(0) * 2) % 16) or a.data_ptr() % 16:
        return "a's rows are not contiguous and 16-byte aligned (TMA)"
    if qweight.stride(1) != 1 or qweight.stride(0) != N or qweight.data_ptr() % 16:
        return "qweight is not contiguous and 16-byte aligned (TMA)"
    why = _scales_bias_reason(a, scales, zeros, bias, " (TMA)")
    if why is not None:
        return why
    if -(-M // 8) * -(-N // 64) * -(-K // W4_BK) >= 2**31:
        return "too many tiles for 32-bit counts"
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) != (9, 0):
        return "not an sm_90 device (the kernel is built for sm_90a)"
    return None


def w4_unavailable(options: tuple[str, ...], device: int) -> str | None:
    """Why a wgmma GEMM build cannot run here (cupy or nvcc missing, a failed build), else
    None (its numbers are the GPU tests')."""
    return _build_unavailable(W4_SOURCE, "gemm_w4a16", options, device)


_W4_WORKSPACE: dict = {}


def _w4_workspace(device: torch.device, floats: int, tiles: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partial tiles and the per-tile arrival counters of this device and stream
    (kept: every counter is back at 0 when a launch ends)."""
    return _loader.per_stream(
        _W4_WORKSPACE, device,
        lambda: (torch.empty(max(floats, 1 << 16), dtype=torch.float32, device=device),
                 torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)),
        lambda ws: ws[0].numel() >= floats and ws[1].numel() >= tiles)


def matmul_int4_wgmma(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None, group_size: int,
                      bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                      bt: int | None = None, cw: int | None = None,
                      stages: int | None = None, split: int | None = None) -> torch.Tensor:
    """The product (module docstring) by the wgmma GEMM. The operands are assumed checked by
    ``tkit.matmul_int4`` and in scope (:func:`w4_supported`); ``out`` an (M, N) row-major
    output to write (else one is allocated). ``bt``, ``cw``, ``stages``, ``split``: see
    :func:`w4_config`."""
    M, K = a.shape
    N = qweight.shape[1]
    c, done = _out_or_done(a, N, bias, out)
    if done:
        return c
    dev = a.device.index or 0
    cfg = w4_config(M, N, K, a.dtype, scales.dtype, group_size, _num_sms(dev), bt=bt, cw=cw,
                    stages=stages, split=split)
    func = _loader.nvcc_kernel(W4_SOURCE, "gemm_w4a16", cfg["options"], dev)
    bt, cw, sp = cfg["bt"], cfg["cw"], cfg["split"]
    tiles = cfg["tiles_m"] * cfg["tiles_n"]
    if sp > 1:
        ws, counters = _w4_workspace(a.device, tiles * sp * W4_THREADS_PER_WG * cw * bt // 2,
                                     tiles)
    else:
        ws, counters = c, c  # not read
    z = zeros if zeros is not None else scales
    sr = 1 if group_size >= W4_BK else W4_BK // group_size
    maps = (tensor_map(a, (K, M), (a.stride(0) if M > 1 else K,), (W4_BK, bt)),
            tensor_map(qweight, (N, K // 8), (N,), (64 * cw, 8), swizzle=False),
            _w4_rows_map(scales, 64 * cw, sr), _w4_rows_map(z, 64 * cw, sr))
    _loader.launch(func, (tiles * sp,), (W4_THREADS_PER_WG * cw + 32,), (
        *maps, c, bias if bias is not None else np.int64(0), ws, counters,
        *_i32(M, N, K, int(zeros is not None), cfg["tiles_m"], sp)), smem=cfg["smem"])
    return c


def _w4_rows_map(t: torch.Tensor, cols: int, rows: int) -> bytes:
    """Scales or zeros (R, N), dense boxes of ``rows`` x ``cols`` (one row: its stride is
    never stepped over, and TMA wants a 16-byte multiple)."""
    R, N = t.shape
    return tensor_map(t, (N, R), (t.stride(0) if R > 1 else N,), (cols, rows), swizzle=False)
