"""Losses for training: cross-entropy over logits, and fused with the LM head's GEMM.

Math, per row of logits x (V classes) with target t (rows whose target is ``ignore_index``
count 0 and are left out of the mean):

    lse      = log sum_v exp(x_v)
    loss     = lse - x_t                                  (label smoothing eps:
               (1 - eps) (lse - x_t) + eps (lse - mean_v x_v), as torch's)
               + z lse^2                                  (z-loss, PaLM's: keeps lse near 0)
    d loss / d x_v = softmax(x)_v (1 + 2 z lse) - (1 - eps) [v = t] - eps / V

Kernel (``_ce_kernel``): a persistent grid (two programs an SM) walks the rows; a first pass
over a row in chunks keeps an online max and sum of exponentials (float32), the target's
logit and the row's sum; a second pass, when a gradient is wanted, writes d loss / d x with
the reduction's factor in it (the mean's 1 / rows kept, computed on the device first), so the
softmax is never stored (Liger-Kernel's arrangement). At best the second pass finds its row
in L2: the logits read once from HBM and the gradient written once, 2 N V itemsize bytes
(the training step measured at 54% of that rate, docs/NOTES.md). The
backward multiplies that gradient in place by the upstream gradient (``_scale_rows_kernel``),
reading and writing nothing where the factor is exactly 1 (the ``loss.backward()`` of a mean
or a sum), decided on the device: no host sync.

:func:`fused_linear_cross_entropy` never holds the (N, V) logits: rows are taken in chunks,
each chunk's logits computed by ``tkit.matmul``, turned in place into their gradient by the
kernel above, and multiplied back into the hidden states' and the weight's gradients before
the next chunk (chunks of ~256 MB of logits: :func:`chunk_rows`); the backward only scales
them, in place, and not at all for an upstream gradient of 1. For LM heads of 128K classes
the logits of 8K tokens are 2 GB in bf16 (4 GB more for their float32 softmax in torch's
backward).
"""

from __future__ import annotations

import torch

