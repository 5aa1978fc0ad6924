"""tkit.models.paged: a Llama from tkit ops over a paged KV cache against transformers' own
model with the same weights (greedy tokens equal, logits close), and the cache's pages."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tkit.models.paged import LlamaModel, PagedKVCache  # noqa: E402
from tkit.testing.tensors import default_device  # noqa: E402

ON_GPU = torch.cuda.is_available()


def _hf(dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               attn_implementation="sdpa", initializer_range=0.15)
    cfg.update(kw)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return m.to(default_device(), dtype).eval()


PROMPTS = [[5, 17, 3, 88, 41], [9, 2, 60, 61, 62, 7, 30, 11, 1], [44]]


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device=default_device())
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _next_step(model, cache, nxt, write=True):
    """The decode step of PROMPTS' sequences (0, 1, 2; prefilled) with tokens ``nxt`` at
    their next positions (written to the cache, or with ``write`` False not: slot -1)."""
    dev = default_device()
    lens = [len(p) for p in PROMPTS]
    for s in range(3):
        cache.reserve(s, lens[s] + 1)
    slots = [cache.slot(s, lens[s]) if write else -1 for s in range(3)]
    return model.decode(cache, nxt, torch.tensor(lens, device=dev),
                        torch.tensor(slots, device=dev),
                        torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=dev),
                        cache.table([0, 1, 2]).to(dev))


@pytest.mark.parametrize("page", [1, 4, 16])
def test_greedy_tokens_equal_hf(page):
    hf = _hf()
    ours = LlamaModel.from_hf(hf)
    got = ours.generate(PROMPTS, 6, page_size=page)
    assert got == [_hf_greedy(hf, p, 6) for p in PROMPTS]


def test_prefill_and_decode_logits_close_to_hf():
    hf = _hf(seed=1, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16})
    ours = LlamaModel.from_hf(hf)
    cache = ours.new_cache(num_blocks=16, page_size=4)
    logits = ours.prefill(cache, [0, 1, 2], PROMPTS)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = hf(torch.tensor([p], device=default_device())).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, atol=2e-4, rtol=2e-4)
    # one decode step of the batch against HF's forward over prompt + token
    nxt = logits.argmax(-1)
    dev = default_device()
    step = _next_step(ours, cache, nxt)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = hf(torch.tensor([p + [int(nxt[i])]], device=dev)).logits[0, -1]
            torch.testing.assert_close(step[i], ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_under_the_reference_rule(dtype):
    # prefill and one decode step of the batch in 16 bits against HF's model in float64 (the
    # reference) and in the same dtype (the peer), both built as from_pretrained builds them
    # (RoPE's frequencies kept in float32); the Llama-3-8B-sized benchmark disagreed with HF
    # in bf16 on the GPU, which this pins down at a small size
    dev = default_device()
    ref_m, peer_m = _hf(seed=2).to(torch.float64), _hf(seed=2).to(dtype)
    for m in (ref_m, peer_m):  # frequencies exact, as from_pretrained(dtype=...) leaves them
        m.model.rotary_emb.inv_freq = m.model.rotary_emb.inv_freq.to(torch.float32)
        m.model.rotary_emb.original_inv_freq = m.model.rotary_emb.inv_freq
    ours = LlamaModel.from_hf(peer_m)
    cache = ours.new_cache(num_blocks=16, page_size=4)
    got = [ours.prefill(cache, [0, 1, 2], PROMPTS)]
    nxt = got[0].argmax(-1)
    got.append(_next_step(ours, cache, nxt))
    with torch.no_grad():
        for step, out in enumerate(got):
            for i, p in enumerate(PROMPTS):
                ids = torch.tensor([p + [int(nxt[i])] * step], device=dev)
                r = ref_m(ids).logits[0, -1]
                peer = peer_m(ids).logits[0, -1].double()
                err, peer_err = (out[i].double() - r).abs().max(), (peer - r).abs().max()
                assert err <= 2 * peer_err + 1e-2 * r.abs().max(), (step, i, err, peer_err)


def test_cache_pages():
    c = PagedKVCache(1, 6, 4, 1, 8, torch.float32, "cpu")
    c.reserve(0, 5)
    c.reserve(1, 4)
    assert len(c.blocks[0]) == 2 and len(c.blocks[1]) == 1
    assert len(set(c.blocks[0]) | set(c.blocks[1])) == 3
    assert c.slot(0, 4) == c.blocks[0][1] * 4
    with pytest.raises(RuntimeError, match="cache is full"):
        c.reserve(2, 13)
    c.release(0)
    c.reserve(2, 12)
    assert c.table([1, 2]).tolist() == [[c.blocks[1][0], 0, 0], c.blocks[2]]
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(1, 4, 3, 1, 8, torch.float32, "cpu")


@pytest.mark.gpu
def test_cuda_graph_generation_equals_eager():
    hf = _hf(torch.bfloat16, seed=2, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2)
    ours = LlamaModel.from_hf(hf)
    eager = ours.generate(PROMPTS, 12, page_size=16)
    assert ours.generate(PROMPTS, 12, page_size=16, cuda_graph=True) == eager
    sampled = ours.generate(PROMPTS, 8, temperature=0.8, top_k=20, seed=5, cuda_graph=True)
    assert ours.generate(PROMPTS, 8, temperature=0.8, top_k=20, seed=5) == sampled
    fp8 = dict(page_size=16, kv_dtype=torch.float8_e4m3fn)
    assert ours.generate(PROMPTS, 12, cuda_graph=True, **fp8) == ours.generate(PROMPTS, 12, **fp8)


def _captured_step_without_its_cache(model):
    """A step captured over PROMPTS' prefilled cache, the caller's reference to the cache
    dropped (as a helper that returns only the step does); the eager logits of the same step
    taken before, and a weak reference to the cache."""
    cache = model.new_cache(num_blocks=6, page_size=16)
    model.prefill(cache, [0, 1, 2], PROMPTS)
    host = cache.step_inputs([0, 1, 2], [len(p) for p in PROMPTS])
    tok = torch.tensor([3, 1, 4], device=default_device())
    eager = model.decode(cache, tok, **{k: v.to(tok.device) for k, v in host.items()})
    step = model.capture_step(cache, tok, host)
    return step, tok, host, eager.clone(), weakref.ref(cache)


def test_captured_step_holds_its_cache(monkeypatch):
    # the graph reads the cache by address: a step that outlives the caller's reference must
    # keep the cache (the HF benchmark's graph step read freed pages, reused by the next
    # allocations, and its logits left HF's by 1.4). The capture path on the CPU, with the
    # graph calls stubbed.
    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ours = LlamaModel.from_hf(_hf())
    with torch.no_grad():
        step, *_, cache = _captured_step_without_its_cache(ours)
    gc.collect()
    assert cache() is not None
    del step
    gc.collect()
    assert cache() is None  # the step held it, nothing else


@pytest.mark.gpu
def test_captured_step_replays_after_the_cache_is_dropped():
    hf = _hf(torch.bfloat16, seed=2, hidden_size=256, intermediate_size=512)
    ours = LlamaModel.from_hf(hf)
    with torch.no_grad():
        step, tok, host, eager, _ = _captured_step_without_its_cache(ours)
        gc.collect()
        junk = ours.new_cache(num_blocks=6, page_size=16)  # a freed cache's blocks go here
        for t in junk.k + junk.v:
            t.fill_(7.0)
        got = step(tok, host).float()
    assert ((got - eager.float()).abs().max() / eager.float().abs().max()) < 2 ** -6


def _family(kind, seed=0, **kw):
    """A tiny transformers model of the Llama family ``kind`` with every norm weight and
    every bias drawn away from HF's init (ones and zeros), so that a dropped one shows."""
    names = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama",
             "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe"}
    torch.manual_seed(seed)
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               attn_implementation="sdpa", initializer_range=0.15)
    cfg.update(kw)
    config = getattr(transformers, f"{names[kind]}Config")(**cfg)
    m = getattr(transformers, f"{names[kind]}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias") or name.endswith("mlp.gate.weight"):  # routers too
                p.normal_(0.0, 0.3)
    return m.to(default_device()).eval()


