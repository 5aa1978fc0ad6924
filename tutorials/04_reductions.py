# %% [markdown]
# # 04. Reductions: RMSNorm, warp shuffles and shared memory, online softmax
#
# A reduction turns a row into one number (a max, a sum, a mean of squares) and usually feeds
# it back to every element of the row. Norms, softmax and losses are all made of them.
#
# Predict first. RMSNorm of a 16384 x 8192 bf16 tensor reads 256 MiB and writes 256 MiB; at the
# H200's measured copy bandwidth (4.25 TB/s) that is 0.126 ms. A few FLOPs per element against
# ~200 FLOP/byte of machine balance: memory-bound, so the whole game is to move each byte once.
#
# Run it: `python tutorials/04_reductions.py` on a GPU measures every step below; `pytest
# tutorials/04_reductions.py` checks every kernel in the interpreter and reads the PTX without a
# GPU.

# %%
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# %% [markdown]
# ## Why a naive RMSNorm is ~10x slower
#
# The textbook PyTorch version (as in many model files) is correct and slow:
#
#     h = x.float(); var = h.pow(2).mean(-1, keepdim=True)
#     h = h * torch.rsqrt(var + eps); return weight * h.to(x.dtype)
#
# Each line is its own kernel, and each kernel reads its input from HBM and writes its output
# back. Count the bytes per element (bf16 = 2, float32 = 4):

# %%
EAGER_STEPS = [  # (what, bytes read, bytes written) per element
    ("x.float()", 2, 4), ("h.pow(2)", 4, 4), (".mean(-1)", 4, 0), ("h * rsqrt(var)", 4, 4),
    (".to(bf16)", 4, 2), ("weight * h", 2, 2),
]


def eager_traffic_ratio() -> float:
    """Bytes the eager version moves per element over the 4 bytes a fused kernel moves."""
    return sum(r + w for _, r, w in EAGER_STEPS) / 4


def eager_rms_norm(x, weight, eps=1e-6):
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype)


def test_eager_moves_about_ten_times_the_bytes():
    # 9x the traffic; measured on the H200 the gap is 13x (0.32 vs 4.17 TB/s-equivalent for
    # torch.compile, docs/FACTS.md): on top of the traffic, six launches and a float32 round trip.
    assert 8 <= eager_traffic_ratio() <= 10


# %% [markdown]
# ## Step 1: one program per row, a loop over the columns
#
# The first Triton version most people write: each program walks its row in small blocks,
# twice (sum of squares, then normalize). It moves the minimum bytes on paper, but one warp per
# row keeps only 128 x 2 bytes in flight per step, the second pass rereads the row, and the
# loop's reduction is done every BLOCK columns.

# %%
@triton.jit
def rms_norm_loop_kernel(x_ptr, w_ptr, y_ptr, N, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty),
                 mask=mask)


def rms_norm_loop(x, weight, eps=1e-6, BLOCK=256, num_warps=1):
    y = torch.empty_like(x)
    rms_norm_loop_kernel[(x.shape[0],)](x, weight, y, x.shape[1], x.stride(0), eps,
                                        BLOCK=BLOCK, num_warps=num_warps)
    return y


# %% [markdown]
# ## Step 2: the whole row in registers; how `tl.sum` reduces
#
# Load the row once into registers (BLOCK_N = next power of two >= N, masked), reduce, scale,
# store: one read and one write per element. `tl.sum` over a tile spread across threads is
# lowered in two levels:
#
# * inside a warp, a butterfly of `shfl.sync.bfly` instructions: 32 lanes exchange registers
#   directly, log2(32) = 5 steps, no memory involved;
# * across warps, each warp's partial goes to shared memory (`st.shared`), a barrier
#   (`bar.sync`), and one warp reduces the partials.
#
# With one warp the second level disappears. The PTX below shows both, compiled ahead of time
# for sm_90 (no GPU needed). More warps put more loads in flight per row (the HBM latency must
# be covered by bytes in flight), at the price of that shared-memory round trip: tkit's
# heuristic (tkit/kernels/reductions/config.py `row_config`) gives each thread about 16
# values.

