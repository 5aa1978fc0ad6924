# %% [markdown]
# # 08. FlashAttention: attention without the score matrix
#
# Attention is two matmuls with a softmax between them: O = softmax(Q K^T * scale) V. Written
# that way, it materialises the seqlen x seqlen score matrix in HBM. FlashAttention never does:
# it walks K and V in blocks and keeps the softmax *online* (chapter 04), so the scores live in
# registers and the op becomes compute-bound. This chapter predicts the traffic of both forms,
# derives the blocked algorithm from chapter 04's online softmax, walks through tkit's Triton
# kernel (`tkit/kernels/attention/`) with `tkit.ir`, and measures it against the prediction.
#
# Run it: `python tutorials/08_flash_attention.py` (on a GPU it times tkit against SDPA's
# backends); `pytest tutorials/08_flash_attention.py` checks every claim on any machine.

# %%
from __future__ import annotations

import importlib.util
import os
import pathlib
import re

import torch

if not torch.cuda.is_available():  # run kernels in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

import tkit  # noqa: E402
import tkit.ir_tools as ir  # noqa: E402  (tkit.ir)
from tkit.specs.attention import ref_attention  # noqa: E402

# %% [markdown]
# ## Predict: HBM traffic at B=4, H=16, S=4096, D=128, bf16
#
# Standard attention writes the scores S (B*H*S*S elements), reads them back for the softmax,
# writes P, and reads P again for P V: four passes over a B*H*S*S tensor, on top of reading
# Q, K, V and writing O once. FlashAttention reads Q, K, V and writes O once; K and V are
# re-read once per query block of BLOCK_M rows, but those re-reads are of a 1 MiB-per-head
# working set that the 60 MB L2 serves, so the HBM floor is the 4*B*S*H*D*2 bytes.
#
# FLOPs: two matmuls of 2*S*S*D each per (batch, head): 4*B*H*S*S*D, half of it when causal.

# %%
B, H, S, D, ITEM = 4, 16, 4096, 128, 2
HBM_TBPS, GEMM_TFLOPS = 4.25, 720.0  # H200: measured copy bandwidth, cuBLAS bf16 GEMM


def traffic(b=B, h=H, s=S, d=D, item=ITEM) -> dict:
    qkvo = 4 * b * s * h * d * item
    scores = b * h * s * s * item
    flops = 4.0 * b * h * s * s * d
    return dict(
        standard_bytes=qkvo + 4 * scores,  # write S, read S, write P, read P
        flash_bytes=qkvo,
        flops=flops,
        standard_ms=(qkvo + 4 * scores) / (HBM_TBPS * 1e12) * 1e3,
        flash_compute_ms=flops / (GEMM_TFLOPS * 1e12) * 1e3,
        flash_memory_ms=qkvo / (HBM_TBPS * 1e12) * 1e3,
    )


def test_traffic_prediction():
    t = traffic()
    # 8.6 GB of score traffic against 0.27 GB: the standard form moves 33x the bytes, and its
    # memory time alone (2 ms) is 2.7x the flash form's compute time at the GEMM ceiling
    assert 8.5e9 < t["standard_bytes"] < 8.9e9
    assert 0.26e9 < t["flash_bytes"] < 0.28e9
    assert t["standard_bytes"] / t["flash_bytes"] > 30
    assert abs(t["flash_compute_ms"] - 0.764) < 0.01
    assert t["flash_memory_ms"] < t["flash_compute_ms"] / 10  # compute-bound by 10x


# %% [markdown]
# So the prediction: FlashAttention at this shape is bound by the tensor cores, 0.76 ms at the
# cuBLAS ceiling (720 TFLOP/s) non-causal and 0.38 ms causal; standard attention cannot beat
# 2 ms however fast its matmuls are. A realistic aim is 485 / 425 TFLOP/s forward, 67% and 59%
# of the GEMM ceiling: attention loses some to the softmax between its matmuls.
#
# ## From online softmax to FlashAttention
#
# Chapter 04 built softmax over chunks with a running (max m, sum s), rescaling s by
# exp(m_old - m_new) when the max grows. Its `online_softmax` is reused here as is.

# %%
def _chapter(name: str):
    path = pathlib.Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


online_softmax = _chapter("04_reductions.py").online_softmax


# %% [markdown]
# Attention needs one more thing: the *weighted sum* of V rows, not the probabilities. The
# accumulator acc = sum_j exp(s_j - m) v_j obeys the same rescaling as s, so a block of keys
# updates (m, l, acc) together and the division by l happens once at the end:
#
#     m_new = max(m, rowmax(S_blk));  p = exp(S_blk - m_new);  alpha = exp(m - m_new)
#     l = l * alpha + rowsum(p);      acc = acc * alpha + p @ V_blk;  m = m_new
#     O = acc / l;  lse = m + log(l)
#
# The kernel does exactly this per block of BLOCK_M query rows, in base 2 (log2(e) folded into
# the scale: one FMA and one `exp2` per score). `lse` is saved for the backward, which recomputes
# P block by block instead of storing it.