FAMILY_CASES = [
    ("mistral", dict(sliding_window=4)),  # every layer sees its last 4 positions
    ("qwen2", {}),  # q, k, v biases
    ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)),
    ("qwen3", dict(head_dim=32)),  # q and k normalized per head; head_dim != hidden / heads
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),  # top-2 of 4, renormalized
    # a sparse layer (top-2 of 4, not renormalized) and a dense one
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       mlp_only_layers=[1], norm_topk_prob=False, head_dim=16)),
]


@pytest.mark.parametrize("kind,kw", FAMILY_CASES)
def test_families_match_hf(kind, kw):
    hf = _family(kind, seed=3, **kw)
    ours = LlamaModel.from_hf(hf)
    extras = ours.layers[0].extras()
    assert (extras["qkv_bias"] is not None) == (kind == "qwen2")
    assert (extras["q_norm"] is not None) == kind.startswith("qwen3")
    assert [lw.moe is not None for lw in ours.layers] == {
        "mixtral": [True, True], "qwen3_moe": [True, False]}.get(kind, [False, False])
    assert [lw.window for lw in ours.layers] == {
        "mistral": [3, 3], "qwen2": [-1, 2] if kw else [-1, -1]}.get(kind, [-1, -1])
    # prefill and a decode step against HF's forward over the same tokens (windows bite:
    # prompts of up to 9 tokens)
    dev = default_device()
    cache = ours.new_cache(num_blocks=16, page_size=4)
    logits = ours.prefill(cache, [0, 1, 2], PROMPTS)
    nxt = logits.argmax(-1)
    step = _next_step(ours, cache, nxt)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = hf(torch.tensor([p], device=dev)).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, atol=2e-4, rtol=2e-4)
            ref = hf(torch.tensor([p + [int(nxt[i])]], device=dev)).logits[0, -1]
            torch.testing.assert_close(step[i], ref, atol=2e-4, rtol=2e-4)
    assert ours.generate(PROMPTS, 5, page_size=4) == [_hf_greedy(hf, p, 5) for p in PROMPTS]


