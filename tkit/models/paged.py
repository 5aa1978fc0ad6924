"""A Llama-family model from tkit ops over a paged KV cache: :class:`LlamaModel` and
:class:`PagedKVCache`.

Prompts of different lengths are prefilled together as one packed batch (RoPE fused with the
cache write, ``tkit.flash_attention_varlen`` over each prompt's own tokens); the batch then
decodes one token a sequence a step (:func:`tkit.models.llama.llama_decode_layer` in every
layer over the pages, ``tkit.sample`` to choose), optionally replayed from a CUDA graph
captured once for the batch. Positions, slots, lengths and the block table are computed on
the host a step and copied in; the kernels read them on the device, never the host.

Weights come from a Hugging Face model of the Llama family (:meth:`LlamaModel.from_hf`:
Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE): q, k, v and gate, up fused into one weight
each (one GEMM each; Qwen2's q, k, v biases fused likewise, in the GEMM's epilogue), Qwen3's
per-head RMSNorm of q and k, sliding-window layers (Mistral's, Qwen2's ``layer_types``),
sparse MoE MLPs (the router's GEMM and ``tkit.moe``), RoPE's table from the config's
``rope_parameters`` (or ``rope_theta`` / ``rope_scaling``) by ``tkit.rope_cache``.

Beyond the plain step: an fp8 cache (``kv_dtype``), sequences ended at an eos token,
parallel samples of a prompt sharing its pages (:meth:`PagedKVCache.fork`), and speculative
decoding with a draft model (:meth:`LlamaModel.generate_speculative`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import tkit
from tkit.models.llama import layer_tail, linear, llama_decode_layer, qkv_heads, window_size

#: ``config.model_type`` values :meth:`LlamaModel.from_hf` takes
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


@dataclass
class LayerWeights:
    """One layer's weights in nn.Linear's (out, in) layout: RMSNorm, [q; k; v], o, RMSNorm,
    [gate; up], down; and the family's extras: the [q; k; v] and o biases (Qwen2: q, k, v),
    q's and k's per-head RMSNorm weights (Qwen3), the sliding window (keys back a query
    sees besides itself; -1: all), a sparse MLP instead of [gate; up] and down (Mixtral,
    Qwen3-MoE: ``moe`` = (router (E, H), experts' [gate; up] (E, 2I, H), experts' down
    (E, H, I), top_k, renormalize); ``w_gu`` and ``w_down`` None)."""

    w_in: torch.Tensor
    w_qkv: torch.Tensor
    w_o: torch.Tensor
    w_post: torch.Tensor
    w_gu: torch.Tensor | None
    w_down: torch.Tensor | None
    b_qkv: torch.Tensor | None = None
    b_o: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = -1
    moe: tuple | None = None

    def as_args(self) -> tuple:
        return (self.w_in, self.w_qkv, self.w_o, self.w_post, self.w_gu, self.w_down)

    def extras(self) -> dict:
        """:func:`tkit.models.llama.llama_decode_layer`'s keywords for the extras."""
        return dict(qkv_bias=self.b_qkv, o_bias=self.b_o, q_norm=self.q_norm,
                    k_norm=self.k_norm, window=self.window, moe=self.moe)


def _sparse_mlp(m, cfg) -> tuple | None:
    """A transformers sparse MoE block's weights as :func:`tkit.models.llama.layer_tail`'s
    ``moe`` (router, experts' [gate; up] and down, top_k, renormalize), or None for a dense
    MLP. Experts laid out otherwise (biases, transposed or separate gate and up, a custom
    gate) are refused: ``tkit.models.hf.apply_tkit_experts`` serves those models in HF."""
    gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
    if experts is None or not hasattr(experts, "gate_up_proj"):
        return None
    if (not getattr(experts, "has_gate", True) or getattr(experts, "has_bias", False)
            or getattr(experts, "is_transposed", False)
            or not getattr(experts, "is_concatenated", True)
            or getattr(gate, "weight", None) is None or getattr(gate, "bias", None) is not None):
        raise NotImplementedError("experts other than [gate; up] (E, 2I, H) and down (E, H, I) "
                                  "with a bias-free linear router")
    top_k = getattr(gate, "top_k", None) or cfg.num_experts_per_tok
    renormalize = bool(getattr(gate, "norm_topk_prob", getattr(cfg, "norm_topk_prob", True)))
    return (gate.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(),
            int(top_k), renormalize)


