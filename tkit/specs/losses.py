"""Specs of the losses family (tkit/kernels/losses/): cross-entropy and the fused LM head +
cross-entropy, each timed and checked as a training step's loss and gradients (forward and
backward), since that is what they are for."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tkit
from tkit.registry import (
    Case,
    Cost,
    OpSpec,
    eager_baseline,
    lazy_composite,
    optional_module,
    torch_compile_baseline,
)
from tkit.testing.tensors import make_tensor

st = optional_module("hypothesis.strategies")
BF16 = torch.bfloat16
#: Llama-3's vocabulary and hidden size
VOCAB, HIDDEN = 128256, 4096


# ---- what is timed and checked: the loss and its gradients ---------------------------------------
def _step(loss_fn, *tensors, n_grad, **kw):
    """(loss, d loss / d the first ``n_grad`` tensors) of ``loss_fn(*tensors, **kw)``."""
    leaves = [t.detach().requires_grad_() for t in tensors[:n_grad]]
    with torch.enable_grad():
        loss = loss_fn(*leaves, *tensors[n_grad:], **kw)
        return (loss,) + torch.autograd.grad(loss, leaves)


def tkit_ce_loss(logits, target, *, label_smoothing=0.0, z_loss=0.0):
    return tkit.cross_entropy(logits, target, label_smoothing=label_smoothing, z_loss=z_loss)


def torch_ce_loss(logits, target, *, label_smoothing=0.0, z_loss=0.0):
    """torch: F.cross_entropy in logits' dtype (float64 for the reference), the z-loss from
    torch.logsumexp."""
    loss = F.cross_entropy(logits, target, label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(logits.float() if logits.dtype != torch.float64 else logits, -1)
        keep = target != -100
        loss = loss + z_loss * (lse[keep] ** 2).sum() / keep.sum()
    return loss


def torch_flce_loss(hidden, weight, target):
    """torch: F.linear then F.cross_entropy (the (N, V) logits in memory)."""
    return F.cross_entropy(F.linear(hidden, weight), target)


def ce_step(logits, target, **kw):
    """tkit.cross_entropy (mean) and its gradient in logits."""
    return _step(tkit_ce_loss, logits, target, n_grad=1, **kw)


def ref_ce_step(logits, target, **kw):
    return _step(torch_ce_loss, logits, target, n_grad=1, **kw)


def flce_step(hidden, weight, target):
    """tkit.fused_linear_cross_entropy (mean) and its gradients in hidden and weight."""
    return _step(tkit.fused_linear_cross_entropy, hidden, weight, target, n_grad=2)


def ref_flce_step(hidden, weight, target):
    return _step(torch_flce_loss, hidden, weight, target, n_grad=2)


def _compiled_step(loss_fn, n_grad):
    """A baseline factory: the loss compiled by torch.compile (its backward by AOTAutograd),
    the gradients taken outside (dynamo does not trace torch.autograd.grad)."""
    def factory():
        if not torch.cuda.is_available():
            return None
        compiled = torch_compile_baseline(loss_fn)()
        return lambda *tensors, **kw: _step(compiled, *tensors, n_grad=n_grad, **kw)

    return factory


def cost_ce(logits, target, **_):
    """Logits read and their gradient written once (a fused forward and backward's least)."""
    n = logits.numel()
    return Cost(2 * n * logits.element_size() + target.numel() * target.element_size(), 8 * n)


def cost_flce(hidden, weight, target):
    """The three GEMMs (logits, d hidden, d weight: 6 N V H FLOPs); bytes of the inputs and
    gradients (the logits never reach memory whole)."""
    n, h = hidden.shape
    v = weight.shape[0]
    e = hidden.element_size()
    return Cost(2 * (n * h + v * h) * e + n * target.element_size(), 6 * n * v * h)


# ---- inputs --------------------------------------------------------------------------------------
def _targets(n, v, device, seed, ignored=True):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=gen)
    if ignored and n > 2:
        t[::7] = -100  # padding / prompt tokens left out of the loss
    return t.to(device)


