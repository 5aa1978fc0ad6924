# %% [markdown]
# # 07. Reading the compiler: what did Triton decide?
#
# A Triton kernel states *what* a program computes on a tile; the compiler decides *how*: which
# thread holds which elements (layouts), whether loads are pipelined through shared memory, which
# tensor-core instruction runs the `tl.dot`, and how many registers that costs. When a kernel is
# slower than its roofline (chapter 01), the first question is "did the compiler do what I
# meant?", and the answer is in its output. `tkit.ir` compiles any kernel ahead of time, for any
# NVIDIA target, on a machine with or without a GPU, and reads that output back:
#
#     tkit.ir.summary(kernel, *args, arch="sm_90", **constexprs)   # layouts, stages, regs, mma
#     tkit.ir.show(kernel, *args, stage="ptx")                     # ttir, ttgir, llir, ptx, sass
#     tkit.ir.diff(a, b)                                           # two compiles side by side
#     tkit.ir.source_map(compiled, "tl.dot")                       # PTX/SASS of one line
#
# The same works for every tkit op from the shell: `tkit ir matmul --arch sm_90 --summary`.
#
# This chapter takes a plain Triton matmul and turns its knobs (BLOCK sizes, num_warps,
# num_stages, target) one at a time, reading what changed. Run it: `python
# tutorials/07_reading_the_compiler.py` (on a GPU it also times each variant against cuBLAS);
# `pytest tutorials/07_reading_the_compiler.py` checks every claim below on any machine.

# %%
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the kernel in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import tkit.ir_tools as ir  # noqa: E402  (tkit.ir)

# %% [markdown]
# ## The kernel
#
# One program computes a BLOCK_M x BLOCK_N tile of C, walking K in steps of BLOCK_K. Nothing
# here mentions threads, shared memory or tensor cores: those are the compiler's choices.


# %%
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[M, N] = A[M, K] @ B[K, N]; all row-major (unit stride along the last dimension);
    fp32 accumulation. a_ptr/b_ptr/c_ptr: the matrices; stride_*: their row strides."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + (rm % M)[:, None] * stride_am + rk[None, :]
    b = b_ptr + rk[:, None] * stride_bk + (rn % N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(a, mask=rk[None, :] < K - k * BLOCK_K, other=0.0)
        y = tl.load(b, mask=rk[:, None] < K - k * BLOCK_K, other=0.0)
        acc += tl.dot(x, y)
        a += BLOCK_K
        b += BLOCK_K * stride_bk
    c = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
           num_warps=8, num_stages=3) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), b.stride(0), c.stride(0),
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                        num_warps=num_warps, num_stages=num_stages)
    return c


# %% [markdown]
# ## Compiling without running
#
# `tkit.ir.compile` takes the kernel and its launch arguments. Tensors may be given as
# `(shape, dtype)`: nothing is allocated, the compiler only needs each argument's type and
# whether it is 16-byte aligned (and integers: whether they are 1 or multiples of 16, which is
# how Triton's launcher specializes them). The result holds every stage.

# %%
SIZE = 4096
F16 = ((SIZE, SIZE), torch.float16)


def compile_mm(arch="sm_90", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3):
    return ir.compile(matmul_kernel, F16, F16, F16, SIZE, SIZE, SIZE, SIZE, SIZE, SIZE,
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                      num_warps=num_warps, num_stages=num_stages, arch=arch)