# %%
def blocked_attention(q, k, v, block: int):
    """One head: q (Sq, D), k/v (Sk, D); keys streamed in blocks with a running (m, l, acc)."""
    scale = q.shape[-1] ** -0.5
    m = torch.full((q.shape[0],), float("-inf"), dtype=q.dtype)
    l_sum = torch.zeros(q.shape[0], dtype=q.dtype)
    acc = torch.zeros_like(q)
    for kb, vb in zip(k.split(block), v.split(block)):
        s = q @ kb.T * scale
        m_new = torch.maximum(m, s.max(-1).values)
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new)
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[:, None] + p @ vb
        m = m_new
    return acc / l_sum[:, None], m + torch.log(l_sum)


def test_online_softmax_is_chapter_04s():
    x = torch.randn(1000, dtype=torch.float64)
    torch.testing.assert_close(online_softmax(x, 64), torch.softmax(x, 0))


def test_blocked_attention_equals_softmax_attention():
    q, k, v = (torch.randn(50, 32, dtype=torch.float64) for _ in range(3))
    out, lse = blocked_attention(q, k, v, block=16)
    s = q @ k.T * 32 ** -0.5
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


# %% [markdown]
# ## tkit's kernel
#
# `tkit.flash_attention(q, k, v, causal=True)` takes the flash-attn layout (batch, seqlen, heads,
# head_dim) with any strides. Per program (BLOCK_M query rows of one head) the key range splits
# in three: blocks before the fully visible ones (a sliding window's left edge, masked), the
# fully visible blocks (no mask arithmetic at all), and the blocks after them (the causal
# diagonal and the ragged end, masked). A row that sees no key at all keeps m = -inf; the kernel
# subtracts 0 instead of -inf there, so it ends with l = 0, O = 0 and lse = -inf instead of NaN.


# %%
def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_kernel_matches_reference():
    dt = torch.bfloat16 if torch.cuda.is_available() else torch.float16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 45, 2, 64, generator=g).to(dt).to(_device()) for _ in range(3))
    out = tkit.flash_attention(q, k, v, causal=True)
    ref = ref_attention(q.double(), k.double(), v.double(), causal=True)
    peer = ref_attention(q, k, v, causal=True)
    err, peer_err = (out.double() - ref).abs().max(), (peer.double() - ref).abs().max()
    assert err <= 2 * peer_err + 1e-3


# %% [markdown]
# ## What the compiler made of it (`tkit.ir`, sm_90, no GPU needed)
#
# Compiled ahead of time for the H200 at the benchmark shape with BLOCK_M=128, BLOCK_N=64,
# 8 warps, 3 stages and K/V read through TMA descriptors:
#
# * **wgmma**: Q K^T runs as `wgmma.mma_async m64n64k16` and P V as `m64n128k16` (accumulator
#   layouts `#mma` with instrShape 16x64x16 and 16x128x16, two warpgroups of 4 warps).
# * **stages**: K and V tiles get 3-slot shared-memory buffers (`3x64x128xbf16`) in the 128-byte
#   swizzled NVMMA layout, filled by `cp.async.bulk.tensor` (TMA) and guarded by mbarriers.
# * **cost**: ~130 KB of shared memory and ~180 registers a thread: one CTA (8 warps) per SM,
#   limited by registers. The `wgmma.wait_group 0` after each MMA means the softmax of one block
#   does not overlap the MMAs of the next inside a warpgroup: with one CTA per SM that overlap
#   must come from warp specialization (FA3's ping-pong), the knob the H200 script measures.

# %%
BENCH_CFG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, USE_TMA=True,
                 WARP_SPEC=False)


def kernel_summary(causal=True, config=BENCH_CFG, echo=False):
    shape = ((B, S, H, D), torch.bfloat16)
    return ir.summary("flash_attention", shape, shape, shape, causal=causal, arch="sm_90",
                      config=config, echo=echo)


def test_compiler_facts_on_sm90():
    s = kernel_summary()
    mma = [k for k in s.ptx if k.startswith("wgmma.mma_async")]
    assert "wgmma.mma_async m64n64k16" in mma and "wgmma.mma_async m64n128k16" in mma
    assert s.pipelining["tma_loads"] > 0 and 3 in s.pipelining["buffers"]
    assert s.resources["n_spills"] == 0
    assert s.resources["shared"] <= s.occupancy["shared_limit_per_block"]


