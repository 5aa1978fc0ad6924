"""Hugging Face's Llama with and without tkit inside (``tkit.models.hf.apply_tkit_to_llama``): a
randomly initialised model with Llama-3-8B's sizes (a few layers, bf16), its prompt forward
and its decode steps over HF's DynamicCache, as a transformers user runs them.

    python benchmarks/hf_llama.py [--layers N]     # rows to $OUT/hf-llama.jsonl

Providers: ``hf`` (transformers' own: SDPA attention), ``hf+tkit`` (the same weights, the
model patched) and, for decode steps, ``tkit paged (graph)`` (``tkit.models.paged.LlamaModel``
from the same weights: its own prefill into pages of 16, then its decode step replayed from a
CUDA graph with the step's inputs copied in), interleaved in rounds with the order rotated.
Cases: prompts of 1 x 4096 and 8 x 512 tokens (the forward with ``logits_to_keep=1``, as
``generate`` runs it), and decode steps of batches of 1 and 32 sequences over 2048 cached
tokens (one new token a sequence; HF's cache cropped back after each step, the paged step
writing the same slot again, so that every step sees the same length). Each case first checks
every provider's logits against HF's (same bf16 weights; the max difference over the logits'
scale is printed and kept in the rows). Times are wall clock a call over back-to-back bursts
(``tkit.bench.latency.wall_per_call_ms``): what HF's Python costs a call is in them, as it is
in a user's loop. Then a Mixtral-8x7B-sized model (at most 2 layers): a prompt of 4096 tokens
with transformers' default experts against ``experts_implementation="tkit"``
(``tkit.models.hf.apply_tkit_experts``). ``--tiny`` runs tiny models on whatever device there
is (a smoke test of this script; its times mean nothing).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tkit.bench.latency import wall_per_call_ms  # noqa: E402
from tkit.bench.runner import environment  # noqa: E402
from tkit.models import LLAMA3_8B, hf  # noqa: E402
from tkit.models.paged import LlamaModel  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))
PROMPTS = ((1, 4096), (8, 512))
DECODES = ((1, 2048), (32, 2048))
ROUNDS = 4
#: the third decode provider: tkit.models.paged's step over its own pages
PAGED = "tkit paged (graph)"


def config(layers: int, tiny: bool):
    import transformers

    if tiny:
        dims = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256)
    else:
        c = LLAMA3_8B
        dims = dict(vocab_size=128256, hidden_size=c["hidden"], intermediate_size=c["mlp"],
                    num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                    max_position_embeddings=8192, rope_theta=500000.0)
    return transformers.LlamaConfig(num_hidden_layers=layers, attn_implementation="sdpa",
                                    **dims)


def models(cfg, device):
    """HF's model and a patched one with the same weights."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        base = _bf16(transformers.LlamaForCausalLM, cfg)
        patched = _bf16(transformers.LlamaForCausalLM, cfg)
    patched.load_state_dict(base.state_dict())
    return base, hf.apply_tkit_to_llama(patched)


def _bf16(cls, cfg):
    """A bf16 model as ``from_pretrained(..., dtype=torch.bfloat16)`` makes it: RoPE's
    frequencies stay float32 (``model.to(torch.bfloat16)`` would round them to bf16 too, and
    HF's angles at position 2048 then miss by up to ~4 radians), and a config of its own (a
    model shares the config object it is built from, and setting the patched model's
    attention or experts implementation would set the baseline's too)."""
    return cls._from_config(copy.deepcopy(cfg), dtype=torch.bfloat16).eval()


@contextlib.contextmanager
def rope_for(provider: str):
    """RoPE is a module-level function in transformers' Llama: HF's for ``hf``, tkit's for
    ``hf+tkit`` (the patched model's other ops are its own modules)."""
    if provider == "hf":
        hf.remove_tkit_from_llama()
    try:
        yield
    finally:
        hf.apply_tkit_to_llama(rope=True, rms_norm=False, swiglu=False, attention=False)


def check(name, fns):
    """The logits of each provider against HF's own (same weights)."""
    with rope_for("hf"):
        ref = fns["hf"]().float()
    rel = {}
    for p, fn in fns.items():
        if p != "hf":
            with rope_for(p):
                out = fn().float()
            rel[p] = ((out - ref).abs().max() / ref.abs().max()).item()
            print(f"{name}: logits max |{p} - hf| / max |hf| = {rel[p]:.3g}")
    return rel