# %% [markdown]
# ## What Triton decided on Hopper (sm_90)
#
# Read the summary top to bottom:
#
# * **layouts**: the loads use a `#blocked` layout with 8 contiguous fp16 per thread, i.e.
#   16-byte (128-bit) global loads; the accumulator lives in an `nvidia_mma` v3 layout, which is
#   the register layout of Hopper's warpgroup MMA (`wgmma`), instruction m64n128k16 for a
#   128-wide tile; the operands sit in shared memory in the `nvmma_shared` layout with a 128-byte
#   swizzle, the layout wgmma reads directly.
# * **pipelining**: num_stages=3 gave two shared-memory ring buffers (A and B) of 3 slots each,
#   async copies (`cp.async`) that keep 2 groups in flight, and a wgmma wait depth of 1: one MMA
#   is still running while the next tile's loads are issued.
# * **resources**: registers per thread, shared memory (3 x (128x64 + 64x128) x 2 bytes = 96 KB)
#   and the occupancy they allow.
# * **instructions**: `wgmma.mma_async` in PTX, `HGMMA` in SASS, `LDGSTS` (the SASS of
#   cp.async) for the loads.
# * **main loop**: the same count for the K loop alone (the SASS's longest backward branch):
#   every HGMMA of the kernel, the copies of the next stages, and no layout conversion (the
#   TTGIR's `convert_layout`s inside `scf.for`). A whole-kernel count hides what runs every
#   iteration: tkit's M=1 INT4 GEMV once had 8 CTA barriers and 6 shared-memory stores and
#   loads in every step, because `tl.load` gave its scales a layout the step's sums did not
#   use (tutorial 09, "Reading the compiler").

# %%
def show_hopper():
    return ir.summary(compile_mm("sm_90"))


# %% [markdown]
# ## Same kernel, Ampere (sm_80)
#
# On sm_80 there is no wgmma: the accumulator becomes an `nvidia_mma` v2 layout, the dot is a
# sequence of warp-level `mma.sync.m16n8k16`, and the operands go from shared memory to
# registers through `ldmatrix` first (the dot-operand layouts appear). `tkit.ir.diff` puts the
# two compiles side by side: summary differences first, then the TTGIR diff.

# %%
def ampere_vs_hopper():
    return ir.diff(compile_mm("sm_80"), compile_mm("sm_90"))


# %% [markdown]
# ## Turning the knobs
#
# * **BLOCK_N** sets the N of the wgmma instruction (m64n64k16 for a 64-wide tile, m64n256k16
#   for 256): larger instructions, fewer of them, more accumulator registers per thread.
# * **num_warps** sets how many warps share the tile: 4 warps are one warpgroup, 8 are two,
#   stacked along M (`warpsPerCTA = [8, 1]`); each warp holds half as much accumulator.
# * **num_stages** sets the ring-buffer depth and so the shared memory: 2, 3, 4 stages need
#   64, 96, 128 KB here; past 2 blocks of 96 KB an SM cannot hold a third (228 KB), so deeper
#   pipelines trade occupancy for latency hiding.

# %%
VARIANTS = [
    dict(),  # the default: 128x128x64, 8 warps, 3 stages
    dict(BLOCK_N=64, num_warps=4),
    dict(BLOCK_N=256, num_warps=8),
    dict(num_warps=4),
    dict(num_stages=2),
    dict(num_stages=4),
]


def facts(s: ir.Summary) -> dict:
    """The handful of numbers this chapter compares, pulled from a summary."""
    mma = next((lay for lay in s.layouts if lay["kind"] == "nvidia_mma"), None)
    instr = [k.split(" ", 1)[1] for k in s.ptx if k.startswith(("wgmma.mma_async", "mma.sync"))]
    return dict(config=s.config, mma=instr, warps_per_cta=mma["params"]["warpsPerCTA"],
                buffers=s.pipelining["buffers"], regs=s.resources["n_regs"],
                spills=s.resources["n_spills"], shared_kb=s.resources["shared"] / 1024,
                blocks_per_sm=s.occupancy["blocks_per_sm"])


def knob_table(arch="sm_90") -> list[dict]:
    rows = []
    for v in VARIANTS:
        f = facts(ir.summary(compile_mm(arch, **v), echo=False))
        rows.append(f)
        cfg = {k: f["config"].get(k, 0) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps",
                                                   "num_stages")}
        print(f"{cfg}  mma={f['mma']}  warps={f['warps_per_cta']}  buffers={f['buffers']}  "
              f"regs={f['regs']}  smem={f['shared_kb']:.0f}KB  blocks/SM={f['blocks_per_sm']}")
    return rows


