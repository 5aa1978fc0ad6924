"""Dynamic quantization of activations, alone or fused with the op that produces them.

Math, per row (token) of K values v (float32 inside whatever the storage dtype):

    quantize_fp8     v = x
    quantize_int8    v = x
    rms_norm_quant   h = x (+ residual, rounded to x's dtype and returned), v = h * rstd * w,
                     rstd = 1 / sqrt(mean(h^2) + eps)
    silu_mul_quant   v = silu(a) * b

    per token:       one scale a row;  per group (group_size g): one scale per g columns
    amax = max |v| over the row or group (NaN ignored: one NaN does not take its row with it)
    fp8 e4m3fn:      amax = min(amax, scale_ub) when given;
                     scale = max(amax / 448, 1 / (448 * 512))   (vLLM's floor, so that an
                     all-zero row gets a finite scale); q = clamp(v / scale, -448, 448),
                     rounded to nearest even, NaN stays NaN
    int8:            scale = amax / 127 (1 for an all-zero row); q = round_half_even(v / scale)

    v ~ q * scale: dequantization multiplies by the scale (torch._scaled_mm's convention).
    v is quantized straight from float32: the fused producers do not round it to x's dtype
    first (the unfused composition does; the fused result is the closer one).

Scales are float32, (rows, 1) per token or (rows, K // g) per group (row-major; the 1x128
layout of DeepSeek-V3 with g = 128).

Cost model: memory-bound at any size. quantize: reads K * itemsize, writes K bytes + the
scales a row; rms_norm_quant adds the residual read, the h write and the weight;
silu_mul_quant reads two inputs. About 1 FLOP per byte.

Kernel (``_quant_kernel``, one for all four ops, the math picked by the constexpr ``OP``):
a program takes ROWS rows and views each as groups of G columns: a tile is (ROWS, CHUNK_NG,
BLOCK_G), columns ``group * G + j``, so the amax of a group is a reduction over the last axis
and per-token scales (G then a sub-width, NG = cdiv(K, G)) a reduction over the last two.
A row that fits one tile (``SINGLE``) is loaded once: statistics, scale, cast and store from
registers (one pass). Longer rows are walked in chunks of CHUNK_NG groups: per group with no
row statistic (quantize, silu_mul_quant) the chunks are independent programs (grid axis 1);
otherwise a first walk takes the row's statistics (sum of squares for RMSNorm; amax for a
per-token scale, taken as rstd * max |h w| for RMSNorm since rstd > 0) and a second walk,
mostly from L2, quantizes. Offsets are 32-bit unless a tensor spans 2**31 elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels._numerics import fp8_keep_nan, round_to, saturate_fp8
from tkit.kernels.reductions import as_rows

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
#: the smallest fp8 scale (vLLM's ``min_scaling_factor``): an all-zero row stays finite
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantConfig:
    """Launch parameters of ``_quant_kernel``.

    max_tile: the most elements of one row a tile holds (a longer row is walked in chunks).
    tile: elements a program's tile should reach (short rows are packed ROWS to a program).
    sub_group: the width G of a tile's groups for per-token scales (a power of 2).
    num_warps: None = tile elements / 512 (16 values of each input a thread), 4 to 16.
    """

    max_tile: int = 16384
    tile: int = 4096
    sub_group: int = 128
    num_warps: Optional[int] = None  # noqa: UP045

    @classmethod
    def for_device(cls) -> QuantConfig:
        """Not measured yet (no GPU run of this kernel so far); the shape follows the norm
        kernels' measured rule (``tkit.kernels.reductions.config.row_config``): ~4 KiB of
        input a program, 16 values of an input a thread, rows of up to 32 KiB of bf16 held in
        registers (N=8192 rms_norm measured 4.05 TB/s that way). The interpreter pays per
        program: large tiles."""
        if _env.INTERPRET:
            return cls(max_tile=16384, tile=8192, sub_group=128, num_warps=4)
        return cls()


_OVERRIDES = C.ConfigOverrides(QuantConfig)


def quant_config(**overrides):
    """Override fields of :class:`QuantConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config() -> QuantConfig:
    cfg = QuantConfig.for_device()
    return _OVERRIDES.apply(cfg)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile(rows, rmask, c, K, NG, G: tl.constexpr, BLOCK_G: tl.constexpr,
          CHUNK_NG: tl.constexpr):
    """Column offsets (1, CHUNK_NG, BLOCK_G), group indices (CHUNK_NG,) and the tile's mask
    (ROWS, CHUNK_NG, BLOCK_G) of chunk ``c``."""
    grp = c * CHUNK_NG + tl.arange(0, CHUNK_NG)
    j = tl.arange(0, BLOCK_G)
    cols = grp[:, None] * G + j[None, :]
    cmask = (grp < NG)[:, None] & (j < G)[None, :] & (cols < K)
    return cols[None, :, :], grp, rmask[:, None, None] & cmask[None, :, :]


@triton.jit
def _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk, shm,
            OP: tl.constexpr, HAS_RES: tl.constexpr, STORE_H: tl.constexpr,
            FROM_H: tl.constexpr):
    """(v, h) of a tile in float32: v the values to quantize before RMSNorm's rstd (h * w
    for RMSNorm), h the normalized input (RMSNorm only; v otherwise). FROM_H: read h back
    (the second walk of the residual form)."""
    r2 = rows[:, None, None]
    if FROM_H:
        h = tl.load(H + r2 * shm + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(X + r2 * sxm + cols * sxk, mask=mask, other=0.0)
        if OP == "silu_mul":
            a = x.to(tl.float32)
            b = tl.load(B + r2 * sbm + cols * sbk, mask=mask, other=0.0).to(tl.float32)
            h = a * tl.sigmoid(a) * b
        elif HAS_RES:
            r = tl.load(R + r2 * srm + cols * srk, mask=mask, other=0.0)
            hs = round_to(x.to(tl.float32) + r.to(tl.float32), H.dtype.element_ty)
            if STORE_H:
                tl.store(H + r2 * shm + cols, hs, mask=mask)
            h = hs.to(tl.float32)
        else:
            h = x.to(tl.float32)
    if OP == "rms":
        v = h * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        v = h
    return v, h


@triton.jit
def _abs_nonan(v):
    return tl.where(v == v, tl.abs(v), 0.0)


@triton.jit
def _quant_store(y, amax, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB,
                 NG, PER_ROW: tl.constexpr, OUT: tl.constexpr, UB_MODE: tl.constexpr):
    """Scale, cast and store a tile of float32 values ``y``; ``amax`` is the row's (per
    token, (ROWS,)) or None-like (per group: taken here over the tile's last axis)."""
    if PER_ROW:
        a = amax[:, None]
    else:
        a = tl.max(_abs_nonan(y), 2)
    if UB_MODE == 1:
        a = tl.minimum(a, ub)
    elif UB_MODE == 2:
        a = tl.minimum(a, tl.load(UB).to(tl.float32))
    if OUT == "fp8":
        sc = tl.maximum(a / 448.0, 1.0 / (448.0 * 512.0))
    else:
        sc = tl.where(a > 0.0, a / 127.0, 1.0)
    # a per-row scale is stored by every chunk of a walked row: the same 4 bytes
    if PER_ROW:
        tl.store(S + rows * ssm, tl.max(sc, 1), mask=rmask)
    else:
        smask = rmask[:, None] & (grp < NG)[None, :]
        tl.store(S + rows[:, None] * ssm + grp[None, :] * ssg, sc, mask=smask)
    r = y / sc[:, :, None]
    if OUT == "fp8":
        r = saturate_fp8(r)
        q = fp8_keep_nan(r)
    else:
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        # round half to even: exact in float32 for |r| < 2**22 (IEEE add, no reassociation)
        r = (r + 12582912.0) - 12582912.0
        q = r.to(tl.int8)
    tl.store(Y + rows[:, None, None] * sym + cols, q, mask=mask)


@triton.jit
def _quant_kernel(
    X, B, R, W, Y, S, H, UB,
    M, K, NG, NCHUNK, sxm, sxk, sbm, sbk, srm, srk, sym, ssm, ssg, shm, eps, ub,
    OP: tl.constexpr, HAS_RES: tl.constexpr, OUT: tl.constexpr, PER_ROW: tl.constexpr,
    UB_MODE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK_NG: tl.constexpr,
    ROWS: tl.constexpr, SINGLE: tl.constexpr, INT64: tl.constexpr,
):
    """Quantize ROWS rows (x, or silu(x) * b, or RMSNorm(x [+ r]) * w) of K columns to Y
    (fp8 e4m3fn or int8) with float32 scales S: per row (PER_ROW, S + row * ssm) or per
    group of G columns (S + row * ssm + group * ssg). H: x + r (HAS_RES), row stride shm.
    UB_MODE: no upper bound on amax (0), the scalar ``ub`` (1) or the one-element tensor UB
    (2). SINGLE: the row is one tile of CHUNK_NG x G columns; otherwise NCHUNK chunks, which
    are grid axis 1 when no row statistic is needed and walked by the program otherwise."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    if INT64:
        rows = rows.to(tl.int64)
    rmask = rows < M
    IS_RMS: tl.constexpr = OP == "rms"
    if SINGLE:
        cols, grp, mask = _tile(rows, rmask, 0, K, NG, G, BLOCK_G, CHUNK_NG)
        v, h = _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk, shm,
                       OP, HAS_RES, True, False)
        if IS_RMS:
            rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(h * h, 2), 1) / K + eps)
            v = v * rstd[:, None, None]
        amax = tl.max(tl.max(_abs_nonan(v), 2), 1)
        _quant_store(v, amax, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB, NG,
                     PER_ROW, OUT, UB_MODE)
    elif not PER_ROW and not IS_RMS:
        # per group with no row statistic: each chunk is a program of its own
        c = tl.program_id(1)
        cols, grp, mask = _tile(rows, rmask, c, K, NG, G, BLOCK_G, CHUNK_NG)
        v, h = _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk, shm,
                       OP, HAS_RES, True, False)
        _quant_store(v, v, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB, NG,
                     PER_ROW, OUT, UB_MODE)
    else:
        # first walk: the row's sum of squares (RMSNorm) and amax of v (per token)
        ss = tl.zeros((ROWS,), tl.float32)
        amax = tl.zeros((ROWS,), tl.float32)
        for c in range(0, NCHUNK):
            cols, grp, mask = _tile(rows, rmask, c, K, NG, G, BLOCK_G, CHUNK_NG)
            v, h = _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk,
                           shm, OP, HAS_RES, True, False)
            if IS_RMS:
                ss += tl.sum(tl.sum(h * h, 2), 1)
            amax = tl.maximum(amax, tl.max(tl.max(_abs_nonan(v), 2), 1))
        if IS_RMS:
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            amax = amax * rstd
        tl.debug_barrier()  # h written above is read back below
        # second walk: last chunk first (the likeliest to still be in L2)
        for i in range(0, NCHUNK):
            c = NCHUNK - 1 - i
            cols, grp, mask = _tile(rows, rmask, c, K, NG, G, BLOCK_G, CHUNK_NG)
            v, h = _values(X, B, R, W, H, rows, cols, mask, sxm, sxk, sbm, sbk, srm, srk,
                           shm, OP, HAS_RES, False, HAS_RES)
            if IS_RMS:
                v = v * rstd[:, None, None]
            _quant_store(v, amax, Y, S, rows, rmask, grp, cols, mask, sym, ssm, ssg, ub, UB,
                         NG, PER_ROW, OUT, UB_MODE)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _plan(K: int, group_size: int, row_dependent: bool):
    """(G, BLOCK_G, NG, CHUNK_NG, NCHUNK, ROWS, warps) for rows of K columns."""
    cfg = current_config()
    per_row = group_size == 0
    if per_row:
        G = min(cfg.sub_group, C.next_power_of_2(K))
        block_g = G
        ng = C.cdiv(K, G)
    else:
        G = group_size
        block_g = C.next_power_of_2(G)
        ng = K // G
    ng_pow2 = C.next_power_of_2(ng)
    if ng_pow2 * block_g <= cfg.max_tile:
        chunk_ng = ng_pow2
    else:  # the largest power of 2 of groups within max_tile
        chunk_ng = 1 << (max(1, cfg.max_tile // block_g).bit_length() - 1)
    nchunk = C.cdiv(ng, chunk_ng)
    tile = chunk_ng * block_g
    rows = 1 if (nchunk > 1 and row_dependent) else max(1, min(64, cfg.tile // tile))
    warps = cfg.num_warps or max(4, min(16, C.next_power_of_2(max(1, rows * tile // 512))))
    return G, block_g, ng, chunk_ng, nchunk, rows, warps


def _quant_launch(op, x, b, r, w, eps, group_size, out_kind, ub_value, ub_tensor):
    """Returns (y, scales, h): y like x in fp8/int8, scales (rows..., 1 or K // g), h
    (x + residual) or None."""
    K = x.shape[-1]
    lead = tuple(x.shape[:-1])
    per_row = group_size == 0
    ng_out = 1 if per_row else K // group_size
    y = C.empty(x.shape, FP8 if out_kind == "fp8" else torch.int8, x.device)
    s = C.empty(lead + (ng_out,), torch.float32, x.device)
    h = C.empty(x.shape, x.dtype, x.device) if r is not None else None
    if y.numel() == 0:
        return y, s, h
    x2 = as_rows(x)
    b2 = as_rows(b) if b is not None else x2
    r2 = as_rows(r) if r is not None else x2
    y2, s2 = y.view(-1, K), s.view(-1, ng_out)
    h2 = h.view(-1, K) if h is not None else y2
    M = x2.shape[0]
    row_dep = op == "rms" or per_row
    G, block_g, ng, chunk_ng, nchunk, rows, warps = _plan(K, group_size, row_dep)
    single = nchunk == 1
    grid = (C.cdiv(M, rows), nchunk if (not single and not row_dep) else 1)
    ub_mode = 0 if (ub_value is None and ub_tensor is None) else (1 if ub_tensor is None else 2)
    C.launch(
        _quant_kernel, grid, X=x2, B=b2, R=r2, W=w if w is not None else x2, Y=y2, S=s2, H=h2,
        UB=ub_tensor if ub_tensor is not None else s2,
        M=M, K=K, NG=ng, NCHUNK=nchunk, sxm=x2.stride(0), sxk=x2.stride(1),
        sbm=b2.stride(0), sbk=b2.stride(1), srm=r2.stride(0), srk=r2.stride(1),
        sym=y2.stride(0), ssm=s2.stride(0), ssg=s2.stride(1), shm=h2.stride(0),
        eps=float(eps), ub=float(ub_value) if ub_value is not None else 0.0,
        OP=op, HAS_RES=r is not None, OUT=out_kind, PER_ROW=per_row, UB_MODE=ub_mode,
        G=G, BLOCK_G=block_g, CHUNK_NG=chunk_ng, ROWS=rows, SINGLE=single,
        INT64=C.needs_int64(x2, b2, r2, y2, h2), num_warps=warps,
    )
    return y, s, h


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
def _fake_out(x, group_size, out_dtype):
    K = x.shape[-1]
    ng = 1 if group_size == 0 else K // group_size
    return (x.new_empty(x.shape, dtype=out_dtype),
            x.new_empty(tuple(x.shape[:-1]) + (ng,), dtype=torch.float32))


@torch.library.custom_op("tkit::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, group_size: int, out_kind: str,
                 ub_value: Optional[float],  # noqa: UP045 (schema parser)
                 ub_tensor: Optional[torch.Tensor]  # noqa: UP045
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    y, s, _ = _quant_launch("none", x, None, None, None, 0.0, group_size, out_kind, ub_value,
                            ub_tensor)
    return y, s


@_quantize_op.register_fake
def _(x, group_size, out_kind, ub_value, ub_tensor):
    return _fake_out(x, group_size, FP8 if out_kind == "fp8" else torch.int8)


@torch.library.custom_op("tkit::rms_norm_quant", mutates_args=())
def _rms_norm_quant_op(x: torch.Tensor, weight: torch.Tensor,
                       residual: Optional[torch.Tensor],  # noqa: UP045
                       eps: float, group_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, s, h = _quant_launch("rms", x, None, residual, weight, eps, group_size, "fp8", None,
                            None)
    return y, s, (h if h is not None else x.new_empty((0,)))


@_rms_norm_quant_op.register_fake
def _(x, weight, residual, eps, group_size):
    y, s = _fake_out(x, group_size, FP8)
    return y, s, (x.new_empty(x.shape) if residual is not None else x.new_empty((0,)))


@torch.library.custom_op("tkit::silu_mul_quant", mutates_args=())
def _silu_mul_quant_op(a: torch.Tensor, b: torch.Tensor,
                       group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    y, s, _ = _quant_launch("silu_mul", a, b, None, None, 0.0, group_size, "fp8", None, None)
    return y, s


@_silu_mul_quant_op.register_fake
def _(a, b, group_size):
    return _fake_out(a, group_size, FP8)


# --------------------------------------------------------------------------------------------
# Validation and public API
# --------------------------------------------------------------------------------------------
def _check_x(x, name="x"):
    C.check_tensor(x, name, min_ndim=1)


def _check_group(group_size, K: int) -> int:
    """0 for per token, else the validated group size."""
    if group_size is None:
        return 0
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if K % group_size:
        raise ValueError(f"group_size {group_size} does not divide the last dimension "
                         f"K = {K}")
    return group_size


def _check_ub(scale_ub, x):
    """(float or None, tensor or None)."""
    if scale_ub is None:
        return None, None
    if isinstance(scale_ub, torch.Tensor):
        C.check_tensor(scale_ub, "scale_ub", (torch.float32,))
        if scale_ub.numel() != 1:
            raise ValueError(f"scale_ub must hold one element, got shape "
                             f"{tuple(scale_ub.shape)}")
        C.check_same_device(x=x, scale_ub=scale_ub)
        return None, scale_ub.reshape(())
    if isinstance(scale_ub, bool) or not isinstance(scale_ub, (int, float)):
        raise TypeError(f"scale_ub must be a float or a one-element float32 tensor, got "
                        f"{type(scale_ub).__name__}")
    if not scale_ub > 0:
        raise ValueError(f"scale_ub must be positive, got {scale_ub}")
    return float(scale_ub), None


def quantize_fp8(x: torch.Tensor, *, group_size: int | None = None,
                 scale_ub: float | torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic float8_e4m3fn quantization, per token or per group, in one pass.

    Parameters
    ----------
    x : Tensor (..., K)
        float32/float16/bfloat16, any strides (a row is one token).
    group_size : int, optional
        None: one scale a row (scales (..., 1)); g: one scale per g columns (scales
        (..., K // g); g = 128 is DeepSeek-V3's 1x128 activation layout). g must divide K.
    scale_ub : float or one-element float32 Tensor, optional
        Upper bound on each amax (vLLM's ``scale_ub``): values past it saturate to +-448.

    Returns
    -------
    (x_fp8, scales): x_fp8 like x (contiguous) with ``x ~ x_fp8 * scale``; scales float32,
    ``max(amax / 448, 1 / (448 * 512))``. NaN stays NaN and does not enter the amax.
    """
    _check_x(x)
    g = _check_group(group_size, x.shape[-1])
    ub_value, ub_tensor = _check_ub(scale_ub, x)
    if C.use_direct_path(x):
        return _quant_launch("none", x, None, None, None, 0.0, g, "fp8", ub_value,
                             ub_tensor)[:2]
    return _quantize_op(x, g, "fp8", ub_value, ub_tensor)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization, one scale a row (token), in one pass.

    Returns (x_int8, scales): x_int8 like x with values in [-127, 127], rounded half to even,
    ``x ~ x_int8 * scale``; scales (..., 1) float32, amax / 127 (1 for an all-zero row).
    NaN inputs give undefined int8 values (they are left out of the amax).
    """
    _check_x(x)
    if C.use_direct_path(x):
        return _quant_launch("none", x, None, None, None, 0.0, 0, "int8", None, None)[:2]
    return _quantize_op(x, 0, "int8", None, None)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, group_size: int | None = None):
    """RMSNorm (optionally after the residual add) and fp8 quantization in one pass: the
    producer of the next GEMM's fp8 activations.

    Parameters
    ----------
    x, weight, eps, residual
        As :func:`tkit.rms_norm`.
    group_size : int, optional
        As :func:`quantize_fp8`.

    Returns
    -------
    (y_fp8, scales), or (y_fp8, scales, h) with ``residual`` (h = x + residual in x's dtype,
    the residual stream for the next layer). ``y_fp8 * scales ~ rms_norm(h) * weight``,
    quantized from float32 (not rounded to x's dtype first).
    """
    from tkit.kernels.reductions.ops import _check_norm

    _check_norm(x, weight, residual=residual, eps=eps)
    g = _check_group(group_size, x.shape[-1])
    if C.use_direct_path(x, weight, residual):
        y, s, h = _quant_launch("rms", x, None, residual, weight.contiguous(), eps, g, "fp8",
                                None, None)
    else:
        y, s, h = _rms_norm_quant_op(x, weight.contiguous(), residual, float(eps), g)
    return (y, s) if residual is None else (y, s, h)


def silu_mul_quant(a: torch.Tensor, b: torch.Tensor, group_size: int | None = None):
    """``silu(a) * b`` (SwiGLU) quantized to fp8 in one pass: the down projection's input.

    a and b: the same shape (..., K) and dtype (float32/float16/bfloat16), any strides (the
    two halves of a fused [gate | up] projection as views). group_size as
    :func:`quantize_fp8`. Returns (y_fp8, scales).
    """
    _check_x(a, "a")
    _check_x(b, "b")
    C.check_same_device(a=a, b=b)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"b has dtype {C.dtype_name(b.dtype)} but a has "
                        f"{C.dtype_name(a.dtype)}; they must match")
    g = _check_group(group_size, a.shape[-1])
    if C.use_direct_path(a, b):
        return _quant_launch("silu_mul", a, b, None, None, 0.0, g, "fp8", None, None)[:2]
    return _silu_mul_quant_op(a, b, g)


def cost(x, *, group_size=None, out_itemsize=1, inputs=1, residual=False, weight=None):
    """Bytes of one call: ``inputs`` tensors like x read (+ the residual and the h write),
    the quantized output and the float32 scales written, the weight read."""
    from tkit._cost import Cost

    n, K = x.numel(), x.shape[-1]
    rows = n // K if K else 0
    ng = 1 if not group_size else K // group_size
    e = x.element_size()
    nbytes = inputs * n * e + n * out_itemsize + rows * ng * 4
    if residual:
        nbytes += 2 * n * e
    if weight is not None:
        nbytes += weight.numel() * weight.element_size()
    return Cost(nbytes, 4 * n)
