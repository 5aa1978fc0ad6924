"""Cross-entropy and the fused LM head + cross-entropy: loss and gradients against torch under
the reference rule, ignored rows, smoothing, z-loss, reductions, strides, bad inputs, the
registered op (opcheck, torch.compile), and the fused form's chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tkit
from tkit import _env
from tkit.kernels.losses import loss_config
from tkit.specs import losses as S
from tkit.testing import check_against_reference, check_spec, fuzz_spec, opcheck
from tkit.testing.tensors import default_device, make_tensor

ON_GPU = torch.cuda.is_available()
NAMES = ("cross_entropy", "fused_linear_cross_entropy")


def _dev():
    return default_device()


@pytest.mark.parametrize("name", NAMES)
def test_check_cases(name):
    assert check_spec(name) > 0


@pytest.mark.parametrize("name", NAMES)
def test_fuzz(name):
    fuzz_spec(name, max_examples=None if ON_GPU else 12)


@pytest.mark.parametrize("v", [1, 2])
def test_z_loss_gradient_of_confident_rows(v):
    # one class (p = 1 exactly) or a confident one: the target's gradient is p - 1 plus
    # z-loss's 2 z lse p, ~2 z lse; formed as p (1 + 2 z lse) - 1 it cancels to an ulp of 1
    # (the GPU fuzz's (1, 1) example: 4.5e-8 off a gradient of 3.1e-3)
    x = make_tensor((64, v), torch.float32, seed=7, device=_dev(), scale=3.0)
    if v > 1:
        x[:, 0] += 30.0  # p of class 0 within float32 rounding of 1
    t = torch.zeros(64, dtype=torch.int64, device=_dev())
    check_against_reference(S.ce_step, S.ref_ce_step, [x, t], dict(z_loss=1e-3))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_and_upstream_gradient(reduction):
    # a 3-D input (batch, seq, classes), a non-unit upstream gradient
    x = make_tensor((2, 5, 300), torch.float32, seed=1, device=_dev(), scale=2.0)
    t = S._targets(10, 300, _dev(), 2).view(2, 5)

    def f(fn):
        def run(x):
            loss = fn(x, t, reduction=reduction)
            return loss * (torch.arange(loss.numel(), device=x.device).view(loss.shape) + 1.5)
        return run

    check_against_reference(f(tkit.cross_entropy), f(_torch_ce), [x], grad=True)


def _torch_ce(x, t, reduction):
    return F.cross_entropy(x.movedim(-1, 1), t, reduction=reduction)  # torch: classes at dim 1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_upstream_factors_a_row_some_of_them_one(reduction):
    # the backward scales the forward's gradient in place and leaves rows whose factor is
    # exactly 1 alone (decided on the device): rows of 1 and of other factors side by side
    x = make_tensor((6, 300), torch.float32, seed=21, device=_dev(), scale=2.0)
    t = S._targets(6, 300, _dev(), 22)
    up = (torch.ones(()) if reduction == "mean"
          else torch.tensor([1.0, 2.5, 1.0, -0.5, 1.0, 0.0])).to(_dev())
    grads = []
    for fn, xx in ((tkit.cross_entropy, x), (_torch_ce, x.double())):
        xx = xx.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(xx, t, reduction=reduction), xx, up.to(xx.dtype))
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1].float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_a_second_backward_is_refused(fused):
    # the gradient is scaled in place: a second backward would scale it twice
    x = make_tensor((4, 16), torch.float32, seed=23, device=_dev()).requires_grad_()
    w = make_tensor((30, 16), torch.float32, seed=24, device=_dev(), scale=0.3)
    t = S._targets(4, 30, _dev(), 25)
    loss = (tkit.fused_linear_cross_entropy(x, w, t) if fused
            else tkit.cross_entropy(x @ w.t(), t))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def test_all_rows_ignored():
    x = make_tensor((4, 50), torch.float32, seed=2, device=_dev()).requires_grad_()
    t = torch.full((4,), -100, device=_dev())
    assert torch.isnan(tkit.cross_entropy(x, t))
    loss = tkit.cross_entropy(x, t, reduction="sum")
    assert float(loss.detach()) == 0.0
    (g,) = torch.autograd.grad(loss, x)
    assert not g.any()


def test_chunks_of_the_fused_form_agree():
    h = make_tensor((45, 32), torch.float32, seed=3, device=_dev())
    w = make_tensor((200, 32), torch.float32, seed=4, device=_dev(), scale=0.2)
    t = S._targets(45, 200, _dev(), 5)
    outs = []
    for rows in (1, 7, 16, 64):
        with loss_config(fused_chunk_rows=rows):
            outs.append(S.flce_step(h, w, t))
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fused_form_with_bias_and_no_gradient():
    h = make_tensor((12, 16), torch.float32, seed=6, device=_dev())
    w = make_tensor((30, 16), torch.float32, seed=7, device=_dev(), scale=0.3)
    b = make_tensor((30,), torch.float32, seed=8, device=_dev()).requires_grad_()
    t = S._targets(12, 30, _dev(), 9)
    loss = tkit.fused_linear_cross_entropy(h, w, t, b)
    ref = F.cross_entropy(F.linear(h, w, b), t)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    (gb,) = torch.autograd.grad(loss, b)
    (rb,) = torch.autograd.grad(ref, b)
    torch.testing.assert_close(gb, rb, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(tkit.fused_linear_cross_entropy(h, w, t), F.cross_entropy(
            F.linear(h, w), t), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda x, t: tkit.cross_entropy(x, t[:3]), "target has shape"),
    (lambda x, t: tkit.cross_entropy(x, t.float()), "target has dtype"),
    (lambda x, t: tkit.cross_entropy(x, t + 100), "outside"),
    (lambda x, t: tkit.cross_entropy(x, t, label_smoothing=1.5), "label_smoothing"),
    (lambda x, t: tkit.cross_entropy(x, t, reduction="max"), "reduction"),
    (lambda x, t: tkit.fused_linear_cross_entropy(x, x[:, :8], t), "weight has shape"),
    (lambda x, t: tkit.fused_linear_cross_entropy(x[:, :8], x[:, :8], t, reduction="none"),
     "reduction"),
])
def test_bad_inputs_name_the_argument(call, match, monkeypatch):
    x = make_tensor((6, 10), torch.float32, seed=10, device=_dev())
    t = (torch.arange(6) % 10).to(_dev())
    # device values are read under TKIT_CHECK=1 (host ones always)
    monkeypatch.setattr(_env, "CHECK", True)
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, t)


def test_opcheck():
    x = make_tensor((5, 40), torch.float32, seed=11, device=_dev()).requires_grad_()
    t = S._targets(5, 40, _dev(), 12, ignored=False)
    for reduction in ("mean", "none"):
        opcheck(torch.ops.tkit.cross_entropy.default, (x, t, -100, 0.1, 0.0, reduction, True))


def test_torch_compile_fullgraph():
    # the loss traced whole; its backward through the op's autograd (AOTAutograd)
    x = make_tensor((7, 90), torch.float32, seed=13, device=_dev())
    t = S._targets(7, 90, _dev(), 14)
    f = torch.compile(S.tkit_ce_loss, fullgraph=True,
                      backend="inductor" if ON_GPU else "aot_eager")
    for a, b in zip(S._step(f, x, t, n_grad=1), S.ce_step(x, t)):
        torch.testing.assert_close(a, b)


def test_fused_form_traces_whole_and_passes_opcheck():
    h = make_tensor((18, 16), torch.float32, seed=15, device=_dev())
    w = make_tensor((40, 16), torch.float32, seed=16, device=_dev(), scale=0.3)
    t = S._targets(18, 40, _dev(), 17)
    f = torch.compile(tkit.fused_linear_cross_entropy, fullgraph=True,
                      backend="inductor" if ON_GPU else "aot_eager")
    for a, b in zip(S._step(f, h, w, t, n_grad=2), S.flce_step(h, w, t)):
        torch.testing.assert_close(a, b)
    opcheck(torch.ops.tkit.fused_linear_cross_entropy.default,
            (h.clone().requires_grad_(), w.clone().requires_grad_(), None, t, -100, 0.0, 0.0,
             True, True))
