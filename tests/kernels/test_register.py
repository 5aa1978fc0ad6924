"""tkit.kernels._register: the low-level torch.library registration keeps custom_op's
semantics (autograd through the op and through the Op object, an error on backward through an
op without a formula, fake tensors, torch.compile, opcheck) on ops defined here."""

from __future__ import annotations

import pytest
import torch

from tkit.kernels import _register as R


@R.custom_op("tkit_test::scaled_tanh")
def _scaled_tanh(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x * w) * scale


@_scaled_tanh.register_fake
def _(x, w, scale):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, w, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(x, w)


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    d = grad * ctx.scale * (1 - torch.tanh(x * w) ** 2)
    return d * w, (d * x).sum(0), None


_scaled_tanh.register_autograd(_backward, setup_context=_setup)


@R.custom_op("tkit_test::no_formula")
def _no_formula(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_no_formula.register_fake
def _(x):
    return torch.empty_like(x)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    return x, w


def _expected(x, w, scale):
    return torch.tanh(x * w) * scale


@pytest.mark.parametrize("call", ["object", "torch.ops"])
def test_gradients_match_autograd_of_the_formula(call):
    x, w = _inputs()
    fn = _scaled_tanh if call == "object" else torch.ops.tkit_test.scaled_tanh.default
    y = fn(x, w, 1.5)
    assert y.requires_grad
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    ex, ew = torch.autograd.grad(_expected(x2, w2, 1.5), (x2, w2), g)
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
    assert torch.autograd.gradcheck(lambda a, b: fn(a, b, 0.5), (x, w))


def test_no_gradient_needed_leaves_no_graph():
    x, w = _inputs(1)
    with torch.no_grad():
        y = _scaled_tanh(x, w, 2.0)
    assert not y.requires_grad
    y = _scaled_tanh(x.detach(), w.detach(), 2.0)
    assert not y.requires_grad and y.grad_fn is None
    torch.testing.assert_close(y, _expected(x.detach(), w.detach(), 2.0))


@pytest.mark.parametrize("call", ["object", "torch.ops"])
def test_backward_without_a_formula_raises(call):
    x, _ = _inputs(2)
    fn = _no_formula if call == "object" else torch.ops.tkit_test.no_formula.default
    y = fn(x)
    assert y.requires_grad  # as custom_op: the forward runs, the backward names the op
    with pytest.raises(RuntimeError, match="tkit_test::no_formula"):
        y.sum().backward()


def test_fake_tensors_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = _scaled_tanh(torch.empty(3, 4), torch.empty(4), 1.0)
    assert y.shape == (3, 4)
    x, w = _inputs(3)
    torch.library.opcheck(torch.ops.tkit_test.scaled_tanh.default, (x, w, 0.7))
    torch.library.opcheck(torch.ops.tkit_test.no_formula.default, (x.detach(),))


def test_torch_compile_fullgraph_forward_and_backward():
    x, w = _inputs(4)

    def f(x, w):
        return _scaled_tanh(x, w, 1.25).sin() + _no_formula(x.detach())

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y = compiled(x, w)
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    ref = _expected(x2, w2, 1.25).sin() + x2.detach() * 2
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, (x, w), g),
                               torch.autograd.grad(ref, (x2, w2), g))


def test_mutating_ops_stay_custom_ops():
    op = R.custom_op("tkit_test::add_one_", mutates_args=("x",))

    def add_one_(x: torch.Tensor) -> None:
        x.add_(1)

    registered = op(add_one_)
    assert isinstance(registered, torch._library.custom_ops.CustomOpDef)
    t = torch.zeros(3)
    v = t._version
    torch.ops.tkit_test.add_one_(t)
    assert t.tolist() == [1.0, 1.0, 1.0] and t._version > v
