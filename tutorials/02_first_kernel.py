# %% [markdown]
# # 02. A first Triton kernel, and how to measure it
#
# Chapter 01 said an add of two 16384 x 8192 bf16 tensors cannot beat the copy time: 768 MiB at
# ~4.25 TB/s is ~0.19 ms. Here we write the add, check it, and measure how close it gets.
#
# A Triton program handles one block of elements; the grid launches enough programs to cover
# the tensor. Each program computes its offsets, loads with a mask for the ragged tail, adds,
# stores.

# %%
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run on the CPU through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n  # the last program may run past the end
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    # compute in float32 and round once (the interpreter cannot do bf16 arithmetic either)
    out = a.to(tl.float32) + b.to(tl.float32)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def add(a: torch.Tensor, b: torch.Tensor, block: int = 1024) -> torch.Tensor:
    assert a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
    out = torch.empty_like(a)
    n = a.numel()
    add_kernel[(triton.cdiv(n, block),)](a, b, out, n, BLOCK=block)
    return out


# %% [markdown]
# ## Is it right?
#
# Compare against a float64 reference with the rule tkit uses everywhere: our error may be at
# most twice PyTorch's own error in the same precision, plus one unit of rounding. Fresh random
# inputs, sizes that do not divide the block, and an output poisoned with NaN would catch an
# element never written (`torch.empty_like` here holds garbage; `tkit.testing.fuzz` poisons).

# %%
def test_add_matches_reference():
    from tkit.testing import check_against_reference, make_tensor

    for n in (1, 1000, 1025, 4097):
        a = make_tensor((n,), torch.float16, seed=n, device=DEVICE)
        b = make_tensor((n,), torch.float16, seed=n + 1, device=DEVICE)
        check_against_reference(add, torch.add, [a, b])


def test_fuzz_add_with_hypothesis():
    """The same check over hypothesis-drawn sizes (contiguous 1-D, as this kernel requires)."""
    from tkit.testing import fuzz
    from tkit.testing import strategies as S

    shapes = S.shapes(min_dims=1, max_dims=1, tile=1024, max_size=5000).map(lambda s: (s, s))
    fuzz(add, torch.add, shapes=shapes, dtypes=[torch.float32, torch.float16], max_examples=15)


# %% [markdown]
# ## How fast is it?
#
# Time with CUDA events, take the median, flush the L2 between runs (`tkit.bench.time_fn` wraps
# `triton.testing.do_bench` for this). Report three ways: time, TB/s, percent of the measured
# copy ceiling, and beside the baselines *in the same run*.
#
# Measured on the H200 (2026-11-29, `python tutorials/02_first_kernel.py`, copy ceiling measured
# in the same run at 4.22 TB/s; run `h200-2026-11-29-b`, benchmarks/results/RUNS.md):
#
#     first kernel (BLOCK=1024)   188.6 us  4.27 TB/s  101.1% of copy
#     first kernel (BLOCK=4096)   189.9 us  4.24 TB/s  100.5% of copy
#     tkit.add                    189.6 us  4.25 TB/s  100.6% of copy
#     torch                       188.7 us  4.27 TB/s  101.1% of copy
#
# The first version is already on the ceiling, even a little over the copy's own figure (a copy
# reads one stream per stream written, an add two; that mix ran about 1% faster here, a
# measurement, not an explanation). An add has nothing to hide: one load per operand and a
# store. Chapter 03 shows what
# happens when the access pattern, not the arithmetic, decides.

# %%
if __name__ == "__main__":
    if not torch.cuda.is_available():
        test_add_matches_reference()
        print("no GPU: checked in the interpreter; timings need a CUDA GPU")
        raise SystemExit(0)
    import tkit
    from tkit.bench import ceilings, time_fn

    ceil = ceilings.get()
    a = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    nbytes = 3 * a.numel() * a.element_size()
    providers = {"first kernel (BLOCK=1024)": lambda: add(a, b, 1024),
                 "first kernel (BLOCK=4096)": lambda: add(a, b, 4096),
                 "tkit.add": lambda: tkit.add(a, b), "torch": lambda: a + b}
    for name, fn in providers.items():
        t = time_fn(fn).median_ms
        tbps = nbytes / (t * 1e-3) / 1e12
        print(f"{name:<28} {t * 1e3:8.1f} us  {tbps:5.2f} TB/s  "
              f"{100 * tbps / ceil.copy_tbps:5.1f}% of copy ({ceil.copy_tbps:.2f} TB/s)")
