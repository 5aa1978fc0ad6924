"""The reductions family's launchers and torch.library registration: validation, allocation,
the launches (each takes ``config=``, None for the table's choice) and the ops
(``tkit::rms_norm``, ``tkit::rms_norm_residual``, ``tkit::layer_norm``, ``tkit::norm_backward``,
``tkit::softmax``, ``tkit::softmax_backward``) with their fake and autograd rules."""

from __future__ import annotations

from typing import Optional

import torch

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _plan as P
from tkit.kernels import _register as R
from tkit.kernels.reductions._norm_kernels import (
    _col_sum_kernel,
    _norm_bwd_kernel,
    _norm_bwd_stats_kernel,
    _norm_fwd_kernel,
)
from tkit.kernels.reductions._rows import as_rows
from tkit.kernels.reductions._softmax_kernels import (
    _softmax_bwd_kernel,
    _softmax_fwd_kernel,
    _softmax_loop_kernel,
    _split_apply_kernel,
    _split_partial_kernel,
)
from tkit.kernels.reductions.config import NormBwdConfig, NormConfig, SoftmaxConfig
from tkit.kernels.reductions.config import active as _overrides_active


# --------------------------------------------------------------------------------------------
# Norm launchers
# --------------------------------------------------------------------------------------------
def _stats_shape(x: torch.Tensor, save_stats: bool) -> tuple[int, int]:
    return ((x.numel() // x.shape[-1] if x.shape[-1] else 0) if save_stats else 0, 2)


def _norm_fwd_impl(x, weight, bias, residual, eps, is_rms, save_stats=False, config=None):
    """Returns (y, h, stats); h is None without residual; stats is the float32 (rows, 2)
    (mean, rstd) of every row with ``save_stats`` (mean 0 for RMSNorm), else a (0, 2) tensor.
    ``config``: a :class:`NormConfig` (default ``NormConfig.for_device``)."""
    N = x.shape[-1]
    weight = weight.contiguous()  # (N,): a copy only for a strided weight
    bias = bias.contiguous() if bias is not None else None
    y = C.empty(x.shape, x.dtype, x.device)
    h = C.empty(x.shape, x.dtype, x.device) if residual is not None else None
    stats = torch.empty(_stats_shape(x, save_stats), dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y, h, stats
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else x2
    y2 = y.view(-1, N)
    h2 = h.view(-1, N) if h is not None else y2
    M = x2.shape[0]
    if config is None:  # cached per shape unless overrides are active
        config = NormConfig.for_device(N, x.element_size(), is_rms=is_rms,
                                       has_res=residual is not None)
    C.launch(_norm_fwd_kernel, (C.cdiv(M, config.rows),), x_ptr=x2, r_ptr=r2, h_ptr=h2,
             w_ptr=weight, b_ptr=bias if bias is not None else weight, y_ptr=y2,
             stats_ptr=stats if save_stats else y2, M=M, N=N,
             sxm=x2.stride(0), sxn=x2.stride(1), srm=r2.stride(0), srn=r2.stride(1),
             shm=h2.stride(0), sym=y2.stride(0), eps=float(eps), IS_RMS=is_rms,
             HAS_RES=residual is not None, HAS_BIAS=bias is not None,
             INT64=C.needs_int64(x2, r2, y2), SAVE_STATS=save_stats, **config.constexprs())
    return y, h, stats


def _norm_bwd_impl(h, weight, dy, dres, eps, is_rms, has_bias, stats=None, config=None):
    """Returns (dx, dweight, dbias); dbias has shape (0,) without bias. ``stats``: the
    forward's (rows, 2) (mean, rstd) (``_norm_fwd_impl(save_stats=True)``), or None (or a
    (0, 2) tensor) to recompute them. ``config``: a :class:`NormBwdConfig`."""
    N = h.shape[-1]
    weight = weight.contiguous()
    dx = C.empty(h.shape, h.dtype, h.device)
    dw = C.empty((N,), weight.dtype, h.device)
    db = C.empty((N,) if has_bias else (0,), weight.dtype, h.device)
    if h.numel() == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db
    h2, dy2, dx2 = as_rows(h), as_rows(dy), dx.view(-1, N)
    dr2 = as_rows(dres) if dres is not None else dy2
    M = h2.shape[0]
    int64 = C.needs_int64(h2, dy2, dx2, dr2)
    has_stats = stats is not None and stats.shape[0] == M and M > 0
    cfg = config or NormBwdConfig.for_device(M, N, h.element_size(), is_rms=is_rms,
                                             has_stats=has_stats, device=h.device)
    fs = stats if cfg.fwd_stats else dx2  # unused without them
    if cfg.single:
        nchunk = 1
        stats_bwd = dx2  # unused
    else:
        nchunk = C.cdiv(N, cfg.block_n)
        stats_bwd = torch.empty((M, 4), dtype=torch.float32, device=h.device)
        C.launch(_norm_bwd_stats_kernel, (M,), h_ptr=h2, w_ptr=weight, dy_ptr=dy2,
                 stats_ptr=stats_bwd, fs_ptr=fs, N=N, shm=h2.stride(0), shn=h2.stride(1),
                 sdym=dy2.stride(0), sdyn=dy2.stride(1), eps=float(eps), IS_RMS=is_rms,
                 BLOCK_N=cfg.block_n, INT64=int64, HAS_FSTATS=cfg.fwd_stats,
                 num_warps=cfg.stats_warps)
    G = cfg.programs
    dw_part = torch.empty((G, N), dtype=torch.float32, device=h.device)
    db_part = torch.empty((G, N), dtype=torch.float32, device=h.device) if has_bias else dw_part
    C.launch(_norm_bwd_kernel, (G, nchunk), h_ptr=h2, w_ptr=weight, dy_ptr=dy2, dres_ptr=dr2,
             dx_ptr=dx2, dw_ptr=dw_part, db_ptr=db_part, stats_ptr=stats_bwd, fs_ptr=fs, M=M,
             N=N,
             shm=h2.stride(0), shn=h2.stride(1), sdym=dy2.stride(0), sdyn=dy2.stride(1),
             sdrm=dr2.stride(0), sdrn=dr2.stride(1), sdxm=dx2.stride(0), eps=float(eps),
             IS_RMS=is_rms, HAS_DRES=dres is not None, HAS_BIAS=has_bias, ROWS=cfg.rows,
             BLOCK_N=cfg.block_n, SINGLE=cfg.single, INT64=int64, PREFETCH=cfg.prefetch,
             HAS_FSTATS=cfg.fwd_stats_single, num_warps=cfg.warps)
    sum_block = 256 if not _env.INTERPRET else C.next_power_of_2(min(N, 4096))
    for part, out in ((dw_part, dw),) + (((db_part, db),) if has_bias else ()):
        C.launch(_col_sum_kernel, (C.cdiv(N, sum_block),), part_ptr=part, out_ptr=out,
                 G=G, N=N, BLOCK_G=min(32, C.next_power_of_2(G)), BLOCK_N=sum_block,
                 num_warps=4)
    return dx, dw, db


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
def _like(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _stats_like(x, save_stats):
    return x.new_empty(_stats_shape(x, save_stats), dtype=torch.float32)


# Each forward op also returns the rows' (mean, rstd) when ``save_stats`` (the public functions
# ask for them when autograd will need them): 8 bytes a row, which spare the backward its
# statistics reductions (LayerNorm: two of its three rounds of shuffles and barriers a row).
# The forwards' implementations serve repeated signatures from eager plans (``P.serve_op``)
# unless an experiment overrides the configs.
@R.custom_op("tkit::rms_norm", mutates_args=(), plans=True)
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 save_stats: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if _overrides_active():
        return _rms_norm_fwd(x, weight, eps, save_stats)
    return P.serve_op(_rms_norm_op, _rms_norm_fwd, (x, weight, eps, save_stats))


def _rms_norm_fwd(x, weight, eps, save_stats):
    y, _, stats = _norm_fwd_impl(x, weight, None, None, eps, True, save_stats)
    return y, stats


@_rms_norm_op.register_fake
def _(x, weight, eps, save_stats=False):
    return _like(x), _stats_like(x, save_stats)


@R.custom_op("tkit::rms_norm_residual", mutates_args=(), plans=True)
def _rms_norm_residual_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, save_stats: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _overrides_active():
        return _rms_norm_residual_fwd(x, residual, weight, eps, save_stats)
    return P.serve_op(_rms_norm_residual_op, _rms_norm_residual_fwd,
                      (x, residual, weight, eps, save_stats))


def _rms_norm_residual_fwd(x, residual, weight, eps, save_stats):
    return _norm_fwd_impl(x, weight, None, residual, eps, True, save_stats)


@_rms_norm_residual_op.register_fake
def _(x, residual, weight, eps, save_stats=False):
    return _like(x), _like(x), _stats_like(x, save_stats)


@R.custom_op("tkit::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
                   eps: float, save_stats: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, stats = _norm_fwd_impl(x, weight, bias, None, eps, False, save_stats)
    return y, stats


@_layer_norm_op.register_fake
def _(x, weight, bias, eps, save_stats=False):
    return _like(x), _stats_like(x, save_stats)


@R.custom_op("tkit::norm_backward", mutates_args=())
def _norm_bwd_op(h: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
                 dres: Optional[torch.Tensor], stats: Optional[torch.Tensor],  # noqa: UP045
                 eps: float, is_rms: bool,
                 has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_bwd_impl(h, weight, dy, dres, eps, is_rms, has_bias, stats)


@_norm_bwd_op.register_fake
def _(h, weight, dy, dres, stats, eps, is_rms, has_bias):
    N = h.shape[-1]
    return (_like(h), weight.new_empty((N,)), weight.new_empty((N,) if has_bias else (0,)))


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs[:3]
    ctx.eps = eps
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _dstats):
    x, weight, stats = ctx.saved_tensors
    dx, dw, _ = _norm_bwd_op(x, weight, dy, None, stats, ctx.eps, True, False)
    return dx, dw, None, None


_rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)


def _rms_res_setup(ctx, inputs, output):
    x, residual, weight, eps = inputs[:4]
    ctx.eps = eps
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(output[1], weight, output[2])


def _rms_res_backward(ctx, dy, dh, _dstats):
    h, weight, stats = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw, _ = _norm_bwd_op(h, weight, dy, dh, stats, ctx.eps, True, False)
    return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, None, None


_rms_norm_residual_op.register_autograd(_rms_res_backward, setup_context=_rms_res_setup)


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs[:4]
    ctx.eps = eps
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _ln_backward(ctx, dy, _dstats):
    x, weight, stats = ctx.saved_tensors
    dx, dw, db = _norm_bwd_op(x, weight, dy, None, stats, ctx.eps, False, ctx.has_bias)
    return dx, dw, (db if ctx.has_bias else None), None, None


_layer_norm_op.register_autograd(_ln_backward, setup_context=_ln_setup)


def _wants_stats(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)



def _check_norm(x, weight, bias=None, residual=None, eps=0.0):
    C.check_tensor(x, "x", min_ndim=1)
    C.check_tensor(weight, "weight", ndim=1)
    N = x.shape[-1]
    if weight.shape[0] != N:
        raise ValueError(f"weight must have shape ({N},) to match x's last dimension, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        C.check_tensor(bias, "bias", ndim=1)
        if bias.shape != weight.shape:
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None:
        C.check_tensor(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, "
                             f"got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual has dtype {C.dtype_name(residual.dtype)} but x has "
                            f"{C.dtype_name(x.dtype)}; they must match")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    C.check_same_device(x=x, weight=weight, bias=bias, residual=residual)



# --------------------------------------------------------------------------------------------
# Softmax launchers
# --------------------------------------------------------------------------------------------
def _split_launch(a2, b2, out2, backward, log, cfg):
    """The two-pass split path over (M, N) rows, all rows in one launch each."""
    M, N = a2.shape
    nchunk = C.cdiv(N, cfg.block_n)
    dev = a2.device
    # per-chunk partials, written in full by the first pass before the second reads them:
    # scratch, so that an eager plan allocates them afresh instead of refusing the signature
    p1 = C.scratch((M, nchunk), torch.float32, dev)
    p2 = C.scratch((M, nchunk), torch.float32, dev)
    int64 = C.needs_int64(a2, out2, p1) or (b2 is not None and C.needs_int64(b2))
    b = b2 if b2 is not None else a2
    common = dict(a_ptr=a2, b_ptr=b, p1_ptr=p1, p2_ptr=p2, N=N, sam=a2.stride(0),
                  san=a2.stride(1), sbm=b.stride(0), sbn=b.stride(1), NCHUNK=nchunk,
                  BACKWARD=backward, LOG=log, CHUNK=cfg.block_n, INT64=int64)
    grid = (M * nchunk,)
    C.launch(_split_partial_kernel, grid, row0=0, num_warps=cfg.warps, **common)
    C.launch(_split_apply_kernel, grid, row0=0, out_ptr=out2, som=out2.stride(0),
             BLOCK_C=C.next_power_of_2(nchunk), num_warps=cfg.warps, **common)


def _softmax_fwd_impl(x: torch.Tensor, dim: int, log: bool, config=None) -> torch.Tensor:
    """``config``: a :class:`SoftmaxConfig` (default ``SoftmaxConfig.for_device``)."""
    last = dim % x.ndim == x.ndim - 1  # the usual case: no movedim views (a microsecond each)
    xm = x if last else x.movedim(dim, -1)
    out = C.empty(xm.shape, x.dtype, x.device)
    if out.numel() == 0:
        return out if last else out.movedim(-1, dim)
    x2, y2 = as_rows(xm), out.view(-1, xm.shape[-1])
    M, N = x2.shape
    cfg = config or SoftmaxConfig.for_device(M, N, x.element_size(), device=x.device)
    if cfg.path == "loop":
        C.launch(_softmax_loop_kernel, (M,), x_ptr=x2, y_ptr=y2, N=N, sxm=x2.stride(0),
                 sxn=x2.stride(1), sym=y2.stride(0), LOG=log, BLOCK_N=cfg.block_n,
                 INT64=C.needs_int64(x2, y2), num_warps=cfg.warps)
    elif cfg.path == "split":
        _split_launch(x2, None, y2, backward=False, log=log, cfg=cfg)
    else:
        C.launch(_softmax_fwd_kernel, (C.cdiv(M, cfg.rows),), x_ptr=x2, y_ptr=y2, M=M, N=N,
                 sxm=x2.stride(0), sxn=x2.stride(1), sym=y2.stride(0), LOG=log, ROWS=cfg.rows,
                 BLOCK_N=cfg.block_n, INT64=C.needs_int64(x2, y2), num_warps=cfg.warps)
    return out if last else out.movedim(-1, dim)


def _softmax_bwd_impl(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool,
                      config=None) -> torch.Tensor:
    ym, dym = y.movedim(dim, -1), dy.movedim(dim, -1)
    dx = C.empty(ym.shape, y.dtype, y.device)
    if dx.numel() == 0:
        return dx.movedim(-1, dim)
    y2, dy2, dx2 = as_rows(ym), as_rows(dym), dx.view(-1, ym.shape[-1])
    M, N = y2.shape
    cfg = config or SoftmaxConfig.for_device(M, N, y.element_size(), device=y.device,
                                             backward=True)
    if cfg.path == "fused":
        C.launch(_softmax_bwd_kernel, (C.cdiv(M, cfg.rows),), y_ptr=y2, dy_ptr=dy2, dx_ptr=dx2,
                 M=M, N=N, sym=y2.stride(0), syn=y2.stride(1), sdym=dy2.stride(0),
                 sdyn=dy2.stride(1), sdxm=dx2.stride(0), LOG=log, ROWS=cfg.rows,
                 BLOCK_N=cfg.block_n, INT64=C.needs_int64(y2, dy2, dx2), num_warps=cfg.warps)
    else:
        _split_launch(y2, dy2, dx2, backward=True, log=log, cfg=cfg)
    return dx.movedim(-1, dim)


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@R.custom_op("tkit::softmax", mutates_args=(), plans=True)
def _softmax_op(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    if _overrides_active():
        return _softmax_fwd_impl(x, dim, log)
    return P.serve_op(_softmax_op, _softmax_fwd_impl, (x, dim, log))


@_softmax_op.register_fake
def _(x, dim, log):
    return torch.empty_like(x.movedim(dim, -1), memory_format=torch.contiguous_format).movedim(
        -1, dim)


@R.custom_op("tkit::softmax_backward", mutates_args=())
def _softmax_bwd_op(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return _softmax_bwd_impl(y, dy, dim, log)


@_softmax_bwd_op.register_fake
def _(y, dy, dim, log):
    return torch.empty_like(y.movedim(dim, -1), memory_format=torch.contiguous_format).movedim(
        -1, dim)


def _softmax_setup(ctx, inputs, output):
    _, dim, log = inputs
    ctx.dim, ctx.log = dim, log
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return _softmax_bwd_op(y, grad.to(y.dtype), ctx.dim, ctx.log), None, None


_softmax_op.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# --------------------------------------------------------------------------------------------
# Validation of the public functions' arguments
# --------------------------------------------------------------------------------------------
def _check(x, dim) -> int:
    C.check_tensor(x, "x", min_ndim=1)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim {dim} is out of range for x of shape {tuple(x.shape)}")
    return dim % x.ndim