def test_from_hf_refuses_other_models():
    hf = _family("llama")
    hf.config.model_type = "gemma"
    with pytest.raises(NotImplementedError, match="model_type 'gemma'"):
        LlamaModel.from_hf(hf)
    hf = _family("llama", mlp_bias=True)
    with pytest.raises(NotImplementedError, match="MLP"):
        LlamaModel.from_hf(hf)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kw", FAMILY_CASES)
def test_families_cuda_graph_generation_equals_eager(kind, kw):
    # every family's decode step (biases, per-head norms, windows, tkit.moe) captured in a
    # CUDA graph and replayed gives the eager step's tokens
    ours = LlamaModel.from_hf(_family(kind, seed=4, **kw).to(torch.bfloat16))
    eager = ours.generate(PROMPTS, 10, page_size=4)
    assert ours.generate(PROMPTS, 10, page_size=4, cuda_graph=True) == eager


def test_fp8_cache_decode_reads_its_pages():
    # with an fp8 cache, prefill and decode write k and v quantized per token and head, and
    # the decode step attends over them dequantized: the same step over a float32 copy of the
    # dequantized pages (k8 * scale; its own write skipped: slot -1) gives the same logits,
    # and both stay near the float32 cache's (fp8's rounding of k and v moves them a little)
    hf = _hf(seed=5)
    ours = LlamaModel.from_hf(hf)
    caches = {kv: ours.new_cache(num_blocks=16, page_size=4, kv_dtype=kv)
              for kv in (torch.float8_e4m3fn, None)}
    logits = {kv: ours.prefill(c, [0, 1, 2], PROMPTS) for kv, c in caches.items()}
    torch.testing.assert_close(logits[None], logits[torch.float8_e4m3fn])  # prefill: fresh k, v
    c8 = caches[torch.float8_e4m3fn]
    assert c8.k[0].dtype == torch.float8_e4m3fn and c8.k_scale[0].shape == c8.k[0].shape[:3]
    for i in range(len(ours.layers)):  # each written token's scales: amax / 448
        for s, p in enumerate(PROMPTS):
            pos = torch.arange(len(p))
            rows = torch.tensor(c8.blocks[s])[pos // 4] * 4 + pos % 4
            assert (c8.k_scale[i].view(-1, 2)[rows] != 1).all()
            assert (c8.v_scale[i].view(-1, 2)[rows] != 1).all()
    nxt = logits[None].argmax(-1)
    fp8, full = _next_step(ours, c8, nxt), _next_step(ours, caches[None], nxt)
    deq = ours.new_cache(num_blocks=16, page_size=4)
    deq.blocks = {s: list(b) for s, b in c8.blocks.items()}
    for i in range(len(ours.layers)):
        deq.k[i].copy_(c8.k[i].float() * c8.k_scale[i][..., None])
        deq.v[i].copy_(c8.v[i].float() * c8.v_scale[i][..., None])
    torch.testing.assert_close(fp8, _next_step(ours, deq, nxt, write=False), atol=1e-4,
                               rtol=1e-4)
    assert 0 < (fp8 - full).abs().max() < 0.05 * full.abs().max()
    with pytest.raises(ValueError, match="kv_dtype"):
        ours.new_cache(4, kv_dtype=torch.float16)


def test_generation_stops_at_eos():
    # each sequence ends with the first eos it emits, as transformers' generate ends it (its
    # padding after the eos dropped); a token that greedy decoding emits early serves as eos
    hf = _hf(seed=6)
    ours = LlamaModel.from_hf(hf)
    free = ours.generate(PROMPTS, 8, page_size=4)
    eos = free[1][2]  # the second prompt's third token: that sequence ends there
    got = ours.generate(PROMPTS, 8, page_size=4, eos_token_id=eos)
    for p, g, f in zip(PROMPTS, got, free):
        ids = torch.tensor([p], device=default_device())
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos,
                           pad_token_id=eos)[0, len(p):].tolist()
        want = want[:want.index(eos) + 1] if eos in want else want
        assert g == want and g == (f[:f.index(eos) + 1] if eos in f else f)
    assert len(got[1]) == 3


