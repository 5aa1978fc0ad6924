"""The losses family's launchers, argument checks, the fused LM head + cross-entropy's chunk
loop (:func:`flce_impl`) and the torch.library registrations (``tkit::cross_entropy``,
``tkit::fused_linear_cross_entropy``) with their fakes and autograd."""

from __future__ import annotations

from typing import Optional

import torch

import tkit
from tkit.kernels import _common as C
from tkit.kernels import _offsets
from tkit.kernels import _register as R
from tkit.kernels.losses._kernels import _ce_kernel
from tkit.kernels.losses.config import current_config

TARGET_DTYPES = (torch.int32, torch.int64)
REDUCTIONS = ("mean", "sum", "none")


def check_options(ignore_index, label_smoothing, z_loss, reduction) -> None:
    if type(ignore_index) is not int:
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if float(z_loss) < 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_target(target, shape, classes: int, ignore_index: int, what: str) -> None:
    """``target`` of ``shape`` (``what`` says whose shape it must be) with class indices."""
    C.check_tensor(target, "target", TARGET_DTYPES)
    if tuple(target.shape) != tuple(shape):
        raise ValueError(f"target has shape {tuple(target.shape)}; it must be {what}, "
                         f"{tuple(shape)}")
    if target.numel() and _offsets.values_checked(target):
        # host values (and device ones under TKIT_CHECK=1), as index tensors are checked
        flat = target.reshape(-1)
        bad = (flat != ignore_index) & ((flat < 0) | (flat >= classes))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"target holds {int(flat[i])} (flat index {i}): outside "
                             f"[0, {classes}) and not ignore_index")


def check_ce(logits, target, ignore_index, label_smoothing, z_loss, reduction) -> None:
    C.check_tensor(logits, "logits", min_ndim=1)
    C.check_same_device(logits=logits, target=target)
    if logits.shape[-1] < 1:
        raise ValueError("logits has no classes (its last dim is 0)")
    check_options(ignore_index, label_smoothing, z_loss, reduction)
    check_target(target, logits.shape[:-1], logits.shape[-1], ignore_index,
                 "logits' shape without the class dim")


def ce_launch(x, target, ignore_index: int, smoothing: float, z: float, with_grad: bool,
              grad_out=None):
    """(loss (N,) float32, grad (N, V) or an empty tensor) for logits x (N, V). ``grad_out``:
    where the gradient goes (``x`` itself: each element is read before it is written, by the
    same program; the fused form's chunks), else a new tensor like x."""
    n, v = x.shape
    loss = C.empty((n,), torch.float32, x.device)
    if not with_grad:
        g = x.new_empty((0,))
    else:
        g = grad_out if grad_out is not None else C.empty((n, v), x.dtype, x.device)
    if n == 0:
        return loss, g
    cfg = current_config()
    block_v = min(cfg.block_v, C.next_power_of_2(v))
    gs = g.stride() if with_grad else (0, 0)
    C.launch(_ce_kernel, (n,), X=x, TGT=target, LOSS=loss, G=g if with_grad else x, V=v,
             sxn=x.stride(0), sxv=x.stride(1), stn=target.stride(0), sgn=gs[0], sgv=gs[1],
             ignore_index=int(ignore_index), smoothing=float(smoothing), z_coef=float(z),
             BLOCK_V=block_v, SMOOTH=smoothing > 0.0, ZLOSS=z > 0.0, HAS_GRAD=with_grad,
             INT64=C.needs_int64(x, g) if with_grad else C.needs_int64(x),
             num_warps=cfg.num_warps)
    return loss, g


@R.custom_op("tkit::cross_entropy", mutates_args=())
def _ce_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float,
           z_loss: float, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return ce_launch(logits, target, ignore_index, smoothing, z_loss, with_grad)


@_ce_op.register_fake
def _(logits, target, ignore_index, smoothing, z_loss, with_grad):
    n = logits.shape[0]
    return (logits.new_empty((n,), dtype=torch.float32),
            logits.new_empty(tuple(logits.shape) if with_grad else (0,)))


def _ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def ce_backward(g, grad_rows):
    """d loss / d logits from the forward's per-row gradient ``g`` and the upstream gradient
    of each row's loss. The upstream gradient a row in g's dtype: one rounding of a per-row
    scale (1 / rows for a mean), where a float32 product would hold a float32 copy of the
    (N, V) gradient."""
    return g * grad_rows[:, None].to(g.dtype)


