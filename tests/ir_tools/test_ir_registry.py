"""`tkit ir OP --arch sm_90 --summary` works for every registered op (families join as they
land in the registry)."""

import re

import pytest
import triton
import triton.language as tl

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



def _prune_by_shared(configs, named_args, **kwargs):
    from tkit.kernels import _device

    return [c for c in configs if c.kwargs["BLOCK"] * 200 <= _device.smem_limit()]


@triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (2048, 1024, 512)], key=["n"],
                 prune_configs_by={"early_config_prune": _prune_by_shared})
@triton.jit
def _pruned_copy(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


@pytest.mark.parametrize("arch,block", [("sm_90", 1024), ("sm_80", 512)])
def test_untuned_autotuned_kernels_compile_the_config_that_fits(arch, block):
    """An autotuned kernel not tuned in this process compiles the first config its pruner
    keeps for the target arch's shared memory (232,448 B on sm_90, 166,912 on sm_80), as an
    untuned launch there would. Before, config 0 was compiled whatever the pruner said:
    flash_attention at float32 and D = 256 showed a 426,496-byte build that no launch makes
    (its pruner keeps a 139,520-byte tile)."""
    import torch

    x = torch.empty(4096, dtype=torch.float32, device="meta")
    k = ir.compile(_pruned_copy, x, x, 4096, arch=arch)
    assert k.config["BLOCK"] == block and "fits" in k.note, k.note


def test_host_descriptor_arguments_compile():
    """matmul_int4 at M = 16 (its tensor-core kernel) passes host TMA descriptors of the packed
    weight, scales and zeros: tkit.ir specializes them as Triton's launcher does (their
    tensordesc types) and compiles the kernel."""
    s = ir.summary("matmul_int4", case=1, arch="sm_90", echo=False)
    text = str(s)
    assert "_matmul_int4_tc_kernel" in text
    # (block columns: 128, or the interpreter's smaller tiles)
    assert re.search(r"q_hdesc: tensordesc<i32\[16, \d+\]>", text)
    assert re.search(r"s_hdesc: tensordesc<bf16\[1, \d+\]>", text)
    assert s.sass.get("UTMALDG", 0) > 0