@pytest.mark.parametrize("draft,k", [("target", 3), ("other", 2)])
def test_speculative_greedy_equals_greedy(draft, k):
    # greedy speculative decoding gives the target's own greedy tokens whatever the draft:
    # the target itself (every draft token accepted) or another model (most rejected); and
    # ends each sequence at eos as generate does
    target = LlamaModel.from_hf(_hf(seed=0))
    small = target if draft == "target" else LlamaModel.from_hf(_hf(seed=7, num_hidden_layers=1))
    want = target.generate(PROMPTS, 7, page_size=4)
    stats = {}
    assert target.generate_speculative(small, PROMPTS, 7, num_draft=k, page_size=4,
                                       stats=stats) == want
    if draft == "target":  # every proposal accepted: 6 tokens after the first in 2 rounds
        assert stats == dict(rounds=2, drafted=2 * 3 * k, accepted=2 * 3 * k)
    else:
        assert stats["accepted"] < stats["drafted"]
    if draft == "other":
        eos = want[0][3]
        assert (target.generate_speculative(small, PROMPTS, 7, num_draft=k, page_size=4,
                                            eos_token_id=eos)
                == target.generate(PROMPTS, 7, page_size=4, eos_token_id=eos))


def test_speculative_sampling_is_seeded():
    target = LlamaModel.from_hf(_hf(seed=0))
    draft = LlamaModel.from_hf(_hf(seed=7, num_hidden_layers=1))
    kw = dict(num_draft=2, page_size=4, temperature=0.8, seed=11)
    a = target.generate_speculative(draft, PROMPTS, 4, **kw)
    assert a == target.generate_speculative(draft, PROMPTS, 4, **kw)
    assert [len(x) for x in a] == [4, 4, 4]
    with pytest.raises(ValueError, match="num_draft"):
        target.generate_speculative(draft, PROMPTS, 6, num_draft=16)


def test_forked_samples_share_the_prompt():
    # num_return_sequences samples of a prompt decode from one prefill: greedy samples all
    # equal the greedy output; seeded sampling gives what the prompts repeated (no sharing)
    # give; the prompt's full pages are held once
    ours = LlamaModel.from_hf(_hf(seed=8))
    greedy = ours.generate(PROMPTS, 5, page_size=4)
    got = ours.generate(PROMPTS, 5, page_size=4, num_return_sequences=3)
    assert got == [g for g in greedy for _ in range(3)]
    kw = dict(page_size=4, temperature=1.0, seed=9)
    shared = ours.generate(PROMPTS, 5, num_return_sequences=2, **kw)
    assert shared == ours.generate([p for p in PROMPTS for _ in range(2)], 5, **kw)
    assert shared[2] != shared[3]  # two samples of the second prompt
    with pytest.raises(ValueError, match="num_return_sequences"):
        ours.generate(PROMPTS, 5, num_return_sequences=0)


def test_fork_shares_full_pages_and_copies_the_last():
    c = PagedKVCache(2, 8, 4, 1, 8, torch.float32, "cpu")
    c.reserve(0, 6)  # a full page and half of another
    for t in c.k + c.v:
        t.normal_()
    c.fork(0, 1, 6)
    assert c.blocks[1][0] == c.blocks[0][0] and c.blocks[1][1] != c.blocks[0][1]
    for t in c.k + c.v:
        assert torch.equal(t[c.blocks[1][1]], t[c.blocks[0][1]])
    assert len(c.free) == 5
    c.release(0)  # the shared page stays held by sequence 1
    assert len(c.free) == 6 and c.blocks[1][0] not in c.free
    c.release(1)
    assert len(c.free) == 8
    c.reserve(2, 4)
    with pytest.raises(ValueError, match="fewer than"):
        c.fork(2, 3, 5)