# %% [markdown]
# ## Measure (GPU): against the prediction and SDPA
#
# `tkit bench flash_attention flash_attention_varlen` does this in full (every benchmark case
# against SDPA's backends); below is the one-shape version.
#
# Measured on the H200 (2026-11-30, run `h200-2026-11-30-d-attention` in
# benchmarks/results/h200.jsonl, B4 S4096
# H16 D128 bf16): the registered op, autotuned, ran the forward at 462.6 TFLOP/s non-causal
# (1.189 ms against the 0.76 ms predicted at the GEMM ceiling: 59% of it) and 415.1 causal;
# the backward (causal) at 354.8. SDPA's flash backend: 353 / 305 / 274; cuDNN: 651 / 584 /
# 473. So the kernel is 1.3x the flash backend and 0.71x cuDNN. In a three-round sweep of
# forced configs (run `h200-2026-11-30-c-attention-focus`) the best medians were 488 and 427,
# with 5-10% spread between rounds. The gap to cuDNN is the softmax: Triton 3.6 issues the
# QK^T wgmma and waits for it before the exponentials (`tkit.ir` shows the wait), so the
# tensor cores idle during the softmax, while cuDNN and FlashAttention-3 overlap one warpgroup's
# softmax with another's matmuls. The tile order matters as well: programs of 4 heads at a
# time share K/V in L2 (8 MB), against 446 TFLOP/s when every head of a query block runs
# before the next block.

# %% [markdown]
# ## Writing the overlap by hand: Gluon (`tkit/kernels/attention/_hopper_kernels.py`)
#
# What the Triton kernel cannot express, Triton's lower-level dialect Gluon can: explicit
# layouts, `warpgroup_mma(..., is_async=True)` and `warpgroup_mma_wait(num_outstanding=...)`,
# TMA copies and mbarriers. The Hopper kernel keeps the same math and tile order and writes the
# schedule out for each key block j: issue S_j = Q K_j^T, issue O += P_{j-1} V_{j-1}, wait
# until only one group is in flight (`wgmma.wait_group 1`: S_j is ready, the PV product may
# still run), do the softmax of S_j while it does, then `wait_group 0` and rescale O. K and V
# stream through a ring of TMA buffers. The PTX (below, compiled without a GPU) shows the
# `wait_group 1` inside the loop that the Triton kernel's PTX lacks.
#
# Measured on the H200 (2026-11-30, run `h200-2026-11-30-i-attention-hopper` in
# `benchmarks/results/h200.jsonl`,
# B4 S4096 H16 D128 bf16, medians of 3 interleaved rounds): 499.4 TFLOP/s non-causal and 455.0
# causal, against 475.7 / 413.3 for the Triton kernel's best tile and 586.7 / 519.6 for cuDNN
# in the same rounds. `tkit.flash_attention` dispatches to it on sm_90 at head_dim 128 (and 64
# causal); through the public function, three later rounds gave 520 / 477 / 461 non-causal
# and 464 / 437 / 426 causal (run `h200-2026-11-30-j-attention-quick`): the machine's power
# and clocks move the figures by ~10% between rounds, cuDNN's by ~1%.
#
# That kernel's two warpgroups still met at a CTA barrier every key block (one thread refilled
# the TMA ring for both), so their softmaxes coincided. Giving the loads to a one-warp loader
# partition (`gl.warp_specialize`, FlashAttention-3's producer), with each consumer warpgroup
# releasing a ring slot through an mbarrier arrive once its wgmmas are retired, leaves each
# warpgroup only its own 128-thread barriers: 580.6 / 569.8 TFLOP/s (non-causal / causal)
# against 499.9 / 455.0 without the loader and 587.2 / 505.8 for cuDNN, same rounds
# (run `h200-2026-11-30-l-attention-hopper-ws`). It is `tkit.flash_attention`'s forward at head_dim
# 128 on sm_90;
# through the public function, medians of 3 rounds: 582.2 / 535.8, 1.65x / 1.79x SDPA's flash
# backend and 0.87x / 0.92x cuDNN (run `h200-2026-11-30-m-attention-quick`).


def test_gluon_kernel_keeps_one_wgmma_group_in_flight():
    from tkit.kernels.attention import hopper as AH

    ptx = AH.compile_sm90(128, causal=False).asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1;" in ptx  # the softmax overlaps a wgmma
    assert "ex2.approx" in ptx


# %% [markdown]
# ## When a ring slot comes back: head dim 256
#
# At D=256 the same warp-specialized kernel first reached only 0.77x cuDNN. A Q tile of 128 rows
# is 64 KB, and so is a stage of 64 keys of K and V. Only two stages fit beside Q in 227 KB.
# Count how early each load is issued.
#
# * A slot was handed back to the loader once its V had been read by PV. That happens one
#   block after its K was read by S, because the schedule issues PV_{j-1} beside S_j.
# * With S stages, block t's slot is freed during block t - S + 1. Its K is needed at the start
#   of block t. That leaves S - 2 whole blocks for the load to land: none at S = 2.
# * K's last reader is S_j, though. Giving K and V their own "empty" barriers lets K's slot go
#   back a block earlier, which leaves S - 1 blocks. V is needed a block later than K anyway,
#   so V keeps S - 1 blocks too.
#
# Measured (run `h200-2026-12-04-zr-attention-kv-apart`, us, ratio to cuDNN), D=256, warp-
# specialized n64 s2:
#
# | shape | together | apart |
# | --- | --- | --- |
# | B4 S4096 causal | 1186.5, 0.77x | 927.0, 0.99x |
# | B4 S4096 | 2260.9, 0.73x | 1680.0, 0.98x |
#
# At D=128 the default ring has three stages, one block of lead already: there the change
# measured within noise. The two-stage D=128 ring went from 0.71x to 1.00x, as the count
# predicts. With its block of lead back, two stages of 128 keys then beat five of 64 on long
# tiles (half the blocks, so half the per-block work: the O rescale, the row reductions'
# shuffles, the waits and barriers): D=128 causal prefill
# runs the persistent n128 s2 beyond 768 keys a tile, 1.04x / 1.09x cuDNN at 2048 / 4096 keys
# against 0.98x / 0.95x for n64 s5 (run `h200-2026-12-04-zx-attention-d128-rules`). Counting
# when each buffer is freed, not only how many there are, is the check to make whenever
# shared memory caps the stages.