def time_case(name, fns, rows, env, extra, calls, rel):
    per = {p: [] for p in fns}
    names = list(fns)
    for r in range(ROUNDS):
        for p in names[r % len(names):] + names[:r % len(names)]:
            with rope_for(p):
                per[p].append(wall_per_call_ms(fns[p], calls, rounds=3, warmup=2)[0])
    got = {p: sorted(v)[len(v) // 2] for p, v in per.items()}
    for p, ms in got.items():
        rows.append({"case": name, "provider": p, "median_ms": ms,
                     "logits_rel_diff": rel.get(p, 0.0), **extra, **env})
    print(f"{name}: " + ", ".join(f"{p} {ms:.3f} ms ({got['hf'] / ms:.2f}x)"
                                  for p, ms in got.items()) + " a call")


def prompt_cases(base, patched, rows, env, tiny, device):
    for b, s in ((2, 12),) if tiny else PROMPTS:
        ids = torch.randint(0, base.config.vocab_size, (b, s), device=device)

        def fwd(m, ids=ids):
            return m(ids, logits_to_keep=1, use_cache=False).logits

        name = f"prompt B{b} S{s}"
        fns = {"hf": lambda: fwd(base), "hf+tkit": lambda: fwd(patched)}
        time_case(name, fns, rows, env, {"batch": b, "tokens": s}, 1 if tiny else 5,
                  check(name, fns))


def paged_step(ours, ids, nxt, device):
    """``tkit.models.paged``'s decode step over the same prompts (prefilled by it), replayed
    from a CUDA graph where there is CUDA; the same step each call (same slots)."""
    b, n = ids.shape
    cache = ours.new_cache(num_blocks=b * -(-(n + 1) // 16), page_size=16)
    ours.prefill(cache, list(range(b)), ids.tolist())
    host = cache.step_inputs(list(range(b)), [n] * b)
    tok = nxt[:, 0].contiguous()
    if torch.cuda.is_available():
        step = ours.capture_step(cache, tok, host)
        return lambda: step(tok, host)[:, None]
    dev = {k: v.to(device) for k, v in host.items()}
    return lambda: ours.decode(cache, tok, **dev)[:, None]


def decode_cases(base, patched, ours, rows, env, tiny, device):
    import transformers

    for b, n in ((2, 9),) if tiny else DECODES:
        ids = torch.randint(0, base.config.vocab_size, (b, n), device=device)
        nxt = torch.randint(0, base.config.vocab_size, (b, 1), device=device)
        caches = {}
        for p, m in (("hf", base), ("hf+tkit", patched)):
            with rope_for(p):
                caches[p] = transformers.DynamicCache(config=m.config)
                m(ids, past_key_values=caches[p], use_cache=True, logits_to_keep=1)

        def step(p, m, nxt=nxt, caches=caches):
            out = m(nxt, past_key_values=caches[p], use_cache=True).logits
            caches[p].crop(-1)  # back to n cached tokens
            return out

        name = f"decode B{b} L{n}"
        fns = {"hf": lambda: step("hf", base), "hf+tkit": lambda: step("hf+tkit", patched),
               PAGED: paged_step(ours, ids, nxt, device)}
        time_case(name, fns, rows, env, {"batch": b, "cached": n}, 2 if tiny else 20,
                  check(name, fns))


def moe_cases(layers, rows, env, tiny, device):
    """A Mixtral-8x7B-sized model (random weights, ``layers`` layers): its prompt forward with
    transformers' default experts (``grouped_mm``: torch._grouped_mm, or its eager loop where
    that cannot run) against the same weights with ``experts_implementation="tkit"``."""
    import transformers

    if tiny:
        dims = dict(vocab_size=97, hidden_size=64, intermediate_size=48, num_local_experts=4,
                    num_attention_heads=4, num_key_value_heads=2)
    else:
        dims = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_local_experts=8, num_attention_heads=32, num_key_value_heads=8)
    cfg = transformers.MixtralConfig(num_hidden_layers=layers, num_experts_per_tok=2,
                                     attn_implementation="sdpa", **dims)
    torch.manual_seed(0)
    with torch.device(device):
        base = _bf16(transformers.MixtralForCausalLM, cfg)
        ours = _bf16(transformers.MixtralForCausalLM, cfg)
    ours.load_state_dict(base.state_dict())
    hf.apply_tkit_experts(ours)
    for b, s in ((2, 12),) if tiny else ((1, 4096),):
        ids = torch.randint(0, cfg.vocab_size, (b, s), device=device)

        def fwd(m, ids=ids):
            return m(ids, logits_to_keep=1, use_cache=False).logits

        name = f"Mixtral experts, prompt B{b} S{s}"
        fns = {"hf": lambda: fwd(base), "hf+tkit experts": lambda: fwd(ours)}
        time_case(name, fns, rows, {**env, "model": "Mixtral-8x7B sizes, random"},
                  {"batch": b, "tokens": s,
                   "hf_experts": base.config._experts_implementation}, 1 if tiny else 5,
                  check(name, fns))


def main(argv):
    import argparse

    ap = argparse.ArgumentParser(description="Hugging Face's Llama with and without tkit "
                                 "inside; rows to $OUT/hf-llama.jsonl")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny models on any device: a smoke test, its times mean nothing")
    args = ap.parse_args(argv)
    tiny, layers = args.tiny, args.layers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    cfg = config(layers, tiny)
    base, patched = models(cfg, device)
    rows = []
    extra = {"layers": layers, "model": "tiny" if tiny else "Llama-3-8B sizes, random"}
    env = {**env, **extra}
    with torch.no_grad():
        prompt_cases(base, patched, rows, env, tiny, device)
        ours = LlamaModel.from_hf(base)
        decode_cases(base, patched, ours, rows, env, tiny, device)
        hf.remove_tkit_from_llama()
        del base, patched, ours
        moe_cases(min(layers, 2), rows, env, tiny, device)
    hf.remove_tkit_from_llama()  # rope_for put tkit's RoPE back after each round
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "hf-llama.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
