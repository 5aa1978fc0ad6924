"""transformers' Llama with tkit inside (``tkit.models.hf.apply_tkit_to_llama``): a tiny random
model's logits, greedy generation over HF's cache and gradients against the unpatched model,
with a spy that fails a test whose tkit ops did not run (a patch that silently fell back)."""

from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tkit  # noqa: E402
from tkit.models import hf  # noqa: E402
from tkit.testing.compare import assert_close_to_reference  # noqa: E402
from tkit.testing.tensors import default_device  # noqa: E402

OPS = ("rms_norm", "silu_mul", "rope", "flash_attention", "decode_attention", "moe_combine")


def _config(**kw):
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               rope_theta=10000.0, attn_implementation="sdpa",
               initializer_range=0.15)  # not HF's 0.02: attention and RoPE must move the logits
    cfg.update(kw)
    return transformers.LlamaConfig(**cfg)


def _model(dtype=torch.float32, seed=0, **kw):
    """The same weights (drawn in float32) in any dtype."""
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(_config(**kw))
    with torch.no_grad():  # RMSNorm weights away from 1, so that a dropped weight shows
        for mod in m.modules():
            if isinstance(mod, transformers.models.llama.modeling_llama.LlamaRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return m.to(default_device(), dtype).eval()


@pytest.fixture(autouse=True)
def _restore():
    yield
    hf.remove_tkit_from_llama()


@contextlib.contextmanager
def _spy():
    """Counts the calls of tkit's public ops made inside."""
    calls = dict.fromkeys(OPS, 0)
    saved = {name: getattr(tkit, name) for name in OPS}

    def wrap(name):
        def f(*a, **k):
            calls[name] += 1
            return saved[name](*a, **k)
        return f

    for name in OPS:
        setattr(tkit, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(tkit, name, fn)


def _ids(batch=2, seq=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (batch, seq), generator=g).to(default_device())


def test_logits_float32():
    ids = _ids()
    base = _model()
    ref = base(ids).logits
    patched = hf.apply_tkit_to_llama(_model())
    with _spy() as calls, torch.no_grad():
        out = patched(ids).logits
    n = 2  # layers
    assert calls == dict(rms_norm=2 * n + 1, silu_mul=n, rope=n, flash_attention=n,
                         decode_attention=0, moe_combine=0)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_low_precision_under_the_reference_rule(dtype):
    # HF's model in float64 is the reference, HF's own in dtype the peer
    ids = _ids(seed=2)
    with torch.no_grad():
        ref = _model(torch.float64)(ids).logits
        peer = _model(dtype)(ids).logits
        out = hf.apply_tkit_to_llama(_model(dtype))(ids).logits
    assert_close_to_reference(out, ref, peer)


def _steps(model, ids, n):
    """The prompt's logits, then ``n`` greedy steps' over HF's DynamicCache."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        logits = [out.logits]
        for _ in range(n):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits)
    return logits


def test_decode_steps_over_the_cache():
    ids = _ids(batch=2, seq=7, seed=3)
    ref = _steps(_model(), ids, 5)
    patched = hf.apply_tkit_to_llama(_model())
    with _spy() as calls:
        out = _steps(patched, ids, 5)
    for i, (o, r) in enumerate(zip(out, ref)):
        torch.testing.assert_close(o, r, atol=2e-4, rtol=2e-4, msg=f"step {i}")
    # the prompt through flash attention, each step after it through decode attention
    assert calls["flash_attention"] == 2 and calls["decode_attention"] == 2 * 5
    assert calls["rope"] == 2 * 6
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(ids, **kw), _model().generate(ids, **kw))


def test_padding_goes_to_sdpa_and_matches():
    ids = _ids(batch=2, seq=9, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of the second sequence
    with torch.no_grad():
        ref = _model()(ids, attention_mask=mask).logits
        with _spy() as calls:
            out = hf.apply_tkit_to_llama(_model())(ids, attention_mask=mask).logits
    assert calls["flash_attention"] == 0 and calls["rms_norm"] > 0
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-4, rtol=2e-4)


def test_gradients_float32():
    # RMSNorm, SwiGLU and flash attention have backward passes; RoPE falls back to HF's own
    ids = _ids(seed=5)
    base, patched = _model(seed=6), hf.apply_tkit_to_llama(_model(seed=6))
    for m in (base, patched):
        m.train()
        m(ids, labels=ids).loss.backward()
    for (name, p), q in zip(base.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_class_patch_reaches_models_built_later():
    hf.apply_tkit_to_llama()
    ids = _ids(seed=7)
    m = _model()
    m.set_attn_implementation("tkit")
    with _spy() as calls, torch.no_grad():
        m(ids)
    assert calls["rms_norm"] == 5 and calls["silu_mul"] == 2 and calls["flash_attention"] == 2
    hf.remove_tkit_from_llama()
    m = _model()
    with _spy() as calls, torch.no_grad():
        m(ids)
    assert not any(calls.values())


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_llama.py"
    spec = importlib.util.spec_from_file_location("hf_llama_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_paged_step_from_its_graph():
    # the benchmark's decode case at its tiny size, step by step, each stage against HF (the
    # benchmark put the graph-replayed step 1.42 from HF on the GPU while the paged model's
    # own tests pass there): the paged prefill's logits, the decode step run eagerly, the
    # step replayed from its CUDA graph right after the capture, and replayed again after
    # the patched model (tkit ops, eager) prefilled and stepped over HF's cache, as the
    # benchmark's check does. Every figure goes into the message, so one run tells the stage.
    from tkit.models.paged import LlamaModel

    hb = _bench_module()
    dev_name = default_device()  # on the CPU the benchmark steps eagerly: the stages agree
    errs = {}

    def rel(out, ref):
        return ((out.float() - ref).abs().max() / ref.abs().max()).item()

    with torch.no_grad(), contextlib.ExitStack() as undo:
        undo.callback(hf.remove_tkit_from_llama)  # the benchmark's patches are class-wide
        base, patched = hb.models(hb.config(1, True), dev_name)
        ours = LlamaModel.from_hf(base)
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 97, (2, 9), generator=gen).to(dev_name)
        nxt = torch.randint(0, 97, (2, 1), generator=gen).to(dev_name)
        with hb.rope_for("hf"):
            full = base(torch.cat([ids, nxt], 1)).logits.float()
        ref, ref_prompt = full[:, -1:], full[:, -2]
        cache = ours.new_cache(num_blocks=2, page_size=16)
        errs["prefill"] = rel(ours.prefill(cache, [0, 1], ids.tolist()), ref_prompt)
        for s in range(2):
            cache.reserve(s, 10)
        dev = dict(positions=torch.full((2,), 9, device=dev_name),
                   slot_mapping=torch.tensor([cache.slot(s, 9) for s in range(2)],
                                             device=dev_name),
                   cache_seqlens=torch.full((2,), 10, dtype=torch.int32, device=dev_name),
                   block_table=cache.table([0, 1]).to(dev_name))
        eager = ours.decode(cache, nxt[:, 0].contiguous(), **dev)[:, None].float()
        errs["eager step"] = rel(eager, ref)
        step = hb.paged_step(ours, ids, nxt, dev_name)
        first = step().float()
        errs["graph step"] = rel(first, ref)
        errs["graph - eager"] = rel(first, eager)
        cache_hf = transformers.DynamicCache(config=patched.config)
        with hb.rope_for("hf+tkit"):
            patched(ids, past_key_values=cache_hf, use_cache=True, logits_to_keep=1)
            patched(nxt, past_key_values=cache_hf, use_cache=True)
        errs["graph step after tkit calls"] = rel(step(), ref)
    figures = ", ".join(f"{k} {v:.3g}" for k, v in errs.items())
    assert all(v < 2 ** -6 for v in errs.values()), figures


def test_benchmark_script_runs(tmp_path, monkeypatch):
    """benchmarks/hf_llama.py end to end on a tiny model: both providers timed, the patched
    model's logits checked against HF's, rows written."""
    import json

    mod = _bench_module()
    monkeypatch.setattr(mod, "OUT", tmp_path)
    monkeypatch.setattr(mod, "ROUNDS", 2)
    rows = mod.main(["--tiny", "--layers", "1"])
    assert {(r["case"], r["provider"]) for r in rows} == {
        ("prompt B2 S12", "hf"), ("prompt B2 S12", "hf+tkit"), ("decode B2 L9", "hf"),
        ("decode B2 L9", "hf+tkit"), ("decode B2 L9", mod.PAGED),
        ("Mixtral experts, prompt B2 S12", "hf"),
        ("Mixtral experts, prompt B2 S12", "hf+tkit experts")}
    assert all(r["logits_rel_diff"] < 2 ** -6 for r in rows)
    # a provider exactly equal to HF in bf16 ran HF's code (a baseline patched along with it)
    assert all(r["logits_rel_diff"] > 0 for r in rows if r["provider"] != "hf")
    assert len((tmp_path / "hf-llama.jsonl").read_text().splitlines()) == 7
    assert json.loads((tmp_path / "hf-llama.jsonl").read_text().splitlines()[0])["layers"] == 1


def _mixtral(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.15,
        attn_implementation="sdpa")
    return transformers.MixtralForCausalLM(cfg).to(default_device(), dtype).eval()


def test_mixtral_experts_through_tkit():
    ids = _ids(seed=9)
    with torch.no_grad():
        ref = _mixtral()(ids).logits
        model = hf.apply_tkit_experts(_mixtral())
        with _spy() as calls:
            spied = {"moe_combine": 0}
            real = tkit.moe_combine

            def combine(*a, **k):
                spied["moe_combine"] += 1
                return real(*a, **k)

            tkit.moe_combine = combine
            try:
                out = model(ids).logits
            finally:
                tkit.moe_combine = real
    assert spied["moe_combine"] == 2 and calls["silu_mul"] == 2
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


_SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.15, attn_implementation="sdpa")


@pytest.mark.parametrize("family, extra", [
    ("MistralConfig", dict(sliding_window=None)),
    ("MistralConfig", dict(sliding_window=8)),  # shorter than the prompt: SDPA's path
    ("Qwen2Config", dict()),
    ("Qwen3Config", dict(head_dim=16)),
    ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            head_dim=16)),
])
def test_other_families(family, extra):
    cfg = getattr(transformers, family)(**_SMALL, **extra)
    ids = _ids(seq=11, seed=12)

    def build():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).to(default_device()).eval()

    with torch.no_grad():
        ref = build()(ids).logits
        model = hf.apply_tkit(build())
        with _spy() as calls:
            out = model(ids).logits
    assert calls["rms_norm"] > 0 and calls["rope"] == 2
    windowed = extra.get("sliding_window") is not None
    assert calls["flash_attention"] == (0 if windowed else 2)
    assert calls["moe_combine"] == (2 if "Moe" in family else 0)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    hf.remove_tkit()
