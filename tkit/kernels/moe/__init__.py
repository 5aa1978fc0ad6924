"""Mixture of experts: the router's top-k, tokens grouped by expert, the experts' SwiGLU MLPs as
two grouped GEMMs, and the weighted sum of each token's expert outputs.

Math, for T tokens x (T, H), router logits z (T, E), experts e with W_gu[e] (2I, H) (gate rows
then up rows, nn.Linear's layout) and W_d[e] (H, I):

    scores    s = softmax(z) over the E experts (or sigmoid(z) each)
    route     the top_k experts of each token by score (ties to the lower index), their
              weights w = their scores, divided by the sum of the top_k when ``renormalize``
    expert    f_e(x) = W_d[e] (silu(W_g[e] x) * (W_u[e] x))
    moe(x)_t  = sum_j w[t, j] f_{ids[t, j]}(x_t)

Pipeline (:func:`moe`): :func:`moe_route` (one kernel: scores, top-k and weights a token, in
float32); :func:`moe_align` (a stable sort of the T * top_k choices by expert: the order, its
inverse and each expert's offsets, on the device without a host sync); the rows of x gathered
in that order; ``tkit.grouped_matmul`` with W_gu (T * top_k x 2I), ``tkit.silu_mul`` of its
halves, ``tkit.grouped_matmul`` with W_d; :func:`moe_combine` (one kernel: each token's
top_k rows weighted and summed in float32, in the order j = 0..top_k-1, so the result does not
depend on how tokens were ordered within an expert).

Cost model: route reads T x E logits and writes T x top_k x 8 bytes; combine reads
T x top_k x H expert outputs and writes T x H; the experts' GEMMs read each expert's weights
once (3 H I elements an expert) and do 6 T top_k H I FLOPs. At decode sizes (tokens a few per
expert) the weights dominate: memory-bound; at prefill (hundreds of tokens an expert) the
GEMMs are compute-bound.
"""

from __future__ import annotations

import torch

import tkit
from tkit.kernels import _common as C
from tkit.kernels import _plan as P
from tkit.kernels.moe.config import (  # noqa: F401  (public)
    _OVERRIDES,
    MAX_EXPERTS,
    MAX_TOP_K,
    MoeConfig,
    current_config,
    moe_config,
)
from tkit.kernels.moe.ops import (
    _combine_launch,
    _combine_op,
    _route_launch,
    _route_op,
    check_combine,
    check_route,
)


def moe_route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True,
              scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice: each token's ``top_k`` experts and their weights, in one pass.

    Parameters
    ----------
    router_logits : Tensor (tokens, experts)
        float32/float16/bfloat16, any strides; up to 1024 experts.
    top_k : int
        Experts a token, 1 to min(experts, 32).
    renormalize : bool
        Divide the top_k scores by their sum (Mixtral, Qwen-MoE); else keep the scores.
    scoring : {"softmax", "sigmoid"}
        Scores from a softmax over the experts, or a sigmoid of each logit.

    Returns
    -------
    (weights, ids): (tokens, top_k) float32 and int32, best first. Differentiable in
    ``router_logits`` through the weights (the choice has no gradient).
    """
    if (type(top_k) is int and type(renormalize) is bool and type(scoring) is str
            and P.plannable(_OVERRIDES.state.value, router_logits)):
        # the eager plan (tkit.kernels._plan): the launch follows from the key
        return P.serve_fast(_plans, ("route", top_k, renormalize, scoring), (router_logits,),
                            _route_slow, (router_logits, top_k, renormalize, scoring))
    return _route_slow(router_logits, top_k, renormalize, scoring)


_plans = P.new_cache()


def _route_slow(router_logits, top_k, renormalize, scoring):
    check_route(router_logits, top_k, scoring)
    renormalize, sigmoid = bool(renormalize), scoring == "sigmoid"
    if C.use_direct_path(router_logits):
        return _route_launch(router_logits, top_k, renormalize, sigmoid)
    return _route_op(router_logits, top_k, renormalize, sigmoid)


def moe_align(topk_ids: torch.Tensor, num_experts: int):
    """Tokens' expert choices grouped by expert, on the device (no host sync).

    ``topk_ids`` (tokens, top_k) integer. Returns ``(order, inv, offsets)``: ``order``
    (tokens * top_k,) int64, the flat choices t * top_k + j sorted by expert (stably: tokens
    in order within an expert); ``inv`` (tokens, top_k) int64, where choice (t, j) sits in that
    order (``order[inv[t, j]] == t * top_k + j``); ``offsets`` (num_experts + 1,) int32, the
    start of each expert's rows (``tkit.grouped_matmul``'s offsets: 0 first, tokens * top_k
    last). A choice outside [0, num_experts) counts as the nearest expert (0 or the last), as
    :func:`moe_route` clamps its own."""
    C.check_tensor(topk_ids, "topk_ids", (torch.int32, torch.int64), ndim=2)
    if type(num_experts) is not int or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    flat = topk_ids.reshape(-1).clamp(0, num_experts - 1)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return order, inv.view(topk_ids.shape), offsets


def moe_combine(y: torch.Tensor, weights: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[inv[t, j]]``: each token's expert outputs weighted and
    summed (j in order, float32), in one pass.

    ``y`` (rows, H) float32/float16/bfloat16, any strides: the experts' outputs in
    :func:`moe_align`'s order; ``weights`` (tokens, top_k) float32; ``inv`` (tokens, top_k)
    int32/int64 (:func:`moe_align`'s). Rows of ``inv`` outside y are clamped to it (never read
    outside y). Returns (tokens, H) in y's dtype; differentiable in y and weights."""
    if P.plannable(_OVERRIDES.state.value, y, weights, inv):
        return P.serve_fast(_plans, ("combine",), (y, weights, inv), _combine_slow,
                            (y, weights, inv))
    return _combine_slow(y, weights, inv)