class PagedKVCache:
    """K and V pages for every layer, (num_blocks, page_size, kv_heads, head_dim) each, and
    the pages each sequence holds (allocated as it grows, from a free list; a page may be held
    by several sequences after :meth:`fork`, and returns to the free list when the last one
    releases it). A float8_e4m3fn cache keeps a float32 scale per token and head beside each
    page (``k_scale``, ``v_scale``: (num_blocks, page_size, kv_heads) a layer), written with
    the values by ``tkit.rope_append_kv`` and read by ``tkit.decode_attention``; other caches
    have None."""

    def __init__(self, layers: int, num_blocks: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device):
        if page_size < 1 or page_size & (page_size - 1) or page_size > 256:
            raise ValueError(f"page_size must be a power of 2 from 1 to 256, got {page_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        shape = (num_blocks, page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        fp8 = dtype == torch.float8_e4m3fn
        self.k_scale = [torch.ones(shape[:3], device=device) if fp8 else None
                        for _ in range(layers)]
        self.v_scale = [torch.ones(shape[:3], device=device) if fp8 else None
                        for _ in range(layers)]
        self.page_size = page_size
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks  # sequences holding each page
        self.blocks: dict[int, list[int]] = {}

    def _take(self, n: int, seq: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"the cache is full: sequence {seq} needs {n} more pages, "
                               f"{len(self.free)} are free")
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def reserve(self, seq: int, length: int) -> None:
        """Pages for the first ``length`` positions of sequence ``seq``."""
        pages = self.blocks.setdefault(seq, [])
        pages += self._take(max(0, -(-length // self.page_size) - len(pages)), seq)

    def release(self, seq: int) -> None:
        for p in reversed(self.blocks.pop(seq, [])):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def fork(self, src: int, dst: int, length: int) -> None:
        """Sequence ``dst`` (new) starts as ``src``'s first ``length`` positions: the full
        pages shared (never written again: a sequence only appends), a partly filled last
        page copied into a page of its own (its K, V and scales, every layer). Parallel
        samples of one prompt hold its prefill once."""
        if dst in self.blocks:
            raise ValueError(f"sequence {dst} already holds pages")
        full, part = divmod(length, self.page_size)
        src_pages = self.blocks[src]
        if len(src_pages) < full + (part > 0):
            raise ValueError(f"sequence {src} holds {len(src_pages)} pages, fewer than "
                             f"{length} positions need")
        shared = src_pages[:full]
        for p in shared:
            self.refs[p] += 1
        self.blocks[dst] = list(shared)
        if part:
            (new,) = self._take(1, dst)
            old = src_pages[full]
            for t in (*self.k, *self.v, *self.k_scale, *self.v_scale):
                if t is not None:
                    t[new].copy_(t[old])
            self.blocks[dst].append(new)

    def slot(self, seq: int, pos: int) -> int:
        """Where position ``pos`` of ``seq`` lives: block * page_size + offset."""
        return self.blocks[seq][pos // self.page_size] * self.page_size + pos % self.page_size

    def step_inputs(self, seqs: list[int], lens: list[int], tokens: int = 1,
                    width: int | None = None) -> dict:
        """The host tensors of a decode step (:meth:`LlamaModel.decode`'s keywords) in which
        each sequence ``seqs[i]``, holding ``lens[i]`` positions, takes ``tokens`` new ones:
        pages reserved for them; positions and slot_mapping (batch, tokens), cache_seqlens
        (batch,) int32, block_table (batch, ``width``)."""
        for s, n in zip(seqs, lens):
            self.reserve(s, n + tokens)
        positions = torch.tensor(lens)[:, None] + torch.arange(tokens)
        return dict(positions=positions,
                    slot_mapping=torch.tensor([[self.slot(s, int(p)) for p in row]
                                               for s, row in zip(seqs, positions)]),
                    cache_seqlens=(positions[:, -1] + 1).to(torch.int32),
                    block_table=self.table(seqs, width))

    def table(self, seqs: list[int], width: int | None = None) -> torch.Tensor:
        """(len(seqs), width) int32 block table on the host; entries past a sequence's pages
        are 0 (a valid block, never read: lengths bound every read)."""
        width = width or max(len(self.blocks[s]) for s in seqs)
        t = torch.zeros((len(seqs), width), dtype=torch.int32)
        for i, s in enumerate(seqs):
            t[i, :len(self.blocks[s])] = torch.tensor(self.blocks[s], dtype=torch.int32)
        return t


class LlamaModel:
    """A Llama-family decoder from tkit ops: embeddings, decoder layers, the final RMSNorm and
    the LM head.

    ``heads``, ``kv_heads``: attention heads; ``eps``: RMSNorm's; ``cos_sin``:
    ``tkit.rope_cache``'s table (neox rotation of the whole head) over the positions the model
    may see."""

    def __init__(self, embed, layers: list[LayerWeights], norm, lm_head, *, heads: int,
                 kv_heads: int, eps: float, cos_sin: torch.Tensor):
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.heads, self.kv_heads, self.eps, self.cos_sin = heads, kv_heads, eps, cos_sin
        self.head_dim = layers[0].w_qkv.shape[0] // (heads + 2 * kv_heads)

    @classmethod
    def from_hf(cls, model, max_position: int | None = None) -> LlamaModel:
        """The weights of a transformers ``...ForCausalLM`` of :data:`FAMILIES` (shared,
        except the fused [q; k; v], [gate; up] and q, k, v biases, which are new tensors)."""
        cfg = model.config
        kind = getattr(cfg, "model_type", None)
        if kind not in FAMILIES:
            raise NotImplementedError(f"model_type {kind!r}: tkit's paged model takes "
                                      f"{', '.join(FAMILIES)}")
        if cfg.hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} (SwiGLU's silu only)")
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        types = getattr(cfg, "layer_types", None)
        sliding = getattr(cfg, "sliding_window", None)
        layers = []
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            moe = _sparse_mlp(m, cfg)
            if moe is None and any(getattr(p, "bias", None) is not None
                                   for p in (m.gate_proj, m.up_proj, m.down_proj)):
                raise NotImplementedError("biases in the MLP's projections")
            biases = [getattr(p, "bias", None) for p in (a.q_proj, a.k_proj, a.v_proj)]
            if any(b is None for b in biases) and any(b is not None for b in biases):
                raise NotImplementedError("a bias on some of q, k, v and not the others")
            # a sliding layer: every layer without layer_types (Mistral), else those so typed
            slides = sliding and (types is None or types[i] == "sliding_attention")
            norms = [getattr(getattr(a, n, None), "weight", None) for n in ("q_norm", "k_norm")]
            layers.append(LayerWeights(
                layer.input_layernorm.weight.detach(),
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                a.o_proj.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                None if moe else torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                None if moe else m.down_proj.weight.detach(),
                b_qkv=None if biases[0] is None else torch.cat(biases).detach(),
                b_o=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                q_norm=None if norms[0] is None else norms[0].detach(),
                k_norm=None if norms[1] is None else norms[1].detach(),
                window=int(sliding) - 1 if slides else -1, moe=moe))
        params = dict(getattr(cfg, "rope_parameters", None) or {})
        base = params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if not params:
            params = dict(getattr(cfg, "rope_scaling", None) or {})
        kind = params.get("rope_type", params.get("type", "default"))
        n = max_position or cfg.max_position_embeddings
        device = layers[0].w_qkv.device
        cos_sin = tkit.rope_cache(n, d, base, None if kind == "default" else params,
                                  device=device)
        return cls(model.model.embed_tokens.weight.detach(), layers,
                   model.model.norm.weight.detach(), model.lm_head.weight.detach(),
                   heads=heads, kv_heads=kv_heads, eps=cfg.rms_norm_eps, cos_sin=cos_sin)

    # ---- the two kinds of step ----------------------------------------------------------------
    def new_cache(self, num_blocks: int, page_size: int = 16,
                  kv_dtype: torch.dtype | None = None) -> PagedKVCache:
        """A cache of ``num_blocks`` pages a layer in the model's dtype, or ``kv_dtype``
        float8_e4m3fn (half the bytes a decode step reads: per-token-head scales)."""
        if kv_dtype not in (None, self.embed.dtype, torch.float8_e4m3fn):
            raise ValueError(f"kv_dtype must be the model's {self.embed.dtype} or "
                             f"torch.float8_e4m3fn, got {kv_dtype}")
        return PagedKVCache(len(self.layers), num_blocks, page_size, self.kv_heads,
                            self.head_dim, kv_dtype or self.embed.dtype, self.embed.device)

    def _logits(self, x):
        return linear(tkit.rms_norm(x, self.norm, self.eps), self.lm_head)

    def prefill(self, cache: PagedKVCache, seqs: list[int], prompts: list[list[int]]):
        """Run ``prompts`` (token ids; sequence ``seqs[i]`` starts empty) through the model
        as one packed batch, filling their pages; returns the logits of each prompt's last
        token, (len(prompts), vocab)."""
        dev = self.embed.device
        lens = [len(p) for p in prompts]
        if not lens or min(lens) < 1:
            raise ValueError("prompts must be non-empty lists of token ids")
        slots, positions = [], []
        for s, n in zip(seqs, lens):  # a sequence's slots from its pages, on the host
            cache.reserve(s, n)
            pos = torch.arange(n)
            pages = torch.tensor(cache.blocks[s])
            slots.append(pages[pos // cache.page_size] * cache.page_size
                         + pos % cache.page_size)
            positions.append(pos)
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.cat(positions).to(dev)
        slots = torch.cat(slots).to(dev)
        cu_dev = cu.to(dev)
        h, d, t = self.heads, self.head_dim, tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        for i, lw in enumerate(self.layers):
            q, k, v = qkv_heads(x, lw.w_in, lw.w_qkv, heads=h, kv_heads=self.kv_heads,
                                eps=self.eps, qkv_bias=lw.b_qkv, q_norm=lw.q_norm,
                                k_norm=lw.k_norm)
            tkit.rope_append_kv(q, k, v, positions, self.cos_sin, cache.k[i], cache.v[i], slots,
                                k_scale=cache.k_scale[i], v_scale=cache.v_scale[i])
            o = tkit.flash_attention_varlen(q, k, v, cu_dev, cu_dev, max(lens), max(lens),
                                            causal=True, window_size=window_size(lw.window))
            x = layer_tail(o.view(t, h * d), x, lw.w_o, lw.w_post, lw.w_gu, lw.w_down,
                           self.eps, lw.b_o, lw.moe)
        return self._logits(x[cu[1:].long().to(dev) - 1])

    def decode(self, cache: PagedKVCache, tokens, positions, slot_mapping, cache_seqlens,
               block_table):
        """One step of the batch: ``tokens`` (batch,) at ``positions`` (batch,), written at
        ``slot_mapping``, each attending to its first ``cache_seqlens`` positions through
        ``block_table``; returns (batch, vocab) logits. Or T tokens a sequence: ``tokens``,
        ``positions`` and ``slot_mapping`` (batch, T) (the sequence's last T positions,
        T <= 16), logits (batch, T, vocab). All inputs on the device."""
        x = F.embedding(tokens.reshape(-1), self.embed)
        positions, slot_mapping = positions.reshape(-1), slot_mapping.reshape(-1)
        for i, lw in enumerate(self.layers):
            x = llama_decode_layer(x, *lw.as_args(), cache.k[i], cache.v[i], self.cos_sin,
                                   positions=positions, slot_mapping=slot_mapping,
                                   cache_seqlens=cache_seqlens, block_table=block_table,
                                   heads=self.heads, kv_heads=self.kv_heads, eps=self.eps,
                                   k_scale=cache.k_scale[i], v_scale=cache.v_scale[i],
                                   **lw.extras())
        return self._logits(x).view(*tokens.shape, -1)

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, page_size: int = 16,
                 kv_dtype: torch.dtype | None = None,
                 num_blocks: int | None = None, temperature: float = 0.0, top_k=None,
                 top_p=None, seed: int | None = None, cuda_graph: bool = False,
                 eos_token_id: int | None = None, num_return_sequences: int = 1):
        """Up to ``max_new_tokens`` tokens for each prompt: the prompts prefilled together,
        then decode steps of the whole batch. ``temperature`` 0 is greedy; with
        ``cuda_graph`` (CUDA only) the decode step is captured once for this batch and
        replayed; ``kv_dtype`` as :meth:`new_cache`'s. A sequence that emits
        ``eos_token_id`` ends there (its list ends with it; the batch steps on, unchanged in
        shape, until every sequence has ended or the tokens run out).
        ``num_return_sequences`` samples of each prompt decode together from one prefill (the
        prompt's full pages shared: :meth:`PagedKVCache.fork`). Returns the new tokens of each
        sequence, prompt-major (as transformers' generate orders them)."""
        n = num_return_sequences
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_return_sequences must be a positive int, got {n!r}")
        b = len(prompts) * n
        longest = max(len(p) for p in prompts) + max_new_tokens
        width = -(-longest // page_size)
        cache = self.new_cache(num_blocks or b * width, page_size, kv_dtype)
        seqs = list(range(b))
        dev = self.embed.device
        opts = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None

        def choose(logits):
            s = None if gen is None else torch.randint(0, 2**62, (b,), generator=gen).to(dev)
            return tkit.sample(logits, seed=s, **opts)

        out = [[] for _ in range(b)]
        done = [False] * b

        def emit(tokens) -> bool:
            """Append each running sequence's token; whether every sequence has ended."""
            for i, t in enumerate(tokens.tolist()):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t == eos_token_id
            return all(done)

        first = self.prefill(cache, seqs[::n], prompts)  # sample 0 of each prompt
        for r in seqs:
            if r % n:
                cache.fork(r - r % n, r, len(prompts[r // n]))
        nxt = choose(first.repeat_interleave(n, 0))
        lens = [len(prompts[r // n]) for r in seqs]
        step = None
        for _ in range(max_new_tokens - 1):
            if emit(nxt):
                return out
            host = cache.step_inputs(seqs, lens, width=width)  # the next position each
            if cuda_graph:
                step = step or self.capture_step(cache, nxt, host)
                logits = step(nxt, host)
            else:
                logits = self.decode(cache, nxt, **{k: v.to(dev) for k, v in host.items()})
            lens = [n + 1 for n in lens]
            nxt = choose(logits)
        emit(nxt)
        return out

    def generate_speculative(self, draft: LlamaModel, prompts: list[list[int]],
                             max_new_tokens: int, *, num_draft: int = 4, page_size: int = 16,
                             kv_dtype: torch.dtype | None = None, temperature: float = 0.0,
                             seed: int | None = None, eos_token_id: int | None = None,
                             stats: dict | None = None):
        """Up to ``max_new_tokens`` tokens for each prompt by speculative decoding: a round
        runs ``draft`` (a smaller model of the same vocabulary, over its own cache) for
        ``num_draft`` tokens a sequence, then this model over all of them in one step (the
        decode attention's queries are the sequence's last ``num_draft`` + 1 positions), and
        ``tkit.speculative_accept`` keeps the longest accepted prefix and one token of this
        model's: the tokens follow this model's distribution (with ``temperature`` 0, its
        greedy tokens exactly; otherwise softmax(logits / temperature), seeded by ``seed``).
        A round makes from 1 to ``num_draft`` + 1 tokens a sequence. Rejected tokens stay in
        the caches past the sequence's length, where the next round writes over them.
        ``eos_token_id`` and ``kv_dtype`` as in :meth:`generate`. ``stats``, a dict, gets the
        rounds run and the draft tokens proposed and accepted (over the sequences still
        running). Returns the new tokens of each prompt."""
        k = num_draft
        if not 1 <= k <= 15:
            raise ValueError(f"num_draft must be from 1 to 15 (16 query tokens a sequence), "
                             f"got {k}")
        if draft.lm_head.shape[0] != self.lm_head.shape[0]:
            raise ValueError(f"draft's vocabulary ({draft.lm_head.shape[0]}) must be this "
                             f"model's ({self.lm_head.shape[0]})")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        b, dev = len(prompts), self.embed.device
        width = -(-(max(len(p) for p in prompts) + max_new_tokens + k + 1) // page_size)
        caches = (self.new_cache(b * width, page_size, kv_dtype),
                  draft.new_cache(b * width, page_size, kv_dtype))
        seqs = list(range(b))
        gen = torch.Generator().manual_seed(seed) if seed is not None else None

        def probs(logits):  # float32 rows: one-hot at the argmax for greedy decoding
            if temperature == 0:
                return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
            return torch.softmax(logits.float() / temperature, -1)

        def seeds():
            return None if gen is None else torch.randint(0, 2**62, (b,), generator=gen).to(dev)

        def pick(logits):
            if temperature == 0:
                return logits.argmax(-1)
            return tkit.sample(logits, temperature=temperature, seed=seeds())

        def step(model, cache, tokens, lens):  # tokens (b, t) at positions lens..lens + t - 1
            host = cache.step_inputs(seqs, lens, tokens.shape[1], width)
            return model.decode(cache, tokens, **{k: v.to(dev) for k, v in host.items()})

        out, done = [[] for _ in range(b)], [False] * b

        def emit(tokens):
            for i, row in enumerate(tokens):
                for t in row:
                    if done[i]:
                        break
                    out[i].append(t)
                    done[i] = t == eos_token_id or len(out[i]) == max_new_tokens

        last = pick(self.prefill(caches[0], seqs, prompts))
        draft.prefill(caches[1], seqs, prompts)
        lens = [len(p) for p in prompts]
        emit([[t] for t in last.tolist()])
        while not all(done):
            tok, drafted, dprobs = last, [], []
            for i in range(k + 1):  # the last step only writes d_k into the draft's cache
                logits = step(draft, caches[1], tok[:, None], [n + i for n in lens])[:, 0]
                if i < k:
                    tok = pick(logits)
                    drafted.append(tok)
                    dprobs.append(probs(logits))
            drafted = torch.stack(drafted, 1)
            logits = step(self, caches[0], torch.cat([last[:, None], drafted], 1), lens)
            ids, n = tkit.speculative_accept(drafted, torch.stack(dprobs, 1), probs(logits),
                                             seed=seeds())
            n = n.tolist()
            if stats is not None:
                running = [i for i in seqs if not done[i]]
                stats["rounds"] = stats.get("rounds", 0) + 1
                stats["drafted"] = stats.get("drafted", 0) + k * len(running)
                stats["accepted"] = stats.get("accepted", 0) + sum(n[i] for i in running)
            emit([row[:a + 1] for row, a in zip(ids.tolist(), n)])
            last = ids[torch.arange(b, device=ids.device), torch.tensor(n, device=ids.device)]
            lens = [m + a + 1 for m, a in zip(lens, n)]
        return out

    def capture_step(self, cache, tokens, host) -> CapturedStep:
        """The decode step captured in a CUDA graph over static input buffers; returns a
        :class:`CapturedStep`, ``step(tokens, host) -> logits``, that copies the inputs in and
        replays."""
        static = {k: v.to(tokens.device) for k, v in host.items()}
        static_tokens = tokens.clone()
        self.decode(cache, static_tokens, **static)  # compiles and plans outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.decode(cache, static_tokens, **static)
        return CapturedStep(self, cache, graph, static_tokens, static, logits)


class CapturedStep:
    """A decode step in a CUDA graph (:meth:`LlamaModel.capture_step`). It holds the model and
    the cache as well as the graph: the graph reads their memory by address, and a cache freed
    while its graph lives hands its pages to the next allocation, which the replay would then
    read as K and V. ``logits`` is the graph's output buffer, overwritten by each replay."""

    def __init__(self, model, cache, graph, tokens, inputs, logits):
        self.model, self.cache, self.graph = model, cache, graph
        self._tokens, self._inputs, self.logits = tokens, inputs, logits

    def __call__(self, tokens, host) -> torch.Tensor:
        self._tokens.copy_(tokens)
        for k, v in host.items():
            self._inputs[k].copy_(v, non_blocking=True)
        self.graph.replay()
        return self.logits