def _ce_backward(ctx, grad_loss, grad_g):
    (g,) = ctx.saved_tensors
    if g.numel() == 0 and grad_loss.numel():
        raise RuntimeError("tkit::cross_entropy ran without its gradient (with_grad=False); "
                           "call tkit.cross_entropy, which asks for it when logits need one")
    return ce_backward(g, grad_loss), None, None, None, None, None


_ce_op.register_autograd(_ce_backward, setup_context=_ce_setup)


# ---- the fused LM head + cross-entropy ----------------------------------------------------------
def chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """Rows a chunk of :func:`fused_linear_cross_entropy`: about as many logits as the hidden
    states hold (N H), a power of 2 (Liger-Kernel's rule), at most n."""
    cfg = current_config()
    if cfg.fused_chunk_rows:
        return max(1, min(n, cfg.fused_chunk_rows))
    chunks = max(1, -(-vocab // max(1, hidden)))
    return max(1, min(n, C.next_power_of_2(-(-n // chunks))))


def flce_impl(h, weight, bias, target, ignore_index: int, smoothing: float, z: float,
              mean: bool, with_grad: bool):
    """(loss, d loss/d h, d loss/d weight, d loss/d bias) of the fused form, the gradients
    (empty tensors without ``with_grad``) already divided by the rows kept for a mean."""
    n = h.shape[0]
    rows = torch.empty((n,), dtype=torch.float32, device=h.device)
    empty = h.new_empty((0,))
    gh = torch.empty_like(h) if with_grad else empty
    gw = torch.zeros_like(weight) if with_grad else empty
    gb = (torch.zeros(bias.shape, dtype=torch.float32, device=h.device)
          if with_grad and bias is not None else empty)
    step = chunk_rows(n, h.shape[1], weight.shape[0])
    for s in range(0, n, step):
        hc, tc = h[s:s + step], target[s:s + step]
        logits = tkit.matmul(hc, weight.t(), bias)
        if not with_grad:
            loss, _ = ce_launch(logits, tc, ignore_index, smoothing, z, False)
        else:  # the chunk's gradient, in place of its logits
            loss, g = ce_launch(logits, tc, ignore_index, smoothing, z, True, logits)
            gh[s:s + step] = tkit.matmul(g, weight)
            gw.addmm_(g.t(), hc)
            if bias is not None:
                gb += g.float().sum(0)
        rows[s:s + step] = loss
    total = rows.sum()
    if not mean:
        return total, gh, gw, gb.to(bias.dtype) if gb.numel() else gb
    n_valid = (target != ignore_index).sum()
    if with_grad:
        gh.div_(n_valid)
        gw.div_(n_valid)
        gb = (gb / n_valid).to(bias.dtype) if bias is not None else gb
    return total / n_valid, gh, gw, gb


@R.custom_op("tkit::fused_linear_cross_entropy", mutates_args=())
def _flce_op(h: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
             target: torch.Tensor, ignore_index: int, smoothing: float, z_loss: float,
             mean: bool, with_grad: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return flce_impl(h, weight, bias, target, ignore_index, smoothing, z_loss, mean,
                     with_grad)


@_flce_op.register_fake
def _(h, weight, bias, target, ignore_index, smoothing, z_loss, mean, with_grad):
    empty = h.new_empty((0,))
    return (h.new_empty((), dtype=torch.float32),
            h.new_empty(h.shape) if with_grad else empty,
            weight.new_empty(weight.shape) if with_grad else empty,
            bias.new_empty(bias.shape) if with_grad and bias is not None else empty)


def _flce_setup(ctx, inputs, output):
    ctx.has_bias = inputs[2] is not None
    ctx.save_for_backward(*output[1:])


def _flce_backward(ctx, grad_loss, *_):
    gh, gw, gb = ctx.saved_tensors
    if gh.numel() == 0 and gw.numel() == 0:
        raise RuntimeError("tkit::fused_linear_cross_entropy ran without its gradients "
                           "(with_grad=False); call tkit.fused_linear_cross_entropy")
    return flce_backward(gh, gw, gb, grad_loss, ctx.has_bias) + (None,) * 6


def flce_backward(gh, gw, gb, grad_loss, has_bias: bool):
    """The fused form's (d hidden, d weight, d bias): the forward's, scaled by the upstream
    gradient of the loss."""
    g = grad_loss.float()
    return (gh * g.to(gh.dtype), gw * g.to(gw.dtype), gb * g.to(gb.dtype) if has_bias else None)


_flce_op.register_autograd(_flce_backward, setup_context=_flce_setup)