def _combine_slow(y, weights, inv):
    check_combine(y, weights, inv)
    if C.use_direct_path(y, weights):
        return _combine_launch(y, weights, inv)
    return _combine_op(y, weights, inv)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
        w_down: torch.Tensor, top_k: int, *, renormalize: bool = True,
        scoring: str = "softmax") -> torch.Tensor:
    """A mixture-of-experts SwiGLU MLP (the module docstring's pipeline).

    Parameters
    ----------
    x : Tensor (tokens, H), float16/bfloat16/float32.
    router_logits : Tensor (tokens, E): the router's output for these tokens.
    w_gate_up : Tensor (E, 2I, H): each expert's gate rows then up rows (transformers 5's
        ``gate_up_proj`` layout), any strides; x's dtype.
    w_down : Tensor (E, H, I), x's dtype.
    top_k, renormalize, scoring : as :func:`moe_route`.

    Returns
    -------
    Tensor (tokens, H) in x's dtype. Differentiable in x, router_logits and the weights.
    """
    C.check_tensor(x, "x", ndim=2)
    C.check_tensor(w_gate_up, "w_gate_up", ndim=3)
    C.check_tensor(w_down, "w_down", ndim=3)
    check_route(router_logits, top_k, scoring)
    t, h = x.shape
    e, two_i, hw = w_gate_up.shape
    if router_logits.shape[0] != t:
        raise ValueError(f"router_logits has {router_logits.shape[0]} rows but x has {t} "
                         "tokens")
    if router_logits.shape[1] != e:
        raise ValueError(f"router_logits has {router_logits.shape[1]} experts but w_gate_up "
                         f"has {e}")
    if hw != h or two_i % 2:
        raise ValueError(f"w_gate_up must be (experts, 2 * intermediate, {h}), got "
                         f"{tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"w_down must be (experts, hidden, intermediate) = "
                         f"{(e, h, two_i // 2)}, got {tuple(w_down.shape)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {C.dtype_name(w.dtype)} but x has "
                            f"{C.dtype_name(x.dtype)}; they must match")
    C.check_same_device(x=x, router_logits=router_logits, w_gate_up=w_gate_up, w_down=w_down)
    weights, ids = moe_route(router_logits, top_k, renormalize=renormalize, scoring=scoring)
    return moe_experts(x, weights, ids, w_gate_up, w_down)


def moe_experts(x, topk_weights, topk_ids, w_gate_up, w_down):
    """The experts' part of :func:`moe` for a routing already made: each token's ``topk_ids``
    (tokens, top_k) experts weighted by ``topk_weights`` (align, gather, the two grouped GEMMs
    around SwiGLU, combine). Shapes as :func:`moe`; not checked here."""
    k = topk_ids.shape[-1]
    i = w_down.shape[-1]
    # through tkit's names, as every op of the pipeline (what wraps them sees all)
    order, inv, offsets = tkit.moe_align(topk_ids, w_gate_up.shape[0])
    xs = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    tf32 = C.torch_tf32()
    gu = tkit.grouped_matmul(xs, w_gate_up.transpose(1, 2), offsets, allow_tf32=tf32)
    act = tkit.silu_mul(gu[:, :i], gu[:, i:])
    y = tkit.grouped_matmul(act, w_down.transpose(1, 2), offsets, allow_tf32=tf32)
    return tkit.moe_combine(y, topk_weights.float(), inv)


def cost_route(router_logits, top_k, **_):
    from tkit._cost import Cost

    t, e = router_logits.shape
    return Cost(t * e * router_logits.element_size() + t * top_k * 8, 6 * t * e)


def cost_combine(y, weights, inv):
    from tkit._cost import Cost

    t, k = weights.shape
    h = y.shape[1]
    e = y.element_size()
    return Cost(t * k * (h * e + 4 + inv.element_size()) + t * h * e, 2 * t * k * h)


def cost(x, router_logits, w_gate_up, w_down, top_k, **_):
    """The experts' weights read once, x and the output, the T * top_k rows each GEMM reads
    and writes; FLOPs of the two GEMMs (6 T top_k H I) and the combine."""
    from tkit._cost import Cost

    t, h = x.shape
    e, two_i, _ = w_gate_up.shape
    el = x.element_size()
    rows = t * top_k
    weights = (w_gate_up.numel() + w_down.numel()) * el
    acts = (2 * t * h + rows * (h + two_i + two_i + two_i // 2 + h + h)) * el
    return Cost(weights + acts + t * router_logits.shape[1] * router_logits.element_size(),
                3 * rows * h * two_i + 2 * rows * h)
