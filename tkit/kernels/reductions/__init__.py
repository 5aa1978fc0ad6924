"""Row reductions: RMSNorm (optionally fused with the residual add), LayerNorm, softmax and
log-softmax over the last (softmax: any) dimension, forward and backward.

Math, per row of length N (float32 inside, rounded once on store; w = weight, b = bias):

    rms_norm     rstd = 1 / sqrt(mean(h^2) + eps)            y = h * rstd * w
    layer_norm   mu = mean(h), rstd = 1 / sqrt(mean((h - mu)^2) + eps)
                                                            y = (h - mu) * rstd * w + b
    residual     h = x + residual, rounded to x's dtype and stored; y is the norm of that
                 stored h (what the next layer's residual stream holds), both in one pass.
    softmax      m = max_j x_j, s = sum_j exp(x_j - m), y_i = exp(x_i - m) / s
    log_softmax  y_i = x_i - m - log(s)

Backward: norms (xhat = (h - mu) * rstd, mu = 0 for RMSNorm; g = dy * w)
dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (no mean(g) term for RMSNorm),
dw = sum over rows of dy * xhat, db = sum of dy; with the residual form the gradient of h adds
dh and x and residual both receive dx. Softmax: dx = y * (dy - sum dy y); log_softmax:
dx = dy - exp(y) * sum dy.

Cost model (``cost_*`` below, used by the specs): a forward reads M*N elements (+ M*N
residual) and writes M*N (+ M*N h), plus the (N,) weight and bias; a backward reads y or h and
dy (+ dh) and writes dx. FLOPs a element: softmax 5, rms_norm 4, its residual form 5,
layer_norm 7 -- against the H200's ~200 FLOP/byte balance point, memory-bound at every N: the
ceiling is the copy bandwidth.

The variance never takes E[x^2] - E[x]^2 (which cancels): a row held in registers takes its
mean first and then the mean of squared deviations; a row walked in chunks keeps a Welford
mean and M2 in each lane, combined exactly across lanes (two sums, or one Chan reduce).

Paths (``config.py`` chooses; the measurements are in docs/NOTES.md):

* rows in registers, ROWS rows a program (``row_config``), one read;
* the norms' and softmax's "loop" path for long rows: one program a row walks it twice in
  chunks (per-lane moments or an online max/sum, then normalize; the second walk mostly hits
  L2), one launch;
* softmax's "split" path (long rows and fewer rows than SMs, and every long-row backward): a
  (row, chunk) program computes partials, a second launch combines a row's partials and
  writes its chunk;
* the norm backward: one program an SM walks row tiles, prefetching the next, and writes a
  dw/db partial row that ``_col_sum_kernel`` reduces; long rows take their statistics from
  ``_norm_bwd_stats_kernel``. When autograd will need them the forward saves each row's
  (mean, rstd), 8 bytes a row, which spares the backward its statistics reductions.

Configurations are typed (``NormConfig``, ``NormBwdConfig``, ``SoftmaxConfig``); experiments
override them with ``with tkit.kernels.reductions.overrides(...)``.
"""

from __future__ import annotations

import torch

from tkit.kernels import _common as C
from tkit.kernels import _plan as P
from tkit.kernels.reductions import ops as _ops
from tkit.kernels.reductions._rows import as_rows
from tkit.kernels.reductions.config import _STATE as _overrides  # .current: overrides()
from tkit.kernels.reductions.config import (
    NormBwdConfig,
    NormConfig,
    SoftmaxConfig,
    overrides,
)

__all__ = ["rms_norm", "layer_norm", "softmax", "log_softmax", "overrides", "NormConfig",
           "NormBwdConfig", "SoftmaxConfig", "as_rows", "cost_softmax", "cost_rms_norm",
           "cost_rms_norm_residual", "cost_layer_norm", "BACKWARD_TENSORS"]

_T = torch.Tensor
_Param = torch.nn.Parameter
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_wants_stats = _ops._wants_stats
#: eager plans (tkit.kernels._plan); the keys hold all the ordinary path reads
_norm_plans = P.new_cache()
_softmax_plans = P.new_cache()


