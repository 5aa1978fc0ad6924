"""Random test tensors in every memory layout a kernel must handle."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch

#: Layout names understood by :func:`make_tensor`. ``broadcast`` gives a read-only expanded view.
LAYOUTS = ("contiguous", "transposed", "sliced", "offset", "permuted", "broadcast")


_state = threading.local()


@contextlib.contextmanager
def without_values():
    """Inside, :func:`make_tensor` allocates its tensors without drawing values (the memory is
    left uninitialized): benchmark-size inputs (GiB of them) can then be built on a CPU in
    milliseconds to check their shapes, layouts and offset tensors, which are built apart."""
    old = getattr(_state, "no_values", False)
    _state.no_values = True
    try:
        yield
    finally:
        _state.no_values = old


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


#: the largest tensor drawn on the CPU whatever the device (see make_tensor)
_HOST_DRAW_MAX = 1 << 22


def make_tensor(
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    layout: str = "contiguous",
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """A standard-normal tensor (times ``scale``) of logical ``shape`` stored in ``layout``.

    Layouts: ``contiguous``; ``transposed`` (last two dims swapped in memory); ``sliced`` (every
    other element of a twice-as-wide last dim); ``offset`` (contiguous, at storage offset 3);
    ``permuted`` (dims stored in reversed order); ``broadcast`` (the first non-unit dim has
    stride 0). Values are drawn in float32 from ``seed`` and rounded to ``dtype``, so the same
    call always gives the same tensor: failures print calls of this function as reproducers.
    Tensors of up to 2^22 elements are drawn on the CPU (the same values on any machine); larger
    ones on ``device`` by its own generator (the same values on the same kind of device), since
    drawing a benchmark's 10^8 elements on the CPU takes seconds.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    device = device or default_device()
    shape = tuple(int(s) for s in shape)

    def randn(*s):
        if getattr(_state, "no_values", False):
            return torch.empty(s, dtype=dtype, device=device)
        n = 1
        for d in s:
            n *= d
        where = "cpu" if n <= _HOST_DRAW_MAX or torch.device(device).type != "cuda" else device
        gen = torch.Generator(device=where).manual_seed(seed)
        return (torch.randn(s, generator=gen, device=where) * scale).to(dtype).to(device)

    nd = len(shape)
    if layout == "transposed" and nd >= 2:
        return randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    if layout == "sliced" and nd >= 1:
        return randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    if layout == "offset":
        n = 1
        for s in shape:
            n *= s
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= max(s, 1)
        return randn(n + 3).as_strided(shape, tuple(reversed(strides)), 3)
    if layout == "permuted" and nd >= 2:
        return randn(*reversed(shape)).permute(*reversed(range(nd)))
    if layout == "broadcast" and nd >= 1:
        dims = [i for i, s in enumerate(shape) if s > 1]
        if dims:
            small = list(shape)
            small[dims[0]] = 1
            return randn(*small).expand(shape)
    return randn(*shape)


def describe(shape, dtype, layout, seed) -> str:
    """The call of :func:`make_tensor` that rebuilds one input."""
    return f"make_tensor({tuple(shape)}, {dtype}, {layout!r}, seed={seed})"
