"""Hugging Face transformers' decoder models with tkit ops inside: :func:`apply_tkit` (Llama,
Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE), :func:`apply_tkit_to_llama`, and the experts of any
model that uses transformers' experts interface (:func:`apply_tkit_experts`).

What is swapped, each with HF's own code as the fallback where a case is not covered:

* the family's RMSNorm -> ``tkit.rms_norm`` (float32 statistics, one rounding of the output
  where HF rounds the normalized rows before the weight multiply);
* the family's dense MLP ``act(gate(x)) * up(x)`` -> ``tkit.silu_mul`` (SiLU models only: the
  projections stay ``nn.Linear``s, so biases, quantized or adapter-wrapped layers keep
  working);
* the family's ``apply_rotary_pos_emb`` -> ``tkit.rope`` on a table built from HF's own cos and
  sin (so every ``rope_scaling`` of the config is honoured as HF computes it), without
  autograd: a call that needs gradients takes HF's function;
* attention -> the ``"tkit"`` entry of transformers' ``AttentionInterface``:
  ``tkit.flash_attention`` for a prompt (causal, GQA without repeating K and V) and
  ``tkit.decode_attention`` for up to 16 new tokens over the cache; a call with an explicit mask
  (padding, packed sequences), dropout while training, a position bias, a softcap or a sliding
  window shorter than the keys goes to transformers' SDPA path. Its mask function is SDPA's,
  which gives no mask for causal attention over unpadded sequences;
* mixture-of-experts blocks (Mixtral, Qwen3-MoE, ...) -> the ``"tkit"`` entry of the experts
  interface (:func:`tkit_experts_forward`).

``transformers`` is imported when a function here is called, not when tkit is.
"""

from __future__ import annotations

import functools
import types

import torch

import tkit

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: the most new tokens a call sends to decode attention (its limit); more take flash attention
DECODE_MAX_Q = 16


#: model_type -> (transformers' modeling module, its RMSNorm class, its dense MLP class or None)
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "LlamaMLP"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm", "MistralMLP"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm", "Qwen2MLP"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "Qwen3MLP"),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralRMSNorm", None),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeRMSNorm",
                  "Qwen3MoeMLP"),
}


def _family(name: str):
    """(modeling module, RMSNorm class, MLP class or None) of a model type."""
    import importlib

    if name not in FAMILIES:
        raise ValueError(f"model type {name!r} is not one tkit patches; supported: "
                         f"{sorted(FAMILIES)}")
    path, norm, mlp = FAMILIES[name]
    m = importlib.import_module(path)
    return m, getattr(m, norm), getattr(m, mlp) if mlp else None


def _modeling():
    return _family("llama")[0]


def _kernels_run_on(x: torch.Tensor) -> bool:
    """tkit's kernels take CUDA tensors, or CPU tensors under Triton's interpreter."""
    from tkit import _env

    return x.is_cuda or (_env.INTERPRET and x.device.type == "cpu")


# ---- RMSNorm and the MLP ----------------------------------------------------------------------
# The patched forwards fall back to ``self._tkit_hf_forward``: HF's forward, kept on the class
# (a class patch: bound on access) or on the instance (an instance patch: already bound).
def _rms_norm_forward(self, hidden_states):
    if not _kernels_run_on(hidden_states) or hidden_states.dtype not in _FLOATS:
        return self._tkit_hf_forward(hidden_states)
    return tkit.rms_norm(hidden_states, self.weight, float(self.variance_epsilon))


def _mlp_forward(self, x):
    if not _kernels_run_on(x) or self.config.hidden_act not in _SILU:
        return self._tkit_hf_forward(x)
    return self.down_proj(tkit.silu_mul(self.gate_proj(x), self.up_proj(x)))


_SILU = ("silu", "swish")


def _patch(obj, forward) -> None:
    """Give ``obj`` (a class, or an instance of an unpatched class) tkit's ``forward``."""
    if "_tkit_hf_forward" in vars(obj) or "_tkit_hf_forward" in vars(type(obj)):
        return  # already patched, itself or through its class
    if isinstance(obj, type):
        obj._tkit_hf_forward, obj.forward = obj.forward, forward
    else:
        obj._tkit_hf_forward, obj.forward = obj.forward, types.MethodType(forward, obj)