# %%
@triton.jit
def rms_norm_row_kernel(x_ptr, w_ptr, y_ptr, N, stride, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_row(x, weight, eps=1e-6, num_warps=8):
    y = torch.empty_like(x)
    rms_norm_row_kernel[(x.shape[0],)](x, weight, y, x.shape[1], x.stride(0), eps,
                                       BLOCK_N=triton.next_power_of_2(x.shape[1]),
                                       num_warps=num_warps)
    return y


def row_kernel_ptx(num_warps: int, n: int = 8192) -> str:
    import tkit

    x = ((64, n), torch.bfloat16)
    w = ((n,), torch.bfloat16)
    ir = tkit.ir.compile(rms_norm_row_kernel, x, w, x, N=n, stride=n, eps=1e-6,
                         BLOCK_N=triton.next_power_of_2(n), num_warps=num_warps, arch="sm_90")
    return ir.stage("ptx")


def test_warp_shuffles_and_shared_memory_in_ptx():
    one, many = row_kernel_ptx(1), row_kernel_ptx(16)
    assert "shfl.sync.bfly" in one and "shfl.sync.bfly" in many
    assert "st.shared" not in one            # a single warp reduces in registers only
    assert "st.shared" in many and "bar.sync" in many   # warps meet in shared memory


def _check_rms(fn):
    from tkit.specs.reductions import ref_rms_norm
    from tkit.testing import check_against_reference, make_tensor

    for n in (1, 100, 1000):
        x = make_tensor((5, n), torch.float16, seed=n, device=DEVICE)
        w = 1 + 0.1 * make_tensor((n,), torch.float16, seed=1, device=DEVICE)
        check_against_reference(fn, ref_rms_norm, [x, w])


def test_loop_and_row_kernels_match_reference():
    _check_rms(rms_norm_loop)
    _check_rms(rms_norm_row)
    _check_rms(eager_rms_norm)


# %% [markdown]
# ## Step 3: tkit.rms_norm
#
# The production kernel (tkit/kernels/reductions/) adds what the measurements asked for: short rows
# packed several to a program (a 1024-column row is only 2 KiB: too little work for a program),
# the warp count scaled with the row, no L2 hint on loads read once (an `evict_first` hint
# measured slower), the residual add fused (`h = x + residual` written and normalized in the
# same pass: 4 tensors of traffic instead of 6 for add-then-norm), strided rows, rows of 4096
# columns and more walked twice in chunks (below), and a backward whose dweight is reduced
# through per-program float32 partials.

# %% [markdown]
# ## Online softmax, derived
#
# softmax(x)_i = exp(x_i - m) / s with m = max x and s = sum exp(x_j - m); subtracting m keeps
# exp from overflowing. Two passes over the row: first m, then s. To do it in one pass over
# chunks (or across programs, each owning a chunk), keep a running (m, s) and fix s whenever m
# grows. For two partial results (m_a, s_a) and (m_b, s_b) of disjoint parts of the row:
#
#     m = max(m_a, m_b)
#     s = s_a * exp(m_a - m) + s_b * exp(m_b - m)
#
# because s_a * exp(m_a - m) = sum_{j in a} exp(x_j - m_a) exp(m_a - m) = sum_{j in a}
# exp(x_j - m). The rule is associative, so chunks can be combined in any order: sequentially
# (FlashAttention's inner loop) or as a tree across programs (tkit's split path for rows of
# 256k to millions of columns). A part holding only -inf has s = 0 and drops out; a row of
# only -inf gives m = -inf and NaN, exactly as torch.softmax.

# %%
def online_softmax(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Softmax of a 1-D tensor, streaming over chunks with a running (max, sum)."""
    m = torch.tensor(float("-inf"), dtype=x.dtype)
    s = torch.tensor(0.0, dtype=x.dtype)
    for part in x.split(chunk):
        m_new = torch.maximum(m, part.max())
        s = s * torch.exp(m - m_new) + torch.exp(part - m_new).sum()
        m = m_new
    return torch.exp(x - m) / s


def test_online_softmax_equals_two_pass():
    x = torch.randn(10_000, dtype=torch.float64) * 20
    for chunk in (1, 7, 256, 10_000):
        torch.testing.assert_close(online_softmax(x, chunk), torch.softmax(x, 0),
                                   rtol=1e-12, atol=1e-300)


def test_tkit_split_path_equals_fused_path():
    """tkit's two online long-row paths (split across programs; one program looping over the
    row) against its fused two-pass path on the same rows."""
    import tkit
    from tkit.kernels.reductions import overrides
    from tkit.testing import make_tensor

    x = make_tensor((6, 3000), torch.float32, seed=3, device=DEVICE) * 8
    fused = tkit.softmax(x)
    for path, chunk_key in (("split", "chunk"), ("loop", "loop_chunk")):
        # force the long-row path, in chunks of 256 columns
        with overrides(fused_max_bytes=1, softmax_long=path, **{chunk_key: 256}):
            online = tkit.softmax(x)
        torch.testing.assert_close(online, fused, rtol=1e-6, atol=1e-7)


# %% [markdown]
# ## Measured
#
# `python tutorials/04_reductions.py` on the H200 prints every step: time, TB/s, percent of the
# copy ceiling, beside torch eager and torch.compile in the same run. The family's full
# benchmark (backward, the N sweep, Liger-Kernel when installed) is `tkit bench reductions`;
# its run of 2026-11-30 (run `h200-2026-11-30-e-reductions` in benchmarks/results/h200.jsonl, copy
# 4.24 TB/s)
# measured, at 16384 x 8192 bf16: rms_norm 4.06 TB/s (torch eager 0.62, torch.compile 4.15),
# fused residual + rms_norm 4.01 (eager 1.02, compile 4.01), layer_norm 4.00 (compile 3.66),
# softmax 3.85 (compile 1.74): eager RMSNorm is 6.5x slower than the fused kernel here, less
# than the ~9x the traffic count gives (the count treats every intermediate pass as HBM
# traffic, an upper bound). Long rows (N = 262144): rms_norm 2.66 TB/s, softmax 2.35, about
# the 2/3-of-copy bound of a schedule whose reread misses L2.
#
# Two measured lessons from tuning these kernels (H200, 2026-11-30, docs/NOTES.md):
# an `eviction_policy="evict_first"` hint on loads that are read once cost 2-5% in every
# config (rms_norm 3.89 -> 4.05 TB/s without it); and the backward, whose program holds a
# whole 8192-column row plus the weight and the dweight partial (120-127 registers x 512
# threads: one program fills an SM's register file), ran at 54% of copy until each program
# issued the loads of its next row before reducing the current one (90% for rms_norm, 80% for
# layer_norm). When occupancy cannot hide latency, the program has to.
#
# A third lesson came from reading what torch.compile generates for the same ops (inductor's
# looped reduction; the H200 norm focus runs of 2026-11-30 saved its kernels and chosen configs
# in the rows of runs `h200-2026-11-30-*-norm-focus` in benchmarks/results/h200.jsonl): for rows
# of 4096 columns and more it does not hold the row in registers. It walks the row twice, in
# chunks of 2048-32768 columns: the first walk accumulates per lane (each thread keeps its own
# running sum of squares, or its own Welford mean and M2, and the threads are combined once at
# the end), the second walk rereads the row from L2 to normalize it. Such a program holds
# 30-60 registers instead of 120+, several programs share an SM, and the fixed row length lets
# the compiler issue every chunk's load before the first update. tkit's loop path now does the
# same: the chunk count is a compile-time constant up to 16 chunks (one build per count) and a
# row made of whole chunks takes no masks, so no load waits for a predicate register (a thread
# has 7). H200, 256 MiB bf16, medians of 3 interleaved rounds (runs q and r of 2026-11-30):
# rms_norm N=4096 3.98 -> 4.15 TB/s, N=16384 3.92 -> 4.06, N=65536 3.43 -> 3.62; the residual
# form N=8192 4.02 -> 4.09; layer_norm N=32768 3.05 -> 3.64. One point stayed behind:
# layer_norm at N=16384, 3.83 TB/s against torch.compile's 3.97.
#
# The fourth lesson is how that point was found: not by more configs, but by rebuilding the faster
# kernel by hand (a probe: run `h200-2026-11-30-w-ln-probe` in benchmarks/results/h200.jsonl) and
# changing one
# thing at a time until it was as slow as ours. torch.compile bakes the row length into its
# kernel, so both walks unroll and the second walk's loads issue ahead too; and its Welford
# combine (Chan's pairwise rule, one three-value reduction instead of two sums) runs on counts the
# compiler can see, so the divisions of the thread-local part fold away. tkit keeps N a run-time
# argument (one build serves every row length with the same chunk count) but makes the same facts
# visible: the second walk is unrolled on the constexpr chunk count, and on whole chunks the lanes
# enter the Chan reduce with count 1 and M2 / c (the rule depends only on the counts' ratios; M2
# is scaled back by c). layer_norm N=16384: 3.80 -> 4.02 TB/s, 1.01x torch.compile (run za of
# 2026-11-30); `reductions.config.LOOP_SHAPES` records which style each row length takes.

# %%
if __name__ == "__main__":
    if not torch.cuda.is_available():
        test_eager_moves_about_ten_times_the_bytes()
        test_loop_and_row_kernels_match_reference()
        test_warp_shuffles_and_shared_memory_in_ptx()
        test_online_softmax_equals_two_pass()
        test_tkit_split_path_equals_fused_path()
        print("no GPU: checked in the interpreter and read the PTX; timings need a CUDA GPU")
        raise SystemExit(0)
    import triton.testing

    import tkit
    from tkit.kernels.reductions import overrides

    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(8192, device="cuda")).to(torch.bfloat16)
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    ceil = 2 * src.numel() * 2 / (copy_ms * 1e-3) / 1e12
    del src, dst
    nbytes = 2 * x.numel() * 2

    def report(name, fn, nb=nbytes):
        ms = triton.testing.do_bench(fn, return_mode="median")
        tbs = nb / (ms * 1e-3) / 1e12
        print(f"{name:<36} {ms * 1e3:8.1f} us {tbs:6.2f} TB/s {100 * tbs / ceil:5.1f}% of copy")

    print(f"copy ceiling this run: {ceil:.2f} TB/s")
    report("rmsnorm: eager (6 kernels)", lambda: eager_rms_norm(x, w))
    compiled_rms = torch.compile(eager_rms_norm)
    compiled_softmax = torch.compile(lambda t: torch.softmax(t, -1))
    report("rmsnorm: torch.compile", lambda: compiled_rms(x, w))
    report("rmsnorm: step 1 loop, 1 warp", lambda: rms_norm_loop(x, w))
    report("rmsnorm: step 1 loop, 4 warps, 1024", lambda: rms_norm_loop(x, w, BLOCK=1024,
                                                                          num_warps=4))
    for warps in (1, 4, 8, 16, 32):
        report(f"rmsnorm: step 2 row, {warps} warps", lambda k=warps: rms_norm_row(x, w,
                                                                                   num_warps=k))
    report("rmsnorm: tkit.rms_norm", lambda: tkit.rms_norm(x, w))
    for n in (8192, 262144):
        xs = torch.randn(2**27 // n, n, device="cuda", dtype=torch.bfloat16)
        report(f"softmax N={n}: eager", lambda xs=xs: torch.softmax(xs, -1))
        report(f"softmax N={n}: torch.compile", lambda xs=xs: compiled_softmax(xs))
        report(f"softmax N={n}: tkit", lambda xs=xs: tkit.softmax(xs))
        if n == 262144:
            # the split path (a row across programs, two launches) that rows take when there
            # are fewer of them than SMs, against the default loop path (docs/NOTES.md)
            with overrides(softmax_long="split"):
                report(f"softmax N={n}: tkit, split path", lambda xs=xs: tkit.softmax(xs))
