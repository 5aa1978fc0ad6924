"""bfloat16 calls of every op family, forward and backward, judged by the reference rule.

Triton's interpreter holds bfloat16 as raw 16-bit integers, so a ``tl.dot`` (or add/mul) on
bfloat16 operands returns garbage there; the kernels upcast such operands where the interpreter
needs it. These tests are the README-style bf16 calls: on a CPU machine they run in the
interpreter (where the garbage used to be returned silently), on a GPU natively.
"""

import pytest
import torch

import tkit
from tkit.specs.attention import ref_attention, ref_attention_varlen
from tkit.specs.matmul import ref_grouped_matmul, ref_matmul, ref_matmul_fp8
from tkit.specs.reductions import (
    ref_layer_norm,
    ref_log_softmax,
    ref_rms_norm,
    ref_rms_norm_residual,
    ref_softmax,
)
from tkit.testing import check_against_reference

BF16 = torch.bfloat16


def _randn(*shape, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16).to(device)


def _rms_norm_residual(x, residual, weight):
    return tkit.rms_norm(x, weight, residual=residual)


@pytest.mark.parametrize("name", ["add", "mul", "silu_mul", "gelu_mul", "silu", "residual_add"])
def test_elementwise_bf16(name, device):
    a = _randn(33, 70, device=device, seed=1)
    b = _randn(70, device=device, seed=2)
    ref = {
        "add": lambda x, y: x + y,
        "mul": lambda x, y: x * y,
        "silu_mul": lambda x, y: torch.nn.functional.silu(x) * y,
        "gelu_mul": lambda x, y: torch.nn.functional.gelu(x) * y,
        "residual_add": lambda x, y: x + y,
    }
    if name == "silu":
        check_against_reference(tkit.silu, torch.nn.functional.silu, [a], grad=True)
        return
    check_against_reference(getattr(tkit, name), ref[name], [a, b], grad=name != "residual_add")


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "rms_norm", "rms_norm_residual",
                                "layer_norm"])
def test_reductions_bf16(op, device):
    x = _randn(9, 200, device=device, seed=3)
    w = _randn(200, device=device, seed=4)
    r = _randn(9, 200, device=device, seed=5)
    cases = {
        "softmax": (tkit.softmax, ref_softmax, [x]),
        "log_softmax": (tkit.log_softmax, ref_log_softmax, [x]),
        "rms_norm": (tkit.rms_norm, ref_rms_norm, [x, w]),
        "rms_norm_residual": (_rms_norm_residual, ref_rms_norm_residual, [x, r, w]),
        "layer_norm": (tkit.layer_norm, ref_layer_norm, [x, w, r[0]]),
    }
    fn, ref, inputs = cases[op]
    check_against_reference(fn, ref, inputs, grad=True)


@pytest.mark.parametrize("epilogue", [False, True])
def test_matmul_bf16(epilogue, device):
    """The README's call: ``tkit.matmul(x, x.T, activation="silu")``, and a plain GEMM with
    gradients (the backward runs two more GEMMs through the same kernels)."""
    a = _randn(70, 48, device=device, seed=6)
    if epilogue:
        bias = _randn(70, device=device, seed=7)
        check_against_reference(tkit.matmul, ref_matmul, [a, a.T, bias],
                                {"activation": "silu"})
    else:
        b = _randn(48, 36, device=device, seed=8)
        check_against_reference(tkit.matmul, ref_matmul, [a, b], grad=True)


def test_grouped_matmul_bf16(device):
    a = _randn(40, 48, device=device, seed=9)
    b = _randn(3, 48, 36, device=device, seed=10, scale=0.2)
    offsets = torch.tensor([0, 10, 10, 40], dtype=torch.int32, device=device)
    check_against_reference(tkit.grouped_matmul, ref_grouped_matmul, [a, b, offsets], grad=True)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_bf16(causal, device):
    q = _randn(2, 40, 4, 32, device=device, seed=11)
    k = _randn(2, 40, 2, 32, device=device, seed=12)
    v = _randn(2, 40, 2, 32, device=device, seed=13)
    check_against_reference(tkit.flash_attention, ref_attention, [q, k, v], {"causal": causal},
                            grad=True)


def test_flash_attention_varlen_bf16(device):
    q = _randn(45, 2, 32, device=device, seed=14)
    k = _randn(45, 2, 32, device=device, seed=15)
    v = _randn(45, 2, 32, device=device, seed=16)
    cu = torch.tensor([0, 5, 20, 45], dtype=torch.int32, device=device)
    check_against_reference(tkit.flash_attention_varlen, ref_attention_varlen,
                            [q, k, v, cu, cu, 25, 25], {"causal": True}, grad=True)


def test_matmul_fp8_bf16_output(device):
    """fp8 operands, bfloat16 output (matmul_fp8's default)."""
    g = torch.Generator().manual_seed(17)
    a = torch.randn(33, 64, generator=g).to(torch.float8_e4m3fn).to(device)
    b = torch.randn(40, 64, generator=g).to(torch.float8_e4m3fn).to(device).T
    sa = torch.tensor([0.5], device=device)
    sb = torch.rand(40, generator=g).to(device)
    check_against_reference(tkit.matmul_fp8, ref_matmul_fp8, [a, b, sa, sb])
