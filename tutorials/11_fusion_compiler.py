# %% [markdown]
# # 11. Fusion: a compiler in a few hundred lines
#
# Chapters 02-04 wrote one kernel per op; chapter 10 counted what a model pays for each launch.
# A model file is not written in kernels, though: Llama's RMSNorm is five torch lines, and in
# eager mode each line is a kernel that reads its input from HBM and writes its result back.
# A fusion compiler turns such a run of small ops into one kernel that reads the inputs once
# and writes the output once. torch.compile (Inductor) does this at scale; `tkit.fuse` does it
# in four stages small enough to read in a sitting (`tkit/fuse/compiler.py`):
#
# 1. trace the function to ATen ops with shapes (`make_fx`),
# 2. cut the ops into groups a kernel can hold,
# 3. generate a Triton kernel for each group,
# 4. launch them in order, leaving what no group holds to torch.
#
# This chapter predicts what fusion saves from the bytes, runs each stage on Llama's RMSNorm,
# shows the one trap of broadcasting a per-row value, and on a GPU measures the fused
# programs against torch eager and torch.compile.
#
# Run it: `python tutorials/11_fusion_compiler.py`; `pytest tutorials/11_fusion_compiler.py`
# checks every claim on any machine (kernels in Triton's interpreter without a GPU).

# %%
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # run kernels in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tkit import fuse  # noqa: E402
from tkit.fuse import compiler  # noqa: E402
from tkit.specs.fuse import PROGRAMS, rms_norm  # noqa: E402
from tkit.testing import check_against_reference  # noqa: E402
from tkit.testing.tensors import make_tensor  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# %% [markdown]
# ## 1. What eager costs, from the bytes
#
# Llama's RMSNorm (`tkit.specs.fuse.rms_norm`):
#
#     v = x.float()
#     y = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(x.dtype)
#
# Eager runs eight ops. Every op reads its tensor inputs and writes its output: for a bf16
# x of T x H, the float32 copy alone writes 4 T H bytes and every float32 op after it reads
# and writes 4 T H more: 6 + 8 + 4 + 8 + 8 + 6 = 40 bytes an element over the eight ops
# (the mean, the add and the rsqrt touch a value a row). A fused kernel reads x and writes y,
# 4 bytes an element: ten times less. The trace says how many bytes each op moves, so the
# prediction is a sum over the graph.

# %%
def eager_bytes(gm) -> int:
    """Bytes the ops of traced ``gm`` move run one by one: each reads its tensor inputs and
    writes its output."""
    total = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        ins = [a.meta["val"] for a in n.args if isinstance(a, torch.fx.Node)]
        out = n.meta["val"]
        total += sum(t.numel() * t.element_size() for t in ins) + out.numel() * out.element_size()
    return total


def fused_bytes(*tensors, out) -> int:
    return sum(t.numel() * t.element_size() for t in tensors) + out.numel() * out.element_size()


def test_rms_norm_moves_ten_times_less_fused():
    x = make_tensor((64, 4096), torch.bfloat16, seed=1, device=DEVICE)
    w = make_tensor((4096,), torch.bfloat16, seed=2, device=DEVICE)
    gm = compiler.trace(rms_norm, (x, w))
    assert len([n for n in gm.graph.nodes if n.op == "call_function"]) == 8
    ratio = eager_bytes(gm) / fused_bytes(x, w, out=x)
    assert 9.5 < ratio < 10.5  # 40 bytes an element eager against 4 fused


# %% [markdown]
# ## 2. Trace, group, generate
#
# `compiler.trace` runs the function once under `make_fx` and keeps the ATen ops with their
# shapes and dtypes. `compiler.group` walks them in order: an op joins the open group when the
# generator knows it and its result has the group's shape (T, H), or that shape with a last dim
# of 1, a value per row (the mean and what follows from it). The RMSNorm is one group; the
# kernel is a program a row that holds the row in registers (the mean needs all of it).

# %%
def test_rms_norm_is_one_group_and_one_kernel():
    x = make_tensor((6, 300), torch.bfloat16, seed=3, device=DEVICE)
    w = make_tensor((300,), torch.bfloat16, seed=4, device=DEVICE)
    steps = compiler.group(compiler.trace(rms_norm, (x, w)))
    assert len(steps) == 1 and isinstance(steps[0], compiler.Group) and steps[0].reduces
    src = compiler.generate(steps[0], "rms")
    # two loads (x, w), one store (y); the mean is a sum over the row divided by N
    assert src.count("tl.load(") == 2 and src.count("tl.store(") == 1 and "/ N" in src