def ptx_loops(ptx: str) -> list[tuple[str, str]]:
    """(label, body) of each loop of a PTX listing: a label and the last branch back to it."""
    lines = ptx.splitlines()
    loops = []
    for i, line in enumerate(lines):
        label = re.match(r"^(\$L__BB\d+_\d+):", line)
        if label is None:
            continue
        back = [j for j in range(i + 1, len(lines))
                if re.search(r"\bbra(\.uni)?\s+" + re.escape(label.group(1)) + ";", lines[j])]
        if back:
            loops.append((label.group(1), "\n".join(lines[i:back[-1] + 1])))
    return loops


def load_lead(stages: int, apart: bool) -> int:
    """Whole key blocks between the issue of a block's K load and its use, in the schedule
    above (PV_{j-1} issued beside S_j), with K's slot handed back after S (``apart``) or after
    PV."""
    return stages - 1 if apart else stages - 2


def test_two_stages_need_k_back_early():
    from tkit.kernels.attention import hopper as AH

    assert load_lead(2, apart=False) == 0 and load_lead(2, apart=True) == 1
    assert load_lead(3, apart=False) == 1
    cfg = AH.default_config(256)
    assert cfg["STAGES"] == 2 and cfg["WS"]  # two 64 KB stages beside the 64 KB Q tile
    ptx = AH.compile_sm90(256, causal=False).asm["ptx"]
    # each consumer's key loops (a label and the last branch back to it, with the wgmmas
    # inside) hand back two slots a block: V's of block j-1, K's of block j
    loops = ptx_loops(ptx)
    # the innermost loops with the wgmmas (the warp-specialized region's dispatch loop holds
    # the others)
    loops = [body for lab, body in loops if "wgmma.mma_async" in body
             and not any(other + ":" in body.split("\n", 1)[1] for other, _ in loops)]
    assert len(loops) == 4  # two consumers, each a loop without masks and one with
    assert all(b.count("mbarrier.arrive.shared::cta.b64") == 2 for b in loops)


# %% [markdown]
# ## The backward in Gluon (`tkit/kernels/attention/_hopper_bwd_kernels.py`)
#
# Predict first. The backward recomputes P from Q, K and the saved lse, then needs dV = P^T dO,
# dP = dO V^T, dS = P * (dP - delta) and dK = dS^T Q, dQ = dS K: five products the size of
# one of the forward's two, so 2.5x the forward's FLOPs (how every tkit benchmark counts it).
# Split as FlashAttention-2 and tkit's Triton backward do, one kernel owns a key block (S^T,
# dP^T, dV, dK: four products) and another a query block (S, dP, dQ: three), so 7 products are
# computed for 5 counted: at best 5/7 of the tensor cores' rate, before any stall.
#
# The Gluon kernels keep that split and write the schedule out. The dK/dV kernel's two
# warpgroups hold 128 keys (K and V resident) and stream 64-query blocks: S^T and dP^T are
# issued together, P^T's exponentials run under dP^T, dV += P^T dO is issued as soon as P^T is
# in registers (as the A operand: no trip through shared memory), dS^T is computed under it,
# then dK += dS^T Q. Q, dO and each block's lse and delta rows arrive by TMA through a ring;
# the rows are read from shared memory where they are used, so they hold no registers across
# the products (both accumulators already take 128 of a thread's 255 at D=128).
#
# One thing the compiler did that the source does not say: Triton's barrier analysis tracks a
# shared-memory allocation as a whole, mbarriers included. With one mbarrier a ring slot for
# all of a slot's copies, or every slot's mbarriers in one array, each copy and each expect
# came after a CTA-wide `bar.sync`: 7 barriers a block. An mbarrier a copy, each kind in its
# own allocation (as the forward's K and V rings have), leaves 3 under Triton 3.6 (the GPU
# machine's; 3.9's analysis still places 7). With that and the rows by
# TMA, the dK/dV kernel took 0.79-0.91x the time of its first version (the rows by pointer
# loads, a few registers spilled, 7 barriers a block); the two changes were not timed apart.
#
# Measured on an H100 (run `h100-2026-12-05-a-attention-bwd`, B4 S4096 H16 bf16, the
# backward's kernels a step): D=128 3389 us against 5232 for the Triton backward at its
# default tiles (406 against 263 TFLOP/s), causal 1792 against 2729, D=64 causal 1064 against
# 1070. A whole training step (forward and backward): 0.87x cuDNN at D=128, 0.82x causal.
# The Triton backward's default tiles are not its best: tuned on the same GPU
# (`benchmarks/tune_table.py`, run `h100-2026-12-05-c-bwd-tuned`), whole steps took 4768 us
# against the Gluon kernels' 4178 at D=128 (1.14x), 2503 against 2389 causal (1.05x), 1457
# against 1432 at D=64 causal (1.02x) and 5027 against 4588 for GQA 32/8 causal (1.10x);
# cuDNN 3544 / 1969 / 1261 / 3917. Hand-scheduling bought 2-14% over a tuned Triton kernel,
# not the 1.5x its default tiles suggest: compare against the tuned baseline.
# What is left is the two extra products of the split and the end of each block, where the
# four products are waited for and a barrier is met before the next block's S^T is issued.
# FlashAttention-3 avoids the two products by adding dQ from the dK/dV kernel with TMA
# reduce-adds; built here, that was slower (a training step at 0.67-0.89x the split's speed
# on an H100), so the split stays.