from tkit.kernels import _common as C
from tkit.kernels import _offsets
from tkit.kernels import _plan as P
from tkit.kernels.losses.config import (  # noqa: F401  (public)
    _OVERRIDES,
    LossConfig,
    current_config,
    loss_config,
)
from tkit.kernels.losses.ops import (  # noqa: F401  (chunk_rows: public)
    REDUCTIONS,
    _ce_op,
    _flce_op,
    backward_once,
    ce_forward,
    ce_launch,
    check_ce,
    check_options,
    check_target,
    chunk_rows,
    flce_backward,
    flce_impl,
    reduce_rows,
    scale_rows_,
)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0,
                  reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V) against class indices ``target`` (...), as
    ``torch.nn.functional.cross_entropy`` with the class dim last.

    Parameters
    ----------
    logits : Tensor (..., V), float32/float16/bfloat16, any strides along V.
    target : int32/int64 Tensor, logits' shape without V. Values in [0, V) or ignore_index
        (checked when on the host; on the device out-of-range values are clamped, never read
        outside the row).
    ignore_index, label_smoothing, reduction
        As torch's. ``mean`` divides by the rows not ignored (NaN when there are none).
    z_loss : float
        Adds ``z_loss * lse^2`` a row (PaLM's auxiliary loss); 0 leaves it out.

    Returns
    -------
    float32 Tensor: a scalar, or target's shape for ``reduction="none"``. Differentiable in
    logits; the gradient is computed in the forward pass (one more pass over the row, no
    softmax stored), in logits' dtype.
    """
    if (logits.ndim == 2 and type(ignore_index) is int and type(label_smoothing) is float
            and type(z_loss) is float and reduction in REDUCTIONS
            and P.plannable(_OVERRIDES.state.value, logits, target)):
        # the eager plan of the loss rows (tkit.kernels._plan; host targets' values are still
        # checked each call), the reduction after it
        rows = P.serve_fast(_plans, ("ce", ignore_index, label_smoothing, z_loss),
                            (logits, target), _ce_rows_slow,
                            (logits, target, ignore_index, label_smoothing, z_loss),
                            _ce_hit_check if _offsets.values_checked(target) else None)
        return reduce_rows(rows, target, ignore_index, reduction)
    check_ce(logits, target, ignore_index, label_smoothing, z_loss, reduction)
    v = logits.shape[-1]
    x = logits.reshape(-1, v)
    t = target.reshape(-1)
    with_grad = torch.is_grad_enabled() and logits.requires_grad
    args = (x, t, int(ignore_index), float(label_smoothing), float(z_loss), reduction)
    if torch.compiler.is_compiling():  # traced: the registered op and its autograd
        loss = _ce_op(*args, with_grad)[0]
    elif with_grad:  # eager: the same kernel, the backward in place, no dispatcher
        loss = _CrossEntropy.apply(*args)
    else:
        loss = ce_forward(*args, False)[0]
    return loss.view(target.shape) if reduction == "none" else loss


_plans = P.new_cache()


def _ce_hit_check(logits, target, ignore_index, smoothing, z):
    check_target(target, target.shape, logits.shape[-1], ignore_index, "unchanged")


def _ce_rows_slow(logits, target, ignore_index, smoothing, z):
    check_ce(logits, target, ignore_index, smoothing, z, "none")
    return ce_launch(logits, target, ignore_index, smoothing, z, False)[0]


class _CrossEntropy(torch.autograd.Function):
    """Eager autograd of ``tkit::cross_entropy``: the op's rule (ops._ce_backward), with the
    forward's gradient scaled in place (not at all where the upstream gradient is 1)."""

    @staticmethod
    def forward(ctx, x, t, ignore_index, smoothing, z, reduction):
        loss, g = ce_forward(x, t, ignore_index, smoothing, z, reduction, True)
        ctx.save_for_backward(g)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        backward_once(ctx, "tkit.cross_entropy")
        (g,) = ctx.saved_tensors
        return scale_rows_(g, grad_loss.float()), None, None, None, None, None





def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                               target: torch.Tensor, bias: torch.Tensor | None = None, *,
                               ignore_index: int = -100, label_smoothing: float = 0.0,
                               z_loss: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without the (N, V) logits in
    memory (the module docstring says how).

    Parameters
    ----------
    hidden : Tensor (..., H), float16/bfloat16/float32: the last hidden states.
    weight : Tensor (V, H): the LM head (nn.Linear's layout), hidden's dtype.
    target : int Tensor, hidden's shape without H.
    bias : Tensor (V,), optional.
    ignore_index, label_smoothing, z_loss : as :func:`cross_entropy`.
    reduction : {"mean", "sum"}

    Returns
    -------
    float32 scalar. Differentiable in hidden, weight and bias; their gradients are computed
    in the forward (the weight's accumulated chunk by chunk in its dtype, as Liger-Kernel
    does) and scaled by the upstream gradient in the backward.
    """
    C.check_tensor(hidden, "hidden", min_ndim=1)
    C.check_tensor(weight, "weight", ndim=2)
    h = hidden.reshape(-1, hidden.shape[-1])
    if weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; it must be (classes, "
                         f"{h.shape[1]}) for hidden states of width {h.shape[1]}")
    if weight.dtype != h.dtype:
        raise TypeError(f"weight has dtype {C.dtype_name(weight.dtype)} but hidden has "
                        f"{C.dtype_name(h.dtype)}; they must match")
    if bias is not None:
        C.check_tensor(bias, "bias", ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} entries but weight has "
                             f"{weight.shape[0]} classes")
    if reduction not in REDUCTIONS[:2]:
        raise ValueError(f"reduction must be 'mean' or 'sum' (the gradients are summed over "
                         f"rows in the forward), got {reduction!r}")
    check_options(ignore_index, label_smoothing, z_loss, reduction)
    check_target(target, hidden.shape[:-1], weight.shape[0], ignore_index,
                 "hidden's shape without the hidden dim")
    C.check_same_device(hidden=hidden, weight=weight, target=target, bias=bias)
    with_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias))
    args = (h, weight, bias, target.reshape(-1), int(ignore_index), float(label_smoothing),
            float(z_loss), reduction == "mean")
    if torch.compiler.is_compiling():  # traced: the registered op and its autograd
        return _flce_op(*args, with_grad)[0]
    if with_grad:  # eager: the same work and backward without the dispatcher
        return _FusedLinearCrossEntropy.apply(*args)
    return flce_impl(*args, False)[0]


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Eager autograd of ``tkit::fused_linear_cross_entropy`` (the op's own rule)."""

    @staticmethod
    def forward(ctx, *args):
        loss, gh, gw, gb = flce_impl(*args, True)
        ctx.has_bias = args[2] is not None
        ctx.save_for_backward(gh, gw, gb)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        backward_once(ctx, "tkit.fused_linear_cross_entropy")
        return flce_backward(*ctx.saved_tensors, grad_loss, ctx.has_bias,
                             in_place=True) + (None,) * 5


def cost_cross_entropy(logits, target, **_):
    from tkit._cost import Cost

    n = logits.numel()
    return Cost(2 * n * logits.element_size() + target.numel() * (target.element_size() + 4),
                6 * n)
