# %% [markdown]
# # 06b. Tensor cores by hand: fragments, ldmatrix, mma.sync, TMA, wgmma, warp specialization
#
# Chapter 06 lets Triton drive the tensor cores. This half reads the two CUDA GEMMs of
# `tkit/cuda_ext/csrc` that do it by hand, and checks each piece of their bookkeeping against
# an independent source (CuTe's layouts, a model of the shared-memory banks, a simulation of
# the mbarrier protocol, the SASS):
#
# * `gemm_mma_sm80.cu`: the Ampere recipe. cp.async (LDGSTS) fills a 4-stage ring of
#   swizzled shared tiles, ldmatrix (LDSM) loads fragments, mma.sync.m16n8k16 (HMMA) multiplies.
# * `gemm_wgmma_sm90.cu`: the Hopper recipe. TMA (UTMALDG) loads tiles that complete on
#   mbarriers (SYNCS), wgmma (HGMMA) reads both operands straight from shared memory, one
#   producer warpgroup feeds two consumer warpgroups that took its registers (setmaxnreg), and
#   a persistent grid walks the tiles.
#
# Run it: `pytest tutorials/06b_tensor_cores_cuda.py` (nvcc and the nvidia-cutlass headers:
# no GPU needed), `python tutorials/06b_tensor_cores_cuda.py` for the printouts, plus timings
# on a GPU.

# %%
from __future__ import annotations

import functools
import random
import re
from collections import Counter

import pytest
import torch

from tkit.cuda_ext import _loader

needs_cute = pytest.mark.skipif(
    _loader.nvcc_path() is None or _loader.cutlass_include() is None,
    reason="needs nvcc and the CuTe headers (pip install nvidia-cutlass)")
needs_sass = pytest.mark.skipif(
    _loader.nvcc_path() is None or _loader.cuda_binutil("cuobjdump") is None,
    reason="needs nvcc and cuobjdump")

# %% [markdown]
# ## 1. Fragment layouts: who holds which element
#
# A tensor-core instruction is a *warp-wide* (mma.sync) or *warpgroup-wide* (wgmma) operation:
# each thread holds a few elements of A, B and C in registers, in a fixed pattern. CuTe writes
# that pattern as a layout from (thread, value) to the element's index in the tile
# (column-major: index = row + M * column). `tkit.cuda_ext.cute_layouts()` builds and runs
# `csrc/cute_tiled_mma_layouts.cu` (a host program) and returns what CuTe prints, e.g. for the
# C fragment of mma.sync.m16n8k16:
#
#     LayoutC_TV: ((_4,_8),(_2,_2)):((_32,_1),(_16,_8))
#
# Below, a 20-line evaluator of such layouts checks the formulas the kernels' epilogues use.


# %%
def _parse(text: str):
    """'((_4,_8),(_2,_2))' -> nested tuples of ints."""
    return eval(re.sub(r"_(\d+)", r"\1", text))  # noqa: S307 - CuTe's own printout


def _flatten(x):
    return [y for e in x for y in _flatten(e)] if isinstance(x, tuple) else [x]


def cute_layout(text: str):
    """A CuTe layout 'shape:stride' as a function of its top-level coordinates."""
    shape_s, stride_s = text.split(":")
    shape, stride = _parse(shape_s), _parse(stride_s)

    def index(*coords):
        total = 0
        for c, sh, st in zip(coords, shape, stride):
            for s, d in zip(_flatten(sh) if isinstance(sh, tuple) else [sh],
                            _flatten(st) if isinstance(st, tuple) else [st]):
                total += (c % s) * d  # colexicographic: the first sub-mode varies fastest
                c //= s
        return total

    return index


def mma_c_fragment(lane: int, v: int) -> tuple[int, int]:
    """gemm_mma_sm80.cu's epilogue: c0,c1 at (lane/4, 2*(lane%4) + {0,1}), c2,c3 8 rows down."""
    return lane // 4 + 8 * (v // 2), 2 * (lane % 4) + v % 2


def mma_a_fragment(lane: int, v: int) -> tuple[int, int]:
    """The A registers as ldmatrix.x4 fills them: a0 rows 0-7 / k 0-7, a1 rows 8-15, a2 k 8-15,
    a3 both; each register packs two consecutive k (v % 2)."""
    reg, half = v // 2, v % 2
    return lane // 4 + 8 * (reg % 2), 2 * (lane % 4) + half + 8 * (reg // 2)


