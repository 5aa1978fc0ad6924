# %% [markdown]
# # 10. A decode step: from fast kernels to a fast model
#
# Chapters 01-09 made each kernel fast alone. A model generating text runs them in a fixed
# order once a token: for Llama-3-8B, 32 layers of RMSNorm, QKV projection, RoPE and the KV
# cache write, decode attention, output projection, RMSNorm, gate/up with SwiGLU, down
# projection, then the LM head and a sampler. This chapter predicts the time of that step from
# the bytes it must move, counts what the host adds (each launch costs microseconds of Python
# and driver work, and a step makes hundreds), shows how a paged KV cache is addressed, works
# out what a mixture of experts reads at a given batch, what an fp8 KV cache saves and what
# speculative decoding buys, and on a GPU measures a step of tkit's paged Llama
# (``tkit.models.paged``) eager and replayed from a CUDA graph, over a 16-bit and an fp8 cache.
#
# Run it: `python tutorials/10_decode_step.py`; `pytest tutorials/10_decode_step.py` checks
# every claim on any machine (kernels in Triton's interpreter without a GPU).

# %%
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # run kernels in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tkit  # noqa: E402
from tkit.models import LLAMA3_8B  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HBM_TBPS = 4.24  # the H200's measured copy ceiling (chapter 01)
LAYERS, VOCAB = 32, 128256
#: tkit's eager host time a call at decode sizes on the H200, us (README: 6.2-15.5 a call)
HOST_US_PER_LAUNCH = 8.0


# %% [markdown]
# ## 1. What one step must read
#
# Every weight is read once a step whatever the batch (a batch of B sequences multiplies the
# FLOPs, not the weight bytes), and each sequence reads its own K and V: 2 x layers x kv_heads
# x head_dim x 2 bytes a cached token, 128 KB for Llama-3-8B in bf16. So the step's floor is
#
#     t(B, L) = (W + B L kv_bytes_per_token) / HBM bandwidth
#
# At B = 1 the 16 GB of weights dominate (3.8 ms, 264 tokens/s at best); the cache catches up
# with the weights at B L = W / 128 KB, ~120 K cached tokens (B = 32 at L = 4096); past that
# the cache decides, which is why decode attention (chapter 08) had to stream at the copy
# ceiling, and why fp8 caches (half the bytes) pay.

# %%
def llama_bytes(cfg=LLAMA3_8B, layers=LAYERS, vocab=VOCAB, itemsize=2) -> dict:
    h, hq, hk, d, m = (cfg[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "mlp"))
    layer = (h * (hq + 2 * hk) * d + hq * d * h + 3 * h * m + 2 * h) * itemsize
    return dict(layer=layer, weights=layers * layer + 2 * vocab * h * itemsize + h * itemsize,
                kv_per_token=2 * layers * hk * d * itemsize)


def step_floor_ms(batch: int, context: int, **kw) -> float:
    b = llama_bytes(**kw)
    return (b["weights"] + batch * context * b["kv_per_token"]) / (HBM_TBPS * 1e12) * 1e3


def test_llama3_8b_bytes():
    b = llama_bytes()
    assert abs(b["weights"] / 1e9 - 16.06) < 0.01  # 8.03 B parameters in bf16
    assert b["kv_per_token"] == 128 * 1024
    assert 3.7 < step_floor_ms(1, 1) < 3.9
    # the cache equals the weights at ~120 K cached tokens
    assert 110e3 < b["weights"] / b["kv_per_token"] < 130e3
    assert step_floor_ms(32, 4096) / step_floor_ms(1, 4096) < 2.1  # 32x the tokens, ~2x time


# %% [markdown]
# ## 2. What the host adds
#
# A layer's decode step is nine launches in tkit (``tkit.models.llama.llama_decode_layer``):
# norm, QKV GEMM, RoPE + cache write, decode attention, o-proj (+ residual), norm, gate/up
# GEMM (+ SwiGLU), down GEMM (+ residual), and the attention's split merge when it splits.
# 32 layers, the LM head, the final norm and the sampler make ~290 launches a step; at ~8 us of
# host time each, 2.3 ms, over half the 3.8 ms floor of a B = 1 step. The launches overlap the
# GPU's work only while the host keeps ahead; a transformers forward adds its own Python per
# module (tens of microseconds a layer) and falls behind. A CUDA graph captures the step's
# launches once and replays them with one call: the host cost becomes one launch, and the
# step's inputs (tokens, positions, slots, lengths, block table) are copied into the captured
# tensors first. Nothing in the step may read a device value on the host, or the capture
# would break: tkit's decode ops take lengths and tables on the device and never sync.

