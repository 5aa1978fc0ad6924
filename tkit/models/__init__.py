"""Models built only from tkit ops: decoder layers for a prompt and for a decode step over a
KV cache (dense, or paged in ``tkit.append_kv``'s format); a whole Llama that prefills prompts
and decodes over a paged cache (:class:`tkit.models.paged.LlamaModel`, weights from a Hugging
Face model); and ``tkit.models.hf``, which puts tkit's ops into Hugging Face transformers' Llama
(:func:`tkit.models.hf.apply_tkit_to_llama`).

Nothing in ``tkit.kernels`` imports this package; its functions call the public ops, so that
what a model costs is what those ops cost, plans and registrations included. Their specs (the
torch references, cost models, benchmark cases and baselines) are in ``tkit/specs/model.py``.
"""

from tkit.models.llama import LLAMA3_8B, llama_decode_layer, llama_layer

__all__ = ["LLAMA3_8B", "llama_decode_layer", "llama_layer"]