def wgmma_c_fragment(t: int, v: int) -> tuple[int, int]:
    """gemm_wgmma_sm90.cu's epilogue: d[4j + 2h + e] at (16*warp + lane/4 + 8h, 8j + 2*(lane%4)
    + e), thread t = 32 * warp + lane of the warpgroup."""
    warp, lane = t // 32, t % 32
    j, h, e = v // 4, (v // 2) % 2, v % 2
    return 16 * warp + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + e


def check_fragment(layout_text: str, rows: int, threads: int, values: int, formula) -> None:
    f = cute_layout(layout_text)
    seen = set()
    for t in range(threads):
        for v in range(values):
            idx = f(t, v)
            got = (idx % rows, idx // rows)
            assert got == formula(t, v), (t, v, got, formula(t, v))
            seen.add(got)
    assert len(seen) == threads * values  # every element held exactly once


def test_fragment_formulas_match_cute_layouts():
    # the layouts as CuTe prints them (test_cute_layouts_printout checks they still are)
    check_fragment("((_4,_8),(_2,_2)):((_32,_1),(_16,_8))", 16, 32, 4, mma_c_fragment)
    check_fragment("((_4,_8),(_2,_2,_2)):((_32,_1),(_16,_8,_128))", 16, 32, 8, mma_a_fragment)
    check_fragment("((_4,_8,_4),(_2,_2,_32)):((_128,_1,_16),(_64,_8,_512))", 64, 128, 128,
                   wgmma_c_fragment)


@pytest.mark.toolchain(group="cute_layouts")
@needs_cute
def test_cute_layouts_printout():
    import tkit.cuda_ext as cx

    out = cx.cute_layouts()
    assert "LayoutC_TV: ((_4,_8),(_2,_2)):((_32,_1),(_16,_8))" in out
    assert "LayoutA_TV: ((_4,_8),(_2,_2,_2)):((_32,_1),(_16,_8,_128))" in out
    assert "((_4,_8,_4),(_2,_2,_32)):((_128,_1,_16),(_64,_8,_512))" in out


# %% [markdown]
# ## 2. ldmatrix and the swizzle
#
# `ldmatrix.x4` loads four 8x8 matrices: in each of its phases, 8 threads give the addresses of
# 8 rows of 16 bytes. Shared memory serves 32 banks of 4 bytes a cycle, i.e. eight 16-byte
# slots per 128 bytes; 8 row addresses that fall in the same slot of different 128-byte lines
# are served one after the other. Rows of an A tile are 32 bf16 = 64 bytes, so rows r and r+2
# land in the same slot: 4-way conflicts. B rows are 128 bf16 = 256 bytes: all 8 rows in one
# slot, 8-way. The kernel XORs the 16-byte chunk index with a few bits of the row (the same
# function on the cp.async store side and the ldmatrix load side):
#
#     A: chunk ^ ((row >> 1) & 3)        B: chunk ^ (row & 7)


# %%
def conflict_degree(addresses: list[int]) -> int:
    """Serialized accesses for one phase of 16-byte requests: the most distinct 16-byte
    addresses that share a bank slot ((addr / 16) % 8)."""
    slots: dict[int, set] = {}
    for a in addresses:
        slots.setdefault((a // 16) % 8, set()).add(a)
    return max(len(s) for s in slots.values())


def ldmatrix_rows(row_bytes: int, chunk: int, swizzle) -> list[int]:
    """Byte addresses of 8 consecutive rows at one 16-byte chunk column."""
    return [r * row_bytes + 16 * swizzle(r, chunk) for r in range(8)]


def test_swizzles_remove_bank_conflicts():
    plain = lambda r, c: c  # noqa: E731
    swz_a = lambda r, c: c ^ ((r >> 1) & 3)  # noqa: E731
    swz_b = lambda r, c: c ^ (r & 7)  # noqa: E731
    for c in range(4):
        assert conflict_degree(ldmatrix_rows(64, c, plain)) == 4
        assert conflict_degree(ldmatrix_rows(64, c, swz_a)) == 1
    for c in range(16):
        assert conflict_degree(ldmatrix_rows(256, c, plain)) == 8
        assert conflict_degree(ldmatrix_rows(256, c, swz_b)) == 1


# %% [markdown]
# Hopper's TMA and wgmma use the same idea with a fixed function, the 128-byte swizzle
# (CuTe's `Swizzle<3,4,3>`: 16-byte chunk ^= row % 8 within each 1024-byte block of eight
# 128-byte rows). That is why the Hopper kernel's tiles are 64 bf16 wide (one 128-byte row per
# TMA box row) and start on 1024-byte boundaries.
#
# ## 3. wgmma's shared-memory descriptors
#
# wgmma takes A and B as 64-bit *descriptors* of shared memory: start address, layout type
# (128-byte swizzle), and two strides in the canonical layout of that swizzle:
#
# * A is K-major (K contiguous, as `a` is in memory): rows of 128 bytes, 8-row groups 1024 bytes
#   apart: SBO = 1024; the k-th 16-wide slice starts 32 bytes further.
# * B is MN-major (`b` is K x N with N contiguous; the transpose bit of wgmma says so): four
#   TMA boxes of 64 k-rows x 64 n (8 KiB each). LBO = 8192 (the next 64 columns of n),
#   SBO = 1024 (the next 8 rows of k); the k-th 16-row slice starts 2048 bytes further.
#
# These numbers are written by hand in the kernel; the CuTe program builds the same stage
# layout with `tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16>, (256, 64))` and asks CuTe's
# `make_gmma_desc` for the descriptor: the numbers agree.


# %%
@pytest.mark.toolchain(group="cute_layouts")
@needs_cute
def test_descriptors_agree_with_cute():
    import tkit.cuda_ext as cx

    out = cx.cute_layouts()
    assert "desc A: LBO 16 B, SBO 1024 B, layout type 1" in out
    assert "desc B: LBO 8192 B, SBO 1024 B, layout type 1" in out
    src = (_loader.CSRC / "gemm_wgmma_sm90.cu").read_text()
    assert "sw128_desc(a_base + kk * 32, 16, 1024)" in src
    assert "sw128_desc(b_base + kk * 16 * 128, BK * 128, 1024)" in src


# %% [markdown]
# ## 4. Warp specialization and the register budget
#
# 384 threads: warpgroup 0 produces (one thread issues TMA), warpgroups 1 and 2 consume (each
# a 64 x 256 fp32 accumulator: 128 registers a thread). At launch every thread gets the same
# count (ptxas: 168, the most that 384 threads can have from 64K registers); then
# `setmaxnreg.dec 24` in the producer and `setmaxnreg.inc 240` in the consumers move registers
# to where the accumulators are.


# %%
def register_budget(producer: int = 24, consumer: int = 240, launch: int = 168) -> dict:
    return dict(at_launch=384 * launch, after=128 * producer + 2 * 128 * consumer,
                file=64 * 1024)


def test_register_budget_fits():
    b = register_budget()
    assert b["at_launch"] <= b["file"] and b["after"] <= b["file"]
    assert register_budget(consumer=248)["after"] > b["file"]  # why 240 and not more


# %% [markdown]
# ## 5. The mbarrier protocol, simulated
#
# Each stage s has two mbarriers. `full[s]` (count 1): the producer arrives with
# `expect_tx(49152 bytes)`, and the phase completes when TMA has written them. `empty[s]`
# (count 2): each consumer arrives when its wgmmas have finished reading the stage. Waits name
# the *parity* of the phase they wait for: the consumer waits for `full[s]` phase `round & 1`;
# the producer waits for `empty[s]` phase `(round & 1) ^ 1`, which in round 0 is the phase
# "before the first", already complete, so the ring starts free. The model below runs the
# exact waits of the kernel under random interleavings (TMA completing late, consumers
# racing) and checks that no stage is overwritten while a consumer still reads it, and that
# every consumer sees every k-step in order. `inflight=True` models `WGMMA_INFLIGHT=1`, where a
# consumer releases stage k-1 only after issuing the wgmmas of step k.


# %%
class MBarrier:
    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def done(self, parity: int) -> bool:  # try_wait.parity
        return (self.phase & 1) != parity

    def _maybe_flip(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, tx: int = 0):
        self.tx += tx
        self.pending -= 1
        self._maybe_flip()

    def complete_tx(self, n: int):
        self.tx -= n
        self._maybe_flip()


def simulate(steps: int, stages: int, consumers: int = 2, inflight: bool = False,
             seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(consumers) for _ in range(stages)]
    data = [None] * stages  # which k-step a stage holds
    readers = [set() for _ in range(stages)]  # consumers still reading a stage
    in_flight_tma: list[tuple[int, int]] = []
    seen = [[] for _ in range(consumers)]
    prod = 0
    cons = [0] * consumers
    held = [None] * consumers  # (stage, step) still being read (inflight variant)

    def producer():
        nonlocal prod
        s, r = prod % stages, prod // stages
        if prod >= steps or not empty[s].done((r & 1) ^ 1):
            return False
        assert not readers[s], f"stage {s} overwritten while read by {readers[s]}"
        full[s].arrive(tx=1)
        in_flight_tma.append((s, prod))
        prod += 1
        return True

    def tma():
        if not in_flight_tma:
            return False
        s, step = in_flight_tma.pop(rng.randrange(len(in_flight_tma)))
        assert not readers[s]
        data[s] = step
        full[s].complete_tx(1)
        return True

    def consumer(c):
        it = cons[c]
        if it >= steps:
            if inflight and held[c] is not None:  # drain: release the last stage
                readers[held[c][0]].discard(c)
                empty[held[c][0]].arrive()
                held[c] = None
                return True
            return False
        s, r = it % stages, it // stages
        if not full[s].done(r & 1):
            return False
        assert data[s] == it, f"consumer {c} expected step {it}, stage {s} holds {data[s]}"
        seen[c].append(data[s])
        if inflight:
            readers[s].add(c)
            if held[c] is not None:
                readers[held[c][0]].discard(c)
                empty[held[c][0]].arrive()
            held[c] = (s, it)
        else:
            empty[s].arrive()
        cons[c] += 1
        return True

    actors = [producer, tma] + [lambda c=c: consumer(c) for c in range(consumers)]
    while prod < steps or any(x < steps for x in cons) or any(h is not None for h in held):
        order = actors[:]
        rng.shuffle(order)
        if not any(a() for a in order):
            raise AssertionError("deadlock")
    return seen


def test_mbarrier_protocol():
    for stages in (2, 3, 4):
        for inflight in (False, True):
            for seed in range(20):
                seen = simulate(steps=23, stages=stages, inflight=inflight, seed=seed)
                assert all(s == list(range(23)) for s in seen)


# %% [markdown]
# ## 6. What the SASS shows
#
# Compiled ahead of time (no GPU): the Ampere kernel is HMMA.16816 fed by LDSM (ldmatrix;
# LDSM.16.MT88 is the transposing one, for B) and LDGSTS (cp.async); the Hopper kernel is
# HGMMA.64x256x16 with `.tnspB` (B is MN-major), UTMALDG (TMA), SYNCS.* (mbarriers) and
# USETMAXREG (setmaxnreg). Neither touches local memory (LDL/STL). Triton's own GEMM for
# sm_90 reaches the same instructions; `python tutorials/06b_tensor_cores_cuda.py` prints
# its SASS histogram next to these through `tkit.ir` (chapter 06 reads it in detail).
#
# ## 7. Measured (H200, 2026-11-30, the GEMM builds' sweep in interleaved rounds)
#
# Median of three interleaved rounds, bf16, ratio to cuBLAS in the same run
# (run `h200-2026-11-30-c-cuda-ext-sweep` in benchmarks/results/h200.jsonl): the wgmma kernel (3
# stages, TMA
# epilogue) 720 TFLOP/s at 4096^3 = 1.024x cuBLAS, 684 at 8192^3 = 1.024x; with a 2-CTA
# cluster multicasting B, 1.003x / 1.033x. The mma.sync kernel (256x128x64 tile, 3 stages,
# fragments double-buffered, epilogue staged through shared memory) 404 / 386-405 TFLOP/s =
# 0.575x / 0.58-0.61x; Triton's own matmul compiled to mma.sync (DISABLE_MMA_V3=1, autotuned
# over 7 configs) 382 / 387 = 0.544x / 0.580x in the same rounds. Two independent mma.sync
# GEMMs stop near 0.6x of the wgmma one: on Hopper, mma.sync is not the instruction that
# reaches the tensor cores' peak. What moved the hand-written kernels: for mma.sync, the tile
# (128x128 -> 256x128 per CTA: 0.43x -> 0.59x), for wgmma, getting the epilogue off the
# critical path (registers -> shared -> TMA store: 0.95x -> 1.02x at 4096^3).
#
# A third mma.sync GEMM, written with CuTe's sm80 building blocks (`csrc/gemm_cute_sm80.cu`:
# a TiledMMA over the 16x8x16 bf16 atom, ldmatrix and cp.async copy atoms, swizzled shared
# tiles; 7 tile builds), settled the question in a later run
# (run `h200-2026-11-30-i-cute-sm80`, 3 rounds): its best build 464 / 460 TFLOP/s = 0.604x /
# 0.582x cuBLAS (769 / 790 TFLOP/s that run), the hand-written kernel 0.560x / 0.530x beside it.
# Three implementations, one a library's own building blocks, all stop at 0.5-0.6x.
#
# Why, measured twice more (run p and v of the third session):
#
# * The instruction's own ceiling. `tkit.cuda_ext.mma_peak` issues nothing but
#   `mma.sync.m16n8k16` from registers (independent accumulator chains, no memory in the loop;
#   run `h200-2026-11-30-p-mma-peak`). Every saturating configuration lands on 0.666 mma per SM per
#   clock: 2729 FLOP per SM per clock, two thirds of the 4096 that wgmma reaches, 645-655
#   TFLOP/s at the ~1.8 GHz such a kernel holds (cuBLAS: 786 / 725 TFLOP/s at 4096^3 before and
#   after the sweep).
# * Where the GEMM loses the rest. Nsight Compute on one 4096^3 launch (clocks locked by ncu):
#   the CuTe kernel keeps the tensor pipe busy 80.6% of its cycles, shared memory at 54% of its
#   wavefront rate (so not the bottleneck), and its warps wait mostly on the busy tensor pipe
#   (38% of the cycles between issues) and on fixed-latency dependencies (35%). cuBLAS's
#   wgmma kernel runs that pipeline at about 90% and does 3706 FLOP per SM per clock (its
#   time and clock).
#
# So at equal clocks even a perfect mma.sync GEMM, tensor pipe busy every cycle, would reach
# 2729 / 3706 = 0.74x of cuBLAS on this chip. The 0.8x an Ampere-class kernel can aim for
# against cuBLAS on an A100 is out of reach on Hopper with this instruction: the wgmma path
# (sections 3-5) is the one that matches cuBLAS.


# %%
def opcode_counts(sass: str) -> Counter:
    return Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.x]*)",
                              sass))