# %%
def launches_per_step(layers=LAYERS, splits=True) -> int:
    return layers * (8 + int(splits)) + 3  # + final norm, LM head, sampler


def host_ms(launches: int) -> float:
    return launches * HOST_US_PER_LAUNCH / 1e3


def test_host_share_at_batch_one():
    n = launches_per_step()
    assert 280 < n < 300
    assert host_ms(n) / step_floor_ms(1, 1) > 0.5  # the host alone is half the floor
    # at B = 64, L = 4096 the GPU's floor is far above the host's cost
    assert host_ms(n) / step_floor_ms(64, 4096) < 0.2


# %% [markdown]
# ## 3. A paged KV cache, addressed
#
# ``tkit.models.paged.PagedKVCache`` keeps K and V as pages (num_blocks, page_size, kv_heads,
# head_dim) and hands a sequence a page from a free list each time it fills one: position p
# of sequence s lives at slot ``block_table[s][p // page] * page + p % page``. Pages need not
# be adjacent, so sequences of any length share one pool without copying or reserving the
# longest length for everyone. The kernels read the block table on the device: decode
# attention gathers a tile of keys across pages (chapter 08), ``rope_append_kv`` writes each
# new token at its slot. ``LlamaModel`` (weights from a transformers Llama) prefills prompts of
# different lengths as one packed batch, then steps the batch; its greedy tokens are the
# transformers model's.

# %%
def test_slots_follow_the_block_table():
    from tkit.models.paged import PagedKVCache

    c = PagedKVCache(1, 8, 4, 1, 8, torch.float32, "cpu")
    c.reserve(0, 6)  # two pages
    c.reserve(1, 3)  # one page
    c.reserve(0, 9)  # a third page for sequence 0, wherever the free list has one
    t = c.table([0, 1])
    for p in range(9):
        assert c.slot(0, p) == int(t[0, p // 4]) * 4 + p % 4
    assert len(set(c.blocks[0]) | set(c.blocks[1])) == 4


def test_paged_llama_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from tkit.models.paged import LlamaModel

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, initializer_range=0.15,
                                   attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(cfg).to(DEVICE).eval()
    prompts = [[5, 17, 3, 88], [9, 2, 60, 61, 62, 7, 30]]
    ours = LlamaModel.from_hf(hf).generate(prompts, 5, page_size=4)
    for p, got in zip(prompts, ours):
        ids = torch.tensor([p], device=DEVICE)
        ref = hf.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                          pad_token_id=0)[0, len(p):].tolist()
        assert got == ref


# %% [markdown]
# ## 4. What a mixture of experts reads
#
# An MoE layer holds E experts and sends each token to k of them. At decode, a step reads the
# weights of the experts its tokens chose, not all E: if tokens choose independently and
# uniformly, an expert escapes all B tokens of a batch with probability (1 - k/E)^B, so
#
#     experts read = E (1 - (1 - k/E)^B)
#
# For Qwen3-30B-A3B's 128 experts with k = 8: 8 at B = 1, 52 at B = 8, 112 at B = 32 and 126
# at B = 64. So an MoE's decode step costs about its active parameters at B = 1 and
# its total parameters at a moderate batch: batching buys less than it does for a dense model
# until every expert is busy. (Real routers are not uniform, which reads fewer.) The check
# below routes random logits with ``tkit.moe_route`` and counts.

# %%
def experts_read(e: int, k: int, batch: int) -> float:
    return e * (1 - (1 - k / e) ** batch)


def test_expected_experts_read():
    assert round(experts_read(128, 8, 1)) == 8
    assert 51 < experts_read(128, 8, 8) < 52
    assert 111 < experts_read(128, 8, 32) < 113 and 125 < experts_read(128, 8, 64) < 127
    gen = torch.Generator().manual_seed(0)
    for b in (1, 4, 16):
        counts = []
        for _ in range(20):
            z = torch.randn(b, 32, generator=gen).to(DEVICE)
            _, ids = tkit.moe_route(z, 4)
            counts.append(len(set(ids.flatten().tolist())))
        mean = sum(counts) / len(counts)
        assert abs(mean - experts_read(32, 4, b)) < 0.15 * experts_read(32, 4, b) + 0.5


# %% [markdown]
# ## 5. An fp8 KV cache
#
# Past the batch where the cache outweighs the weights (section 1), the step is the cache's
# bytes. Stored as float8_e4m3fn with a float32 scale per token and head (vLLM's and
# FlashInfer's layout; ``tkit.rope_append_kv`` computes each scale as amax / 448 while it
# writes, ``tkit.decode_attention`` dequantizes in registers), a token costs
# 2 x layers x kv_heads x (head_dim + 4) bytes instead of 2 x layers x kv_heads x head_dim x 2:
# 66 KB instead of 128 KB for Llama-3-8B. The floor of a step then falls by up to
# 128 / 66 = 1.94x at long contexts, and by little at B = 1 where the weights dominate:
# ``LlamaModel.new_cache(..., kv_dtype=torch.float8_e4m3fn)`` (or ``generate(...,
# kv_dtype=...)``) is worth it for large batches and long contexts. The check below also
# runs a tiny model's decode step over an fp8 cache and over its pages dequantized: the
# kernels read exactly what was stored.

# %%
def kv_bytes_per_token(fp8: bool, cfg=LLAMA3_8B, layers=LAYERS) -> int:
    hk, d = cfg["kv_heads"], cfg["head_dim"]
    return 2 * layers * hk * ((d + 4) if fp8 else 2 * d)


def fp8_floor_ratio(batch: int, context: int) -> float:
    """The bf16 cache's step floor over the fp8 cache's."""
    w = llama_bytes()["weights"]
    return ((w + batch * context * kv_bytes_per_token(False))
            / (w + batch * context * kv_bytes_per_token(True)))


def test_fp8_cache_floor():
    assert kv_bytes_per_token(False) == 128 * 1024
    assert kv_bytes_per_token(True) == 66 * 1024
    assert fp8_floor_ratio(1, 4096) < 1.02  # the weights dominate
    assert 1.3 < fp8_floor_ratio(32, 4096) < 1.4
    assert 1.75 < fp8_floor_ratio(64, 32768) < 1.94


def test_fp8_cache_step_reads_what_was_stored():
    import transformers

    from tkit.models.paged import LlamaModel

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)).to(DEVICE)
    model = LlamaModel.from_hf(hf)
    cache = model.new_cache(num_blocks=4, page_size=4, kv_dtype=torch.float8_e4m3fn)
    model.prefill(cache, [0], [[3, 1, 4, 1, 5, 9]])
    cache.reserve(0, 7)
    inputs = dict(positions=torch.tensor([6]), cache_seqlens=torch.tensor([7], dtype=torch.int32),
                  block_table=cache.table([0]))
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    tok = torch.tensor([2], device=DEVICE)
    fp8 = model.decode(cache, tok, slot_mapping=torch.tensor([cache.slot(0, 6)], device=DEVICE),
                       **inputs)
    deq = model.new_cache(num_blocks=4, page_size=4)
    deq.blocks = cache.blocks
    deq.k[0].copy_(cache.k[0].float() * cache.k_scale[0][..., None])
    deq.v[0].copy_(cache.v[0].float() * cache.v_scale[0][..., None])
    again = model.decode(deq, tok, slot_mapping=torch.tensor([-1], device=DEVICE), **inputs)
    torch.testing.assert_close(fp8, again, atol=1e-4, rtol=1e-4)