def barriers_in_loops(ptx: str) -> list[int]:
    """`bar.sync` count of each loop with wgmmas in a PTX listing (outer loops included)."""
    return [body.count("bar.sync") for _, body in ptx_loops(ptx) if "wgmma.mma_async" in body]


def test_backward_block_meets_three_barriers():
    from tkit.kernels.attention import hopper as AH

    ptx = AH.compile_bwd_sm90("dkdv", 128, causal=False).asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1;" in ptx  # P^T's exponentials under dP^T
    counts = barriers_in_loops(ptx)
    assert counts, "no loop with wgmmas"
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) == (3, 6):
        assert min(counts) <= 3, counts  # 3.9 places 7 (its barrier analysis differs)


# %% [markdown]
# ## Decode: one new token against a long KV cache (`tkit.decode_attention`)
#
# Generating a token runs attention with seqlen_q = 1 (a few with speculative decoding) over
# every key and value the sequence has cached. The shapes change the whole picture, so predict
# first, per call and per generated token. Take a Llama-3-8B-like layer: 32 query heads, 8
# key/value heads (GQA group 4), D = 128, bf16, a batch of 32 sequences of 8192 cached tokens.
#
# * **bytes**: K and V of every cached token are read once: 2 * L * Hkv * D * 2 bytes per
#   sequence and layer, 33.6 MB; 1.07 GB for the batch. q and O (32 x 32 x 128 x 2 bytes) are
#   noise.
# * **FLOPs**: two products of 2 * L * D per query head: 4 * L * Hq * D = 134 MFLOP a sequence.
# * **intensity**: FLOP / byte = 2 * group * seqlen_q / itemsize = 4, against a ridge of
#   720 / 4.25 = 170 FLOP/byte on the H200. Decode attention is memory-bound by 40x: its floor is
#   the copy bandwidth, 1.07 GB / 4.25 TB/s = 253 us a call, and nothing about the tensor cores
#   matters except that they must not slow the stream down.
#
# Per generated token this layer's attention moves 33.6 MB of one sequence's cache (plus the
# write of one new K/V row in `tkit.append_kv`): at 32 layers, 1.07 GB of KV reads per token of
# one sequence at 8192 tokens of context, 0.25 ms at the copy ceiling before any weight is read.

# %%
DEC = dict(b=32, hq=32, hk=8, d=128, length=8192, item=2)
H200_SMS = 132


def decode_traffic(b=32, hq=32, hk=8, d=128, length=8192, item=2, sq=1) -> dict:
    """Bytes, FLOPs and the floor time of one decode call (every sequence `length` long)."""
    kv = 2.0 * b * length * hk * d * item
    qo = 2.0 * b * sq * hq * d * 2
    flops = 4.0 * b * length * hq * sq * d
    return dict(kv_bytes=kv, bytes=kv + qo, flops=flops, intensity=flops / (kv + qo),
                ridge=GEMM_TFLOPS / HBM_TBPS, floor_us=(kv + qo) / (HBM_TBPS * 1e12) * 1e6,
                per_seq_layer_bytes=kv / b)


def test_decode_is_memory_bound():
    t = decode_traffic(**DEC)
    assert abs(t["kv_bytes"] - 1.074e9) < 0.001e9
    assert abs(t["per_seq_layer_bytes"] - 33.55e6) < 0.01e6
    assert 3.9 < t["intensity"] <= 4.0 and t["ridge"] / t["intensity"] > 40
    assert 252 < t["floor_us"] < 254
    # the same with an fp8 cache: half the bytes, the same FLOPs, still 20x under the ridge
    t8 = decode_traffic(**{**DEC, "item": 1})
    assert abs(t8["kv_bytes"] - t["kv_bytes"] / 2) < 1 and t8["ridge"] / t8["intensity"] > 20


