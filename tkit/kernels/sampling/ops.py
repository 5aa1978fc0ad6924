"""Sampling's launchers, argument checks (options per row or scalar, seeds) and torch.library
registrations (``tkit::sample``, ``tkit::speculative_accept``) with their fakes."""

from __future__ import annotations

from typing import Optional

import torch

from tkit.kernels import _common as C
from tkit.kernels import _register as R
from tkit.kernels.sampling._kernels import (
    _chunk_kernel,
    _merge_kernel,
    _sample_kernel,
    _spec_accept_kernel,
)
from tkit.kernels.sampling.config import SEED_DTYPES, current_config


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _mode(x) -> int:
    return 0 if x is None else (2 if isinstance(x, torch.Tensor) else 1)


#: the most chunk candidates (chunks rounded up to a power of 2, times cap) a merge program
#: holds in registers; rows that would need more run one program per row
_MERGE_MAX = 16384


def _split_chunks(v: int, top_k, k_val: int, cfg) -> int:
    """Chunks per row of the split path, 0 for one program per row. Decided from the host
    values alone (a scalar top_k, the vocabulary, the config): no device read."""
    if cfg.split is False or top_k is not None or not 1 <= k_val <= cfg.cap or k_val >= v:
        return 0
    nch = C.cdiv(v, cfg.split_block)
    if cfg.split is None and nch < 2:
        return 0
    return nch if C.next_power_of_2(nch) * cfg.cap <= _MERGE_MAX else 0


def _sample_impl(logits, temperature, top_k, top_p, min_p, seeds, t_val, k_val, p_val,
                 minp_val, seed_val) -> torch.Tensor:
    b, v = logits.shape
    dev = logits.device
    out = C.empty((b,), torch.int64, dev)
    if b == 0:
        return out
    cfg = current_config(v)
    cv = C.scratch((b, cfg.cap), torch.float32, dev)
    ci = C.scratch((b, cfg.cap), torch.int32, dev)
    dummy = logits

    def ptr(t):
        return t if t is not None else dummy

    def stride(t):
        return t.stride(0) if t is not None else 0

    args = dict(X=logits, OUT=out, T=ptr(temperature), K=ptr(top_k), P=ptr(top_p),
                MINP=ptr(min_p), SEEDS=ptr(seeds), CV=cv, CI=ci, V=v,
                sxb=logits.stride(0), sxv=logits.stride(1), st=stride(temperature),
                sk=stride(top_k), sp=stride(top_p), smp=stride(min_p), ss=stride(seeds),
                t_val=t_val, k_val=k_val, p_val=p_val, minp_val=minp_val, seed_val=seed_val,
                span=cfg.span, max_iters=cfg.max_iters,
                T_MODE=2 if temperature is not None else 1,
                K_MODE=2 if top_k is not None else (1 if k_val >= 0 else 0),
                P_MODE=2 if top_p is not None else (1 if p_val >= 0 else 0),
                MINP_MODE=2 if min_p is not None else (1 if minp_val >= 0 else 0),
                SEED_MODE=2 if seeds is not None else 1,
                BLOCK=cfg.block, NP=cfg.pivots, CAP=cfg.cap, JB=min(cfg.cap_chunk, cfg.cap),
                num_warps=cfg.num_warps)
    nch = _split_chunks(v, top_k, k_val, cfg)
    if not nch:
        C.launch(_sample_kernel, (b,), **args)
        return out
    # every slot a merge reads is written first: candidates below the chunk's count, all stats
    cc = C.scratch((b, nch, cfg.cap), torch.int32, dev)
    cs = C.scratch((b, nch, 4), torch.int32, dev)
    C.launch(_chunk_kernel, (b * nch,), X=logits, T=args["T"], CC=cc, CS=cs, V=v,
             NCH=nch, sxb=args["sxb"], sxv=args["sxv"], st=args["st"], t_val=t_val,
             k_val=k_val, span=cfg.span, max_iters=cfg.max_iters, T_MODE=args["T_MODE"],
             CHUNK=cfg.split_block, SUB=min(cfg.split_block, 128 * cfg.split_warps),
             NP=cfg.split_pivots, CAP=cfg.cap, num_warps=cfg.split_warps)
    args["num_warps"] = cfg.merge_warps or cfg.num_warps
    C.launch(_merge_kernel, (b,), CC=cc, CS=cs, NCH=nch, NCHP=C.next_power_of_2(nch), **args)
    return out