# --------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``.

    Parameters
    ----------
    x : Tensor
        float32/float16/bfloat16 CUDA tensor, any leading shape; rows may be strided (any
        column stride works; leading dimensions that do not merge into one row stride are
        copied first).
    weight : Tensor
        (N,), any of the three float dtypes.
    eps : float
    residual : Tensor, optional
        Same shape and dtype as ``x``. When given, ``h = x + residual`` is computed and
        normalized in one pass, and ``(rms_norm(h), h)`` is returned: the fused add + norm of
        inference engines.

    Returns
    -------
    Tensor, or (Tensor, Tensor) with ``residual``
        In ``x``'s dtype, contiguous. Differentiable in x, residual and weight.
    """
    if (P.ON and type(x) is _T and (type(weight) is _T or type(weight) is _Param)
            and type(eps) is float and not _overrides.current and not _compiling()):
        if residual is None:
            if not (_grad_enabled() and (x.requires_grad or weight.requires_grad)):
                return P.serve_fast(_norm_plans, (eps,), (x, weight), _rms_norm_slow,
                                    (x, weight, eps, None))
        elif type(residual) is _T and not (_grad_enabled() and (
                x.requires_grad or weight.requires_grad or residual.requires_grad)):
            return P.serve_fast(_norm_plans, (eps,), (x, weight, residual), _rms_norm_slow,
                                (x, weight, eps, residual))
    return _rms_norm_slow(x, weight, eps, residual)


def _rms_norm_slow(x, weight, eps, residual):
    _ops._check_norm(x, weight, residual=residual, eps=eps)
    if residual is None:
        if C.use_direct_path(x, weight):
            return _ops._norm_fwd_impl(x, weight, None, None, eps, True)[0]
        return _ops._rms_norm_op(x, weight, float(eps), _wants_stats(x, weight))[0]
    if C.use_direct_path(x, weight, residual):
        return _ops._norm_fwd_impl(x, weight, None, residual, eps, True)[:2]
    return _ops._rms_norm_residual_op(x, residual, weight, float(eps),
                                      _wants_stats(x, weight, residual))[:2]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    The variance is the biased one (as ``torch.nn.functional.layer_norm``), computed two-pass on
    chip, or with per-lane Welford updates for rows walked in chunks (see the module docstring);
    never as E[x^2] - E[x]^2. ``bias`` may be None.
    Shapes, dtypes and layouts as :func:`rms_norm`.
    """
    if type(eps) is float and P.plannable(_overrides.current, x, weight, bias):
        return P.serve_fast(_norm_plans, ("layer_norm", eps), (x, weight, bias),
                            _layer_norm_slow, (x, weight, bias, eps))
    return _layer_norm_slow(x, weight, bias, eps)


def _layer_norm_slow(x, weight, bias, eps):
    _ops._check_norm(x, weight, bias=bias, eps=eps)
    if C.use_direct_path(x, weight, bias):
        return _ops._norm_fwd_impl(x, weight, bias, None, eps, False)[0]
    return _ops._layer_norm_op(x, weight, bias, float(eps), _wants_stats(x, weight, bias))[0]


# --------------------------------------------------------------------------------------------
# Softmax
# --------------------------------------------------------------------------------------------
def _softmax_slow(x, dim, log):
    dim = _ops._check(x, dim)
    if C.use_direct_path(x):
        return _ops._softmax_fwd_impl(x, dim, log)
    return _ops._softmax_op(x, dim, log)


def _softmax(x, dim, log):
    # the eager plan (tkit.kernels._plan): the key holds all the ordinary path reads
    if (P.ON and type(x) is _T and type(dim) is int and not _overrides.current
            and not _compiling() and not (_grad_enabled() and x.requires_grad)):
        return P.serve_fast(_softmax_plans, (log, dim), (x,), _softmax_slow, (x, dim, log))
    return _softmax_slow(x, dim, log)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim``: ``exp(x - max) / sum(exp(x - max))``, computed in float32.

    Parameters
    ----------
    x : Tensor
        float32, float16 or bfloat16 CUDA tensor, at least 1-D, any strides.
    dim : int
        The reduced dimension. Rows of up to 32 KiB take one pass in registers; longer rows
        (tested up to 1M columns) take the loop or the split online-softmax path.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x``. Rows of only -inf (or holding +inf) give NaN, as torch.
    """
    return _softmax(x, dim, False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x - max - log(sum(exp(x - max)))`` along ``dim``; see :func:`softmax`."""
    return _softmax(x, dim, True)


# --------------------------------------------------------------------------------------------
# Cost: one function per op, used by its spec (tkit/specs/reductions.py)
# --------------------------------------------------------------------------------------------
#: backward bytes: (tensors read + written) per element of x
BACKWARD_TENSORS = {"softmax": 3, "log_softmax": 3, "rms_norm": 3, "rms_norm_residual": 4,
                    "layer_norm": 3}


def _cost(n_bytes, flops):
    from tkit._cost import Cost

    return Cost(n_bytes, flops)


def cost_softmax(x, dim=-1):
    """softmax and log_softmax: read x, write y; 5 FLOPs a element."""
    return _cost(2 * x.numel() * x.element_size(), 5 * x.numel())


def cost_rms_norm(x, weight, eps=1e-6):
    """Read x and weight, write y; 4 FLOPs a element."""
    return _cost(2 * x.numel() * x.element_size() + weight.numel() * weight.element_size(),
                 4 * x.numel())


def cost_rms_norm_residual(x, residual, weight, eps=1e-6):
    """Read x, residual and weight, write y and h; 5 FLOPs a element."""
    return _cost(4 * x.numel() * x.element_size() + weight.numel() * weight.element_size(),
                 5 * x.numel())


def cost_layer_norm(x, weight, bias=None, eps=1e-5):
    """Read x, weight (and bias), write y; 7 FLOPs a element."""
    wb = weight.numel() * weight.element_size() * (2 if bias is not None else 1)
    return _cost(2 * x.numel() * x.element_size() + wb, 7 * x.numel())
