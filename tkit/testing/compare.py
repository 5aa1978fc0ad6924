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


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over the elements where ref is finite (0 for empty tensors). Computed on
    ``out``'s device: abs and max are exact in float64, so where changes nothing but the copies
    (a GPU fuzz example of 1M elements would move several float64 tensors to the host)."""
    out = out.detach().double()
    ref = ref.detach().double().to(out.device)
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
) -> dict:
    """Apply the rule above; raise :class:`ReferenceMismatch` naming ``name`` on failure.

    ``peer`` may be omitted where PyTorch has no same-precision version of the op; the bound is
    then the floor alone (pass a floor that says what precision the kernel promises).
    Returns the measured errors.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ReferenceMismatch(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o = out.detach().double()
    r = ref.detach().double().to(o.device)
    finite = torch.isfinite(r)
    bad = finite & ~torch.isfinite(o)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise ReferenceMismatch(
            f"{name}: {int(bad.sum())} non-finite values where the reference is finite "
            f"(first at {idx}: {o[tuple(idx)].item()} vs {r[tuple(idx)].item()}); "
            "NaN here often means an element was never written"
        )
    nonfinite = ~finite
    if nonfinite.any():
        same = (o[nonfinite] == r[nonfinite]) | (o[nonfinite].isnan() & r[nonfinite].isnan())
        if not same.all():
            raise ReferenceMismatch(f"{name}: inf/NaN pattern differs from the reference")
    err = max_error(o, r)
    peer_err = max_error(peer, r) if peer is not None else 0.0
    if floor is None:
        scale = r[finite].abs().max().item() if finite.any() else 0.0
        floor = eps(out.dtype) * max(scale, 1e-6)
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