# %% [markdown]
# ### Why one program per (sequence, kv head) is not enough
#
# A prefill kernel has B * H * S / BLOCK_M programs; decode has one query row per head. The
# natural grid is one program per (sequence, kv head), each walking all of its keys: 32 x 8 =
# 256 programs here, and only 8 for a single long sequence (B = 1, L = 131072). An SM streams
# from HBM only as fast as it keeps bytes in flight (Little's law: 4.25 TB/s x ~1 us of latency
# is ~4 MB in flight across the chip, ~32 KB an SM), and a decode program holds one or two K/V
# tiles in flight (16-32 KB). 8 programs on 132 SMs leave 124 SMs idle: the B = 1 call could
# reach at most 8/132 of the bandwidth. Even 256 programs are under one full wave when two or
# three programs fit on an SM, and the SMs that get one program finish early.
#
# **Split-KV** (flash-decoding) cuts each program's keys into `num_splits` runs; each split
# writes a partial O and its log-sum-exp in float32, and a second small kernel merges the
# splits: O = sum_s exp(lse_s - lse) O_s with lse = logsumexp_s(lse_s) (the same algebra as the
# online softmax above, once per split instead of once per block). tkit chooses the split count
# on the host from the SM count, batch, kv heads and the *largest possible* length (the cache's
# shape, never `cache_seqlens`: no host sync, so the call can be captured in a CUDA graph), and
# at least enough splits that none streams more than 2 MB (so one long sequence of a mixed
# batch is not a tail). The partials cost (D + 1) * 4 bytes per split, query head and
# sequence: at 2 splits and 32 heads, 33 KB against 33.6 MB of cache. The function below asks
# tkit's planner: B = 1 at 131072 keys gets 32 splits (8 -> 256 programs), B = 32 at 8192 gets
# 2 (256 -> 512), B = 128 at 1024 none (1024 programs already fill the 264 slots of two
# programs an SM about four times). The merge is a second launch; where the grid of one split
# fits in one wave (a dense B32 cache: 256 programs of 8 warps, two an SM, each keeping two
# K/V tiles in flight) tkit skips both the split and the merge. A paged 16-bit cache with pages
# smaller than a tile (page 16) merges inside the split kernel instead: the last split of a
# (sequence, kv head) to finish, told by an atomic counter that each call zeroes afresh, reads
# the others' partials and writes O (0.96x the dense TB/s against 0.95x with the launch).
#
# **GQA packing**: the 4 query heads of one kv head read the same K and V. One program takes
# all 4 rows (padded to the 16 rows `tl.dot` needs), so each K/V byte leaves HBM once instead of
# 4 times: the MMA runs at 4/16 of its rows, which costs nothing in a memory-bound kernel.

# %%
def decode_grid(b=32, hq=32, hk=8, d=128, length=8192, item=2, sq=1, sms=H200_SMS):
    """(programs without split, num_splits, programs with split) as tkit plans them for an
    H200 (from shapes only) with 4 warps and 2 stages a program, the default for a paged
    16-bit D=128 cache (a dense one whose grid fits one wave takes 8 warps in one split: below)."""
    from tkit.kernels import decode as da

    cfg = da.DecodeConfig(block_n=64, num_stages=2)
    q = torch.empty(b, sq, hq, d, device="meta", dtype=torch.bfloat16)
    kc = torch.empty(b, length, hk, d, device="meta",
                     dtype=torch.bfloat16 if item == 2 else torch.float8_e4m3fn)
    splits, _, _, n_m = da.plan_splits(q, kc, None, config=cfg)  # meta tensors: 132 SMs
    return b * hk * n_m, splits, b * hk * n_m * splits


def test_split_kv_fills_the_sms():
    # one sequence: 8 programs become 256 (32 splits of 4096 keys, 2 MB each), two an SM
    assert decode_grid(b=1, length=131072) == (8, 32, 256)
    # B32: 256 programs leave some SMs with one program, some with two: 2 splits, 512
    assert decode_grid(**DEC) == (256, 2, 512)
    # B128 L1024: 1024 programs are ~4 waves of 264 slots already: no split
    assert decode_grid(b=128, length=1024) == (1024, 1, 1024)
    # GQA packing: the 4 heads of a group are one program's rows, K/V read once, not 4x
    per_head = decode_traffic(**{**DEC, "hq": 8})["kv_bytes"] * 4  # a program per query head
    assert per_head == 4 * decode_traffic(**DEC)["kv_bytes"]