# %% [markdown]
# ## From a Python line to the instructions
#
# `source_map` lists the PTX and SASS that one line of the kernel produced (Triton compiles with
# line information). For the `tl.dot` line on sm_90 that is the wgmma fence/commit/wait
# sequence and the HGMMA instructions.

# %%
def dot_line():
    return ir.source_map(compile_mm("sm_90"), "tl.dot")


# %% [markdown]
# ## Checks (pytest runs these on any machine; the kernel itself runs in the interpreter on CPU)


# %%
def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_matmul_is_correct():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(70, 96, generator=g).half().to(_device())
    b = torch.randn(96, 50, generator=g).half().to(_device())
    c = matmul(a, b, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=4)  # one program
    ref = a.float() @ b.float()
    torch.testing.assert_close(c.float(), ref, atol=2e-2, rtol=2e-2)


def test_the_main_loop_holds_every_mma():
    s = ir.summary(compile_mm("sm_90"), echo=False)
    mma = [k for k in s.sass if k.startswith("HGMMA")]
    assert mma and all(s.main_loop["histogram"][k] == s.sass[k] for k in mma)
    assert s.main_loop["conversions"] == 0


def test_hopper_uses_wgmma_and_ampere_mma_sync():
    h, a = compile_mm("sm_90"), compile_mm("sm_80")
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in h.asm["ptx"]
    assert "HGMMA.64x128x16" in h.sass()
    assert "mma.sync.aligned.m16n8k16" in a.asm["ptx"] and "ldmatrix" in a.asm["ptx"]
    assert "wgmma" not in a.asm["ptx"]
    s = ir.summary(h, echo=False)
    words = " ".join(lay["words"] for lay in s.layouts)
    assert "16-byte" in words and "128-byte swizzle" in words


def test_block_n_sets_the_wgmma_shape():
    small = facts(ir.summary(compile_mm(BLOCK_N=64, num_warps=4), echo=False))
    large = facts(ir.summary(compile_mm(BLOCK_N=256), echo=False))
    assert small["mma"] == ["m64n64k16"] and large["mma"] == ["m64n256k16"]


def test_num_warps_sets_warps_per_cta():
    assert facts(ir.summary(compile_mm(num_warps=4), echo=False))["warps_per_cta"] == [4, 1]
    assert facts(ir.summary(compile_mm(num_warps=8), echo=False))["warps_per_cta"] == [8, 1]


def test_num_stages_sets_buffers_and_shared_memory():
    tile_kb = (128 * 64 + 64 * 128) * 2 / 1024  # one stage of A and B, fp16
    for stages in (2, 4):
        f = facts(ir.summary(compile_mm(num_stages=stages), echo=False))
        assert f["buffers"] == [stages, stages]
        assert f["shared_kb"] == stages * tile_kb


# %% [markdown]
# ## Measure (GPU)
#
# On the H200 each variant is timed against cuBLAS (torch.matmul) with the facts beside it, so a
# slow variant can be read off its summary: low occupancy, spills, or no pipelining.

# %%
if __name__ == "__main__":
    show_hopper()
    print()
    ampere_vs_hopper()
    print()
    rows = knob_table()
    dot_line()
    if torch.cuda.is_available():
        a = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.float16)
        b = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.float16)
        flops = 2 * SIZE**3
        ms = triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="median")
        print(f"\ncuBLAS: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
        ref = torch.matmul(a, b)
        for v, f in zip(VARIANTS, rows):
            out = matmul(a, b, **v)
            err = (out.float() - ref.float()).abs().max().item()
            t = triton.testing.do_bench(lambda v=v: matmul(a, b, **v), return_mode="median")
            print(f"{v or 'default'}: {t:.3f} ms, {flops / t / 1e9:.0f} TFLOP/s, "
                  f"{ms / t:.2f}x cuBLAS, max err {err:.3f}, regs {f['regs']}, "
                  f"blocks/SM {f['blocks_per_sm']}")
