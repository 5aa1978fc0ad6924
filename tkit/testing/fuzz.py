"""``fuzz``: property-test a kernel against a reference over shapes, dtypes and layouts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from tkit.kernels._common import poisoned_outputs
from tkit.testing.compare import ReferenceMismatch, assert_close_to_reference
from tkit.testing.tensors import default_device, describe, make_tensor

# hypothesis is imported where fuzzing happens: check_against_reference (and tkit bench, which
# uses it) needs only the runtime dependencies
if TYPE_CHECKING:
    from hypothesis import strategies as st


def _as_strategy(x):
    from hypothesis import strategies as st

    if isinstance(x, st.SearchStrategy):
        return x
    return st.sampled_from(tuple(x))


def _upcast(x, dtype=torch.float64):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype)
    return x


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def check_against_reference(
    fn: Callable,
    reference: Callable,
    inputs: Sequence,
    kwargs: dict | None = None,
    *,
    factor: float = 2.0,
    grad: bool = False,
    grad_factor: float = 3.0,
    ref_dtype: torch.dtype = torch.float64,
    floor: float | None = None,
) -> None:
    """One check of the DESIGN rule: run ``fn`` (outputs poisoned), ``reference`` in
    ``ref_dtype`` and ``reference`` in the inputs' own precision; compare. With ``grad``, also
    backpropagate one random output gradient through all three and compare input gradients."""
    kwargs = kwargs or {}
    is_float = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in inputs]
    float_idx = [i for i, f in enumerate(is_float) if f]

    def prepare(dtype):
        out = []
        for x, f in zip(inputs, is_float):
            if f:
                x = x.detach() if dtype is None else _upcast(x, dtype)
                x = x.requires_grad_(grad)
            out.append(x)
        return out

    inputs, hp_inputs, peer_inputs = prepare(None), prepare(ref_dtype), prepare(None)
    with poisoned_outputs():
        out = fn(*inputs, **kwargs)
    with torch.set_grad_enabled(grad):
        ref = reference(*hp_inputs, **kwargs)
        peer = reference(*peer_inputs, **kwargs)
    outs, refs, peers = _tensors(out), _tensors(ref), _tensors(peer)
    if len(outs) != len(refs):
        raise ReferenceMismatch(f"{len(outs)} outputs but the reference gives {len(refs)}")
    for i, (o, r, p) in enumerate(zip(outs, refs, peers)):
        assert_close_to_reference(o, r, p, factor=factor, floor=floor, name=f"output {i}")
    if not grad:
        return
    gen = torch.Generator().manual_seed(1234)
    douts = [torch.randn(o.shape, generator=gen).to(o.device) for o in outs]

    def grads(ins, os):
        used = [(o, d) for o, d in zip(os, douts) if o.requires_grad]
        return torch.autograd.grad(
            [o for o, _ in used], [ins[i] for i in float_idx],
            [d.to(o.dtype) for o, d in used], allow_unused=True)

    for k, (g, gr, gp) in enumerate(zip(grads(inputs, outs), grads(hp_inputs, refs),
                                        grads(peer_inputs, peers))):
        if gr is None:
            continue
        if g is None:
            raise ReferenceMismatch(f"input {float_idx[k]} got no gradient")
        assert_close_to_reference(g, gr, gp, factor=grad_factor, floor=floor,
                                  name=f"gradient of input {float_idx[k]}")


def fuzz(
    fn: Callable,
    reference: Callable,
    *,
    shapes: st.SearchStrategy,
    dtypes: Sequence[torch.dtype] | st.SearchStrategy = (torch.float32,),
    layouts: Sequence[str] | st.SearchStrategy = ("contiguous",),
    kwargs: st.SearchStrategy | None = None,
    extra_args: Callable | None = None,
    scale: float = 1.0,
    factor: float = 2.0,
    grad: bool = False,
    floor: float | None = None,
    max_examples: int | None = None,
    device: str | None = None,
) -> None:
    """Property-test ``fn`` against ``reference`` with hypothesis.

    Parameters
    ----------
    fn : callable
        The kernel under test, called as ``fn(*tensors, **kw)``: a tkit op or any function that
        launches a Triton kernel of your own.
    reference : callable
        Same signature, written in PyTorch; called on float64 copies for the reference and on
        the inputs themselves for the same-precision peer.
    shapes : strategy
        Draws a tuple with one shape per tensor input (see ``tkit.testing.strategies``).
    dtypes, layouts : sequences or strategies
        One dtype for all inputs; one layout drawn per input.
    kwargs : strategy, optional
        Draws a dict of keyword arguments.
    extra_args : callable, optional
        ``extra_args(tensors, dtype, device) -> tuple`` appends non-random arguments.
    grad : bool
        Also compare input gradients (factor 3).

    A failure is shrunk by hypothesis to the smallest case and raised with the call that
    reproduces it, written with :func:`tkit.testing.make_tensor`.
    """
    from hypothesis import given, note, settings
    from hypothesis import strategies as st

    from tkit.testing.strategies import seeds

    device = device or default_device()
    dtype_st, layout_st = _as_strategy(dtypes), _as_strategy(layouts)
    kwargs_st = kwargs if kwargs is not None else st.just({})
    name = getattr(fn, "__qualname__", repr(fn))

    @given(shape_tuple=shapes, dtype=dtype_st, data=st.data(), kw=kwargs_st, seed=seeds())
    def run(shape_tuple, dtype, data, kw, seed):
        specs = []
        for i, shape in enumerate(shape_tuple):
            layout = data.draw(layout_st, label=f"layout of input {i}")
            specs.append((shape, dtype, layout, seed + i))
        tensors = [make_tensor(s, d, lay, seed=sd, device=device, scale=scale)
                   for s, d, lay, sd in specs]
        args = list(tensors) + list(extra_args(tensors, dtype, device) if extra_args else ())
        repro = f"{name}(" + ", ".join(describe(*s) for s in specs)
        if extra_args:
            repro += ", *extra_args"
        repro += "".join(f", {k}={v!r}" for k, v in kw.items()) + ")"
        note(f"reproduce: {repro}")
        try:
            check_against_reference(fn, reference, args, kw, factor=factor, grad=grad,
                                    floor=floor)
        except ReferenceMismatch as e:
            raise ReferenceMismatch(f"{e}\n  reproduce: {repro}") from None

    if max_examples is not None:
        run = settings(max_examples=max_examples)(run)
    run()
