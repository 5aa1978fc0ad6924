"""`tkit ir OP --arch sm_90 --summary` works for every registered op (families join as they
land in the registry)."""

import re

import pytest

import tkit.ir_tools as ir
from tkit import registry

SPECS = registry.all_specs()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_summary_for_every_op(spec):
    if spec.family == "cuda_ext":
        pytest.skip("CUDA C++ escape hatch, not a Triton kernel: tkit.ir reads Triton kernels")
    s = ir.summary(spec.name, arch="sm_90", echo=False)
    k = ir.compile(spec.name, arch="sm_90")  # cached: the same compile
    # the numbers the summary reports are the compiled kernel's
    assert s.num_warps == k.metadata.num_warps and s.num_stages == k.metadata.num_stages
    assert s.resources["shared"] == k.metadata.shared
    assert s.resources["n_regs"] > 0
    assert f".target {k.arch}" in k.asm["ptx"]
    # every layout the TTGIR defines is described
    defined = set(re.findall(r"^(#\w+) = #ttg\.", k.asm["ttgir"], re.M))
    described = {lay["name"] for lay in s.layouts}
    assert defined <= described
    assert all(lay["words"] for lay in s.layouts)
    # the histograms count what the text holds
    assert s.ptx["(all instructions)"] > 0 and s.sass["(all instructions)"] > 0
    assert s.sass.get("HGMMA", 0) + sum(v for n, v in s.sass.items() if n.startswith(
        ("HGMMA", "QGMMA"))) == len(re.findall(r"\b[HQ]GMMA\.", k.sass()))
    text = str(s)
    assert "occupancy on sm_90a" in text and "layouts:" in text


def test_cuda_ext_ops_are_refused_clearly():
    names = [s.name for s in SPECS if s.family == "cuda_ext"]
    if not names:
        pytest.skip("no cuda_ext op registered")
    with pytest.raises(ir.IRError, match="CUDA C\\+\\+ kernel"):
        ir.compile(names[0], arch="sm_90")