def test_decode_kernel_matches_reference():
    from tkit.specs.decode_attention import ref_decode_attention

    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if torch.cuda.is_available() else torch.float16
    q = torch.randn(2, 1, 8, 64, generator=g).to(dt).to(_device())
    kc, vc = (torch.randn(2, 200, 2, 64, generator=g).to(dt).to(_device()) for _ in range(2))
    lens = torch.tensor([200, 37], dtype=torch.int32, device=_device())
    out = tkit.decode_attention(q, kc, vc, lens, num_splits=3)  # split-KV plus the merge
    ref = ref_decode_attention(q.double(), kc.double(), vc.double(), lens)
    peer = ref_decode_attention(q, kc, vc, lens)
    err, peer_err = (out.double() - ref).abs().max(), (peer.double() - ref).abs().max()
    assert err <= 2 * peer_err + 1e-3


# %% [markdown]
# ### Measured on the H200 (2026-12-02), against the prediction
#
# From `benchmarks/results/h200.jsonl`, run `h200-2026-12-02-zo-decode` (docs/NOTES.md,
# "thirteenth session"; bytes = K and V read, plus the fp8 scales; % of the copy ceiling,
# 4.28 TB/s in that run; SDPA reads the same keys from a dense cache):
#
# | case | us | TB/s | % of copy | x SDPA flash | x SDPA cuDNN |
# | --- | --- | --- | --- | --- | --- |
# | B32 Hq32/Hkv8 D128 L8192 dense | 243.7 | 4.41 | 103% | 1.88 | 1.00 |
# | same, page 64 shuffled | 251.0 | 4.28 | 100% | 1.83 | 0.96 |
# | same, page 16 shuffled | 255.6 | 4.20 | 98% | 1.80 | 0.94 |
# | B1 L131072 dense | 133.5 | 4.02 | 94% | 1.20 | 0.95 |
# | B128 L1024 dense | 127.1 | 4.24 | 99% | 1.88 | 0.99 |
# | B32 L8192 page 64, fp8 per-token-head scales | 139.0 | 3.99 | 93% | - | - |
#
# * The prediction was 253 us for the B32 case at the copy ceiling; the dense call took 243.7
#   us. The ceiling is a copy, a read and a write; a kernel that only reads streams a little
#   faster (Nsight Compute put the decode kernel's DRAM at ~90% of its peak). The dense cache
#   runs as one split of 8 warps with 3 stages in flight (two K/V tiles a program, 256 programs,
#   two an SM): the whole grid in one wave and no merge launch. Two splits of 4 warps and the
#   merge took ~250 us + 4 us in the same week's runs.
# * The single long sequence, 8 programs without splitting, reaches 4.02 TB/s with 29 splits:
#   split-KV turns a grid of 6% of the SMs into a full one.
# * The fp8 cache reads half the bytes; it takes 0.554x the bf16 paged time (139.0 against
#   251.0 us), 1.11x its own floor. The first fp8 kernel took 335.5 us, slower than bf16: the
#   pipelined loop read the fp8 tile from shared memory a byte at a time into the MMA
#   operand's layout (the layout is chosen at the shared-memory read, and 8-bit values have no
#   transposing `ldmatrix`). Reading the cache as 32-bit words (4 head-dim positions each) and
#   converting each word into four fp16 quarters that are dotted separately removed the byte
#   gathers (0.575x). Where the batch fills one wave of programs (B27-B33 here) the default
#   now skips K's conversion altogether: the scores are computed transposed, keys as the
#   MMA's M, by an fp8 `wgmma` that reads K from shared memory as loaded, with the query
#   split into two fp8 parts (hi and lo, about bfloat16's 8 significant bits together);
#   128-key tiles, two in flight, two programs an SM. Over
#   L2-resident pages its loop takes the same time as the word pipeline's (118.9 against
#   119.3 us), so what it buys over HBM (0.56 against 0.58 in the same sweep) is bytes in
#   flight, not instructions; L2 prefetches beyond the shared-memory pipeline made it
#   slower in every form tried. Its time is set per program rather than by HBM, so at
#   other batches (a second, partial wave, or splits) the word pipeline ties or wins, and
#   keeps them (docs/NOTES.md, "thirteenth session").
# * One short sequence (B1 L4096: 16.8 MB, 3.9 us at the copy ceiling) is mostly fixed cost.
#   By events it takes ~16 us, of which ~3.5 us are what the events add around any run; by
#   its own kernels (`tkit bench --timer kernels`, run `h200-2026-12-04-zzzg-kernel-timer`)
#   13.9 us, against 13.2 for cuDNN. Both run two kernels, a split kernel and a merge (tkit
#   9.4 + 2.7 us, cuDNN 8.45 + 3.1); split-KV puts one program on each SM (16 splits of 4
#   tiles), and what separates the two is how fast such a split streams: each 4096 more
#   keys cost tkit ~4.2 us (4.0 TB/s) and cuDNN ~3.5 (4.8). Merging in the split kernel,
#   launching the merge early (PDL) and deeper pipelines all lost (docs/NOTES.md,
#   "thirty-second session").
# * Host time: decode steps are captured in CUDA graphs or, eager, served by per-signature
#   plans (15 us a call against SDPA's 29 in the latency group).

