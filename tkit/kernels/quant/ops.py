"""Dynamic quantization's launcher, argument checks and torch.library registrations
(``tkit::quantize``, ``tkit::rms_norm_quant``, ``tkit::silu_mul_quant``) with their fakes."""

from __future__ import annotations

from typing import Optional

import torch

from tkit.kernels import _common as C
from tkit.kernels import _register as R
from tkit.kernels.quant._kernels import _quant_kernel
from tkit.kernels.quant.config import FP8, current_config
from tkit.kernels.reductions import as_rows


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


@R.custom_op("tkit::quantize", mutates_args=())
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


@R.custom_op("tkit::rms_norm_quant", mutates_args=())
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


@R.custom_op("tkit::silu_mul_quant", mutates_args=())
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