def _ce_case(n, v, dtype=BF16, group="cross_entropy", **kw):
    def make(device):
        # the target as a keyword: 1-D integer positionals are offsets to the case checks
        return (make_tensor((n, v), dtype, seed=1, device=device, scale=2.0),), dict(
            target=_targets(n, v, device, n + v), **kw)

    opts = "".join(f" {a}={b}" for a, b in kw.items())
    return Case(f"N{n} V{v}{opts}", make, group, meta=dict(rows=n, classes=v))


def _flce_case(n, h, v, dtype=BF16, group="fused_linear_cross_entropy"):
    def make(device):
        return (make_tensor((n, h), dtype, seed=1, device=device),
                make_tensor((v, h), dtype, seed=2, device=device, scale=h ** -0.5)), dict(
            target=_targets(n, v, device, n + v))

    return Case(f"N{n} H{h} V{v}", make, group, meta=dict(rows=n, hidden=h, classes=v))


def ce_bench_cases():
    return [_ce_case(8192, VOCAB)]


def ce_check_cases():
    f32 = torch.float32
    return [_ce_case(37, 1000, f32), _ce_case(20, 517, BF16, label_smoothing=0.1),
            _ce_case(9, 20000, f32, z_loss=1e-3)]


def flce_bench_cases():
    return [_flce_case(8192, HIDDEN, VOCAB)]


def flce_check_cases():
    return [_flce_case(50, 64, 300, torch.float32), _flce_case(33, 32, 1000, BF16)]


# ---- fuzz ----------------------------------------------------------------------------------------
@lazy_composite
def _ce_shapes(draw):
    n = draw(st.integers(1, 40))
    v = draw(st.sampled_from((1, 2, 7, 100, 1000, 5000)))
    return ((n, v),)


def ce_targets(tensors, dtype, device):
    n, v = tensors[0].shape
    return (_targets(n, v, device, n * 31 + v),)


def _fuzz_ce():
    return dict(fn=ce_step, reference=ref_ce_step, shapes=_ce_shapes(),
                dtypes=(torch.float32, torch.float16, BF16),
                layouts=("contiguous", "transposed", "sliced"), extra_args=ce_targets,
                kwargs=st.fixed_dictionaries({"label_smoothing": st.sampled_from((0.0, 0.2)),
                                              "z_loss": st.sampled_from((0.0, 1e-3))}))


@lazy_composite
def _flce_shapes(draw):
    n = draw(st.integers(1, 40))
    h = draw(st.sampled_from((16, 48)))
    v = draw(st.sampled_from((3, 50, 300)))
    return ((n, h), (v, h))


def flce_targets(tensors, dtype, device):
    n = tensors[0].shape[0]
    v = tensors[1].shape[0]
    return (_targets(n, v, device, n * 17 + v),)


def _fuzz_flce():
    # float32 only (the 16-bit parts are fuzzed as tkit.matmul and cross_entropy), and a floor
    # of 16 units of rounding: the weight's gradient is summed chunk by chunk (one rounding a
    # chunk, up to one chunk a row here), where the unfused peer sums all rows in one GEMM
    return dict(fn=flce_step, reference=ref_flce_step, shapes=_flce_shapes(),
                dtypes=(torch.float32,), layouts=("contiguous",), extra_args=flce_targets,
                ulps=16.0)


SPECS = [
    OpSpec(name="cross_entropy", family="losses", fn=ce_step, reference=ref_ce_step,
           cost=cost_ce, bench_cases=ce_bench_cases, check_cases=ce_check_cases,
           fuzz=_fuzz_ce,
           baselines={"torch": eager_baseline(ref_ce_step),
                      "torch.compile": _compiled_step(torch_ce_loss, 1)},
           bound="memory",
           doc="a training step's loss and d loss / d logits (forward + backward)"),
    OpSpec(name="fused_linear_cross_entropy", family="losses", fn=flce_step,
           reference=ref_flce_step, cost=cost_flce, bench_cases=flce_bench_cases,
           check_cases=flce_check_cases, fuzz=_fuzz_flce,
           baselines={"torch": eager_baseline(ref_flce_step),
                      "torch.compile": _compiled_step(torch_flce_loss, 2)},
           bound="compute",
           doc="a training step's loss and gradients in hidden and the LM head (forward + "
               "backward; the logits never whole in memory)"),
]
