"""Spec of the mini fusion compiler (tkit/fuse/): programs written in plain torch, compiled by
``tkit.fuse`` and timed against the same program in torch eager and under torch.compile.

``fused(*tensors, program=name)`` runs program ``name`` of :data:`PROGRAMS` through
``tkit.fuse``; its reference is the program itself (in float64 for the reference, in the
inputs' dtype for the peer). The cost is what one fused kernel must move: every input read
once and every output written once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tkit import fuse
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


def rms_norm(x, w):
    """RMSNorm as a model file writes it (Llama's): float32 inside, the input's dtype out."""
    v = x.float()
    return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(x.dtype)


def softmax_scaled(x):
    """Scaled, clamped logits and their softmax (a sampling head's prologue)."""
    return torch.softmax((x * 0.7).clamp(-30.0, 30.0), -1)


def gelu_gate(a, b):
    """GeGLU's gate, tanh form, with a residual-style add."""
    return F.gelu(a, approximate="tanh") * b + a


#: the programs, by name
PROGRAMS = {"rms_norm": rms_norm, "softmax_scaled": softmax_scaled, "gelu_gate": gelu_gate}
_COMPILED: dict = {}


def fused(*tensors, program: str):
    """Program ``program`` compiled by ``tkit.fuse`` (one compiled object a program)."""
    if program not in _COMPILED:
        _COMPILED[program] = fuse.fuse(PROGRAMS[program])
    return _COMPILED[program](*tensors)


def reference(*tensors, program: str):
    return PROGRAMS[program](*tensors)


def cost(*tensors, program: str):
    n = tensors[0].numel()
    moved = sum(t.numel() * t.element_size() for t in tensors) + n * tensors[0].element_size()
    return Cost(moved, 8 * n)


def _case(program, shapes, dtype=BF16, group="fuse"):
    def make(device):
        ins = tuple(make_tensor(s, dtype, seed=i + 1, device=device) for i, s in enumerate(shapes))
        return ins, {"program": program}

    dims = " ".join("x".join(map(str, s)) for s in shapes)
    return Case(f"{program} {dims}", make, group, meta=dict(program=program))


def bench_cases():
    return [_case("rms_norm", [(8192, 4096), (4096,)]),
            _case("softmax_scaled", [(4096, 8192)]),
            _case("gelu_gate", [(8192, 4096), (8192, 4096)])]


def check_cases():
    f32 = torch.float32
    return [_case("rms_norm", [(7, 300), (300,)], f32), _case("rms_norm", [(3, 2, 64), (64,)]),
            _case("softmax_scaled", [(5, 1000)]), _case("gelu_gate", [(6, 129), (6, 129)], f32)]


@lazy_composite
def _shapes(draw):
    rows = draw(st.integers(1, 9))
    n = draw(st.sampled_from((1, 17, 64, 300, 1500)))
    return ((rows, n), (n,))


def _fuzz():
    # rms_norm over drawn shapes and layouts (the weight broadcast along rows)
    return dict(fn=lambda x, w: fused(x, w, program="rms_norm"),
                reference=lambda x, w: rms_norm(x, w), shapes=_shapes(),
                dtypes=(torch.float32, torch.float16, BF16),
                layouts=("contiguous", "transposed", "sliced"), ulps=4.0)


SPECS = [
    OpSpec(name="fuse", family="fuse", fn=fused, reference=reference, cost=cost,
           bench_cases=bench_cases, check_cases=check_cases, fuzz=_fuzz,
           # torch.compile: dynamo specializes on the program's name, a graph a program
           baselines={"torch": eager_baseline(reference),
                      "torch.compile": torch_compile_baseline(reference)},
           bound="memory", ulps=4.0,
           doc="programs in plain torch compiled by tkit.fuse; bytes: inputs read and the "
               "output written once"),
]