# %% [markdown]
# ## 3. The trap: a value per row is not always per row
#
# `x.sum(-1)` is shaped (R,). Written against x (R, N), torch aligns shapes on the right, so
# (R,) is read along x's *last* dim, not one value per row: `x - x.sum(-1)` subtracts row
# sums from columns (and needs R == N). Only the keepdim form (R, 1) broadcasts per row. A
# generator that treated both as per-row values would compute another function whenever
# R == N; the grouping keeps them apart, and that case leaves the group.

# %%
def test_a_row_sum_without_keepdim_is_not_per_row():
    def fn(x):
        return x - x.sum(-1), x - x.sum(-1, keepdim=True)

    x = make_tensor((8, 8), torch.float32, seed=5, device=DEVICE)
    check_against_reference(fuse.fuse(fn), fn, [x], ulps=4)


# %% [markdown]
# ## 4. Right, under the reference rule
#
# Each program against itself in float64 (the reference) and in the inputs' dtype (the
# peer): the fused kernel computes in float32 and rounds once at its store, so its error
# is at most the peer's (which rounds after every 16-bit op) plus a few units of rounding.

# %%
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_programs_under_the_reference_rule(name):
    shapes = {"rms_norm": [(5, 256), (256,)], "softmax_scaled": [(5, 1000)],
              "gelu_gate": [(5, 256), (5, 256)]}[name]
    ins = [make_tensor(s, torch.bfloat16, seed=i, device=DEVICE) for i, s in enumerate(shapes)]
    check_against_reference(fuse.fuse(PROGRAMS[name]), PROGRAMS[name], ins, ulps=4)


# %% [markdown]
# ## 5. Measured (GPU)
#
# The `fuse` spec's cases (`tkit bench fuse` records them with the other ops): each program at
# an LLM size in bf16, fused, eager and under torch.compile, with the bytes a fused kernel must
# move. Eager should land near the ratio of section 1 below fused; torch.compile generates the
# same kind of kernel, so the two should be close; a gap between them is in the code each
# compiler writes, which `tkit ir fuse --arch sm_90` shows for ours.

# %%
def measure():
    """(program, provider, ms, TB/s) rows on the GPU, the L2 flushed before each run."""
    from tkit import registry
    from tkit.bench.timing import time_fn

    spec = registry.get("fuse")
    rows = []
    for case in spec.bench_cases():
        args, kw = case.make(DEVICE)
        moved = spec.cost(*args, **kw).bytes
        providers = {"tkit.fuse": spec.fn, **spec.available_baselines()}
        for name, fn in providers.items():
            fn(*args, **kw)  # compile first
            ms = time_fn(lambda fn=fn, args=args, kw=kw: fn(*args, **kw)).median_ms
            rows.append((case.label, name, ms, moved / ms / 1e9))
    return rows


@pytest.mark.gpu
def test_fused_beats_eager_gpu():
    t = {(c, p): ms for c, p, ms, _ in measure()}
    for case in {c for c, _ in t}:
        assert t[(case, "tkit.fuse")] < t[(case, "torch")]


# %%
if __name__ == "__main__":
    x = make_tensor((8192, 4096), torch.bfloat16, seed=1, device=DEVICE)
    w = make_tensor((4096,), torch.bfloat16, seed=2, device=DEVICE)
    gm = compiler.trace(rms_norm, (x, w))
    print(f"RMSNorm at 8192 x 4096 bf16: eager moves {eager_bytes(gm) / 1e6:.0f} MB, fused "
          f"{fused_bytes(x, w, out=x) / 1e6:.0f} MB")
    print(fuse.explain(fuse.fuse(rms_norm), x[:4], w))
    if torch.cuda.is_available():
        for case, provider, ms, tbps in measure():
            print(f"{case:36s} {provider:14s} {ms * 1e3:8.1f} us {tbps:5.2f} TB/s")
    else:
        print("the measurement (section 5) needs a CUDA GPU: skipped")