def _spec_impl(draft_token_ids, draft_probs, target_probs, seeds, seed_val):
    b, k = draft_token_ids.shape
    v = draft_probs.shape[-1]
    dev = draft_probs.device
    ids = C.empty((b, k + 1), torch.int64, dev)
    nacc = C.empty((b,), torch.int32, dev)
    if b == 0:
        return ids, nacc
    cfg = current_config(v)
    C.launch(_spec_accept_kernel, (b,), DT=draft_token_ids, DP=draft_probs, TP=target_probs,
             OUT=ids, NACC=nacc, SEEDS=seeds if seeds is not None else draft_probs, K=k, V=v,
             sdtb=draft_token_ids.stride(0), sdtk=draft_token_ids.stride(1),
             sdpb=draft_probs.stride(0), sdpk=draft_probs.stride(1),
             sdpv=draft_probs.stride(2), stpb=target_probs.stride(0),
             stpk=target_probs.stride(1), stpv=target_probs.stride(2), sob=ids.stride(0),
             sok=ids.stride(1), ss=seeds.stride(0) if seeds is not None else 0,
             seed_val=seed_val, SEED_MODE=2 if seeds is not None else 1,
             BLOCK_K=max(2, C.next_power_of_2(k + 1)), BLOCK=cfg.block,
             num_warps=min(cfg.num_warps, 8))
    return ids, nacc


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@R.custom_op("tkit::sample", mutates_args=())
def _sample_op(logits: torch.Tensor, temperature: Optional[torch.Tensor],  # noqa: UP045
               top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],  # noqa: UP045
               min_p: Optional[torch.Tensor], seeds: Optional[torch.Tensor],  # noqa: UP045
               t_val: float, k_val: int, p_val: float, minp_val: float,
               seed_val: int) -> torch.Tensor:
    return _sample_impl(logits, temperature, top_k, top_p, min_p, seeds, t_val, k_val, p_val,
                        minp_val, seed_val)


@_sample_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, t_val, k_val, p_val, minp_val,
      seed_val):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@R.custom_op("tkit::speculative_accept", mutates_args=())
def _spec_op(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor,
             target_probs: torch.Tensor, seeds: Optional[torch.Tensor],  # noqa: UP045
             seed_val: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _spec_impl(draft_token_ids, draft_probs, target_probs, seeds, seed_val)


@_spec_op.register_fake
def _(draft_token_ids, draft_probs, target_probs, seeds, seed_val):
    b, k = draft_token_ids.shape
    return (draft_probs.new_empty((b, k + 1), dtype=torch.int64),
            draft_probs.new_empty((b,), dtype=torch.int32))


# --------------------------------------------------------------------------------------------
# Validation and public API
# --------------------------------------------------------------------------------------------
def _values_checked(t: torch.Tensor) -> bool:
    from tkit.kernels import _offsets

    return _offsets.values_checked(t)


def _option(x, name, batch, device, dtypes, kind):
    """(tensor or None, scalar) for one per-row option; the scalar is -1 when not given
    (the kernel compiles the option out) and ignored when a tensor is given."""
    if x is None:
        return None, -1
    if isinstance(x, torch.Tensor):
        C.check_tensor(x, name, dtypes, ndim=1)
        C.check_same_device(logits=device, **{name: x})
        if x.shape[0] != batch:
            raise ValueError(f"{name} must have one value per row ({batch}), got shape "
                             f"{tuple(x.shape)}")
        return x, 0
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a {kind}, a ({batch},) tensor or None, got "
                        f"{type(x).__name__}")
    if kind == "int" and not isinstance(x, int):
        raise TypeError(f"{name} must be an int (or a ({batch},) integer tensor), got {x!r}")
    return None, x


def _seeds(seed, batch, logits, like="logits"):
    """(per-row seed tensor or None, scalar seed); ``logits`` gives the device (named
    ``like`` in errors)."""
    if seed is None:
        # per-row seeds from torch's generator on the device: no sync, capturable in a graph
        gen = torch.randint(0, 2**62, (batch,), dtype=torch.int64, device=logits.device)
        return gen, 0
    if isinstance(seed, torch.Tensor):
        C.check_tensor(seed, "seed", SEED_DTYPES, ndim=1)
        C.check_same_device(**{like: logits}, seed=seed)
        if seed.shape[0] != batch:
            raise ValueError(f"seed must be an int or have one value per row ({batch}), got "
                             f"shape {tuple(seed.shape)}")
        return seed, 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, a ({batch},) int64 tensor or None, got "
                        f"{type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return None, seed


