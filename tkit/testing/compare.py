"""The reference-comparison rule.

A kernel in low precision is judged against a float64 (or float32) reference by comparing its
error with the error PyTorch itself makes in the same low precision, as FlashAttention's tests do:

    max|out - ref| <= factor * max|peer - ref| + floor

with ``factor`` 2 for outputs and 3 for gradients, ``peer`` the same computation run by PyTorch
in the kernel's dtype, and ``floor`` one unit of rounding of the output dtype at the reference's
largest magnitude (so that an exact peer does not demand an exact kernel). Non-finite values must
match the reference position for position; NaN never passes where the reference is finite.
"""

from __future__ import annotations

import torch

_EPS = {
    torch.float64: 2.0**-52,
    torch.float32: 2.0**-23,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
    torch.float8_e4m3fn: 2.0**-3,
    torch.float8_e5m2: 2.0**-2,
}


def eps(dtype: torch.dtype) -> float:
    """Distance from 1 to the next representable number."""
    return _EPS.get(dtype, 2.0**-23)


def _float64(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # compared where the output lives: at benchmark sizes (10^8 elements and more) a copy to
    # the host and float64 arithmetic on the CPU took seconds a case, a GPU takes milliseconds
    return t.detach().to(device=device, dtype=torch.float64)


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over the elements where ref is finite (0 for empty tensors)."""
    out, ref = _float64(out, out.device), _float64(ref, out.device)
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    return (out[finite] - ref[finite]).abs().max().item()


class ReferenceMismatch(AssertionError):
    pass


def assert_close_to_reference(
    out: torch.Tensor,
    ref: torch.Tensor,
    peer: torch.Tensor | None = None,
    *,
    factor: float = 2.0,
    floor: float | None = None,
    name: str = "output",
    ulps: float = 1.0,
) -> dict:
    """Apply the rule above; raise :class:`ReferenceMismatch` naming ``name`` on failure.

    ``peer`` may be omitted where PyTorch has no same-precision version of the op; the bound is
    then the floor alone (pass a floor that says what precision the kernel promises).
    ``ulps`` widens the default floor of float32 outputs to that many units of rounding, for
    values a kernel derives through the GPU's approximate transcendentals (exp, rsqrt: within
    2 ulp each) where the peer's own error can happen to be 0 at the worst element (the
    rounding of a low-precision output dominates there; its floor stays one unit).
    Returns the measured errors.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ReferenceMismatch(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o = _float64(out, out.device)
    r = _float64(ref, out.device)
    finite = torch.isfinite(r)
    nonfinite = ~finite
    # every count and maximum in one transfer: on a GPU each read of a value waits for the
    # device, and a fuzz campaign runs thousands of comparisons in processes that share it
    if o.numel():
        bad = finite & ~torch.isfinite(o)
        differs = nonfinite & ~((o == r) | (o.isnan() & r.isnan()))
        zero = torch.zeros((), dtype=torch.float64, device=o.device)
        stats = [bad.sum(), differs.sum(), torch.where(finite, (o - r).abs(), zero).max(),
                 torch.where(finite, r.abs(), zero).max()]
        if peer is not None:
            p = _float64(peer, out.device)
            stats.append(torch.where(finite, (p - r).abs(), zero).max())
        n_bad, n_differs, err, scale, *peer_stat = torch.stack(
            [x.to(torch.float64) for x in stats]).tolist()
        peer_err = peer_stat[0] if peer_stat else 0.0
    else:
        n_bad = n_differs = err = scale = peer_err = 0.0
    if n_bad:
        idx = bad.nonzero()[0].tolist()
        raise ReferenceMismatch(
            f"{name}: {int(n_bad)} non-finite values where the reference is finite "
            f"(first at {idx}: {o[tuple(idx)].item()} vs {r[tuple(idx)].item()}); "
            "NaN here often means an element was never written"
        )
    if n_differs:
        raise ReferenceMismatch(f"{name}: inf/NaN pattern differs from the reference")
    if floor is None:
        floor = (ulps if out.dtype == torch.float32 else 1.0) * eps(out.dtype) * max(scale, 1e-6)
    bound = factor * peer_err + floor
    if not err <= bound:
        where = ((o - r).abs() * finite).flatten().argmax().item()
        # divmod, not torch.unravel_index: its first call imports torch._refs (seconds), which
        # every forked fuzz example would pay again
        idx = []
        for size in reversed(o.shape):
            where, i = divmod(where, size)
            idx.append(i)
        idx = tuple(reversed(idx))
        raise ReferenceMismatch(
            f"{name}: max error {err:.3g} > {factor} x peer error {peer_err:.3g} + floor "
            f"{floor:.3g} (dtype {out.dtype}); worst at {idx}: got {o[idx].item():.6g}, "
            f"reference {r[idx].item():.6g}"
        )
    return {"error": err, "peer_error": peer_err, "bound": bound}
