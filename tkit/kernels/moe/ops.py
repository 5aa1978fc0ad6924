"""The MoE family's launchers, argument checks and torch.library registrations
(``tkit::moe_route``, ``tkit::moe_combine``) with their fakes and autograd."""

from __future__ import annotations

import torch

from tkit.kernels import _common as C
from tkit.kernels import _register as R
from tkit.kernels.moe._kernels import _combine_kernel, _route_kernel
from tkit.kernels.moe.config import MAX_EXPERTS, MAX_TOP_K, SCORINGS, current_config

INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def check_route(router_logits, top_k, scoring) -> None:
    C.check_tensor(router_logits, "router_logits", ndim=2)
    e = router_logits.shape[1]
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"router_logits: {e} experts (its last dim); 1 to {MAX_EXPERTS} "
                         "are supported")
    if type(top_k) is not int or not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"top_k must be an int from 1 to min(experts, {MAX_TOP_K}) = "
                         f"{min(e, MAX_TOP_K)}, got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def check_combine(y, weights, inv) -> None:
    C.check_tensor(y, "y", ndim=2)
    C.check_tensor(weights, "weights", (torch.float32,), ndim=2)
    C.check_tensor(inv, "inv", INDEX_DTYPES, ndim=2)
    C.check_same_device(y=y, weights=weights, inv=inv)
    if inv.shape != weights.shape:
        raise ValueError(f"inv has shape {tuple(inv.shape)} but weights has "
                         f"{tuple(weights.shape)}; they must match (tokens, top_k)")
    if weights.shape[1] > MAX_TOP_K:
        raise ValueError(f"weights: top_k = {weights.shape[1]} (its last dim); at most "
                         f"{MAX_TOP_K}")
    if y.shape[0] == 0 and weights.numel():
        raise ValueError("y has no rows for the tokens' experts to read")


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _route_launch(z, top_k: int, renormalize: bool, sigmoid: bool):
    t, e = z.shape
    w = C.empty((t, top_k), torch.float32, z.device)
    ids = C.empty((t, top_k), torch.int32, z.device)
    if t == 0:
        return w, ids
    cfg = current_config()
    block_e = C.next_power_of_2(e)
    block_t = max(1, min(64, cfg.route_elems // block_e))
    C.launch(_route_kernel, (C.cdiv(t, block_t),), Z=z, W=w, IDS=ids, T=t, E=e,
             szt=z.stride(0), sze=z.stride(1), swt=w.stride(0), sit=ids.stride(0),
             TOP_K=top_k, BLOCK_K=C.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_E=block_e,
             SIGMOID=sigmoid, RENORM=renormalize, INT64=C.needs_int64(z),
             num_warps=cfg.route_warps)
    return w, ids


def _combine_launch(y, weights, inv):
    t, k = weights.shape
    rows, h = y.shape
    out = C.empty((t, h), y.dtype, y.device)
    if out.numel() == 0:
        return out
    cfg = current_config()
    block_h = min(cfg.combine_h, C.next_power_of_2(h))
    grid = (C.cdiv(t, cfg.combine_t), C.cdiv(h, block_h))
    C.launch(_combine_kernel, grid, Y=y, W=weights, INV=inv, O=out, T=t, H=h, R=rows,
             syr=y.stride(0), syh=y.stride(1), swt=weights.stride(0), swk=weights.stride(1),
             sit=inv.stride(0), sik=inv.stride(1),
             sot=out.stride(0), soh=out.stride(1), TOP_K=k, BLOCK_T=cfg.combine_t,
             BLOCK_H=block_h, INT64=C.needs_int64(y, out, weights, inv),
             num_warps=cfg.combine_warps)
    return out


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@R.custom_op("tkit::moe_route", mutates_args=())
def _route_op(router_logits: torch.Tensor, top_k: int, renormalize: bool,
              sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _route_launch(router_logits, top_k, renormalize, sigmoid)


@_route_op.register_fake
def _(router_logits, top_k, renormalize, sigmoid):
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, top_k), dtype=torch.float32),
            router_logits.new_empty((t, top_k), dtype=torch.int32))


def _route_setup(ctx, inputs, output):
    z, _, ctx.renormalize, ctx.sigmoid = inputs
    ctx.save_for_backward(z, output[1])


def route_backward(z, ids, grad_w, renormalize: bool, sigmoid: bool):
    """d(loss)/d(router_logits) from d(loss)/d(weights), in float32: only the chosen experts'
    scores move the weights (the choice itself has no gradient)."""
    z, ids, g = z.float(), ids.long(), grad_w.float()
    if sigmoid:
        s = torch.sigmoid(z).gather(1, ids)
        if renormalize:
            tot = s.sum(1, keepdim=True)
            g = (g - (g * s / tot).sum(1, keepdim=True)) / tot
        return torch.zeros_like(z).scatter_(1, ids, g * s * (1 - s))
    p = torch.softmax(z, -1)
    ps = p.gather(1, ids)
    if renormalize:  # the weights are a softmax over the chosen logits
        w = ps / ps.sum(1, keepdim=True)
        return torch.zeros_like(z).scatter_(1, ids, w * (g - (w * g).sum(1, keepdim=True)))
    gp = g * ps
    return torch.zeros_like(z).scatter_(1, ids, gp) - p * gp.sum(1, keepdim=True)


def _route_backward(ctx, grad_w, grad_ids):
    z, ids = ctx.saved_tensors
    dz = route_backward(z, ids, grad_w, ctx.renormalize, ctx.sigmoid)
    return dz.to(z.dtype), None, None, None


_route_op.register_autograd(_route_backward, setup_context=_route_setup)


@R.custom_op("tkit::moe_combine", mutates_args=())
def _combine_op(y: torch.Tensor, weights: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return _combine_launch(y, weights, inv)


@_combine_op.register_fake
def _(y, weights, inv):
    return y.new_empty((weights.shape[0], y.shape[1]))


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _combine_backward(ctx, grad):
    y, w, inv = ctx.saved_tensors
    g = grad.float()
    rows = inv.long().clamp(0, y.shape[0] - 1)
    gy = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    gy.index_put_((rows.reshape(-1),), (w[..., None] * g[:, None, :]).reshape(-1, y.shape[1]),
                  accumulate=True)
    gw = (y[rows].float() * g[:, None, :]).sum(-1)
    return gy.to(y.dtype), gw, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)