# ---- RoPE ---------------------------------------------------------------------------------------
def _rope_table(cos, sin, batch: int):
    """(table, positions) for ``tkit.rope`` from HF's cos and sin ((b or 1, seq, head_dim),
    each half repeated: the neox layout): row i of the table is token i's cos and sin halves,
    in float32."""
    b, s, d = cos.shape
    half = d // 2
    table = torch.cat((cos[..., :half], sin[..., :half]), -1).reshape(b * s, d).float()
    pos = torch.arange(b * s, device=cos.device).view(b, s)
    return table, (pos if b == batch else pos.expand(batch, s))


def _make_rope(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        if (args or kwargs or unsqueeze_dim != 1 or grad or q.ndim != 4 or cos.ndim != 3
                or not _kernels_run_on(q) or q.dtype not in _FLOATS or k.dtype != q.dtype
                or cos.shape[-1] != q.shape[-1] or cos.shape[0] not in (1, q.shape[0])):
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        table, pos = _rope_table(cos, sin, q.shape[0])
        # (batch, heads, seq, dim) -> tkit's (batch, seq, heads, dim): views both ways
        qr, kr = tkit.rope(q.transpose(1, 2), k.transpose(1, 2), pos, table)
        return qr.transpose(1, 2), kr.transpose(1, 2)

    apply_rotary_pos_emb.tkit_original = original
    return apply_rotary_pos_emb


# ---- attention ---------------------------------------------------------------------------------
def tkit_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           is_causal=None, **kwargs):
    """transformers' attention interface over tkit: ``query`` (batch, heads, q_len, head_dim),
    ``key``/``value`` (batch, kv_heads, kv_len, head_dim) with the cache's keys in front;
    returns ((batch, q_len, heads, head_dim), None). Follows SDPA's rules where no mask is
    given: causal only for more than one query, and a prompt whose keys run past its queries
    (an empty static cache) attends to its own first q_len keys."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len, d = query.shape[2], key.shape[2], query.shape[3]
    window = kwargs.get("sliding_window")
    other = (attention_mask is not None or (dropout and module.training)
             or kwargs.get("position_bias") is not None or kwargs.get("softcap")
             or (window is not None and kv_len > window) or kwargs.get("output_attentions")
             or not _kernels_run_on(query) or query.dtype not in _FLOATS
             or not (key.dtype == value.dtype == query.dtype) or d > 256
             or value.shape[3] != d or query.shape[1] % key.shape[1])
    if other:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and q_len > 1
    q = query.transpose(1, 2)
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    k, v = key.transpose(1, 2), value.transpose(1, 2)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q_len <= DECODE_MAX_Q and not causal and not needs_grad:
        # new tokens over the cache: every cached key is visible to each of them
        lens = _full_lengths(q.shape[0], k.shape[1], q.device)
        out = tkit.decode_attention(q, k, v, lens, softmax_scale=scaling, causal=False)
    else:
        out = tkit.flash_attention(q, k, v, causal=causal, softmax_scale=scaling)
    return out, None


@functools.lru_cache(maxsize=64)
def _full_lengths(batch: int, length: int, device: torch.device) -> torch.Tensor:
    # the lengths of a dense cache without padding, kept a call to the next (no fill a layer)
    return torch.full((batch,), length, dtype=torch.int32, device=device)


def register_attention(name: str = "tkit") -> str:
    """Register :func:`tkit_attention_forward` (with SDPA's mask function) under ``name`` in
    transformers' attention interfaces; ``attn_implementation=name`` then selects it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, tkit_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


# ---- experts (transformers' ExpertsInterface: Mixtral, Qwen-MoE, DeepSeek, ...) ---------------
def tkit_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface over tkit: ``hidden_states`` (tokens, hidden), each
    token's ``top_k_index`` experts and their ``top_k_weights`` -> (tokens, hidden). Gated
    SiLU experts stored [gate; up] as (experts, 2I, hidden) and (experts, hidden, I) go through
    ``tkit.moe_align``, two ``tkit.grouped_matmul``s around ``tkit.silu_mul`` and
    ``tkit.moe_combine``; other layouts (biases, transposed or interleaved weights, a custom
    gate, a post-expert norm, expert parallelism) take transformers' grouped (CUDA) or
    batched implementation."""
    from transformers.integrations import moe as hf_moe

    cfg = getattr(self, "config", None)
    plain = (getattr(self, "has_gate", True) and not getattr(self, "has_bias", False)
             and not getattr(self, "is_transposed", False)
             and getattr(self, "is_concatenated", True)
             and not getattr(self, "has_post_expert_norm", False)
             and not getattr(self, "_is_expert_parallel", False)
             and type(self)._apply_gate is hf_moe._default_apply_gate
             and getattr(cfg, "hidden_act", "silu") in _SILU
             and hidden_states.ndim == 2 and _kernels_run_on(hidden_states)
             and hidden_states.dtype in _FLOATS
             and self.gate_up_proj.dtype == self.down_proj.dtype == hidden_states.dtype)
    if not plain:
        other = (hf_moe.grouped_mm_experts_forward if hidden_states.is_cuda
                 else hf_moe.batched_mm_experts_forward)
        return other(self, hidden_states, top_k_index, top_k_weights)
    from tkit.kernels.moe import moe_experts

    return moe_experts(hidden_states, top_k_weights, top_k_index, self.gate_up_proj,
                       self.down_proj)


def register_experts(name: str = "tkit") -> str:
    """Register :func:`tkit_experts_forward` under ``name`` in transformers' experts interface;
    ``experts_implementation=name`` (``from_pretrained``) or ``set_experts_implementation``
    selects it."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, tkit_experts_forward)
    return name


def apply_tkit_experts(model):
    """Run the experts of an HF mixture-of-experts model (any whose experts class carries
    transformers' ``@use_experts_implementation``) through tkit. Returns ``model``."""
    model.set_experts_implementation(register_experts())
    return model


# ---- the entry points -------------------------------------------------------------------------
def apply_tkit(model=None, *, family: str | None = None, rope: bool = True,
               rms_norm: bool = True, swiglu: bool = True, attention: bool = True,
               experts: bool = True):
    """Put tkit's ops into a transformers decoder of one of :data:`FAMILIES`.

    With ``model`` (``...ForCausalLM`` or its base model; the family from its
    ``config.model_type`` unless ``family`` says it), its own RMSNorm and MLP modules are
    patched, and its attention (and, for MoE families, experts) implementation set to
    ``"tkit"``; without it, the ``family``'s RMSNorm and MLP classes are (every model, built
    before or after), and ``attn_implementation="tkit"`` (``experts_implementation="tkit"``)
    is the caller's to pass to ``from_pretrained``. RoPE is patched in the family's modeling
    module either way (transformers calls it as a module-level function). Returns ``model``."""
    name = family or (model.config.model_type if model is not None else None)
    if name is None:
        raise ValueError("family is required without a model")
    m, norm_cls, mlp_cls = _family(name)
    if rope and not hasattr(m.apply_rotary_pos_emb, "tkit_original"):
        m.apply_rotary_pos_emb = _make_rope(m.apply_rotary_pos_emb)
    if attention:
        register_attention()
    moe = name in ("mixtral", "qwen3_moe") or (model is not None and any(
        hasattr(mod, "gate_up_proj") for mod in model.modules()))
    if experts and moe:
        register_experts()
    if model is None:
        if rms_norm:
            _patch(norm_cls, _rms_norm_forward)
        if swiglu and mlp_cls is not None:
            _patch(mlp_cls, _mlp_forward)
        return None
    for mod in model.modules():
        if rms_norm and isinstance(mod, norm_cls):
            _patch(mod, _rms_norm_forward)
        elif swiglu and mlp_cls is not None and isinstance(mod, mlp_cls):
            _patch(mod, _mlp_forward)
    if attention:
        model.set_attn_implementation("tkit")
    if experts and moe:
        model.set_experts_implementation("tkit")
    return model


def apply_tkit_to_llama(model=None, *, rope: bool = True, rms_norm: bool = True,
                        swiglu: bool = True, attention: bool = True):
    """:func:`apply_tkit` for the Llama family (``family="llama"``)."""
    return apply_tkit(model, family="llama", rope=rope, rms_norm=rms_norm, swiglu=swiglu,
                      attention=attention, experts=False)


def remove_tkit(family: str | None = None) -> None:
    """Undo the class and module patches of :func:`apply_tkit` for ``family`` (every family:
    None). Models patched one by one keep theirs; the ``"tkit"`` entries stay registered."""
    for name in ([family] if family else list(FAMILIES)):
        try:
            m, norm_cls, mlp_cls = _family(name)
        except ImportError:  # an older transformers without this family
            continue
        original = getattr(m.apply_rotary_pos_emb, "tkit_original", None)
        if original is not None:
            m.apply_rotary_pos_emb = original
        for cls in (norm_cls, mlp_cls):
            if cls is not None and "_tkit_hf_forward" in vars(cls):
                cls.forward = cls._tkit_hf_forward
                del cls._tkit_hf_forward


def remove_tkit_from_llama() -> None:
    """:func:`remove_tkit` for the Llama family."""
    remove_tkit("llama")