# %%
MEASURED_H200 = {  # run h200-2026-12-02-zo-decode: (us, TB/s)
    "dense": (243.7, 4.41), "page64": (251.0, 4.28), "fp8_page64": (139.0, 3.99),
}


def test_measured_figures_against_the_prediction():
    t = decode_traffic(**DEC)
    for name in ("dense", "page64"):
        us, tbps = MEASURED_H200[name]
        assert abs(t["kv_bytes"] / (us * 1e-6) / 1e12 - tbps) < 0.01  # the notes' own bytes
        assert 0.95 * t["floor_us"] <= us < 1.05 * t["floor_us"]  # at the copy floor
    us8, tb8 = MEASURED_H200["fp8_page64"]
    t8 = decode_traffic(**{**DEC, "item": 1})
    scales = 2.0 * DEC["b"] * DEC["length"] * DEC["hk"] * 4  # float32 per token and head
    assert abs((t8["kv_bytes"] + scales) / (us8 * 1e-6) / 1e12 - tb8) < 0.01
    assert t8["floor_us"] < us8 < 1.2 * t8["floor_us"]  # fp8: within 20% of its own floor
    assert us8 / MEASURED_H200["page64"][0] < 0.6  # ~half the bf16 time, as the bytes say


def measure_decode(b=32, hq=32, hk=8, d=128, length=8192, page=None):
    """On a GPU: tkit.decode_attention and SDPA (flash, cuDNN; dense K/V) in us and TB/s."""
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    k, v = (torch.randn(b, length, hk, d, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((b,), length, dtype=torch.int32, device=dev)
    kw = {}
    kc, vc = k, v
    if page:  # the same keys in shuffled pages
        nb = b * length // page
        perm = torch.randperm(nb, device=dev)
        kc, vc = (torch.empty(nb, page, hk, d, device=dev, dtype=dt) for _ in range(2))
        kc[perm] = k.reshape(nb, page, hk, d)
        vc[perm] = v.reshape(nb, page, hk, d)
        kw["block_table"] = perm.view(b, length // page).to(torch.int32)
    runs = {"tkit": lambda: tkit.decode_attention(q, kc, vc, lens, **kw)}
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                     ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(be=be):
            with sdpa_kernel(be):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                        enable_gqa=True)
        runs[name] = run
    kv = decode_traffic(b, hq, hk, d, length)["kv_bytes"]
    return {n: (ms * 1e3, kv / (ms * 1e-3) / 1e12)
            for n, ms in ((n, triton.testing.do_bench(f, return_mode="median"))
                          for n, f in runs.items())}

# %%
if __name__ == "__main__":
    t = traffic()
    print(f"standard attention: {t['standard_bytes'] / 1e9:.2f} GB -> >= {t['standard_ms']:.2f} ms"
          f"; flash: {t['flash_bytes'] / 1e9:.2f} GB, {t['flops'] / 1e9:.0f} GFLOP -> "
          f">= {t['flash_compute_ms']:.3f} ms at {GEMM_TFLOPS:.0f} TFLOP/s")
    test_blocked_attention_equals_softmax_attention()
    kernel_summary(echo=True)
    if torch.cuda.is_available():
        import triton
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        for causal in (False, True):
            fl = t["flops"] * (0.5 if causal else 1.0)
            runs = {"tkit": lambda c=causal: tkit.flash_attention(q, k, v, causal=c)}
            for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                             ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                def run(be=be, c=causal):
                    with sdpa_kernel(be):
                        return torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=c)
                runs[name] = run
            for name, fn in runs.items():
                ms = triton.testing.do_bench(fn, return_mode="median")
                tf = fl / (ms * 1e-3) / 1e12
                print(f"{'causal' if causal else 'full  '} {name:10s} {ms:.3f} ms "
                      f"{tf:6.1f} TFLOP/s = {100 * tf / GEMM_TFLOPS:.0f}% of the GEMM ceiling; "
                      f"prediction {fl / (GEMM_TFLOPS * 1e12) * 1e3:.3f} ms")
    td = decode_traffic(**DEC)
    print(f"decode B32 Hq32/Hkv8 D128 L8192: {td['kv_bytes'] / 1e9:.2f} GB of K/V, "
          f"{td['intensity']:.1f} FLOP/byte (ridge {td['ridge']:.0f}) -> "
          f">= {td['floor_us']:.0f} us")
    for args in (dict(b=1, length=131072), DEC):
        progs, splits, total = decode_grid(**args)
        print(f"  B{args['b']} L{args['length']}: {progs} programs -> {splits} splits, "
              f"{total} programs on {H200_SMS} SMs")
    if torch.cuda.is_available():
        for page in (None, 64):
            for name, (us, tbps) in measure_decode(page=page).items():
                print(f"decode {'dense ' if page is None else 'page64'} {name:10s} {us:7.1f} us "
                      f"{tbps:5.2f} TB/s = {100 * tbps / HBM_TBPS:.0f}% of copy; prediction "
                      f"{td['floor_us']:.0f} us")