# %% [markdown]
# ## 6. Speculative decoding
#
# At small batches a step is the weights' bytes (section 1), and a step over k + 1 tokens of
# a sequence reads the same weights as a step over one: verifying k guesses costs about one
# step. Speculative decoding guesses with a small draft model (k of its steps), verifies with
# the target in one step, and ``tkit.speculative_accept`` keeps the guesses up to the first
# rejection plus one token of the target's, so that the output follows the target's
# distribution exactly. If the draft's token is accepted with probability a at each position
# (a = sum over the vocabulary of min(p_target, p_draft)), a round makes
#
#     E[tokens] = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)
#
# tokens for one target step and k + 1 draft steps (``LlamaModel.generate_speculative`` runs
# the draft once more to keep its cache whole). With a = 0.8 and k = 4: 3.36 tokens a round;
# with a draft step costing 10% of the target's, 1.5 target steps, so 2.24x the tokens a unit of
# time. The check samples ``tkit.speculative_accept`` on two fixed distributions and counts.

# %%
def expected_tokens_per_round(a: float, k: int) -> float:
    return k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def test_acceptance_matches_the_formula():
    assert abs(expected_tokens_per_round(0.8, 4) - 3.3616) < 1e-4
    gen = torch.Generator().manual_seed(0)
    vocab, k, rows = 16, 3, 1000
    p = torch.softmax(torch.randn(vocab, generator=gen), 0)  # the target's distribution
    q = torch.softmax(torch.log(p) + 0.7 * torch.randn(vocab, generator=gen), 0)  # the draft's
    a = torch.minimum(p, q).sum().item()
    drafted = torch.multinomial(q, rows * k, replacement=True, generator=gen).view(rows, k)
    _, n = tkit.speculative_accept(drafted.to(DEVICE), q.expand(rows, k, vocab).to(DEVICE),
                                   p.expand(rows, k + 1, vocab).to(DEVICE),
                                   seed=torch.arange(rows, device=DEVICE))
    mean = n.float().mean().item() + 1  # accepted drafts + the target's token
    assert abs(mean - expected_tokens_per_round(a, k)) < 0.05 * expected_tokens_per_round(a, k)


