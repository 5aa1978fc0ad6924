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
from tkit.kernels._device import sm_count
from tkit.kernels.losses._kernels import _ce_kernel, _scale_rows_kernel
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
              grad_out=None, grad_scale=None):
    """(loss (N,) float32, grad (N, V) or an empty tensor) for logits x (N, V). ``grad_out``:
    where the gradient goes (``x`` itself: each element is read before it is written, by the
    same program; the fused form's chunks), else a new tensor like x. ``grad_scale``: a
    float32 0-d device tensor the gradient is multiplied by (the mean's 1 / rows kept), or
    None for 1."""
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
    programs = min(n, cfg.programs_per_sm * sm_count(x.device))
    C.launch(_ce_kernel, (programs,), X=x, TGT=target, LOSS=loss, G=g if with_grad else x,
             GSCALE=grad_scale if grad_scale is not None else loss, N=n, V=v, sxn=x.stride(0),
             sxv=x.stride(1), stn=target.stride(0), sgn=gs[0], sgv=gs[1],
             ignore_index=int(ignore_index), smoothing=float(smoothing), z_coef=float(z),
             BLOCK_V=block_v, SMOOTH=smoothing > 0.0, ZLOSS=z > 0.0, HAS_GRAD=with_grad,
             SCALED=with_grad and grad_scale is not None,
             INT64=C.needs_int64(x, g) if with_grad else C.needs_int64(x),
             num_warps=cfg.num_warps)
    return loss, g


def mean_scale(target, ignore_index: int):
    """1 / (rows whose target is not ignore_index), float32, 0-d, on the device (inf when
    every row is ignored: the mean is NaN then, as torch's)."""
    return (target != ignore_index).sum(dtype=torch.float32).reciprocal()