def sass_histogram(source: str, arch: str) -> Counter:
    return opcode_counts(_loader.sass(_loader.compile_cubin(source, arch)))


@pytest.mark.toolchain
@needs_sass
def test_hopper_sass():
    h = sass_histogram("gemm_wgmma_sm90.cu", "90a")
    assert h["HGMMA.64x256x16.F32.BF16"] == 4  # 4 k16 steps per 64-wide k tile
    assert any(k.startswith("UTMALDG") for k in h)
    assert any(k.startswith("USETMAXREG") for k in h)
    assert not any(k.startswith(("LDL", "STL")) for k in h)


def triton_sass_histogram() -> Counter | None:
    """Triton's GEMM for sm_90 through tkit.ir (ahead of time)."""
    try:
        import tkit

        ir = tkit.ir.compile("matmul", arch="sm_90")
        return opcode_counts(ir.sass())
    except Exception as e:  # the matmul family is optional here
        print(f"(tkit.ir on tkit.matmul unavailable: {type(e).__name__}: {e})")
        return None


def measure() -> list[tuple[str, int, float]]:
    import triton

    import tkit.cuda_ext as cx

    rows = []
    for size in (4096, 8192):
        a = torch.randn(size, size, device="cuda").bfloat16()
        b = torch.randn(size, size, device="cuda").bfloat16()
        for name, fn in (("cuBLAS", torch.matmul), ("mma.sync", cx.matmul_mma),
                         ("wgmma", cx.matmul_wgmma)):
            try:
                ms = triton.testing.do_bench(functools.partial(fn, a, b), return_mode="median")
                rows.append((name, size, 2 * size**3 / ms / 1e9))
            except Exception as e:
                print(f"{name} {size}: {type(e).__name__}: {e}")
    return rows


if __name__ == "__main__":
    if _loader.cutlass_include() and _loader.nvcc_path():
        import tkit.cuda_ext as cx

        print(cx.cute_layouts())
    if _loader.nvcc_path():
        for src, arch in (("gemm_mma_sm80.cu", "80"), ("gemm_wgmma_sm90.cu", "90a")):
            h = sass_histogram(src, arch)
            keep = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "SYNCS", "USETMAXREG", "LDL",
                    "STL")
            print(src, {k: v for k, v in sorted(h.items()) if k.startswith(keep)})
        t = triton_sass_histogram()
        if t:
            keep = ("HGMMA", "UTMALDG", "SYNCS", "LDL", "STL", "LDGSTS")
            print("triton matmul sm_90", {k: v for k, v in sorted(t.items())
                                          if k.startswith(keep)})
    if torch.cuda.is_available():
        for name, size, tflops in measure():
            print(f"{name:10s} {size}^3 {tflops:7.1f} TFLOP/s")