# %% [markdown]
# ## 7. Measured (GPU)
#
# A stack of Llama-3-8B-sized layers (random weights) decoding a batch over the paged cache:
# the step eager, and replayed from its CUDA graph, against the byte floor of section 1 for
# those layers; then the graph's replay over an fp8 cache against section 5's floor. The eager
# step pays the host's launches; the graph's replay is the GPU's time.

# %%
def measure(layers=4, batch=8, context=1024):
    """(name, ms a step, floor ms) rows for a ``layers``-layer stack: the 16-bit cache eager
    and from its graph, the fp8 cache from its graph."""
    import transformers

    from tkit.models.paged import LlamaModel

    c = LLAMA3_8B
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=c["hidden"], intermediate_size=c["mlp"],
        num_hidden_layers=layers, num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], max_position_embeddings=2 * context,
        attn_implementation="sdpa")
    with torch.device(DEVICE):
        hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model = LlamaModel.from_hf(hf)
    del hf
    rows = []
    b = llama_bytes(layers=layers)
    for kv_dtype in (None, torch.float8_e4m3fn):
        eager, graph = _time_steps(model, batch, context, kv_dtype, eager=kv_dtype is None)
        kv = kv_bytes_per_token(kv_dtype is not None, layers=layers)
        floor = (b["weights"] + batch * (context + 1) * kv) / (HBM_TBPS * 1e9)
        if kv_dtype is None:
            rows += [("eager step", eager, floor), ("CUDA graph replay", graph, floor)]
        else:
            rows.append(("fp8 cache, graph replay", graph, floor))
    return rows


def _time_steps(model, batch, context, kv_dtype, eager=True):
    """(eager ms or None, graph replay ms) of a decode step of ``batch`` prompts of
    ``context`` tokens over a new cache of ``kv_dtype``."""
    from tkit.bench.latency import wall_per_call_ms

    seqs = list(range(batch))
    cache = model.new_cache(num_blocks=batch * (context // 16 + 1), page_size=16,
                            kv_dtype=kv_dtype)
    with torch.no_grad():
        tok = model.prefill(cache, seqs, [[1] * context for _ in seqs]).argmax(-1)
        host = cache.step_inputs(seqs, [context] * batch)
        dev = {k: v.to(DEVICE) for k, v in host.items()}
        t_eager = (wall_per_call_ms(lambda: model.decode(cache, tok, **dev), 20, 5)[0]
                   if eager else None)
        step = model.capture_step(cache, tok, host)
        return t_eager, wall_per_call_ms(lambda: step(tok, host), 20, 5)[0]


@pytest.mark.gpu
def test_graph_replay_beats_eager_gpu():
    t = {name: ms for name, ms, _ in measure()}
    assert t["CUDA graph replay"] < t["eager step"]


# %%
if __name__ == "__main__":
    b = llama_bytes()
    print(f"Llama-3-8B: weights {b['weights'] / 1e9:.2f} GB, KV {b['kv_per_token'] / 1024:.0f} "
          f"KB a token")
    for batch, ctx in ((1, 1), (1, 4096), (32, 4096), (64, 8192)):
        print(f"B={batch:3d} L={ctx:5d}: floor {step_floor_ms(batch, ctx):6.2f} ms a step, "
              f"{batch / step_floor_ms(batch, ctx) * 1e3:8.0f} tokens/s at best")
    n = launches_per_step()
    print(f"{n} launches a step: ~{host_ms(n):.1f} ms of host time eager")
    for batch in (1, 8, 32, 64):
        print(f"Qwen3-30B-A3B experts read at B={batch}: {experts_read(128, 8, batch):.0f} "
              "of 128")
    for batch, ctx in ((1, 4096), (32, 4096), (64, 32768)):
        print(f"B={batch:3d} L={ctx:5d}: the bf16 cache's floor / the fp8 cache's = "
              f"{fp8_floor_ratio(batch, ctx):.2f}")
    for a in (0.6, 0.8, 0.9):
        print(f"speculative, acceptance {a}: " + ", ".join(
            f"k={k} {expected_tokens_per_round(a, k):.2f}" for k in (2, 4, 8)) + " tokens a round")
    if torch.cuda.is_available():
        for name, ms, floor in measure():
            print(f"{name:20s} {ms:7.3f} ms a step (floor {floor:.3f} ms)")
    else:
        print("the measurement (section 7) needs a CUDA GPU: skipped")