def scale_rows_(g, factor) -> torch.Tensor:
    """``g`` (R, C) times ``factor`` (a 0-d tensor, or one value a row) in place, in float32
    and rounded once; rows whose factor is 1 are not touched (decided on the device)."""
    if g.numel() == 0:
        return g
    g2 = g if g.ndim == 2 else g.view(1, -1) if g.ndim < 2 else g.view(-1, g.shape[-1])
    r, c = g2.shape
    f = factor.reshape(-1)
    block = min(SCALE_BLOCK, C.next_power_of_2(c))
    C.launch(_scale_rows_kernel, (r, -(-c // block)), G=g2, S=f, V=c, sgn=g2.stride(0),
             sgv=g2.stride(1), ss=0 if f.numel() == 1 else f.stride(0), BLOCK=block,
             INT64=C.needs_int64(g2), num_warps=4)
    return g


#: columns a program of the backward's scaling
SCALE_BLOCK = 4096


def backward_once(ctx, what: str) -> None:
    """An eager backward that scales the forward's gradient in place: a second backward
    through the same graph (``retain_graph=True``) would scale it twice, so it is refused."""
    if getattr(ctx, "used", False):
        raise RuntimeError(f"{what}: its gradient is made in the forward and scaled in place "
                           "by the backward, so its graph takes one backward (a second one, "
                           "after retain_graph=True, is not supported); call the loss again")
    ctx.used = True


def reduce_rows(rows, target, ignore_index: int, reduction: str, inv=None):
    """The loss from its rows: ``none`` as target's shape, ``sum``, or ``mean`` (``inv``:
    :func:`mean_scale` when already computed)."""
    if reduction == "none":
        return rows.view(target.shape)
    total = rows.sum()
    if reduction == "sum":
        return total
    return total * (inv if inv is not None else mean_scale(target, ignore_index))


def ce_forward(x, t, ignore_index, smoothing, z, reduction, with_grad):
    """(loss reduced as ``reduction`` asks, d loss / d x or an empty tensor): the gradient
    already holds the mean's 1 / rows kept."""
    inv = mean_scale(t, ignore_index) if reduction == "mean" else None
    rows, g = ce_launch(x, t, ignore_index, smoothing, z, with_grad, grad_scale=inv)
    return reduce_rows(rows, t, ignore_index, reduction, inv), g


@R.custom_op("tkit::cross_entropy", mutates_args=())
def _ce_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float,
           z_loss: float, reduction: str, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return ce_forward(logits, target, ignore_index, smoothing, z_loss, reduction, with_grad)


@_ce_op.register_fake
def _(logits, target, ignore_index, smoothing, z_loss, reduction, with_grad):
    n = logits.shape[0]
    return (logits.new_empty((n,) if reduction == "none" else (), dtype=torch.float32),
            logits.new_empty(tuple(logits.shape) if with_grad else (0,)))


def _ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _ce_backward(ctx, grad_loss, grad_g):
    # traced (torch.compile): out of place, as a functional graph wants; the eager Function
    # scales in place
    (g,) = ctx.saved_tensors
    if g.numel() == 0 and grad_loss.numel():
        raise RuntimeError("tkit::cross_entropy ran without its gradient (with_grad=False); "
                           "call tkit.cross_entropy, which asks for it when logits need one")
    f = grad_loss.reshape(-1, 1) if grad_loss.ndim else grad_loss
    return (g * f.to(g.dtype)), None, None, None, None, None, None


_ce_op.register_autograd(_ce_backward, setup_context=_ce_setup)


# ---- the fused LM head + cross-entropy ----------------------------------------------------------
def chunk_rows(n: int, hidden: int, vocab: int, itemsize: int = 2) -> int:
    """Rows a chunk of :func:`fused_linear_cross_entropy`: a power of 2 whose logits take
    about ``CHUNK_BYTES`` (at least 256 rows, at most n). Small chunks save memory but each
    adds a pass over the weight's gradient (read and written by the accumulating GEMM, 2 GB
    at 128K x 4096 bf16) and leaves the hidden states' GEMM (chunk x hidden tiles) short of
    a wave; at 128K classes this rule takes 1024 rows, 262 MB of bf16 logits against 2.1 GB
    unchunked."""
    cfg = current_config()
    if cfg.fused_chunk_rows:
        return max(1, min(n, cfg.fused_chunk_rows))
    rows = max(256, CHUNK_BYTES // max(1, vocab * itemsize))
    return max(1, min(n, 1 << (rows.bit_length() - 1)))


#: the logits of one chunk of the fused form, in bytes (see :func:`chunk_rows`)
CHUNK_BYTES = 256 << 20


def flce_impl(h, weight, bias, target, ignore_index: int, smoothing: float, z: float,
              mean: bool, with_grad: bool):
    """(loss, d loss/d h, d loss/d weight, d loss/d bias) of the fused form, the gradients
    (empty tensors without ``with_grad``) already divided by the rows kept for a mean."""
    n = h.shape[0]
    rows = torch.empty((n,), dtype=torch.float32, device=h.device)
    inv = mean_scale(target, ignore_index) if mean else None
    empty = h.new_empty((0,))
    gh = torch.empty_like(h) if with_grad else empty
    gw = (torch.empty_like(weight) if n else torch.zeros_like(weight)) if with_grad else empty
    gb = (torch.zeros(bias.shape, dtype=torch.float32, device=h.device)
          if with_grad and bias is not None else empty)
    step = chunk_rows(n, h.shape[1], weight.shape[0], h.element_size())
    tf32 = C.torch_tf32()  # float32 as torch's own GEMMs (the weight's gradient is torch's)
    planning = C._capturing() is not None  # capture_launches: benchmark sizes on a CPU
    for s in range(0, n, step):
        hc, tc = h[s:s + step], target[s:s + step]
        logits = tkit.matmul(hc, weight.t(), bias, allow_tf32=tf32)
        if not with_grad:
            loss, _ = ce_launch(logits, tc, ignore_index, smoothing, z, False)
        else:  # the chunk's gradient (the mean's 1 / rows in it), in place of its logits
            loss, g = ce_launch(logits, tc, ignore_index, smoothing, z, True, logits, inv)
            gh[s:s + step] = tkit.matmul(g, weight, allow_tf32=tf32)
            if not planning:  # (launches recorded, none run: nor do torch's GEMMs)
                if s == 0:  # the first chunk writes the weight's gradient: no zeros read
                    torch.mm(g.t(), hc, out=gw)
                else:
                    gw.addmm_(g.t(), hc)
                if bias is not None:
                    gb += g.float().sum(0)
        rows[s:s + step] = loss
    total = rows.sum()
    return (total * inv if mean else total), gh, gw, gb.to(bias.dtype) if gb.numel() else gb


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


def flce_backward(gh, gw, gb, grad_loss, has_bias: bool, in_place: bool = False):
    """The fused form's (d hidden, d weight, d bias): the forward's, scaled by the upstream
    gradient of the loss; ``in_place`` (the eager Function) scales the forward's tensors
    themselves, skipping them on the device when the upstream gradient is 1."""
    if in_place:
        g = grad_loss.float()
        return (scale_rows_(gh, g), scale_rows_(gw, g), scale_rows_(gb, g) if has_bias else None)
    return (gh * grad_loss.to(gh.dtype), gw * grad_loss.to(gw.dtype),
            gb * grad_loss.to(gb.dtype) if has_bias else None)


_flce_op.register_autograd(_flce_backward, setup_context=_flce_setup)
